"""The shipped relay's messages, for every rank of a world: what ``RefitConfig(relay="on")``
sends, round by round.

A relayed refit (``xreshard.planner.relay``) plans two stages with the world's hosts as
its domains - here the cluster's NVLink domains, declared as hosts (``World.join(host=
...)``): stage 1 sends each piece a domain needs into it once, cut 1/m over the m ranks of
the domain that need it; stage 2 forwards every part from its taker to the domain's other
needers. ``relay.overlapped_schedule`` runs both as one schedule: stage 1 keeps its rounds,
every forward runs in the first round after the stage-1 rounds that land its bytes at its
sender, and no pair's round holds more than the pair's bucket size.

:func:`relay_traffic` lists the same messages (the same rounds, pairs and byte counts)
without the executor's ``Bucket`` objects, of which DeepSeek-V3 on 256 ranks needs ~50
million: the stage decisions come from :mod:`.stages`; stage 1's transfers from the real
planner (``plan`` of the stage-1 layouts: its senders and quotas are the refit's); stage
2's from the decisions (each forwarded part has one holder); each pair's messages from the
scheduler's rules (``traffic.cut_messages``, ``fill_rounds``), once per distinct sequence.
:func:`relay_replays_executor` prepares the same call as a ``Refit`` does
(``xreshard.planner.prepare.prepare``, whose schedule the executor runs) and compares the
two message lists: the check ``tests/test_simulate.py`` pins and
``benchmarks/bench_simulate.py`` reports.

Pure: a plan, the domain of every rank and the two byte budgets in; messages out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..planner.schedule import pair_bucket_bytes
from .stages import RelayStages, relay_stages
from .traffic import PairTraffic, PartTable, Pattern, RankReceives, ShapeIds, Traffic, \
    WireKeys, cut_messages, fill_rounds, pair_pattern, rank_receives
from .wire import Wire, wire_regions

__all__ = ["RelayTraffic", "relay_traffic", "domain_topology", "executor_messages",
           "relay_replays_executor"]

#: parts of one tensor that one rank takes in stage 1 stay below this (a code's radix)
_PARTS = 1 << 20


def domain_topology(domain: Sequence[int]) -> Any:
    """The ``Topology`` a relayed refit sees when every rank is its own process and each
    NVLink domain is declared as one host."""
    from ..ir.topology import Topology
    return Topology({r: r for r in range(len(domain))},
                    {r: f"domain {d}" for r, d in enumerate(domain)})


@dataclass(frozen=True)
class RelayTraffic:
    """The relay's messages (``traffic.forward`` marks stage 2's pairs) and the stage-1
    plan and decisions they came from."""

    traffic: PairTraffic
    stages: RelayStages
    plan1: Any


class _Forwards:
    """Every stage-2 transfer of every tensor as rows - tensor, taker, part (its index in
    the taker's stage-1 regions), targets (an id into ``target_sets``), region, shape id -
    grouped by taker and, within one, in the scheduler's order (tensor, region bounds)."""

    def __init__(self, stages: RelayStages, dst_layouts: Any):
        sets: dict[tuple[int, ...], int] = {}
        flat = []           # (forward, piece) of every decision, each decision's in order
        starts = [0]
        for fw in stages.forwards:
            rows = [(f, piece) for f in fw for piece in f.pieces]
            rows.sort(key=lambda x: (x[0].taker, x[1].starts, x[1].stops))
            flat.extend(rows)
            starts.append(len(flat))
        for f, _ in flat:
            sets.setdefault(f.targets, len(sets))
        self.target_sets = list(sets)
        self.regions = [piece for _, piece in flat]
        lens = np.diff(starts)[stages.choice]
        tensor: np.ndarray = np.repeat(np.arange(len(stages.names)), lens)
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        fid = np.asarray(starts, np.int64)[stages.choice][tensor] + within
        taker = np.array([f.taker for f, _ in flat], np.int64)[fid]
        order = np.argsort(taker, kind="stable")
        self.tensor = tensor[order]
        self.fid = fid[order]
        takers = taker[order]
        self.part = np.array([f.index for f, _ in flat], np.int64)[self.fid]
        self.targets = np.array([sets[f.targets] for f, _ in flat], np.int64)[self.fid]
        self.relays = np.unique(takers).tolist()
        self._bounds = takers.searchsorted(np.array(self.relays + [len(takers) and
                                                                   takers[-1] + 1]))
        self.pairs = sorted({(f.taker, x) for f, _ in flat for x in f.targets})
        self.shape: np.ndarray = np.zeros(len(self.fid), np.int64)

    def name_shapes(self, shape_ids: ShapeIds, keys: WireKeys) -> None:
        """Give every row its (piece shape, wire cost) id; stage 2 moves the destination's
        dtype (stage 1 already cast)."""
        width = len(keys.specs)
        code = self.fid * width + keys.cls[self.tensor]
        uniq, inverse = np.unique(code, return_inverse=True)
        ids = np.fromiter((shape_ids(keys.key(u % width, self.regions[u // width]))
                           for u in uniq.tolist()), np.int64, len(uniq))
        self.shape = ids[inverse.reshape(-1)]

    def rows_of(self, i: int) -> slice:
        """Rows of relay ``self.relays[i]``."""
        return slice(int(self._bounds[i]), int(self._bounds[i + 1]))


class _Arrivals:
    """When each part a relay took in stage 1 has landed there: ``ready`` (the first
    round a forward of it may run in) and whether every byte of it landed in one round
    (then every piece of it is ready then; else pieces are timed by what overlaps them,
    as ``relay._ready`` does)."""

    def __init__(self, relay: int, rec: RankReceives, stages: RelayStages,
                 patterns: list[Pattern], pair_pattern: dict[tuple[int, int], int],
                 shapes: list[tuple[tuple[int, ...], Any]]):
        self.rec, self.patterns, self.shapes = rec, patterns, shapes
        first, last, pat, pos = [], [], [], []
        for a, b in zip(rec.starts.tolist(), rec.stops.tolist()):
            k = pair_pattern[(int(rec.src[a]), relay)]
            p = patterns[k]
            first.append(p.part_round[p.item_parts[:-1]])
            last.append(p.part_round[p.item_parts[1:] - 1])
            pat.append(np.full(b - a, k, np.int64))
            pos.append(np.arange(b - a))
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        self.pat, self.pos = cat(pat), cat(pos)
        # the stage-1 part (region index in the relay's stage-1 layout) holding each row
        choice = stages.choice[rec.tensor].astype(np.int64)
        combo = choice * (len(rec.table.regions) + 1) + rec.region
        uniq, inverse = np.unique(combo, return_inverse=True)
        width = len(rec.table.regions) + 1
        holder: np.ndarray = np.empty(len(uniq), np.int64)
        for u, c in enumerate(uniq.tolist()):
            holder[u] = _containing(stages.layouts[c // width].regions(relay),
                                    rec.table.regions[c % width], relay)
        code = rec.tensor.astype(np.int64) * _PARTS + holder[inverse.reshape(-1)]
        self.row_code = code
        order = np.argsort(code, kind="stable")
        self.order = order
        codes = code[order]
        self.codes, cut = np.unique(codes, return_index=True)
        self.cut = np.append(cut, len(codes))
        f, l_ = cat(first)[order], cat(last)[order]
        self.ready = 1 + np.maximum.reduceat(l_, cut) if len(cut) else np.zeros(0, np.int64)
        self.uniform = (np.minimum.reduceat(f, cut) == self.ready - 1) if len(cut) else \
            np.zeros(0, bool)
        self._exact: dict[tuple[int, int], np.ndarray] = {}

    def lookup(self, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ready, uniform)`` of parts ``code`` (tensor * _PARTS + part index)."""
        i = np.searchsorted(self.codes, code)
        assert (self.codes[i] == code).all(), "a forwarded part never arrived in stage 1"
        return self.ready[i], self.uniform[i]

    def exact(self, code: int, region: Any, wire: Any, size: int) -> np.ndarray:
        """Ready round of each piece ``wire_regions(region, wire, size)`` of part
        ``code``: one after the last stage-1 round landing bytes that overlap it."""
        got = self._exact.get((code, size))
        if got is not None:
            return got
        g = int(np.searchsorted(self.codes, code))
        lo: list[tuple[int, ...]] = []
        hi: list[tuple[int, ...]] = []
        rnd: list[np.ndarray] = []
        for row in self.order[self.cut[g]:self.cut[g + 1]].tolist():
            p = self.patterns[int(self.pat[row])]
            k = int(self.pos[row])
            boxes = wire_regions(self.rec.table.regions[int(self.rec.region[row])],
                                 self.shapes[int(self.rec.shape[row])][1], p.size)
            lo.extend(b.starts for b in boxes)
            hi.extend(b.stops for b in boxes)
            rnd.append(p.part_round[p.item_parts[k]:p.item_parts[k + 1]])
        pieces = wire_regions(region, wire, size)
        q_lo = np.array([q.starts for q in pieces], np.int64)[:, None, :]
        q_hi = np.array([q.stops for q in pieces], np.int64)[:, None, :]
        a_lo, a_hi = np.array(lo, np.int64)[None], np.array(hi, np.int64)[None]
        landed = np.concatenate(rnd)
        ready: np.ndarray = np.empty(len(pieces), np.int64)
        step = max(1, (1 << 22) // max(1, len(landed)))      # bound the Q x L block
        for i in range(0, len(pieces), step):
            meets = ((q_lo[i:i + step] < a_hi) & (a_lo < q_hi[i:i + step])).all(axis=2)
            ready[i:i + step] = 1 + np.where(meets, landed[None], -1).max(axis=1)
        got = self._exact[(code, size)] = np.maximum(ready, 1)
        return got


def _containing(held: Sequence[Any], region: Any, rank: int) -> int:
    """Index of the region of ``held`` (``rank``'s stage-1 regions of a tensor) that holds
    ``region`` (a stage-1 transfer is a piece of one)."""
    for j, h in enumerate(held):
        if all(a <= x and y <= b for a, b, x, y in zip(h.starts, h.stops, region.starts,
                                                       region.stops)):
            return j
    raise AssertionError(f"stage-1 piece {region} lies in no stage-1 region of rank {rank}")


def _forward_pattern(fwd: _Forwards, rows: np.ndarray, arrived: _Arrivals, size: int,
                     parts: PartTable, wire: Wire) -> Pattern:
    """The messages of one stage-2 pair forwarding ``rows`` (in the scheduler's order):
    cut as the scheduler cuts them, each ready when all its pieces' bytes have landed at
    the relay, then rounds filled as ``overlapped_schedule`` fills them."""
    part_bytes, part_elems, prow = parts.expand(fwd.shape[rows], size)
    code = fwd.tensor[rows] * _PARTS + fwd.part[rows]
    ready, uniform = arrived.lookup(code)
    part_ready = ready[prow]
    uneven = np.flatnonzero(~uniform)
    if len(uneven):
        # asarray: a no-op that mypy needs (numpy's stubs type searchsorted(v=array) a scalar)
        at = np.asarray(prow.searchsorted(np.arange(len(rows) + 1)))
        for i in uneven.tolist():
            row = int(rows[i])
            part_ready[at[i]:at[i + 1]] = arrived.exact(
                int(code[i]), fwd.regions[int(fwd.fid[row])],
                parts.shapes[int(fwd.shape[row])][1], size)
    msg, msg_bytes = cut_messages(part_bytes, size)
    first = np.flatnonzero(np.diff(msg, prepend=-1))
    msg_ready = np.maximum.reduceat(part_ready, first) if len(first) else part_ready[:0]
    order, rounds = fill_rounds(msg_bytes, size, msg_ready)
    if wire.delta is not None:
        msg_bytes = wire.encode(msg_bytes, np.bincount(msg, weights=part_elems,
                                                       minlength=len(msg_bytes)))
    return Pattern(rounds, msg_bytes[order], size, rounds[:0], np.zeros(1, np.int64))


def relay_traffic(plan: Any, domain: Sequence[int], *, bucket_bytes: int,
                  staging_bytes: int, progress: Callable[[int, int], None] | None = None,
                  wire: Wire | None = None) -> RelayTraffic:
    """The messages of ``plan``'s refit with ``RefitConfig(relay="on")`` when rank ``r``
    lives in NVLink domain ``domain[r]`` (declared as its host); ``bucket_bytes`` and
    ``staging_bytes`` as ``overlapped_schedule`` takes them; each message's bytes as
    ``wire`` says (default: the plan's dtypes).

    Returns:
        A :class:`RelayTraffic`: the stage-1 pairs (sorted), then the stage-2 pairs.
    """
    from ..planner.plan import plan as make_plan
    wire = wire if wire is not None else Wire()
    stages = relay_stages(plan.src_layouts, plan.dst_layouts, domain)
    plan1 = make_plan(plan.src_layouts, stages.stage1_dst, domain_topology(domain),
                      wire_dtype=dict(plan.wire_dtypes))
    assert plan1.names == stages.names
    fwd = _Forwards(stages, plan.dst_layouts)
    keys1 = WireKeys(plan1, wire)
    keys2 = WireKeys(plan1, wire, {n: lay.dtype for n, lay in plan.dst_layouts.items()})
    shape_ids = ShapeIds()
    dst_ranks = sorted({r for lay in {id(v): v for v in plan1.dst_layouts.values()}.values()
                        for r in lay.ranks})
    steps = len(dst_ranks) + len(fwd.relays)
    receives: dict[int, RankReceives] = {}
    for i, r in enumerate(dst_ranks):
        receives[r] = rank_receives(plan1, r, keys1, shape_ids)
        if progress is not None:
            progress(i + 1, steps)
    fwd.name_shapes(shape_ids, keys2)
    pairs1 = [(int(rec.src[a]), r) for r, rec in receives.items() for a in rec.starts.tolist()]
    counts = dict(Counter(x for p in pairs1 + fwd.pairs for x in p))
    parts = PartTable(shape_ids.shapes)

    def size_of(a: int, b: int) -> int:
        return pair_bucket_bytes(a, b, counts, bucket_bytes=bucket_bytes,
                                 staging_bytes=staging_bytes)

    # stage 1: one pattern per (bucket size, item sequence), as the direct schedule
    memo: dict[tuple[int, bytes], int] = {}
    patterns: list[Pattern] = []
    pair_of: dict[tuple[int, int], int] = {}
    for r, rec in receives.items():
        for a, b in zip(rec.starts.tolist(), rec.stops.tolist()):
            s = int(rec.src[a])
            size = size_of(s, r)
            seq = rec.shape[a:b]
            k = memo.setdefault((size, seq.tobytes()), len(patterns))
            if k == len(patterns):
                patterns.append(pair_pattern(seq, size, parts, wire))
            pair_of[(s, r)] = k
    # stage 2: per relay, when each part it took has landed, then each pair's messages
    forward_of: dict[tuple[int, int], int] = {}
    for i, relay in enumerate(fwd.relays):
        arrived = _Arrivals(relay, receives[relay], stages, patterns, pair_of, shape_ids.shapes)
        rows = np.arange(len(fwd.tensor))[fwd.rows_of(i)]
        ids = np.unique(fwd.targets[rows]).tolist()
        targets = sorted({x for j in ids for x in fwd.target_sets[j]})
        memo2: dict[tuple, int] = {}
        for t in targets:
            wanted = tuple(j for j in ids if t in fwd.target_sets[j])
            key = (size_of(relay, t), wanted)
            known = memo2.get(key)
            if known is None:
                sel = rows if len(wanted) == len(ids) else rows[np.isin(fwd.targets[rows],
                                                                        wanted)]
                known = memo2[key] = len(patterns)
                patterns.append(_forward_pattern(fwd, sel, arrived, key[0], parts, wire))
            forward_of[(relay, t)] = known
        if progress is not None:
            progress(len(dst_ranks) + i + 1, steps)
    keys = sorted(pair_of) + sorted(forward_of)
    ends = np.array(keys, np.int32).reshape(-1, 2)
    pattern = np.array([pair_of[p] for p in sorted(pair_of)]
                       + [forward_of[p] for p in sorted(forward_of)], np.int32)
    forward: np.ndarray = np.repeat([False, True], [len(pair_of), len(forward_of)])
    traffic = PairTraffic(ends[:, 0].copy(), ends[:, 1].copy(), pattern,
                          [p.rounds for p in patterns], [p.sizes for p in patterns], forward)
    return RelayTraffic(traffic, stages, plan1)


# ---------------------------------------------------------------------------- the check

def executor_messages(plan: Any, domain: Sequence[int], *, bucket_bytes: int,
                      staging_bytes: int, ranks: Iterable[int] | None = None,
                      relay: str = "on") -> Traffic:
    """The messages the executor runs for ranks ``ranks`` (default: all) in ``plan``'s
    refit when rank ``r`` lives in domain ``domain[r]``: the schedule of the call
    :func:`xreshard.planner.prepare.prepare` builds, as a ``Refit`` prepares it
    (``relay="on"``: both stages, overlapped; ``Bucket`` objects, so small worlds only).
    A bucket of stage 1 is a forward."""
    from ..planner.prepare import CallOptions, prepare
    options = CallOptions(bucket_bytes=bucket_bytes, staging_bytes=staging_bytes,
                          wire_dtype=dict(plan.wire_dtypes), relay=relay)
    ranks = range(len(domain)) if ranks is None else ranks
    call = prepare(plan.src_layouts, plan.dst_layouts, domain_topology(domain), options,
                   ranks=ranks)
    buckets = [b for rnd in call.schedule.rounds for b in rnd]
    return Traffic.of([(b.round, b.src, b.dst, b.nbytes) for b in buckets],
                      forward=[b.stage == 1 for b in buckets])


def _rows(tr: Traffic, ranks: set[int] | None) -> list[tuple[int, int, int, int, bool]]:
    rows = zip(tr.round.tolist(), tr.src.tolist(), tr.dst.tolist(), tr.nbytes.tolist(),
               tr.forward.tolist())
    return sorted(r for r in rows if ranks is None or r[1] in ranks or r[2] in ranks)


def relay_replays_executor(plan: Any, domain: Sequence[int], *, bucket_bytes: int,
                           staging_bytes: int, ranks: Iterable[int] | None = None,
                           simulated: PairTraffic | None = None) -> bool:
    """Whether :func:`relay_traffic` lists exactly the messages (round, sender, receiver,
    bytes, forwarded or not) of the executor's schedule, for every message that ``ranks``
    (default: every rank) send or receive. ``simulated``: the relay traffic if already
    computed with the same arguments."""
    if simulated is None:
        simulated = relay_traffic(plan, domain, bucket_bytes=bucket_bytes,
                                  staging_bytes=staging_bytes).traffic
    mine = None if ranks is None else set(ranks)
    want = executor_messages(plan, domain, bucket_bytes=bucket_bytes,
                             staging_bytes=staging_bytes, ranks=mine)
    return _rows(simulated.to_traffic(), mine) == _rows(want, mine)
