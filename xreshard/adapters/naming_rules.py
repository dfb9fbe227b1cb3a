"""Naming rules: how trainer names and tensors become canonical (HF) tensors, declared.

A trainer's parameter tree rarely uses HF names or HF orientation: Flax kernels are
``[in, out]``, attention kernels keep heads as a dim (``[embed, heads, head_dim]``), q/k/v or
gate/up may be fused, experts stacked, layers scanned under a leading dim. A :class:`Rule`
says, for trainer names matching a pattern, which HF name template they fill and which
transforms (:class:`Transpose`, :class:`Reshape`, :class:`Index`, :class:`Slice`,
:class:`Unsqueeze`, :class:`Unstack`, :class:`Split`) turn the trainer array into the HF
tensor(s). Patterns use ``{name}`` for a run of digits and ``{name:regex}`` for anything
else; the captured values fill the template. ``Unstack`` and ``Split`` fan one trainer array
out into several HF tensors and bind a new template field. A :class:`ConcatRule` assembles
one HF tensor from several trainer arrays (separate q/k/v into a fused HF ``qkv_proj``,
per-expert arrays into a stacked HF tensor). One short table per model family:
:data:`JAX_LLAMA`, :func:`jax_llama_rules`, :func:`jax_moe_rules`, :data:`HF_IDENTITY`.

This module only declares; :mod:`xreshard.adapters.naming` applies the rules (to whole
arrays as strided views, or to sharded JAX arrays as layouts plus shard views). A transform
works on any *view*: an object with ``shape`` and the view ops ``transpose(perm)``,
``reshape(shape)``, ``index(dim, i)``, ``slice(dim, start, stop)`` and ``unsqueeze(dim)``.
A ``dim`` is a tensor dim (an ``axis`` is a mesh axis).

Canonical JAX tree for Llama/Qwen2-style models (``"/"``-joined pytree paths, see
:func:`~xreshard.adapters.naming.flatten_tree`; ``D`` hidden, ``H``/``KV`` heads, ``hd``
head dim, ``I`` MLP width)::

    # trainer path (l: layer)      | shape       | HF tensor (P = model.layers.{l})  | transform
    # embed/embedding              | [V, D]      | model.embed_tokens.weight [V, D]  | -
    # layers/{l}/attn/q/kernel     | [D, H, hd]  | P.self_attn.q_proj.weight         | [D, H*hd], T
    # layers/{l}/attn/k|v/kernel   | [D, KV, hd] | P.self_attn.k|v_proj.weight       | [D, KV*hd], T
    # layers/{l}/attn/q|k|v/bias   | [H|KV, hd]  | P.self_attn.q|k|v_proj.bias       | [-1]
    # layers/{l}/attn/o/kernel     | [H, hd, D]  | P.self_attn.o_proj.weight         | [H*hd, D], T
    # layers/{l}/mlp/gate|up/kernel| [D, I]      | P.mlp.gate|up_proj.weight [I, D]  | T
    # layers/{l}/mlp/down/kernel   | [I, D]      | P.mlp.down_proj.weight [D, I]     | T
    # layers/{l}/input_norm/scale  | [D]         | P.input_layernorm.weight          | -
    # layers/{l}/post_attn_norm/scale | [D]      | P.post_attention_layernorm.weight | -
    # final_norm/scale             | [D]         | model.norm.weight                 | -
    # lm_head/kernel               | [D, V]      | lm_head.weight [V, D] (not if tied) | T

Scanned trees drop ``/{l}`` and add a leading ``[L, ...]`` dim; fused trees replace
q/k/v with ``attn/qkv/kernel [D, H+2*KV, hd]`` (``attn/qkv/bias [H+2*KV, hd]``) and gate/up
with ``mlp/gate_up/kernel [D, 2*I]``. MoE layers (Qwen-MoE HF names) use
``layers/{l}/moe/router/kernel [D, E]`` and stacked ``moe/{gate,up}/kernel [E, D, I]``,
``moe/down/kernel [E, I, D]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from xreshard.errors import XreshardError

__all__ = [
    "NamingError", "Transform", "Transpose", "Reshape", "Index", "Slice", "Unsqueeze",
    "Unstack", "Split", "Rule", "ConcatRule", "HF_IDENTITY", "JAX_LLAMA", "jax_llama_rules",
    "jax_moe_rules", "hf_stacked_experts_rules",
]


class NamingError(XreshardError):
    """Trainer names that no rule maps, or that map twice, or a transform that cannot apply."""


# ---------------------------------------------------------------------------- transforms

class Transform:
    """A step applied to the views of one trainer array; may fan out into several.

    ``apply`` yields ``(view, new fields)``; ``view`` is any view (module docstring)."""

    def apply(self, view: Any, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[Any, dict]]:
        raise NotImplementedError


def _size(expr: int | str, params: Mapping[str, int], shape: tuple[int, ...]) -> int:
    """An int, a param name, ``"@k"`` (the current size of dim k), or a product of those
    (``"num_heads*head_dim"``)."""
    if isinstance(expr, int):
        return expr
    out = 1
    for tok in str(expr).split("*"):
        tok = tok.strip()
        if tok.lstrip("-").isdigit():
            out *= int(tok)
        elif tok.startswith("@") and tok[1:].isdigit() and int(tok[1:]) < len(shape):
            out *= shape[int(tok[1:])]
        elif tok in params:
            out *= int(params[tok])
        else:
            raise NamingError(f"size {expr!r} names {tok!r}, which is not among the rule "
                              f"params {sorted(params)}; pass it to NameMap(params=...)")
    return out


@dataclass(frozen=True)
class Transpose(Transform):
    """Permute dims (default: reverse them, a Flax ``[in, out]`` kernel -> ``[out, in]``)."""

    perm: tuple[int, ...] | None = None

    def apply(self, view, fields, params):
        yield view.transpose(self.perm), {}


@dataclass(frozen=True)
class Reshape(Transform):
    """Reshape as a view; entries are ints, ``-1``, ``"@k"`` (keep dim k's size) or param
    names / products of them."""

    shape: tuple[int | str, ...]

    def apply(self, view, fields, params):
        yield view.reshape([_size(s, params, view.shape) for s in self.shape]), {}


@dataclass(frozen=True)
class Index(Transform):
    """Select index ``i`` of dim ``dim`` (an int or a captured field name)."""

    dim: int
    i: int | str

    def apply(self, view, fields, params):
        i = int(fields[self.i]) if isinstance(self.i, str) else self.i
        yield view.index(self.dim, i), {}


@dataclass(frozen=True)
class Slice(Transform):
    """Keep ``[start, stop)`` of dim ``dim`` (ints or param expressions)."""

    dim: int
    start: int | str
    stop: int | str

    def apply(self, view, fields, params):
        yield view.slice(self.dim, _size(self.start, params, view.shape),
                         _size(self.stop, params, view.shape)), {}


@dataclass(frozen=True)
class Unsqueeze(Transform):
    """Insert a size-1 dim at ``dim``."""

    dim: int

    def apply(self, view, fields, params):
        yield view.unsqueeze(self.dim), {}


@dataclass(frozen=True)
class Unstack(Transform):
    """Fan out over dim ``dim`` (scanned layers, stacked experts), binding field ``name``."""

    dim: int
    name: str

    def apply(self, view, fields, params):
        for i in range(view.shape[self.dim]):
            yield view.index(self.dim, i), {self.name: i}


@dataclass(frozen=True)
class Split(Transform):
    """Fan out into consecutive slices of dim ``dim`` (fused q/k/v, gate/up).

    ``parts`` is ``((value, size), ...)``: each slice binds field ``name`` to ``value``.
    Sizes are ints or param expressions; the sizes must add up to the dim.
    """

    dim: int
    name: str
    parts: tuple[tuple[str, int | str], ...]

    def apply(self, view, fields, params):
        sizes = [_size(s, params, view.shape) for _, s in self.parts]
        if sum(sizes) != view.shape[self.dim]:
            raise NamingError(f"split of dim {self.dim} (size {view.shape[self.dim]}) into "
                              f"{dict(zip((v for v, _ in self.parts), sizes))} does not add up")
        start = 0
        for (value, _), n in zip(self.parts, sizes):
            yield view.slice(self.dim, start, start + n), {self.name: value}
            start += n


# ---------------------------------------------------------------------------- rules

def _compile(pattern: str) -> re.Pattern:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)(?::([^{}]+))?\}", pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>{m.group(2) or r'[0-9]+'})")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


@dataclass(frozen=True)
class Rule:
    """Trainer names matching ``src`` become the HF tensor(s) ``dst`` through ``transforms``."""

    src: str
    dst: str
    transforms: tuple[Transform, ...] = ()
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", _compile(self.src))

    def match(self, name: str) -> dict | None:
        m = self._regex.fullmatch(name)
        return None if m is None else m.groupdict()


@dataclass(frozen=True, init=False)
class ConcatRule:
    """One HF tensor ``dst`` from several trainer arrays laid side by side.

    ``srcs`` patterns are concatenated in order along HF dim ``dim`` (after ``transforms``,
    applied to each source alone). With ``stack_over`` (a field of the patterns) the
    matched arrays are also stacked along a new leading dim 0 in field order 0..n-1, and
    ``dim`` counts dims after stacking. Example, per-expert HF checkpoints to the stacked
    ``experts.gate_up_proj [E, 2I, H]``: ``srcs=(gate, up)``, ``dim=1``, ``stack_over="e"``.
    """

    srcs: tuple[str, ...]
    dst: str
    dim: int
    transforms: tuple[Transform, ...] = ()
    stack_over: str | None = None
    _regexes: tuple = field(default=(), repr=False, compare=False)

    def __init__(self, srcs: tuple[str, ...], dst: str, dim: int,
                 transforms: tuple[Transform, ...] = (), stack_over: str | None = None) -> None:
        for name, value in (("srcs", srcs), ("dst", dst), ("dim", dim),
                            ("transforms", transforms), ("stack_over", stack_over),
                            ("_regexes", tuple(_compile(s) for s in srcs))):
            object.__setattr__(self, name, value)

    @property
    def src(self) -> str:
        """The source patterns, ``|``-joined (for messages)."""
        return "|".join(self.srcs)

    def match(self, name: str) -> tuple[int, dict] | None:
        for j, rx in enumerate(self._regexes):
            m = rx.fullmatch(name)
            if m is not None:
                return j, m.groupdict()
        return None


# ---------------------------------------------------------------------------- rule tables

#: HF-named torch models (state_dict names are already canonical).
HF_IDENTITY: tuple[Rule, ...] = (Rule("{name:.+}", "{name}"),)

_T = (Transpose(),)

L = "model.layers.{l}"


def _per_layer(scanned: bool, path: str) -> str:
    return f"layers/{path}" if scanned else f"layers/{{l}}/{path}"


def jax_llama_rules(*, scanned: bool = False, fused: bool = False, qkv_bias: bool = False,
                    tied: bool = False) -> tuple[Rule, ...]:
    """The canonical JAX Llama/Qwen2 tree (module docstring) as a rule table.

    The unfused table needs no params; ``fused`` needs ``num_heads``, ``num_kv_heads`` and
    ``intermediate`` in ``NameMap(params=...)`` to split the fused dims.
    """
    pre = (Unstack(0, "l"),) if scanned else ()
    # [D, h, hd] -> [D, h*hd] -> [h*hd, D]
    heads_in = (Reshape(("@0", -1)), Transpose())
    rows: list[tuple[str, str, tuple[Transform, ...]]] = [
        (_per_layer(scanned, "attn/o/kernel"), f"{L}.self_attn.o_proj.weight",   # [H, hd, D]
         (Reshape((-1, "@2")), Transpose())),
        (_per_layer(scanned, "mlp/down/kernel"), f"{L}.mlp.down_proj.weight", _T),
        (_per_layer(scanned, "input_norm/scale"), f"{L}.input_layernorm.weight", ()),
        (_per_layer(scanned, "post_attn_norm/scale"), f"{L}.post_attention_layernorm.weight", ()),
    ]
    if fused:
        rows += [
            (_per_layer(scanned, "attn/qkv/kernel"), f"{L}.self_attn.{{p}}_proj.weight",
             (Split(1, "p", (("q", "num_heads"), ("k", "num_kv_heads"), ("v", "num_kv_heads"))),
              *heads_in)),
            (_per_layer(scanned, "mlp/gate_up/kernel"), f"{L}.mlp.{{p}}_proj.weight",
             (Split(1, "p", (("gate", "intermediate"), ("up", "intermediate"))), *_T)),
        ]
        if qkv_bias:
            rows.append((_per_layer(scanned, "attn/qkv/bias"), f"{L}.self_attn.{{p}}_proj.bias",
                         (Split(0, "p", (("q", "num_heads"), ("k", "num_kv_heads"),
                                         ("v", "num_kv_heads"))), Reshape((-1,)))))
    else:
        rows += [(_per_layer(scanned, f"attn/{p}/kernel"), f"{L}.self_attn.{p}_proj.weight",
                  heads_in) for p in "qkv"]
        rows += [(_per_layer(scanned, f"mlp/{p}/kernel"), f"{L}.mlp.{p}_proj.weight", _T)
                 for p in ("gate", "up")]
        if qkv_bias:
            rows += [(_per_layer(scanned, f"attn/{p}/bias"), f"{L}.self_attn.{p}_proj.bias",
                      (Reshape((-1,)),)) for p in "qkv"]
    rules = [Rule(src, dst, pre + tuple(tr)) for src, dst, tr in rows]
    rules += [Rule("embed/embedding", "model.embed_tokens.weight"),
              Rule("final_norm/scale", "model.norm.weight")]
    if not tied:
        rules.append(Rule("lm_head/kernel", "lm_head.weight", _T))
    return tuple(rules)


#: the plain (per-layer, unfused, untied, no bias) JAX Llama table
JAX_LLAMA: tuple[Rule, ...] = jax_llama_rules()


#: HF names of a MoE block's router and experts (gate, up, down), per checkpoint family
_MOE_HF_NAMES = {
    "qwen": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
             "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}


def jax_moe_rules(*, scanned: bool = False, hf: str = "qwen") -> tuple[Rule, ...]:
    """Stacked-expert JAX MoE blocks -> per-expert HF names; add to a dense table whose tree
    has ``moe/`` instead of ``mlp/``.

    The tree: ``moe/router/kernel [D, E]``, ``moe/{gate,up}/kernel [E, D, I]``,
    ``moe/down/kernel [E, I, D]``. ``hf`` picks the checkpoint family: ``"qwen"``
    (Qwen2/3-MoE: ``mlp.experts.{e}.gate_proj``, ...) or ``"mixtral"``
    (``block_sparse_moe.experts.{e}.w1`` gate, ``w3`` up, ``w2`` down).
    """
    if hf not in _MOE_HF_NAMES:
        raise ValueError(f"hf={hf!r}: expected one of {sorted(_MOE_HF_NAMES)}")
    router, gate, up, down = _MOE_HF_NAMES[hf]
    pre = (Unstack(0, "l"),) if scanned else ()
    experts = pre + (Unstack(0, "e"), Transpose())
    return (
        Rule(_per_layer(scanned, "moe/router/kernel"), f"{L}.{router}", pre + _T),
        Rule(_per_layer(scanned, "moe/gate/kernel"), f"{L}.{gate}", experts),
        Rule(_per_layer(scanned, "moe/up/kernel"), f"{L}.{up}", experts),
        Rule(_per_layer(scanned, "moe/down/kernel"), f"{L}.{down}", experts),
    )


def hf_stacked_experts_rules() -> tuple[ConcatRule, ...]:
    """Per-expert HF checkpoint names -> transformers' stacked ``experts.gate_up_proj
    [E, 2I, H]`` and ``experts.down_proj [E, H, I]``; combine with :data:`HF_IDENTITY`
    only for the other names (the identity rule would match these too)."""
    e = f"{L}.mlp.experts.{{e}}"
    return (
        ConcatRule((f"{e}.gate_proj.weight", f"{e}.up_proj.weight"),
                   f"{L}.mlp.experts.gate_up_proj", dim=1, stack_over="e"),
        ConcatRule((f"{e}.down_proj.weight",), f"{L}.mlp.experts.down_proj", dim=1,
                   stack_over="e"),
    )
