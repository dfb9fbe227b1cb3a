"""Names and transforms from trainer conventions to canonical (HF) tensors, as views.

A trainer's parameter tree rarely uses HF names or HF orientation: Flax kernels are
``[in, out]``, attention kernels keep heads as a dim (``[embed, heads, head_dim]``), q/k/v or
gate/up may be fused, experts stacked, layers scanned under a leading axis. xreshard's
layouts are in canonical coordinates (HF names, torch ``[out, in]``), so each trainer array
is bound to the HF tensor(s) it holds by a :class:`StridedView`: HF element ``(i0, i1, ...)``
is element ``offset + sum(i_k * strides_k)`` of the trainer array in C order. Views are
exact and never copy; a rule that would need a copy (a transpose followed by a merge of
non-adjacent dims) is refused when the table is applied.

Rules are declarative, one short table per model family: a trainer-name pattern, an HF
name template and a list of transforms (:data:`JAX_LLAMA`, :func:`jax_llama_rules`,
:data:`HF_IDENTITY`). Patterns use ``{name}`` for a run of digits and ``{name:regex}`` for
anything else; the captured values fill the template. ``Unstack`` and ``Split`` fan one
trainer array out into several HF tensors and bind a new template field. A
:class:`ConcatRule` assembles one HF tensor from several trainer arrays (separate q/k/v into
a fused HF ``qkv_proj``, per-expert arrays into a stacked HF tensor).

Canonical JAX tree for Llama/Qwen2-style models (``"/"``-joined pytree paths, see
:func:`flatten_tree`; ``D`` hidden, ``H``/``KV`` heads, ``hd`` head dim, ``I`` MLP width)::

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

Scanned trees drop ``/{l}`` and add a leading ``[L, ...]`` axis; fused trees replace
q/k/v with ``attn/qkv/kernel [D, H+2*KV, hd]`` (``attn/qkv/bias [H+2*KV, hd]``) and gate/up
with ``mlp/gate_up/kernel [D, 2*I]``. MoE layers (Qwen-MoE HF names) use
``layers/{l}/moe/router/kernel [D, E]`` and stacked ``moe/{gate,up}/kernel [E, D, I]``,
``moe/down/kernel [E, I, D]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from xreshard.errors import XreshardError
from xreshard.layout import Region

__all__ = [
    "NamingError", "StridedView", "Source", "HFTensor", "NameMap", "Rule", "ConcatRule",
    "Transpose", "Reshape", "Index", "Slice", "Unsqueeze", "Unstack", "Split",
    "HF_IDENTITY", "JAX_LLAMA", "jax_llama_rules", "jax_moe_rules", "hf_stacked_experts_rules",
    "flatten_tree",
]


class NamingError(XreshardError):
    """Trainer names that no rule maps, or that map twice, or a transform that cannot apply."""


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


# ---------------------------------------------------------------------------- views

@dataclass(frozen=True, slots=True)
class StridedView:
    """An HF tensor (or a region of it) as a strided view of one trainer array.

    HF element ``idx`` is the trainer array's C-order flat element
    ``offset + sum(idx[k] * strides[k])``. ``src_shape`` is the trainer array's shape.
    """

    src_shape: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def identity(cls, src_shape: Sequence[int]) -> StridedView:
        shape = tuple(int(n) for n in src_shape)
        return cls(shape, shape, _c_strides(shape), 0)

    # ------------------------------------------------------------ view ops

    def transpose(self, perm: Sequence[int] | None = None) -> StridedView:
        perm = tuple(reversed(range(len(self.shape)))) if perm is None else tuple(perm)
        if sorted(perm) != list(range(len(self.shape))):
            raise NamingError(f"transpose {perm} is not a permutation of {len(self.shape)} dims")
        return StridedView(self.src_shape, tuple(self.shape[p] for p in perm),
                           tuple(self.strides[p] for p in perm), self.offset)

    def reshape(self, new_shape: Sequence[int]) -> StridedView:
        """numpy's no-copy reshape: merge or split dims where the strides allow it."""
        new_shape = list(int(n) for n in new_shape)
        if -1 in new_shape:
            known = math.prod(n for n in new_shape if n != -1)
            new_shape[new_shape.index(-1)] = math.prod(self.shape) // max(known, 1)
        if math.prod(new_shape) != math.prod(self.shape):
            raise NamingError(f"cannot reshape {self.shape} to {tuple(new_shape)}: sizes differ")
        strides = _nocopy_reshape(self.shape, self.strides, new_shape)
        if strides is None:
            raise NamingError(f"reshape of a {self.shape} view with strides {self.strides} to "
                              f"{tuple(new_shape)} would need a copy; reorder the transforms "
                              "(reshape before transposing)")
        return StridedView(self.src_shape, tuple(new_shape), strides, self.offset)

    def index(self, axis: int, i: int) -> StridedView:
        n = self.shape[axis]
        if not 0 <= i < n:
            raise NamingError(f"index {i} out of range for dim {axis} of size {n}")
        return StridedView(self.src_shape, self.shape[:axis] + self.shape[axis + 1:],
                           self.strides[:axis] + self.strides[axis + 1:],
                           self.offset + i * self.strides[axis])

    def slice(self, axis: int, start: int, stop: int) -> StridedView:
        n = self.shape[axis]
        if not 0 <= start <= stop <= n:
            raise NamingError(f"slice [{start}:{stop}) out of range for dim {axis} of size {n}")
        shape = list(self.shape)
        shape[axis] = stop - start
        return StridedView(self.src_shape, tuple(shape), self.strides,
                           self.offset + start * self.strides[axis])

    def unsqueeze(self, axis: int) -> StridedView:
        return StridedView(self.src_shape, self.shape[:axis] + (1,) + self.shape[axis:],
                           self.strides[:axis] + (0,) + self.strides[axis:], self.offset)

    def restrict(self, region: Region) -> StridedView:
        """The view of ``region`` (HF coordinates) of this view."""
        if region.ndim != len(self.shape) or any(
                b > n for b, n in zip(region.stops, self.shape)):
            raise NamingError(f"region {region} does not fit a view of shape {self.shape}")
        offset = self.offset + sum(a * s for a, s in zip(region.starts, self.strides))
        return StridedView(self.src_shape, region.shape, self.strides, offset)

    # ------------------------------------------------------------ reading it

    def apply(self, array: Any) -> np.ndarray:
        """This view of ``array`` (the trainer array, C-contiguous numpy), zero-copy."""
        array = np.asarray(array)
        if tuple(array.shape) != self.src_shape:
            raise NamingError(f"view expects a trainer array of shape {self.src_shape}, got "
                              f"{tuple(array.shape)}")
        if not array.flags.c_contiguous:
            raise NamingError("StridedView.apply needs a C-contiguous array (a strided view of "
                              "a non-contiguous array is not a view of its buffer)")
        flat = array.reshape(-1)
        if math.prod(self.shape) == 0:
            return flat[:0].reshape(self.shape)
        return np.lib.stride_tricks.as_strided(
            flat[self.offset:], shape=self.shape,
            strides=tuple(s * array.itemsize for s in self.strides))

    def index_expr(self) -> tuple[Region, tuple[int, ...]]:
        """``(box, perm)`` with ``trainer[box.slices()].transpose(perm).reshape(self.shape)``
        equal to this view: the trainer-coordinate box it reads and the dim order.

        Raises:
            NamingError: the view is not a (permuted, reshaped) box of the trainer array.
        """
        base, g = self.src_shape, _c_strides(self.src_shape)
        start, rem = [], self.offset
        for k, n in enumerate(base):
            q = rem // g[k] if n > 1 else 0
            start.append(q)
            rem -= q * g[k]
        stop = [s + 1 for s in start]
        owner: dict[int, int] = {}
        for vd, (n, s) in enumerate(zip(self.shape, self.strides)):
            if n == 1:
                continue
            ks = [k for k in range(len(base)) if base[k] > 1 and g[k] == s and k not in owner]
            if not ks:
                raise NamingError(f"view {self} is not a box of the trainer array")
            k = ks[-1]
            while True:
                if k < 0 or k in owner:
                    raise NamingError(f"view {self} is not a box of the trainer array")
                owner[k] = vd
                if n <= base[k] - start[k]:
                    stop[k] = start[k] + n
                    break
                if start[k] or n % base[k]:
                    raise NamingError(f"view {self} is not a box of the trainer array")
                stop[k], n, k = base[k], n // base[k], k - 1
                while k >= 0 and base[k] == 1:
                    k -= 1
        if any(b > n for b, n in zip(stop, base)):
            raise NamingError(f"view {self} reads outside the trainer array {base}")
        # trainer dims in the order the view walks them (dims the view does not walk go first)
        order = sorted(range(len(base)), key=lambda k: (owner.get(k, -1), k))
        return Region(tuple(start), tuple(stop)), tuple(order)

    def __str__(self) -> str:
        return f"view{self.shape}@{self.offset}/{self.strides} of {self.src_shape}"


def _nocopy_reshape(shape: Sequence[int], strides: Sequence[int],
                    new_shape: Sequence[int]) -> tuple[int, ...] | None:
    """numpy's ``_attempt_nocopy_reshape``: strides for ``new_shape`` or None."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    new_strides = [0] * len(new_shape)
    oi = ni = 0
    old_n, new_n = len(old), len(new_shape)
    while oi < old_n and ni < new_n:
        # find the smallest groups old[oi:oj], new[ni:nj] with equal products
        oj, nj = oi + 1, ni + 1
        op, np_ = old[oi][0], new_shape[ni]
        while op != np_:
            if np_ < op:
                np_ *= new_shape[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):           # the old group must be contiguous in itself
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new_strides[k - 1] = new_strides[k] * new_shape[k]
        oi, ni = oj, nj
    # trailing size-1 new dims
    for k in range(ni, new_n):
        new_strides[k] = 1
    return tuple(new_strides)


# ---------------------------------------------------------------------------- transforms

class Transform:
    """A step applied to the views of one trainer array; may fan out into several."""

    def apply(self, view: StridedView, fields: Mapping[str, Any], params: Mapping[str, int]
              ) -> Iterator[tuple[StridedView, dict]]:
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
    """Select index ``i`` of dim ``axis`` (an int or a captured field name)."""

    axis: int
    i: int | str

    def apply(self, view, fields, params):
        i = int(fields[self.i]) if isinstance(self.i, str) else self.i
        yield view.index(self.axis, i), {}


@dataclass(frozen=True)
class Slice(Transform):
    axis: int
    start: int | str
    stop: int | str

    def apply(self, view, fields, params):
        yield view.slice(self.axis, _size(self.start, params, view.shape),
                         _size(self.stop, params, view.shape)), {}


@dataclass(frozen=True)
class Unsqueeze(Transform):
    axis: int

    def apply(self, view, fields, params):
        yield view.unsqueeze(self.axis), {}


@dataclass(frozen=True)
class Unstack(Transform):
    """Fan out over dim ``axis`` (scanned layers, stacked experts), binding field ``name``."""

    axis: int
    name: str

    def apply(self, view, fields, params):
        for i in range(view.shape[self.axis]):
            yield view.index(self.axis, i), {self.name: i}


@dataclass(frozen=True)
class Split(Transform):
    """Fan out into consecutive slices of dim ``axis`` (fused q/k/v, gate/up).

    ``parts`` is ``((value, size), ...)``: each slice binds field ``name`` to ``value``.
    Sizes are ints or param expressions; the sizes must add up to the dim.
    """

    axis: int
    name: str
    parts: tuple[tuple[str, int | str], ...]

    def apply(self, view, fields, params):
        sizes = [_size(s, params, view.shape) for _, s in self.parts]
        if sum(sizes) != view.shape[self.axis]:
            raise NamingError(f"split of dim {self.axis} (size {view.shape[self.axis]}) into "
                              f"{dict(zip((v for v, _ in self.parts), sizes))} does not add up")
        start = 0
        for (value, _), n in zip(self.parts, sizes):
            yield view.slice(self.axis, start, start + n), {self.name: value}
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


@dataclass(frozen=True)
class ConcatRule:
    """One HF tensor ``dst`` from several trainer arrays laid side by side.

    ``srcs`` patterns are concatenated in order along HF dim ``axis`` (after ``transforms``,
    applied to each source alone). With ``stack_over`` (a field of the patterns) the
    matched arrays are also stacked along a new leading dim 0 in field order 0..n-1, and
    ``axis`` counts dims after stacking. Example, per-expert HF checkpoints to the stacked
    ``experts.gate_up_proj [E, 2I, H]``: ``srcs=(gate, up)``, ``axis=1``, ``stack_over="e"``.
    """

    srcs: tuple[str, ...]
    dst: str
    axis: int
    transforms: tuple[Transform, ...] = ()
    stack_over: str | None = None
    _regexes: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regexes", tuple(_compile(s) for s in self.srcs))

    def match(self, name: str) -> tuple[int, dict] | None:
        for j, rx in enumerate(self._regexes):
            m = rx.fullmatch(name)
            if m is not None:
                return j, m.groupdict()
        return None


@dataclass(frozen=True, slots=True)
class Source:
    """Part of an HF tensor: its ``region`` (HF coordinates) is ``view`` of trainer array
    ``name``."""

    name: str
    region: Region
    view: StridedView


@dataclass(frozen=True)
class HFTensor:
    """A canonical tensor and the trainer arrays it is made of (usually exactly one)."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[Source, ...]

    def pieces(self, region: Region | None = None) -> list[tuple[Source, Region, StridedView]]:
        """For ``region`` (default: all): ``(source, sub-region of region, view of it)``."""
        region = region or Region(tuple(0 for _ in self.shape), self.shape)
        out = []
        for src in self.sources:
            inter = src.region.intersect(region) if not src.region.is_empty else None
            if inter is None:
                continue
            local = Region(tuple(a - s for a, s in zip(inter.starts, src.region.starts)),
                           tuple(b - s for b, s in zip(inter.stops, src.region.starts)))
            out.append((src, inter, src.view.restrict(local)))
        return out

    def view(self, arrays: Mapping[str, Any], region: Region | None = None) -> np.ndarray:
        """``region`` of this tensor read from the trainer ``arrays``: a zero-copy view when one
        source covers it, else assembled into a new array."""
        region = region or Region(tuple(0 for _ in self.shape), self.shape)
        pieces = self.pieces(region)
        if len(pieces) == 1 and pieces[0][1] == region:
            src, _, v = pieces[0]
            return v.apply(arrays[src.name])
        first = np.asarray(arrays[pieces[0][0].name]) if pieces else np.zeros(0)
        out = np.empty(region.shape, dtype=first.dtype)
        for src, inter, v in pieces:
            out[tuple(slice(a - r, b - r) for a, b, r in
                      zip(inter.starts, inter.stops, region.starts))] = v.apply(arrays[src.name])
        return out


class NameMap:
    """A rule table applied to one trainer tree: trainer names and shapes -> HF tensors.

    Args:
        rules: :class:`Rule` / :class:`ConcatRule` entries, e.g. ``jax_llama_rules()``.
        params: sizes the transforms name (``num_heads``, ``head_dim``, ...).
    """

    def __init__(self, rules: Iterable[Rule | ConcatRule], params: Mapping[str, int] | None = None
                 ) -> None:
        self.rules = tuple(rules)
        self.params = dict(params or {})

    def apply(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, HFTensor]:
        """Map every trainer array (name -> shape) to HF tensors.

        Raises:
            NamingError: listing, at once, every trainer name no rule matches, every name
                two rules match, and every HF name produced twice.
        """
        unmapped, double = [], []
        produced: dict[str, list[tuple[str, Source]]] = {}   # hf -> [(producer, source)]
        concat_groups: dict[tuple, dict] = {}
        for name, shape in shapes.items():
            hits = [(rule, m) for rule in self.rules if (m := rule.match(name)) is not None]
            if not hits:
                unmapped.append(name)
                continue
            if len(hits) > 1:
                double.append(f"{name} (rules {', '.join(repr(_rule_src(r)) for r, _ in hits)})")
                continue
            rule, m = hits[0]
            shape = tuple(int(s) for s in shape)
            if isinstance(rule, Rule):
                for view, fields in self._expand(StridedView.identity(shape), m, rule.transforms):
                    full = Region((0,) * len(view.shape), view.shape)
                    produced.setdefault(rule.dst.format(**fields), []).append(
                        (name, Source(name, full, view)))
            else:
                j, fields = m
                key_fields = {k: v for k, v in fields.items() if k != rule.stack_over}
                group = concat_groups.setdefault(
                    (id(rule), tuple(sorted(key_fields.items()))),
                    {"rule": rule, "fields": key_fields, "items": []})
                index = int(fields[rule.stack_over]) if rule.stack_over else 0
                group["items"].append((index, j, name, shape))
        for group in concat_groups.values():
            hf, sources = self._concat(group)
            label = "+".join(sorted({s.name for s in sources}))
            produced.setdefault(hf, []).extend((label, s) for s in sources)
        twice = [f"{hf} (from {', '.join(sorted({p for p, _ in srcs}))})"
                 for hf, srcs in produced.items() if len({p for p, _ in srcs}) > 1]
        problems = []
        if unmapped:
            problems.append(f"{len(unmapped)} trainer names match no rule: {', '.join(unmapped)}")
        if double:
            problems.append(f"{len(double)} trainer names match several rules: {'; '.join(double)}")
        if twice:
            problems.append(f"{len(twice)} HF names are produced twice: {'; '.join(twice)}")
        if problems:
            raise NamingError(" | ".join(problems) + " - add or narrow rules so each trainer "
                              "array maps exactly once")
        out = {}
        for hf, srcs in produced.items():
            sources = tuple(s for _, s in srcs)
            shape = tuple(max(s.region.stops[d] for s in sources)
                          for d in range(sources[0].region.ndim))
            out[hf] = HFTensor(hf, shape, sources)
        return out

    def _expand(self, view: StridedView, fields: dict, transforms: Sequence[Transform]
                ) -> Iterator[tuple[StridedView, dict]]:
        if not transforms:
            yield view, fields
            return
        for v, new in transforms[0].apply(view, fields, self.params):
            yield from self._expand(v, {**fields, **new}, transforms[1:])

    def _concat(self, group: dict) -> tuple[str, list[Source]]:
        rule: ConcatRule = group["rule"]
        items = sorted(group["items"])
        hf = rule.dst.format(**group["fields"])
        indices = sorted({i for i, *_ in items})
        if rule.stack_over and indices != list(range(len(indices))):
            raise NamingError(f"{hf}: stacked {rule.stack_over!r} values {indices} are not 0..n-1")
        have = {(i, j) for i, j, *_ in items}
        missing = [f"{rule.srcs[j]} at {rule.stack_over}={i}" if rule.stack_over else rule.srcs[j]
                   for i in indices for j in range(len(rule.srcs)) if (i, j) not in have]
        if missing:
            raise NamingError(f"{hf}: sources missing: {', '.join(missing)}")
        sources, offset_by_i = [], {}
        for i, j, name, shape in items:
            views = list(self._expand(StridedView.identity(shape), {}, rule.transforms))
            if len(views) != 1:
                raise NamingError(f"{hf}: a ConcatRule transform must not fan out")
            view = views[0][0]
            if rule.stack_over:
                view = view.unsqueeze(0)
            starts = [0] * len(view.shape)
            if rule.stack_over:
                starts[0] = i
            starts[rule.axis] = offset_by_i.get(i, 0)
            offset_by_i[i] = starts[rule.axis] + view.shape[rule.axis]
            stops = [a + n for a, n in zip(starts, view.shape)]
            sources.append(Source(name, Region(tuple(starts), tuple(stops)), view))
        return hf, sources


def _rule_src(rule: Rule | ConcatRule) -> str:
    return rule.src if isinstance(rule, Rule) else "|".join(rule.srcs)


# ---------------------------------------------------------------------------- trees

def flatten_tree(tree: Any, sep: str = "/") -> dict[str, Any]:
    """``{"a": {"b": [x, y]}}`` -> ``{"a/b/0": x, "a/b/1": y}``: the trainer names rules match.

    Nested mappings, lists and tuples; anything else is a leaf. (Flax ``nnx.State``:
    pass ``state.to_pure_dict()``.)
    """
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            items = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        else:
            out[prefix] = node
            return
        for k, v in items:
            walk(v, f"{prefix}{sep}{k}" if prefix else str(k))

    walk(tree, "")
    return out


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
    rows = [
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
                   f"{L}.mlp.experts.gate_up_proj", axis=1, stack_over="e"),
        ConcatRule((f"{e}.down_proj.weight",), f"{L}.mlp.experts.down_proj", axis=1,
                   stack_over="e"),
    )
