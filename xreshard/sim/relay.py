"""A relay schedule built from a plan: each byte crosses the network once per domain.

Destination ranks of one NVLink domain that need the same region form its *relay set*.
Instead of every one of them pulling the region over its own NIC (the direct schedule:
one network copy per destination replica), one of them - the *relay* - receives it over
the network and forwards it over NVLink to the rest, chunked so forwarding overlaps
arrival::

    round k    sender s ──network──▶ relay r            (chunk k of the stream s -> r)
    round k+1  relay r  ──NVLink──▶ every other rank of the set that needs chunk k

Choices (greedy, deterministic, in plan order):

* the relay is the least loaded receiver of the set (bytes received over the network so
  far), which balances the domain's NICs, and the sender the least loaded (bytes sent so
  far) of the ranks the plan already picked for that region's receivers in the domain
  (all of them hold it);
* except that a receiver within ``STICKY_BYTES`` of the least loaded that already pairs
  with one of those senders takes the region from it: a relay talks to few senders, so
  its chunks stay large under the staging budget;
* pairs inside one domain (colocated layouts) keep their direct transfers, over NVLink.

Chunks: every (sender, relay) pair moves its bytes in the same number of rounds (its
chunk is its share of the round), the fewest that keep a relay's staged bytes - its
network chunks and about as many forwarded to it - within ``staging_bytes`` (its own
forwards leave from its destination binding).

This is a pure function of the plan, the domain of every rank and the two byte budgets,
so every rank can derive the same relay schedule, as with the direct one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..dtypes import itemsize
from ..planner.schedule import MIN_BUCKET_BYTES
from .traffic import Traffic, pair_messages, split_sizes

__all__ = ["RelayStream", "RelaySchedule", "build_relay", "relay_traffic", "STICKY_BYTES"]

#: a relay keeps its current senders while within this many bytes of the least loaded
STICKY_BYTES = 512 << 20

#: a (sender, relay) pair carries at most 1/PAIR_SHARE of a relay's expected bytes
PAIR_SHARE = 4


@dataclass(frozen=True, slots=True)
class RelayStream:
    """Regions going ``src`` -> ``relay`` over the network, then forwarded by the relay
    to every rank of ``forward_to`` (same domain). ``items`` are (name, region, bytes)
    in send order; ``chunk_bytes`` the largest message."""

    src: int
    relay: int
    forward_to: tuple[int, ...]
    items: tuple[tuple[str, object, int], ...]
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(nb for _, _, nb in self.items)


@dataclass(frozen=True)
class RelaySchedule:
    """Relay streams by (src, relay) pair, plus the pairs left direct (same domain)."""

    streams: tuple[RelayStream, ...]
    direct: tuple[tuple[int, int, int, tuple], ...]
    """(src, dst, chunk_bytes, transfers) of pairs inside one domain."""

    @property
    def network_bytes(self) -> int:
        return sum(s.nbytes for s in self.streams)

    @property
    def forwarded_bytes(self) -> int:
        return sum(s.nbytes * len(s.forward_to) for s in self.streams)

    def traffic(self, names: Sequence[str], wire_dtypes: dict[str, str]) -> Traffic:
        """Every message, round by round: a stream's message ``i`` in the pair's round
        ``k``; its forwards, coalesced per (relay, target), in round ``k + 1``.

        Rows: the network flows by (pair, round), then the forwards in the order they
        first appear (stream, round, target), then the pairs inside one domain.
        """
        isz = {n: itemsize(wire_dtypes[n]) for n in names}
        by_pair: dict[tuple[int, int], list[RelayStream]] = {}
        for st in self.streams:
            by_pair.setdefault((st.src, st.relay), []).append(st)
        memo: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        shapes: dict[int, tuple[int, ...]] = {}
        pairs = list(by_pair)
        net_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        fwd_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for p, streams in enumerate(by_pair.values()):
            rnd = used = 0
            for st in streams:
                starts, nbytes = _stream_messages(st, isz, memo, shapes)
                # a stream opens a new round of its pair unless its first message still
                # fits the pair's current one; each later round of the stream is a new one
                if used and used + int(nbytes[0]) > st.chunk_bytes:
                    rnd, used = rnd + 1, 0
                seg_bytes = np.add.reduceat(nbytes, starts)
                seg_round = rnd + np.arange(len(starts))
                used = (used if len(starts) == 1 else 0) + int(seg_bytes[-1])
                rnd += len(starts) - 1
                net_parts.append((np.full(len(starts), p), seg_round, seg_bytes))
                fwd = np.asarray(st.forward_to, np.int64)
                fwd_parts.append((np.repeat(seg_round + 1, len(fwd)),
                                  np.full(len(fwd) * len(starts), st.relay),
                                  np.tile(fwd, len(starts)), np.repeat(seg_bytes, len(fwd))))
        rows = [_coalesce_network(net_parts, pairs), _coalesce_forwards(fwd_parts)]
        direct: list[tuple[int, int, int, int]] = []
        for src, dst, size, transfers in self.direct:
            parts = (nb for t in transfers
                     for nb in split_sizes(t.region.shape, isz[t.name], size))
            direct.extend((r, src, dst, nb) for r, nb in pair_messages(parts, size))
        rows.append(np.array(direct, np.int64).reshape(-1, 4))
        is_fwd = np.repeat([False, True, False], [len(r) for r in rows])
        arr = np.concatenate(rows)
        return Traffic(arr[:, 0].astype(np.int32), arr[:, 1].astype(np.int32),
                       arr[:, 2].astype(np.int32), arr[:, 3].copy(), is_fwd)


def _stream_messages(st: RelayStream, isz: dict[str, int], memo: dict,
                     shapes: dict[int, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, nbytes)``: a stream's message sizes in send order (parts of at most a
    quarter chunk fill each round to >= 3/4 of its chunk), and where each of its rounds
    starts among them."""
    size = st.chunk_bytes
    part = max(MIN_BUCKET_BYTES, size // 4)
    key = (size,) + tuple((shapes.get(id(reg)) or shapes.setdefault(id(reg), reg.shape),
                           isz[n]) for n, reg, _ in st.items)
    got = memo.get(key)
    if got is None:
        parts = (nb for shape, b in key[1:] for nb in split_sizes(shape, b, part))
        msgs = np.array(pair_messages(parts, size), np.int64).reshape(-1, 2)
        new = np.flatnonzero(np.diff(msgs[:, 0], prepend=-1) != 0)
        # a round that held only empty messages would not open a new one: never cut so
        assert (np.add.reduceat(msgs[:, 1], new) > 0).all()
        got = memo[key] = (new, msgs[:, 1].copy())
    return got


def _coalesce_network(parts: list, pairs: list[tuple[int, int]]) -> np.ndarray:
    """``(round, src, relay, bytes)`` rows, one per (pair, round) in pair order: one
    peer's messages in one round run in order, so they are one flow."""
    if not parts:
        return np.zeros((0, 4), np.int64)
    pair, rnd, nb = (np.concatenate([x[i] for x in parts]) for i in range(3))
    width = int(rnd.max()) + 1
    keys, inverse = np.unique(pair * width + rnd, return_inverse=True)
    total = np.bincount(inverse.reshape(-1), weights=nb).astype(np.int64)
    ends = np.array(pairs, np.int64).reshape(-1, 2)[keys // width]
    return np.column_stack([keys % width, ends, total])


def _coalesce_forwards(parts: list) -> np.ndarray:
    """``(round, relay, target, bytes)`` rows summed per key, in first-appearance order."""
    if not parts:
        return np.zeros((0, 4), np.int64)
    rnd, relay, target, nb = (np.concatenate([x[i] for x in parts]) for i in range(4))
    n = int(max(relay.max(), target.max())) + 1
    keys, first, inverse = np.unique((rnd * n + relay) * n + target, return_index=True,
                                     return_inverse=True)
    total = np.bincount(inverse.reshape(-1), weights=nb)
    order = np.argsort(first, kind="stable")
    keys = keys[order]
    return np.column_stack([keys // (n * n), keys // n % n, keys % n,
                            total[order].astype(np.int64)])


def build_relay(plan, by_pair: dict[tuple[int, int], list] | None, domain: Sequence[int], *,
                bucket_bytes: int, staging_bytes: int,
                nic: Sequence[tuple[int, int]] | None = None) -> RelaySchedule:
    """The relay schedule of ``plan`` when rank ``r`` lives in NVLink domain ``domain[r]``.

    Args:
        plan: the plan (its transfers say which bytes each rank needs, and from whom).
        by_pair: its transfers by (src, dst) pair (``traffic.receive_lists``), or None to
            read them from ``plan.receive_table`` as arrays (same schedule, no object per
            transfer: what makes 256-rank models fast).
        domain: NVLink domain of every world rank.
        bucket_bytes / staging_bytes: as ``RefitConfig``.
        nic: per rank, (node, NIC rail); when given, a sender is chosen by the load of the
            NIC its bytes leave through (PXN: the sender's node, the relay's rail), so no
            sender-side NIC is left with more than its share.
    """
    order = {name: i for i, name in enumerate(plan.names)}
    # 1. per (domain, region): the receivers there, and the senders the plan chose.
    # Replicas of a region share its Region object, so identity is a cheap key (a region
    # the plan split at a quota boundary becomes pieces of its own: correct, rarely bigger)
    if by_pair is None:
        ordered, direct = _pieces_from_tables(plan, domain)
    else:
        ordered, direct = _pieces_from_transfers(by_pair, domain, order)
    streams = _choose(ordered, domain, nic)
    return RelaySchedule(_chunked(streams, bucket_bytes, staging_bytes),
                         _direct_pairs(direct, order, bucket_bytes, staging_bytes))


def _choose(ordered: list, domain: Sequence[int], nic: Sequence[tuple[int, int]] | None
            ) -> dict[tuple[int, int, tuple[int, ...]], list]:
    """Step 2: relay and sender of every piece, greedily in plan order: the least loaded
    receiver, unless one within STICKY_BYTES of it already pairs with a candidate sender.
    Returns the streams' items by (src, relay, forward_to)."""
    n = len(domain)
    # a pair stays sticky up to a quarter of its relay's expected load, so a relay has
    # at least ~4 senders at once: one NCCL network peer is capped below a NIC's rate
    dom_bytes: dict[int, int] = {}
    dom_ranks: dict[int, set[int]] = {}
    seen: set[int] = set()
    for v in ordered:
        dm = domain[v[4][0]]
        dom_bytes[dm] = dom_bytes.get(dm, 0) + v[2]
        if id(v[4]) not in seen:        # pieces share their receiver lists
            seen.add(id(v[4]))
            dom_ranks.setdefault(dm, set()).update(v[4])
    cap_of = [dom_bytes[dm] // (PAIR_SHARE * len(dom_ranks[dm])) if dm in dom_bytes else 0
              for dm in domain]
    # the counter a sender's bytes load: its own, or with ``nic`` the NIC they leave by
    # (the sender's node, the relay's rail): out_base[sender] + out_rail[relay]
    if nic is None:
        out_base, out_rail = list(range(n)), [0] * n
    else:
        rails = max(r for _, r in nic) + 1
        node_ids = {nd: i for i, nd in enumerate(sorted({nd for nd, _ in nic}))}
        out_base = [node_ids[nd] * rails for nd, _ in nic]
        out_rail = [r for _, r in nic]
    sent = [0] * (max(out_base) + max(out_rail) + 1)
    got = [0] * n
    pair_load: dict[int, int] = {}
    partners: list[set[int]] = [set() for _ in range(n)]
    fwd_of: dict[tuple[int, int], tuple[int, ...]] = {}
    streams: dict[tuple[int, int, tuple[int, ...]], list] = {}
    for name, region, nb, senders, receivers in ordered:
        by_load = sorted([(got[r], r) for r in receivers])
        limit = by_load[0][0] + STICKY_BYTES
        relay = -1
        for load, r in by_load:
            if load > limit:
                break
            common = partners[r] & senders
            if common:
                cap = cap_of[r]
                fits = [x for x in common if pair_load.get(x * n + r, 0) + nb <= cap]
                if fits:
                    relay, rail = r, out_rail[r]
                    src = min(fits, key=lambda x: (sent[out_base[x] + rail], x))
                    break
        if relay < 0:
            relay, rail = by_load[0][1], out_rail[by_load[0][1]]
            src = min(senders, key=lambda x: (sent[out_base[x] + rail], x))
        partners[relay].add(src)
        pair_load[src * n + relay] = pair_load.get(src * n + relay, 0) + nb
        sent[out_base[src] + out_rail[relay]] += nb
        got[relay] += nb
        fwd = fwd_of.get((id(receivers), relay))
        if fwd is None:
            fwd = fwd_of[(id(receivers), relay)] = tuple(r for r in receivers if r != relay)
        streams.setdefault((src, relay, fwd), []).append((name, region, nb))
    return streams


def _pieces_from_transfers(by_pair: dict[tuple[int, int], list], domain: Sequence[int],
                           order: dict[str, int]) -> tuple[list, list]:
    """Step 1 from ``Transfer`` lists: the cross-domain pieces ``[name, region, bytes,
    senders, receivers (sorted)]`` in plan order, and the same-domain pairs."""
    pieces: dict[tuple, list] = {}
    direct: list[tuple[int, int, list]] = []
    for (src, dst), transfers in by_pair.items():
        dm = domain[dst]
        if domain[src] == dm:
            direct.append((src, dst, transfers))
            continue
        for t in transfers:
            key = (dm, t.name, id(t.region))
            got = pieces.get(key)
            if got is None:
                pieces[key] = [t.name, t.region, t.nbytes, {src}, [dst]]
            else:
                got[3].add(src)
                got[4].append(dst)
    for v in pieces.values():
        v[4] = sorted(set(v[4]))
    ordered = sorted(pieces.values(), key=lambda v: (order[v[0]], v[1].starts, v[1].stops,
                                                     v[4][0]))
    return ordered, direct


def _pieces_from_tables(plan, domain: Sequence[int]) -> tuple[list, list]:
    """Step 1 as :func:`_pieces_from_transfers`, from every destination rank's
    ``plan.receive_table``: rows grouped by (domain, tensor, region object) in numpy,
    ``Transfer`` objects built only for same-domain pairs (few)."""
    from ..planner.plan import Transfer
    dom = np.asarray(domain, np.int64)
    dst_ranks = sorted({r for lay in {id(v): v for v in plan.dst.values()}.values()
                        for r in lay.ranks})
    gid_of: dict[int, int] = {}
    regions: list = []                  # by gid; keeps every region alive, so ids stay unique
    cols: list[tuple[np.ndarray, ...]] = []
    direct: dict[tuple[int, int], list] = {}
    for rank in dst_ranks:
        tb = plan.receive_table(rank)
        gids = np.empty(len(tb.regions), np.int64)
        for k, reg in enumerate(tb.regions):
            g = gid_of.get(id(reg))
            if g is None:
                g = gid_of[id(reg)] = len(regions)
                regions.append(reg)
            gids[k] = g
        src = tb.src.astype(np.int64)
        keep = src != rank
        same = keep & (dom[src] == dom[rank])
        for i in np.flatnonzero(same).tolist():
            t = int(tb.tensor[i])
            direct.setdefault((int(src[i]), rank), []).append(Transfer(
                plan.names[t], tb.regions[tb.region[i]], int(src[i]), rank, int(tb.nbytes[i])))
        other = keep & ~same
        cols.append((src[other], np.full(int(other.sum()), rank, np.int64),
                     tb.tensor[other].astype(np.int64), gids[tb.region[other]],
                     tb.nbytes[other]))
    if not cols or not sum(len(c[0]) for c in cols):
        return [], [(s, d, ts) for (s, d), ts in direct.items()]
    src, dst, tensor, gid, nbytes = (np.concatenate([c[i] for c in cols]) for i in range(5))
    del cols
    # rows sorted by (domain, tensor, region, dst, src); groups: (domain, tensor, region)
    n, num_t, num_g = len(dom), len(plan.names), len(regions)
    if (int(dom.max()) + 1) * num_t * num_g * n * n < 1 << 62:   # one int64 key, one sort
        group = (dom[dst] * num_t + tensor) * num_g + gid
        key = group * (n * n) + dst * n + src
        srt = np.argsort(key, kind="stable")
        key = key[srt]
        group, dst, src = key // (n * n), key // n % n, key % n
        del key
        new = np.ones(len(src), bool)
        new[1:] = group[1:] != group[:-1]
        first = np.flatnonzero(new)
        tensor_f, gid_f = group[first] // num_g % num_t, group[first] % num_g
        nbytes_f = nbytes[srt[first]]
    else:
        dm = dom[dst]
        srt = np.lexsort((src, dst, gid, tensor, dm))
        src, dst, tensor, gid, nbytes, dm = (a[srt] for a in (src, dst, tensor, gid, nbytes, dm))
        new = np.ones(len(src), bool)
        new[1:] = (dm[1:] != dm[:-1]) | (tensor[1:] != tensor[:-1]) | (gid[1:] != gid[:-1])
        first = np.flatnonzero(new)
        tensor_f, gid_f, nbytes_f = tensor[first], gid[first], nbytes[first]
    last = np.append(first[1:], len(src))
    # plan order: tensor, then region bounds, then the least receiver (dst is sorted)
    by_bounds = sorted(range(len(regions)), key=lambda g: (regions[g].starts, regions[g].stops))
    bound_rank = np.empty(len(regions), np.int64)
    bound_rank[by_bounds] = np.arange(len(regions))
    seq = np.lexsort((dst[first], bound_rank[gid_f], tensor_f))
    src_l, dst_l = src.tolist(), dst.tolist()
    names = plan.names
    ordered = []
    # pieces of one pattern share their sender set and receiver list (read only)
    sets: dict[tuple, tuple[set, list]] = {}
    for a, b, t, g, nb in zip(first[seq].tolist(), last[seq].tolist(), tensor_f[seq].tolist(),
                              gid_f[seq].tolist(), nbytes_f[seq].tolist()):
        key = (*src_l[a:b], -1, *dst_l[a:b])
        got = sets.get(key)
        if got is None:
            got = sets[key] = (set(src_l[a:b]), sorted(set(dst_l[a:b])))
        ordered.append([names[t], regions[g], nb, got[0], got[1]])
    return ordered, [(s, d, ts) for (s, d), ts in direct.items()]


def _chunked(streams: dict[tuple[int, int, tuple[int, ...]], list], bucket_bytes: int,
             staging_bytes: int) -> tuple[RelayStream, ...]:
    """The streams with their chunk sizes."""
    # 3. chunk sizes: every pair moves its bytes in the same number of rounds, so each
    # round carries every pair's share and no NIC idles while a few long pairs finish.
    # The rounds are as few as staging allows: a relay stages its network chunks and
    # about as many bytes again forwarded to it by the other relays of its sets (its own
    # forwards leave from its destination binding; TODO(part 4): count packed forwards).
    pair_bytes: dict[tuple[int, int], int] = {}
    into: dict[int, int] = {}
    out_of: dict[int, int] = {}
    for (src, relay, _), items in streams.items():
        nb = sum(x[2] for x in items)
        pair_bytes[(src, relay)] = pair_bytes.get((src, relay), 0) + nb
        into[relay] = into.get(relay, 0) + nb
        out_of[src] = out_of.get(src, 0) + nb
    need = max([2 * b for b in into.values()] + list(out_of.values()) + [0])
    num_rounds = max(1, -(-need // max(staging_bytes, 1)))
    out = []
    for (src, relay, fwd), items in sorted(streams.items()):
        chunk = -(-pair_bytes[(src, relay)] // num_rounds)
        chunk = max(MIN_BUCKET_BYTES, min(bucket_bytes, chunk))
        out.append(RelayStream(src, relay, fwd, tuple(items), chunk))
    return tuple(out)


def _direct_pairs(direct: list[tuple[int, int, list]], order: dict[str, int],
                  bucket_bytes: int, staging_bytes: int) -> tuple:
    """Pairs inside one domain, sized as the direct scheduler sizes them."""
    peers_d: dict[int, int] = {}
    for src, dst, _ in direct:
        peers_d[src] = peers_d.get(src, 0) + 1
        peers_d[dst] = peers_d.get(dst, 0) + 1
    kept = []
    for src, dst, transfers in sorted(direct, key=lambda x: (x[0], x[1])):
        size = max(MIN_BUCKET_BYTES, min(bucket_bytes, staging_bytes
                                         // max(peers_d[src], peers_d[dst], 1)))
        ts = sorted(transfers, key=lambda t: (order[t.name], t.region.starts, t.region.stops))
        kept.append((src, dst, size, tuple(ts)))
    return tuple(kept)


def relay_traffic(plan, by_pair: dict[tuple[int, int], list] | None, domain: Sequence[int], *,
                  bucket_bytes: int, staging_bytes: int,
                  nic: Sequence[tuple[int, int]] | None = None) -> Traffic:
    """The messages of :func:`build_relay`'s schedule."""
    sched = build_relay(plan, by_pair, domain, bucket_bytes=bucket_bytes,
                        staging_bytes=staging_bytes, nic=nic)
    return sched.traffic(plan.names, plan.wire_dtypes)
