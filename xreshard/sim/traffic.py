"""Messages of a schedule as arrays, and the direct schedule of a whole world, fast.

``xreshard.planner.schedule.schedule`` builds one ``Bucket`` object (with its ``Item`` and
``Region`` objects) per message: right for the ranks of one process, far too slow for all
256 ranks of a DeepSeek-V3 refit (11.8 million messages). :func:`direct_traffic` derives
the same messages - the same rounds, pairs and byte counts - from the plan's transfers
with the same rules and constants, without building those objects: a region's parts come
from its shape alone (``split_sizes`` mirrors ``split_region``), and a pair's message
sequence is computed once per distinct sequence of transfer shapes. The equality with
``schedule()`` is pinned by tests on several plans.

The transfers themselves are read as arrays (``Plan.receive_table``, one destination rank at
a time) and only each pair's sequence of (shape, itemsize) is kept; the result is a
:class:`PairTraffic` (a message pattern per pair) whose rounds are generated one at a time,
because a 2,048-rank refit sends ~5.6 x 10^8 messages: too many to hold as rows.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..planner.plan import ReceiveTable
from ..planner.schedule import MIN_BUCKET_BYTES, OWN_MESSAGE_BYTES
from .wire import Wire, wire_parts

__all__ = ["Traffic", "split_sizes", "cut_messages", "fill_rounds",
           "PairSequences", "pair_sequences", "rank_receives", "RankReceives",
           "ShapeIds", "WireKeys", "PartTable", "Pattern", "pair_pattern",
           "PairTraffic", "direct_traffic", "Progress"]


@dataclass(frozen=True)
class Traffic:
    """Messages as parallel arrays: message ``i`` goes from ``src[i]`` to ``dst[i]`` in
    round ``round[i]``, ``nbytes[i]`` bytes; ``forward[i]`` marks a relay forwarding bytes
    it received in this refit."""

    round: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    forward: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.round)
        assert all(len(a) == n for a in (self.src, self.dst, self.nbytes, self.forward))

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int, int, int]] | None = None, *,
           forward: Sequence[bool] | None = None) -> Traffic:
        """From ``(round, src, dst, nbytes)`` rows."""
        arr = np.array(list(rows or ()), dtype=np.int64).reshape(-1, 4)
        fwd = np.zeros(len(arr), bool) if forward is None else np.asarray(forward, bool)
        return cls(arr[:, 0].astype(np.int32), arr[:, 1].astype(np.int32),
                   arr[:, 2].astype(np.int32), arr[:, 3], fwd)

    @classmethod
    def concat(cls, parts: Sequence[Traffic]) -> Traffic:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0)
                     for f in ("round", "src", "dst", "nbytes", "forward")))

    def __len__(self) -> int:
        return len(self.round)

    @property
    def num_rounds(self) -> int:
        return int(self.round.max()) + 1 if len(self.round) else 0

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def rounds(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per round, in order: ``(index, src, dst, nbytes)`` of its messages (``index``
        into this traffic's arrays; messages in traffic order)."""
        order = np.argsort(self.round, kind="stable")
        bounds = self.round[order].searchsorted(np.arange(self.num_rounds + 1))
        for k in range(self.num_rounds):
            sel = order[bounds[k]:bounds[k + 1]]
            yield sel, self.src[sel], self.dst[sel], self.nbytes[sel]

    def pair_totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, bytes)`` of every pair that moves bytes."""
        n = max(int(self.src.max(initial=0)), int(self.dst.max(initial=0))) + 1
        pair_bytes = np.bincount(self.src.astype(np.int64) * n + self.dst,
                                 weights=self.nbytes.astype(float), minlength=n * n)
        pairs = np.flatnonzero(pair_bytes)
        return pairs // n, pairs % n, pair_bytes[pairs]


@dataclass(frozen=True)
class PairTraffic:
    """The direct schedule without one row per message: pair ``i`` (``src[i]`` ->
    ``dst[i]``) sends the messages of pattern ``pattern[i]`` (``rounds[p]``, ``sizes[p]``:
    one pair's message sequence; pairs with equal sizes and transfer shapes share one).
    Rounds are generated one at a time, in the order :class:`Traffic` would hold them, so
    a 2,048-rank refit (5 x 10^8 messages) replays in bounded memory.
    """

    src: np.ndarray
    dst: np.ndarray
    pattern: np.ndarray
    rounds_of: list[np.ndarray]
    sizes_of: list[np.ndarray]
    forward: np.ndarray | None = None
    """Per pair: its messages forward bytes a relay received in this refit (None: none do)."""

    def __len__(self) -> int:
        counts = np.array([len(r) for r in self.rounds_of], np.int64)
        return int(counts[self.pattern].sum()) if len(self.pattern) else 0

    @property
    def num_rounds(self) -> int:
        return max((int(r[-1]) + 1 for r in self.rounds_of if len(r)), default=0)

    @property
    def total_bytes(self) -> int:
        return int(self._pattern_bytes()[self.pattern].sum()) if len(self.pattern) else 0

    def _pattern_bytes(self) -> np.ndarray:
        return np.array([int(s.sum()) for s in self.sizes_of], np.int64)

    def pair_totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = self._pattern_bytes()[self.pattern].astype(float)
        keep = b > 0
        return (self.src[keep].astype(np.int64), self.dst[keep].astype(np.int64), b[keep])

    @cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(flat, base, off)``: every pattern's sizes end to end, where each pattern
        starts in them, and per pattern where each round's messages start in its arrays."""
        num_rounds = self.num_rounds
        flat = np.concatenate(self.sizes_of) if self.sizes_of else np.zeros(0, np.int64)
        base = np.cumsum([0] + [len(s) for s in self.sizes_of])[:-1].astype(np.int64)
        off = np.stack([np.searchsorted(r, np.arange(num_rounds + 1)) for r in self.rounds_of]
                       ) if self.rounds_of else np.zeros((0, num_rounds + 1), np.int64)
        return flat, base, off

    def round(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(pair, src, dst, nbytes)`` of round ``k``'s messages, in the order
        :class:`Traffic` would hold them (``pair``: each message's pair; there are no
        message rows)."""
        flat, base, off = self._layout
        lo, cnt_p = off[:, k], off[:, k + 1] - off[:, k]
        cnt = cnt_p[self.pattern]
        idx = np.flatnonzero(cnt)
        c = cnt[idx]
        pat = self.pattern[idx]
        if len(c) == 0 or int(c.max()) == 1:    # one message per pair (the usual case)
            return idx, self.src[idx], self.dst[idx], flat[base[pat] + lo[pat]]
        total = int(c.sum())
        first: np.ndarray = np.repeat(base[pat] + lo[pat] - (np.cumsum(c) - c), c)
        pair: np.ndarray = np.repeat(idx, c)
        return pair, self.src[pair], self.dst[pair], flat[first + np.arange(total)]

    def rounds(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """As :meth:`Traffic.rounds`, but the index is each message's pair."""
        for k in range(self.num_rounds):
            yield self.round(k)

    def round_keys(self) -> Iterator[bytes]:
        """Per round, a digest of what each pattern in use sends in it: two rounds have
        equal keys exactly when they send the same messages (a pair's messages in a round
        are its pattern's), found without generating them."""
        flat, base, off = self._layout
        used = np.unique(self.pattern)
        base, off = base[used], off[used]
        for k in range(self.num_rounds):
            lo, cnt = off[:, k], off[:, k + 1] - off[:, k]
            total = int(cnt.sum())
            first: np.ndarray = np.repeat(base + lo - (np.cumsum(cnt) - cnt), cnt)
            sizes = flat[first + np.arange(total)]
            yield hashlib.blake2b(cnt.tobytes() + sizes.tobytes(), digest_size=16).digest()

    def to_traffic(self) -> Traffic:
        """Every message as a row (pair order, as ``direct_traffic`` used to return)."""
        if not len(self.pattern):
            return Traffic.of()
        counts = np.array([len(r) for r in self.rounds_of], np.int64)[self.pattern]
        fwd: np.ndarray = (np.zeros(int(counts.sum()), bool) if self.forward is None
                           else np.repeat(self.forward, counts))
        return Traffic(np.concatenate([self.rounds_of[p] for p in self.pattern.tolist()]),
                       np.repeat(self.src, counts), np.repeat(self.dst, counts),
                       np.concatenate([self.sizes_of[p] for p in self.pattern.tolist()]), fwd)


class Progress:
    """``label: i/n`` (or ``label: what (i/n)``) on stderr, only when stderr is a terminal
    (``enabled=None``), at most 5 times a second, the last one on its own line."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._width = 0

    def __call__(self, i: int, n: int, what: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last >= 0.2 or i == n or what:
            self._last = now
            text = f"{self.label}: {what} ({i}/{n})" if what else f"{self.label}: {i}/{n}"
            pad = " " * max(0, self._width - len(text))     # cover a longer line before
            self._width = len(text)
            print(f"\r{text}{pad}", end="\n" if i == n else "", file=sys.stderr, flush=True)


@lru_cache(maxsize=65536)
def split_sizes(shape: tuple[int, ...], isz: int, max_bytes: int) -> tuple[int, ...]:
    """Byte sizes of the parts ``schedule.split_region`` cuts a region of ``shape`` into."""
    total = math.prod(shape) * isz
    if total <= max_bytes:
        return (total,)
    d = next(i for i, n in enumerate(shape) if n > 1)
    slab = math.prod(shape[d + 1:]) * isz
    n = shape[d]
    if slab <= max_bytes:
        step = max(1, max_bytes // slab)
        full, rem = divmod(n, step)
        return (step * slab,) * full + ((rem * slab,) if rem else ())
    return split_sizes((1,) * (d + 1) + tuple(shape[d + 1:]), isz, max_bytes) * n


def cut_messages(part_bytes: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The scheduler's packing (``schedule._pair_buckets``), in numpy: ``(message of each
    part, message bytes)`` for one pair's parts in canonical order. A part of at least
    ``min(OWN_MESSAGE_BYTES, size)`` is a message of its own; runs of smaller parts share
    messages up to ``size``."""
    part_bytes = np.asarray(part_bytes, np.int64)
    n = len(part_bytes)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    own = part_bytes >= min(OWN_MESSAGE_BYTES, size)
    opens: np.ndarray = np.ones(n, bool)
    small = np.flatnonzero(~own)
    if len(small):
        # a small part joins the message of the part before it when that one was small
        # and the message still has room (the only sequential rule: loop over small parts)
        fill = size
        prev = -2
        sizes = part_bytes[small].tolist()
        for i, nb in zip(small.tolist(), sizes):
            if i == prev + 1 and fill + nb <= size:
                opens[i] = False
                fill += nb
            else:
                fill = nb
            prev = i
    msg = np.cumsum(opens) - 1
    return msg, np.bincount(msg, weights=part_bytes).astype(np.int64)


def fill_rounds(msg_bytes: np.ndarray, size: int,
                ready: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rounds of one pair's messages, filled up to ``size`` bytes each (the scheduler's
    rule: a message opens a new round when the current one has bytes and would overflow).

    With ``ready`` (the first round each message may run in: a forward waits for the
    rounds that land its bytes), messages run in order of readiness (stable) and a message
    not yet ready opens the round it becomes ready in (``relay.overlapped_schedule``).

    Returns:
        ``(order, rounds)``: the messages' order (``arange`` without ``ready``) and the
        round of each, in that order (non-decreasing).
    """
    n = len(msg_bytes)
    order = (np.arange(n) if ready is None else np.argsort(ready, kind="stable"))
    cum = np.concatenate([[0], np.cumsum(np.asarray(msg_bytes, np.int64)[order])])
    # nxt[i]: where a round that starts at message i ends, by bytes alone (>= i + 1)
    nxt_arr = np.maximum(cum.searchsorted(cum[:-1] + size, side="right") - 1,
                         np.arange(1, n + 1))
    starts: list[int] = []
    values: list[int] = []
    i, rnd = 0, -1
    if ready is not None and n:
        rd_arr = np.asarray(ready, np.int64)[order]
        top = int(rd_arr[-1])
        # upto[v]: messages ready by round v
        upto = rd_arr.searchsorted(np.arange(top + 1), side="right").tolist()
        rd, nxt = rd_arr.tolist(), nxt_arr.tolist()
        # while some message is not yet ready, one step per round (over lists: a numpy
        # call per step would cost more than the step)
        while i < n:
            rnd = max(rnd + 1, rd[i])
            if rnd >= top:
                rnd -= 1
                break
            starts.append(i)
            values.append(rnd)
            end = min(nxt[i], upto[rnd])
            i = end if end > i else i + 1
    # every message ready: the rest is a plain fill, one round per step of nxt
    rest = _chain(nxt_arr, i, n)
    counts = np.diff(np.concatenate([np.asarray(starts, np.int64), rest, [n]]))
    first = np.concatenate([np.asarray(values, np.int64), rnd + 1 + np.arange(len(rest))])
    return order, np.repeat(first, counts)


def _chain(nxt: np.ndarray, i: int, n: int) -> np.ndarray:
    """``i, nxt[i], nxt[nxt[i]], ...`` while below ``n`` (``nxt[j] > j``), by pointer
    doubling: log2(n) array passes instead of one Python step per element."""
    if i >= n:
        return np.zeros(0, np.int64)
    jumps = [np.append(np.minimum(nxt, n), n)]
    while (1 << len(jumps)) <= n - i:
        jumps.append(jumps[-1][jumps[-1]])
    steps, p = 0, i
    for k in range(len(jumps) - 1, -1, -1):
        if jumps[k][p] < n:
            p = int(jumps[k][p])
            steps += 1 << k
    k_of = np.arange(steps + 1)
    pos: np.ndarray = np.full(steps + 1, i, np.int64)
    for k, jump in enumerate(jumps):
        sel = (k_of >> k) & 1 == 1
        pos[sel] = jump[pos[sel]]
    return pos


def _peer_counts(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for s, d in pairs:
        counts[s] = counts.get(s, 0) + 1
        counts[d] = counts.get(d, 0) + 1
    return counts


@dataclass(frozen=True)
class PairSequences:
    """Every (src, dst) pair of a plan with the sequence of its transfers' (shape, itemsize)
    in the scheduler's canonical order - all the direct schedule needs of a pair - and
    nothing else: identical sequences are stored once.

    ``pairs[i] = (src, dst)`` uses sequence ``seq_of[i]``; ``seqs[k]`` is an int32 array of
    indices into ``shapes`` (``(region shape, wire itemsize)``).
    """

    pairs: list[tuple[int, int]]
    seq_of: list[int]
    seqs: list[np.ndarray]
    shapes: list[tuple[tuple[int, ...], int]]


@dataclass(frozen=True)
class RankReceives:
    """One destination rank's receives in the scheduler's canonical order: by source rank,
    then tensor (plan order), then region bounds. ``shape[i]`` indexes the
    ``(region shape, wire itemsize)`` list the caller keeps; ``starts`` / ``stops`` bound
    each source's rows; ``table`` and ``region`` locate each row's ``Region``."""

    src: np.ndarray
    tensor: np.ndarray
    region: np.ndarray
    shape: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    table: ReceiveTable


class ShapeIds:
    """``(region shape, wire)`` -> a small id, shared over every rank's rows (``wire``: an
    itemsize, or what ``sim/wire.py`` says a transfer costs)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[tuple[int, ...], Any], int] = {}
        self.shapes: list[tuple[tuple[int, ...], Any]] = []

    def __call__(self, key: tuple[tuple[int, ...], Any]) -> int:
        got = self.ids.get(key)
        if got is None:
            got = self.ids[key] = len(self.shapes)
            self.shapes.append(key)
        return got


class WireKeys:
    """What each of a plan's tensors costs on the wire, as ``ShapeIds`` keys per region:
    ``cls[t]`` is tensor ``t``'s class (``Wire.classes``); ``key(c, region)`` the key."""

    def __init__(self, plan, wire: Wire | None = None, dtypes: Any = None):
        self.wire = wire if wire is not None else Wire()
        self.cls, self.specs = self.wire.classes(
            plan.names, plan.wire_dtypes if dtypes is None else dtypes, plan.dst_layouts)

    def key(self, c: int, region: Any) -> tuple[tuple[int, ...], Any]:
        return self.wire.key(self.specs[c], region)


def rank_receives(plan, rank: int, keys: WireKeys, shape_ids: ShapeIds) -> RankReceives:
    """``rank``'s receives from other ranks (``Plan.receive_table``) in canonical order,
    each with its ``shape_ids`` id (region shape and wire cost, from ``keys``)."""
    tb = plan.receive_table(rank)
    keep = tb.src != rank
    src, tensor, region = tb.src[keep], tb.tensor[keep], tb.region[keep]
    if not len(src):
        e: np.ndarray = np.zeros(0, np.int64)
        return RankReceives(e, e, e, e, e, e, tb)
    regs = tb.regions
    # canonical order within a pair: tensor (plan order), then region starts, stops
    by_bounds = sorted(range(len(regs)), key=lambda k: (regs[k].starts, regs[k].stops))
    reg_rank: np.ndarray = np.empty(len(regs), np.int64)
    reg_rank[by_bounds] = np.arange(len(regs))
    width = len(keys.specs)
    combo = region.astype(np.int64) * width + keys.cls[tensor]
    uniq, inverse = np.unique(combo, return_inverse=True)
    ids = np.fromiter((shape_ids(keys.key(c % width, regs[c // width]))
                       for c in uniq.tolist()), np.int32, len(uniq))
    order = np.lexsort((reg_rank[region], tensor, src))
    s_sorted = src[order]
    cuts = np.flatnonzero(np.diff(s_sorted)) + 1
    return RankReceives(s_sorted, tensor[order], region[order],
                        ids[inverse.reshape(-1)[order]],
                        np.concatenate([[0], cuts]), np.concatenate([cuts, [len(s_sorted)]]),
                        tb)


def pair_sequences(plan, progress: Callable[[int, int], None] | None = None, *,
                   wire: Wire | None = None) -> PairSequences:
    """:class:`PairSequences` of ``plan``, one destination rank at a time from
    ``Plan.receive_table`` (no ``Transfer`` objects; memory is the distinct sequences);
    transfers cost what ``wire`` says (default: the plan's dtypes)."""
    dst_ranks = sorted({r for lay in {id(v): v for v in plan.dst_layouts.values()}.values()
                        for r in lay.ranks})
    keys = WireKeys(plan, wire)
    shape_ids = ShapeIds()
    seq_id: dict[bytes, int] = {}
    seqs: list[np.ndarray] = []
    pairs: list[tuple[int, int]] = []
    seq_of: list[int] = []
    for i, rank in enumerate(dst_ranks):
        got = rank_receives(plan, rank, keys, shape_ids)
        for a, b in zip(got.starts.tolist(), got.stops.tolist()):
            seq = got.shape[a:b]
            key_b = seq.tobytes()
            k = seq_id.get(key_b)
            if k is None:
                k = seq_id[key_b] = len(seqs)
                seqs.append(seq.copy())
            pairs.append((int(got.src[a]), rank))
            seq_of.append(k)
        if progress is not None:
            progress(i + 1, len(dst_ranks))
    return PairSequences(pairs, seq_of, seqs, shape_ids.shapes)


class PartTable:
    """The parts ``split_region`` cuts regions into, per (shape id, bucket size), as
    arrays for many rows at once: bytes and elements of each (``wire.wire_parts``)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], Any]]):
        self.shapes = shapes
        self.memo: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def expand(self, shape: np.ndarray, size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(bytes, elements, row)`` of the parts of rows whose shape ids are ``shape``."""
        got = self.memo.get(size)
        if got is None or got[0] < len(self.shapes):
            parts = [wire_parts(sh, w, size) for sh, w in self.shapes]
            count = np.array([len(p[0]) for p in parts], np.int64)
            first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
            got = self.memo[size] = (len(self.shapes), count, first,
                                     np.array([x for p in parts for x in p[0]], np.int64),
                                     np.array([x for p in parts for x in p[1]], np.int64))
        _, count, first, nbytes, elems = got
        c = count[shape]
        if len(c) == 0 or int(c.max()) == 1:
            at = first[shape]
            return nbytes[at], elems[at], np.arange(len(shape))
        row: np.ndarray = np.repeat(np.arange(len(shape)), c)
        at = np.repeat(first[shape] - (np.cumsum(c) - c), c) + np.arange(int(c.sum()))
        return nbytes[at], elems[at], row


@dataclass(frozen=True)
class Pattern:
    """One pair's messages (round and wire bytes of each, in round order) and, per item
    (a transfer, in canonical order), the rounds its parts land in."""

    rounds: np.ndarray
    sizes: np.ndarray
    size: int                   # the pair's bucket size
    part_round: np.ndarray
    item_parts: np.ndarray      # where each item's parts start in part_round, then the end


def pair_pattern(shape_seq: np.ndarray, size: int, parts: PartTable, wire: Wire) -> Pattern:
    """The scheduler's messages of one pair whose items have shape ids ``shape_seq``:
    parts cut at ``size``, packed (``cut_messages``), rounds filled (``fill_rounds``),
    each message's bytes as ``wire`` encodes them."""
    part_bytes, part_elems, row = parts.expand(shape_seq, size)
    msg, msg_bytes = cut_messages(part_bytes, size)
    _, rounds = fill_rounds(msg_bytes, size)
    if wire.delta is not None:
        msg_bytes = wire.encode(msg_bytes, np.bincount(msg, weights=part_elems,
                                                       minlength=len(msg_bytes)))
    # asarray: a no-op that mypy needs (numpy's stubs type searchsorted(v=array) a scalar)
    starts = np.asarray(row.searchsorted(np.arange(len(shape_seq) + 1)))
    return Pattern(rounds, msg_bytes, size, rounds[msg], starts)


def direct_traffic(plan, sequences: PairSequences | None = None, *, bucket_bytes: int,
                   staging_bytes: int, progress: Callable[[int, int], None] | None = None,
                   wire: Wire | None = None) -> PairTraffic:
    """The messages ``schedule.schedule(plan, all ranks, ...)`` would send, by pair.

    Args:
        plan: the plan.
        sequences: its pairs' transfer sequences (:func:`pair_sequences`; computed when
            None).
        bucket_bytes / staging_bytes: as ``RefitConfig``.
        wire: what a transfer costs on the wire (``sim/wire.py``; default: the plan's
            dtypes); ``sequences`` must have been listed with the same.
    """
    wire = wire if wire is not None else Wire()
    if sequences is None:
        sequences = pair_sequences(plan, wire=wire)
    parts = PartTable(sequences.shapes)
    peers = _peer_counts(sequences.pairs)
    memo: dict[tuple[int, int], int] = {}
    rounds_of: list[np.ndarray] = []
    sizes_of: list[np.ndarray] = []
    order = sorted(range(len(sequences.pairs)), key=sequences.pairs.__getitem__)
    pattern: np.ndarray = np.empty(len(order), np.int32)
    for i, p in enumerate(order):
        src, dst = sequences.pairs[p]
        size = max(MIN_BUCKET_BYTES, min(bucket_bytes, staging_bytes
                                         // max(peers.get(src, 1), peers.get(dst, 1), 1)))
        key = (size, sequences.seq_of[p])
        got = memo.get(key)
        if got is None:
            pat = pair_pattern(sequences.seqs[key[1]], size, parts, wire)
            got = memo[key] = len(rounds_of)
            rounds_of.append(pat.rounds.astype(np.int32))
            sizes_of.append(pat.sizes)
        pattern[i] = got
        if progress is not None and (i % 4096 == 4095 or i + 1 == len(order)):
            progress(i + 1, len(order))
    pairs = np.array([sequences.pairs[p] for p in order], np.int32).reshape(-1, 2)
    return PairTraffic(pairs[:, 0].copy(), pairs[:, 1].copy(), pattern, rounds_of, sizes_of)
