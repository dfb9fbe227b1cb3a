"""A relay schedule built from a plan: each byte crosses the network once per domain.

Destination ranks of one NVLink domain that need the same region form its *relay set*.
Instead of every one of them pulling the region over its own NIC (the direct schedule:
one network copy per destination replica), one of them - the *relay* - receives it over
the network and forwards it over NVLink to the rest, chunked so forwarding overlaps
arrival::

    round k    sender s ──network──▶ relay r            (chunk k of the stream s -> r)
    round k+1  relay r  ──NVLink──▶ every other rank of the set that needs chunk k

Choices (greedy, deterministic, in plan order):

* the sender of a region is the least loaded (bytes sent so far) of the ranks the plan
  already picked for that region's receivers in the domain - all of them hold it;
* the relay is the least loaded receiver of the set (bytes received over the network
  so far), which balances the domain's NICs; it stays with a sender it already pairs
  with while that is within ``STICKY_BYTES`` of the least loaded, so a relay talks to few
  senders and its chunks stay large under the staging budget;
* pairs inside one domain (colocated layouts) keep their direct transfers, over NVLink.

Staging: a relay's bytes in flight per round are its network chunks, plus the same bytes
forwarded to each other member of the set, plus what the other relays forward to it;
chunk sizes are cut so that this stays within ``staging_bytes``.

This is a pure function of the plan, the domain of every rank and the two byte budgets,
so every rank can derive the same relay schedule, as with the direct one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..dtypes import itemsize
from ..schedule import MIN_BUCKET_BYTES
from .traffic import Traffic, pair_messages, split_sizes

__all__ = ["RelayStream", "RelaySchedule", "build_relay", "relay_traffic", "STICKY_BYTES"]

#: a relay keeps its current senders while within this many bytes of the least loaded
STICKY_BYTES = 64 << 20


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
        ``k``; its forwards, coalesced per (relay, target), in round ``k + 1``."""
        rows: list[tuple[int, int, int, int]] = []
        fwd: dict[tuple[int, int, int], int] = {}
        isz = {n: itemsize(wire_dtypes[n]) for n in names}
        by_pair: dict[tuple[int, int], list[RelayStream]] = {}
        for st in self.streams:
            by_pair.setdefault((st.src, st.relay), []).append(st)
        memo: dict[tuple, list[tuple[int, int]]] = {}
        for (src, relay), streams in by_pair.items():
            rnd = used = 0
            for st in streams:
                size = st.chunk_bytes
                key = (size,) + tuple((reg.shape, isz[n]) for n, reg, _ in st.items)
                msgs = memo.get(key)
                if msgs is None:
                    parts = (nb for n, reg, _ in st.items
                             for nb in split_sizes(reg.shape, isz[n], size))
                    msgs = memo[key] = pair_messages(parts, size)
                last = -1
                for r, nb in msgs:
                    if r != last:       # a new round of this stream
                        if used and (last >= 0 or used + nb > size):
                            rnd, used = rnd + 1, 0
                        last = r
                    used += nb
                    rows.append((rnd, src, relay, nb))
                    for x in st.forward_to:
                        k = (rnd + 1, relay, x)
                        fwd[k] = fwd.get(k, 0) + nb
        n_net = len(rows)
        for (rnd, relay, x), nb in fwd.items():
            rows.append((rnd, relay, x, nb))
        for src, dst, size, transfers in self.direct:
            parts = (nb for t in transfers
                     for nb in split_sizes(t.region.shape, isz[t.name], size))
            rows.extend((r, src, dst, nb) for r, nb in pair_messages(parts, size))
        is_fwd = np.zeros(len(rows), bool)
        is_fwd[n_net:n_net + len(fwd)] = True
        return Traffic.of(rows, forward=is_fwd)


def build_relay(plan, by_pair: dict[tuple[int, int], list], domain: Sequence[int], *,
                bucket_bytes: int, staging_bytes: int) -> RelaySchedule:
    """The relay schedule of ``plan`` when rank ``r`` lives in NVLink domain ``domain[r]``.

    Args:
        plan: the plan (its transfers say which bytes each rank needs, and from whom).
        by_pair: its transfers by (src, dst) pair (``traffic.receive_lists``).
        domain: NVLink domain of every world rank.
        bucket_bytes / staging_bytes: as ``RefitConfig``.
    """
    order = {name: i for i, name in enumerate(plan.names)}
    # 1. per (domain, region): the receivers there, and the senders the plan chose
    pieces: dict[tuple, list] = {}
    direct: list[tuple[int, int, list]] = []
    for (src, dst), transfers in by_pair.items():
        dm = domain[dst]
        if domain[src] == dm:
            direct.append((src, dst, transfers))
            continue
        for t in transfers:
            key = (dm, order[t.name], t.region.starts, t.region.stops)
            got = pieces.get(key)
            if got is None:
                pieces[key] = [t.name, t.region, t.nbytes, {src}, [dst]]
            else:
                got[3].add(src)
                got[4].append(dst)
    # 2. sender and relay of every piece, greedily in plan order
    sent: dict[int, int] = {}
    got_net: dict[int, int] = {}
    partners: dict[int, set[int]] = {}
    streams: dict[tuple[int, int, tuple[int, ...]], list] = {}
    for key in sorted(pieces):
        name, region, nb, senders, receivers = pieces[key]
        src = min(senders, key=lambda r: (sent.get(r, 0), r))
        receivers = sorted(set(receivers))
        least = min(got_net.get(r, 0) for r in receivers)
        mine = partners.setdefault(src, set())
        sticky = [r for r in receivers if r in mine and got_net.get(r, 0) <= least + STICKY_BYTES]
        relay = min(sticky or receivers, key=lambda r: (got_net.get(r, 0), r))
        mine.add(relay)
        sent[src] = sent.get(src, 0) + nb
        got_net[relay] = got_net.get(relay, 0) + nb
        fwd = tuple(r for r in receivers if r != relay)
        streams.setdefault((src, relay, fwd), []).append((name, region, nb))
    # 3. chunk sizes: a relay's bytes in flight per round stay within staging_bytes
    net_in: dict[int, set[int]] = {}
    net_out: dict[int, set[int]] = {}
    fan: dict[int, int] = {}
    fwd_in: dict[int, set[int]] = {}
    for src, relay, fwd in streams:
        net_in.setdefault(relay, set()).add(src)
        net_out.setdefault(src, set()).add(relay)
        fan[relay] = max(fan.get(relay, 0), len(fwd))
        for x in fwd:
            fwd_in.setdefault(x, set()).add(relay)
    def weight(r: int) -> int:
        return (len(net_in.get(r, ())) * (1 + fan.get(r, 0))
                + sum(len(net_in.get(q, ())) for q in fwd_in.get(r, ())))
    out = []
    for (src, relay, fwd), items in sorted(streams.items()):
        peers = max(weight(relay), len(net_out[src]), 1)
        chunk = max(MIN_BUCKET_BYTES, min(bucket_bytes, staging_bytes // peers))
        out.append(RelayStream(src, relay, fwd, tuple(items), chunk))
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
    return RelaySchedule(tuple(out), tuple(kept))


def relay_traffic(plan, by_pair: dict[tuple[int, int], list], domain: Sequence[int], *,
                  bucket_bytes: int, staging_bytes: int) -> Traffic:
    """The messages of :func:`build_relay`'s schedule."""
    sched = build_relay(plan, by_pair, domain, bucket_bytes=bucket_bytes,
                        staging_bytes=staging_bytes)
    return sched.traffic(plan.names, plan.wire_dtypes)
