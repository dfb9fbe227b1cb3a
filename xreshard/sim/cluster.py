"""The cluster model: where ranks sit, and how fast the links between them are.

A :class:`Cluster` is the hardware a refit runs on, as the simulator (``simulate.py``)
sees it: nodes of ``gpus_per_node`` GPUs grouped into NVLink *domains*, each GPU with an
NVLink port and a NIC *rail* (per direction), a latency per message per link class, and
NCCL's per-peer channel cap on network messages. A :class:`Placement` says which GPU each
world rank runs on. Pure data: nothing here touches a device.

Links (every bandwidth is per direction, in bytes per second)::

    GPU g ──nvlink out──▶ (switch) ──nvlink in──▶ GPU h         same domain
    GPU g ─(nvlink)─▶ GPU p ──NIC p out──▶ fabric ──NIC d in──▶ GPU d   other domain

Across domains NCCL sends through the NIC whose rail is the *destination* GPU's rail
(PXN, ``NCCL_P2P_PXN_LEVEL=2``, docs/cluster.md §4.3): the bytes first hop over NVLink to the
proxy GPU ``p`` on the sender's node that owns that rail, unless the sender owns it.
The fabric above the leaves is taken as non-blocking (rail-optimised fat tree, full
bisection: DGX SuperPOD reference architecture).

Decision record. The parameters are the documented *achievable* rates (NCCL's own
effective NVLink figure, the NCCL team's stated per-NIC rate), not line rates and not
fitted to any published refit: calibration in ``benchmarks/RESULTS.md`` is a check, not
a fit. Rejected: packet-level models (ns-3, htsim) - orders of magnitude slower than a
flow model, and refit traffic is long bulk transfers where flow models are accurate.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import XreshardError

__all__ = ["Cluster", "Placement", "ClusterError", "PRESETS", "load_cluster",
           "default_placement", "load_placement", "placement_of_world", "localhost_path"]

GB = 1e9


class ClusterError(XreshardError):
    """A cluster or placement description is malformed or does not fit the refit."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """The hardware a refit runs on. Bandwidths are bytes/s per direction, latencies s."""

    name: str
    gpus_per_node: int
    """GPUs under one OS instance (a DGX box; a GB200 compute tray)."""
    domain_size: int
    """GPUs joined by NVLink: one node on DGX H100, a 72-GPU rack on GB200 NVL72."""
    nvlink_bw: float
    """NVLink bandwidth of one GPU, each direction (any-to-any through NVSwitch)."""
    nic_bw: float
    """Achievable bandwidth of one NIC, each direction."""
    nics_per_node: int
    """NIC rails per node; GPU ``g`` of a node uses rail ``g * nics_per_node // gpus_per_node``."""
    nvlink_latency: float
    """Seconds added to each message that stays inside a domain."""
    network_latency: float
    """Seconds added to each message that crosses the network."""
    net_channel_bw: float = 0.0
    """Bandwidth of one NCCL network channel; 0 disables the per-peer channel cap."""
    net_channels_min: int = 4
    """NCCL's starting channels per network peer, before it halves them for large
    communicators (max(local NICs, ceil(NIC GB/s / 14)); paths.cc)."""
    p2p_channels: int = 32
    """NCCL's p2p channel count (p2pnChannels) used in the halving rule."""
    site_bw: float = 0.0
    """Bandwidth of each node's link to other sites (datacenters), each direction; 0: one
    site. A message between ranks of two sites leaves through its node's site link and
    enters through the receiver's (not the NIC rails, which stay inside a site)."""
    site_latency: float = 0.0
    """Seconds added to each message between two sites."""
    nvlink_out_bw: float = 0.0
    """Bandwidth out of a GPU over the domain's fast links when it differs from
    ``nvlink_bw`` (0: the same). On a CPU host (``localhost``) the shm transport's receiver
    copies every byte (it pulls from the sender's memory), so senders are not limited."""
    call_latency: float = 0.0
    """Seconds a refit call spends outside its rounds (metadata exchanges, checks), added
    once to every prediction (measured on ``localhost``; 0 elsewhere)."""
    host_bw: float = 0.0
    """Bandwidth of a node's memory copies between its GPUs' processes, all together (a
    CPU host's cores and memory bus: measured on ``localhost``); 0: not a limit."""
    message_cost: float = 0.0
    """Seconds of work per message in each process of a pair besides moving its bytes, one
    message after another (a CPU transport's per-message bookkeeping: measured on
    ``localhost``; 0 on GPUs, where a round's messages are posted as one group)."""

    def __post_init__(self) -> None:
        problems = []
        for f in ("gpus_per_node", "domain_size", "nics_per_node", "net_channels_min",
                  "p2p_channels"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                problems.append(f"{f} must be an integer >= 1, got {getattr(self, f)!r}")
        for f in ("nvlink_bw", "nic_bw"):
            if not getattr(self, f) > 0:
                problems.append(f"{f} must be > 0 bytes/s, got {getattr(self, f)!r}")
        for f in ("nvlink_latency", "network_latency", "net_channel_bw", "site_bw",
                  "site_latency", "nvlink_out_bw", "call_latency", "message_cost",
                  "host_bw"):
            if not getattr(self, f) >= 0:
                problems.append(f"{f} must be >= 0, got {getattr(self, f)!r}")
        if not problems and self.domain_size % self.gpus_per_node:
            problems.append(f"domain_size {self.domain_size} is not a multiple of "
                            f"gpus_per_node {self.gpus_per_node}; a domain holds whole nodes")
        if problems:
            raise ClusterError(f"cluster {self.name!r}: " + "; ".join(problems))

    @property
    def nodes_per_domain(self) -> int:
        return self.domain_size // self.gpus_per_node

    def rail(self, gpu: int) -> int:
        """The NIC rail of GPU ``gpu`` (its index in its node)."""
        return gpu * self.nics_per_node // self.gpus_per_node

    def channels_per_peer(self, num_ranks: int, num_nodes: int) -> int:
        """NCCL's network channels per peer in a communicator of ``num_ranks`` ranks.

        ``paths.cc`` (NCCL 2.30.7): start from ``net_channels_min``; with several nodes,
        halve while ``per_peer * ceil(num_ranks / 8) > p2p_channels`` (maxP2pPeers
        defaults to nRanks). A 256-rank communicator falls to 1 channel per peer.
        """
        per_peer = self.net_channels_min
        if num_nodes > 1:
            while per_peer > 1 and per_peer * math.ceil(num_ranks / 8) > self.p2p_channels:
                per_peer //= 2
        return per_peer

    def peer_cap(self, num_ranks: int, num_nodes: int) -> float:
        """Most bytes/s one network message between two ranks can reach (inf: no cap)."""
        if self.net_channel_bw <= 0:
            return math.inf
        return self.channels_per_peer(num_ranks, num_nodes) * self.net_channel_bw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "cluster JSON") -> Cluster:
        """From ``to_dict()``'s keys; bandwidths may also be given in GB/s as ``*_gbps``
        (``nvlink_gbps``, ``nic_gbps``, ``net_channel_gbps``, ``site_gbps``)."""
        known = {f.name for f in fields(cls)}
        data = dict(d)
        for key in list(data):
            if key.endswith("_gbps") and key[:-5] + "_bw" in known:
                data[key[:-5] + "_bw"] = float(data.pop(key)) * GB
        data.pop("sources", None)
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls)
                         if f.name not in data and f.default is MISSING)
        if unknown or missing:
            raise ClusterError(f"{where}: unknown keys {unknown}, missing keys {missing}; "
                               f"a cluster has {sorted(known)} (bandwidths in bytes/s, or "
                               "GB/s as nvlink_gbps / nic_gbps / net_channel_gbps / "
                               "site_gbps)")
        return cls(**data)


# DGX/HGX H100 and H200 (docs/cluster.md §2):
#   8 GPUs per node, the NVLink domain is the node (4 NVSwitch chips, one hop).
#   NVLink: 370 GB/s per direction is what NCCL's SM copies reach (SM90_NVLINK_BW =
#     20.6 GB/s x 18 links, src/graph/topo.h; "effective NVLink bandwidth of 370GB/s",
#     NCCL maintainer, nccl-tests#212; 364.9 GB/s measured sendrecv, HF playbook).
#   NIC: 8 x ConnectX-7 400 Gb/s, one per GPU, rail-indexed (DGX BasePOD RA; DGX H100
#     User Guide 1.2.3); "for NDR @ 400Gbps you should see 46-48GB/s per NIC" (NCCL team,
#     nccl-tests#290, #267): 47 GB/s, the middle of that range.
#   Latency per message: NVLink 4 us (sendrecv ~3 us measured + launch, nccl#1487/#1984),
#     network 15 us (NCCL's Simple NET hop 14 us + post overhead, tuning.cc; docs/cluster.md §4.4
#     planning range 10-20 us).
#   Per-peer cap: ~21 GB/s per network channel (one channel measured at ~21 of 42 GB/s,
#     HF playbook; 18-24 GB/s, nccl#1272); 4 channels per peer halved for large
#     communicators (paths.cc), p2pnChannels 32 [infer: the H100 collective channel count].
_H100: dict[str, Any] = dict(gpus_per_node=8, domain_size=8, nvlink_bw=370 * GB,
                             nic_bw=47 * GB, nics_per_node=8, nvlink_latency=4e-6,
                             network_latency=15e-6, net_channel_bw=21 * GB, net_channels_min=4,
                             p2p_channels=32)

#: the clusters ``--cluster NAME`` knows; sources in the comments above and below
PRESETS: dict[str, Cluster] = {
    "dgx-h100": Cluster("dgx-h100", **_H100),
    # H200: same NVLink 4 fabric, NVSwitch chips and 8 x CX-7 400G NICs as H100 (DGX
    # BasePOD RA, docs/cluster.md §2 H12); only HBM differs, which a refit does not wait on.
    "hgx-h200": Cluster("hgx-h200", **_H100),
    # GB200 NVL72 (docs/cluster.md §3):
    #   a compute tray is one node of 4 GPUs; the NVLink domain is the 72-GPU rack
    #     (DGX GB200 User Guide; MNNVL).
    #   NVLink 5: 900 GB/s per direction spec; NCCL's effective figure is 40.1 GB/s x 18 =
    #     721.8 GB/s (SM100_NVLINK_BW, topo.h), 680-847 GB/s measured busbw: 720 GB/s.
    #   NIC: 4 x CX-7 400G per tray = one 400 Gb/s NIC per GPU (DGX GB200 User Guide),
    #     the same 46-48 GB/s achievable as on H100: 47 GB/s.
    #   Latencies and the channel cap as on H100 (B200 small-message latency is slightly
    #     above Hopper's, row 17; no GB200 IB sendrecv latency was found).
    "gb200-nvl72": Cluster("gb200-nvl72", gpus_per_node=4, domain_size=72,
                           nvlink_bw=720 * GB, nic_bw=47 * GB, nics_per_node=4,
                           nvlink_latency=4e-6, network_latency=15e-6,
                           net_channel_bw=21 * GB, net_channels_min=4, p2p_channels=32),
    # Cross-datacenter (issue 22): DGX H100 nodes in two sites, trainer in one and engines
    # in the other, each node joined to the other site by one 100 Gb/s Ethernet port.
    #   12.25 GB/s per direction: 12.5 GB/s line rate less RoCEv2 framing at a 4 KiB MTU
    #     (82 B of Ethernet, IP, UDP, BTH and ICRC per 4,096 B: 98.0%) [infer].
    #   250 us per message between sites: ~50 km of fiber at 5 us/km, one way [infer: a
    #     metro pair of datacenters; pass a cluster JSON for another distance].
    #   Inside a site: the dgx-h100 values.
    "xdc-h100": Cluster("xdc-h100", **_H100, site_bw=12.25 * GB, site_latency=250e-6),
}


def load_cluster(name_or_path: str | Path | Cluster) -> Cluster:
    """A preset by name (``dgx-h100``, ``hgx-h200``, ``gb200-nvl72``, ``xdc-h100``,
    ``localhost``) or a JSON file.

    The JSON holds ``Cluster``'s fields (``"name"`` optional; bandwidths in bytes/s, or
    GB/s under ``nvlink_gbps``, ``nic_gbps``, ``net_channel_gbps``, ``site_gbps``), or
    ``{"preset": NAME, ...overrides}``.

    Raises:
        ClusterError: unknown name, unreadable file, missing or unknown keys.
    """
    if isinstance(name_or_path, Cluster):
        return name_or_path
    text = str(name_or_path)
    if text in PRESETS:
        return PRESETS[text]
    if text == "localhost":
        path = localhost_path()
        if not path.exists():
            raise ClusterError(f"the localhost cluster is measured, not typed in: run "
                               f"python benchmarks/calibrate_localhost.py (it writes {path}), "
                               f"or pass --cluster FILE.json")
        return load_cluster(str(path))
    if not (text.endswith(".json") or "/" in text):
        raise ClusterError(f"unknown cluster {text!r}; presets are {', '.join(PRESETS)}, "
                           "localhost "
                           "(or pass the path of a JSON file with the Cluster fields)")
    try:
        data = json.loads(Path(text).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read cluster file {text!r}: {e}") from e
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {text!r} must hold a JSON object")
    preset = data.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ClusterError(f"{text}: unknown preset {preset!r}; presets are "
                               f"{', '.join(PRESETS)}")
        base = PRESETS[preset].to_dict()
        base.update({k: v for k, v in data.items() if not k.endswith("_gbps")})
        base.update({k: v for k, v in data.items() if k.endswith("_gbps")})
        for k in [k for k in base if k.endswith("_gbps")]:
            base.pop(k[:-5] + "_bw", None)
        data = base
    data.setdefault("name", Path(text).stem)
    return Cluster.from_dict(data, where=f"cluster file {text!r}")


def localhost_path() -> Path:
    """Where ``benchmarks/calibrate_localhost.py`` writes this machine's measured cluster
    (``$XDG_CACHE_HOME/xreshard/localhost.json``, else ``~/.cache/xreshard/...``), read
    by ``load_cluster("localhost")``."""
    import os
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xreshard" / "localhost.json"


# ---------------------------------------------------------------------------- placement

@dataclass(frozen=True, slots=True)
class Placement:
    """Where each world rank runs: ``domain[r]``, ``node[r]`` (global ids), ``gpu[r]``,
    the GPU's index in its node (which sets its NIC rail), and ``site[r]`` (a datacenter;
    empty: all in site 0).

    Two ranks share a GPU only if they share (node, gpu); such pairs copy locally.
    """

    domain: tuple[int, ...]
    node: tuple[int, ...]
    gpu: tuple[int, ...]
    site: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.domain)
        if len(self.node) != n or len(self.gpu) != n:
            raise ClusterError(f"placement lists {n} domains, {len(self.node)} nodes and "
                               f"{len(self.gpu)} GPUs; give one (domain, node, gpu) per rank")
        if self.site and len(self.site) != n:
            raise ClusterError(f"placement lists {len(self.site)} sites for {n} ranks; give "
                               "one per rank or none")
        node_domain: dict[int, int] = {}
        domain_site: dict[int, int] = {}
        for r, (d, nd, st) in enumerate(zip(self.domain, self.node, self.sites)):
            if node_domain.setdefault(nd, d) != d:
                raise ClusterError(f"placement: node {nd} is in domain {node_domain[nd]} "
                                   f"and in domain {d} (rank {r}); a node lies in one domain")
            if domain_site.setdefault(d, st) != st:
                raise ClusterError(f"placement: domain {d} is in site {domain_site[d]} and "
                                   f"in site {st} (rank {r}); a domain lies in one site")

    @property
    def sites(self) -> tuple[int, ...]:
        """The site of every rank (all 0 when the placement names none)."""
        return self.site or (0,) * len(self.domain)

    @property
    def num_ranks(self) -> int:
        return len(self.domain)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node))

    def check(self, cluster: Cluster, num_ranks: int) -> None:
        """Raise unless this placement covers ``num_ranks`` ranks on ``cluster``."""
        if self.num_ranks != num_ranks:
            raise ClusterError(f"the placement places {self.num_ranks} ranks but the refit "
                               f"has {num_ranks}; place every world rank")
        bad = [r for r, g in enumerate(self.gpu) if not 0 <= g < cluster.gpus_per_node]
        if bad:
            raise ClusterError(f"placement: rank {bad[0]} is on GPU {self.gpu[bad[0]]} but "
                               f"{cluster.name} nodes have GPUs 0..{cluster.gpus_per_node - 1}")
        per_domain: dict[int, set[int]] = {}
        for d, nd in zip(self.domain, self.node):
            per_domain.setdefault(d, set()).add(nd)
        for d, nodes in per_domain.items():
            if len(nodes) > cluster.nodes_per_domain:
                raise ClusterError(f"placement: domain {d} spans {len(nodes)} nodes but a "
                                   f"{cluster.name} NVLink domain holds "
                                   f"{cluster.nodes_per_domain}")

    def to_dict(self) -> dict[str, Any]:
        if self.site:
            return {"ranks": [list(x) for x in zip(self.domain, self.node, self.gpu,
                                                   self.site)]}
        return {"ranks": [[d, n, g] for d, n, g in zip(self.domain, self.node, self.gpu)]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "placement") -> Placement:
        """``{"ranks": [[domain, node, gpu(, site)], ...]}`` (by rank), or
        ``{"RANK": [domain, node, gpu(, site)] | {"domain", "node", "gpu"(, "site")}}``."""
        rows: list[Any]
        if isinstance(data, dict) and "ranks" in data:
            rows = list(data["ranks"])
        elif isinstance(data, dict):
            try:
                keyed = {int(k): v for k, v in data.items()}
            except ValueError as e:
                raise ClusterError(f"{where}: keys must be world ranks: {e}") from e
            if sorted(keyed) != list(range(len(keyed))):
                raise ClusterError(f"{where}: ranks {sorted(keyed)[:10]}... are not 0..N-1")
            rows = [keyed[r] for r in range(len(keyed))]
        elif isinstance(data, list):
            rows = data
        else:
            raise ClusterError(f"{where}: expected {{\"ranks\": [[domain, node, gpu], ...]}}")
        out = []
        for r, row in enumerate(rows):
            if isinstance(row, dict):
                row = [row.get(k) for k in ("domain", "node", "gpu", "site") if k in row]
            if not (isinstance(row, (list, tuple)) and len(row) in (3, 4)
                    and all(isinstance(x, int) for x in row)):
                raise ClusterError(f"{where}: rank {r} is {row!r}; expected [domain, node, "
                                   "gpu] or [domain, node, gpu, site] integers")
            out.append(tuple(row))
        if len({len(row) for row in out}) > 1:
            raise ClusterError(f"{where}: give a site for every rank or for none")
        return cls(*(tuple(c) for c in zip(*out))) if out else cls((), (), ())


def default_placement(cluster: Cluster, job_sizes: Sequence[int]) -> Placement:
    """Jobs side by side, ranks numbered job after job (as the recipes number them).

    Each job starts in a fresh NVLink domain and spreads evenly over the fewest domains
    that hold it (the first domains take one more rank when it does not divide); inside
    a domain its ranks fill whole nodes, GPU 0 first. On ``gb200-nvl72`` jobs of 128 and
    128 ranks::

        # ranks     | job | domain | ranks per domain | nodes (trays of 4)
        # 0..63     | 0   | 0      | 64               | 0..15
        # 64..127   | 0   | 1      | 64               | 18..33
        # 128..191  | 1   | 2      | 64               | 36..51
        # 192..255  | 1   | 3      | 64               | 54..69

    On a cluster of several sites (``site_bw > 0``: ``xdc-h100``) each job is in a site
    of its own.
    """
    domain, node, gpu, site = [], [], [], []
    next_domain = 0
    for job, size in enumerate(job_sizes):
        if size < 0:
            raise ClusterError(f"a job of {size} ranks")
        num = max(1, math.ceil(size / cluster.domain_size))
        base, extra = divmod(size, num)
        for k in range(num):
            d = next_domain + k
            for i in range(base + (k < extra)):
                domain.append(d)
                node.append(d * cluster.nodes_per_domain + i // cluster.gpus_per_node)
                gpu.append(i % cluster.gpus_per_node)
                site.append(job)
        next_domain += num
    return Placement(tuple(domain), tuple(node), tuple(gpu),
                     tuple(site) if cluster.site_bw > 0 else ())


def load_placement(path: str | Path) -> Placement:
    """A placement from a JSON file (see :meth:`Placement.from_dict`)."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read placement file {str(path)!r}: {e}") from e
    return Placement.from_dict(data, where=f"placement file {str(path)!r}")


_CUDA = re.compile(r"(?:cuda|gpu)[:_ ]?(\d+)", re.IGNORECASE)


def placement_of_world(world: Any) -> Placement:
    """The placement a live ``World`` reports about itself.

    Duck-typed on ``world.processes`` (one dict per process with ``host``, ``ranks`` and
    optionally ``devices`` and ``nvlink_clique``). The node is the host; the domain is
    the process's NVLink clique when it reported one (GB200 MNNVL: the rack), else its
    host (on CPU, and on GPUs whose NVLink stops at the box); the GPU index is the CUDA
    ordinal of the rank's device when it names one (``"cuda:3"``), else the rank's
    position among its host's ranks.
    """
    hosts: dict[str, int] = {}
    cliques: dict[Any, int] = {}
    per_host_count: dict[str, int] = {}
    rows: dict[int, tuple[int, int, int]] = {}
    for info in world.processes:
        host = str(info.get("host"))
        node = hosts.setdefault(host, len(hosts))
        clique = info.get("nvlink_clique")
        key = ("clique", str(clique)) if clique not in (None, "") else ("host", host)
        dom = cliques.setdefault(key, len(cliques))
        devices = list(info.get("devices") or [])
        for i, rank in enumerate(info["ranks"]):
            m = _CUDA.search(devices[i]) if i < len(devices) else None
            index = per_host_count.get(host, 0)
            per_host_count[host] = index + 1
            rows[int(rank)] = (dom, node, int(m.group(1)) if m else index)
    if sorted(rows) != list(range(len(rows))):
        raise ClusterError("the world's processes do not list ranks 0..N-1")
    ordered = [rows[r] for r in range(len(rows))]
    return Placement(*(tuple(c) for c in zip(*ordered))) if ordered else Placement((), (), ())
