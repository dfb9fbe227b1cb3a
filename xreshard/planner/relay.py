"""Relay through destination replicas: each byte crosses the slow links once per domain.

Destination ranks of one fast *domain* (an NVLink island; on CPU a host, as declared by
``World.join(..., host=...)``) that need the same region form its *relay set*. A direct
plan sends that region over the slow links once per rank of the set; a relay plan sends
it once per domain and the set forwards it inside the domain. A refit with
``RefitConfig(relay="on")`` plans two ordinary stages and runs them overlapped, as one
schedule, in one call (see "Overlap" below):

* **stage 1** (across domains): the real sources -> ``stage1_dst``, in which every
  region a relayed domain needs is held by exactly one of the domain's ranks that needs
  it (pieces cut and spread so each rank of the set receives about the same bytes);
* **stage 2** (inside domains): ``stage2_src`` (what each relay rank received in stage 1
  and another rank of its domain needs) -> ``stage2_dst`` (what each rank needs and did
  not receive in stage 1). Every piece of ``stage2_dst`` has exactly one holder, on the
  same domain, so the planner has nothing to choose.

Both stages bind views of the real destination memory (the runtime cuts them,
``xreshard.runtime.metadata.stage_views``), so stage 1 writes straight into the final
memory and stage 2 forwards from it; nothing is staged twice.

Pieces: a domain's needs of one tensor are cut by a grid made of every boundary of every
region of the domain's ranks, so each grid cell lies inside or outside each rank's
region (never across), and the cells some rank needs are the pieces. A piece needed by
``m >= 2`` ranks is cut into ``m`` row blocks (torch.chunk on its first dim longer than
1), handed to those ranks, the least loaded (bytes assigned so far in that domain) taking
the largest. Example: a ``(8, 4)`` float32 tensor replicated on ranks 1, 2 (host "a") and
3, 4 (host "b"), sent from rank 0 (host "t")::

    # rank | host | needs   | stage 1 receives | stage 2 sends   | stage 2 receives
    #    1 | a    | [0:8]   | [0:4]            | [0:4] -> 2      | [4:8] from 2
    #    2 | a    | [0:8]   | [4:8]            | [4:8] -> 1      | [0:4] from 1
    #    3 | b    | [0:8]   | [0:4]            | [0:4] -> 4      | [4:8] from 4
    #    4 | b    | [0:8]   | [4:8]            | [4:8] -> 3      | [0:4] from 3

Rank 0 sends 2 copies (not 4); ranks 1-4 forward the other 2.

Which domains relay: one that holds none of the tensor's sources (there the direct plan
already picks same-host senders) and in which some piece is needed by two or more ranks.
Every other domain's ranks receive their own regions in stage 1, as in a direct plan.
``relay="auto"`` relays when some tensor has such a domain and falls back to the direct
plan (exactly today's) otherwise; ``relay="on"`` always runs the two stages.

Overlap (:func:`overlapped_schedule`): the two stages run as one schedule, so forwarding
overlaps arrival. Stage 1's buckets keep their rounds (a bucket is a chunk: at most the
pair's share of ``staging_bytes``); every stage-2 bucket moves to the first round after
the last round that brings any of its bytes to its sender, and never shares a round with
more of its pair's bytes than the pair's bucket size. A round completes before the next
begins (and the pipelined executor waits for the earlier rounds before packing a forward),
so a byte is forwarded only once it has landed, and stage 2 of chunk ``c`` is on the wire
with stage 1 of chunk ``c + 1``. Stage-2 buckets carry ``stage=1`` (their tensors keep
their names: the executor keys a tensor by ``(name, stage)``), bound to views of the same
destination memory. Every rank counts
its pairs of both stages when sizing buckets, so one round keeps at most
``staging_bytes`` in flight per rank, as a direct plan does. Each process derives the
rounds of the pairs it takes part in from the two plans alone (a stage-2 pair's rounds
from its sender's stage-1 arrivals, which both ends compute): no extra metadata crosses.

Cost model: with ``m`` replicas in a domain each rank receives ``1/m`` of what it needs
over the slow link (stage 1) and ``(m-1)/m`` over the fast one (stage 2). Back to back,
stage 2 adds ``(m-1) * slow / fast`` of stage 1's time (13% per extra replica with the
H100 preset's 47 GB/s NIC and 370 GB/s NVLink; m = 4: +38%). Overlapped, a rank's NIC
and NVLink work at once and the refit takes ``max(stage 1, stage 2)`` plus one chunk of
the stage it ends on: with ``N`` rounds of stage 1, ``N + 1`` rounds instead of about
``2N`` (more exactly: stage 2 hides behind stage 1 while ``(m-1) * slow / fast < 1``,
i.e. up to 8 replicas per domain on that preset). What overlap does not remove: the
first round forwards nothing, and on CPU, where "fast" and "slow" are the same loopback
and the same cores, both stages compete for them (see benchmarks/bench_relay.py).

Delta through a relay (``RefitConfig(delta=True, relay=...)``, issue 22 item 2): a
forwarder is the *sender* of its stage-2 pairs, like a trainer rank is of its stage-1
pairs. It keeps the bytes it last forwarded per pair and bucket (its baseline, host
memory), diffs what landed in its destination memory against it and sends the smallest of
dense, bitmask + values and runs + values (:mod:`xreshard.runtime.delta_exec`); the
per-pair version fence of :mod:`xreshard.runtime.delta_wire` decides each stage-2 pair
``(forwarder, receiver)`` exactly as it decides a stage-1 pair. Rejected: forwarding the
stage-1 delta message verbatim. A stage-2 bucket is cut by its own pair's budget from
pieces that arrived in several stage-1 buckets (other senders, other tags, other pack
order), so a message would have to be cut and re-headed, i.e. re-encoded anyway; and a
forwarder that received dense (it is new or had a wrong base) would have no delta to pass
on to receivers whose base is right. With a baseline per forwarded pair, each pair's
decision stands alone: a forwarder with a wrong base receives dense yet forwards deltas;
a receiver with a wrong base gets dense from its stage-1 sender and from its forwarder;
the baseline's call moves only at the outcome exchange; any failure makes every pair
dense next. The cost: a forwarder holds as many baseline bytes as it forwards per call
(``RefitReport.delta["baseline_bytes"]``) and diffs them once per call. Timing: the delta
executor sends a bucket's header (which needs its encoding) one group before its
payload, and lands round ``k``'s payloads at the end of group ``k + 1``, so a forward is
encoded from landed bytes only when it runs two rounds after its last arrival
(``lag=2`` in :func:`overlapped_schedule`; one round later than a plain relay). With
``atomic=True`` a forwarder forwards from its staging (stage 1 lands there) and its
forwards' baselines change only at the outcome, like any sender's. With FP8 destinations
(below) a forward is plain codes and scales: diffed in bytes against what was last
forwarded, so only the codes and scales of changed blocks cross the fast links again.

FP8 through a relay (destinations quantized on the way, :mod:`xreshard.planner.quantize`,
issue 20 item 3): stage 1 is the direct call's quantization restricted to ``stage1_dst``,
whose pieces of a quantized tensor are cut along whole blocks (``_cut`` with the block
shape; the destinations' shards are block-aligned already, ``QuantizedTensor.
check_layouts``): a sender that holds a piece's blocks whole quantizes them and sends
codes + scales, as it would to any receiver. Stage 2 forwards what the forwarder then
holds, its finished codes and the scales of their blocks, as two plain tensors
(:func:`fp8_forwards`): no quantizer runs in stage 2, so a replica's bytes are its
forwarder's, which are the quantizer's (vLLM's), bit for bit, and the forwards are half
of bf16 too. A forward waits for the FP8 items that write its codes and scales (an FP8
item's arrival counts for its blocks' scales). Rejected: forwarding the bf16 values of
blocks the forwarder receives split across senders (it holds them in scratch and
quantizes them only after every round): a receiver of such a piece would need a scratch
and a finishing pass of its own for stage 2, and forwarding the finished codes instead
would need the finish moved ahead of later rounds. Such a tensor (:func:`split_at_forwarders`;
it happens only where the trainer's shards cut the destination's blocks) is not relayed:
its domains receive it directly, split blocks quantized by each receiver, exactly as
without relay.

Pure: layouts and a topology in, layouts and schedules out; every process derives the
same stages. :func:`xreshard.planner.prepare.prepare` plans both stages and their
overlapped schedule into one prepared call; the runtime runs it.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping

from ..dtypes import itemsize
from ..ir.geometry import Region
from ..ir.intervals import chunk
from ..ir.layout import Layout
from .schedule import Bucket, Schedule, pair_bucket_bytes, peer_counts, schedule

__all__ = ["RelayLayouts", "overlapped_schedule", "relay_layouts"]


@dataclass(frozen=True)
class RelayLayouts:
    """The two stages of a relayed refit (see the module docstring).

    Attributes:
        stage1_dst: destination layout of stage 1, every tensor.
        stage2_src: what each relay rank forwards, only tensors that forward anything.
        stage2_dst: what each rank receives from its domain, same tensors as stage2_src.
        bytes_relayed: destination bytes that arrive by forwarding (stage 2), over all.
    """

    stage1_dst: dict[str, Layout]
    stage2_src: dict[str, Layout]
    stage2_dst: dict[str, Layout]
    bytes_relayed: int

    @property
    def forwards(self) -> bool:
        return bool(self.stage2_dst)


def domain_of(topology: Any, rank: int) -> Any:
    """The fast domain of ``rank``: its host, else the rank alone."""
    host = topology.host_of(rank) if topology is not None else None
    return ("host", host) if host is not None else ("rank", rank)


def _cells(regions: list[tuple[int, Region]], ndim: int) -> dict[tuple[int, ...], list[Any]]:
    """Grid cells (index tuples) of ``regions`` -> [cell region, ranks needing it]."""
    bounds = [sorted({b for _, r in regions for b in (r.starts[d], r.stops[d])})
              for d in range(ndim)]
    cells: dict[tuple[int, ...], list[Any]] = {}
    for rank, r in regions:
        ranges = [range(bisect_left(bounds[d], r.starts[d]), bisect_left(bounds[d], r.stops[d]))
                  for d in range(ndim)]
        for idx in itertools.product(*ranges):
            got = cells.get(idx)
            if got is None:
                box = Region(tuple(bounds[d][i] for d, i in enumerate(idx)),
                             tuple(bounds[d][i + 1] for d, i in enumerate(idx)))
                got = cells[idx] = [box, []]
            got[1].append(rank)
    return cells


def _cut(box: Region, k: int, block: tuple[int, ...] | None = None) -> list[Region]:
    """``box`` in ``k`` row blocks along its first dim longer than 1 (fewer if short);
    with ``block`` (a quantized tensor's block shape), along whole blocks: the first dim
    more than one block long, cut on multiples of the block (``box`` starts on one)."""
    unit = block or (1,) * box.ndim
    counts = [-(-n // u) for n, u in zip(box.shape, unit)]
    dim = next((d for d, n in enumerate(counts) if n > 1), None)
    if dim is None or k <= 1:
        return [box]
    n, a, u, end = counts[dim], box.starts[dim], unit[dim], box.stops[dim]
    out = []
    for i in range(min(k, n)):
        off, length = chunk(n, min(k, n), i)
        if length:
            lo, hi = a + off * u, min(a + (off + length) * u, end)
            out.append(Region(box.starts[:dim] + (lo,) + box.starts[dim + 1:],
                              box.stops[:dim] + (hi,) + box.stops[dim + 1:]))
    return out


def _pieces(dst: Layout, src_domains: frozenset[Any] | None, domain: Any,
            block: tuple[int, ...] | None = None) -> list[Any]:
    """Per domain of ``dst``'s ranks: (domain, ranks, cells) with cells the sorted
    [(box, ranks needing it, its parts)], or None where the domain receives directly."""
    by_domain: dict[Any, list[int]] = {}
    for r in dst.ranks:
        if dst.num_elements(r):
            by_domain.setdefault(domain(r), []).append(r)
    out = []
    for dom, ranks in by_domain.items():
        cells = None
        if src_domains is not None and dom not in src_domains and len(ranks) > 1:
            grid = _cells([(r, reg) for r in ranks for reg in dst.regions(r)], dst.ndim)
            if any(len(needers) > 1 for _, needers in grid.values()):
                cells = [(box, needers, _cut(box, len(needers), block))
                         for box, needers in (grid[idx] for idx in sorted(grid))]
        out.append((dom, ranks, cells))
    return out


def relay_layouts(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                  topology: Any, *, blocks: Mapping[str, tuple[int, ...]] | None = None,
                  direct: Collection[str] = ()) -> RelayLayouts:
    """The stage layouts of a relayed refit (see the module docstring).

    Args:
        src_layouts / dst_layouts: the refit's merged layouts (tensors only on one side
            are left to the planner to refuse).
        topology: a ``Topology`` or ``World`` (its ``host_of`` names the domains), or None
            (every rank its own domain: nothing relays).
        blocks: name -> block shape of the tensors quantized on the way: their pieces are
            cut along whole blocks (see "FP8 through a relay").
        direct: tensors not to relay (every domain receives them directly).

    Returns:
        A :class:`RelayLayouts`; every destination element is written exactly once over
        the two stages, every stage-2 piece has exactly one holder in the receiver's domain.
    """
    topology = getattr(topology, "topology", topology)
    stage1: dict[str, Layout] = {}
    stage2_src: dict[str, Layout] = {}
    stage2_dst: dict[str, Layout] = {}
    relayed = 0
    loads: dict[Any, dict[int, int]] = {}       # domain -> rank -> bytes assigned
    domains: dict[int, Any] = {}
    src_memo: dict[Layout, frozenset[Any]] = {}
    # layouts are interned: tensors share the work, and most get equal stage layouts
    pieces_memo: dict[tuple[Any, ...], list[Any]] = {}
    made: dict[tuple[Any, ...], Layout] = {}

    def domain(rank: int) -> Any:
        got = domains.get(rank)
        if got is None:
            got = domains[rank] = domain_of(topology, rank)
        return got

    for name in sorted(dst_layouts):
        dst = dst_layouts[name]
        src = src_layouts.get(name)
        isz = itemsize(dst.dtype)
        src_domains = None
        if src is not None and name not in direct:
            src_domains = src_memo.get(src)
            if src_domains is None:
                src_domains = src_memo[src] = frozenset(
                    domain(r) for r in src.ranks if src.num_elements(r))
        block = (blocks or {}).get(name)
        key = (dst, src_domains, block)
        pieces = pieces_memo.get(key)
        if pieces is None:
            pieces = pieces_memo[key] = _pieces(dst, src_domains, domain, block)
        one: dict[int, list[Region]] = {}
        fwd_src: dict[int, list[Region]] = {}
        fwd_dst: dict[int, list[Region]] = {}
        for dom, ranks, cells in pieces:
            if cells is None:        # direct: every rank receives its own regions
                for r in ranks:
                    one[r] = list(dst.regions(r))
                continue
            load = loads.setdefault(dom, {})
            for r in ranks:
                one.setdefault(r, [])
            for box, needers, parts in cells:
                takers = sorted(needers, key=lambda r: (load.get(r, 0), r))
                for part, taker in zip(parts, takers):
                    one[taker].append(part)
                    nbytes = part.size * isz
                    load[taker] = load.get(taker, 0) + nbytes
                    others = [r for r in needers if r != taker]
                    if others:
                        fwd_src.setdefault(taker, []).append(part)
                    for r in others:
                        fwd_dst.setdefault(r, []).append(part)
                        relayed += nbytes
        stage1[name] = _explicit(dst, one, made)
        if fwd_dst:
            stage2_src[name] = _explicit(dst, fwd_src, made)
            stage2_dst[name] = _explicit(dst, fwd_dst, made)
    return RelayLayouts(stage1, stage2_src, stage2_dst, relayed)


def _explicit(like: Layout, regions: dict[int, list[Region]],
              made: dict[tuple[Any, ...], Layout]) -> Layout:
    """``Layout.explicit_form`` (shape and dtype of ``like``), remembered in ``made``: its
    checks cost ~1 ms for a hundred ranks, and most tensors repeat a few stage layouts."""
    key = (like.shape, like.dtype, tuple((r, tuple(regions[r])) for r in sorted(regions)))
    got = made.get(key)
    if got is None:
        got = made[key] = Layout.explicit_form(like.shape, like.dtype, regions)
    return got


# ---------------------------------------------------------------------------- overlap


def overlapped_schedule(plan1: Any, plan2: Any, ranks: Iterable[int], *, bucket_bytes: int,
                        staging_bytes: int, overlap: bool = True, lag: int = 1,
                        quantized: Mapping[str, Any] | None = None) -> Schedule:
    """Both stages of a relayed refit as one schedule for ``ranks`` (this process's).

    Stage 1's buckets (``stage=0``) keep their rounds; each stage-2 bucket (``stage=1``)
    runs in the first round after every stage-1 round that brings its bytes to its
    sender (see the module docstring). A pair's stage-2 tags follow its stage-1 tags.
    Pure: the same plans give every process the same rounds for every pair.

    Args:
        plan1 / plan2: the stage plans (sources -> stage1_dst, stage2_src -> stage2_dst).
        ranks: the world ranks this process executes.
        bucket_bytes / staging_bytes: as for :func:`xreshard.planner.schedule.schedule`; every
            rank's pairs of both stages share ``staging_bytes`` in a round.
        overlap: False puts every forward after its sender's last stage-1 round (the
            stages back to back, for comparison).
        lag: rounds between the last stage-1 round that brings a forward's bytes and the
            forward: 1, or 2 for a delta call (see "Delta through a relay" above).
        quantized: name -> ``QuantizedTensor`` of the tensors quantized on the way in stage
            1 (cut into FP8 items and the rest, as :func:`schedule` cuts them); a forward
            of their scales waits for the FP8 items that bring them.
    """
    assert lag >= 1, lag
    ranks = sorted(set(ranks))
    mine = set(ranks)
    # every stage-2 sender of a local rank: its stage-1 arrivals time the forwards
    senders = sorted({t.src for r in ranks for t in plan2.transfers_for(r)} - mine)
    counts = _both_counts(plan1, plan2, ranks, senders)
    quantized = quantized or {}
    sched1 = schedule(plan1, ranks, counts, bucket_bytes=bucket_bytes,
                      staging_bytes=staging_bytes, quantized=quantized)
    arrivals = _arrivals(sched1.rounds, mine, quantized)
    if senders:
        remote = schedule(plan1, senders, counts, bucket_bytes=bucket_bytes,
                          staging_bytes=staging_bytes, quantized=quantized)
        arrivals.update(_arrivals(remote.rounds, set(senders), quantized))
    sched2 = schedule(plan2, ranks, counts, bucket_bytes=bucket_bytes,
                      staging_bytes=staging_bytes, stage=1)
    first_tag: dict[tuple[int, int], int] = {}
    for rnd in sched1.rounds:
        for b in rnd:
            first_tag[(b.src, b.dst)] = max(first_tag.get((b.src, b.dst), 0), b.tag + 1)
    by_pair: dict[tuple[int, int], list[Bucket]] = {}
    for rnd in sched2.rounds:
        for b in rnd:
            by_pair.setdefault((b.src, b.dst), []).append(b)
    rounds = [list(rnd) for rnd in sched1.rounds]
    for (src, dst), buckets in sorted(by_pair.items()):
        size = pair_bucket_bytes(src, dst, counts, bucket_bytes=bucket_bytes,
                                 staging_bytes=staging_bytes)
        arrived = arrivals.get(src, {})
        if overlap:
            ready = {b.tag: _ready(b, arrived, lag) for b in buckets}
        else:
            last = lag + max((k for got in arrived.values() for _, k in got), default=0)
            ready = {b.tag: last for b in buckets}
        at = used = 0
        for i, b in enumerate(sorted(buckets, key=lambda b: (ready[b.tag], b.tag))):
            if ready[b.tag] > at:
                at, used = ready[b.tag], 0
            elif used and used + b.nbytes > size:
                at, used = at + 1, 0
            used += b.nbytes
            while len(rounds) <= at:
                rounds.append([])
            rounds[at].append(dataclasses.replace(
                b, round=at, tag=first_tag.get((src, dst), 0) + i))
    in_flight: dict[tuple[int, int], int] = {}
    for k, buckets in enumerate(rounds):
        for b in buckets:
            for r in {b.src, b.dst} & mine:
                in_flight[(k, r)] = in_flight.get((k, r), 0) + b.nbytes
    return Schedule(tuple(tuple(r) for r in rounds),
                    sched1.local_copies + sched2.local_copies,
                    max(in_flight.values(), default=0))


def _both_counts(plan1: Any, plan2: Any, ranks: list[int], senders: list[int]
                 ) -> dict[int, int]:
    """Peer counts over both stages (a pair in both counts twice: it may use its budget in
    each) of every rank that shares a pair with ``ranks`` or, in stage 1, with ``senders``."""
    needed = set(ranks) | set(senders)
    for r in ranks:
        needed.update(x for t in plan2.transfers_for(r) for x in (t.src, t.dst))
    for r in set(ranks) | set(senders):
        needed.update(x for t in plan1.transfers_for(r) for x in (t.src, t.dst))
    one, two = peer_counts(plan1, sorted(needed)), peer_counts(plan2, sorted(needed))
    return {r: one[r] + two[r] for r in needed}


def _arrivals(rounds: Iterable[Iterable[Bucket]], ranks: set[int],
              quantized: Mapping[str, Any] | None = None
              ) -> dict[int, dict[str, list[tuple[Region, int]]]]:
    """rank -> tensor -> [(region, round it lands in)] of the stage-1 receives of ``ranks``
    (an FP8 item of a tensor quantized on the way brings its blocks' scales too)."""
    out: dict[int, dict[str, list[tuple[Region, int]]]] = {}
    for k, rnd in enumerate(rounds):
        for b in rnd:
            if b.dst in ranks:
                got = out.setdefault(b.dst, {})
                for it in b.items:
                    got.setdefault(it.name, []).append((it.region, k))
                    if it.quantized:
                        qt = quantized[it.name]    # type: ignore[index]
                        got.setdefault(qt.scale, []).append(
                            (qt.format.blocks(it.region, qt.shape), k))
    return out


def _ready(b: Bucket, arrived: Mapping[str, list[tuple[Region, int]]], lag: int = 1) -> int:
    """The first round in which stage-2 bucket ``b`` may run: ``lag`` rounds after every
    stage-1 round that lands a part of one of its items at its sender (round 1 at the
    earliest: the sender's same-rank copies are done by then on both executors)."""
    ready = 1
    for it in b.items:
        for region, k in arrived.get(it.name, ()):
            if k + lag > ready and _overlaps(region, it.region):
                ready = k + lag
    return ready


def _overlaps(a: Region, b: Region) -> bool:
    return all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(a.starts, a.stops, b.starts,
                                                             b.stops))


# ---------------------------------------------------------------------------- FP8


def split_at_forwarders(quantized: Mapping[str, Any], plan1: Any, layouts: RelayLayouts
                        ) -> set[str]:
    """The tensors quantized on the way of which some forwarder would forward a block it
    receives split across stage-1 transfers (so it holds the block's values in scratch,
    not its codes, until the call's end): they are not relayed (see "FP8 through a
    relay")."""
    from .quantize import core_of, rest_boxes
    out = set()
    for name, fwd in layouts.stage2_src.items():
        qt = quantized.get(name)
        if qt is None:
            continue
        for f in fwd.ranks:
            sent = fwd.regions(f)
            got = [t.region for t in plan1.transfers_for(f) if t.dst == f and t.name == name]
            got += [t.region for t in plan1.local_copies_for(f) if t.name == name]
            if any(_overlaps(box, s) for g in got for box in rest_boxes(g, core_of(qt, g))
                   for s in sent):
                out.add(name)
                break
    return out


def fp8_forwards(layouts: RelayLayouts, quantized: Mapping[str, Any]
                 ) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """Stage 2's source and destination layouts with every tensor quantized on the way
    forwarded as what its forwarder holds: its codes (the format's dtype) and, as a tensor
    of its own, the scales of their blocks (the pieces are whole blocks)."""
    made: dict[tuple[Any, ...], Layout] = {}
    out: tuple[dict[str, Layout], dict[str, Layout]] = (dict(layouts.stage2_src),
                                                        dict(layouts.stage2_dst))
    for side in out:
        for name in sorted(set(side) & set(quantized)):
            qt, lay = quantized[name], side[name]
            fmt = qt.format
            regions = {r: list(lay.regions(r)) for r in lay.ranks}
            side[name] = _explicit(Layout.explicit_form(qt.shape, fmt.dtype, {}), regions,
                                   made)
            side[qt.scale] = _explicit(
                Layout.explicit_form(qt.scale_shape, fmt.scale_dtype, {}),
                {r: [fmt.scale_region(g, qt.shape, name) for g in regs]
                 for r, regs in regions.items()}, made)
    return out
