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
import math
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

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
    """The pieces of one (source layout, destination layout) pair, in element counts."""

    pieces: list[tuple[int, Region, Holders, int]]      # (dst, region, holders, elements)
    local: list[tuple[int, Region, int]]                 # (rank, region, elements)
    by_dst: dict[int, list[int]]                         # dst rank -> piece indices
    local_by_rank: dict[int, list[int]]
    min_elems: int                                       # elements dst ranks lack
    recv_elems: dict[int, int]
    num_dst_ranks: int


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


def _product_pieces(src: Layout, dst: Layout) -> Iterator[tuple[int, Region, Holders]]:
    """Pieces for two product layouts, by per-dim interval merging."""
    ndim = src.ndim
    src_axes = [src.dim_axes(d) for d in range(ndim)]
    segs = []
    for d in range(ndim):
        items = sorted((s, e, key) for key, ivs in src.dim_table(d).items() for s, e in ivs)
        segs.append(([s for s, _, _ in items], items))
    holders_memo: dict[tuple, Holders] = {}
    by_dst_key: dict[tuple, list[tuple[Region, Holders]]] = {}
    for rank in dst.mesh.ranks:
        per_dim = dst.dim_intervals(rank)
        if any(not ivs for ivs in per_dim):
            continue
        boxes = by_dst_key.get(per_dim)
        if boxes is None:
            boxes = []
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
                boxes.append((Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo)),
                              holders))
            by_dst_key[per_dim] = boxes
        for region, holders in boxes:
            yield rank, region, holders


def _general_pieces(src: Layout, dst: Layout, name: str,
                    problems: list[str]) -> Iterator[tuple[int, Region, Holders]]:
    """Pieces when either side is explicit: refine each destination region on all boundaries."""
    src_held = [(r, reg) for r in src.ranks for reg in src.regions(r)]
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
            cells: list[tuple[Region, Holders]] = []
            for combo in itertools.product(*cuts):
                cell = Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
                holders = tuple(sorted({r for r, x in inter if x.contains(cell)}))
                if not holders:
                    problems.append(f"tensor {name!r}: destination rank {rank} needs region "
                                    f"{cell} but no source rank holds it")
                    continue
                # merge runs along the last dim that share holders (row-major order)
                if cells and cells[-1][1] == holders and want.ndim and \
                        cells[-1][0].starts[:-1] == cell.starts[:-1] and \
                        cells[-1][0].stops[:-1] == cell.stops[:-1] and \
                        cells[-1][0].stops[-1] == cell.starts[-1]:
                    prev = cells[-1][0]
                    cells[-1] = (Region(prev.starts, prev.stops[:-1] + cell.stops[-1:]), holders)
                else:
                    cells.append((cell, holders))
            for cell, holders in cells:
                yield rank, cell, holders


def _build_template(src: Layout, dst: Layout, name: str, problems: list[str]) -> _Template:
    if src.is_product and dst.is_product:
        raw = _product_pieces(src, dst)
    else:
        raw = _general_pieces(src, dst, name, problems)
    pieces, local = [], []
    by_dst: dict[int, list[int]] = {}
    local_by_rank: dict[int, list[int]] = {}
    recv: dict[int, int] = {}
    for rank, region, holders in raw:
        n = region.size
        if rank in holders:
            local_by_rank.setdefault(rank, []).append(len(local))
            local.append((rank, region, n))
        else:
            by_dst.setdefault(rank, []).append(len(pieces))
            pieces.append((rank, region, holders, n))
            recv[rank] = recv.get(rank, 0) + n
    # the minimum, from the layouts alone: what each destination rank holds minus what it
    # already owns as a source
    min_elems, num_dst = 0, 0
    for rank in dst.ranks:
        wants = dst.regions(rank)
        if not wants or all(w.is_empty for w in wants):
            continue
        num_dst += 1
        owns = src.regions(rank)
        for w in wants:
            min_elems += w.size - sum(x.size for o in owns if (x := w.intersect(o)) is not None)
    return _Template(pieces, local, by_dst, local_by_rank, min_elems, recv, num_dst)


# ---------------------------------------------------------------------------- balancing

def _max_flow(num_nodes: int, edges: list[tuple[int, int, int]], s: int, t: int
              ) -> tuple[int, list[int], list[list[int]], list[int], list[int]]:
    """Dinic's max-flow on integer capacities. Returns (flow, cap, adj, to, edge list)."""
    to: list[int] = []
    cap: list[int] = []
    adj: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v, c in edges:
        adj[u].append(len(to)); to.append(v); cap.append(c)
        adj[v].append(len(to)); to.append(u); cap.append(0)
    flow = 0
    while True:
        level = [-1] * num_nodes
        level[s] = 0
        queue = [s]
        for u in queue:
            for e in adj[u]:
                if cap[e] > 0 and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    queue.append(to[e])
        if level[t] < 0:
            return flow, cap, adj, to, level
        it = [0] * num_nodes

        def push(u: int, f: int) -> int:
            if u == t:
                return f
            while it[u] < len(adj[u]):
                e = adj[u][it[u]]
                v = to[e]
                if cap[e] > 0 and level[v] == level[u] + 1:
                    got = push(v, min(f, cap[e]))
                    if got:
                        cap[e] -= got
                        cap[e ^ 1] += got
                        return got
                it[u] += 1
            return 0

        while True:
            f = push(s, 1 << 62)
            if not f:
                break
            flow += f


def _balance(demand: Mapping[Holders, int], fixed: Mapping[int, int]
             ) -> tuple[int, dict[Holders, dict[int, int]]]:
    """Least possible max load, and a flow reaching it.

    ``demand[holders]`` bytes must be sent by the ranks in ``holders`` (splittable among
    them); ``fixed[rank]`` bytes a rank must send anyway. Returns (max load L, per class the
    bytes each holder sends). L is found by Dinkelbach steps on min cuts: a cut that blocks
    the flow names a set of ranks whose demand/size exceeds L, and that ratio is the next L.
    """
    multi = sorted(h for h, b in demand.items() if b > 0)
    senders = sorted({r for h in multi for r in h})
    top_fixed = max(fixed.values(), default=0)
    if not multi:
        return top_fixed, {}
    total = sum(demand[h] for h in multi)
    load = max(max((fixed.get(r, 0) for r in senders), default=0),
               -(-(total + sum(fixed.get(r, 0) for r in senders)) // len(senders)))
    cls_node = {h: 2 + i for i, h in enumerate(multi)}
    rank_node = {r: 2 + len(multi) + i for i, r in enumerate(senders)}
    num_nodes = 2 + len(multi) + len(senders)
    while True:
        edges = [(0, cls_node[h], demand[h]) for h in multi]
        edges += [(cls_node[h], rank_node[r], total) for h in multi for r in h]
        edges += [(rank_node[r], 1, load - fixed.get(r, 0)) for r in senders]
        flow, cap, adj, to, level = _max_flow(num_nodes, edges, 0, 1)
        if flow == total:
            break
        cut_ranks = [r for r in senders if level[rank_node[r]] >= 0]
        cut_demand = sum(demand[h] for h in multi if level[cls_node[h]] >= 0)
        new_load = -(-(cut_demand + sum(fixed.get(r, 0) for r in cut_ranks)) // len(cut_ranks))
        assert new_load > load, (new_load, load)
        load = new_load
    flows: dict[Holders, dict[int, int]] = {}
    e = 2 * len(multi)
    for h in multi:
        out = {}
        for r in h:
            out[r] = cap[e + 1]      # reverse residual = flow on the class -> rank edge
            e += 2
        flows[h] = out
    return max(load, top_fixed), flows


# ---------------------------------------------------------------------------- the plan

@dataclass(slots=True)
class _View:
    """A template seen from one topology: each moved piece's class and byte offset."""

    template: _Template
    nbytes_per_elem: int
    piece_class: list[int]
    piece_offset: list[int]
    class_order: list[int]                      # classes of this template, first-seen order
    class_bytes: list[int]
    class_pieces: dict[int, tuple[list[int], list[int]]]   # class -> (piece idx, offsets)


def _split_piece(region: Region, nbytes: int, start: int, bounds: Sequence[int]
                 ) -> list[tuple[int, Region, int]]:
    """Cut one piece of a class stream at the quota ``bounds``: [(holder index, region, bytes)].

    The piece occupies ``[start, start + nbytes)`` of the stream; holder j owns
    ``[bounds[j], bounds[j+1])``. Cuts fall on whole rows of the outermost dim longer than
    one; a piece that cannot be cut goes whole to the holder owning its first byte.
    """
    j = bisect_right(bounds, start) - 1
    end = start + nbytes
    if bounds[j + 1] >= end:
        return [(j, region, nbytes)]
    shape = region.shape
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None:
        return [(j, region, nbytes)]
    rows = shape[d]
    row_bytes = nbytes // rows
    out = []
    row, owner, k = 0, j, j + 1
    while k < len(bounds) - 1 and bounds[k] < end:
        cut = min(rows, max(row, round((bounds[k] - start) / row_bytes)))
        if cut > row:
            out.append((owner, row, cut))
            row = cut
        owner = k
        k += 1
    if row < rows:
        out.append((owner, row, rows))
    a = region.starts[d]
    return [(o, Region(region.starts[:d] + (a + r0,) + region.starts[d + 1:],
                       region.stops[:d] + (a + r1,) + region.stops[d + 1:]),
             (r1 - r0) * row_bytes) for o, r0, r1 in out]


class Plan:
    """All transfers of a refit (computed lazily per rank) and their statistics.

    Build with :func:`plan`. ``transfers_for(rank)`` lists a rank's sends and receives;
    ``local_copies_for(rank)`` its same-rank copies (colocated layouts).
    """

    def __init__(self, names: list[str], src: Mapping[str, Layout], dst: Mapping[str, Layout],
                 views: list[_View], view_of: list[int], classes: list[Holders],
                 bounds: list[list[int]], tensor_list: list[list[int]],
                 tensor_cum: list[list[int]], tensor_starts: list[tuple[int, ...]],
                 stats: PlanStats, wire_dtypes: dict[str, str]):
        self.names = names
        self.src = src
        self.dst = dst
        self.stats = stats
        self.wire_dtypes = wire_dtypes
        self._views = views
        self._view_of = view_of
        self._classes = classes
        self._bounds = bounds
        self._tensor_list = tensor_list
        self._tensor_cum = tensor_cum
        self._tensor_starts = tensor_starts
        self._sender_classes: dict[int, list[int]] = {}
        for c, holders in enumerate(classes):
            for r in holders:
                self._sender_classes.setdefault(r, []).append(c)

    def __repr__(self) -> str:
        return (f"Plan({len(self.names)} tensors, {self.stats.num_transfers} transfers, "
                f"{self.stats.bytes_moved} bytes)")

    def __str__(self) -> str:
        return str(self.stats)

    def transfers_for(self, rank: int) -> tuple[Transfer, ...]:
        """Every transfer ``rank`` sends or receives, receives first, in plan order."""
        out: list[Transfer] = []
        names, views, view_of = self.names, self._views, self._view_of
        for t, name in enumerate(names):
            view = views[view_of[t]]
            mine = view.template.by_dst.get(rank)
            if not mine:
                continue
            starts = self._tensor_starts[t]
            for p in mine:
                _, region, _, n = view.template.pieces[p]
                c = view.piece_class[p]
                holders = self._classes[c]
                bounds = self._bounds[c]
                if len(holders) == 1:
                    out.append(Transfer(name, region, holders[0], rank, n * view.nbytes_per_elem))
                    continue
                start = starts[view.class_order.index(c)] + view.piece_offset[p]
                for j, sub, nb in _split_piece(region, n * view.nbytes_per_elem, start, bounds):
                    out.append(Transfer(name, sub, holders[j], rank, nb))
        for c in self._sender_classes.get(rank, ()):
            out.extend(self._sends_in_class(rank, c))
        return tuple(out)

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
            base = tcum[i]
            idx, offs = view.class_pieces[c]
            k = max(bisect_right(offs, lo - base) - 1, 0)
            name = self.names[t]
            while k < len(idx) and base + offs[k] < hi:
                dst, region, _, n = view.template.pieces[idx[k]]
                for owner, sub, nb in _split_piece(region, n * view.nbytes_per_elem,
                                                   base + offs[k], bounds):
                    if owner == j:
                        yield Transfer(name, sub, rank, dst, nb)
                k += 1
            i += 1

    def local_copies_for(self, rank: int) -> tuple[Transfer, ...]:
        """Regions ``rank`` holds on both sides: copied within the rank, never sent."""
        out = []
        for t, name in enumerate(self.names):
            view = self._views[self._view_of[t]]
            for i in view.template.local_by_rank.get(rank, ()):
                _, region, n = view.template.local[i]
                out.append(Transfer(name, region, rank, rank, n * view.nbytes_per_elem))
        return tuple(out)

    def iter_transfers(self) -> Iterator[Transfer]:
        """Every transfer of the plan (receiver order). Costs time proportional to the world."""
        for rank in sorted({r for v in self._views for r in v.template.by_dst}):
            for tr in self.transfers_for(rank):
                if tr.dst == rank:
                    yield tr


class PlanCache:
    """Templates keyed on (source layout, destination layout); reuse across plan() calls."""

    def __init__(self) -> None:
        self.templates: dict[tuple[Layout, Layout], _Template] = {}

    def __len__(self) -> int:
        return len(self.templates)


def _validate(src: Mapping[str, Layout], dst: Mapping[str, Layout], wire_dtype: str | None
              ) -> tuple[list[str], dict[str, str]]:
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
        if wire_dtype is None:
            if s.dtype != d.dtype:
                dtype_bad.append(f"{name!r} source {s.dtype} vs destination {d.dtype}")
            wire[name] = d.dtype
        else:
            wire[name] = wire_dtype
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
        wire_dtype: cast to this dtype on the sender; None requires equal dtypes.
        cache: templates to reuse across calls.

    Returns:
        The plan. Deterministic: the same inputs give the same plan on every rank.

    Raises:
        PlanError: names missing on one side (all listed), shape or dtype mismatches, or a
            destination region no source rank holds.
    """
    t0 = time.perf_counter()
    wire_name = None if wire_dtype is None else dtype_name(wire_dtype)
    names, wire = _validate(src, dst, wire_name)
    topology: Topology | None = getattr(world, "topology", world)
    cache = cache if cache is not None else PlanCache()

    # 1. templates
    problems: list[str] = []
    tpl_index: dict[tuple[Layout, Layout], int] = {}
    tpl_list: list[_Template] = []
    view_key_of: list[tuple[int, int]] = []
    for name in names:
        key = (src[name], dst[name])
        i = tpl_index.get(key)
        if i is None:
            tpl = cache.templates.get(key)
            if tpl is None:
                tpl = _build_template(key[0], key[1], name, problems)
                if not problems:
                    cache.templates[key] = tpl
            i = tpl_index[key] = len(tpl_list)
            tpl_list.append(tpl)
        view_key_of.append((i, itemsize(wire[name])))
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise PlanError("destination regions that no source rank holds:\n  "
                        + "\n  ".join(problems[:_MAX_LISTED]) + more
                        + "\nthe source layouts must cover every element a destination holds")

    # 2. classes: candidate senders after locality, per template view
    class_id: dict[Holders, int] = {}
    classes: list[Holders] = []
    narrow_memo: dict[tuple[Holders, int], Holders] = {}

    def narrow(holders: Holders, dst_rank: int) -> Holders:
        if topology is None or len(holders) == 1:
            return holders
        key = (holders, dst_rank)
        got = narrow_memo.get(key)
        if got is None:
            proc, host = topology.process_of(dst_rank), topology.host_of(dst_rank)
            got = (tuple(h for h in holders if proc is not None and topology.process_of(h) == proc)
                   or tuple(h for h in holders if host is not None and topology.host_of(h) == host)
                   or holders)
            narrow_memo[key] = got
        return got

    views: list[_View] = []
    view_index: dict[tuple[int, int], int] = {}
    view_of: list[int] = []
    for vk in view_key_of:
        v = view_index.get(vk)
        if v is None:
            tpl, size = tpl_list[vk[0]], vk[1]
            piece_class, piece_offset, order, cbytes = [], [], [], []
            where: dict[int, int] = {}
            cpieces: dict[int, tuple[list[int], list[int]]] = {}
            for p, (dst_rank, _, holders, n) in enumerate(tpl.pieces):
                h = narrow(holders, dst_rank)
                c = class_id.get(h)
                if c is None:
                    c = class_id[h] = len(classes)
                    classes.append(h)
                k = where.get(c)
                if k is None:
                    k = where[c] = len(order)
                    order.append(c)
                    cbytes.append(0)
                    cpieces[c] = ([], [])
                piece_class.append(c)
                piece_offset.append(cbytes[k])
                cpieces[c][0].append(p)
                cpieces[c][1].append(cbytes[k])
                cbytes[k] += n * size
            v = view_index[vk] = len(views)
            views.append(_View(tpl, size, piece_class, piece_offset, order, cbytes, cpieces))
        view_of.append(v)

    # 3. class streams over the model, in tensor order
    tensor_list: list[list[int]] = [[] for _ in classes]
    tensor_cum: list[list[int]] = [[] for _ in classes]
    totals = [0] * len(classes)
    tensor_starts: list[tuple[int, ...]] = []
    for t, v in enumerate(view_of):
        view = views[v]
        starts = []
        for c, b in zip(view.class_order, view.class_bytes):
            tensor_list[c].append(t)
            tensor_cum[c].append(totals[c])
            starts.append(totals[c])
            totals[c] += b
        tensor_starts.append(tuple(starts))

    # 4. balance: quotas per class by max-flow
    fixed: dict[int, int] = {}
    demand: dict[Holders, int] = {}
    for c, h in enumerate(classes):
        if len(h) == 1:
            fixed[h[0]] = fixed.get(h[0], 0) + totals[c]
        else:
            demand[h] = totals[c]
    lower, flows = _balance(demand, fixed)
    bounds: list[list[int]] = []
    for c, h in enumerate(classes):
        if len(h) == 1:
            bounds.append([0, totals[c]])
            continue
        acc, b = 0, [0]
        for r in h:
            acc += flows[h][r]
            b.append(acc)
        assert acc == totals[c]
        bounds.append(b)
    counts = Counter(view_of)
    if topology is not None:
        # the lower bound ignores locality (full holder sets): what any plan could reach
        lb_demand: dict[Holders, int] = {}
        lb_fixed: dict[int, int] = {}
        for v, cnt in counts.items():
            view = views[v]
            for _, _, holders, n in view.template.pieces:
                b = cnt * n * view.nbytes_per_elem
                if len(holders) == 1:
                    lb_fixed[holders[0]] = lb_fixed.get(holders[0], 0) + b
                else:
                    lb_demand[holders] = lb_demand.get(holders, 0) + b
        lower, _ = _balance(lb_demand, lb_fixed)

    # 5. statistics: actual sender loads after row rounding, extra transfers from cuts
    plan_obj = Plan(names, src, dst, views, view_of, classes, bounds, tensor_list, tensor_cum,
                    tensor_starts, None, wire)  # type: ignore[arg-type]
    sent: dict[int, int] = {}
    extra = 0
    for c, h in enumerate(classes):
        if len(h) == 1:
            sent[h[0]] = sent.get(h[0], 0) + totals[c]
            continue
        eff = [0]
        for k in range(1, len(h)):
            x = bounds[c][k]
            pos = bisect_right(tensor_cum[c], x) - 1
            if x >= totals[c] or pos < 0:
                eff.append(totals[c] if x >= totals[c] else 0)
                continue
            t = tensor_list[c][pos]
            view = views[view_of[t]]
            idx, offs = view.class_pieces[c]
            q = bisect_right(offs, x - tensor_cum[c][pos]) - 1
            start = tensor_cum[c][pos] + offs[q]
            _, region, _, n = view.template.pieces[idx[q]]
            parts = _split_piece(region, n * view.nbytes_per_elem, start, bounds[c])
            # effective boundary k: first byte of the part owned by holder >= k
            acc, cut = start, start + n * view.nbytes_per_elem
            for owner, _, nb in parts:
                if owner >= k:
                    cut = acc
                    break
                acc += nb
            eff.append(cut)
            if start < cut < start + n * view.nbytes_per_elem and x != start:
                extra += 1
        eff.append(totals[c])
        for k, r in enumerate(h):
            sent[r] = sent.get(r, 0) + max(0, eff[k + 1] - eff[k])

    received: dict[int, int] = {}
    bytes_min = gather = local_bytes = num_pieces = num_local = 0
    for v, cnt in counts.items():
        view = views[v]
        tpl, size = view.template, view.nbytes_per_elem
        for r, e in tpl.recv_elems.items():
            received[r] = received.get(r, 0) + cnt * e * size
        bytes_min += cnt * tpl.min_elems * size
        local_bytes += cnt * sum(n for _, _, n in tpl.local) * size
        num_pieces += cnt * len(tpl.pieces)
        num_local += cnt * len(tpl.local)
    for t, name in enumerate(names):
        view = views[view_of[t]]
        gather += math.prod(src[name].shape) * view.nbytes_per_elem * (1 + view.template.num_dst_ranks)
    src_ranks = {r for h in classes for r in h}
    moved = sum(totals)
    top = max(sent.values(), default=0)
    mean = moved / max(len(src_ranks), 1)
    stats = PlanStats(
        bytes_moved=moved, bytes_min=bytes_min, bytes_gather_broadcast=gather,
        bytes_local=local_bytes, bytes_sent=sent, bytes_received=received,
        sender_lower_bound=lower, sender_balance=(top / lower) if lower else 1.0,
        sender_balance_mean=(top / mean) if mean else 1.0,
        num_transfers=num_pieces + extra, num_local_copies=num_local, num_tensors=len(names),
        num_templates=len(tpl_list), plan_seconds=time.perf_counter() - t0)
    plan_obj.stats = stats
    logger.debug("planned %d tensors: %s", len(names), stats.to_dict())
    return plan_obj
