"""How a world makes its transports: which kind moves each pair of ranks, and creating them.

``World`` inherits these methods (this module keeps world.py about joining and metadata
collectives). Creating any transport but "local" is a collective: every process asks for
the same kinds in the same order, so every process reaches the same per-pair choice from
the same gathered capabilities (``transport.select.choose_routes``).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Sequence

from .commcount import CountedTransport
from .world_links import WorldLinks
from ..errors import RefitError
from .store import connect, parse_address
from ..transport.base import Transport
from ..transport.local import LocalTransport
from ..transport.routed import RenumberedTransport, RoutedTransport

__all__ = ["WorldTransports", "cuda_ordinal", "device_kind"]

logger = logging.getLogger("xreshard.runtime.world")


def device_kind(device: Any) -> str:
    """"cpu" / "cuda" / ... for a JAX device, a torch device or a device string."""
    platform = getattr(device, "platform", None)         # jax.Device
    if isinstance(platform, str):
        return "cuda" if platform == "gpu" else platform
    kind = getattr(device, "type", None)                 # torch.device
    if isinstance(kind, str):
        return kind
    if isinstance(device, str):
        return device.split(":", 1)[0]
    raise ValueError(f"cannot tell the kind of device {device!r}: pass JAX devices, torch "
                     f"devices, strings like 'cuda:0', or an int count of CPU ranks")


def cuda_ordinal(device: Any) -> int:
    """The CUDA device ordinal of a JAX device, a torch device or a "cuda:N" string."""
    for attr in ("local_hardware_id", "index"):
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    if isinstance(device, str) and ":" in device:
        return int(device.split(":", 1)[1])
    return 0



class WorldTransports(WorldLinks):
    """The transport half of ``World`` (a mixin: it uses the world's processes, ranks,
    store and collectives)."""

    @property
    def cross_kind(self) -> str:
        """The transport that reaches every pair across processes: "nccl" when every rank
        is a CUDA rank, "gloo" when every rank is a CPU rank; a mixed world is refused
        (``select_backend``). Pairs with a fast path (``route``) bypass it."""
        from ..transport.select import select_backend
        return select_backend(self._rank_kind)

    def route(self, src_rank: int, dst_rank: int) -> str:
        """Which transport "auto" moves ``src_rank -> dst_rank`` with: "local" when one
        process hosts both; "shm" between CPU processes of one host, "cuda_ipc" between
        ranks on one GPU (or GPUs with peer access); else ``cross_kind``. The same answer
        in every process.

        Until ``transport("auto")`` (or "shm"/"cuda_ipc") probed what processes share,
        the answer is from the hosts alone: same-host CPU pairs say "shm", GPU pairs
        ``cross_kind``.
        """
        self._check_rank(src_rank)
        self._check_rank(dst_rank)
        routes = getattr(self, "_routes", None)
        if routes is not None:
            return routes.kind(src_rank, dst_rank)
        p, q = self._rank_process[src_rank], self._rank_process[dst_rank]
        if p == q:
            return "local"
        if (self._rank_kind[src_rank] == "cpu" and self._rank_kind[dst_rank] == "cpu"
                and self._infos[p]["host"] == self._infos[q]["host"]
                and self.cross_kind == "gloo"):
            return "shm"
        return self.cross_kind

    def routes(self, requested: str = "auto") -> Any:
        """The per-pair transport choice (``xreshard.transport.select.Routes``).

        The first call is a collective (every process publishes what it can share and
        probes the others); later calls reuse what it gathered.
        """
        from ..transport.select import choose_routes
        caps = getattr(self, "_caps", None)
        if caps is None:
            caps = self._caps = self._gather_caps()
        return choose_routes(self._rank_process, self._rank_kind, caps, requested)

    def _gather_caps(self) -> list[dict[str, Any]]:
        """Every process's capabilities (collective: two JSON all-gathers).

        Each process with CPU ranks publishes a token in a tiny shared-memory probe; every
        process then says which same-host probes it could read and which same-host
        processes it can see as themselves (``sees``: the pid the peer published, with the
        start time it published, in this process's ``/proc``), so a pair takes shm only
        when both sides can open each other's segments *and* see each other's process:
        containers that share ``/dev/shm`` but not a pid namespace would otherwise watch a
        stranger's pid for liveness (see ``transport.peers.visible``). CUDA processes
        publish the uuid of each rank's device and those they can reach by peer access.
        """
        import secrets
        from ..transport import peers as peers_mod
        from ..transport import shm as shm_mod

        token = secrets.token_hex(8)
        off = ("0", "false", "off")
        enabled = os.environ.get("XRESHARD_SHM", "1") not in off
        pull_ok = enabled and os.environ.get("XRESHARD_SHM_PULL", "1") not in off
        import numpy as np
        mark = np.frombuffer(token.encode(), np.uint8).copy()    # what peers pull to probe
        probe = None
        if enabled and any(self._rank_kind[r] == "cpu" for r in self._rank_ids):
            probe = shm_mod.create_probe(token)
        cuda: dict[str, Any] = {"cuda_devices": [], "cuda_reach": []}
        if any(self._rank_kind[r] == "cuda" for r in self._rank_ids):
            from ..transport.cuda_ipc import local_cuda_caps
            cuda = local_cuda_caps([cuda_ordinal(d) if device_kind(d) == "cuda" else None
                                    for d in self._devices])
        first: list[dict[str, Any]] = []
        me = self._process_index
        try:
            # shm_tag: the secret every segment name of this world starts with (process 0's)
            mine = {"token": token, "probe": probe is not None, "shm_tag": secrets.token_hex(8),
                    "mark": int(mark.ctypes.data) if pull_ok and probe is not None else None,
                    "start": peers_mod.own_start_time(), **cuda}
            first = self.allgather_json(mine)
            host = self._infos[me]["host"]
            near = [q for q in range(len(first)) if q != me and self._infos[q]["host"] == host]
            sees = [q for q in near if peers_mod.visible(
                self._infos[q]["pid"], first[q]["start"],
                shm_mod.probe_path(first[q]["token"]) if first[q]["probe"] else None)]
            reach = [q for q in near if q in sees and first[q]["probe"] and probe is not None
                     and shm_mod.read_probe(first[q]["token"])]
            pulls = [q for q in reach if first[q]["mark"] is not None and pull_ok
                     and shm_mod.can_pull(self._infos[q]["pid"], first[q]["mark"],
                                          first[q]["token"].encode())]
            second = self.allgather_json({"shm_reach": reach, "pull_reach": pulls,
                                          "sees": sees})
        except BaseException:
            # a peer that died after publishing its token cannot remove its probe
            for c in first:
                if c.get("probe"):
                    shm_mod.remove_shm(shm_mod.probe_name(c["token"]))
            raise
        finally:
            if probe is not None:
                probe.unlink()
                probe.close()
        caps = []
        for q, (c, r) in enumerate(zip(first, second)):
            caps.append({"host": self._infos[q]["host"], "pid": self._infos[q]["pid"],
                         "start": c["start"], "token": c["token"], "shm_tag": c["shm_tag"],
                         "shm_reach": r["shm_reach"], "pull_reach": r["pull_reach"],
                         "sees": r["sees"], "cuda_devices": c["cuda_devices"],
                         "cuda_reach": c["cuda_reach"]})
        return caps

    def transport(self, kind: str = "auto") -> Transport:
        """The transport of ``kind``, created on first use and cached.

        Args:
            kind: "local" (copies between this process's ranks), "gloo" (a private gloo
                group over all processes), "nccl", "shm" (shared memory with the
                processes of this host), "cuda_ipc" (CUDA IPC between ranks on one GPU or
                peer-accessible GPUs), or "auto": one ``RoutedTransport`` that sends each
                pair through ``route(src, dst)`` and counts bytes per kind.

        Creating anything but "local" is a collective: every process must ask for it, in
        the same order relative to the other collectives. "auto" probes what processes
        share (``routes``) and creates exactly the kinds some pair needs (the same kinds
        in every process); a world whose pairs all share memory never builds gloo.

        What it returns reports to ``xreshard.count_comm()`` counters (a
        :class:`~xreshard.runtime.commcount.CountedTransport` around the cached transport).
        """
        self._ensure_open()
        counted = self._counted.get(kind)
        if counted is None:
            counted = self._counted[kind] = CountedTransport(self._made_transport(kind))
        return counted

    def abort_transports(self, why: str) -> None:
        """This process failed in the middle of a refit's move: make its peers' waits on it
        fail now, not at their timeout (shm, cuda_ipc: the failure is published where their
        watchers look; gloo: its sockets close). Each such transport is unusable afterwards:
        the refit's outcome, which every process reaches, has them made again
        (``renew_transports``, or a new epoch). NCCL communicators are left as they are."""
        for kind, t in list(self._transports.items()):
            abort = getattr(t, "abort", None)
            if kind == "auto" or abort is None:
                continue        # "auto" is a view of the others
            try:
                abort(why)
            except Exception:   # noqa: BLE001 - the call's own error is what is raised
                logger.warning("world %r: aborting its %s transport failed", self._world_id,
                               kind, exc_info=True)
        # a gloo group's pairs close only once nothing holds its context: the failed
        # call's works may still be held by a traceback in a reference cycle (and the
        # call pauses the cyclic collector): collect them now, once
        import gc
        gc.collect()

    def renew_transports(self) -> None:
        """Close every transport of this process; the next ``transport()`` makes them again
        (a collective, as at first). Every process calls it at the same step (after a
        refit whose outcome failed), so their transports are made anew together."""
        self._close_transports()

    def _made_transport(self, kind: str) -> Transport:
        """The transport of ``kind`` itself (not wrapped for counting), created once."""
        cached = self._transports.get(kind)
        if cached is not None:
            return cached
        if kind == "local":
            made: Transport = LocalTransport(self._rank_ids)
        elif kind == "gloo":
            made = self._make_gloo()
        elif kind == "auto":
            if self.num_processes == 1:
                # every pair is local; and NCCL refuses two ranks on one GPU anyway
                made = self._made_transport("local")
            else:
                made = self._make_auto()
        elif kind == "nccl":
            made = self._make_nccl()
        elif kind == "shm":
            made = self._make_shm()
        elif kind == "cuda_ipc":
            made = self._make_cuda_ipc()
        else:
            raise RefitError(f"unknown transport kind {kind!r}: expected 'auto', 'local', "
                             f"'gloo', 'nccl', 'shm' or 'cuda_ipc'")
        self._transports[kind] = made
        return made

    def _make_auto(self) -> Transport:
        routes = self.routes("auto")
        self._routes = routes
        parts = {}
        for k in routes.kinds:
            if k == "nccl" and "cuda_ipc" in routes.kinds:
                # some GPU pairs take IPC: NCCL gets only the ranks that need it between
                # groups, so an engine sharing a GPU with its trainer (IPC) does not make
                # NCCL refuse the communicator the trainer shares with a remote engine
                groups = [info["group"] for info in self._infos]
                parts[k] = self._transports["nccl"] = self._make_nccl_among(
                    routes.ranks_using("nccl", groups), routes)
            elif k != "local":
                parts[k] = self._made_transport(k)
        parts["local"] = self._made_transport("local")
        made = RoutedTransport(parts, routes.kind, self._rank_ids)
        logger.info("world %r: transport %s", self._world_id, made.name)
        return made

    def _make_shm(self) -> Transport:
        from ..transport.shm import ShmTransport

        routes, peers, pids, prefix, labels = self._peer_setup("shm")
        caps, me = self._caps, self._process_index
        # both ways, so that sender and receiver agree on every message's path
        pulls = [q for q in peers if q in caps[me]["pull_reach"] and me in caps[q]["pull_reach"]]
        return ShmTransport(self._store, f"{prefix}/shm", caps[0]["shm_tag"], self._rank_process,
                            me, peers, pids=pids, process_labels=labels,
                            connect=self._store_client, pull_peers=pulls, seal=self._seal)

    def _peer_setup(self, kind: str) -> tuple[Any, list[int], dict, str, list[str]]:
        """What a same-host transport of ``kind`` (shm, cuda_ipc) is built from: the routes,
        this process's peers over it, their (pid, start time), a fresh store prefix (a
        collective step: every process takes one) and every process's label.

        Only peers that each side sees as the same process (``sees``, both ways) get a
        pid: the dead-peer watcher is armed for them alone; others are waited for until
        the timeout (another pid namespace shows another process, or none, at that pid).
        """
        routes = self.routes("auto")
        caps = self._caps
        me = self._process_index
        peers = routes.peers(me, kind)
        pids = {q: (caps[q]["pid"], caps[q]["start"]) for q in peers
                if q in caps[me].get("sees", ()) and me in caps[q].get("sees", ())}
        prefix = self._next_prefix()
        labels = [self.describe_process(p) for p in range(self.num_processes)]
        return routes, peers, pids, prefix, labels

    def _store_client(self) -> Any:
        """Another client of the world's store, for a transport's helper thread (a client
        blocked in ``wait`` serves nobody else)."""
        return connect(self._address, self._timeout)

    def _make_cuda_ipc(self) -> Transport:
        from ..transport.cuda_ipc import CudaIpcTransport

        routes, peers, pids, prefix, labels = self._peer_setup("cuda_ipc")
        me = self._process_index
        devices = {r: cuda_ordinal(self._devices[i]) for i, r in enumerate(self._rank_ids)
                   if self._rank_kind[r] == "cuda"}
        return CudaIpcTransport(self._store, f"{prefix}/ipc", self._rank_process, me, peers,
                                devices, pids=pids, process_labels=labels,
                                can_reach=routes.ipc_ok, connect=self._store_client,
                                seal=self._seal)

    def _make_nccl(self) -> Transport:
        """One NCCL communicator over every rank (collective, like gloo)."""
        from ..transport.nccl import NcclTransport
        from ..transport.select import select_backend

        select_backend(self._rank_kind, "nccl")       # refuses CPU ranks, naming them
        prefix = self._next_prefix()
        devices = {r: cuda_ordinal(self._devices[i]) for i, r in enumerate(self._rank_ids)}
        if self._elastic is not None:       # kept or shrunk across epochs (world_links.py)
            return self._nccl_epoch(prefix, tuple(range(self.num_ranks)), devices)
        return NcclTransport(self._store, self.num_ranks, devices, key=f"{prefix}/nccl",
                             timeout=self._wait_seconds())

    def _make_nccl_among(self, members: Sequence[int], routes: Any) -> Transport:
        """An NCCL communicator over ``members`` only (world ranks, ascending), renumbered
        0..len-1 (collective over the whole world: every process advances the prefix; only
        processes with members join NCCL)."""
        from ..transport.nccl import NcclTransport

        prefix = self._next_prefix()
        by_device: dict[Any, int] = {}
        for r in members:
            dev = routes.rank_device[r]
            if dev is not None and dev in by_device:
                self._refuse_shared_gpu(by_device[dev], r, dev)
            by_device[dev] = r
        if self._elastic is not None:
            return self._nccl_epoch(prefix, tuple(members), {
                r: cuda_ordinal(self._devices[i]) for i, r in enumerate(self._rank_ids)})
        index = {r: i for i, r in enumerate(members)}
        mine = {index[r]: cuda_ordinal(self._devices[i])
                for i, r in enumerate(self._rank_ids) if r in index}
        if not mine:
            return RenumberedTransport(None, index, "nccl")
        inner = NcclTransport(self._store, len(members), mine, key=f"{prefix}/nccl",
                              timeout=self._wait_seconds())
        return RenumberedTransport(inner, index, "nccl")

    @staticmethod
    def _refuse_shared_gpu(a: int, b: int, dev: Any) -> None:
        """Ranks ``a`` and ``b`` share GPU ``dev`` and both need NCCL: fine where this
        process's NCCL takes several ranks of one GPU (2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1,
        which every process must set alike), else refused with what it would take."""
        from ..transport.nccl_setup import import_cupy, multi_rank_gpu
        try:
            _, nccl = import_cupy()
            version = int(nccl.get_version())
        except ImportError:
            version = 0
        ok, why = multi_rank_gpu(version)
        if not ok:
            raise RefitError(f"ranks {a} and {b} share GPU {dev} and both need NCCL for pairs "
                             f"without an IPC path; {why} - or keep each colocated rank's "
                             f"peers reachable by cuda_ipc")

    def _make_gloo(self) -> Transport:
        from ..transport.gloo import GlooTransport, create_gloo_group

        if self._elastic is not None:       # links, kept across epochs (world_links.py)
            return self._make_links()
        prefix = self._next_prefix()
        # gloo's own rendezvous cannot say who is missing; a barrier first can.
        self.barrier()
        store_host, _ = parse_address(self._address)
        seconds = self._wait_seconds()
        # gloo's rendezvous reads peers' addresses through the store with the store's own
        # timeout (the join's, minutes): cut it to this wait, or a peer that died here
        # holds the others for the whole join timeout
        self._store.set_timeout(datetime.timedelta(seconds=seconds))
        try:
            pg = create_gloo_group(self._store, f"{prefix}/gloo/", rank=self._process_index,
                                   size=self.num_processes, timeout=seconds,
                                   store_host=store_host)
        finally:
            self._store.set_timeout(datetime.timedelta(seconds=self._timeout))
        labels = [self.describe_process(p) for p in range(self.num_processes)]
        return GlooTransport(pg, rank_process=self._rank_process, process_index=self._process_index,
                             process_labels=labels)

