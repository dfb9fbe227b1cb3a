"""How a world makes its transports: which kind moves each pair of ranks, and creating them.

``WorldTransports`` is the world's transport component (``World.transports``): it owns
the transports, what was gathered to choose them, and their life (abort, renew, park at an
epoch change, close); it reads the members from ``World.membership``. Creating any
transport but "local" is a collective: every process asks for the same kinds in the same
order, so every process reaches the same per-pair choice from the same gathered
capabilities (``transport.select.choose_routes``).
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Sequence, cast

from ..config import Tuning
from .commcount import CountedTransport
from .wire import WireThread
from .world_links import EpochLinks
from ..errors import RefitError
from .store import connect, parse_address
from ..transport.base import Transport
from ..transport.local import LocalTransport
from ..transport.routed import RenumberedTransport, RoutedTransport

if TYPE_CHECKING:
    from .world import World
    from .world_membership import Membership

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



class WorldTransports:
    """The transports of one world (``World.transports``), with their own state: the
    transports made so far (by kind, and wrapped for counting), the capabilities and
    routes gathered for the current member set, the communicators kept across epochs
    (``links``) and the tuning that says which fast paths this process offers.

    It reads the members from ``World.membership`` and runs its collectives through the
    world; it changes neither.
    """

    def __init__(self, world: World, tuning: Tuning):
        self._world = world
        self.tuning = tuning
        self.made: dict[str, Transport] = {}
        self.counted: dict[str, CountedTransport] = {}
        #: every process's capabilities and the routes chosen from them (per member set)
        self.caps: list[dict[str, Any]] | None = None
        self.chosen: Any = None
        self.links = EpochLinks(world)
        #: the executors' wire thread, kept across calls (ends with the transports)
        self.wire = WireThread()

    @property
    def _m(self) -> Membership:
        return self._world.membership

    @property
    def comm_steps(self) -> dict[str, str]:
        """What happened to this process's communicators since the last epoch change
        (or the join): gloo link key, or "nccl", -> the action taken ("keep", "shrink",
        "create", "recreate", "drop"; see ``comm_epochs``)."""
        return dict(self.links.steps)

    @property
    def comm_counts(self) -> dict[str, int]:
        """How many of this process's communicators each action touched since the world
        formed (cumulative, e.g. ``{"create": 3, "keep": 2, "drop": 1}``)."""
        return dict(self.links.counts)

    @property
    def cross_kind(self) -> str:
        """The transport that reaches every pair across processes: "nccl" when every rank
        is a CUDA rank, "gloo" when every rank is a CPU rank; a mixed world is refused
        (``select_backend``). Pairs with a fast path (``route``) bypass it."""
        from ..transport.select import select_backend
        return select_backend(self._m.rank_kind)

    def route(self, src_rank: int, dst_rank: int) -> str:
        """Which transport "auto" moves ``src_rank -> dst_rank`` with: "local" when one
        process hosts both; "shm" between CPU processes of one host, "cuda_ipc" between
        ranks on one GPU (or GPUs with peer access); else ``cross_kind``. The same answer
        in every process.

        Until ``transport("auto")`` (or "shm"/"cuda_ipc") probed what processes share,
        the answer is from the hosts alone: same-host CPU pairs say "shm", GPU pairs
        ``cross_kind``.
        """
        self._m.check_rank(src_rank)
        self._m.check_rank(dst_rank)
        if self.chosen is not None:
            return str(self.chosen.kind(src_rank, dst_rank))
        p, q = self._m.rank_process[src_rank], self._m.rank_process[dst_rank]
        if p == q:
            return "local"
        if (self._m.rank_kind[src_rank] == "cpu" and self._m.rank_kind[dst_rank] == "cpu"
                and self._m.infos[p]["host"] == self._m.infos[q]["host"]
                and self.cross_kind == "gloo"):
            return "shm"
        return self.cross_kind

    def routes(self, requested: str = "auto") -> Any:
        """The per-pair transport choice (``xreshard.transport.select.Routes``).

        The first call is a collective (every process publishes what it can share and
        probes the others); later calls reuse what it gathered.
        """
        from ..transport.select import choose_routes
        caps = self.caps
        if caps is None:
            caps = self.caps = self._gather_caps()
        return choose_routes(self._m.rank_process, self._m.rank_kind, caps, requested)

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
        enabled = self.tuning.shm
        pull_ok = enabled and self.tuning.shm_pull
        import numpy as np
        mark = np.frombuffer(token.encode(), np.uint8).copy()    # what peers pull to probe
        probe = None
        if enabled and any(self._m.rank_kind[r] == "cpu" for r in self._m.rank_ids):
            probe = shm_mod.create_probe(token)
        cuda: dict[str, Any] = {"cuda_devices": [], "cuda_reach": []}
        if any(self._m.rank_kind[r] == "cuda" for r in self._m.rank_ids):
            from ..transport.cuda_ipc import local_cuda_caps
            cuda = local_cuda_caps([cuda_ordinal(d) if device_kind(d) == "cuda" else None
                                    for d in self._m.devices])
        first: list[dict[str, Any]] = []
        me = self._m.process_index
        try:
            # shm_tag: the secret every segment name of this world starts with (process 0's)
            mine = {"token": token, "probe": probe is not None, "shm_tag": secrets.token_hex(8),
                    "mark": int(mark.ctypes.data) if pull_ok and probe is not None else None,
                    "start": peers_mod.own_start_time(), **cuda}
            first = self._world.allgather_json(mine)
            host = self._m.infos[me]["host"]
            near = [q for q in range(len(first)) if q != me and self._m.infos[q]["host"] == host]
            sees = [q for q in near if peers_mod.visible(
                self._m.infos[q]["pid"], first[q]["start"],
                shm_mod.probe_path(first[q]["token"]) if first[q]["probe"] else None)]
            reach = [q for q in near if q in sees and first[q]["probe"] and probe is not None
                     and shm_mod.read_probe(first[q]["token"])]
            pulls = [q for q in reach if first[q]["mark"] is not None and pull_ok
                     and shm_mod.can_pull(self._m.infos[q]["pid"], first[q]["mark"],
                                          first[q]["token"].encode())]
            second = self._world.allgather_json({"shm_reach": reach, "pull_reach": pulls,
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
            caps.append({"host": self._m.infos[q]["host"], "pid": self._m.infos[q]["pid"],
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
        self._world._ensure_open()
        counted = self.counted.get(kind)
        if counted is None:
            counted = self.counted[kind] = CountedTransport(self._made(kind))
            counted.wire_worker = self.wire
        # it forwards every member of the protocol; its ``name`` is a read-only property,
        # which the protocol's plain attribute does not express
        return cast(Transport, counted)

    def abort(self, why: str) -> None:
        """This process failed in the middle of a refit's move: make its peers' waits on it
        fail now, not at their timeout (shm, cuda_ipc: the failure is published where their
        watchers look; gloo: its sockets close). Each such transport is unusable afterwards:
        the refit's outcome, which every process reaches, has them made again
        (``renew``, or a new epoch). NCCL communicators are left as they are."""
        for kind, t in list(self.made.items()):
            abort = getattr(t, "abort", None)
            if kind == "auto" or abort is None:
                continue        # "auto" is a view of the others
            try:
                abort(why)
            except Exception:   # noqa: BLE001 - the call's own error is what is raised
                logger.warning("world %r: aborting its %s transport failed", self._world.world_id,
                               kind, exc_info=True)
        # a gloo group's pairs close only once nothing holds its context: the failed
        # call's works may still be held by a traceback in a reference cycle (and the
        # call pauses the cyclic collector): collect them now, once
        import gc
        gc.collect()

    def renew(self) -> None:
        """Close every transport of this process; the next ``transport()`` makes them again
        (a collective, as at first). Every process calls it at the same step (after a
        refit whose outcome failed), so their transports are made anew together."""
        self.close()

    def park(self) -> None:
        """At an epoch change: keep the communicators the next epoch may keep
        (``links``), close every other transport."""
        self.links.park(self.made)
        self.close()

    def close(self) -> None:
        """Close every transport made (not the parked links: ``links.close``), and forget
        what was gathered for this member set."""
        for kind, t in self.made.items():
            if kind == "auto":
                continue        # a view of the others
            try:
                t.close()
            except Exception:   # noqa: BLE001 - the others still close (and their threads end)
                logger.warning("world %r: closing its %s transport failed",
                               self._world.world_id, kind, exc_info=True)
        self.made.clear()
        self.counted.clear()
        self.caps = self.chosen = None
        self.wire.stop()
        self.wire = WireThread()        # started by the next call, if any (renew, a new epoch)

    def _made(self, kind: str) -> Transport:
        """The transport of ``kind`` itself (not wrapped for counting), created once."""
        cached = self.made.get(kind)
        if cached is not None:
            return cached
        if kind == "local":
            made: Transport = LocalTransport(self._m.rank_ids)
        elif kind == "gloo":
            made = self._make_gloo()
        elif kind == "auto":
            if self._world.num_processes == 1:
                # every pair is local; and NCCL refuses two ranks on one GPU anyway
                made = self._made("local")
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
        self.made[kind] = made
        return made

    def _make_auto(self) -> Transport:
        routes = self.routes("auto")
        self.chosen = routes
        parts = {}
        for k in routes.kinds:
            if k == "nccl" and "cuda_ipc" in routes.kinds:
                # some GPU pairs take IPC: NCCL gets only the ranks that need it between
                # groups, so an engine sharing a GPU with its trainer (IPC) does not make
                # NCCL refuse the communicator the trainer shares with a remote engine
                groups = [info["group"] for info in self._m.infos]
                parts[k] = self.made["nccl"] = self._make_nccl_among(
                    routes.ranks_using("nccl", groups), routes)
            elif k != "local":
                parts[k] = self._made(k)
        parts["local"] = self._made("local")
        made = RoutedTransport(parts, routes.kind, self._m.rank_ids)
        logger.info("world %r: transport %s", self._world.world_id, made.name)
        return made

    def _make_shm(self) -> Transport:
        from ..transport.shm import ShmTransport

        routes, peers, pids, prefix, labels = self._peer_setup("shm")
        caps, me = self.caps, self._m.process_index
        assert caps is not None         # gathered by routes() in _peer_setup
        # both ways, so that sender and receiver agree on every message's path
        pulls = [q for q in peers if q in caps[me]["pull_reach"] and me in caps[q]["pull_reach"]]
        return ShmTransport(self._world._store, f"{prefix}/shm", caps[0]["shm_tag"],
                            self._m.rank_process, me, peers, pids=pids, process_labels=labels,
                            connect=self._store_client, pull_peers=pulls, seal=self._world._seal)

    def _peer_setup(self, kind: str) -> tuple[Any, list[int], dict, str, list[str]]:
        """What a same-host transport of ``kind`` (shm, cuda_ipc) is built from: the routes,
        this process's peers over it, their (pid, start time), a fresh store prefix (a
        collective step: every process takes one) and every process's label.

        Only peers that each side sees as the same process (``sees``, both ways) get a
        pid: the dead-peer watcher is armed for them alone; others are waited for until
        the timeout (another pid namespace shows another process, or none, at that pid).
        """
        routes = self.routes("auto")
        caps = self.caps
        assert caps is not None         # routes() gathered them
        me = self._m.process_index
        peers = routes.peers(me, kind)
        pids = {q: (caps[q]["pid"], caps[q]["start"]) for q in peers
                if q in caps[me].get("sees", ()) and me in caps[q].get("sees", ())}
        prefix = self._world._next_prefix()
        labels = [self._world.describe_process(p) for p in range(self._world.num_processes)]
        return routes, peers, pids, prefix, labels

    def _store_client(self) -> Any:
        """Another client of the world's store, for a transport's helper thread (a client
        blocked in ``wait`` serves nobody else)."""
        return connect(self._world.address, self._world.timeout)

    def _make_cuda_ipc(self) -> Transport:
        from ..transport.cuda_ipc import CudaIpcTransport

        routes, peers, pids, prefix, labels = self._peer_setup("cuda_ipc")
        me = self._m.process_index
        devices = {r: cuda_ordinal(self._m.devices[i]) for i, r in enumerate(self._m.rank_ids)
                   if self._m.rank_kind[r] == "cuda"}
        return CudaIpcTransport(self._world._store, f"{prefix}/ipc", self._m.rank_process, me,
                                peers, devices, pids=pids, process_labels=labels,
                                can_reach=routes.ipc_ok, connect=self._store_client,
                                seal=self._world._seal)

    def _make_nccl(self) -> Transport:
        """One NCCL communicator over every rank (collective, like gloo)."""
        from ..transport.nccl import NcclTransport
        from ..transport.select import select_backend

        select_backend(self._m.rank_kind, "nccl")       # refuses CPU ranks, naming them
        prefix = self._world._next_prefix()
        devices = {r: cuda_ordinal(self._m.devices[i]) for i, r in enumerate(self._m.rank_ids)}
        if self._m.elastic:       # kept or shrunk across epochs (world_links.py)
            return self.links.nccl_epoch(prefix, tuple(range(self._world.num_ranks)), devices)
        return NcclTransport(self._world._store, self._world.num_ranks, devices,
                             key=f"{prefix}/nccl", timeout=self._world._wait_seconds())

    def _make_nccl_among(self, members: Sequence[int], routes: Any) -> Transport:
        """An NCCL communicator over ``members`` only (world ranks, ascending), renumbered
        0..len-1 (collective over the whole world: every process advances the prefix; only
        processes with members join NCCL)."""
        from ..transport.nccl import NcclTransport

        prefix = self._world._next_prefix()
        by_device: dict[Any, int] = {}
        for r in members:
            dev = routes.rank_device[r]
            if dev is not None and dev in by_device:
                self._refuse_shared_gpu(by_device[dev], r, dev)
            by_device[dev] = r
        if self._m.elastic:
            return self.links.nccl_epoch(prefix, tuple(members), {
                r: cuda_ordinal(self._m.devices[i]) for i, r in enumerate(self._m.rank_ids)})
        index = {r: i for i, r in enumerate(members)}
        mine = {index[r]: cuda_ordinal(self._m.devices[i])
                for i, r in enumerate(self._m.rank_ids) if r in index}
        if not mine:
            return RenumberedTransport(None, index, "nccl")
        inner = NcclTransport(self._world._store, len(members), mine, key=f"{prefix}/nccl",
                              timeout=self._world._wait_seconds())
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

        if self._m.elastic:       # links, kept across epochs (world_links.py)
            return self.links.make_links()
        prefix = self._world._next_prefix()
        # gloo's own rendezvous cannot say who is missing; a barrier first can.
        self._world.barrier()
        store_host, _ = parse_address(self._world.address)
        seconds = self._world._wait_seconds()
        # gloo's rendezvous reads peers' addresses through the store with the store's own
        # timeout (the join's, minutes): cut it to this wait, or a peer that died here
        # holds the others for the whole join timeout
        self._world._store.set_timeout(datetime.timedelta(seconds=seconds))
        try:
            pg = create_gloo_group(self._world._store, f"{prefix}/gloo/",
                                   rank=self._m.process_index, size=self._world.num_processes,
                                   timeout=seconds, store_host=store_host)
        finally:
            self._world._store.set_timeout(datetime.timedelta(seconds=self._world.timeout))
        labels = [self._world.describe_process(p) for p in range(self._world.num_processes)]
        return GlooTransport(pg, rank_process=self._m.rank_process,
                             process_index=self._m.process_index, process_labels=labels)

