"""Applying naming rules: trainer arrays -> canonical (HF) tensors, as views.

The rules (:mod:`xreshard.adapters.naming_rules`, re-exported here) say which trainer
arrays make which HF tensors through which transforms. This module applies them, with one
interpreter of transforms (:meth:`NameMap.expand`) for two kinds of view:

* :class:`StridedView`, a whole trainer array: HF element ``(i0, i1, ...)`` is element
  ``offset + sum(i_k * strides_k)`` of the trainer array in C order. Views are exact and
  never copy; a rule that would need a copy (a transpose followed by a merge of
  non-adjacent dims) is refused. :meth:`NameMap.apply` maps a tree's names and shapes to
  :class:`HFTensor` s of such views.
* :class:`ShardedView`, a sharded JAX array: its :class:`~xreshard.ir.layout.Layout`, carried
  through the transforms by the layout's view algebra (``permuted``, ``reshaped``,
  ``selected``, ``sliced``; ``merged`` where a reshape merges a split minor dim, each shard
  then several boxes), and each local shard viewed alongside. The JAX adapter's
  ``bind_named`` (:mod:`xreshard.adapters.jax`) binds a JAX pytree this way, so the HF
  tensors are sent from the devices that hold them.

Xreshard's layouts are in canonical coordinates (HF names, torch ``[out, in]``); trainer
paths are ``"/"``-joined pytree paths (:func:`flatten_tree`). See
:mod:`~xreshard.adapters.naming_rules` for the canonical JAX Llama tree and its table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from xreshard.errors import LayoutError
from xreshard.ir.layout import Layout, Region

from .naming_rules import (HF_IDENTITY, JAX_LLAMA, ConcatRule, Index, NamingError, Reshape,
                           Rule, Slice, Split, Transform, Transpose, Unsqueeze, Unstack,
                           hf_stacked_experts_rules, jax_llama_rules, jax_moe_rules)

__all__ = [
    "NamingError", "StridedView", "ShardedView", "Source", "HFTensor", "NameMap", "Rule",
    "ConcatRule", "Transform", "Transpose", "Reshape", "Index", "Slice", "Unsqueeze",
    "Unstack", "Split", "HF_IDENTITY", "JAX_LLAMA", "jax_llama_rules", "jax_moe_rules",
    "hf_stacked_experts_rules", "flatten_tree",
]


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

    def index(self, dim: int, i: int) -> StridedView:
        n = self.shape[dim]
        if not 0 <= i < n:
            raise NamingError(f"index {i} out of range for dim {dim} of size {n}")
        return StridedView(self.src_shape, self.shape[:dim] + self.shape[dim + 1:],
                           self.strides[:dim] + self.strides[dim + 1:],
                           self.offset + i * self.strides[dim])

    def slice(self, dim: int, start: int, stop: int) -> StridedView:
        n = self.shape[dim]
        if not 0 <= start <= stop <= n:
            raise NamingError(f"slice [{start}:{stop}) out of range for dim {dim} of size {n}")
        shape = list(self.shape)
        shape[dim] = stop - start
        return StridedView(self.src_shape, tuple(shape), self.strides,
                           self.offset + start * self.strides[dim])

    def unsqueeze(self, dim: int) -> StridedView:
        return StridedView(self.src_shape, self.shape[:dim] + (1,) + self.shape[dim:],
                           self.strides[:dim] + (0,) + self.strides[dim:], self.offset)

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


@dataclass(frozen=True)
class ShardedView:
    """A sharded trainer array seen through naming transforms: its ``layout`` and, per world
    rank of this process, its local shard (a host array) viewed alongside.

    The view ops of :class:`StridedView`, on layouts: a transpose permutes, a reshape may
    merge or split dims (a split dim that is its run's major one stays an even split),
    indexing a split dim (experts over an expert axis) keeps the ranks that hold the index,
    slicing a split dim keeps the ranks of its blocks (see ``Layout.sliced``). A reshape that
    merges a split dim into the dims before it (Tunix's Gemma4 per-layer tables, ``P``
    split, to HF's ``[.., L*P]``) makes the layout explicit form (``Layout.merged``): each
    rank's shard is several boxes of the result, each bound as a strided view of the shard
    (``arrays[rank]`` is then a list, one per region); only transposes may follow. Local
    views never copy except where a reshape of a shard cannot be a view.

    Attributes:
        layout: the layout of the (transformed) array over world ranks.
        arrays: world rank -> this process's local array of it (ranks that hold it only),
            or its list of arrays, one per region, where the layout is explicit form.
    """

    layout: Layout
    arrays: Mapping[int, Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    def transpose(self, perm: Sequence[int] | None = None) -> ShardedView:
        perm = tuple(reversed(range(self.layout.ndim))) if perm is None else tuple(perm)
        if not self.layout.is_product:
            return ShardedView(self.layout.permuted(perm), {
                r: [x.transpose(perm) for x in a] for r, a in self.arrays.items()})
        return ShardedView(self.layout.permuted(perm),
                           {r: a.transpose(perm) for r, a in self.arrays.items()})

    def reshape(self, new_shape: Sequence[int]) -> ShardedView:
        new = [int(n) for n in new_shape]
        if -1 in new:
            known = math.prod(n for n in new if n != -1)
            new[new.index(-1)] = math.prod(self.shape) // max(known, 1)
        try:
            return self._with(self._product("reshape").reshaped(new))
        except LayoutError:
            layout, index = self.layout.merged(new)     # or its LayoutError: no box form
        return ShardedView(layout, {
            r: [a[ix].reshape(box.shape) for ix, box in zip(index[r], layout.regions(r))]
            for r, a in self.arrays.items()})

    def unsqueeze(self, dim: int) -> ShardedView:
        return self._with(self._product("unsqueeze").reshaped(
            self.shape[:dim] + (1,) + self.shape[dim:]))

    def index(self, dim: int, i: int) -> ShardedView:
        return self._cut(dim, *self._product("index").selected(dim, i))

    def slice(self, dim: int, start: int, stop: int) -> ShardedView:
        return self._cut(dim, *self._product("slice").sliced(dim, start, stop))

    def _product(self, op: str) -> Layout:
        """The layout, product form: after a reshape that cut shards into several boxes
        (explicit form) only transposes are views of every box."""
        if not self.layout.is_product:
            raise NamingError(f"{op} after a reshape that cut each shard into boxes "
                              f"({self.layout}); only a transpose may follow it")
        return self.layout

    def _with(self, layout: Layout) -> ShardedView:
        return ShardedView(layout, {r: a.reshape(layout.local_shape(r))
                                    for r, a in self.arrays.items()})

    def _cut(self, dim: int, layout: Layout, local: Mapping[int, Any]) -> ShardedView:
        """``layout``, each holder's array indexed by ``local[rank]`` along ``dim``."""
        lead = (slice(None),) * dim
        return ShardedView(layout, {r: a[lead + (local[r],)] for r, a in self.arrays.items()
                                    if r in local})


# ---------------------------------------------------------------------------- applying rules



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
        out: np.ndarray = np.empty(region.shape, dtype=first.dtype)
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
        self._checked: tuple | None = None

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
                double.append(f"{name} (rules {', '.join(repr(r.src) for r, _ in hits)})")
                continue
            rule, m = hits[0]
            shape = tuple(int(s) for s in shape)
            if isinstance(rule, Rule):
                assert isinstance(m, dict)          # a Rule's match (a ConcatRule's: a pair)
                for view, fields in self.expand(StridedView.identity(shape), m,
                                                rule.transforms, name):
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
            parts = tuple(s for _, s in srcs)
            shape = tuple(max(s.region.stops[d] for s in parts)
                          for d in range(parts[0].region.ndim))
            out[hf] = HFTensor(hf, shape, parts)
        return out

    def check(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """:meth:`apply`'s checks (every trainer name maps exactly once), skipped for the
        names and shapes checked last: a refit binds the same tree every step."""
        key = tuple((n, tuple(int(x) for x in s)) for n, s in shapes.items())
        if key != self._checked:
            self.apply(dict(key))
            self._checked = key

    def expand(self, view: Any, fields: dict, transforms: Sequence[Transform], name: str
               ) -> Iterator[tuple[Any, dict]]:
        """The one interpreter of transforms: ``(view after transforms, fields)`` for every
        HF tensor ``transforms`` make of ``view`` (a :class:`StridedView` or
        :class:`ShardedView` of trainer array ``name``).

        Raises:
            NamingError: a transform does not apply (naming ``name``; a layout's
                ``LayoutError`` is raised as this).
        """
        if not transforms:
            yield view, fields
            return
        steps = transforms[0].apply(view, fields, self.params)
        while True:
            try:
                v, new = next(steps)
            except StopIteration:
                return
            except (NamingError, LayoutError) as e:
                raise NamingError(f"{name!r}: {e}") from e
            yield from self.expand(v, {**fields, **new}, transforms[1:], name)

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
        sources: list[Source] = []
        offset_by_i: dict[int, int] = {}
        for i, j, name, shape in items:
            views = list(self.expand(StridedView.identity(shape), {}, rule.transforms, name))
            if len(views) != 1:
                raise NamingError(f"{hf}: a ConcatRule transform must not fan out")
            view = views[0][0]
            if rule.stack_over:
                view = view.unsqueeze(0)
            starts = [0] * len(view.shape)
            if rule.stack_over:
                starts[0] = i
            starts[rule.dim] = offset_by_i.get(i, 0)
            offset_by_i[i] = starts[rule.dim] + view.shape[rule.dim]
            stops = [a + n for a, n in zip(starts, view.shape)]
            sources.append(Source(name, Region(tuple(starts), tuple(stops)), view))
        return hf, sources


# ---------------------------------------------------------------------------- trees

def flatten_tree(tree: Any, sep: str = "/") -> dict[str, Any]:
    """``{"a": {"b": [x, y]}}`` -> ``{"a/b/0": x, "a/b/1": y}``: the trainer names rules match.

    Nested mappings, lists and tuples; anything else is a leaf. (Flax ``nnx.State``:
    pass ``state.to_pure_dict()``.)
    """
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        items: Iterable[tuple[Any, Any]]
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
