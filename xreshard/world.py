"""The refit world: which processes joined, which ranks each hosts, and metadata collectives.

Processes meet through a ``torch.distributed.TCPStore`` used stand-alone: xreshard never
creates or touches torch's default process group, so a world coexists with the trainer's
and the inference engine's own groups. Everything that crosses processes here is JSON.

A launcher (or the first process) holds the store server::

    server = xreshard.world.serve()            # port 0: the OS picks a free port
    # hand server.address ("tcp://127.0.0.1:41234") to every process, then in each:
    world = World.join(server.address, "trainer", jax.local_devices(),
                       num_processes=3, index=jax.process_index())
    transport = world.transport()              # local copies + gloo across processes

Every collective (``allgather_json``, ``broadcast_json``, ``barrier``, creating the gloo
transport) uses a fresh key prefix from a per-world counter that every process advances
identically, so all processes must call them in the same order. Every wait is bounded; a
timeout raises ``TransportTimeout`` naming the processes that never arrived.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Iterator, Mapping, Sequence

from .errors import RefitError
from .topology import Topology
from .transport.base import Transport, TransportError, TransportTimeout, _nbytes
from .transport.local import LocalTransport

__all__ = ["StoreServer", "World", "RoutedTransport", "serve", "parse_address"]

logger = logging.getLogger(__name__)

_KEY_ROOT = "xreshard"


def _tcp_store_class() -> Any:
    try:
        from torch.distributed import TCPStore
    except ImportError as e:
        raise ImportError("the refit world rendezvous needs PyTorch's TCPStore: "
                          "pip install 'xreshard[torch]'") from e
    return TCPStore


def parse_address(address: str) -> tuple[str, int]:
    """``"tcp://host:port"``, ``"host:port"`` or ``"tcp://[::1]:port"`` -> ``(host, port)``."""
    rest = address[len("tcp://"):] if address.startswith("tcp://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store address {address!r} is not 'tcp://host:port'")
    return host.strip("[]"), int(port)


def _format_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class StoreServer:
    """Holds the master ``TCPStore`` every process of a world joins through.

    Keep it alive (and its process running) until every process has closed its world.

    Attributes:
        host: the host it listens on.
        port: the port it got (the OS picks one when asked for port 0).
        address: ``"tcp://host:port"``, what to pass to ``World.join``.
        store: the master ``TCPStore`` itself.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 300.0):
        tcp_store = _tcp_store_class()
        self.store = tcp_store(host, port, None, True, datetime.timedelta(seconds=timeout),
                               wait_for_workers=False)
        self.host = host
        self.port = int(self.store.port)
        self.address = _format_address(host, self.port)

    def close(self) -> None:
        """Stop serving (drops the store; clients still connected then fail)."""
        self.store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreServer(address={self.address!r})"


def serve(host: str = "127.0.0.1", port: int = 0, *, timeout: float = 300.0) -> StoreServer:
    """Start a rendezvous store server; ``port=0`` (the default) lets the OS pick a free port.

    Args:
        host: the interface to listen on ("0.0.0.0" for other hosts to reach it).
        port: the port; 0 for a free one (read it back from ``.port`` / ``.address``).
        timeout: default timeout of the server's own store operations, in seconds.

    Returns:
        The running ``StoreServer``.
    """
    return StoreServer(host, port, timeout=timeout)


def _device_kind(device: Any) -> str:
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


def _cuda_ordinal(device: Any) -> int:
    """The CUDA device ordinal of a JAX device, a torch device or a "cuda:N" string."""
    for attr in ("local_hardware_id", "index"):
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    if isinstance(device, str) and ":" in device:
        return int(device.split(":", 1)[1])
    return 0


def _default_index(devices: Any) -> int:
    """The process index within its group when the framework makes it unambiguous."""
    if not isinstance(devices, int) and devices and hasattr(devices[0], "platform"):
        jax = sys.modules.get("jax")
        if jax is not None and jax.process_count() > 1:
            return int(jax.process_index())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    raise RefitError("World.join needs index= (this process's position within its group): "
                     "it is only inferred from a multi-process JAX job (jax.process_index()) "
                     "or an initialized torch.distributed (its rank)")


def _group_key(groups: Sequence[str] | None) -> Any:
    if groups is None:
        return lambda info: (info["group"], info["index"])
    order = {g: i for i, g in enumerate(groups)}
    return lambda info: (order[info["group"]], info["index"])


def _label(info: Mapping[str, Any]) -> str:
    return f"{info['group']}[{info['index']}]"


class World:
    """The processes of one refit and the world ranks each one hosts.

    Build it with ``World.join`` in every process. Rank numbering (the same in every
    process, independent of arrival order, pids or ports):

    1. processes are ordered by group (the order of ``groups`` when given, else sorted
       group names), then by ``index`` within the group; that order is the process
       position (``process_index``);
    2. ranks are numbered 0..N-1 through the processes in that order, each process's
       ranks in its local device order.

    Three processes, ``groups=None`` (sorted names: "rollout" < "trainer")::

        # process (group[index]) | devices | position | ranks
        # rollout[0]             | 1       | 0        | 0
        # rollout[1]             | 1       | 1        | 1
        # trainer[0]             | 4       | 2        | 2, 3, 4, 5

    The same processes with ``groups=("trainer", "rollout")``::

        # trainer[0]             | 4       | 0        | 0, 1, 2, 3
        # rollout[0]             | 1       | 1        | 4
        # rollout[1]             | 1       | 2        | 5
    """

    def __init__(self, *, store: Any, server: StoreServer | None, address: str,
                 world_id: str, timeout: float, infos: list[dict[str, Any]],
                 process_index: int, devices: Sequence[Any]):
        self._store = store
        self._server = server
        self._address = address
        self._world_id = world_id
        self._root = f"{_KEY_ROOT}/{world_id}"
        self._timeout = float(timeout)
        self._infos = infos
        self._process_index = process_index
        self._devices = tuple(devices)
        self._num_ops = 0
        self._transports: dict[str, Transport] = {}
        self._closed = False
        rank_process: list[int] = []
        kinds: list[str] = []
        for pos, info in enumerate(infos):
            rank_process.extend([pos] * info["num_ranks"])
            kinds.extend(info["device_kinds"])
        self._rank_process = tuple(rank_process)
        self._rank_kind = tuple(kinds)
        self._rank_ids = tuple(infos[process_index]["ranks"])
        self._local = frozenset(self._rank_ids)
        self._topology = Topology.of({r: (p, infos[p]["host"])
                                      for r, p in enumerate(rank_process)})

    # ------------------------------------------------------------------ joining

    @classmethod
    def join(cls, address: str, group: str, devices: Sequence[Any] | int, *,
             num_processes: int, index: int | None = None,
             groups: Sequence[str] | None = None, host: str | None = None,
             timeout: float = 300.0, world_id: str = "default",
             is_server: bool = False) -> World:
        """Join a world; returns once all ``num_processes`` processes have joined.

        Args:
            address: the store, ``"tcp://host:port"`` (``StoreServer.address``).
            group: this process's group, e.g. ``"trainer"`` or ``"rollout"``.
            devices: this process's local devices, one world rank each, in order (JAX
                devices, torch devices, strings like ``"cuda:0"``), or an int count of
                CPU ranks.
            num_processes: how many processes join, over all groups.
            index: this process's position within its group (0..). Inferred only from a
                multi-process JAX job or an initialized torch.distributed.
            groups: the group order for rank numbering; default sorted group names. Every
                process must pass the same value.
            host: the host name published for the topology; default ``socket.gethostname()``.
            timeout: seconds to wait for the others (and the default of every later wait).
            world_id: distinguishes several worlds on one store; unique per store.
            is_server: host the store in this process at ``address`` (its port must be
                free and known to the others, so launchers should prefer ``serve()``).

        Returns:
            The joined world.

        Raises:
            TransportTimeout: not every process joined within ``timeout``; names those that did.
            RefitError: processes disagree (two with one group and index, different
                ``num_processes`` or ``groups``), or too many joined.
        """
        if not isinstance(group, str) or not group:
            raise RefitError(f"group must be a non-empty string, got {group!r}")
        if num_processes < 1:
            raise RefitError(f"num_processes must be >= 1, got {num_processes}")
        if groups is not None:
            groups = list(groups)
            if group not in groups:
                raise RefitError(f"group {group!r} is not in groups={groups}; "
                                 f"add it or pass groups=None for sorted group names")
        if isinstance(devices, int):
            if devices < 0:
                raise RefitError(f"devices must be a device list or a count >= 0, got {devices}")
            local_devices: list[Any] = ["cpu"] * devices
        else:
            local_devices = list(devices)
        if index is None:
            index = _default_index(local_devices)
        kinds = [_device_kind(d) for d in local_devices]

        host_name, port = parse_address(address)
        server = None
        tcp_store = _tcp_store_class()
        try:
            if is_server:
                server = StoreServer(host_name, port, timeout=timeout)
                store, address = server.store, server.address
            else:
                store = tcp_store(host_name, port, None, False,
                                  datetime.timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, TimeoutError) as e:
            raise TransportTimeout(f"could not reach the rendezvous store at {address} "
                                   f"within {timeout} s: {e}") from e

        root = f"{_KEY_ROOT}/{world_id}"
        me = {"group": group, "index": int(index), "host": host or socket.gethostname(),
              "pid": os.getpid(), "num_ranks": len(local_devices), "device_kinds": kinds,
              "devices": [str(d) for d in local_devices]}
        expect = {"num_processes": num_processes, "groups": groups}
        slot = int(store.add(f"{root}/join/n", 1)) - 1
        if slot >= num_processes:
            raise RefitError(f"{_label(me)} is process #{slot + 1} to join world {world_id!r}, "
                             f"but num_processes={num_processes}; give every world on one "
                             f"store its own world_id and every process the same num_processes")
        store.set(f"{root}/join/{slot}", json.dumps({"info": me, "expect": expect}))
        keys = [f"{root}/join/{i}" for i in range(num_processes)]
        deadline = time.monotonic() + timeout
        try:
            _wait(store, keys, deadline)
        except TransportTimeout as e:
            arrived = [json.loads(store.get(k))["info"] for k in keys if store.check([k])]
            raise TransportTimeout(
                f"world {world_id!r} at {address}: {len(arrived)} of {num_processes} processes "
                f"joined within {timeout} s ({', '.join(map(_label, arrived))}); "
                f"{num_processes - len(arrived)} never did") from e
        records = [json.loads(v) for v in store.multi_get(keys)]

        for rec in records:
            if rec["expect"] != expect:
                raise RefitError(f"processes of world {world_id!r} disagree: "
                                 f"{_label(rec['info'])} joined with {rec['expect']}, "
                                 f"{_label(me)} with {expect}; pass the same num_processes "
                                 f"and groups everywhere")
        infos = sorted((rec["info"] for rec in records), key=_group_key(groups))
        for a, b in zip(infos, infos[1:]):
            if (a["group"], a["index"]) == (b["group"], b["index"]):
                raise RefitError(f"two processes joined world {world_id!r} as {_label(a)} "
                                 f"(pids {a['pid']} on {a['host']} and {b['pid']} on "
                                 f"{b['host']}); give each process of a group its own index")
        first = 0
        for info in infos:
            info["ranks"] = list(range(first, first + info["num_ranks"]))
            first += info["num_ranks"]
        position = next(p for p, info in enumerate(infos)
                        if (info["group"], info["index"]) == (group, index))
        world = cls(store=store, server=server, address=address, world_id=world_id,
                    timeout=timeout, infos=infos, process_index=position,
                    devices=local_devices)
        logger.debug("joined %r", world)
        return world

    # ------------------------------------------------------------------ who is where

    @property
    def address(self) -> str:
        """The store address this world joined through."""
        return self._address

    @property
    def world_id(self) -> str:
        return self._world_id

    @property
    def timeout(self) -> float:
        """Default timeout of every wait, in seconds."""
        return self._timeout

    @property
    def rank_ids(self) -> tuple[int, ...]:
        """This process's world ranks, in local device order."""
        return self._rank_ids

    @property
    def num_ranks(self) -> int:
        return len(self._rank_process)

    @property
    def num_processes(self) -> int:
        return len(self._infos)

    @property
    def process_index(self) -> int:
        """This process's position in the world's process order."""
        return self._process_index

    @property
    def processes(self) -> list[dict[str, Any]]:
        """Per-process info in process order: group, index, host, pid, num_ranks,
        device_kinds, devices (strings) and ranks."""
        return [json.loads(json.dumps(info)) for info in self._infos]

    @property
    def topology(self) -> Topology:
        """Process (= process position) and host of every rank, for the planner."""
        return self._topology

    @property
    def groups(self) -> tuple[str, ...]:
        """Group names in rank order."""
        return tuple(dict.fromkeys(info["group"] for info in self._infos))

    def group_ranks(self, name: str) -> tuple[int, ...]:
        """The ranks of group ``name``, ascending."""
        ranks = tuple(r for info in self._infos if info["group"] == name for r in info["ranks"])
        if not ranks:
            raise RefitError(f"world {self._world_id!r} has no group {name!r}; "
                             f"its groups are {list(self.groups)}")
        return ranks

    def process_of(self, rank: int) -> int:
        """The position of the process hosting ``rank``."""
        return self._rank_process[self._check_rank(rank)]

    def device_kind(self, rank: int) -> str:
        """"cpu" or "cuda" (or another torch/JAX platform name) for ``rank``."""
        return self._rank_kind[self._check_rank(rank)]

    def is_local(self, rank: int) -> bool:
        """Whether ``rank`` lives in this process."""
        return rank in self._local

    def local_device(self, rank: int) -> Any:
        """The device object this process passed to ``join`` for its ``rank``."""
        if rank not in self._local:
            raise RefitError(f"rank {rank} is not local to process {self._process_index} "
                             f"(its ranks are {list(self._rank_ids)})")
        return self._devices[rank - self._rank_ids[0]]

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < len(self._rank_process):
            raise RefitError(f"rank {rank} is not in world {self._world_id!r} "
                             f"(ranks 0..{len(self._rank_process) - 1})")
        return rank

    def describe_process(self, position: int) -> str:
        """``"trainer[0] (process 2, pid 123 on host-a)"``, for error messages."""
        info = self._infos[position]
        return f"{_label(info)} (process {position}, pid {info['pid']} on {info['host']})"

    # ------------------------------------------------------------------ collectives

    def _next_prefix(self) -> str:
        self._ensure_open()
        self._num_ops += 1
        return f"{self._root}/op{self._num_ops}"

    def _collect(self, what: str, prefix: str, keys: Sequence[str], owners: Sequence[int],
                 timeout: float | None) -> list[bytes]:
        """Wait for ``keys`` (written by processes ``owners``), read them, clean up."""
        timeout = self._timeout if timeout is None else timeout
        try:
            _wait(self._store, keys, time.monotonic() + timeout)
        except TransportTimeout as e:
            try:
                missing = [p for k, p in zip(keys, owners) if not self._store.check([k])]
            except RuntimeError:
                missing = list(owners)
            names = "; ".join(self.describe_process(p) for p in missing)
            raise TransportTimeout(f"{what} ({prefix}) in world {self._world_id!r} timed out "
                                   f"after {timeout} s: never arrived: {names}") from e
        values = self._store.multi_get(list(keys))
        # The last reader deletes the keys, so a long-lived world does not grow the store.
        if int(self._store.add(f"{prefix}/done", 1)) == self.num_processes:
            for k in (*keys, f"{prefix}/done"):
                self._store.delete_key(k)
        return values

    def allgather_json(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every process's ``obj``, in process order. JSON values only.

        Raises:
            TypeError: ``obj`` is not JSON-serializable (raised before anything is posted,
                so the other processes are not left waiting on a half-done collective).
            TransportTimeout: some process never called it; names them.
        """
        payload = json.dumps(obj)
        prefix = self._next_prefix()
        self._store.set(f"{prefix}/{self._process_index}", payload)
        keys = [f"{prefix}/{p}" for p in range(self.num_processes)]
        values = self._collect("allgather_json", prefix, keys, range(self.num_processes), timeout)
        return [json.loads(v) for v in values]

    def broadcast_json(self, obj: Any = None, root_process: int = 0, *,
                       timeout: float | None = None) -> Any:
        """``obj`` of process ``root_process``, in every process. JSON values only."""
        if not 0 <= root_process < self.num_processes:
            raise RefitError(f"root_process {root_process} is not a process position "
                             f"(0..{self.num_processes - 1})")
        payload = json.dumps(obj) if self._process_index == root_process else None
        prefix = self._next_prefix()
        key = f"{prefix}/b"
        if payload is not None:
            self._store.set(key, payload)
        (value,) = self._collect("broadcast_json", prefix, [key], [root_process], timeout)
        return json.loads(value)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait until every process reaches this barrier."""
        prefix = self._next_prefix()
        self._store.set(f"{prefix}/{self._process_index}", b"")
        keys = [f"{prefix}/{p}" for p in range(self.num_processes)]
        self._collect("barrier", prefix, keys, range(self.num_processes), timeout)

    # ------------------------------------------------------------------ transports

    @property
    def cross_kind(self) -> str:
        """The transport that reaches every pair across processes: "nccl" when every rank
        is a CUDA rank, "gloo" when every rank is a CPU rank; a mixed world is refused
        (``select_backend``). Pairs with a fast path (``route``) bypass it."""
        from .transport.select import select_backend
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
        from .transport.select import choose_routes
        caps = getattr(self, "_caps", None)
        if caps is None:
            caps = self._caps = self._gather_caps()
        return choose_routes(self._rank_process, self._rank_kind, caps, requested)

    def _gather_caps(self) -> list[dict[str, Any]]:
        """Every process's capabilities (collective: two JSON all-gathers).

        Each process with CPU ranks publishes a token in a tiny shared-memory probe; every
        process then says which same-host probes it could read, so a pair takes shm only
        when both sides can open each other's segments. CUDA processes publish the uuid of
        each rank's device and those they can reach by peer access.
        """
        import secrets
        from .transport import shm as shm_mod

        token = secrets.token_hex(5)
        enabled = os.environ.get("XRESHARD_SHM", "1") not in ("0", "false", "off")
        probe = None
        if enabled and any(self._rank_kind[r] == "cpu" for r in self._rank_ids):
            probe = shm_mod.create_probe(token)
        cuda: dict[str, Any] = {"cuda_devices": [], "cuda_reach": []}
        if any(self._rank_kind[r] == "cuda" for r in self._rank_ids):
            from .transport.cuda_ipc import local_cuda_caps
            cuda = local_cuda_caps([_cuda_ordinal(d) if _device_kind(d) == "cuda" else None
                                    for d in self._devices])
        try:
            mine = {"token": token, "probe": probe is not None,
                    "start": shm_mod.process_start_time(os.getpid()), **cuda}
            first = self.allgather_json(mine)
            host = self._infos[self._process_index]["host"]
            reach = [q for q, c in enumerate(first)
                     if q != self._process_index and c["probe"] and probe is not None
                     and self._infos[q]["host"] == host and shm_mod.read_probe(c["token"])]
            second = self.allgather_json({"shm_reach": reach})
        finally:
            if probe is not None:
                probe.unlink()
                probe.close()
        caps = []
        for q, (c, r) in enumerate(zip(first, second)):
            caps.append({"host": self._infos[q]["host"], "pid": self._infos[q]["pid"],
                         "start": c["start"], "token": c["token"],
                         "shm_reach": r["shm_reach"], "cuda_devices": c["cuda_devices"],
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
        """
        self._ensure_open()
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
                made = self.transport("local")
            else:
                made = self._make_auto()
        elif kind == "nccl":
            made = self._make_nccl()
        elif kind == "shm":
            made = self._make_shm()
        elif kind == "cuda_ipc":
            made = self._make_cuda_ipc()
        else:
            raise ValueError(f"unknown transport kind {kind!r}: expected 'auto', 'local', "
                             f"'gloo', 'nccl', 'shm' or 'cuda_ipc'")
        self._transports[kind] = made
        return made

    def _make_auto(self) -> Transport:
        routes = self.routes("auto")
        self._routes = routes
        parts = {k: self.transport(k) for k in routes.kinds if k != "local"}
        parts["local"] = self.transport("local")
        made = RoutedTransport(parts, routes.kind, self._rank_ids)
        logger.info("world %r: transport %s", self._world_id, made.name)
        return made

    def _make_shm(self) -> Transport:
        from .transport.shm import ShmTransport

        routes = self.routes("auto")
        caps = self._caps
        me = self._process_index
        peers = routes.peers(me, "shm")
        pids = {q: (caps[q]["pid"], caps[q]["start"]) for q in peers}
        prefix = self._next_prefix()
        labels = [self.describe_process(p) for p in range(self.num_processes)]
        return ShmTransport(self._store, f"{prefix}/shm", caps[0]["token"], self._rank_process,
                            me, peers, pids=pids, process_labels=labels,
                            connect=self._store_client)

    def _store_client(self) -> Any:
        """Another client of the world's store, for a transport's helper thread (a client
        blocked in ``wait`` serves nobody else)."""
        host, port = parse_address(self._address)
        return _tcp_store_class()(host, port, None, False,
                                  datetime.timedelta(seconds=self._timeout),
                                  wait_for_workers=False)

    def _make_cuda_ipc(self) -> Transport:
        from .transport.cuda_ipc import CudaIpcTransport

        routes = self.routes("auto")
        caps = self._caps
        me = self._process_index
        peers = routes.peers(me, "cuda_ipc")
        pids = {q: (caps[q]["pid"], caps[q]["start"]) for q in peers}
        prefix = self._next_prefix()
        labels = [self.describe_process(p) for p in range(self.num_processes)]
        devices = {r: _cuda_ordinal(self._devices[i]) for i, r in enumerate(self._rank_ids)
                   if self._rank_kind[r] == "cuda"}
        return CudaIpcTransport(self._store, f"{prefix}/ipc", self._rank_process, me, peers,
                                devices, pids=pids, process_labels=labels,
                                can_reach=routes.ipc_ok)

    def _make_nccl(self) -> Transport:
        """One NCCL communicator over every rank (collective, like gloo)."""
        from .transport.nccl import NcclTransport
        from .transport.select import select_backend

        select_backend(self._rank_kind, "nccl")       # refuses CPU ranks, naming them
        prefix = self._next_prefix()
        devices = {r: _cuda_ordinal(self._devices[i]) for i, r in enumerate(self._rank_ids)}
        return NcclTransport(self._store, self.num_ranks, devices, key=f"{prefix}/nccl",
                             timeout=self._timeout)

    def _make_gloo(self) -> Transport:
        from .transport.gloo import GlooTransport, create_gloo_group

        prefix = self._next_prefix()
        # gloo's own rendezvous cannot say who is missing; a barrier first can.
        self.barrier()
        store_host, _ = parse_address(self._address)
        pg = create_gloo_group(self._store, f"{prefix}/gloo/", rank=self._process_index,
                               size=self.num_processes, timeout=self._timeout,
                               store_host=store_host)
        labels = [self.describe_process(p) for p in range(self.num_processes)]
        return GlooTransport(pg, rank_process=self._rank_process, process_index=self._process_index,
                             process_labels=labels)

    # ------------------------------------------------------------------ lifetime

    def _ensure_open(self) -> None:
        if self._closed:
            raise RefitError(f"world {self._world_id!r} is closed")

    def close(self) -> None:
        """Close the transports and leave the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for kind, t in self._transports.items():
            if kind != "auto":
                t.close()
        self._transports.clear()
        self._store = None
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"World(world_id={self._world_id!r}, address={self._address!r}, "
                f"process_index={self._process_index}, num_processes={self.num_processes}, "
                f"rank_ids={list(self._rank_ids)}, num_ranks={self.num_ranks})")


def _wait(store: Any, keys: Sequence[str], deadline: float) -> None:
    """``store.wait(keys)`` until ``deadline``; TransportTimeout on timeout, TransportError
    when the store itself fails."""
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        store.wait(list(keys), datetime.timedelta(seconds=remaining))
    except RuntimeError as e:   # torch's DistStoreError / DistNetworkError derive from it
        if time.monotonic() >= deadline - 0.01 or "timeout" in str(e).lower():
            raise TransportTimeout(str(e)) from e
        raise TransportError(f"the rendezvous store failed: {e}") from e


class RoutedTransport:
    """One transport over several: each pair goes through the kind ``route(src, dst)``
    names ("local", "shm", "cuda_ipc", "gloo", "nccl"), as ``World.route`` says.

    Inside ``group`` every sub-transport collects its posts; on exit they complete in
    the fixed order of ``select.KINDS`` in every process (local copies first, then the
    shared-memory paths, then the network). That cannot deadlock: each transport starts
    its sends when they are posted and its exit waits only on its own peers' posts and
    exits, which every process reaches in the same order. Each is given the group's
    timeout from the moment the group was entered.

    Attributes:
        parts: the sub-transports by kind.
        bytes_sent_by_transport / bytes_received_by_transport: bytes posted per kind,
            cumulative (take differences around a refit for its own share).
        alloc: staging in shared memory (``ShmTransport.alloc``) when shm is one of the
            parts, else None; pass it as the executor's ``alloc`` so that staged sends
            are exposed to shm peers without a copy.
    """

    def __init__(self, parts: Mapping[str, Transport], route: Any, local_ranks: Sequence[int]):
        from .transport.select import KINDS

        unknown = set(parts) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown transport kinds {sorted(unknown)}; expected {KINDS}")
        self.parts = {k: parts[k] for k in KINDS if k in parts}
        self._route = route
        self.name = f"auto({'+'.join(self.parts)})"
        self._local = frozenset(local_ranks)
        self.bytes_sent_by_transport = {k: 0 for k in self.parts}
        self.bytes_received_by_transport = {k: 0 for k in self.parts}
        shm = self.parts.get("shm")
        self.alloc = getattr(shm, "alloc", None)

    @property
    def local(self) -> Transport:
        return self.parts["local"]

    @property
    def bytes_by_transport(self) -> dict[str, int]:
        """Bytes sent + received per kind by this process, cumulative."""
        return {k: self.bytes_sent_by_transport[k] + self.bytes_received_by_transport[k]
                for k in self.parts}

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            # ExitStack exits in reverse: enter last what must complete first
            for kind in reversed(self.parts):
                stack.enter_context(self.parts[kind].group(timeout))
            yield

    def _part(self, src_rank: int, dst_rank: int, what: str) -> tuple[str, Transport]:
        kind = self._route(src_rank, dst_rank)
        part = self.parts.get(kind)
        if part is None:
            raise TransportError(f"{what} {src_rank}->{dst_rank}: routed to {kind!r}, which "
                                 f"this world did not create ({self.name})")
        return kind, part

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        kind, part = self._part(src_rank, dst_rank, "send")
        self.bytes_sent_by_transport[kind] += _nbytes(buf)
        part.send(buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        kind, part = self._part(src_rank, dst_rank, "recv")
        self.bytes_received_by_transport[kind] += _nbytes(buf)
        part.recv(buf, src_rank, dst_rank, tag)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
