"""Naming tables of Tunix's model families: Tunix parameter paths -> the HF tensors vLLM loads.

One :class:`Family` per Tunix model class (chosen by :func:`family_of` from the model's
class): its naming table (:class:`~xreshard.adapters.naming_rules.Rule` s over the
``/``-joined paths of ``nnx.state(model, nnx.Param)``), its HF / vLLM architecture and the
HF ``config.json`` derived from the Tunix ``ModelConfig`` (what vLLM builds the engine from).

Decision record.

* The Llama-style decoders (Qwen2, Qwen3 dense, Llama3) keep heads as a dim in their
  kernels (``[D, N, H]``, ``[N, H, D]``): strided views make HF's ``[N*H, D]`` / ``[D, N*H]``
  of them, so their shards are sent without a copy.
* Gemma (1 and 2), Gemma3: ``q_einsum [N, D, H]``, ``kv_einsum [2, K, D, H]`` and
  ``qkv_einsum [3, N, D, H]`` put the model dim between the head and head-dim dims; HF's
  ``q_proj [N*H, D]`` interleaves heads (stride ``D*H``) with head dims (stride 1), which
  no strided view makes. :class:`HeadsToRows` copies each shard once per refit (the
  transposed shard made contiguous: q/k/v kernels only, about 1/8 of a Gemma's bytes);
  the layout stays exact and nothing is gathered. Rejected: sending one HF row block per
  head (a view each) - N tensors per weight that vLLM's loader does not take.
* Gemma's RMSNorm stores ``w`` and scales by ``1 + w`` at run time; HF's and vLLM's Gemma
  norms do the same, so the scales move unchanged (no ``+1`` on the way). The embedding is
  tied (Tunix decodes with ``input_embedding.T``) and scaled by ``sqrt(D)`` in all three.
* Gemma4 (text; HF and vLLM ``Gemma4ForCausalLM``): the Gemma3 attention kernels plus
  per-layer input embeddings (``[V, L, P]`` and ``[D, L, P]``: reshapes, views), ``k_eq_v``
  global layers (``k_einsum`` only: HF ships ``k_proj`` and vLLM loads it into both K and V),
  partial RoPE (HF's ``proportional``), MoE (stacked experts onto HF's stacked
  ``experts.gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``, views; vLLM's loader takes
  them as they are). KV-shared layers keep K/V kernels in Tunix's tree that nothing reads;
  HF and vLLM have none: :class:`Unused` maps them to nothing, so they are never sent. A
  config whose computation HF or vLLM cannot express (a different
  KV-sharing origin, a MLP width HF cannot state, scaled partial RoPE, ...) is refused
  naming the field, before the engine starts (:mod:`~xreshard.integrations.tunix_gemma4`).
  Tunix 0.1.7's MoE router reads
  ``RMSNorm(moe_pre_ffw_norm(x))`` where HF's and vLLM's read ``RMSNorm(x)``: the same
  routing only while that scale is uniform. The weights move exactly; HF's config is
  written with a warning (refusing would leave a Tunix Gemma4 MoE with no vLLM rollout,
  and no table can make one function the other).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from xreshard.adapters.naming_rules import (Index, NamingError, Reshape, Rule, Split,
                                            Transform, Transpose)
from xreshard.errors import RefitError

__all__ = ["TunixNamingError", "Family", "FAMILIES", "UNMAPPED", "HeadsToRows", "Unused", "Copies",
           "Refused",
           "family_of",
           "tunix_rules", "tunix_lora_rules", "hf_config_of", "write_model_dir", "check_names"]


class TunixNamingError(RefitError):
    """A Tunix model that no naming table maps: the model class is not one of
    :data:`FAMILIES`, or a parameter path is not in its family's table."""


# ---------------------------------------------------------------------------- naming

L = "model.layers.{l}"
_T = (Transpose(),)
_HEADS_IN = (Reshape(("@0", -1)), Transpose())        # [D, N, H] -> [D, N*H] -> [N*H, D]
_HEADS_OUT = (Reshape((-1, "@2")), Transpose())       # [N, H, D] -> [N*H, D] -> [D, N*H]


def _dense_rules(*, qkv_bias: bool, qk_norm: bool, tied: bool) -> tuple[Rule, ...]:
    """Tunix's Llama-style decoder (Qwen2, Qwen3 dense, Llama3) as HF tensors.

    Tunix paths (``nnx.state(model).to_pure_dict()``, ``/``-joined)::

        # tunix path                          | shape       | HF tensor (P = model.layers.{l})
        # embedder/input_embedding            | [V, D]      | model.embed_tokens.weight
        # layers/{l}/attn/{q,k,v}_proj/w      | [D, N|K, H] | P.self_attn.{q,k,v}_proj.weight
        # layers/{l}/attn/o_proj/w            | [N, H, D]   | P.self_attn.o_proj.weight
        # layers/{l}/attn/{q,k,v}_bias        | [N*H|K*H]   | P.self_attn.{q,k,v}_proj.bias
        # layers/{l}/attn/{q,k}_norm/w        | [H]         | P.self_attn.{q,k}_norm.weight
        # layers/{l}/mlp/{gate,up,down}_proj/kernel | [in, out] | P.mlp.{...}_proj.weight (T)
        # layers/{l}/{input,post_attention}_layernorm/w | [D] | P.{...}_layernorm.weight
        # final_norm/w                        | [D]         | model.norm.weight
        # lm_head/w                           | [D, V]      | lm_head.weight (T; not if tied)
    """
    rules = [
        Rule("embedder/input_embedding", "model.embed_tokens.weight"),
        Rule("layers/{l}/attn/{p:[qkv]}_proj/w", L + ".self_attn.{p}_proj.weight", _HEADS_IN),
        Rule("layers/{l}/attn/o_proj/w", L + ".self_attn.o_proj.weight", _HEADS_OUT),
        Rule("layers/{l}/mlp/{p:gate|up|down}_proj/kernel", L + ".mlp.{p}_proj.weight", _T),
        Rule("layers/{l}/{p:input_layernorm|post_attention_layernorm}/w", L + ".{p}.weight"),
        Rule("final_norm/w", "model.norm.weight"),
    ]
    if qkv_bias:
        rules.append(Rule("layers/{l}/attn/{p:[qkv]}_bias", L + ".self_attn.{p}_proj.bias"))
    if qk_norm:
        rules.append(Rule("layers/{l}/attn/{p:[qk]}_norm/w", L + ".self_attn.{p}_norm.weight"))
    if not tied:
        rules.append(Rule("lm_head/w", "lm_head.weight", _T))
    return tuple(rules)


@dataclass(frozen=True)
class Family:
    """One Tunix model family: its naming table and HF config, from the model's config.

    Attributes:
        name: the Tunix model class's name (``Qwen2``).
        module: the Tunix module defining it (``tunix.models.qwen2.model``).
        architecture: the HF / vLLM architecture (``Qwen2ForCausalLM``); ``hf_config``
            may name another (Tunix's one ``Gemma`` class is HF's Gemma or Gemma2).
        hf_config: Tunix ``ModelConfig`` -> the HF config's fields.
        rules: Tunix ``ModelConfig`` -> the naming table.
        lora: whether :func:`tunix_lora_rules` maps qwix's factors of this family.
    """

    name: str
    module: str
    architecture: str
    hf_config: Callable[[Any], dict[str, Any]]
    rules: Callable[[Any], tuple[Rule, ...]]
    lora: bool = True


def _tied(c: Any) -> bool:
    # Qwen2/Qwen3 call it use_tied_embedding, Llama3 weight_tying
    return bool(getattr(c, "use_tied_embedding", False) or getattr(c, "weight_tying", False))


def _common_hf(c: Any) -> dict[str, Any]:
    return {"vocab_size": c.vocab_size, "hidden_size": c.embed_dim,
            "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": float(c.norm_eps),
            "rope_theta": float(c.rope_theta), "tie_word_embeddings": _tied(c),
            "max_position_embeddings": 4096, "torch_dtype": "float32"}


def _qwen2_hf(c: Any) -> dict[str, Any]:
    if c.num_heads * c.head_dim != c.embed_dim:
        # HF's (and vLLM's) Qwen2 derive head_dim = hidden_size // num_attention_heads
        raise TunixNamingError(f"Tunix Qwen2 with num_heads*head_dim = {c.num_heads}*"
                               f"{c.head_dim} != embed_dim {c.embed_dim}: HF's Qwen2 has no "
                               "head_dim of its own; vLLM would build other shapes")
    return {**_common_hf(c), "model_type": "qwen2", "use_sliding_window": False}


def _qwen3_hf(c: Any) -> dict[str, Any]:
    if getattr(c, "num_experts", None):
        raise TunixNamingError("Tunix Qwen3 MoE (num_experts set): the MoE table is not "
                               "built yet; dense Qwen3 only")
    # Tunix 0.1.7's Qwen3 attention calls apply_rope without the config's rope_theta, so it
    # always rotates with its default base 1e6 (every released Qwen3's): the engine must too
    return {**_common_hf(c), "model_type": "qwen3", "rope_theta": 1_000_000.0}


def _llama3_hf(c: Any) -> dict[str, Any]:
    # Tunix's Llama3 applies plain RoPE (no llama3 rope_scaling), and like its Qwen3 calls
    # apply_rope without the config's rope_theta (0.1.7: the default base 1e6, whatever the
    # config says): the engine must rotate the same way
    return {**_common_hf(c), "model_type": "llama", "attention_bias": False, "mlp_bias": False,
            "rope_theta": 1_000_000.0}


# ---------------------------------------------------------------------------- Gemma

@dataclass(frozen=True)
class HeadsToRows(Transform):
    """Gemma's ``[N, D, H]`` attention kernel -> HF's ``[N*H, D]`` (row ``n*H + h``).

    No strided view makes it (module docstring): a sharded array's layout is permuted and
    merged exactly, and each local shard is copied once (transposed, made contiguous). For a
    whole array (:meth:`~xreshard.adapters.naming.NameMap.apply`: the names, shapes and
    reference views of a table) it yields a :class:`_Copied` view.
    """

    def apply(self, view: Any, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[Any, dict]]:
        from xreshard.adapters.naming import StridedView

        t = view.transpose((0, 2, 1))                     # [N, H, D]
        rows = (t.shape[0] * t.shape[1], t.shape[2])
        if not isinstance(view, StridedView):
            yield t.reshape(rows), {}                     # ShardedView: the shards copy
            return
        try:
            yield t.reshape(rows), {}                     # a view where one exists (N or D 1)
        except NamingError:
            yield _Copied(t, rows, (0,) * len(rows), rows), {}


@dataclass(frozen=True)
class _Copied:
    """``base`` (a strided view) made contiguous, reshaped to ``full``, then the box
    ``starts`` + ``shape`` of that: what :class:`HeadsToRows` makes of a whole array."""

    base: Any
    full: tuple[int, ...]
    starts: tuple[int, ...]
    shape: tuple[int, ...]

    def restrict(self, region: Any) -> _Copied:
        if region.ndim != len(self.shape) or any(b > n for b, n in zip(region.stops, self.shape)):
            raise NamingError(f"region {region} does not fit a view of shape {self.shape}")
        return _Copied(self.base, self.full,
                       tuple(s + a for s, a in zip(self.starts, region.starts)), region.shape)

    def apply(self, array: Any) -> Any:
        import numpy as np

        out = np.ascontiguousarray(self.base.apply(array)).reshape(self.full)
        return out[tuple(slice(s, s + n) for s, n in zip(self.starts, self.shape))]


_QKV = (("q", 1), ("k", 1), ("v", 1))


def _gemma_rules(version: int) -> tuple[Rule, ...]:
    """Tunix's Gemma (``version`` 1 or 2) and Gemma3 as HF tensors.

    Tunix paths (``P = model.layers.{l}``; Gemma3's ``post_attn_norm`` is
    ``post_attention_norm``)::

        # tunix path                        | shape        | HF tensor
        # embedder/input_embedding          | [V, D]       | model.embed_tokens.weight (tied)
        # layers/{l}/attn/q_einsum/w        | [N, D, H]    | P.self_attn.q_proj.weight (copy)
        # layers/{l}/attn/kv_einsum/w       | [2, K, D, H] | P.self_attn.{k,v}_proj.weight (copy)
        # layers/{l}/attn/qkv_einsum/w      | [3, N, D, H] | P.self_attn.{q,k,v}_proj... (copy)
        # layers/{l}/attn/attn_vec_einsum/w | [N, H, D]    | P.self_attn.o_proj.weight [D, N*H]
        # layers/{l}/attn/_query_norm/scale | [H]          | P.self_attn.q_norm.weight (3; k too)
        # layers/{l}/mlp/{gate,up,down}_proj/kernel | [in, out] | P.mlp.{...}_proj.weight (T)
        # layers/{l}/pre_attention_norm/scale | [D]        | P.input_layernorm.weight
        # layers/{l}/pre_ffw_norm/scale     | [D]          | P.post_attention_layernorm (1)
        #                                   |              | P.pre_feedforward_layernorm (2, 3)
        # layers/{l}/post_attn_norm/scale   | [D]          | P.post_attention_layernorm (2, 3)
        # layers/{l}/post_ffw_norm/scale    | [D]          | P.post_feedforward_layernorm (2, 3)
        # final_norm/scale                  | [D]          | model.norm.weight

    (``qkv_einsum`` where ``N == K``, else ``q_einsum`` and ``kv_einsum``; norms end in
    ``.weight``; (1), (2), (3): only in Gemma 1, Gemma2, Gemma3.)
    """
    one = (Index(0, 0), HeadsToRows())
    rules = [
        Rule("embedder/input_embedding", "model.embed_tokens.weight"),
        Rule("layers/{l}/attn/q_einsum/w", L + ".self_attn.q_proj.weight", (HeadsToRows(),)),
        Rule("layers/{l}/attn/kv_einsum/w", L + ".self_attn.{p}_proj.weight",
             (Split(0, "p", _QKV[1:]), *one)),
        Rule("layers/{l}/attn/qkv_einsum/w", L + ".self_attn.{p}_proj.weight",
             (Split(0, "p", _QKV), *one)),
        Rule("layers/{l}/attn/attn_vec_einsum/w", L + ".self_attn.o_proj.weight", _HEADS_OUT),
        Rule("layers/{l}/mlp/{p:gate|up|down}_proj/kernel", L + ".mlp.{p}_proj.weight", _T),
        Rule("layers/{l}/pre_attention_norm/scale", L + ".input_layernorm.weight"),
        Rule("final_norm/scale", "model.norm.weight"),
    ]
    if version == 1:        # HF's Gemma calls the pre-FFW norm post_attention_layernorm
        rules.append(Rule("layers/{l}/pre_ffw_norm/scale", L + ".post_attention_layernorm.weight"))
        return tuple(rules)
    post_attn = "post_attn_norm" if version == 2 else "post_attention_norm"
    rules += [
        Rule(f"layers/{{l}}/{post_attn}/scale", L + ".post_attention_layernorm.weight"),
        Rule("layers/{l}/pre_ffw_norm/scale", L + ".pre_feedforward_layernorm.weight"),
        Rule("layers/{l}/post_ffw_norm/scale", L + ".post_feedforward_layernorm.weight"),
    ]
    if version == 3:
        rules += [Rule("layers/{l}/attn/_query_norm/scale", L + ".self_attn.q_norm.weight"),
                  Rule("layers/{l}/attn/_key_norm/scale", L + ".self_attn.k_norm.weight")]
    return tuple(rules)


def _gemma_version(c: Any) -> int:
    """1 (HF ``GemmaForCausalLM``) or 2 (``Gemma2ForCausalLM``): Tunix's one ``Gemma``
    class runs both; the post norms tell them apart."""
    post = (bool(c.use_post_attn_norm), bool(c.use_post_ffw_norm))
    if post == (True, True):
        return 2
    if post == (False, False):
        kinds = {getattr(t, "name", str(t)) for t in c.attention_types}
        if c.final_logit_softcap is None and c.attn_logits_soft_cap is None \
                and kinds <= {"GLOBAL"}:
            return 1
        raise TunixNamingError("Tunix Gemma without post norms but with softcaps or sliding "
                               f"layers ({sorted(kinds)}): neither HF's Gemma (no softcaps, "
                               "global attention only) nor Gemma2 (all four norms) computes it")
    raise TunixNamingError(f"Tunix Gemma with use_post_attn_norm={post[0]}, use_post_ffw_norm="
                           f"{post[1]}: HF's Gemma has neither, Gemma2 both")


def _gemma_common(c: Any, dtype: str) -> dict[str, Any]:
    return {"vocab_size": c.num_embed, "hidden_size": c.embed_dim,
            "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": 1e-6,       # Tunix's RMSNorm: fixed 1e-6
            "hidden_activation": "gelu_pytorch_tanh",           # nnx.gelu: tanh approximation
            "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
            "attention_bias": False, "max_position_embeddings": 4096, "torch_dtype": dtype}


def _layer_types(kinds: Sequence[Any]) -> list[str]:
    return ["sliding_attention" if getattr(t, "name", "") == "LOCAL_SLIDING" else
            "full_attention" for t in kinds]


def _gemma_hf(c: Any) -> dict[str, Any]:
    # Tunix's Gemma rotates with base 10000 and scales queries by head_dim**-0.5
    version = _gemma_version(c)
    common = {**_gemma_common(c, "float32"), "rope_theta": 10_000.0}
    if version == 1:
        return {**common, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
    kinds = list(c.attention_types)[:c.num_layers]
    return {**common, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
            "query_pre_attn_scalar": c.head_dim, "layer_types": _layer_types(kinds),
            "sliding_window": c.sliding_window_size or 4096,
            "attn_logit_softcapping": c.attn_logits_soft_cap,
            "final_logit_softcapping": c.final_logit_softcap}


def _gemma3_hf(c: Any) -> dict[str, Any]:
    import itertools

    import numpy as np

    from tunix.models.gemma3 import model as gemma3
    if getattr(c, "vision_config", None) is not None:
        raise TunixNamingError("Tunix Gemma3 with a vision encoder (vision_config set): the "
                               "SigLIP tower is not mapped; text-only Gemma3 only")
    by_head = c.query_pre_attn_norm == \
        gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    kinds = list(itertools.islice(itertools.cycle(gemma3.GEMMA3_ATTENTION_PATTERN),
                                  c.num_layers))

    def rope(base: float, factor: float) -> dict[str, Any]:
        # Tunix divides the positions by the factor: HF's "linear" RoPE
        return ({"rope_type": "default", "rope_theta": float(base)} if factor == 1.0 else
                {"rope_type": "linear", "factor": float(factor), "rope_theta": float(base)})
    return {**_gemma_common(c, np.dtype(c.param_dtype).name), "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "query_pre_attn_scalar": c.head_dim if by_head else c.embed_dim // c.num_heads,
            "layer_types": _layer_types(kinds), "sliding_window": c.sliding_window_size or 4096,
            "rope_parameters": {
                "sliding_attention": rope(c.local_base_frequency, c.local_scale_factor),
                "full_attention": rope(c.global_base_frequency, c.global_scale_factor)},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


# ---------------------------------------------------------------------------- Gemma4

@dataclass(frozen=True)
class Unused(Transform):
    """A Tunix parameter with no HF tensor: it maps to nothing and is never sent.

    Gemma4's KV-shared layers keep ``kv_einsum`` (or ``k_einsum``) and ``_key_norm`` in
    Tunix's tree but never read them (the layer attends with the K/V of its origin layer,
    so they get no gradient either); HF's and vLLM's Gemma4 build no such tensors.
    """

    def apply(self, view: Any, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[Any, dict]]:
        return iter(())


@dataclass(frozen=True)
class Refused(Transform):
    """A Tunix parameter that no engine tensor takes: mapping it raises
    :class:`TunixNamingError` naming the path (``src``, the rule's pattern, filled with the
    match) and ``why``; :func:`check_names` raises the same before any byte moves."""

    src: str
    why: str

    def apply(self, view: Any, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[Any, dict]]:
        import re
        path = re.sub(r"\{(\w+)(?::[^{}]+)?\}", lambda m: str(fields[m.group(1)]), self.src)
        raise TunixNamingError(f"parameter path {path!r}: {self.why}")


def _gemma4() -> Any:
    from . import tunix_gemma4      # imports this module: loaded on first use
    return tunix_gemma4


#: Tunix's model families, by model class name.
FAMILIES: dict[str, Family] = {
    "Qwen2": Family("Qwen2", "tunix.models.qwen2.model", "Qwen2ForCausalLM", _qwen2_hf,
                    lambda c: _dense_rules(qkv_bias=True, qk_norm=False, tied=_tied(c))),
    "Qwen3": Family("Qwen3", "tunix.models.qwen3.model", "Qwen3ForCausalLM", _qwen3_hf,
                    lambda c: _dense_rules(qkv_bias=False, qk_norm=True, tied=_tied(c))),
    "Llama3": Family("Llama3", "tunix.models.llama3.model", "LlamaForCausalLM", _llama3_hf,
                     lambda c: _dense_rules(qkv_bias=False, qk_norm=False, tied=_tied(c))),
    "Gemma": Family("Gemma", "tunix.models.gemma.model", "Gemma2ForCausalLM", _gemma_hf,
                    lambda c: _gemma_rules(_gemma_version(c))),
    "Gemma3": Family("Gemma3", "tunix.models.gemma3.model", "Gemma3ForCausalLM", _gemma3_hf,
                     lambda c: _gemma_rules(3)),
    "Gemma4": Family("Gemma4", "tunix.models.gemma4.model", "Gemma4ForCausalLM",
                     lambda c: _gemma4().gemma4_hf(c), lambda c: _gemma4().gemma4_rules(c)),
}


#: Tunix's model classes with no table yet, and why (their error says so). Empty in Tunix
#: 0.1.7: every model class has a table; what a table cannot express is refused by config
#: (Gemma4: :mod:`~xreshard.integrations.tunix_gemma4`; Qwen3 MoE; Gemma3 vision)
UNMAPPED: dict[str, str] = {}


def family_of(model: Any) -> Family:
    """The :class:`Family` of a Tunix model instance (by class, subclasses included)."""
    for cls in type(model).__mro__:
        fam = FAMILIES.get(cls.__name__)
        if fam is not None and cls.__module__ == fam.module:
            return fam
        why = UNMAPPED.get(f"{cls.__module__}.{cls.__name__}")
        if why is not None:
            raise TunixNamingError(f"no xreshard naming table for Tunix's {cls.__name__} yet: "
                                   f"{why} (pass rules=... with a table of your own)")
    raise TunixNamingError(f"no xreshard naming table for Tunix model class "
                           f"{type(model).__module__}.{type(model).__name__}; tables exist "
                           f"for {', '.join(f.module + '.' + n for n, f in FAMILIES.items())} "
                           "(pass rules=... for another model)")


def tunix_rules(model: Any) -> tuple[Rule, ...]:
    """The naming table of a Tunix model (Qwen2, Qwen3 dense, Llama3, Gemma 1/2, Gemma3,
    Gemma4)."""
    return family_of(model).rules(model.config)


def tunix_lora_rules(model: Any, adapter: str) -> tuple[Rule, ...]:
    """The naming table of a Tunix model's qwix LoRA factors, onto the names adapter
    ``adapter``'s PEFT tensors move under in a LoRA refit
    (``<adapter>/base_model.model.<module>.lora_A.weight``).

    qwix names a factor after the weight it adapts (``<weight>_lora_a``, ``_lora_b``) and
    keeps the weight's non-contracted dims::

        # tunix path                          | shape       | PEFT tensor (P = ...model.layers.{l})
        # layers/{l}/attn/{q,k,v}_proj/w_lora_a | [D, r]    | P.self_attn.{q,k,v}_proj.lora_A (T)
        # layers/{l}/attn/{q,k,v}_proj/w_lora_b | [r, N, H] | P.self_attn.{...}.lora_B [N*H, r]
        # layers/{l}/attn/o_proj/w_lora_a       | [N, H, r] | P.self_attn.o_proj.lora_A [r, N*H]
        # layers/{l}/attn/o_proj/w_lora_b       | [r, D]    | P.self_attn.o_proj.lora_B (T)
        # layers/{l}/mlp/{p}_proj/kernel_lora_a | [in, r]  | P.mlp.{p}_proj.lora_A (T)
        # layers/{l}/mlp/{p}_proj/kernel_lora_b | [r, out] | P.mlp.{p}_proj.lora_B (T)

    Gemma (1, 2) and Gemma3: the MLP likewise, the attention einsums by
    :func:`_gemma_lora_rules`; Gemma4 by
    :func:`~xreshard.integrations.tunix_gemma4.gemma4_lora_rules` (a ``k_eq_v`` layer's K
    factors also as its ``v_proj``'s, the per-layer projections; MoE refused).
    """
    from xreshard.adapters.lora import PEFT_PREFIX

    fam = family_of(model)      # the dense families share these paths
    if not fam.lora:
        raise TunixNamingError(f"no LoRA naming table for Tunix's {fam.name} yet; LoRA on "
                               + ", ".join(n for n, f in FAMILIES.items() if f.lora))
    if not adapter or any(c in adapter for c in "/{}"):
        raise TunixNamingError(f"LoRA adapter name {adapter!r}: non-empty, without '/', "
                               "'{' or '}'")
    p = f"{adapter}/{PEFT_PREFIX}{L}"
    a, b = "lora_A.weight", "lora_B.weight"
    mlp = tuple(Rule(f"layers/{{l}}/mlp/{{p:gate|up|down}}_proj/kernel_lora_{x}",
                     f"{p}.mlp.{{p}}_proj.lora_{x.upper()}.weight", _T) for x in "ab")
    if fam.name in ("Gemma", "Gemma3"):
        return _gemma_lora_rules(p) + mlp
    if fam.name == "Gemma4":
        return _gemma4().gemma4_lora_rules(model.config, f"{adapter}/{PEFT_PREFIX}") + mlp
    return (
        Rule("layers/{l}/attn/{p:[qkv]}_proj/w_lora_a", f"{p}.self_attn.{{p}}_proj.{a}", _T),
        Rule("layers/{l}/attn/{p:[qkv]}_proj/w_lora_b", f"{p}.self_attn.{{p}}_proj.{b}",
             _HEADS_IN),
        Rule("layers/{l}/attn/o_proj/w_lora_a", f"{p}.self_attn.o_proj.{a}", _HEADS_OUT),
        Rule("layers/{l}/attn/o_proj/w_lora_b", f"{p}.self_attn.o_proj.{b}", _T),
        *mlp,
    )


@dataclass(frozen=True)
class Copies(Transform):
    """The same view under each of ``values`` of field ``name``: one factor that several HF
    tensors hold (qwix's ``A`` of a fused ``kv_einsum`` is k's and v's ``lora_A``)."""

    name: str
    values: tuple[str, ...]

    def apply(self, view: Any, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[Any, dict]]:
        for v in self.values:
            yield view, {self.name: v}


def _gemma_lora_rules(prefix: str) -> tuple[Rule, ...]:
    """qwix's factors of Gemma's (1, 2, 3) attention einsums as PEFT tensors. qwix gives
    an einsum's weight ``A`` over its contracted dims and ``B`` over the rest::

        # tunix path (P = prefix.self_attn)      | shape         | PEFT tensor
        # layers/{l}/attn/q_einsum/w_lora_a      | [D, r]        | P.q_proj.lora_A (T)
        # layers/{l}/attn/q_einsum/w_lora_b      | [r, N, H]     | P.q_proj.lora_B [N*H, r]
        # layers/{l}/attn/kv_einsum/w_lora_a     | [D, r]        | P.{k,v}_proj.lora_A (T, both)
        # layers/{l}/attn/kv_einsum/w_lora_b     | [r, 2, K, H]  | P.{k,v}_proj.lora_B [K*H, r]
        # layers/{l}/attn/qkv_einsum/w_lora_{a,b} | [D, r], [r, 3, N, H] | q, k, v likewise
        # layers/{l}/attn/attn_vec_einsum/w_lora_a | [N, H, r]   | P.o_proj.lora_A [r, N*H]
        # layers/{l}/attn/attn_vec_einsum/w_lora_b | [r, D]      | P.o_proj.lora_B (T)

    All views of the shards (heads stay a dim in ``B``; no copy, unlike the base kernels).
    """
    p = f"{prefix}.self_attn"
    a, b = "lora_A.weight", "lora_B.weight"
    rules = [Rule("layers/{l}/attn/q_einsum/w_lora_a", f"{p}.q_proj.{a}", _T),
             Rule("layers/{l}/attn/q_einsum/w_lora_b", f"{p}.q_proj.{b}", _HEADS_IN),
             Rule("layers/{l}/attn/attn_vec_einsum/w_lora_a", f"{p}.o_proj.{a}", _HEADS_OUT),
             Rule("layers/{l}/attn/attn_vec_einsum/w_lora_b", f"{p}.o_proj.{b}", _T)]
    for fused, parts in (("kv", _QKV[1:]), ("qkv", _QKV)):
        rules += [Rule(f"layers/{{l}}/attn/{fused}_einsum/w_lora_a", f"{p}.{{p}}_proj.{a}",
                       (Copies("p", tuple(n for n, _ in parts)), Transpose())),
                  Rule(f"layers/{{l}}/attn/{fused}_einsum/w_lora_b", f"{p}.{{p}}_proj.{b}",
                       (Split(1, "p", parts), Index(1, 0), *_HEADS_IN))]
    return tuple(rules)


def hf_config_of(model: Any) -> dict[str, Any]:
    """The HF ``config.json`` fields of a Tunix model (what vLLM builds the engine from)."""
    fam = family_of(model)
    return {"architectures": [fam.architecture], **fam.hf_config(model.config)}


def write_model_dir(model: Any, path: str, overrides: Mapping[str, Any] | None = None) -> str:
    """Write ``config.json`` of a Tunix model into ``path`` (no weights: the engine starts
    with ``load_format="dummy"`` and gets the trainer's weights by refit)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config_of(model), **dict(overrides or {})}, f, indent=1)
    return path


def check_names(rules: Sequence[Any], names: Sequence[str], model_name: str) -> None:
    """Raise :class:`TunixNamingError` naming the first path no rule maps."""
    for name in names:
        for r in rules:
            refused = [t for t in getattr(r, "transforms", ()) if isinstance(t, Refused)]
            if refused and r.match(name) is not None:
                raise TunixNamingError(f"{model_name}: parameter path {name!r}: "
                                       f"{refused[0].why}")
        if not any(r.match(name) is not None for r in rules):
            raise TunixNamingError(f"{model_name}: parameter path {name!r} matches no rule of "
                                   f"its naming table ({len(names)} paths; the table maps "
                                   f"{', '.join(r.src for r in rules)}); pass rules=... with a "
                                   "rule for it")


