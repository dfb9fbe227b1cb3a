"""The planner: which bytes go from which source rank to which destination rank.

Glossary (the planner's own words; the shared ones are in docs/vocabulary.md):
  piece     a region some destination ranks need, with its *holders* (source ranks holding it)
  template  the pieces of one (source layout, destination layout) pair; tensors share it
  class     the candidate senders of a piece: its holders narrowed by locality
  stream    a class's pieces over the whole model in tensor order, as one run of bytes
  quota     the contiguous range of a class's stream that one of its holders sends

Pure metadata in, metadata out. Every rank computes the same plan from the same layouts, so
no plan is ever shipped between ranks. ``plan()`` runs five phases, each a pure function
returning a value, then builds the :class:`Plan` once:

1. *Templates* (templates.py): one per distinct layout pair, by per-dim interval merging,
   never from all (src rank, dst rank) pairs. The 61 layers of a model share a handful.
2. *Sender classes*: a piece's candidate senders are its holders, narrowed by locality: the
   destination rank itself (then it is a local copy, not a transfer), else holders in the
   same process, else on the same host, else all. A template at one wire itemsize, cut by
   class, is a *view*.
3. *Streams*: a class's pieces, over the whole model in a fixed order, are one byte stream.
4. *Quotas*: every stream is cut into contiguous quotas, one per holder, chosen by a
   max-flow so the most loaded sender carries the least possible: the exact optimum when
   regions may be split among their holders. A piece crossing a quota boundary is split
   along its outermost dim (rows rounded), so balance is exact up to a row.
5. *Statistics*: bytes moved, the minimum, gather-and-broadcast, per-rank loads.

Transfers are lazy: ``plan.transfers_for(rank)`` walks only that rank's pieces (as a
receiver) and its quota ranges (as a sender), so a rank pays for its own transfers.
``plan.describe(rank)`` prints them as a table.
"""

from __future__ import annotations

import difflib
import logging
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from .balance import split_piece
from ..dtypes import dtype_name
from ..errors import PlanError
from ..ir.layout import Layout, Region
from .streams import (Quotas, SenderClasses, Streams, Sub, cut_quotas, lay_streams, piece_at,
                      sender_classes)
from .templates import MAX_LISTED, PlanCache, build_templates
from ..ir.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Plan", "PlanCache", "PlanStats", "ReceiveTable", "Transfer", "plan"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``region`` of tensor ``name`` goes from rank ``src`` to rank ``dst`` (``nbytes`` on the
    wire)."""

    name: str
    region: Region
    src: int
    dst: int
    nbytes: int

    def __str__(self) -> str:
        return f"{self.name}{self.region} {self.src}->{self.dst} ({self.nbytes} B)"


@dataclass(frozen=True)
class ReceiveTable:
    """One rank's receives as parallel arrays (see :meth:`Plan.receive_table`): row ``i``
    is ``regions[region[i]]`` of tensor ``plan.names[tensor[i]]`` from rank ``src[i]``,
    ``nbytes[i]`` wire bytes."""

    src: Any
    tensor: Any
    region: Any
    nbytes: Any
    regions: tuple[Region, ...]

    def __len__(self) -> int:
        return len(self.src)


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
                                 f"({self.bytes_gather_broadcast / max(self.bytes_moved, 1):.1f}x "
                                 f"moved)"),
            ("local copies", f"{self.bytes_local / gib:.3f} GiB in {self.num_local_copies}"),
            ("max sent / rank", f"{max(self.bytes_sent.values(), default=0) / gib:.3f} GiB"),
            ("max received / rank",
             f"{max(self.bytes_received.values(), default=0) / gib:.3f} GiB"),
            ("sender balance", f"{self.sender_balance:.4f} x lower bound, "
                               f"{self.sender_balance_mean:.3f} x mean"),
            ("transfers", str(self.num_transfers)),
            ("plan time", f"{self.plan_seconds:.3f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------- 5. statistics

def _stats(names: Sequence[str], src_layouts: Mapping[str, Layout], num_templates: int,
           cls: SenderClasses, streams: Streams, quotas: Quotas, t0: float) -> PlanStats:
    """Phase 5: what the plan moves (``t0``: when planning began, for ``plan_seconds``)."""
    sent, extra = _sender_loads(cls, streams, quotas)
    views = cls.views
    recv_by_tuple: dict[int, int] = {}
    bytes_min = gather = local_bytes = num_pieces = num_local = 0
    for v, cnt in streams.view_counts.items():
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
        for r in cls.rank_tuples[tid]:
            received[r] = received.get(r, 0) + b
    for t, name in enumerate(names):
        view = views[cls.view_of[t]]
        n = 1
        for s in src_layouts[name].shape:
            n *= s
        gather += n * view.itemsize * (1 + view.template.num_dst_ranks)
    src_ranks = {r for h in cls.classes for r in h}
    moved = sum(streams.totals)
    top = max(sent.values(), default=0)
    mean = moved / max(len(src_ranks), 1)
    lower = quotas.lower_bound
    return PlanStats(
        bytes_moved=moved, bytes_min=bytes_min, bytes_gather_broadcast=gather,
        bytes_local=local_bytes, bytes_sent=sent, bytes_received=received,
        sender_lower_bound=lower, sender_balance=(top / lower) if lower else 1.0,
        sender_balance_mean=(top / mean) if mean else 1.0,
        num_transfers=num_pieces + extra, num_local_copies=num_local, num_tensors=len(names),
        num_templates=num_templates, plan_seconds=time.perf_counter() - t0)


def _sender_loads(cls: SenderClasses, streams: Streams, quotas: Quotas
                  ) -> tuple[dict[int, int], int]:
    """(bytes each rank sends after quota cuts are rounded to rows, transfers the cuts add)."""
    sent: dict[int, int] = {}
    extra = 0
    for c, h in enumerate(cls.classes):
        bounds, total = quotas.bounds[c], streams.totals[c]
        eff = [0]
        for k in range(1, len(h)):
            x = bounds[k]
            found = piece_at(cls, streams, c, x) if x < total else None
            if found is None:
                eff.append(min(x, total))
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
        eff.append(total)
        for k, r in enumerate(h):
            sent[r] = sent.get(r, 0) + max(0, eff[k + 1] - eff[k])
    return sent, extra


# ---------------------------------------------------------------------------- the plan

class Plan:
    """All transfers of a refit (listed lazily per rank) and their statistics.

    Build with :func:`plan`. ``transfers_for(rank)`` lists a rank's sends and receives;
    ``local_copies_for(rank)`` its same-rank copies (colocated layouts); ``describe(rank)``
    prints both as a table. ``src_layouts`` / ``dst_layouts`` are the ``{tensor name:
    Layout}`` of the two sides.
    """

    def __init__(self, names: list[str], src_layouts: Mapping[str, Layout],
                 dst_layouts: Mapping[str, Layout], wire_dtypes: dict[str, str],
                 classes: SenderClasses, streams: Streams, quotas: Quotas, stats: PlanStats):
        assert len(classes.view_of) == len(names) == len(streams.tensor_starts)
        assert len(classes.classes) == len(streams.totals) == len(quotas.bounds)
        assert all(len(b) == len(h) + 1 and b[-1] == total for b, h, total
                   in zip(quotas.bounds, classes.classes, streams.totals))
        self.names = names
        self.src_layouts = src_layouts
        self.dst_layouts = dst_layouts
        self.wire_dtypes = wire_dtypes
        self.stats = stats
        self._views = classes.views
        self._view_of = classes.view_of
        self._classes = classes.classes
        self._rank_tuples = classes.rank_tuples
        self._streams = streams
        self._bounds = quotas.bounds
        self._sender_classes = quotas.sender_classes
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
            got = self._receives(rank) + self._sends(rank)
            if len(self._memo) >= 16:     # a process asks for its own few ranks, repeatedly
                self._memo.pop(next(iter(self._memo)))
            self._memo[rank] = got
        return got

    def _receives(self, rank: int) -> tuple[Transfer, ...]:
        out: list[Transfer] = []
        position = {}
        for tid, ranks in enumerate(self._rank_tuples):
            if rank in ranks:
                position[tid] = ranks.index(rank)
        if not position:
            return ()
        mine: dict[int, list[tuple[Sub, int]]] = {}
        tensor_starts = self._streams.tensor_starts
        for t, name in enumerate(self.names):
            v = self._view_of[t]
            subs = mine.get(v)
            if subs is None:
                subs = mine[v] = [(sub, position[sub.tid]) for sub in self._views[v].subs
                                  if sub.tid in position]
            if not subs:
                continue
            groups = self._views[v].template.groups
            starts = tensor_starts[t]
            for sub, pos in subs:
                region = groups[sub.group][0]
                holders = self._classes[sub.cls]
                if len(holders) == 1:
                    out.append(Transfer(name, region, holders[0], rank, sub.nbytes))
                    continue
                start = starts[sub.slot] + sub.offset + pos * sub.nbytes
                for j, part, nb in split_piece(region, sub.nbytes, start, self._bounds[sub.cls]):
                    out.append(Transfer(name, part, holders[j], rank, nb))
        return tuple(out)

    def _sends(self, rank: int) -> tuple[Transfer, ...]:
        out: list[Transfer] = []
        for c in self._sender_classes.get(rank, ()):
            if len(self._classes[c]) == 1:
                out.extend(self._sends_whole_class(rank, c))
            else:
                out.extend(self._sends_in_class(rank, c))
        return tuple(out)

    def _sends_whole_class(self, rank: int, c: int) -> Iterator[Transfer]:
        """Every piece of a class ``rank`` alone holds (view by view, tensors in order)."""
        for v in self._streams.class_views.get(c, ()):
            view = self._views[v]
            subs = [view.subs[i] for i in view.class_subs[c][0]]
            groups = view.template.groups
            for t in self._streams.view_tensors[v]:
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
        tlist, tcum = self._streams.tensor_list[c], self._streams.tensor_cum[c]
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

    def receive_table(self, rank: int) -> ReceiveTable:
        """The transfers ``rank`` receives, as arrays: the same set as the receives of
        ``transfers_for(rank)``, without a ``Transfer`` object per transfer.

        Tensors of one view share its pieces, so the work is done once per (view, piece)
        over all the view's tensors in numpy; only pieces crossing a quota boundary are cut
        one by one (``split_piece``). For simulators and tools that need every rank's
        receives (millions of transfers); the executor keeps ``transfers_for``.

        Returns:
            A :class:`ReceiveTable`, rows grouped by view (not in plan order).
        """
        import numpy as np
        position = {tid: ranks.index(rank) for tid, ranks in enumerate(self._rank_tuples)
                    if rank in ranks}
        regions: list[Any] = []
        src: list[Any] = []
        tensor: list[Any] = []
        region: list[Any] = []
        nbytes: list[Any] = []
        extra: list[tuple[int, int, int, int]] = []   # split pieces: (src, tensor, region, bytes)
        if position:
            for v, view in enumerate(self._views):
                subs = [(sub, position[sub.tid]) for sub in view.subs if sub.tid in position]
                tensors = self._streams.view_tensors.get(v)
                if not subs or not tensors:
                    continue
                tarr = np.asarray(tensors, np.int64)
                local: dict[int, int] = {}
                for sub, pos in subs:
                    reg = view.template.groups[sub.group][0]
                    k = local.get(sub.group)
                    if k is None:
                        k = local[sub.group] = len(regions)
                        regions.append(reg)
                    holders = self._classes[sub.cls]
                    nb = sub.nbytes
                    if len(holders) == 1:
                        src.append(np.full(len(tarr), holders[0], np.int64))
                        tensor.append(tarr)
                        region.append(np.full(len(tarr), k, np.int64))
                        nbytes.append(np.full(len(tarr), nb, np.int64))
                        continue
                    bounds = self._bounds[sub.cls]
                    barr = np.asarray(bounds, np.int64)
                    first = np.fromiter((self._streams.tensor_starts[t][sub.slot]
                                         for t in tensors), np.int64, len(tensors))
                    first += sub.offset + pos * nb
                    j = np.minimum(np.searchsorted(barr, first, side="right") - 1,
                                   len(barr) - 2)
                    whole = barr[j + 1] >= first + nb
                    hold = np.asarray(holders, np.int64)
                    src.append(hold[j[whole]])
                    tensor.append(tarr[whole])
                    region.append(np.full(int(whole.sum()), k, np.int64))
                    nbytes.append(np.full(int(whole.sum()), nb, np.int64))
                    for i in np.flatnonzero(~whole).tolist():
                        for jj, part, pnb in split_piece(reg, nb, int(first[i]), bounds):
                            regions.append(part)
                            extra.append((holders[jj], tensors[i], len(regions) - 1, pnb))
        if extra:
            e = np.array(extra, np.int64)
            src.append(e[:, 0])
            tensor.append(e[:, 1])
            region.append(e[:, 2])
            nbytes.append(e[:, 3])

        def cat(xs: list[Any], dtype: Any) -> Any:
            return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)

        return ReceiveTable(cat(src, np.int32), cat(tensor, np.int32), cat(region, np.int32),
                            cat(nbytes, np.int64), tuple(regions))

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

    def describe(self, rank: int, max_rows: int | None = None) -> str:
        """``rank``'s share of the plan, for people: a summary line, bytes per peer, then
        one row per region it receives, sends or copies locally (plan order).

        Example (``w`` float32 [8, 4], rows split over ranks 0..3, wanted whole by rank 4)::

            rank 4: receives 128 B in 4 regions from 4 peers; sends 0 B in 0 regions to 0
            peers; copies 0 B locally in 0 regions     (one line)

            peer | direction | regions | bytes
               0 | recv from |       1 |    32
               ...
               3 | recv from |       1 |    32

            direction | peer | tensor | region     | bytes
            recv from |    0 | w      | [0:2, 0:4] |    32
            ...
            recv from |    3 | w      | [6:8, 0:4] |    32

        Args:
            rank: a world rank (one with no part in the plan gets an empty table).
            max_rows: list at most this many region rows (None: all); the summary and the
                per-peer table are always complete.
        """
        recv = [t for t in self.transfers_for(rank) if t.dst == rank]
        send = [t for t in self.transfers_for(rank) if t.src == rank]
        copies = self.local_copies_for(rank)
        per_peer: dict[tuple[int, str], list[int]] = {}
        rows = []
        peer_of: Callable[[Transfer], int]
        for direction, peer_of, transfers in (("recv from", lambda t: t.src, recv),
                                              ("send to", lambda t: t.dst, send),
                                              ("local", lambda t: t.src, copies)):
            for t in transfers:
                peer = peer_of(t)
                if direction != "local":
                    got = per_peer.setdefault((peer, direction), [0, 0])
                    got[0] += 1
                    got[1] += t.nbytes
                rows.append((direction, str(peer), t.name, str(t.region), f"{t.nbytes:,}"))

        def total(ts: Sequence[Transfer]) -> str:
            return _human_bytes(sum(t.nbytes for t in ts))

        lines = [f"rank {rank}: receives {total(recv)} in {len(recv):,} regions from "
                 f"{len({t.src for t in recv})} peers; sends {total(send)} in {len(send):,} "
                 f"regions to {len({t.dst for t in send})} peers; copies {total(copies)} "
                 f"locally in {len(copies):,} regions"]
        if per_peer:
            order = sorted(per_peer, key=lambda pd: (pd[1] != "recv from", pd[0]))
            lines += [""] + _table(("peer", "direction", "regions", "bytes"),
                                   [(str(p), d, f"{per_peer[p, d][0]:,}", f"{per_peer[p, d][1]:,}")
                                    for p, d in order], right=(0, 2, 3))
        if rows:
            shown = rows if max_rows is None else rows[:max(max_rows, 0)]
            if shown:
                lines += [""] + _table(("direction", "peer", "tensor", "region", "bytes"), shown,
                                       right=(1, 4))
            if len(shown) < len(rows):
                lines.append(f"... and {len(rows) - len(shown):,} more regions "
                             "(describe(rank, max_rows=None) lists all)")
        return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]],
           right: Sequence[int] = ()) -> list[str]:
    """Rows as ``a | b | c`` lines under a header; columns in ``right`` right-aligned."""
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.rjust(w) if i in right else c.ljust(w)
                          for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- plan()

def _validate(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
              wire_dtype: str | Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """Tensor names in plan order and each tensor's wire dtype; every problem at once."""
    only_src = sorted(set(src_layouts) - set(dst_layouts))
    only_dst = sorted(set(dst_layouts) - set(src_layouts))
    problems = []

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
        return ", ".join(repr(n) for n in names[:MAX_LISTED]) + more

    if only_src:
        problems.append(f"{len(only_src)} tensor(s) only on the source side: {listed(only_src)}")
    if only_dst:
        problems.append(f"{len(only_dst)} tensor(s) only on the destination side: "
                        f"{listed(only_dst)}")
    if only_src and only_dst:
        problems.append(_nearest_names(only_src, only_dst))
    names = sorted(set(src_layouts) & set(dst_layouts))
    wire: dict[str, str] = {}
    shape_bad, dtype_bad = [], []
    for name in names:
        s, d = src_layouts[name], dst_layouts[name]
        if s.shape != d.shape:
            shape_bad.append(f"{name!r} source {s.shape} vs destination {d.shape}"
                             + (f" (reversed: pass transpose={{{name!r}}} to Refit, e.g. for a "
                                f"JAX [in, out] kernel of an [out, in] weight)"
                                if len(s.shape) == 2 and s.shape == d.shape[::-1] else ""))
        cast = wire_dtype.get(name) if isinstance(wire_dtype, Mapping) else wire_dtype
        if cast is None:
            if s.dtype != d.dtype:
                dtype_bad.append(f"{name!r} source {s.dtype} vs destination {d.dtype}")
            wire[name] = d.dtype
        else:
            wire[name] = cast
    if shape_bad:
        problems.append(f"shape mismatch in {len(shape_bad)} tensor(s): "
                        + "; ".join(shape_bad[:MAX_LISTED])
                        + (f"; and {len(shape_bad) - MAX_LISTED} more"
                           if len(shape_bad) > MAX_LISTED else ""))
    if dtype_bad:
        problems.append(f"dtype mismatch in {len(dtype_bad)} tensor(s) and no cast requested: "
                        + "; ".join(dtype_bad[:MAX_LISTED])
                        + (" ..." if len(dtype_bad) > MAX_LISTED else "")
                        + " - pass wire_dtype= (e.g. RefitConfig(wire_dtype='bfloat16')) to cast "
                          "on the sender")
    if problems:
        raise PlanError("cannot plan this refit:\n  " + "\n  ".join(problems))
    return names, wire


def _nearest_names(only_src: list[str], only_dst: list[str]) -> str:
    """A hint for names on one side only: the nearest name of the other side, and names=."""
    pairs = []
    for name in only_src:
        near = (difflib.get_close_matches(name, only_dst, n=1, cutoff=0.5)
                or [d for d in only_dst if name in d or d in name][:1])
        if near:
            pairs.append(f"{name!r}: {near[0]!r}")
    guess = ("nearest names: {" + ", ".join(pairs[:MAX_LISTED])
             + (", ..." if len(pairs) > MAX_LISTED else "") + "}; " if pairs else "")
    return (f"{guess}map source names to destination names with Refit(..., names={{source: "
            f"destination}}) (a dict or a callable) or rules= (xreshard.adapters.naming)")


def _topology_of(topology: Any, world: Any) -> Topology | None:
    """The Topology behind ``topology=`` (a World or a Topology) or its alias ``world=``."""
    if world is not None:
        if topology is not None:
            raise TypeError("plan() takes topology= or its alias world=, not both")
        topology = world
    topo: Topology | None = getattr(topology, "topology", topology)
    if topo is not None and not (hasattr(topo, "process_of") and hasattr(topo, "host_of")):
        raise TypeError(f"plan(topology=...) takes a World or a Topology (or None), got "
                        f"{type(topo).__name__}")
    return topo


def plan(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
         topology: Any = None, *, wire_dtype: object = None, cache: PlanCache | None = None,
         world: Any = None) -> Plan:
    """Plan a refit from ``src_layouts`` to ``dst_layouts`` (``{tensor name: Layout}``).

    Args:
        src_layouts: source layouts, one per tensor.
        dst_layouts: destination layouts, same tensor names and shapes.
        topology: a ``Topology``, or a ``World`` (its ``world.topology``), saying which
            process and host own each rank; None means every rank is its own host.
        wire_dtype: cast to this dtype on the sender (one dtype for every tensor, or a
            mapping name -> dtype for some); None requires equal dtypes.
        cache: templates to reuse across calls.
        world: the former name of ``topology`` (keyword only), kept as an alias.

    Returns:
        The plan. Deterministic: the same inputs give the same plan on every rank.

    Raises:
        PlanError: names missing on one side (all listed), shape or dtype mismatches, or a
            destination region no source rank holds.
        TypeError: ``topology`` is neither a World nor a Topology, or both ``topology``
            and ``world`` were given.
    """
    t0 = time.perf_counter()
    topo = _topology_of(topology, world)
    if isinstance(wire_dtype, Mapping):
        wire_name: Any = {n: dtype_name(d) for n, d in wire_dtype.items()}
    else:
        wire_name = None if wire_dtype is None else dtype_name(wire_dtype)
    names, wire = _validate(src_layouts, dst_layouts, wire_name)
    use = build_templates(names, src_layouts, dst_layouts, wire,
                          cache if cache is not None else PlanCache())
    classes = sender_classes(use, topo)
    streams = lay_streams(classes)
    quotas = cut_quotas(classes, streams, topo)
    stats = _stats(names, src_layouts, len(use.templates), classes, streams, quotas, t0)
    result = Plan(names, src_layouts, dst_layouts, wire, classes, streams, quotas, stats)
    logger.debug("planned %d tensors: %s", len(names), stats.to_dict())
    return result
