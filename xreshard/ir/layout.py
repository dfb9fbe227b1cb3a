"""The neutral layout IR: Mesh, Region, Split and Layout.

A layout says which region(s) of one tensor every rank holds. It is geometry only: no
framework object, no memory. Two forms, one meaning (see docs/architecture.md):

* product form: a mesh plus an ordered tuple of ``Split(dim, axis, split_factor)``. Splits
  of one dim apply in order, each re-splitting that rank's current extent with torch.chunk
  semantics (``ceil(n/k)`` blocks, trailing blocks short or empty); a split factor > 1 is
  DTensor's ``_StridedShard``. JAX's even rule is the same geometry plus a divisibility
  check, so one representation serves both. Mesh axes that split no dim replicate.
* explicit form: ``{rank: (Region, ...)}`` for anything else.

The one geometry query is ``layout.regions(rank)``; everything else derives from it or from
the per-dim interval lists it is built from.

Equal meshes and equal layouts are one object: constructing a ``Mesh`` or ``Layout`` equal
to one that is alive returns that one, geometry caches warm (as ``jax.sharding.Mesh`` does
with its cache). The intern tables hold their values weakly, so nothing outlives its users;
a refit rebuilding thousands of equal layouts every step pays for their geometry once.
"""

from __future__ import annotations

import itertools
import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from ..dtypes import dtype_name
from ..errors import LayoutError
from .geometry import SLOTS, Mesh, Region, Split, interned, new_table
from .intervals import Interval, chunk, dim_runs, run_boxes, split_intervals
from .placements import is_unconstrained, parse_placement, splits_of_placements

__all__ = ["Interval", "Layout", "LayoutMemo", "Mesh", "Region", "Split", "chunk",
           "parse_placement", "split_intervals", "splits_of_placements"]

_T = TypeVar("_T")

#: the live layouts by value (see the module docstring)
_LAYOUTS: dict[Any, Layout] = new_table()


# ---------------------------------------------------------------------------- Layout


@dataclass(frozen=True, init=False, **SLOTS)
class Layout:
    """Which region(s) of one tensor (shape, dtype) each rank holds.

    Build it with ``Layout.from_placements`` (DTensor), ``Layout.from_spec`` (JAX),
    ``Layout.replicated``, ``Layout.product`` or ``Layout.explicit_form``. Equal layouts
    are one object (interned), so their geometry caches are computed once.
    """

    shape: tuple[int, ...]
    dtype: str
    mesh: Mesh | None = None
    splits: tuple[Split, ...] = ()
    explicit: tuple[tuple[int, tuple[Region, ...]], ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False)
    _cache: dict[Any, Any] = field(init=False, repr=False, compare=False)

    def __new__(cls, shape: Sequence[int], dtype: object, mesh: Mesh | None = None,
                splits: tuple[Split, ...] = (),
                explicit: tuple[tuple[int, tuple[Region, ...]], ...] | None = None) -> Layout:
        self = object.__new__(cls)
        for name, value in (("shape", shape), ("dtype", dtype), ("mesh", mesh),
                            ("splits", splits), ("explicit", explicit)):
            object.__setattr__(self, name, value)
        self._normalize()
        return interned(_LAYOUTS, (self.shape, self.dtype, self.mesh, self.splits,
                                  self.explicit), self)

    def __reduce__(self) -> tuple[Any, ...]:
        return Layout, (self.shape, self.dtype, self.mesh, self.splits, self.explicit)

    def _uninterned(self) -> Layout:
        """An equal layout (and mesh) outside the intern tables, its caches cold: what a
        fresh build was before interning (benchmarks build these to measure what interning
        and ``LayoutMemo`` save)."""
        twin = object.__new__(Layout)
        mesh = self.mesh
        if mesh is not None:
            mesh = object.__new__(Mesh)
            for name in ("shape", "ranks", "axis_names", "_hash"):
                object.__setattr__(mesh, name, getattr(self.mesh, name))
            object.__setattr__(mesh, "_coords", None)
        for name, value in (("shape", self.shape), ("dtype", self.dtype), ("mesh", mesh),
                            ("splits", self.splits), ("explicit", self.explicit),
                            ("_hash", self._hash), ("_cache", {})):
            object.__setattr__(twin, name, value)
        return twin

    def _normalize(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise LayoutError(f"tensor shape {shape} has a negative size")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.explicit is not None:
            if self.mesh is not None or self.splits:
                raise LayoutError("a layout is either product form (mesh + splits) or explicit "
                                  "form (rank -> regions), not both")
            for rank, regions in self.explicit:
                for i, r in enumerate(regions):
                    if r.ndim != len(shape) or any(b > n for b, n in zip(r.stops, shape)):
                        raise LayoutError(f"rank {rank} region {r} does not fit in tensor "
                                          f"shape {shape}")
                    for other in regions[:i]:
                        if r.intersect(other) is not None:
                            raise LayoutError(f"rank {rank} holds regions {other} and {r}, which "
                                              "overlap; a rank holds each element at most once")
        else:
            if self.mesh is None:
                raise LayoutError("a product-form layout needs a mesh")
            seen: set[int] = set()
            for sp in self.splits:
                if not 0 <= sp.dim < len(shape):
                    raise LayoutError(f"split {sp} names dim {sp.dim} of a {len(shape)}-d tensor "
                                      f"of shape {shape}")
                if not 0 <= sp.axis < self.mesh.ndim:
                    raise LayoutError(f"split {sp} names mesh axis {sp.axis} of a "
                                      f"{self.mesh.ndim}-d mesh")
                if sp.axis in seen:
                    raise LayoutError(f"mesh axis {self.mesh.axis_label(sp.axis)!r} splits the "
                                      "tensor twice; a mesh axis may split at most one dim once")
                if sp.split_factor < 1:
                    raise LayoutError(f"split {sp} needs split_factor >= 1")
                seen.add(sp.axis)
            # canonical order: by dim, keeping each dim's order (which is what matters);
            # splits by a size-1 axis change nothing and are dropped.
            splits = tuple(sorted((sp for sp in self.splits if self.mesh.shape[sp.axis] > 1),
                                  key=lambda sp: sp.dim))
            object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "_hash", hash((shape, self.dtype, self.mesh, self.splits,
                                                self.explicit)))
        object.__setattr__(self, "_cache", {})

    def __hash__(self) -> int:
        return self._hash

    @property
    def _mesh(self) -> Mesh:
        """``mesh`` where the layout is product form (explicit-form paths return before)."""
        assert self.mesh is not None, f"{self} is explicit form"
        return self.mesh

    # ------------------------------------------------------------ constructors

    @classmethod
    def product(cls, shape: Sequence[int], dtype: object, mesh: Mesh,
                splits: Iterable[Split | tuple[int, ...]], *, even: bool = False,
                name: str | None = None) -> Layout:
        """Product form from explicit splits; ``even=True`` enforces JAX's divisibility rule."""
        parsed = tuple(s if isinstance(s, Split) else Split(*s) for s in splits)
        layout = cls(tuple(shape), dtype, mesh, parsed)
        if even:
            layout._check_even(name)
        return layout

    @classmethod
    def replicated(cls, shape: Sequence[int], dtype: object, mesh: Mesh) -> Layout:
        """Every rank of ``mesh`` holds the whole tensor."""
        return cls(tuple(shape), dtype, mesh, ())

    @classmethod
    def from_placements(cls, shape: Sequence[int], dtype: object, mesh: Mesh,
                        placements: Sequence[Any], *, name: str | None = None) -> Layout:
        """DTensor placements, one per mesh axis: ``["R", "S0", "SS1/2"]`` or torch objects.

        Raises:
            LayoutError: wrong count, an unknown entry, or ``Partial`` (pending reduction).
        """
        where = f"tensor {name!r}: " if name else ""
        return cls(tuple(shape), dtype, mesh,
                   tuple(splits_of_placements(placements, mesh, tuple(shape), where)))

    @classmethod
    def from_spec(cls, shape: Sequence[int], dtype: object, mesh: Mesh, spec: Sequence[Any],
                  *, name: str | None = None) -> Layout:
        """A JAX PartitionSpec: per dim ``None``, an axis name, or a tuple of names (major first).

        Raises:
            LayoutError: unknown or repeated axis names, a spec longer than the tensor has dims,
                an unreduced (pending reduction) spec, or a split that is not even.
        """
        where = f"tensor {name!r}: " if name else ""
        if mesh.axis_names is None:
            raise LayoutError(f"{where}Layout.from_spec needs a mesh with axis_names")
        if unreduced := getattr(spec, "unreduced", None):
            raise LayoutError(f"{where}PartitionSpec {spec} has unreduced axes "
                              f"{sorted(unreduced)} (a pending reduction); xreshard does not "
                              "reduce yet - reduce (e.g. jax.lax.psum) before refitting")
        entries = list(spec)
        if len(entries) > len(shape):
            raise LayoutError(f"{where}PartitionSpec {tuple(entries)} has {len(entries)} entries "
                              f"but the tensor has {len(shape)} dims (shape {tuple(shape)})")
        splits, used = [], set()
        for dim, entry in enumerate(entries):
            if entry is None or is_unconstrained(entry):
                continue
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            for axis_name in names:
                if axis_name in used:
                    raise LayoutError(f"{where}mesh axis {axis_name!r} appears twice in "
                                      f"PartitionSpec {tuple(entries)}")
                used.add(axis_name)
                splits.append(Split(dim, mesh.axis_index(axis_name), 1))
        layout = cls(tuple(shape), dtype, mesh, tuple(splits))
        layout._check_even(name)
        return layout

    @classmethod
    def explicit_form(cls, shape: Sequence[int], dtype: object,
                      regions: Mapping[int, Iterable[Region | Sequence[Any]]]) -> Layout:
        """Explicit form: ``{rank: [Region | [(start, stop), ...], ...]}``."""
        items = []
        for rank in sorted(regions):
            rs = tuple(r if isinstance(r, Region) else Region.of(r) for r in regions[rank])
            items.append((int(rank), tuple(r for r in rs if not r.is_empty)))
        return cls(tuple(shape), dtype, None, (), tuple(items))

    def _check_even(self, name: str | None) -> None:
        for dim, n in enumerate(self.shape):
            axes = [sp.axis for sp in self.splits if sp.dim == dim]
            ways = math.prod(self._mesh.shape[a] for a in axes)
            if n % ways:
                label = tuple(self._mesh.axis_label(a) for a in axes)
                who = f"tensor {name!r}" if name else "tensor"
                raise LayoutError(
                    f"{who} dim {dim} (size {n}) is split {ways} ways by mesh axes {label} but "
                    f"{n} % {ways} != 0; JAX NamedSharding needs even splits - pad the tensor "
                    "or change the PartitionSpec")

    def permuted(self, perm: Sequence[int]) -> Layout:
        """The same placement seen through ``transpose(perm)``: dim ``i`` of the result is
        dim ``perm[i]`` of this layout (``(1, 0)`` turns an ``[in, out]`` kernel's layout
        into the ``[out, in]`` weight's). Remembered on this layout, as the other views are
        (a refit permutes the same layouts every step)."""
        perm = tuple(perm)
        return self._remember(("permuted", perm), lambda: self._permuted(perm))

    def _permuted(self, perm: tuple[int, ...]) -> Layout:
        if sorted(perm) != list(range(self.ndim)):
            raise LayoutError(f"{perm} is not a permutation of the {self.ndim} dims of {self}")
        inverse = {d: i for i, d in enumerate(perm)}
        shape = tuple(self.shape[d] for d in perm)
        if self.explicit is not None:
            return Layout(shape, self.dtype, None, (), tuple(
                (rank, tuple(Region(tuple(r.starts[d] for d in perm),
                                    tuple(r.stops[d] for d in perm))
                             for r in regions)) for rank, regions in self.explicit))
        return Layout(shape, self.dtype, self.mesh,
                      tuple(Split(inverse[sp.dim], sp.axis, sp.split_factor) for sp in self.splits))

    def _view(self, op: str, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        """``make()`` for a view method (product form only), memoized under ``key``."""
        if self.explicit is not None:
            raise LayoutError(f"{op} needs a product-form layout; {self} is explicit form")
        return self._remember(key, make)

    def _remember(self, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        got: _T | None = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def sliced(self, dim: int, start: int, stop: int) -> tuple[Layout, Mapping[int, slice]]:
        """The layout of ``x[start:stop]`` along ``dim`` and, per rank holding it, the slice
        of ``dim`` of its local array. A ``dim`` split (evenly, by one mesh axis) is sliced in
        one block or as whole blocks, held by their ranks. 8 rows on ``tp=4``::

            # rank | rows | [2:4] local | [4:8] local
            #    1 | 2:4  | [0:2]       | -
            #    2 | 4:6  | -           | [:] (rows 0:2 of the result)

        Raises:
            LayoutError: explicit form, out of range, or a split dim cut across its blocks.
        """
        if not 0 <= dim < self.ndim or not 0 <= start <= stop <= self.shape[dim]:
            raise LayoutError(f"slice [{start}:{stop}] of dim {dim} is outside {self}")
        return self._view("slice", ("sliced", dim, start, stop),
                          lambda: self._sliced(dim, start, stop))

    def _sliced(self, dim: int, start: int, stop: int) -> tuple[Layout, Mapping[int, slice]]:
        mesh, axes, n = self._mesh, self.dim_axes(dim), self.shape[dim]
        shape = self.shape[:dim] + (stop - start,) + self.shape[dim + 1:]
        if not axes or n == 0:
            return (Layout(shape, self.dtype, mesh, self.splits),
                    MappingProxyType(dict.fromkeys(mesh.ranks, slice(start, stop))))
        ways = math.prod(mesh.shape[a] for a in axes)
        block = n // ways
        k0 = min(start // block, ways - 1)
        k1 = max(-(-stop // block), k0 + 1)
        if len(axes) > 1 or n % ways or any(sp.split_factor > 1 for sp in self.splits
                                            if sp.dim == dim) or (
                k1 - k0 > 1 and (start % block or stop % block)):
            raise LayoutError(
                f"slices [{start}:{stop}] of dim {dim} (size {n}), which mesh axes "
                f"{[mesh.axis_label(a) for a in axes]} split into blocks of {block}; a slice of "
                "a split dim must lie in one block or be whole blocks of one axis (an even "
                "split) - split another dim, or align the slice with the blocks")
        (ax,) = axes
        coords = itertools.product(*map(range, mesh.shape))      # row-major, as mesh.ranks
        ranks = tuple(r for r, c in zip(mesh.ranks, coords) if k0 <= c[ax] < k1)
        sub = Mesh(mesh.shape[:ax] + (k1 - k0,) + mesh.shape[ax + 1:], ranks, mesh.axis_names)
        local = slice(start - k0 * block, stop - k0 * block) if k1 - k0 == 1 else slice(None)
        return Layout(shape, self.dtype, sub, self.splits), MappingProxyType(dict.fromkeys(
            ranks, local))

    def selected(self, dim: int, index: int) -> tuple[Layout, Mapping[int, int]]:
        """The layout of ``x[index]`` along ``dim`` (dropped) and, per rank holding it, the
        position of ``index`` in its local array; axes splitting ``dim`` leave the mesh.
        Expert 5 of 8 stacked experts on ``ep=4``::

            # rank | experts | local index of expert 5
            #    2 | 4:6     | 1

        Raises:
            LayoutError: explicit form, or ``dim`` or ``index`` out of range.
        """
        if not 0 <= dim < self.ndim or not 0 <= index < self.shape[dim]:
            raise LayoutError(f"index {index} of dim {dim} is outside {self}")
        return self._view("select", ("selected", dim, index), lambda: self._selected(dim, index))

    def _selected(self, dim: int, index: int) -> tuple[Layout, Mapping[int, int]]:
        mesh, axes = self._mesh, self.dim_axes(dim)
        shape = self.shape[:dim] + self.shape[dim + 1:]
        keep = [a for a in range(mesh.ndim) if a not in axes]
        renumber = {a: k for k, a in enumerate(keep)}
        splits = tuple(Split(sp.dim - (sp.dim > dim), renumber[sp.axis], sp.split_factor)
                       for sp in self.splits if sp.dim != dim)
        local = {}
        for r in mesh.ranks:
            pos, held = 0, self.dim_intervals(r)
            assert held is not None                # every rank of the mesh holds something
            for a, b in held[dim]:
                if a <= index < b:
                    local[r] = pos + index - a
                pos += b - a
        ranks = tuple(local)           # the holders, in mesh order: the kept axes row-major
        names = None if mesh.axis_names is None else tuple(mesh.axis_names[a] for a in keep)
        sub = Mesh(tuple(mesh.shape[a] for a in keep), ranks, names) if keep else \
            Mesh((1,), ranks)
        return Layout(shape, self.dtype, sub, splits), MappingProxyType(local)

    def reshaped(self, shape: Sequence[int]) -> Layout:
        """The layout of ``x.reshape(shape)`` (no ``-1``): dims pair up in runs of equal
        products, and only a run's major (outermost non-1) dim may be split - evenly, unless
        the run is one dim to one dim. ``[8, 4, 6]``, ``tp`` on dim 0: ``[32, 6]``, ``tp``
        on dim 0; ``tp`` on dim 2: refused (a rank's block would be no box).

        Raises:
            LayoutError: explicit form, another size, an empty tensor, or shards cut apart.
        """
        old, new = self.shape, tuple(int(n) for n in shape)
        if math.prod(old) != math.prod(new) or min(new, default=0) < 0:
            raise LayoutError(f"cannot reshape {old} to {new}: the sizes differ")
        if 0 in old:
            raise LayoutError(f"cannot reshape an empty tensor {old}: its splits are ambiguous")
        return self._view("reshape", ("reshaped", new), lambda: self._reshaped(new))

    def _reshaped(self, new: tuple[int, ...]) -> Layout:
        old, splits = self.shape, []
        for od, nd in dim_runs(old, new):
            split_dims = [d for d in od if self.dim_axes(d)]
            if not split_dims:
                continue
            major_old = next((d for d in od if old[d] > 1), od[0])
            major_new = next((d for d in nd if new[d] > 1), nd[0])
            moved = [sp for sp in self.splits if sp.dim == major_old]
            ways = math.prod(self._mesh.shape[sp.axis] for sp in moved)
            whole = old[major_old] == new[major_new] == math.prod(new[d] for d in nd)
            if split_dims != [major_old] or not whole and (
                    old[major_old] % ways or new[major_new] % ways
                    or any(sp.split_factor > 1 for sp in moved)):
                axes = [self._mesh.axis_label(a) for d in split_dims for a in self.dim_axes(d)]
                raise LayoutError(
                    f"reshape {old} -> {new} would cut the shards of dims {split_dims} (split "
                    f"by mesh axes {axes}) into non-boxes; only the major dim of a merged or "
                    "split run of dims may be split, evenly")
            splits += [Split(major_new, sp.axis, sp.split_factor) for sp in moved]
        return Layout(new, self.dtype, self.mesh, tuple(splits))

    def merged(self, shape: Sequence[int], limit: int = 512
               ) -> tuple[Layout, Mapping[int, tuple[tuple[Any, ...], ...]]]:
        """``x.reshape(shape)`` where ``reshaped`` refuses because a merged run's split dim
        is not its major one: explicit form, each rank's block cut into the boxes it makes
        of the merged dim, and per rank the index of each box in its local array (``local
        [index].reshape(box.shape)``, in ``regions(rank)`` order: a view of a C-contiguous
        shard). ``[V, L, P]``, ``P`` split on tp=2, to ``[V, L*P]`` (Gemma4's per-layer
        tables)::

            # rank | holds          | boxes (l = 0..L-1)     | index
            #    0 | [:, :, 0:P/2]  | [:, l*P : l*P + P/2]   | [:, l, :]

        Raises:
            LayoutError: explicit form, another size, a split dim split into several dims
                (not its run's major one, evenly), or more than ``limit`` boxes per rank.
        """
        old, new = self.shape, tuple(int(n) for n in shape)
        if math.prod(old) != math.prod(new) or 0 in old:
            raise LayoutError(f"cannot reshape {old} to {new}: the sizes differ (or are 0)")
        return self._view("reshape", ("merged", new, limit), lambda: self._merged(new, limit))

    def _merged(self, new: tuple[int, ...], limit: int
                ) -> tuple[Layout, Mapping[int, tuple[tuple[Any, ...], ...]]]:
        runs, explicit, index = dim_runs(self.shape, new), [], {}
        for rank in self._mesh.ranks:
            held = self.dim_intervals(rank) or tuple(() for _ in self.shape)
            boxes: list[tuple[tuple[Any, ...], tuple[Interval, ...]]] = [((), ())]
            for od, nd in runs:
                got = run_boxes([self.shape[d] for d in od], [held[d] for d in od],
                                 [new[d] for d in nd])
                if got is None:
                    axes = [self._mesh.axis_label(a) for d in od for a in self.dim_axes(d)]
                    raise LayoutError(
                        f"reshape {self.shape} -> {new} would cut the shards of dims {od} "
                        f"(split by mesh axes {axes}) into non-boxes; a split dim may be "
                        "merged with the dims before it, or split into several dims if it "
                        "is its run's major dim, evenly")
                boxes = [(ix + jx, iv + jv) for ix, iv in boxes for jx, jv in got]
            boxes = [(ix, iv) for ix, iv in boxes if all(b > a for a, b in iv)]
            if len(boxes) > limit:
                raise LayoutError(f"reshape {self.shape} -> {new} cuts rank {rank}'s shard "
                                  f"into {len(boxes)} boxes (more than {limit})")
            explicit.append((rank, tuple(Region(tuple(a for a, _ in iv), tuple(b for _, b in iv))
                                         for _, iv in boxes)))
            index[rank] = tuple(ix for ix, _ in boxes)
        return Layout(new, self.dtype, None, (), tuple(explicit)), MappingProxyType(index)

    def with_dtype(self, dtype: object) -> Layout:
        return Layout(self.shape, dtype, self.mesh, self.splits, self.explicit)

    # ------------------------------------------------------------ geometry

    @property
    def is_product(self) -> bool:
        return self.explicit is None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank the layout places (some may hold nothing)."""
        if self.explicit is not None:
            return tuple(r for r, _ in self.explicit)
        return self._mesh.ranks

    def dim_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting ``dim``, in the order they apply."""
        axes: tuple[tuple[int, ...], ...] | None = self._cache.get("axes")
        if axes is None:
            axes = self._cache["axes"] = tuple(
                tuple(sp.axis for sp in self.splits if sp.dim == d) for d in range(self.ndim))
        return axes[dim]

    @property
    def rank_set(self) -> frozenset[int]:
        got = self._cache.get("rank_set")
        if got is None:
            got = self._cache["rank_set"] = frozenset(self.ranks)
        return got

    def num_elements(self, rank: int) -> int:
        """Elements ``rank`` holds."""
        if self.explicit is not None:
            return sum(r.size for r in self.regions(rank))
        per_dim = self.dim_intervals(rank)
        if per_dim is None:
            return 0
        return math.prod(sum(e - s for s, e in ivs) for ivs in per_dim)

    def dim_table(self, dim: int) -> dict[tuple[int, ...], tuple[Interval, ...]]:
        """For product layouts: key (coords on ``dim_axes(dim)``) -> that key's intervals.

        The intervals of all keys partition ``[0, shape[dim])``.
        """
        key = ("table", dim)
        table = self._cache.get(key)
        if table is None:
            dim_splits = [sp for sp in self.splits if sp.dim == dim]
            table = {}
            for coords in itertools.product(*(range(self._mesh.shape[sp.axis])
                                              for sp in dim_splits)):
                ivs: tuple[Interval, ...] = ((0, self.shape[dim]),) if self.shape[dim] else ()
                for sp, c in zip(dim_splits, coords):
                    ivs = split_intervals(ivs, self._mesh.shape[sp.axis], c, sp.split_factor)
                table[coords] = ivs
            self._cache[key] = table
        return table

    def dim_intervals(self, rank: int) -> tuple[tuple[Interval, ...], ...] | None:
        """Product form: per dim, the intervals ``rank`` holds (in local order); None if outside."""
        if self.explicit is not None:
            raise LayoutError("dim_intervals needs a product-form layout; an explicit-form "
                              "layout has only regions(rank)")
        key = ("iv", rank)
        if key in self._cache:
            known: tuple[tuple[Interval, ...], ...] | None = self._cache[key]
            return known
        coord = self._mesh.coord(rank)
        got = None if coord is None else tuple(
            self.dim_table(d)[tuple(coord[a] for a in self.dim_axes(d))] for d in range(self.ndim))
        self._cache[key] = got
        return got

    def rank_groups(self) -> tuple[tuple[tuple[tuple[Interval, ...], ...], tuple[int, ...]], ...]:
        """Product form: the ranks holding anything, grouped by the intervals they hold
        (replicas share a group), as (per-dim intervals, ranks) in mesh order. Cached.

        Example: 4 rows on mesh (2, 2) with placements (S0, R)::

            # per-dim intervals | ranks
            # (((0, 2),),)      | (0, 1)
            # (((2, 4),),)      | (2, 3)
        """
        if self.explicit is not None:
            raise LayoutError("rank_groups needs a product-form layout; an explicit-form "
                              "layout has only regions(rank)")
        got: tuple[tuple[tuple[tuple[Interval, ...], ...], tuple[int, ...]], ...] | None = \
            self._cache.get("groups")
        if got is None:
            groups: dict[tuple[tuple[Interval, ...], ...], list[int]] = {}
            for rank in self._mesh.ranks:
                per_dim = self.dim_intervals(rank)
                if per_dim is not None and all(per_dim):
                    groups.setdefault(per_dim, []).append(rank)
            got = self._cache["groups"] = tuple((k, tuple(v)) for k, v in groups.items())
        return got

    def regions(self, rank: int) -> tuple[Region, ...]:
        """The regions ``rank`` holds, in the order its local array stores them.

        Example: 5 rows on mesh (2, 2) with placements (S0, S0) (torch.chunk, nested)::

            # rank | coord | region
            #    0 | (0,0) | [0:2]
            #    1 | (0,1) | [2:3]
            #    2 | (1,0) | [3:4]
            #    3 | (1,1) | [4:5]
        """
        if self.explicit is not None:
            for r, regions in self.explicit:
                if r == rank:
                    return regions
            return ()
        per_dim = self.dim_intervals(rank)
        if per_dim is None:
            return ()
        return tuple(Region(tuple(iv[0] for iv in combo), tuple(iv[1] for iv in combo))
                     for combo in itertools.product(*per_dim))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local array (product form) - zeros where it holds nothing."""
        if self.explicit is not None:
            raise LayoutError("an explicit-form layout has one local array per region; "
                              "use regions(rank)")
        per_dim = self.dim_intervals(rank)
        if per_dim is None:
            return tuple(0 for _ in self.shape)
        return tuple(sum(e - s for s, e in ivs) for ivs in per_dim)

    def locate(self, rank: int, region: Region) -> tuple[int, tuple[slice, ...]]:
        """Where ``region`` (held by ``rank``) sits in local storage: (buffer index, slices).

        Product layouts have one local array (buffer 0); explicit layouts one per region.
        """
        if self.explicit is not None:
            for i, held in enumerate(self.regions(rank)):
                if held.contains(region):
                    return i, tuple(slice(a - h, b - h) for a, b, h in
                                    zip(region.starts, region.stops, held.starts))
            raise LayoutError(f"rank {rank} does not hold region {region}")
        per_dim = self.dim_intervals(rank)
        slices = []
        for d, (a, b) in enumerate(zip(region.starts, region.stops)):
            ivs = per_dim[d] if per_dim is not None else ()
            i = bisect_right(ivs, (a, math.inf)) - 1
            if i < 0 or b > ivs[i][1]:
                raise LayoutError(f"rank {rank} does not hold region {region} (dim {d})")
            offset = sum(e - s for s, e in ivs[:i]) + a - ivs[i][0]
            slices.append(slice(offset, offset + b - a))
        return 0, tuple(slices)

    # ------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.explicit is not None:
            d["explicit"] = [[rank, [[list(r.starts), list(r.stops)] for r in regions]]
                             for rank, regions in self.explicit]
        else:
            d["mesh"] = self._mesh.to_dict()
            d["splits"] = [[s.dim, s.axis, s.split_factor] for s in self.splits]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layout:
        if "explicit" in d:
            return cls(tuple(d["shape"]), d["dtype"], None, (), tuple(
                (int(rank), tuple(Region(tuple(a), tuple(b)) for a, b in regions))
                for rank, regions in d["explicit"]))
        return cls(tuple(d["shape"]), d["dtype"], Mesh.from_dict(d["mesh"]),
                   tuple(Split(*s) for s in d["splits"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> Layout:
        return cls.from_dict(json.loads(text) if isinstance(text, (str, bytes)) else text)

    def __str__(self) -> str:
        head = f"{tuple(self.shape)} {self.dtype}"
        if self.explicit is not None:
            return f"Layout({head}, explicit over {len(self.explicit)} ranks)"
        parts = [f"d{sp.dim}<-{self._mesh.axis_label(sp.axis)}"
                 + (f"/sf{sp.split_factor}" if sp.split_factor > 1 else "") for sp in self.splits]
        return f"Layout({head} on {self.mesh}: {' '.join(parts) or 'replicated'})"


class LayoutMemo:
    """Layouts by an adapter's key (a sharding, a DTensor spec, plus the rank map), so a
    refit called every step gets the same :class:`Layout` objects back, with their geometry
    caches warm, instead of rebuilding thousands of equal ones (~0.2 ms each).

    ``ranks_id`` turns a rank map into a small int once per bind, so keys stay cheap to hash.
    Bounded: it forgets everything when it holds ``limit`` layouts. Layouts are interned
    (equal layouts are one object, caches warm): this memo saves an adapter's own conversion
    work. A ``Refit`` owns one (``Refit.layout_memo``, ``Tuning.layout_memo``) and hands it
    to its adapters' binds; there is no module state.
    """

    def __init__(self, limit: int = 1 << 16) -> None:
        self._layouts: dict[Any, Layout] = {}
        self._rank_maps: dict[Any, int] = {}
        self._limit = limit

    def ranks_id(self, ranks: Any) -> int | None:
        """A small int for a rank map (mapping), or None when it cannot key a memo."""
        if not isinstance(ranks, Mapping):
            return None
        key = tuple(sorted(ranks.items()))
        got = self._rank_maps.get(key)
        if got is None:
            if len(self._rank_maps) >= 1024:
                self._rank_maps.clear()
                self._layouts.clear()
            got = self._rank_maps[key] = len(self._rank_maps)
        return got

    def get(self, key: Any, make: Callable[[], Layout]) -> Layout:
        """The layout remembered under ``key``, else ``make()`` (remembered). A ``None`` key
        (nothing to key on) or an unhashable one is never remembered."""
        if key is None:
            return make()
        try:
            return self._layouts[key]
        except KeyError:
            pass
        except TypeError:
            return make()
        layout = make()
        if len(self._layouts) >= self._limit:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout
