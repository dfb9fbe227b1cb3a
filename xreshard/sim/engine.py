"""Replay messages on a cluster, round by round: max-min fair bandwidth, per-message latency.

Model (the one the issue asks for, and what the executor does):

* Rounds run one after the other; all messages of a round start together (one transport
  group) and the round ends when its last message has landed.
* A message loads every link on its path (``cluster.py``: NVLink out/in of the GPUs it
  crosses, the PXN proxy's NIC out, the destination rail's NIC in). Links share their
  bandwidth max-min fairly among the messages crossing them (progressive filling); when a
  message lands the rest are re-shared. A network message is also held under NCCL's
  per-peer channel cap where it applies.
* A message lands its link class's latency after its last byte (NVLink or network).

Not modelled (``TODO(model)``): NCCL's limit of 8 p2p operations per channel in flight
(messages beyond it queue); pack/unpack copies and kernel launches between rounds;
congestion above the leaf switches (the fabric is taken as non-blocking).

Rounds that send the same messages (same pairs, same sizes) take the same time: each
distinct round is simulated once, which is what makes 10^7 messages tractable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..cluster import Cluster, Placement
from .traffic import PairTraffic, Traffic

__all__ = ["Network", "RoundResult", "Replay", "maxmin_rates", "replay"]

NVLINK, NETWORK, LOCAL = 1, 2, 0
_LINK_KINDS = ("nvlink out", "nvlink in", "nic out", "nic in")


class Network:
    """The links of ``cluster`` under ``placement``, and each message's path over them.

    Link ids: NVLink out / in of every physical GPU of the nodes in use, then NIC out / in
    of every (node, rail).
    """

    def __init__(self, cluster: Cluster, placement: Placement, *, peer_cap: bool = True):
        self.cluster = cluster
        self.placement = placement
        nodes = sorted(set(placement.node))
        self.node_index = {n: i for i, n in enumerate(nodes)}
        g, rails = cluster.gpus_per_node, cluster.nics_per_node
        self.num_nodes = len(nodes)
        self.num_gpus = self.num_nodes * g
        self.num_nics = self.num_nodes * rails
        node = np.array([self.node_index[n] for n in placement.node], np.int64)
        gpu = np.array(placement.gpu, np.int64)
        self.rank_node = node
        self.rank_gpu = gpu
        self.rank_phys = node * g + gpu
        self.rank_domain = np.array(placement.domain, np.int64)
        self.rank_rail = gpu * rails // g
        n_g, n_n = self.num_gpus, self.num_nics
        self.num_links = 2 * n_g + 2 * n_n
        cap = np.empty(self.num_links + 1)
        cap[:2 * n_g] = cluster.nvlink_bw
        cap[2 * n_g:-1] = cluster.nic_bw
        cap[-1] = np.inf                       # the "no link" sentinel
        self.capacity = cap
        self.flow_cap = (cluster.peer_cap(placement.num_ranks, placement.num_nodes)
                         if peer_cap else np.inf)

    def paths(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(links, kind)``: per message its 4 link ids (the sentinel pads) and whether it
        is LOCAL (same GPU), NVLINK (same domain) or NETWORK."""
        c = self.cluster
        n_g, n_n, sentinel = self.num_gpus, self.num_nics, self.num_links
        ps, pd = self.rank_phys[src], self.rank_phys[dst]
        same_domain = self.rank_domain[src] == self.rank_domain[dst]
        kind = np.where(ps == pd, LOCAL, np.where(same_domain, NVLINK, NETWORK))
        links = np.full((len(src), 4), sentinel, np.int64)
        nv = kind == NVLINK
        links[nv, 0] = ps[nv]
        links[nv, 1] = n_g + pd[nv]
        net = kind == NETWORK
        # PXN: leave through the NIC of the destination's rail on the sender's node,
        # reached over NVLink from the sender unless the sender owns that rail
        rail = self.rank_rail[dst[net]]
        snode = self.rank_node[src[net]]
        proxy_gpu = rail * c.gpus_per_node // c.nics_per_node
        proxy = snode * c.gpus_per_node + proxy_gpu
        hop = proxy != ps[net]
        idx = np.flatnonzero(net)
        links[idx[hop], 0] = ps[net][hop]
        links[idx[hop], 1] = n_g + proxy[hop]
        links[idx, 2] = 2 * n_g + snode * c.nics_per_node + rail
        links[idx, 3] = 2 * n_g + n_n + self.rank_node[dst[net]] * c.nics_per_node + rail
        return links, kind

    def describe_link(self, link: int) -> tuple[str, str, list[int]]:
        """``(class, what, ranks)``: link class ("nvlink" / "network"), a label, and the
        world ranks on that GPU or NIC."""
        n_g = self.num_gpus
        c = self.cluster
        inv = {i: n for n, i in self.node_index.items()}
        if link < 2 * n_g:
            phys = link % n_g
            ranks = np.flatnonzero(self.rank_phys == phys).tolist()
            node, gpu = divmod(phys, c.gpus_per_node)
            return "nvlink", f"{_LINK_KINDS[link // n_g]} of node {inv[node]} GPU {gpu}", ranks
        k = link - 2 * n_g
        direction, nic = divmod(k, self.num_nics)
        node, rail = divmod(nic, c.nics_per_node)
        ranks = np.flatnonzero((self.rank_node == node) & (self.rank_rail == rail)).tolist()
        return "network", f"{_LINK_KINDS[2 + direction]} of node {inv[node]} rail {rail}", ranks


def maxmin_rates(links: np.ndarray, capacity: np.ndarray, flow_cap: float) -> np.ndarray:
    """Max-min fair rates of flows over ``links`` (flows x K link ids; the last link of
    ``capacity`` is an unlimited sentinel), each flow also held under ``flow_cap``.

    Parallel water-filling: every link whose fair share (remaining capacity / unfrozen
    flows) is no larger than the share of any link its flows cross is a bottleneck; its
    flows freeze at that share, all such links at once. Shares only grow as flows freeze
    below them, so this is exactly progressive filling, in as many passes as the longest
    chain of bottlenecks rather than one pass per distinct rate.
    """
    n = len(links)
    rate = np.zeros(n)
    rem = capacity.astype(float).copy()
    num_links = len(capacity)
    sentinel = num_links - 1
    alive = np.arange(n)
    cols = [np.ascontiguousarray(links[:, k]) for k in range(links.shape[1])]
    while len(alive):
        cnt = sum(np.bincount(col, minlength=num_links) for col in cols).astype(float)
        cnt[sentinel] = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            share = rem / cnt
        share[cnt == 0] = np.inf
        shares = [share[col] for col in cols]
        low = shares[0]
        for sh in shares[1:]:
            low = np.minimum(low, sh)
        fmin = np.minimum(low, flow_cap)
        if not np.isfinite(fmin).all():
            raise ValueError("a flow crosses no link with a finite capacity")
        # a link is not a bottleneck if one of its flows is held lower elsewhere
        blocked = np.zeros(num_links, bool)
        cut = fmin * (1 + 1e-12)
        for col, sh in zip(cols, shares):
            blocked[col[cut < sh]] = True
        blocked[sentinel] = True
        frozen = ~blocked[cols[0]]
        for col in cols[1:]:
            frozen |= ~blocked[col]
        if flow_cap < np.inf:   # the cap is a private link: a bottleneck when lowest
            frozen |= flow_cap <= low * (1 + 1e-12)
        if not frozen.any():     # numerical safety: freeze the lowest
            frozen = fmin <= fmin.min() * (1 + 1e-9)
        rate[alive[frozen]] = fmin[frozen]
        f = fmin[frozen]
        for col in cols:
            rem -= np.bincount(col[frozen], weights=f, minlength=num_links)
        rem[sentinel] = np.inf
        np.maximum(rem, 0.0, out=rem)
        keep = ~frozen
        alive = alive[keep]
        cols = [col[keep] for col in cols]
    return rate


@dataclass(frozen=True)
class RoundResult:
    seconds: float
    finish: np.ndarray        # per message of the round: landing time from the round start
    critical_link: int        # the most loaded link (bytes / capacity) of the round
    critical_kind: int        # class of the message that landed last


#: completions closer than this fraction of a round's link-load bound share one re-share
#: of bandwidth (the earlier ones' bandwidth idles until the last of them lands)
EVENT_WINDOW = 0.02

#: at most this many bandwidth shares per round; what is left then drains at the link-load
#: bound of the remainder (each link busy until its last byte: the tail can only come out
#: shorter than max-min would make it, never shorter than any schedule could)
MAX_RESHARES = 16


def _fluid(links: np.ndarray, capacity: np.ndarray, caps: np.ndarray, nbytes: np.ndarray,
           moving: np.ndarray, bound: float, window: float, max_reshares: int) -> np.ndarray:
    """Landing time (bandwidth only) of every message in ``moving``; others stay 0."""
    finish = np.zeros(len(nbytes))
    remaining = nbytes.astype(float)
    t = 0.0
    solves = 0
    while len(moving):
        solves += 1
        if solves > max_reshares:
            left = remaining[moving]
            load = np.bincount(links[moving].ravel(), weights=np.repeat(left, links.shape[1]),
                               minlength=len(capacity))[:-1]
            tail = max(float((load / capacity[:-1]).max()),
                       float((left / caps[moving]).max()))
            finish[moving] = t + tail
            break
        lk = links[moving]
        fc = caps[moving]
        if (fc == fc[0]).all():
            rate = maxmin_rates(lk, capacity, float(fc[0]))
        else:                       # mixed: give capped flows a private link each
            rate = _mixed_rates(lk, capacity, fc)
        left = remaining[moving]
        until = left / rate
        first = float(until.min())
        done = until <= first + window * bound
        finish[moving[done]] = t + until[done]
        step = float(until[done].max())
        remaining[moving] = left - rate * step
        t += step
        moving = moving[~done]
    return finish


def _simulate_round(net: Network, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                    window: float = EVENT_WINDOW, max_reshares: int = MAX_RESHARES,
                    paths: tuple[np.ndarray, np.ndarray] | None = None) -> RoundResult:
    links, kind = net.paths(src, dst) if paths is None else paths
    c = net.cluster
    latency = np.where(kind == NETWORK, c.network_latency,
                       np.where(kind == NVLINK, c.nvlink_latency, 0.0))
    moving = np.flatnonzero((kind != LOCAL) & (nbytes > 0))
    load = np.bincount(links[moving].ravel(), weights=np.repeat(
        nbytes[moving].astype(float), links.shape[1]), minlength=len(net.capacity))[:-1]
    util = load / net.capacity[:-1]
    bound = float(util.max()) if len(util) else 0.0
    caps = np.where(kind == NETWORK, net.flow_cap, np.inf)
    finish = _fluid(links, net.capacity, caps, nbytes, moving, bound, window, max_reshares)
    landed = finish + latency
    seconds = float(landed.max()) if len(landed) else 0.0
    crit = int(np.argmax(util)) if bound > 0 else -1
    last = int(np.argmax(landed)) if len(landed) else 0
    return RoundResult(seconds, landed, crit, int(kind[last]) if len(kind) else LOCAL)


def _mixed_rates(links: np.ndarray, capacity: np.ndarray, flow_cap: np.ndarray) -> np.ndarray:
    capped = np.flatnonzero(np.isfinite(flow_cap))
    extra = len(capacity) - 1 + np.arange(len(capped))
    cap2 = np.concatenate([capacity[:-1], flow_cap[capped], [np.inf]])
    lk = links.copy()
    lk[lk == len(capacity) - 1] = len(cap2) - 1
    col = np.full(len(links), len(cap2) - 1)
    col[capped] = extra
    return maxmin_rates(np.column_stack([lk, col]), cap2, np.inf)


@dataclass(frozen=True)
class Replay:
    """A replayed traffic: total time, round start times, every message's landing time."""

    seconds: float
    round_start: np.ndarray   # per round
    round_seconds: np.ndarray
    finish: np.ndarray | None  # per message (traffic order): absolute landing time
    critical_link: int        # link that was the most loaded in the rounds worth most time
    critical_kind: int
    distinct_rounds: int


def replay(net: Network, traffic: Traffic | PairTraffic,
           progress: Callable[[int, int], None] | None = None) -> Replay:
    """Run ``traffic`` on ``net``, round after round.

    A :class:`Traffic` gets every message's landing time (``Replay.finish``); a
    :class:`PairTraffic` (hundreds of millions of messages) does not (``finish`` is None),
    and only the time of each distinct round is kept.
    """
    num_rounds = traffic.num_rounds
    per_message = isinstance(traffic, Traffic)
    # a PairTraffic's messages name their pair: paths are computed once per pair
    pair_paths = None if per_message else net.paths(traffic.src, traffic.dst)
    finish = np.zeros(len(traffic)) if per_message else None
    starts = np.zeros(num_rounds)
    secs = np.zeros(num_rounds)
    cache: dict[bytes, RoundResult] = {}
    crit_time: dict[tuple[int, int], float] = {}
    t = 0.0
    for k, (sel, src, dst, nb) in enumerate(traffic.rounds()):
        key = hashlib.blake2b(src.tobytes() + dst.tobytes() + nb.tobytes(),
                              digest_size=16).digest()
        res = cache.get(key)
        if res is None:
            paths = None if pair_paths is None else (pair_paths[0][sel], pair_paths[1][sel])
            res = _simulate_round(net, src, dst, nb, paths=paths)
            if not per_message:     # keep memory bounded: a round's times are not kept
                res = RoundResult(res.seconds, np.zeros(0), res.critical_link,
                                  res.critical_kind)
            cache[key] = res
        starts[k] = t
        secs[k] = res.seconds
        if finish is not None:
            finish[sel] = t + res.finish
        t += res.seconds
        ck = (res.critical_link, res.critical_kind)
        crit_time[ck] = crit_time.get(ck, 0.0) + res.seconds
        if progress is not None and (k % 16 == 15 or k + 1 == num_rounds):
            progress(k + 1, num_rounds)
    link, kind = max(crit_time, key=crit_time.get) if crit_time else (-1, LOCAL)
    return Replay(t, starts, secs, finish, link, kind, len(cache))
