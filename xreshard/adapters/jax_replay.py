"""A refit's warm send bind as a lookup: the last call's findings, checked against its arrays.

Decision record (issue 35, item 3: "binding of unchanged layouts is a lookup, not a walk"):

* A refit binds its JAX send side every call. After its geometries (sharding, shape,
  dtype) are known, what a call can change is only which arrays it holds: after an
  optimizer step every array is new, with new, equal shardings. Walking the tree leaf by
  leaf (the geometry lookups, the layout dict, grouping the small arrays for their stacks,
  a binding per shard made one at a time) cost ~6.8 ms of a 3,000-tensor bind (19 ms)
  before any shard was read, and another ~5 ms went to building the 12,000 bindings in
  Python.
* So a send bind that found every geometry already known and bound without errors is
  recorded (:class:`Replay`): the tree structure and names, each leaf's sharding, shape and
  dtype, the layouts, which leaves are viewed shard by shard and which are read through
  which stack, and the bindings' keys. The next call replays it when its tree has the same
  structure and names and every leaf the same geometry (compared leaf by leaf: identity
  first, then each distinct sharding once by value, so an optimizer step's new shardings
  cost a comparison each, not one per leaf), under the same geometry cache, memo,
  ``transpose``, local ranks and stack refusals. It reads the shards exactly as the walk
  would (:func:`~xreshard.adapters.jax_stack.shard_views`, the same stacks) and makes the
  same bindings in the same order; the stacks' rows come from numpy's own iteration over
  a block and the keys from the record.
* Anything else (a leaf that is not an array, a new geometry, a refused stack, a call
  with errors) takes the walk, which records again when it may.
* Kept out: the receiving side (its landing buffers and unstacks are per call) and the
  naming-rules path (``bind_named``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from xreshard.ir.layout import Layout
from xreshard.runtime.binding import RowBindings
from xreshard.adapters import jax_stack
from xreshard.adapters.jax_stack import as_binding, put_views, refused_count, shard_views

__all__ = ["Group", "Replay", "Step", "View", "geometry_agrees", "record", "replay", "replayed"]


@dataclass(frozen=True)
class View:
    """A leaf bound shard by shard: its index in the tree, name, whether its canonical
    layout is its transpose, whether that layout is product form, its shards' ranks."""

    index: int
    name: str
    flip: bool
    product: bool
    shard_ranks: list | None


@dataclass(frozen=True)
class Group:
    """Leaves of one geometry read through stacks: the geometry, the stack's sharding,
    the shard shape, the leaves' indices, the world ranks of the stack's blocks in its
    per-device order, and for each chunk the bindings' keys in the walk's order (leaf by
    leaf, rank by rank)."""

    key: Any
    out: Any
    shard_shape: tuple[int, ...]
    indices: list[int]
    ranks: list[int]
    keys: list[list[tuple[int, str]]]
    forms: tuple | None         # None: each binding is its row; else per member (whether
                                # transposed, whether product form: [row] when not)


Step = View | Group


@dataclass(frozen=True)
class Replay:
    """What a send bind found, and what it was found under (see the module's docstring)."""

    geometry: dict
    memo: Any
    names: list
    transpose: frozenset
    local_ranks: frozenset
    refused: int
    shardings: list             # each leaf's
    canonical: list             # each leaf's, one object per distinct value (canon's)
    canon: dict                 # a sharding -> the equal one in canonical
    shapes: list
    dtypes: list
    layouts: dict
    steps: list[Step]           # in the walk's order, so the bindings are made in it too
    checked: bool
    rows: dict                  # a stacked binding's key -> (block, row): RowBindings


def record(*, geometry: dict, memo: Any, names: list, transpose: frozenset,
           local_ranks: frozenset, refused: int, leaves: Sequence[Any], layouts: dict,
           views: list[View], stacks: dict, checked: bool,
           shard_ranks: Callable[[Any], list | None], previous: Replay | None = None
           ) -> Replay | None:
    """A :class:`Replay` of a walk that bound ``leaves`` (``views``: those it viewed shard
    by shard; ``stacks``: geometry -> ``[(name, leaf, flip, product)]``, as the walk hands
    them to :func:`~xreshard.adapters.jax_stack.bind_stacks`), or None when it cannot be
    replayed as a lookup (a stack's ranks unknown).
    Its ``rows`` are ``previous``'s object when equal, so plans made from them stay."""
    from xreshard.adapters.jax_stack import MIN_GROUP, chunk_size
    index = {name: i for i, name in enumerate(names)}
    steps: list[Step] = list(views)
    for key, members in stacks.items():
        if len(members) < MIN_GROUP:        # viewed shard by shard (bind_stacks)
            steps.extend(View(index[name], name, flip, product, geometry[key][1])
                         for name, _, flip, product in members)
            continue
        forms = tuple((flip, product) for _, _, flip, product in members)
        out, shard_shape = geometry[key][3]
        ranks = shard_ranks(out)
        if ranks is None:
            return None
        k = chunk_size(len(members))
        ordered = [r for r, _ in ranks]
        member_names = [name for name, _, _, _ in members]
        keys = [[(r, name) for name in member_names[s:s + k] for r in ordered]
                for s in range(0, len(members), k)]
        steps.append(Group(key, out, shard_shape, [index[n] for n in member_names],
                           ordered, keys,
                           None if all(f == (False, True) for f in forms) else forms))
    canon: dict = {}                # equal shardings -> one of them
    shardings = [leaf.sharding for leaf in leaves]
    return Replay(geometry, memo, names, transpose, local_ranks, refused,
                  shardings, [canon.setdefault(s, s) for s in shardings], canon,
                  [leaf.shape for leaf in leaves], [leaf.dtype for leaf in leaves],
                  layouts, steps, checked, _same_or(_rows(steps), previous))


def _same_or(rows: dict, previous: Replay | None) -> dict:
    return previous.rows if previous is not None and previous.rows == rows else rows


def _rows(steps: list[Step]) -> dict[tuple[int, str], tuple[int, int]]:
    """Each stacked binding's (block, row): blocks numbered as :func:`replay` lists them
    (group by group, chunk by chunk, the stack's ranks in order)."""
    rows: dict[tuple[int, str], tuple[int, int]] = {}
    block = 0
    for step in steps:
        if isinstance(step, View):
            continue
        start = 0
        for keys in step.keys:
            n = len(step.ranks)
            for p in range(n):              # a binding that is its row as it is
                rows.update((key, (block + p, i)) for i, key in enumerate(keys[p::n])
                            if step.forms is None or step.forms[start + i] == (False, True))
            block += n
            start += len(keys) // n
    return rows


def replayed(rec: Replay | None, *, geometry: dict, memo: Any, names: list, transpose: frozenset,
             local_ranks: frozenset, leaves: list, per_device: dict,
             rank_of: Callable[[Any], int], shard_ranks: Callable[[Any], list | None]
             ) -> tuple[dict, dict, bool] | None:
    """:func:`replay` of a refit's kept record when it was made under this call's geometry
    cache, memo, names (the same list: the tree's structure and names did not change),
    ``transpose`` and local ranks; None otherwise (the caller walks)."""
    if rec is None or rec.geometry is not geometry or rec.memo is not memo \
            or rec.names is not names or rec.transpose != transpose \
            or rec.local_ranks != local_ranks:
        return None
    return replay(rec, leaves, per_device, rank_of, shard_ranks)


def replay(rec: Replay, leaves: list, per_device: dict, rank_of: Callable[[Any], int],
           shard_ranks: Callable[[Any], list | None]) -> tuple[dict, dict, bool] | None:
    """(layouts, bindings, checked) of ``leaves`` bound as ``rec`` says, or None when the
    leaves' geometries are not the recorded ones, or a stack failed (the caller walks)."""
    if len(leaves) != len(rec.shardings) or refused_count() != rec.refused:
        return None
    try:
        shardings = [leaf.sharding for leaf in leaves]
        shapes = [leaf.shape for leaf in leaves]
        dtypes = [leaf.dtype for leaf in leaves]
    except AttributeError:          # not an array
        return None
    if shapes != rec.shapes or dtypes != rec.dtypes or not _same_shardings(shardings, rec):
        return None
    bindings: dict = {}
    hosts: list = []            # the blocks, as _rows numbers them
    ordered = True
    for step in rec.steps:
        if isinstance(step, View):
            got, in_order = shard_views(leaves[step.index], step.shard_ranks, per_device,
                                        rank_of)
            ordered = ordered and in_order
            put_views(bindings, step.name, got, step.flip, step.product)
            continue
        blocks = jax_stack.stack_blocks(step.key, step.out, [leaves[i] for i in step.indices],
                                        step.shard_shape, shard_ranks)
        if blocks is None:
            return None
        start = 0
        for (per_device_blocks, size), keys in zip(blocks, step.keys):
            if [r for r, _ in per_device_blocks] != step.ranks:
                return None
            hosts.extend(host for _, host in per_device_blocks)
            # a block's rows as views, by numpy's own iteration (host[i, ...] for scalars)
            rows = [list(host[:size]) if step.shard_shape else
                    [host[i, ...] for i in range(size)] for _, host in per_device_blocks]
            if step.forms is not None:
                forms = step.forms[start:start + size]
                rows = [[as_binding(r, *f) for r, f in zip(per, forms)] for per in rows]
            start += size
            bindings.update(zip(keys, chain.from_iterable(zip(*rows))))
    return dict(rec.layouts), RowBindings(bindings, rec.rows, hosts), rec.checked and ordered


def _same_shardings(shardings: list, rec: Replay) -> bool:
    """Whether each leaf's sharding equals the recorded one: by identity, or through the
    few distinct sharding objects of this call, each looked up by value once."""
    if all(map(operator.is_, shardings, rec.shardings)):
        return True
    found: dict[int, Any] = {}
    for s in {id(s): s for s in shardings}.values():
        try:
            same = rec.canon.get(s)
        except TypeError:           # unhashable
            return False
        if same is None:
            return False
        found[id(s)] = same
    return all(map(operator.is_, (found[id(s)] for s in shardings), rec.canonical))


def geometry_agrees(leaf: Any, layout: Layout, shard_ranks: list | None,
                    local_ranks: frozenset[int]) -> bool:
    """Whether every array of ``leaf``'s (sharding, shape, dtype) binds exactly what
    ``layout`` gives its ranks: JAX gives each per-device array of such an array the shape
    ``sharding.shard_shape(shape)`` and the array's dtype, so comparing that once with the
    layout's local shape of each addressable rank (and the dtypes) checks every later
    array of the geometry; and every rank of this process (``local_ranks``) the layout
    gives elements must be one of them. False (checked per call instead) when JAX does not
    list the shards' devices, or for an explicit layout."""
    from xreshard.dtypes import numpy_dtype
    if shard_ranks is None or not layout.is_product:
        return False
    try:
        shard_shape = tuple(leaf.sharding.shard_shape(tuple(leaf.shape)))
        same_dtype = numpy_dtype(layout.dtype) == leaf.dtype    # leaf.dtype: a numpy dtype
    except Exception:   # noqa: BLE001 - anything odd: the refit's own check decides
        return False
    ranks = [rank for rank, _ in shard_ranks]
    held = {r for r in layout.rank_set if r in local_ranks and layout.num_elements(r)}
    return (same_dtype and len(set(ranks)) == len(ranks) and held <= set(ranks) <= layout.rank_set
            and all(tuple(layout.local_shape(rank)) == shard_shape for rank in ranks))
