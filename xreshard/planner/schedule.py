"""The scheduler: a rank's transfers cut into buckets per peer, in rounds.

Pure: plan in, buckets out. Both peers of a pair derive the same buckets from the plan
(the pair's transfers in canonical order, cut at the same sizes), so no size is negotiated
at run time. Bucket ``i`` of every pair runs in round ``i``: within a round every send has
its receive posted by the peer in the same round, so no order can deadlock, and a rank
with fewer buckets simply stops early.

Messages: an item of at least ``OWN_MESSAGE_BYTES`` travels as a message of its own, so the
executor can send or receive it in place when its view is one contiguous run; smaller
items are packed together. A pair's messages fill rounds up to the pair's bucket size, and
each carries the pair's running message number as its tag.

Memory: a pair's bucket size is ``min(bucket_bytes, staging_bytes // max(peers of src,
peers of dst))``, so the bytes a rank has in flight in one round, over all its peers in
both directions, never exceed ``staging_bytes``.

Quantized pairs: with ``FP8_ROUNDS`` > 1, a pair that sends FP8 items (whole blocks its
sender quantizes at pack time, :mod:`xreshard.planner.quantize`) is cut into at least
that many rounds (of at least ``FP8_MIN_ROUND_BYTES``, never more than the size above), so
a pipelined sender quantizes round k+1 while round k is on the wire and its receiver
unpacks round k-1, instead of quantize + wire + unpack in series. The size is a function
of the pair's transfers, which both peers see alike. Off by default (1): on the 2-core CPU
benchmark 4 rounds measured 1.10-1.18x slower than one, not faster (no idle core for the
overlap, and more rounds cost CPU; ``benchmarks/RESULTS.md``, issue 20 phase 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..dtypes import itemsize
from ..ir.layout import Region
from .plan import Plan, Transfer
from .quantize import quantized_bytes, split_quantized

#: a bucket never shrinks below this, whatever the staging budget and the peer count (so
#: staging_bytes is honoured as long as it allows this much per peer)
MIN_BUCKET_BYTES = 1 << 10

#: items at least this big are messages of their own (maybe zero-copy); smaller ones share
OWN_MESSAGE_BYTES = 1 << 16

#: a pair that sends quantized items spreads its bytes over at least this many rounds
#: (1: as the bucket size allows; see the module docstring for why that is the default)...
FP8_ROUNDS = 1

#: ...of at least this many bytes each (below it, a round's fixed cost outweighs the overlap)
FP8_MIN_ROUND_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Item:
    """One region of one tensor inside a bucket (``nbytes`` wire bytes); ``quantized``:
    whole blocks of a quantized destination, sent as codes plus scales (see
    :mod:`xreshard.planner.quantize`)."""

    name: str
    region: Region
    nbytes: int
    quantized: bool = False


@dataclass(frozen=True, slots=True)
class Bucket:
    """One message: ``items`` packed back to back, from ``src`` to ``dst`` in ``round``;
    ``tag`` numbers the pair's messages; every item is a tensor of stage ``stage`` of the
    prepared call (a bucket never mixes stages, see :mod:`xreshard.planner.prepare`)."""

    src: int
    dst: int
    round: int
    tag: int
    items: tuple[Item, ...]
    nbytes: int
    stage: int = 0


@dataclass(frozen=True, slots=True)
class Copy:
    """A same-rank copy: ``region`` of tensor ``name`` (stage ``stage``), which ``rank``
    holds on both sides, ``nbytes`` wire bytes. Never sent. ``quantized``: as
    :attr:`Item.quantized`."""

    name: str
    region: Region
    rank: int
    nbytes: int
    stage: int = 0
    quantized: bool = False


@dataclass(frozen=True)
class Schedule:
    """The buckets of some local ranks, by round, plus their same-rank copies."""

    rounds: tuple[tuple[Bucket, ...], ...]
    local_copies: tuple[Copy, ...]
    max_round_bytes: int
    """Most bytes any one local rank has in flight in one round."""

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def split_region(region: Region, itemsize: int, max_bytes: int) -> list[Region]:
    """Cut ``region`` into boxes of at most ``max_bytes`` (whole elements), outermost dim first.

    A dim is cut into runs of whole slabs; when one slab of the outermost dim is still too
    big, each slab is cut along the next dim, and so on.
    """
    if region.size * itemsize <= max_bytes:
        return [region]
    shape = region.shape
    d = next(i for i, n in enumerate(shape) if n > 1)
    slab = math.prod(shape[d + 1:]) * itemsize
    out = []
    a, b = region.starts[d], region.stops[d]
    if slab <= max_bytes:
        step = max(1, max_bytes // slab)
        for s in range(a, b, step):
            out.append(Region(region.starts[:d] + (s,) + region.starts[d + 1:],
                              region.stops[:d] + (min(s + step, b),) + region.stops[d + 1:]))
        return out
    for s in range(a, b):
        slab_region = Region(region.starts[:d] + (s,) + region.starts[d + 1:],
                             region.stops[:d] + (s + 1,) + region.stops[d + 1:])
        out.extend(split_region(slab_region, itemsize, max_bytes))
    return out


def pair_bucket_bytes(src: int, dst: int, peer_counts: Mapping[int, int], *,
                      bucket_bytes: int, staging_bytes: int) -> int:
    """Bucket size for the pair (src, dst); both peers compute the same value."""
    peers = max(peer_counts.get(src, 1), peer_counts.get(dst, 1), 1)
    return max(MIN_BUCKET_BYTES, min(bucket_bytes, staging_bytes // peers))


def fp8_pair_bytes(transfers: Sequence[Transfer], size: int, itemsizes: Mapping[str, int],
                   quantized: Mapping[str, Any]) -> int:
    """The bucket size of a pair sending ``transfers``, ``size`` its plain one: cut to a
    ``FP8_ROUNDS``-th of the pair's wire bytes (at least ``FP8_MIN_ROUND_BYTES``) when some
    of them are quantized whole blocks (see the module docstring); else ``size``."""
    total, fp8 = 0, False
    for t in transfers:
        qt = quantized.get(t.name)
        if qt is None:
            total += t.region.size * itemsizes[t.name]
            continue
        fp8_bytes, rest = quantized_bytes(qt, t.region, itemsizes[t.name])
        total += fp8_bytes + rest
        fp8 = fp8 or fp8_bytes > 0
    if not fp8 or FP8_ROUNDS <= 1:
        return size
    return min(size, max(FP8_MIN_ROUND_BYTES, -(-total // FP8_ROUNDS)))


def _pair_buckets(src: int, dst: int, transfers: Sequence[Transfer], order: Mapping[str, int],
                  size: int, itemsizes: Mapping[str, int], quantized: Mapping[str, Any]
                  ) -> list[list[Item]]:
    items: list[Item] = []
    for t in sorted(transfers, key=lambda t: (order[t.name], t.region.starts, t.region.stops)):
        isz = itemsizes[t.name]
        if t.name in quantized:
            items += [Item(t.name, part, n, q) for part, n, q in split_quantized(
                quantized[t.name], t.region, isz, size, split_region)]
            continue
        for part in split_region(t.region, isz, size):
            items.append(Item(t.name, part, part.size * isz))
    messages: list[list[Item]] = []
    fill = size
    for it in items:
        if it.nbytes >= min(OWN_MESSAGE_BYTES, size):
            messages.append([it])
            fill = size                  # the next small item starts a new message
            continue
        if fill + it.nbytes > size:
            messages.append([])
            fill = 0
        messages[-1].append(it)
        fill += it.nbytes
    return messages


def peer_counts(plan: Plan, ranks: Iterable[int]) -> dict[int, int]:
    """Number of distinct (peer, direction) pairs of each of ``ranks``."""
    out = {}
    for rank in ranks:
        out[rank] = len({(t.src, t.dst) for t in plan.transfers_for(rank)})
    return out


def paired_counts(plan: Plan, ranks: Iterable[int]) -> dict[int, int]:
    """:func:`peer_counts` of every rank that shares a transfer with one of ``ranks`` (what
    :func:`schedule` needs to size their pairs' buckets). Every process computes the same
    count for a rank from the same plan."""
    paired = {r for m in ranks for t in plan.transfers_for(m) for r in (t.src, t.dst)}
    return peer_counts(plan, sorted(paired))


def schedule(plan: Plan, local_ranks: Sequence[int], peer_counts: Mapping[int, int], *,
             bucket_bytes: int, staging_bytes: int, stage: int = 0,
             quantized: Mapping[str, Any] | None = None) -> Schedule:
    """Buckets and rounds for this process's ranks.

    Args:
        plan: the plan (the same on every rank).
        local_ranks: the world ranks this process executes.
        peer_counts: for every rank paired with a local rank, its number of distinct
            (peer, direction) pairs (see :func:`peer_counts` and :func:`paired_counts`).
        bucket_bytes: the most bytes in one message.
        staging_bytes: the most bytes a rank has in flight in one round.
        stage: the stage of the prepared call ``plan`` is (stamped on every bucket and
            copy).
        quantized: name -> ``QuantizedTensor`` of the tensors quantized on the way: their
            transfers and copies are cut into quantized whole blocks and the rest
            (:func:`~xreshard.planner.quantize.split_quantized`).
    """
    quantized = quantized or {}
    order = {name: i for i, name in enumerate(plan.names)}
    itemsizes = {name: itemsize(plan.wire_dtypes[name]) for name in plan.names}
    by_pair: dict[tuple[int, int], list[Transfer]] = {}
    local = set(local_ranks)
    for rank in local_ranks:
        for t in plan.transfers_for(rank):
            # a pair with both ends in this process is listed by both ranks: keep it once
            if t.src in local and t.dst in local and t.src != rank:
                continue
            by_pair.setdefault((t.src, t.dst), []).append(t)
    rounds: list[list[Bucket]] = []
    in_flight: dict[tuple[int, int], int] = {}
    for (src, dst), transfers in sorted(by_pair.items()):
        size = pair_bucket_bytes(src, dst, peer_counts, bucket_bytes=bucket_bytes,
                                 staging_bytes=staging_bytes)
        if quantized:
            size = fp8_pair_bytes(transfers, size, itemsizes, quantized)
        rnd, used = 0, 0
        for tag, items in enumerate(_pair_buckets(src, dst, transfers, order, size, itemsizes,
                                                         quantized)):
            nbytes = sum(it.nbytes for it in items)
            if used and used + nbytes > size:
                rnd, used = rnd + 1, 0
            used += nbytes
            while len(rounds) <= rnd:
                rounds.append([])
            rounds[rnd].append(Bucket(src, dst, rnd, tag, tuple(items), nbytes, stage))
            for r in (src, dst):
                if r in local:
                    in_flight[(rnd, r)] = in_flight.get((rnd, r), 0) + nbytes
    copies = tuple(_copies(plan, local_ranks, stage, quantized, itemsizes))
    return Schedule(tuple(tuple(r) for r in rounds), copies, max(in_flight.values(), default=0))


def _copies(plan: Plan, local_ranks: Sequence[int], stage: int, quantized: Mapping[str, Any],
            itemsizes: Mapping[str, int]) -> Iterator[Copy]:
    """The same-rank copies of ``local_ranks``; a quantized tensor's cut like its transfers
    (one piece per part: a copy is never bucketed)."""
    for r in local_ranks:
        for t in plan.local_copies_for(r):
            qt = quantized.get(t.name)
            if qt is None:
                yield Copy(t.name, t.region, r, t.nbytes, stage)
                continue
            for part, n, q in split_quantized(qt, t.region, itemsizes[t.name], 1 << 62,
                                              split_region):
                yield Copy(t.name, part, r, n, stage, q)
