"""Tunix's Gemma4 (text) as HF tensors and an HF config: the Gemma4 family of
:mod:`~xreshard.integrations.tunix_tables` (loaded on first use).

Decision record.

* What HF's and vLLM's ``Gemma4ForCausalLM`` compute is the reference: a Tunix config they
  would compute differently is refused naming the field (:func:`gemma4_checks`), before
  an engine starts; the rest maps exactly (logits equal transformers', tests).
* KV sharing: Tunix's layer ``i >= n`` reads layer ``n-1`` (global) or ``n-2`` (sliding);
  HF and vLLM read the last layer of the same type among the first ``n``. Equal for the
  released patterns (E2B, E4B); checked per config.
* Tunix's KV-shared layers keep K/V kernels nothing reads (no gradient either); HF and vLLM
  build none. :class:`~xreshard.integrations.tunix_tables.Unused` maps them to nothing.
* MoE: Tunix 0.1.7's router reads ``RMSNorm(moe_pre_ffw_norm(x))``, HF's and vLLM's
  ``RMSNorm(x)``: one routing only while that norm's scale is uniform. No table makes one
  function the other; refusing would leave a Tunix Gemma4 MoE with no vLLM rollout, so the
  config is written with a warning and the weights move exactly.
* Partial RoPE is HF's ``proportional`` (Tunix pads the frequencies with ``1/inf``: the
  same zero frequencies); vLLM's proportional RoPE ignores a scale factor (HF's divides by
  it), so a factor on a partial-RoPE layer is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from xreshard.adapters.naming_rules import Index, Reshape, Rule, Split, Transpose

from .tunix_tables import HeadsToRows, L, TunixNamingError, Unused

logger = logging.getLogger(__name__)

_T = (Transpose(),)
_HEADS_OUT = (Reshape((-1, "@2")), Transpose())       # [N, H, D] -> [N*H, D] -> [D, N*H]
_KV = (("k", 1), ("v", 1))

__all__ = ["gemma4_rules", "gemma4_hf", "gemma4_checks"]


def _gemma4_layers(c: Any) -> tuple[list[Any], int]:
    """The attention type of each layer and how many lead layers own their K/V (Tunix's
    ``create_kv_cache_sharing_patterns``: the rest read an earlier layer's)."""
    from tunix.models.gemma4 import model as gemma4
    pattern = c.attention_pattern or gemma4.GEMMA4_ATTENTION_PATTERN
    kinds = [pattern[i % len(pattern)] for i in range(c.num_layers)]
    return kinds, int(c.num_layers - c.frac_shared_layers * c.num_layers)


def gemma4_rules(c: Any) -> tuple[Rule, ...]:
    """Tunix's Gemma4 (text) as HF tensors (``P = model.layers.{l}``; O: layers that own
    their K/V, S: KV-shared layers)::

        # tunix path                          | shape        | HF tensor
        # embedder/input_embedding            | [V, D]       | model.embed_tokens.weight (tied)
        # embedder/per_layer_input_embedding  | [V, L, P]    | model.embed_tokens_per_layer [V, L*P]
        # embedder/per_layer_model_projection/w | [D, L, P]  | model.per_layer_model_projection
        #                                     |              |     [L*P, D]
        # embedder/per_layer_projection_norm/scale | [P]     | model.per_layer_projection_norm
        # layers/{l}/attn/q_einsum/w          | [N, D, H]    | P.self_attn.q_proj [N*H, D] (copy)
        # layers/{O}/attn/kv_einsum/w         | [2, K, D, H] | P.self_attn.{k,v}_proj (copy)
        # layers/{O}/attn/k_einsum/w          | [K, D, H]    | P.self_attn.k_proj (k_eq_v: V = K)
        # layers/{S}/attn/{kv,k}_einsum/w, _key_norm/scale | | none (unread; not sent)
        # layers/{l}/attn/attn_vec_einsum/w   | [N, H, D]    | P.self_attn.o_proj [D, N*H]
        # layers/{l}/attn/_query_norm/scale   | [H]          | P.self_attn.q_norm (k_norm: O)
        # layers/{l}/mlp/{gate,up,down}_proj/kernel | [in, out] | P.mlp.{...}_proj (T)
        # layers/{l}/{pre_attention,post_attention,pre_ffw,post_ffw}_norm/scale | [D] |
        #     P.{input,post_attention,pre_feedforward,post_feedforward}_layernorm
        # layers/{l}/per_layer_input_gate/w   | [D, P]       | P.per_layer_input_gate (T)
        # layers/{l}/per_layer_projection/w   | [P, D]       | P.per_layer_projection (T)
        # layers/{l}/post_per_layer_input_norm/scale | [D]   | P.post_per_layer_input_norm
        # layers/{l}/skip_scale               | [1]          | P.layer_scalar
        # layers/{l}/moe/router_logits        | [D, E]       | P.router.proj.weight (T)
        # layers/{l}/moe/router_scale         | [D]          | P.router.scale
        # layers/{l}/moe/per_expert_scale     | [E]          | P.router.per_expert_scale
        # layers/{l}/moe/gating_einsum        | [E, 2, F, D] | P.experts.gate_up_proj [E, 2F, D]
        # layers/{l}/moe/linear               | [E, F, D]    | P.experts.down_proj [E, D, F]
        # layers/{l}/{moe_pre_ffw,moe_post_ffw,dense_post_ffw}_norm/scale | [D] |
        #     P.{pre_feedforward_layernorm_2,post_feedforward_layernorm_2,_1}
        # final_norm/scale                    | [D]          | model.norm.weight

    Gemma4's norms scale by ``w`` (not ``1 + w``) in all three; the scales move unchanged.
    """
    owners = _gemma4_checked(c)[1]
    own = "|".join(str(i) for i in range(owners))
    norms = {"pre_attention_norm": "input_layernorm",
             "post_attention_norm": "post_attention_layernorm",
             "pre_ffw_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
    rules = [
        Rule("embedder/input_embedding", "model.embed_tokens.weight"),
        Rule("layers/{l}/attn/q_einsum/w", L + ".self_attn.q_proj.weight", (HeadsToRows(),)),
        Rule(f"layers/{{l:{own}}}/attn/kv_einsum/w", L + ".self_attn.{p}_proj.weight",
             (Split(0, "p", _KV), Index(0, 0), HeadsToRows())),
        Rule(f"layers/{{l:{own}}}/attn/k_einsum/w", L + ".self_attn.k_proj.weight",
             (HeadsToRows(),)),
        Rule(f"layers/{{l:{own}}}/attn/_key_norm/scale", L + ".self_attn.k_norm.weight"),
        Rule("layers/{l}/attn/_query_norm/scale", L + ".self_attn.q_norm.weight"),
        Rule("layers/{l}/attn/attn_vec_einsum/w", L + ".self_attn.o_proj.weight", _HEADS_OUT),
        Rule("layers/{l}/mlp/{p:gate|up|down}_proj/kernel", L + ".mlp.{p}_proj.weight", _T),
        *(Rule(f"layers/{{l}}/{t}/scale", f"{L}.{h}.weight") for t, h in norms.items()),
        Rule("layers/{l}/skip_scale", L + ".layer_scalar"),
        Rule("final_norm/scale", "model.norm.weight"),
    ]
    if owners < c.num_layers:
        shared = "|".join(str(i) for i in range(owners, c.num_layers))
        rules.append(Rule(f"layers/{{l:{shared}}}/attn/{{p:kv_einsum/w|k_einsum/w|"
                          "_key_norm/scale}", "", (Unused(),)))
    if c.per_layer_input_dim > 0:
        rules += [
            Rule("embedder/per_layer_input_embedding", "model.embed_tokens_per_layer.weight",
                 (Reshape(("@0", -1)),)),
            Rule("embedder/per_layer_model_projection/w",
                 "model.per_layer_model_projection.weight", (Reshape(("@0", -1)), Transpose())),
            Rule("embedder/per_layer_projection_norm/scale",
                 "model.per_layer_projection_norm.weight"),
            Rule("layers/{l}/{p:per_layer_input_gate|per_layer_projection}/w",
                 L + ".{p}.weight", _T),
            Rule("layers/{l}/post_per_layer_input_norm/scale",
                 L + ".post_per_layer_input_norm.weight"),
        ]
    if c.enable_moe:
        moe_norms = {"moe_pre_ffw_norm": "pre_feedforward_layernorm_2",
                     "moe_post_ffw_norm": "post_feedforward_layernorm_2",
                     "dense_post_ffw_norm": "post_feedforward_layernorm_1"}
        rules += [
            Rule("layers/{l}/moe/router_logits", L + ".router.proj.weight", _T),
            Rule("layers/{l}/moe/router_scale", L + ".router.scale"),
            Rule("layers/{l}/moe/per_expert_scale", L + ".router.per_expert_scale"),
            Rule("layers/{l}/moe/gating_einsum", L + ".experts.gate_up_proj",
                 (Reshape(("@0", -1, "@3")),)),
            Rule("layers/{l}/moe/linear", L + ".experts.down_proj", (Transpose((0, 2, 1)),)),
            *(Rule(f"layers/{{l}}/{t}/scale", f"{L}.{h}.weight") for t, h in moe_norms.items()),
        ]
    return tuple(rules)


def _gemma4_rope(base: float, factor: float, proportion: float) -> dict[str, Any]:
    if proportion == 1.0:       # Tunix divides the positions by the factor: HF's "linear"
        return ({"rope_type": "default", "rope_theta": float(base)} if factor == 1.0 else
                {"rope_type": "linear", "factor": float(factor), "rope_theta": float(base)})
    return {"rope_type": "proportional", "partial_rotary_factor": float(proportion),
            "rope_theta": float(base)}


def gemma4_checks(c: Any, kinds: list[Any], owners: int) -> list[str]:
    """What HF's and vLLM's Gemma4 cannot compute of a Tunix Gemma4 config (empty: all)."""
    why = []
    if kinds[-1].name != "GLOBAL":
        why.append("the last layer is not global (HF's Gemma4 forces it to full attention)")
    if any(k.name == "LOCAL_SLIDING" for k in kinds) and not c.sliding_window_size:
        why.append("sliding layers without sliding_window_size")
    if c.num_global_kv_heads not in (None, c.num_kv_heads) and not c.k_eq_v_global:
        why.append("num_global_kv_heads without k_eq_v_global (HF's config applies "
                   "num_global_key_value_heads to k_eq_v models only)")
    if owners < c.num_layers:
        for i in range(owners, c.num_layers):     # HF, vLLM: the last owner of the same type
            origin = max((j for j in range(owners) if kinds[j] == kinds[i]), default=None)
            tunix = owners - 1 if kinds[i].name == "GLOBAL" else owners - 2
            if origin != tunix:
                why.append(f"KV-shared layer {i} reads layer {tunix}'s K/V in Tunix, layer "
                           f"{origin}'s in HF and vLLM (the last {kinds[i].name} layer that "
                           "owns its K/V)")
                break
    for kind, factor, proportion in (("sliding", c.local_scale_factor, c.local_rope_proportion),
                                     ("global", c.global_scale_factor, c.global_rope_proportion)):
        if proportion != 1.0 and factor != 1.0:
            why.append(f"{kind} RoPE proportion {proportion} with scale factor {factor} (vLLM's "
                       "proportional RoPE ignores the factor, HF's divides by it)")
    wide = c.override_kv_shared_ffw_hidden
    if wide is not None and owners < c.num_layers and wide != 2 * c.hidden_dim:
        why.append(f"override_kv_shared_ffw_hidden {wide} != 2 * hidden_dim (HF's "
                   "use_double_wide_mlp doubles it)")
    if c.enable_moe and c.moe_dense_hidden_dim not in (None, c.hidden_dim):
        why.append(f"moe_dense_hidden_dim {c.moe_dense_hidden_dim} != hidden_dim (Tunix's "
                   "dense branch is hidden_dim wide whatever it says)")
    return why


def _gemma4_checked(c: Any) -> tuple[list[Any], int]:
    """:func:`_gemma4_layers` of a config HF and vLLM compute, else TunixNamingError."""
    kinds, owners = _gemma4_layers(c)
    why = gemma4_checks(c, kinds, owners)
    if why:
        raise TunixNamingError(f"a Tunix Gemma4 config that HF's and vLLM's Gemma4 do not "
                               f"compute: {'; '.join(why)}")
    return kinds, owners


def gemma4_hf(c: Any) -> dict[str, Any]:
    """HF ``Gemma4TextConfig`` fields (vLLM's ``Gemma4ForCausalLM`` builds from them)."""
    import numpy as np

    kinds, owners = _gemma4_checked(c)
    if c.enable_moe:
        logger.warning(
            "Tunix Gemma4 MoE: Tunix 0.1.7's router reads RMSNorm(moe_pre_ffw_norm(x)), HF's "
            "and vLLM's RMSNorm(x); they route alike only while moe_pre_ffw_norm's scale is "
            "uniform, so the engine samples from HF's Gemma4 with the trainer's exact weights")
    moe = ({"enable_moe_block": True, "num_experts": c.num_experts,
            "top_k_experts": c.num_experts_per_tok, "moe_intermediate_size": c.expert_dim}
           if c.enable_moe else {"enable_moe_block": False})
    global_kv = c.num_global_kv_heads if c.num_global_kv_heads is not None else c.num_kv_heads
    return {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
            "vocab_size": c.num_embed, "hidden_size": c.embed_dim,
            "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "global_head_dim": c.global_key_size or c.head_dim,
            "num_global_key_value_heads": global_kv if c.k_eq_v_global else None,
            "attention_k_eq_v": bool(c.k_eq_v_global), "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
            "attention_bias": False, "max_position_embeddings": 4096,
            "torch_dtype": np.dtype(c.param_dtype).name,
            "layer_types": ["sliding_attention" if k.name == "LOCAL_SLIDING" else
                            "full_attention" for k in kinds],
            "sliding_window": c.sliding_window_size or 4096,
            "final_logit_softcapping": c.final_logit_softcap,
            "hidden_size_per_layer_input": c.per_layer_input_dim,
            "vocab_size_per_layer_input": c.num_embed,
            "num_kv_shared_layers": c.num_layers - owners,
            "use_double_wide_mlp": c.override_kv_shared_ffw_hidden is not None
            and owners < c.num_layers,
            "rope_parameters": {
                "sliding_attention": _gemma4_rope(c.local_base_frequency,
                                                  c.local_scale_factor, c.local_rope_proportion),
                "full_attention": _gemma4_rope(c.global_base_frequency,
                                               c.global_scale_factor, c.global_rope_proportion)},
            **moe}


_PLE_LORA = "embedder/per_layer_model_projection/w_lora_{x:[ab]}"
_PLE_LORA_WHY = ("LoRA on Tunix Gemma4's embedder per_layer_model_projection is refused: "
                 "Tunix scales that einsum's weight by embed_dim**-0.5 and qwix adds its LoRA "
                 "term unscaled, while HF and vLLM scale the whole output (their LoRA "
                 "included) by hidden_size**-0.5, so no view of qwix's factors is the PEFT "
                 "adapter (B would need rescaling by sqrt(embed_dim)); leave it out of "
                 "qwix's module_path")
_MOE_LORA = "layers/{l}/moe/{w:.+}_lora_{x:[ab]}"
_MOE_LORA_WHY = ("LoRA on Tunix Gemma4's MoE block is not mapped (qwix's factors of Tunix's "
                 "stacked expert weights onto vLLM's per-expert LoRA: not built or tested); "
                 "LoRA maps on the attention einsums, the MLP and the per-layer projections")


def gemma4_lora_rules(c: Any, root: str) -> tuple[Rule, ...]:
    """qwix's factors of Tunix's Gemma4 attention einsums and per-layer projections as PEFT
    tensors under ``root`` (``<adapter>/base_model.model.``; the MLP's are the other
    families' rules, :func:`~xreshard.integrations.tunix_tables.tunix_lora_rules`)::

        # tunix path (P = root + model.layers.{l}) | shape       | PEFT tensor
        # layers/{l}/attn/q_einsum/w_lora_{a,b}     | [D, r], [r, N, H] | P.self_attn.q_proj
        # layers/{O}/attn/kv_einsum/w_lora_{a,b}    | [D, r], [r, 2, K, H] | P.self_attn.{k,v}_proj
        # layers/{O}/attn/k_einsum/w_lora_{a,b}     | [D, r], [r, K, H] | P.self_attn.{k,v}_proj
        #                                           |              |   (k_eq_v: both the same)
        # layers/{S}/attn/{kv,k}_einsum/w_lora_*    |              | none (unread; not sent)
        # layers/{l}/attn/attn_vec_einsum/w_lora_{a,b} | [N, H, r], [r, D] | P.self_attn.o_proj
        # layers/{l}/per_layer_input_gate/w_lora_{a,b} | [D, r], [r, P] | P.per_layer_input_gate (T)
        # layers/{l}/per_layer_projection/w_lora_{a,b} | [P, r], [r, D] | P.per_layer_projection (T)
        # embedder/per_layer_model_projection/w_lora_* |           | refused (TunixNamingError)
        # layers/{l}/moe/*_lora_*                   |              | refused (TunixNamingError)

    A ``k_eq_v`` layer's V is its (LoRA-adapted) K projection in Tunix. vLLM loads the base
    ``k_proj`` into both the K and V slots of its ``qkv_proj``, but builds that packed
    module's LoRA from the PEFT modules ``q_proj``, ``k_proj`` and ``v_proj`` by name (a
    missing one: no LoRA on that slot). So ``k_einsum``'s factors are sent as both
    ``k_proj``'s and ``v_proj``'s: the engine's V is then ``(W_k + s B_k A_k) x``, as Tunix's.
    HF's Gemma4 has no ``v_proj`` in those layers (V = K): HF's PEFT skips that module.

    Refused: the embedder's ``per_layer_model_projection`` (Tunix scales that einsum's
    weight by ``embed_dim**-0.5`` inside the module and qwix adds its LoRA term unscaled;
    HF and vLLM scale the whole output, LoRA included, by ``hidden_size**-0.5``: PEFT's
    ``B`` would be qwix's times ``sqrt(D)``, a rescaled copy, not a view of the shard) and
    the MoE block (not mapped).
    """
    from .tunix_tables import Copies, Refused

    owners = _gemma4_checked(c)[1]
    own = "|".join(str(i) for i in range(owners))
    p = f"{root}{L}"
    a, b = "lora_A.weight", "lora_B.weight"
    att = f"{p}.self_attn"
    heads_in = (Reshape(("@0", -1)), Transpose())     # [r, N, H] -> [r, N*H] -> [N*H, r]
    kv = tuple(n for n, _ in _KV)
    rules = [
        Rule("layers/{l}/attn/q_einsum/w_lora_a", f"{att}.q_proj.{a}", _T),
        Rule("layers/{l}/attn/q_einsum/w_lora_b", f"{att}.q_proj.{b}", heads_in),
        Rule("layers/{l}/attn/attn_vec_einsum/w_lora_a", f"{att}.o_proj.{a}", _HEADS_OUT),
        Rule("layers/{l}/attn/attn_vec_einsum/w_lora_b", f"{att}.o_proj.{b}", _T),
        Rule(f"layers/{{l:{own}}}/attn/kv_einsum/w_lora_a", f"{att}.{{p}}_proj.{a}",
             (Copies("p", kv), Transpose())),
        Rule(f"layers/{{l:{own}}}/attn/kv_einsum/w_lora_b", f"{att}.{{p}}_proj.{b}",
             (Split(1, "p", _KV), Index(1, 0), *heads_in)),
        Rule(f"layers/{{l:{own}}}/attn/k_einsum/w_lora_a", f"{att}.{{p}}_proj.{a}",
             (Copies("p", kv), Transpose())),
        Rule(f"layers/{{l:{own}}}/attn/k_einsum/w_lora_b", f"{att}.{{p}}_proj.{b}",
             (Copies("p", kv), *heads_in)),
        *(Rule(f"layers/{{l}}/{{m:per_layer_input_gate|per_layer_projection}}/w_lora_{x}",
               f"{p}.{{m}}.lora_{x.upper()}.weight", _T) for x in "ab"),
        Rule(_PLE_LORA, "", (Refused(_PLE_LORA, _PLE_LORA_WHY),)),
        Rule(_MOE_LORA, "", (Refused(_MOE_LORA, _MOE_LORA_WHY),)),
    ]
    if owners < c.num_layers:
        shared = "|".join(str(i) for i in range(owners, c.num_layers))
        rules.append(Rule(f"layers/{{l:{shared}}}/attn/{{p:kv_einsum|k_einsum}}/w_lora_{{x:[ab]}}",
                          "", (Unused(),)))
    return tuple(rules)
