"""The values layouts are made of: Region (a box), Mesh (a grid of ranks), Split (an axis
splitting a dim), and the intern tables that make equal meshes and layouts one object.

Equal meshes are one object: ``Mesh(...)`` equal to a live mesh returns that mesh, its
coordinate table built once (as ``jax.sharding.Mesh`` does with its cache). The tables hold
their values weakly. ``xreshard.ir.layout`` re-exports everything here.
"""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from ..errors import LayoutError

__all__ = ["Mesh", "Region", "Split"]

_T = TypeVar("_T")

if sys.version_info >= (3, 11):
    SLOTS: dict[str, bool] = {"slots": True, "weakref_slot": True}
    new_table: Callable[[], Any] = weakref.WeakValueDictionary
else:   # TODO(python 3.10): slotted dataclasses take weak references from 3.11 on
    SLOTS = {"slots": True}
    new_table = dict

#: a strong (python 3.10) intern table forgets everything at this size
_INTERN_LIMIT = 1 << 16

#: the live meshes by value
_MESHES: dict[Any, Any] = new_table()


def interned(table: Any, key: tuple[Any, ...], value: _T) -> _T:
    """The object equal to ``value`` already in ``table`` under ``key``, else ``value``
    (now interned). Two threads racing on one key may each get their own equal object."""
    got: _T | None = table.get(key)
    if got is not None:
        return got
    if type(table) is dict and len(table) >= _INTERN_LIMIT:
        table.clear()
    out: _T = table.setdefault(key, value)
    return out


@dataclass(frozen=True, slots=True)
class Region:
    """A box in a tensor's global coordinates: one ``[start, stop)`` per dim."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.stops):
            raise LayoutError(f"region starts {self.starts} and stops {self.stops} differ in "
                              "length (one start and one stop per dim)")
        if any(a < 0 or b < a for a, b in zip(self.starts, self.stops)):
            raise LayoutError(f"region {self.starts}..{self.stops} needs 0 <= start <= stop "
                              f"per dim")

    @classmethod
    def of(cls, bounds: Iterable[Sequence[int]]) -> Region:
        """``Region.of([(0, 4), (2, 6)])`` from one ``(start, stop)`` pair per dim."""
        pairs = [tuple(b) for b in bounds]
        return cls(tuple(int(p[0]) for p in pairs), tuple(int(p[1]) for p in pairs))

    @property
    def ndim(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.starts, self.stops))

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(b - a for a, b in zip(self.starts, self.stops))

    @property
    def is_empty(self) -> bool:
        return any(b == a for a, b in zip(self.starts, self.stops))

    def intersect(self, other: Region) -> Region | None:
        """The overlap of two regions, or None when they do not overlap."""
        starts = tuple(map(max, self.starts, other.starts))
        stops = tuple(map(min, self.stops, other.stops))
        if any(b <= a for a, b in zip(starts, stops)):
            return None
        return Region(starts, stops)

    def contains(self, other: Region) -> bool:
        return all(a <= c and d <= b for a, b, c, d in
                   zip(self.starts, self.stops, other.starts, other.stops))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.starts, self.stops))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.starts, self.stops)) + "]"


@dataclass(frozen=True, init=False, **SLOTS)
class Mesh:
    """An n-d grid of world ranks with optional axis names.

    ``ranks`` lists the world rank at each mesh coordinate in row-major order (default
    ``range(prod(shape))``). Equal meshes are one object (interned).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...] = ()        # () only before __new__ fills it in
    axis_names: tuple[str, ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False)
    _coords: dict[int, tuple[int, ...]] | None = field(init=False, repr=False, compare=False)

    def __new__(cls, shape: Sequence[int], ranks: Any = None,
                axis_names: Sequence[str] | None = None) -> Mesh:
        self = object.__new__(cls)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "axis_names", axis_names)
        self._normalize()
        return interned(_MESHES, (self.shape, self.ranks, self.axis_names), self)

    def __reduce__(self) -> tuple[Any, ...]:
        return Mesh, (self.shape, self.ranks, self.axis_names)

    def _normalize(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if any(s < 1 for s in shape):
            raise LayoutError(f"mesh shape {shape} needs every axis size >= 1")
        size = math.prod(shape)
        ranks = (tuple(range(size)) if self.ranks is None
                 else tuple(int(r) for r in flat(self.ranks)))
        if len(ranks) != size:
            raise LayoutError(f"mesh of shape {shape} has {size} positions but {len(ranks)} ranks "
                              "were given; list one world rank per mesh position, row-major")
        if len(set(ranks)) != len(ranks):
            dups = sorted({r for r in ranks if ranks.count(r) > 1})
            raise LayoutError(f"mesh ranks {dups} appear more than once; each world rank may sit "
                              "at one mesh position only")
        if any(r < 0 for r in ranks):
            raise LayoutError(f"mesh ranks must be >= 0, got {min(ranks)}")
        names = self.axis_names
        if names is not None:
            names = tuple(str(n) for n in names)
            if len(names) != len(shape):
                raise LayoutError(f"mesh of shape {shape} needs {len(shape)} axis names, "
                                  f"got {names}")
            if len(set(names)) != len(names):
                raise LayoutError(f"mesh axis names {names} must be distinct")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_hash", hash((shape, ranks, names)))
        object.__setattr__(self, "_coords", None)

    def __hash__(self) -> int:
        return self._hash

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coord(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of a world rank, or None when the rank is not in the mesh."""
        coords = self._coords
        if coords is None:     # built whole, then published: an interned mesh is shared
            coords = dict(zip(self.ranks, itertools.product(*map(range, self.shape))))
            object.__setattr__(self, "_coords", coords)
        return coords.get(rank)

    def rank_at(self, coord: Sequence[int]) -> int:
        pos = 0
        for c, s in zip(coord, self.shape):
            pos = pos * s + c
        return self.ranks[pos]

    def axis_index(self, axis: int | str) -> int:
        """Index of a mesh axis given by index or name."""
        if isinstance(axis, str):
            if self.axis_names is None or axis not in self.axis_names:
                raise LayoutError(f"mesh axis {axis!r} is not one of the mesh axis names "
                                  f"{self.axis_names}; name the axes with "
                                  f"Mesh(..., axis_names=...)")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise LayoutError(f"mesh axis {axis} out of range for a {self.ndim}-d mesh")
        return int(axis)

    def axis_label(self, axis: int) -> str:
        return self.axis_names[axis] if self.axis_names else str(axis)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "ranks": list(self.ranks),
                "axis_names": None if self.axis_names is None else list(self.axis_names)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mesh:
        names = d.get("axis_names")
        return cls(tuple(d["shape"]), tuple(d["ranks"]), None if names is None else tuple(names))

    def __str__(self) -> str:
        axes = ",".join(f"{self.axis_label(i)}={s}" for i, s in enumerate(self.shape))
        span = (f"{self.ranks[0]}..{self.ranks[-1]}"
                if self.size > 1 and self.ranks == tuple(range(self.ranks[0],
                                                               self.ranks[0] + self.size))
                else ",".join(map(str, self.ranks[:8])) + (",..." if self.size > 8 else ""))
        return f"mesh({axes})[{span}]"


@dataclass(frozen=True, slots=True)
class Split:
    """Mesh axis ``axis`` splits tensor dim ``dim``; ``split_factor`` > 1 is a strided split."""

    dim: int
    axis: int
    split_factor: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.split_factor == 1 else f"SS({self.dim},{self.split_factor})"


def flat(xs: Any) -> list[Any]:
    if hasattr(xs, "tolist"):
        xs = xs.tolist()
    if isinstance(xs, (list, tuple)):
        out: list[Any] = []
        for x in xs:
            out.extend(flat(x) if isinstance(x, (list, tuple)) or hasattr(x, "tolist") else [x])
        return out
    return [xs]
