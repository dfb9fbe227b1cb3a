"""The planner: which bytes go from which source rank to which destination rank.

Pure metadata in, metadata out. Every rank computes the same plan from the same layouts, so
no plan is ever shipped between ranks.

How it works (and why it is fast):

1. *Templates.* Tensors with the same (source layout, destination layout) share one
   template: the pieces every destination rank needs, each with the set of source ranks
   holding it. Pieces come from per-dim interval merging (product layouts partition every
   dim; a destination interval is cut at the source boundaries, and the Cartesian product
   over dims gives boxes), never from all (src rank, dst rank) pairs. The 61 layers of a
   model share a handful of templates.
2. *Classes.* A piece's candidate senders are its holders, narrowed by locality: the
   destination rank itself (then it is a local copy, not a transfer), else holders in the
   same process, else on the same host, else all. Pieces with the same candidate set form a
   class; a class's pieces, over the whole model in a fixed order, are one byte stream.
3. *Balance.* The stream of every class is cut into contiguous quotas, one per candidate,
   chosen by a max-flow so the most loaded sender carries the least possible: the exact
   optimum when regions may be split among their holders. A piece crossing a quota
   boundary is split along its outermost dim (rows rounded), so balance is exact up to a
   row. This dominates "least loaded so far" greedy choice and is computed from per-class
   totals, not per piece.
4. *Lazy transfers.* ``plan.transfers_for(rank)`` walks only that rank's pieces (as a
   receiver) and its quota ranges (as a sender), so a rank pays for its own transfers.
"""

from __future__ import annotations

import itertools
import logging
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from .balance import balance, split_piece
from .dtypes import dtype_name, itemsize
from .errors import PlanError
from .layout import Layout, Region
from .topology import Topology

logger = logging.getLogger(__name__)

Holders = tuple[int, ...]
_MAX_LISTED = 20


@dataclass(frozen=True, slots=True)
class Transfer:
    """``region`` of tensor ``name`` goes from rank ``src`` to rank ``dst`` (``nbytes`` on the wire)."""

    name: str
    region: Region
    src: int
    dst: int
    nbytes: int

    def __str__(self) -> str:
        return f"{self.name}{self.region} {self.src}->{self.dst} ({self.nbytes} B)"


@dataclass(frozen=True)
class PlanStats:
    """What a plan moves. Bytes are wire bytes (after any cast)."""

    bytes_moved: int
    """Bytes crossing between ranks (local copies excluded)."""
    bytes_min: int
    """The minimum: every byte a destination rank holds but does not already own, once."""
    bytes_gather_broadcast: int
    """Gather-and-broadcast: each full tensor gathered once, then sent to every destination
    rank holding any of it."""
    bytes_local: int
    """Bytes copied within a rank (colocated source and destination)."""
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    sender_lower_bound: int
    """Least possible max bytes sent by one rank when every region may be split among the
    ranks holding it (exact, by max-flow)."""
    sender_balance: float
    """max bytes sent by one rank / sender_lower_bound (1.0 is optimal)."""
    sender_balance_mean: float
    """max bytes sent by one rank / mean over source ranks."""
    num_transfers: int
    num_local_copies: int
    num_tensors: int
    num_templates: int
    plan_seconds: float

    def to_dict(self, per_rank: bool = False) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__
             if per_rank or k not in ("bytes_sent", "bytes_received")}
        d["max_bytes_sent"] = max(self.bytes_sent.values(), default=0)
        d["max_bytes_received"] = max(self.bytes_received.values(), default=0)
        if per_rank:
            d["bytes_sent"] = {str(k): v for k, v in sorted(self.bytes_sent.items())}
            d["bytes_received"] = {str(k): v for k, v in sorted(self.bytes_received.items())}
        return d

    def __str__(self) -> str:
        gib = 1 << 30
        rows = [
            ("tensors", f"{self.num_tensors} ({self.num_templates} layout pairs)"),
            ("bytes moved", f"{self.bytes_moved / gib:.3f} GiB"),
            ("minimum", f"{self.bytes_min / gib:.3f} GiB (moved/min "
                        f"{self.bytes_moved / max(self.bytes_min, 1):.3f})"),
            ("gather+broadcast", f"{self.bytes_gather_broadcast / gib:.3f} GiB "
                                 f"({self.bytes_gather_broadcast / max(self.bytes_moved, 1):.1f}x moved)"),
            ("local copies", f"{self.bytes_local / gib:.3f} GiB in {self.num_local_copies}"),
            ("max sent / rank", f"{max(self.bytes_sent.values(), default=0) / gib:.3f} GiB"),
            ("max received / rank", f"{max(self.bytes_received.values(), default=0) / gib:.3f} GiB"),
            ("sender balance", f"{self.sender_balance:.4f} x lower bound, "
                               f"{self.sender_balance_mean:.3f} x mean"),
            ("transfers", str(self.num_transfers)),
            ("plan time", f"{self.plan_seconds:.3f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------- templates

@dataclass(slots=True)
class _Template:
    """The pieces of one (source layout, destination layout) pair, in elements.

    Destination ranks holding the same intervals (replicas) share one group entry.
    """

    groups: list[tuple[Region, Holders, tuple[int, ...], int]]   # region, holders, receivers, elems
    local: list[tuple[Region, tuple[int, ...], int]]             # region, ranks owning it, elems
    min_elems: int                                               # elements destinations lack
    num_dst_ranks: int                                           # ranks holding any element


def _overlaps(starts: list[int], segs: list[tuple[int, int, Any]],
              intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int, Any]]:
    out = []
    for a, b in intervals:
        i = max(bisect_right(starts, a) - 1, 0)
        while i < len(segs) and segs[i][0] < b:
            s, e, key = segs[i]
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                out.append((lo, hi, key))
            i += 1
    return out


def _rank_groups(layout: Layout) -> list[tuple[tuple, tuple[int, ...]]]:
    """Product layout: ranks grouped by the intervals they hold (replicas share a group)."""
    got = layout._cache.get("groups")
    if got is None:
        groups: dict[tuple, list[int]] = {}
        for rank in layout.mesh.ranks:
            per_dim = layout.dim_intervals(rank)
            if all(per_dim):
                groups.setdefault(per_dim, []).append(rank)
        got = layout._cache["groups"] = [(k, tuple(v)) for k, v in groups.items()]
    return got


def _product_pieces(src: Layout, dst: Layout
                    ) -> Iterator[tuple[tuple[int, ...], Region, Holders]]:
    """(receiving ranks, region, holders) for two product layouts, by per-dim merging."""
    ndim = src.ndim
    src_axes = [src.dim_axes(d) for d in range(ndim)]
    segs = []
    for d in range(ndim):
        items = sorted((s, e, key) for key, ivs in src.dim_table(d).items() for s, e in ivs)
        segs.append(([s for s, _, _ in items], items))
    holders_memo: dict[tuple, Holders] = {}
    for per_dim, ranks in _rank_groups(dst):
        dim_lists = [_overlaps(*segs[d], per_dim[d]) for d in range(ndim)]
        for combo in itertools.product(*dim_lists):
            keys = tuple(k for _, _, k in combo)
            holders = holders_memo.get(keys)
            if holders is None:
                fixed = {a: c for d in range(ndim) for a, c in zip(src_axes[d], keys[d])}
                coords = [[fixed[a]] if a in fixed else range(src.mesh.shape[a])
                          for a in range(src.mesh.ndim)]
                holders = tuple(sorted(src.mesh.rank_at(c) for c in itertools.product(*coords)))
                holders_memo[keys] = holders
            yield ranks, Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo)), holders


def _general_pieces(src: Layout, dst: Layout, name: str, problems: list[str]
                    ) -> Iterator[tuple[tuple[int, ...], Region, Holders]]:
    """Pieces when either side is explicit: refine each destination region on all boundaries."""
    # a holder is (rank, which of its local buffers): a rank holding two pieces of a cell in
    # two buffers must not be asked for the cell as one view
    src_held = [((r, i), reg) for r in src.ranks for i, reg in enumerate(src.regions(r))]
    for rank in sorted(dst.ranks):
        for want in dst.regions(rank):
            if want.is_empty:
                continue
            inter = [(r, x) for r, reg in src_held if (x := want.intersect(reg)) is not None]
            cuts = []
            for d in range(want.ndim):
                pts = {want.starts[d], want.stops[d]}
                for _, x in inter:
                    pts.update((x.starts[d], x.stops[d]))
                pts = sorted(pts)
                cuts.append(list(zip(pts, pts[1:])))
            cells: list[tuple[Region, tuple]] = []
            for combo in itertools.product(*cuts):
                cell = Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
                holders = tuple(sorted(h for h, x in inter if x.contains(cell)))
                if not holders:
                    problems.append(f"tensor {name!r}: destination rank {rank} needs region "
                                    f"{cell} but no source rank holds it")
                    continue
                prev = cells[-1][0] if cells else None
                if prev is not None and cells[-1][1] == holders and want.ndim and \
                        prev.starts[:-1] == cell.starts[:-1] and \
                        prev.stops[:-1] == cell.stops[:-1] and prev.stops[-1] == cell.starts[-1]:
                    # merge runs along the last dim that share holders (row-major order)
                    cells[-1] = (Region(prev.starts, prev.stops[:-1] + cell.stops[-1:]), holders)
                else:
                    cells.append((cell, holders))
            for cell, holders in cells:
                yield (rank,), cell, tuple(sorted({r for r, _ in holders}))


def _build_template(src: Layout, dst: Layout, name: str, problems: list[str]) -> _Template:
    if src.is_product and dst.is_product:
        raw = _product_pieces(src, dst)
    else:
        raw = _general_pieces(src, dst, name, problems)
    src_ranks = src.rank_set
    colocated = not src_ranks.isdisjoint(dst.rank_set)
    groups, local = [], []
    for ranks, region, holders in raw:
        n = region.size
        if colocated and not src_ranks.isdisjoint(ranks):
            owners = tuple(r for r in ranks if r in holders)
            if owners:
                local.append((region, owners, n))
                ranks = tuple(r for r in ranks if r not in holders)
                if not ranks:
                    continue
        groups.append((region, holders, ranks, n))
    # the minimum, from the layouts alone: what each destination rank holds minus what it
    # already owns as a source
    min_elems = num_dst = 0
    if dst.is_product:
        for _, ranks in _rank_groups(dst):
            n = dst.num_elements(ranks[0])
            num_dst += len(ranks)
            min_elems += n * len(ranks)
    else:
        for rank in dst.ranks:
            n = dst.num_elements(rank)
            num_dst += n > 0
            min_elems += n
    if colocated:
        for rank in dst.rank_set & src_ranks:
            owns = src.regions(rank)
            for w in dst.regions(rank):
                min_elems -= sum(x.size for o in owns if (x := w.intersect(o)) is not None)
    return _Template(groups, local, min_elems, num_dst)


# ---------------------------------------------------------------------------- views

class _Sub:
    """Receivers of one template group that share a sender class (locality may split a group)."""

    __slots__ = ("group", "cls", "slot", "ranks", "tid", "nbytes", "offset")

    def __init__(self, group: int, cls: int, slot: int, ranks: tuple[int, ...], tid: int,
                 nbytes: int, offset: int):
        self.group = group      # index into template.groups
        self.cls = cls          # sender class
        self.slot = slot        # index of cls among the view's multi-holder classes, or -1
        self.ranks = ranks      # receivers, stream order
        self.tid = tid          # interned id of `ranks`
        self.nbytes = nbytes    # bytes per receiver
        self.offset = offset    # byte offset of the first receiver in this view's class share


@dataclass(slots=True)
class _View:
    """A template at one wire itemsize under one topology."""

    template: _Template
    itemsize: int
    subs: list[_Sub]
    class_order: list[int]
    class_bytes: list[int]
    class_subs: dict[int, tuple[list[int], list[int]]]   # class -> (sub indices, offsets)
    multi_order: list[int]                               # classes with several holders
    multi_bytes: list[int]


# ---------------------------------------------------------------------------- the plan

class Plan:
    """All transfers of a refit (listed lazily per rank) and their statistics.

    Build with :func:`plan`. ``transfers_for(rank)`` lists a rank's sends and receives;
    ``local_copies_for(rank)`` its same-rank copies (colocated layouts).
    """

    def __init__(self, names: list[str], src: Mapping[str, Layout], dst: Mapping[str, Layout],
                 wire_dtypes: dict[str, str]):
        self.names = names
        self.src = src
        self.dst = dst
        self.wire_dtypes = wire_dtypes
        self.stats: PlanStats
        self._views: list[_View] = []
        self._view_of: list[int] = []
        self._classes: list[Holders] = []
        self._bounds: list[list[int]] = []
        self._tensor_list: list[list[int]] = []     # per class: tensors in stream order
        self._tensor_cum: list[list[int]] = []      # per class: stream offset of each tensor
        self._tensor_starts: list[tuple[int, ...]] = []   # per tensor: offset per view slot
        self._rank_tuples: list[tuple[int, ...]] = []
        self._sender_classes: dict[int, list[int]] = {}
        self._class_views: dict[int, list[int]] = {}     # single-holder class -> views
        self._view_tensors: dict[int, list[int]] = {}    # view -> tensors, in order
        self._memo: dict[int, tuple[Transfer, ...]] = {}

    def __repr__(self) -> str:
        return (f"Plan({len(self.names)} tensors, {self.stats.num_transfers} transfers, "
                f"{self.stats.bytes_moved} bytes)")

    def __str__(self) -> str:
        return str(self.stats)

    def transfers_for(self, rank: int) -> tuple[Transfer, ...]:
        """Every transfer ``rank`` receives (first) or sends, in plan order."""
        got = self._memo.get(rank)
        if got is None:
            got = self._transfers_for(rank)
            if len(self._memo) >= 16:     # a process asks for its own few ranks, repeatedly
                self._memo.pop(next(iter(self._memo)))
            self._memo[rank] = got
        return got

    def _transfers_for(self, rank: int) -> tuple[Transfer, ...]:
        out: list[Transfer] = []
        position = {}
        for tid, ranks in enumerate(self._rank_tuples):
            if rank in ranks:
                position[tid] = ranks.index(rank)
        mine: dict[int, list[tuple[_Sub, int]]] = {}
        if position:
            for t, name in enumerate(self.names):
                v = self._view_of[t]
                subs = mine.get(v)
                if subs is None:
                    subs = mine[v] = [(sub, position[sub.tid]) for sub in self._views[v].subs
                                      if sub.tid in position]
                if not subs:
                    continue
                groups = self._views[v].template.groups
                starts = self._tensor_starts[t]
                for sub, pos in subs:
                    region = groups[sub.group][0]
                    holders = self._classes[sub.cls]
                    if len(holders) == 1:
                        out.append(Transfer(name, region, holders[0], rank, sub.nbytes))
                        continue
                    start = starts[sub.slot] + sub.offset + pos * sub.nbytes
                    for j, part, nb in split_piece(region, sub.nbytes, start, self._bounds[sub.cls]):
                        out.append(Transfer(name, part, holders[j], rank, nb))
        for c in self._sender_classes.get(rank, ()):
            if len(self._classes[c]) == 1:
                out.extend(self._sends_whole_class(rank, c))
            else:
                out.extend(self._sends_in_class(rank, c))
        return tuple(out)

    def _sends_whole_class(self, rank: int, c: int) -> Iterator[Transfer]:
        """Every piece of a class ``rank`` alone holds (view by view, tensors in order)."""
        for v in self._class_views.get(c, ()):
            view = self._views[v]
            subs = [view.subs[i] for i in view.class_subs[c][0]]
            groups = view.template.groups
            for t in self._view_tensors[v]:
                name = self.names[t]
                for sub in subs:
                    region = groups[sub.group][0]
                    for dst in sub.ranks:
                        yield Transfer(name, region, rank, dst, sub.nbytes)

    def _sends_in_class(self, rank: int, c: int) -> Iterator[Transfer]:
        holders, bounds = self._classes[c], self._bounds[c]
        j = holders.index(rank)
        lo, hi = bounds[j], bounds[j + 1]
        if lo == hi:
            return
        tlist, tcum = self._tensor_list[c], self._tensor_cum[c]
        # a piece crossing `lo` that cannot be cut belongs to the previous holder, one
        # starting before `hi` may run past it: walk from the piece holding `lo` to `hi`
        i = max(bisect_right(tcum, lo) - 1, 0)
        while i < len(tlist) and tcum[i] < hi:
            t = tlist[i]
            view = self._views[self._view_of[t]]
            base, name = tcum[i], self.names[t]
            idx, offs = view.class_subs[c]
            k = max(bisect_right(offs, lo - base) - 1, 0)
            while k < len(idx) and base + offs[k] < hi:
                sub = view.subs[idx[k]]
                region = view.template.groups[sub.group][0]
                first = base + offs[k]
                b = sub.nbytes
                p0 = max(0, (lo - first) // b) if b else 0
                p1 = min(len(sub.ranks), -(-(hi - first) // b)) if b else len(sub.ranks)
                for p in range(p0, p1):
                    for owner, part, nb in split_piece(region, b, first + p * b, bounds):
                        if owner == j:
                            yield Transfer(name, part, rank, sub.ranks[p], nb)
                k += 1
            i += 1

    def local_copies_for(self, rank: int) -> tuple[Transfer, ...]:
        """Regions ``rank`` holds on both sides: copied within the rank, never sent."""
        out = []
        for t, name in enumerate(self.names):
            view = self._views[self._view_of[t]]
            for region, owners, n in view.template.local:
                if rank in owners:
                    out.append(Transfer(name, region, rank, rank, n * view.itemsize))
        return tuple(out)

    def iter_transfers(self) -> Iterator[Transfer]:
        """Every transfer of the plan, by receiver. Costs time proportional to the world."""
        for rank in sorted({r for ranks in self._rank_tuples for r in ranks}):
            for tr in self.transfers_for(rank):
                if tr.dst == rank:
                    yield tr

    def _piece_at(self, c: int, x: int) -> tuple[Region, int, int] | None:
        """The piece of class ``c``'s stream holding byte ``x``: (region, start, bytes)."""
        tcum = self._tensor_cum[c]
        pos = bisect_right(tcum, x) - 1
        if pos < 0:
            return None
        view = self._views[self._view_of[self._tensor_list[c][pos]]]
        idx, offs = view.class_subs[c]
        k = bisect_right(offs, x - tcum[pos]) - 1
        sub = view.subs[idx[k]]
        first = tcum[pos] + offs[k]
        p = (x - first) // sub.nbytes if sub.nbytes else 0
        return view.template.groups[sub.group][0], first + p * sub.nbytes, sub.nbytes


class PlanCache:
    """Templates keyed on (source layout, destination layout); reuse across plan() calls."""

    def __init__(self) -> None:
        self.templates: dict[tuple[Layout, Layout], _Template] = {}

    def __len__(self) -> int:
        return len(self.templates)


def _validate(src: Mapping[str, Layout], dst: Mapping[str, Layout],
              wire_dtype: str | Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    only_src = sorted(set(src) - set(dst))
    only_dst = sorted(set(dst) - set(src))
    problems = []

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
        return ", ".join(repr(n) for n in names[:_MAX_LISTED]) + more

    if only_src:
        problems.append(f"{len(only_src)} tensor(s) only on the source side: {listed(only_src)}")
    if only_dst:
        problems.append(f"{len(only_dst)} tensor(s) only on the destination side: "
                        f"{listed(only_dst)}")
    names = sorted(set(src) & set(dst))
    wire: dict[str, str] = {}
    shape_bad, dtype_bad = [], []
    for name in names:
        s, d = src[name], dst[name]
        if s.shape != d.shape:
            shape_bad.append(f"{name!r} source {s.shape} vs destination {d.shape}")
        cast = wire_dtype.get(name) if isinstance(wire_dtype, Mapping) else wire_dtype
        if cast is None:
            if s.dtype != d.dtype:
                dtype_bad.append(f"{name!r} source {s.dtype} vs destination {d.dtype}")
            wire[name] = d.dtype
        else:
            wire[name] = cast
    if shape_bad:
        problems.append(f"shape mismatch in {len(shape_bad)} tensor(s): "
                        + "; ".join(shape_bad[:_MAX_LISTED])
                        + (f"; and {len(shape_bad) - _MAX_LISTED} more" if len(shape_bad) > _MAX_LISTED else ""))
    if dtype_bad:
        problems.append(f"dtype mismatch in {len(dtype_bad)} tensor(s) and no cast requested: "
                        + "; ".join(dtype_bad[:_MAX_LISTED])
                        + (" ..." if len(dtype_bad) > _MAX_LISTED else "")
                        + " - pass wire_dtype= (e.g. RefitConfig(wire_dtype='bfloat16')) to cast "
                          "on the sender")
    if problems:
        raise PlanError("cannot plan this refit:\n  " + "\n  ".join(problems))
    return names, wire


def plan(src: Mapping[str, Layout], dst: Mapping[str, Layout], world: Any = None, *,
         wire_dtype: object = None, cache: PlanCache | None = None) -> Plan:
    """Plan a refit from ``src`` to ``dst`` layouts (``{tensor name: Layout}``).

    Args:
        src: source layouts, one per tensor.
        dst: destination layouts, same tensor names and shapes.
        world: a ``World`` or ``Topology`` saying which process and host own each rank;
            None means every rank is its own host.
        wire_dtype: cast to this dtype on the sender (one dtype for every tensor, or a
            mapping name -> dtype for some); None requires equal dtypes.
        cache: templates to reuse across calls.

    Returns:
        The plan. Deterministic: the same inputs give the same plan on every rank.

    Raises:
        PlanError: names missing on one side (all listed), shape or dtype mismatches, or a
            destination region no source rank holds.
    """
    t0 = time.perf_counter()
    if isinstance(wire_dtype, Mapping):
        wire_name: Any = {n: dtype_name(d) for n, d in wire_dtype.items()}
    else:
        wire_name = None if wire_dtype is None else dtype_name(wire_dtype)
    names, wire = _validate(src, dst, wire_name)
    topology: Topology | None = getattr(world, "topology", world)
    cache = cache if cache is not None else PlanCache()
    result = Plan(names, src, dst, wire)

    # 1. templates, one per layout pair
    problems: list[str] = []
    tpl_index: dict[tuple[Layout, Layout], int] = {}
    templates: list[_Template] = []
    view_keys: list[tuple[int, int]] = []
    for name in names:
        key = (src[name], dst[name])
        i = tpl_index.get(key)
        if i is None:
            tpl = cache.templates.get(key)
            if tpl is None:
                before = len(problems)
                tpl = _build_template(key[0], key[1], name, problems)
                if len(problems) == before:
                    cache.templates[key] = tpl
            i = tpl_index[key] = len(templates)
            templates.append(tpl)
        view_keys.append((i, itemsize(wire[name])))
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise PlanError("destination regions that no source rank holds:\n  "
                        + "\n  ".join(problems[:_MAX_LISTED]) + more
                        + "\nthe source layouts must cover every element a destination holds")

    # 2. sender classes: holders narrowed by locality, per view
    classes, class_id = result._classes, {}
    rank_tuples, tuple_id = result._rank_tuples, {}
    narrow_memo: dict[tuple[Holders, int], Holders] = {}

    def narrow(holders: Holders, dst_rank: int) -> Holders:
        key = (holders, dst_rank)
        got = narrow_memo.get(key)
        if got is None:
            proc, host = topology.process_of(dst_rank), topology.host_of(dst_rank)
            got = (tuple(h for h in holders if proc is not None and topology.process_of(h) == proc)
                   or tuple(h for h in holders if host is not None and topology.host_of(h) == host)
                   or holders)
            narrow_memo[key] = got
        return got

    def intern(xs: tuple, table: dict, store: list) -> int:
        i = table.get(xs)
        if i is None:
            i = table[xs] = len(store)
            store.append(xs)
        return i

    views, view_index = result._views, {}
    for vk in view_keys:
        v = view_index.get(vk)
        if v is None:
            tpl, size = templates[vk[0]], vk[1]
            subs, order, cbytes, slot_of = [], [], [], {}
            for g, (_, holders, ranks, n) in enumerate(tpl.groups):
                if topology is None or len(holders) == 1:
                    split = [(holders, ranks)]
                else:
                    by_cls: dict[Holders, list[int]] = {}
                    for r in ranks:
                        by_cls.setdefault(narrow(holders, r), []).append(r)
                    split = [(h, tuple(rs)) for h, rs in by_cls.items()]
                for h, rs in split:
                    c = intern(h, class_id, classes)
                    slot = slot_of.get(c)
                    if slot is None:
                        slot = slot_of[c] = len(order)
                        order.append(c)
                        cbytes.append(0)
                    subs.append(_Sub(g, c, slot, rs, intern(rs, tuple_id, rank_tuples),
                                     n * size, cbytes[slot]))
                    cbytes[slot] += n * size * len(rs)
            class_subs: dict[int, tuple[list[int], list[int]]] = {c: ([], []) for c in order}
            for i, sub in enumerate(subs):
                class_subs[sub.cls][0].append(i)
                class_subs[sub.cls][1].append(sub.offset)
            # only classes with several holders need stream offsets (quotas cut them);
            # a single holder sends its whole class
            multi = [k for k, c in enumerate(order) if len(classes[c]) > 1]
            mslot = {k: i for i, k in enumerate(multi)}
            for sub in subs:
                sub.slot = mslot.get(sub.slot, -1)
            v = view_index[vk] = len(views)
            views.append(_View(tpl, size, subs, order, cbytes, class_subs,
                               [order[k] for k in multi], [cbytes[k] for k in multi]))
        result._view_of.append(v)

    # 3. one byte stream per multi-holder class over the model, in tensor order
    counts = Counter(result._view_of)
    totals = [0] * len(classes)
    for v, cnt in counts.items():
        for c, b in zip(views[v].class_order, views[v].class_bytes):
            if len(classes[c]) == 1:
                totals[c] += cnt * b
                result._class_views.setdefault(c, []).append(v)
    tensor_list = result._tensor_list = [[] for _ in classes]
    tensor_cum = result._tensor_cum = [[] for _ in classes]
    for t, v in enumerate(result._view_of):
        view = views[v]
        result._view_tensors.setdefault(v, []).append(t)
        starts = []
        for c, b in zip(view.multi_order, view.multi_bytes):
            tensor_list[c].append(t)
            tensor_cum[c].append(totals[c])
            starts.append(totals[c])
            totals[c] += b
        result._tensor_starts.append(tuple(starts))

    # 4. balance: contiguous quotas per class from a max-flow
    fixed: dict[int, int] = {}
    demand: dict[Holders, int] = {}
    for c, h in enumerate(classes):
        if len(h) == 1:
            fixed[h[0]] = fixed.get(h[0], 0) + totals[c]
        else:
            demand[h] = totals[c]
    lower, flows = balance(demand, fixed)
    for c, h in enumerate(classes):
        acc, b = 0, [0]
        for r in h:
            acc += flows[h][r] if len(h) > 1 else totals[c]
            b.append(acc)
        result._bounds.append(b)
        for r in h:
            result._sender_classes.setdefault(r, []).append(c)
    if topology is not None:
        # the lower bound ignores locality (full holder sets): what any plan could reach
        lb_demand: dict[Holders, int] = {}
        lb_fixed: dict[int, int] = {}
        for v, cnt in counts.items():
            view = views[v]
            for _, holders, ranks, n in view.template.groups:
                b = cnt * n * view.itemsize * len(ranks)
                if len(holders) == 1:
                    lb_fixed[holders[0]] = lb_fixed.get(holders[0], 0) + b
                else:
                    lb_demand[holders] = lb_demand.get(holders, 0) + b
        lower, _ = balance(lb_demand, lb_fixed)

    # 5. statistics: sender loads after rounding cuts to rows, extra transfers from cuts
    sent: dict[int, int] = {}
    extra = 0
    for c, h in enumerate(classes):
        bounds = result._bounds[c]
        eff = [0]
        for k in range(1, len(h)):
            x = bounds[k]
            found = result._piece_at(c, x) if x < totals[c] else None
            if found is None:
                eff.append(min(x, totals[c]))
                continue
            region, start, nb = found
            acc, cut = start, start + nb
            for owner, _, part in split_piece(region, nb, start, bounds):
                if owner >= k:
                    cut = acc
                    break
                acc += part
            eff.append(cut)
            if start < cut < start + nb:
                extra += 1
        eff.append(totals[c])
        for k, r in enumerate(h):
            sent[r] = sent.get(r, 0) + max(0, eff[k + 1] - eff[k])

    recv_by_tuple: dict[int, int] = {}
    bytes_min = gather = local_bytes = num_pieces = num_local = 0
    for v, cnt in counts.items():
        view = views[v]
        tpl, size = view.template, view.itemsize
        for sub in view.subs:
            recv_by_tuple[sub.tid] = recv_by_tuple.get(sub.tid, 0) + cnt * sub.nbytes
            num_pieces += cnt * len(sub.ranks)
        bytes_min += cnt * tpl.min_elems * size
        local_bytes += cnt * sum(n * len(owners) for _, owners, n in tpl.local) * size
        num_local += cnt * sum(len(owners) for _, owners, _ in tpl.local)
    received: dict[int, int] = {}
    for tid, b in recv_by_tuple.items():
        for r in rank_tuples[tid]:
            received[r] = received.get(r, 0) + b
    for t, name in enumerate(names):
        view = views[result._view_of[t]]
        n = 1
        for s in src[name].shape:
            n *= s
        gather += n * view.itemsize * (1 + view.template.num_dst_ranks)
    src_ranks = {r for h in classes for r in h}
    moved = sum(totals)
    top = max(sent.values(), default=0)
    mean = moved / max(len(src_ranks), 1)
    result.stats = PlanStats(
        bytes_moved=moved, bytes_min=bytes_min, bytes_gather_broadcast=gather,
        bytes_local=local_bytes, bytes_sent=sent, bytes_received=received,
        sender_lower_bound=lower, sender_balance=(top / lower) if lower else 1.0,
        sender_balance_mean=(top / mean) if mean else 1.0,
        num_transfers=num_pieces + extra, num_local_copies=num_local, num_tensors=len(names),
        num_templates=len(templates), plan_seconds=time.perf_counter() - t0)
    logger.debug("planned %d tensors: %s", len(names), result.stats.to_dict())
    return result
