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
distinct round is simulated once, which is what makes 10^7 messages tractable. Within a
round, flows that are identical once a network flow's NVLink hop is dropped (same NIC
pair, same bytes: the GPUs of a node sending to one GPU elsewhere) are solved as one flow
with a multiplicity, exact while the hops do not bind, which each solve checks (else the
round is solved flow by flow): Kimi-K2 at 2,048 ranks has ~6x fewer flows to share.
Link ids are held as K x flows arrays (``cols``); ``np.compress`` / ``np.take`` keep
them C-ordered (``cols[:, mask]`` would not, and every reduction would crawl).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .cluster import Cluster, ClusterError, Placement
from .traffic import PairTraffic, Traffic

__all__ = ["Network", "RoundResult", "Replay", "maxmin_rates", "reduced_paths", "replay",
           "KIND_NAMES", "BUSY_CLASSES"]

NVLINK, NETWORK, LOCAL, SITE = 1, 2, 0, 3
_LINK_KINDS = ("nvlink out", "nvlink in", "nic out", "nic in", "site link out",
               "site link in")
#: what each message kind is called in results
KIND_NAMES = {LOCAL: "local", NVLINK: "nvlink", NETWORK: "network", SITE: "site"}


class Network:
    """The links of ``cluster`` under ``placement``, and each message's path over them.

    Link ids: NVLink out / in of every physical GPU of the nodes in use, then NIC out / in
    of every (node, rail), then the site link out / in of every node (clusters of several
    sites), then each node's host copy link (clusters with ``host_bw``: a CPU host).
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
        self.rank_site = np.array(placement.sites, np.int64)
        n_g, n_n = self.num_gpus, self.num_nics
        n_s = self.num_nodes if len(set(placement.sites)) > 1 else 0
        if n_s and cluster.site_bw <= 0:
            raise ClusterError(f"the placement puts ranks in {len(set(placement.sites))} "
                               f"sites but cluster {cluster.name!r} has no site links "
                               "(site_bw = 0); give it site_gbps, or one site")
        self.num_host = self.num_nodes if cluster.host_bw > 0 else 0
        self.num_links = 2 * n_g + 2 * n_n + 2 * n_s + self.num_host
        cap = np.empty(self.num_links + 1)
        cap[:2 * n_g] = cluster.nvlink_bw
        if cluster.nvlink_out_bw > 0:
            cap[:n_g] = cluster.nvlink_out_bw
        cap[2 * n_g:2 * n_g + 2 * n_n] = cluster.nic_bw
        cap[2 * n_g + 2 * n_n:2 * n_g + 2 * n_n + 2 * n_s] = cluster.site_bw
        cap[self.num_links - self.num_host:-1] = cluster.host_bw
        cap[-1] = np.inf                       # the "no link" sentinel
        self.capacity = cap
        self.flow_cap = (cluster.peer_cap(placement.num_ranks, placement.num_nodes)
                         if peer_cap else np.inf)
        # GPU x rail: whether GPU g of a node is the PXN proxy of the rail (a network
        # message to that rail hops into g), or not (one from g to that rail hops out)
        proxy: np.ndarray = np.arange(rails) * g // rails
        self.hop_in = (proxy[None, :] == np.arange(g)[:, None]).astype(float)
        self.hop_out = 1.0 - self.hop_in

    def paths(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(links, kind)``: per message its 4 link ids (the sentinel pads) and whether it
        is LOCAL (same GPU), NVLINK (same domain), NETWORK or SITE (another site: out of
        the sender's node's site link, into the receiver's)."""
        c = self.cluster
        n_g, n_n, sentinel = self.num_gpus, self.num_nics, self.num_links
        ps, pd = self.rank_phys[src], self.rank_phys[dst]
        same_domain = self.rank_domain[src] == self.rank_domain[dst]
        kind = np.where(ps == pd, LOCAL, np.where(same_domain, NVLINK, NETWORK))
        far = self.rank_site[src] != self.rank_site[dst]
        kind[far] = SITE
        links: np.ndarray = np.full((len(src), 4), sentinel, np.int64)
        nv = kind == NVLINK
        links[nv, 0] = ps[nv]
        links[nv, 1] = n_g + pd[nv]
        if self.num_host:       # copies inside a node also share the node's host link
            inside = nv & (self.rank_node[src] == self.rank_node[dst])
            links[inside, 3] = self.num_links - self.num_host + self.rank_node[src[inside]]
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
        site = np.flatnonzero(far)
        links[site, 2] = 2 * n_g + 2 * n_n + self.rank_node[src[site]]
        links[site, 3] = 2 * n_g + 2 * n_n + self.num_nodes + self.rank_node[dst[site]]
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
        if link >= self.num_links - self.num_host:
            node = link - (self.num_links - self.num_host)
            return ("nvlink", f"host copies of node {inv[node]}",
                    np.flatnonzero(self.rank_node == node).tolist())
        k = link - 2 * n_g
        if k >= 2 * self.num_nics:
            direction, node = divmod(k - 2 * self.num_nics, self.num_nodes)
            ranks = np.flatnonzero(self.rank_node == node).tolist()
            return "site", f"{_LINK_KINDS[4 + direction]} of node {inv[node]}", ranks
        direction, nic = divmod(k, self.num_nics)
        node, rail = divmod(nic, c.nics_per_node)
        ranks = np.flatnonzero((self.rank_node == node) & (self.rank_rail == rail)).tolist()
        return "network", f"{_LINK_KINDS[2 + direction]} of node {inv[node]} rail {rail}", ranks


def maxmin_rates(links: np.ndarray, capacity: np.ndarray,
                 flow_cap: float | np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows over ``links`` (flows x K link ids; the last link of
    ``capacity`` is an unlimited sentinel), each flow also held under ``flow_cap`` (one
    cap for all, or one per flow).

    Parallel water-filling: every link whose fair share (remaining capacity / unfrozen
    flows) is no larger than the share of any link its flows cross is a bottleneck; its
    flows freeze at that share, all such links at once. Shares only grow as flows freeze
    below them, so this is exactly progressive filling, in as many passes as the longest
    chain of bottlenecks rather than one pass per distinct rate. A flow's cap acts as a
    private link of its own.
    """
    cols = np.ascontiguousarray(np.asarray(links, np.intp).T)
    return _waterfill(cols, np.asarray(capacity, float), flow_cap)


def _waterfill(cols: np.ndarray, capacity: np.ndarray, cap: float | np.ndarray,
               mult: np.ndarray | None = None) -> np.ndarray:
    """:func:`maxmin_rates` on ``cols`` (K x flows link ids). ``mult[i]``: row ``i``
    stands for that many identical flows (same links, same cap), which max-min fairness
    treats identically, so one row each is exact."""
    k = cols.shape[0]
    rate = np.zeros(cols.shape[1])
    rem: np.ndarray = capacity.astype(float)
    num_links = len(capacity)
    sentinel = num_links - 1
    alive = np.arange(cols.shape[1])
    per_flow = np.ndim(cap) > 0
    if per_flow:
        cap = np.asarray(cap, float)
    capped = per_flow or cap < np.inf
    while len(alive):
        # each link id lives in one column (``Network.paths``), so one bincount over all
        # columns adds exactly what one per column would
        flat = cols.ravel()
        if mult is None:
            cnt = np.bincount(flat, minlength=num_links).astype(float)
        else:
            cnt = np.bincount(flat, weights=np.concatenate((mult,) * k), minlength=num_links)
        cnt[sentinel] = 0
        # (the relay's rounds take ~20 passes over a few thousand flows: calls are lean)
        share = np.divide(rem, cnt, out=np.full(num_links, np.inf), where=cnt > 0)
        shares = share[cols]
        low = np.minimum.reduce(shares, axis=0)
        fmin = np.minimum(low, cap) if capped else low
        if not np.isfinite(fmin).all():
            raise ValueError("a flow crosses no link with a finite capacity")
        # a link is not a bottleneck if one of its flows is held lower elsewhere
        blocked: np.ndarray = np.zeros(num_links, bool)
        blocked[cols[fmin * (1 + 1e-12) < shares]] = True
        blocked[sentinel] = True
        frozen = ~np.logical_and.reduce(blocked[cols], axis=0)
        if capped:      # the cap is a private link: a bottleneck when lowest
            frozen |= cap <= low * (1 + 1e-12)
        if not frozen.any():     # numerical safety: freeze the lowest
            frozen = fmin <= fmin.min() * (1 + 1e-9)
        f = fmin[frozen]
        rate[alive[frozen]] = f
        w = f if mult is None else f * mult[frozen]
        rem -= np.bincount(np.compress(frozen, cols, axis=1).ravel(),
                           weights=np.concatenate((w,) * k), minlength=num_links)
        rem[sentinel] = np.inf
        np.maximum(rem, 0.0, out=rem)
        keep = ~frozen
        alive = alive[keep]
        cols = np.compress(keep, cols, axis=1)   # stays C-ordered, unlike cols[:, keep]
        if per_flow and isinstance(cap, np.ndarray):     # (per_flow made it an array)
            cap = cap[keep]
        if mult is not None:
            mult = mult[keep]
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


def _fluid(cols: np.ndarray, capacity: np.ndarray, caps: np.ndarray, nbytes: np.ndarray,
           moving: np.ndarray, bound: float, window: float, max_reshares: int,
           classes: _Classes | None = None) -> np.ndarray | None:
    """Landing time (bandwidth only) of every flow in ``moving``; others stay 0.

    With ``classes``, the rows are classes of identical flows (``cols`` their paths
    without NVLink hops): None if a dropped hop turns out to bind (then solve per flow).
    """
    finish = np.zeros(len(nbytes))
    remaining: np.ndarray = nbytes.astype(float)
    t = 0.0
    solves = 0
    while len(moving):
        solves += 1
        if solves > max_reshares:
            left = remaining[moving]
            if classes is None:
                load = np.bincount(np.take(cols, moving, axis=1).ravel(),
                                   weights=np.tile(left, len(cols)),
                                   minlength=len(capacity))
            else:
                load = classes.flow_load(moving, left, len(capacity))
            tail = max(float((load[:-1] / capacity[:-1]).max()),
                       float((left / caps[moving]).max()))
            finish[moving] = t + tail
            break
        fc = caps[moving]
        cap = float(fc[0]) if (fc == fc[0]).all() else fc
        if classes is None:
            rate = _waterfill(np.take(cols, moving, axis=1), capacity, cap)
        else:
            rate = _waterfill(np.take(cols, moving, axis=1), capacity, cap,
                              classes.mult[moving])
            if not classes.hops_fit(moving, rate, capacity):
                return None
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
                    paths: tuple[np.ndarray, np.ndarray] | None = None,
                    reduced: tuple[np.ndarray, np.ndarray] | None = None,
                    grouped: bool = True) -> RoundResult:
    """One round. ``paths``: ``(cols, kind)`` of its messages (K x n link ids, as
    :meth:`Network.paths` transposed); ``reduced``: their :func:`reduced_paths`;
    ``grouped``: solve classes of identical flows (exact; False: every flow on its own,
    the straightforward reference)."""
    if paths is None:
        links, kind = net.paths(src, dst)
        cols = np.ascontiguousarray(links.T)
    else:
        cols, kind = paths
    c = net.cluster
    latency = np.select([kind == NETWORK, kind == NVLINK, kind == SITE],
                        [c.network_latency, c.nvlink_latency, c.site_latency], 0.0)
    if c.message_cost > 0:
        # the receiver's serial work per message, as bytes its in-link carries meanwhile
        # (its one process handles its messages one after another)
        into = np.where(kind == NVLINK, cols[1], cols[-1])
        nbytes = np.where(kind != LOCAL, nbytes + c.message_cost * net.capacity[into], nbytes)
    moving = np.flatnonzero((kind != LOCAL) & (nbytes > 0))
    everyone = len(moving) == len(kind)
    mcols = cols if everyone else np.take(cols, moving, axis=1)
    mbytes = nbytes if everyone else nbytes[moving]
    weights = np.concatenate((mbytes.astype(float),) * len(cols))
    load = np.bincount(mcols.ravel(), weights=weights, minlength=len(net.capacity))[:-1]
    util = load / net.capacity[:-1]
    bound = float(util.max()) if len(util) else 0.0
    caps = np.where(kind >= NETWORK, net.flow_cap, np.inf)
    finish = None
    if grouped and len(moving):
        if reduced is None:
            reduced = reduced_paths(net, cols, kind)
        cl = _Classes.of(net, mcols, kind[moving], mbytes, moving, reduced)
        if cl is not None:
            got = _fluid(cl.cols, net.capacity, cl.caps, cl.nbytes, np.arange(len(cl.mult)),
                         bound, window, max_reshares, cl)
            if got is not None:
                finish = np.zeros(len(nbytes))
                finish[moving] = got[cl.inverse]
    if finish is None:
        finish = _fluid(cols, net.capacity, caps, nbytes, moving, bound, window, max_reshares)
    landed = finish + latency
    seconds = float(landed.max()) if len(landed) else 0.0
    if c.message_cost > 0 and len(moving):
        # the sending process posts its messages one after another too: a round lasts at
        # least as long as its busiest sender's work
        posts = np.bincount(net.rank_phys[src[moving]], minlength=net.num_gpus)
        seconds = max(seconds, float(posts.max()) * c.message_cost)
    crit = int(np.argmax(util)) if bound > 0 else -1
    last = int(np.argmax(landed)) if len(landed) else 0
    return RoundResult(seconds, landed, crit, int(kind[last]) if len(kind) else LOCAL)


def reduced_paths(net: Network, cols: np.ndarray, kind: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per message, the id of its path without a network message's NVLink hop (PXN's
    detour to the proxy GPU), and those paths: 2 x R link ids, (NIC out, NIC in) across
    domains, (NVLink out, NVLink in) inside one."""
    s = net.num_links + 1
    far = kind >= NETWORK
    a = np.where(far, cols[2], cols[0])
    b = np.where(far, cols[3], cols[1])
    uniq, rid = np.unique(a * s + b, return_inverse=True)
    return rid.reshape(-1), np.stack([uniq // s, uniq % s])


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for arrays of few distinct values (a
    round's message sizes) without sorting them all: look up, then add what was missed."""
    uniq = np.unique(values[:1024])
    while True:
        idx = uniq.searchsorted(values)
        miss = uniq[np.minimum(idx, len(uniq) - 1)] != values
        if not miss.any():
            return uniq, idx
        uniq = np.union1d(uniq, values[miss])


#: solve by classes only when they are at most this fraction of a round's flows
CLASS_SHARE = 0.8


@dataclass(frozen=True)
class _Classes:
    """A round's moving flows as classes of identical flows: the same path once network
    flows' NVLink hops are dropped, the same bytes, hence the same cap. Max-min fairness
    gives identical flows identical rates, so a class is one row with a multiplicity.

    Dropping the hops is exact whenever they do not bind: an allocation that is max-min
    fair under fewer constraints and satisfies the rest is max-min fair under all of them
    (every flow keeps its bottleneck). :meth:`hops_fit` checks each solve: first against a
    bound (a GPU's hops carry at most what leaves its node through the NICs it proxies, or
    through the others), then flow by flow; if a hop would bind, the round is solved per
    flow. PXN keeps hops far from binding (NVLink is ~8x a NIC).
    """

    inverse: np.ndarray     # per moving flow: its class
    cols: np.ndarray        # 2 x C link ids of each class
    mult: np.ndarray        # flows per class
    nbytes: np.ndarray
    caps: np.ndarray
    flow_cols: np.ndarray   # K x m full paths of the moving flows
    hop: np.ndarray         # per moving flow: crosses an NVLink hop
    net: Network

    @classmethod
    def of(cls, net: Network, cols: np.ndarray, kind: np.ndarray, nbytes: np.ndarray,
           moving: np.ndarray, reduced: tuple[np.ndarray, np.ndarray]) -> _Classes | None:
        """The classes of the flows ``moving`` of a round (``cols``, ``kind``, ``nbytes``:
        theirs alone); None when they would not be much fewer."""
        rid, rpaths = reduced
        sizes, sidx = _factorize(nbytes)
        ns = len(sizes)
        code = rid[moving] * ns + sidx
        top = rpaths.shape[1] * ns
        if top <= 4 * len(code) + 4096:     # dense relabelling beats a sort
            present = np.zeros(top, bool)
            present[code] = True
            codes = np.flatnonzero(present)
            inverse = (np.cumsum(present) - 1)[code]
        else:
            codes, inverse = np.unique(code, return_inverse=True)
            inverse = inverse.reshape(-1)
        if len(codes) > CLASS_SHARE * len(code):
            return None
        ccols = np.take(rpaths, codes // ns, axis=1)
        mult = np.bincount(inverse, minlength=len(codes)).astype(float)
        far = ccols[0] >= 2 * net.num_gpus
        hop = (kind == NETWORK) & (cols[0] != net.num_links)
        return cls(inverse, ccols, mult, sizes[codes % ns],
                   np.where(far, net.flow_cap, np.inf), cols, hop, net)

    def flow_load(self, moving: np.ndarray, left: np.ndarray, num_links: int) -> np.ndarray:
        """Bytes on every link (full paths, hops included) of classes ``moving`` with
        ``left`` bytes left per flow."""
        w = np.zeros(len(self.mult))
        w[moving] = left
        k = len(self.flow_cols)
        return np.bincount(self.flow_cols.ravel(), weights=np.tile(w[self.inverse], k),
                           minlength=num_links)

    def hops_fit(self, moving: np.ndarray, rate: np.ndarray, capacity: np.ndarray) -> bool:
        """Whether classes ``moving`` at ``rate`` per flow leave every NVLink link that
        carries hops below its capacity."""
        net = self.net
        ng, num_links = net.num_gpus, len(capacity)
        w = rate * self.mult[moving]
        b0 = np.bincount(self.cols[0, moving], w, num_links)
        b1 = np.bincount(self.cols[1, moving], w, num_links)
        kept = np.concatenate([b0[:ng], b1[ng:2 * ng]])     # NVLink classes, out then in
        nic_out = b0[2 * ng:2 * ng + net.num_nics].reshape(net.num_nodes, -1)
        hop = np.concatenate([(nic_out @ net.hop_out.T).ravel(),
                              (nic_out @ net.hop_in.T).ravel()])
        room = capacity[:2 * ng] * (1 - 1e-9)
        if ((hop <= 0) | (kept + hop <= room)).all():
            return True
        per_class = np.zeros(len(self.mult))
        per_class[moving] = rate
        fc = np.compress(self.hop, self.flow_cols[:2], axis=1)
        r = per_class[self.inverse[self.hop]]
        hop = (np.bincount(fc[0], r, num_links) + np.bincount(fc[1], r, num_links))[:2 * ng]
        return bool(((hop <= 0) | (kept + hop <= room)).all())


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
    busy: list[np.ndarray] | None = None
    """Per round, ``[rank, class]``: when the rank's last message of that class lands,
    from the round's start (0: none), classes :data:`BUSY_CLASSES` (``replay(busy=True)``)."""


#: what a rank is busy with in a round (columns of ``Replay.busy``)
BUSY_CLASSES = ("network", "nvlink", "forward")


def _busy(net: Network, src: np.ndarray, dst: np.ndarray, kind: np.ndarray,
          landed: np.ndarray, forward: np.ndarray | None) -> np.ndarray:
    """``[rank, class]`` landing time of each rank's last message of each class (it is
    busy sending or receiving until then)."""
    n = net.placement.num_ranks
    cls = np.where(kind == NVLINK, 1, 0)
    if forward is not None:
        cls = np.where(forward, 2, cls)
    keep = kind != LOCAL
    out = np.zeros(n * 3)
    for ranks in (src, dst):
        np.maximum.at(out, (ranks.astype(np.int64) * 3 + cls)[keep], landed[keep])
    return out.reshape(n, 3)


def replay(net: Network, traffic: Traffic | PairTraffic,
           progress: Callable[[int, int], None] | None = None, *,
           grouped: bool = True, busy: bool = False) -> Replay:
    """Run ``traffic`` on ``net``, round after round.

    A :class:`Traffic` gets every message's landing time (``Replay.finish``); a
    :class:`PairTraffic` (hundreds of millions of messages) does not (``finish`` is None),
    and only the time of each distinct round is kept: its rounds are told apart by their
    patterns' messages, so a repeated round is not even generated. ``grouped=False``
    solves every flow on its own (the reference the class solver is tested against).
    ``busy=True`` also keeps, per distinct round, when each rank is busy (``Replay.busy``).
    """
    num_rounds = traffic.num_rounds
    per_message = isinstance(traffic, Traffic)
    finish = np.zeros(len(traffic)) if per_message else None
    rounds = (_message_rounds(traffic) if isinstance(traffic, Traffic)
              else _pair_rounds(net, traffic))
    grouped = grouped and not net.num_host    # classes drop every link but the NIC pair
    starts = np.zeros(num_rounds)
    secs = np.zeros(num_rounds)
    cache: dict[bytes, tuple[RoundResult, np.ndarray | None]] = {}
    busy_of: list[np.ndarray] | None = [] if busy else None
    crit_time: dict[tuple[int, int], float] = {}
    t = 0.0
    for k, (key, sel, build) in enumerate(rounds):
        got = cache.get(key)
        if got is None:
            src, dst, nb, paths, reduced, fwd = build()
            res = _simulate_round(net, src, dst, nb, paths=paths, reduced=reduced,
                                  grouped=grouped)
            used = None
            if busy:
                kind = paths[1] if paths is not None else net.paths(src, dst)[1]
                used = _busy(net, src, dst, kind, res.finish, fwd)
            if not per_message:     # keep memory bounded: a round's times are not kept
                res = RoundResult(res.seconds, np.zeros(0), res.critical_link,
                                  res.critical_kind)
            got = cache[key] = (res, used)
        res = got[0]
        if busy_of is not None:
            held = got[1]
            assert held is not None                 # kept for every round when busy
            busy_of.append(held)
        starts[k] = t
        secs[k] = res.seconds
        if finish is not None:
            finish[sel] = t + res.finish
        t += res.seconds
        ck = (res.critical_link, res.critical_kind)
        crit_time[ck] = crit_time.get(ck, 0.0) + res.seconds
        if progress is not None and (k % 16 == 15 or k + 1 == num_rounds):
            progress(k + 1, num_rounds)
    link, kind = max(crit_time, key=lambda ck: crit_time[ck]) if crit_time else (-1, LOCAL)
    return Replay(t, starts, secs, finish, link, kind, len(cache), busy_of)


def _digest(*arrays: np.ndarray) -> bytes:
    return hashlib.blake2b(b"".join(a.tobytes() for a in arrays), digest_size=16).digest()


def _message_rounds(traffic: Traffic) -> Iterator[tuple[bytes, np.ndarray, Callable]]:
    """``(key, index, build)`` per round of a :class:`Traffic`: equal keys, equal
    messages."""
    for sel, src, dst, nb in traffic.rounds():
        fwd = traffic.forward[sel]
        yield (_digest(src, dst, nb, fwd), sel,
               lambda s=src, d=dst, b=nb, f=fwd: (s, d, b, None, None, f))


def _pair_rounds(net: Network, traffic: PairTraffic
                 ) -> Iterator[tuple[bytes, None, Callable]]:
    """As :func:`_message_rounds` for a :class:`PairTraffic`: keys from its patterns,
    messages built only when asked, paths computed once per pair."""
    links, kind = net.paths(traffic.src, traffic.dst)
    cols = np.ascontiguousarray(links.T)
    del links
    reduced = reduced_paths(net, cols, kind)

    def build(k: int) -> tuple:
        pair, src, dst, nb = traffic.round(k)
        paths = (np.take(cols, pair, axis=1), kind[pair])
        fwd = None if traffic.forward is None else traffic.forward[pair]
        return src, dst, nb, paths, (reduced[0][pair], reduced[1]), fwd
    for k, key in enumerate(traffic.round_keys()):
        yield key, None, lambda k=k: build(k)
