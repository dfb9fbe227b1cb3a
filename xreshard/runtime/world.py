"""The refit world: which processes joined, which ranks each hosts, and metadata collectives.

Processes meet through a ``torch.distributed.TCPStore`` used stand-alone: xreshard never
creates or touches torch's default process group, so a world coexists with the trainer's
and the inference engine's own groups. Everything that crosses processes here is JSON.

A launcher (or the first process) holds the store server::

    server = xreshard.runtime.world.serve()            # port 0: the OS picks a free port
    # hand server.address ("tcp://127.0.0.1:41234") to every process, then in each:
    world = World.join(server.address, "trainer", jax.local_devices(),
                       num_processes=3, index=jax.process_index())
    transport = world.transport()              # local copies + gloo across processes

Every collective (``allgather_json``, ``broadcast_json``, ``barrier``, creating the gloo
transport) uses a fresh key prefix from a per-world counter that every process advances
identically, so all processes must call them in the same order. Every wait is bounded; a
timeout raises ``TransportTimeout`` naming the processes that never arrived. A wait that
lasts names them every 15 s, and ends early, with one error on every process, when one of
them will not come (:mod:`xreshard.runtime.waiting`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Iterator, Sequence

from ..errors import (CommunicationError, RefitError, TransportError,
                      WorldBroken, error_name)
from . import epochs, waiting
from .epochs import ElasticWorld
from .joining import (KEY_ROOT, Joined, join_arguments, join_records, label, member_nonce,
                      numbered, refusal, retire)
from .store import Seal, StoreServer, connect, parse_address, serve, token_from
from ..ir.topology import Topology
from ..transport.base import Transport, TransportTimeout, format_seconds
from ..transport.routed import RenumberedTransport, RoutedTransport
from .world_transports import WorldTransports, device_kind
from .commcount import count_collective

__all__ = ["StoreServer", "World", "RoutedTransport", "RenumberedTransport", "serve",
           "parse_address"]

logger = logging.getLogger(__name__)

# Open worlds (weakly), closed at interpreter exit: one left open (an exception on its way
# out) has its store and gloo clients torn down by C++ destructors under their threads,
# and the process aborts ("terminate called without an active exception", exit -6).
_OPEN: weakref.WeakSet[World] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for world in list(_OPEN):
        with contextlib.suppress(Exception):    # exiting: the others still close
            world.close(wait=5.0)               # a daemon thread's collective: 5 s at most


class World(WorldTransports, ElasticWorld):
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
                 process_index: int, devices: Sequence[Any], seal: Seal | None = None,
                 joined: Joined | None = None, instance_seal: Seal | None = None,
                 elastic: Any = None):
        self._store = store
        self._seal = seal or Seal(None, world_id)
        # the join's instance, retired on close, and its refusal marker, read by every
        # collective for one join timeout (a disagreeing process may join after us)
        self._joined = joined
        self._instance_seal = instance_seal
        self._refusal_until = time.monotonic() + float(timeout) if joined is not None else 0.0
        self._broken: str | None = None
        self._lock = threading.RLock()
        self._limit: float | None = None      # a deadline every wait stops at (``limited``)
        self._limit_seconds = 0.0             # the length of that limit, for messages
        self._server = server
        self._address = address
        self._world_id = world_id
        self._root = f"{KEY_ROOT}/{world_id}"
        self._timeout = float(timeout)
        self._infos = infos
        self._process_index = process_index
        self._devices = tuple(devices)
        self._num_ops = 0
        self._transports: dict[str, Transport] = {}
        self._counted: dict[str, Transport] = {}
        self._closed = False
        self._closing = False
        self._why = ""          # what made this process close it (``__exit__``'s exception)
        self._depth = 0         # nesting of ``exclusive`` in the thread that holds it
        self._elastic = elastic     # an epochs.Membership, or None (a fixed world)
        self._set_members(infos, process_index)
        _OPEN.add(self)

    def _set_members(self, infos: list[dict[str, Any]], process_index: int) -> None:
        """The rank tables of a member set (at the join, and at each new epoch)."""
        self._infos = infos
        self._process_index = process_index
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
             is_server: bool = False, token: str | bytes | None = None,
             elastic: bool = False, wait: bool = True, unit: str | None = None) -> World:
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
            timeout: seconds to wait for the others (and the default of every later wait);
                a wait that lasts logs who it waits for every 15 s.
            world_id: distinguishes several worlds on one store; unique per store among
                the worlds open at one time (a closed world's id may be joined again).
            is_server: host the store in this process at ``address`` (a free port known
                to all; launchers should prefer ``serve()``).
            token: a secret shared by the world's processes (default ``XRESHARD_TOKEN``,
                else none): join records and every metadata payload are signed with it, so
                a process without it can neither join nor inject metadata
                (``xreshard.runtime.store`` says what it does and does not protect).
            elastic: a world whose members may change (:mod:`xreshard.runtime.epochs`):
                when its world is already running, this process asks to join it and is
                admitted at the members' next refit call (``num_processes`` is then
                unused); a member that dies, stops answering or calls ``leave()`` is
                excluded at the next collective the members agree on, and the world moves
                to a new ``epoch`` instead of being broken. Every process of a world
                passes the same value.
            wait: (elastic, a running world) False returns before the members admitted it,
                for ``Refit.catch_up()``; its first refit (or ``admit()``) asks to join.
            unit: (elastic) a member excluded takes every member of its unit with it
                (one tensor-parallel engine's workers; ``ElasticWorld.excluded``).

        Returns:
            The joined world.

        Raises:
            TransportTimeout: not every process joined within ``timeout``; names those that did.
            WorldMismatch: processes passed different ``num_processes`` or ``groups``, or
                one passed arguments it cannot join with: every one of them raises it, with
                one message (members that had formed a world already raise it from their
                next collective, within ``timeout``).
            TransportError: a process that joined no longer runs (on this node) and the
                world cannot form with its record: every joiner raises it at once.
            RefitError: two processes joined with one group and index, or this one came
                after the world was complete.
            AuthenticationError: join records signed with another token were found and
                too few with this process's token (at once when ``num_processes`` of them
                exist), or the world's instance record was forged or replayed.
        """
        seal = Seal(token_from(token), world_id)
        groups, local_devices, index = join_arguments(
            address, seal, group, devices, num_processes, groups, index, is_server)
        deadline = time.monotonic() + timeout
        server = None
        if is_server:
            host_name, port = parse_address(address)
            server = StoreServer(host_name, port, timeout=timeout)
            store, address = server.store, server.address
        else:
            store = connect(address, timeout)

        me = {"group": group, "index": int(index), "host": host or socket.gethostname(),
              "node": epochs.own_node(), "pid": os.getpid(), "start": epochs.own_start(),
              "num_ranks": len(local_devices), "devices": [str(d) for d in local_devices],
              "device_kinds": [device_kind(d) for d in local_devices]}
        expect = {"num_processes": num_processes, "groups": groups}
        if elastic:
            me.update({} if unit is None else {"unit": unit})
            running = epochs.read_epoch(store, seal)
            if running is not None:
                return cls._join_running(store, server, address, seal, me, groups,
                                         local_devices, deadline, timeout, running, wait)
        try:
            joined = join_records(store, seal, me, expect, num_processes, deadline, address)
            infos, position = numbered(joined.members, groups, world_id, (group, index))
        except BaseException:
            if server is not None:
                server.close()
            raise
        nonce = member_nonce(joined)
        world = cls(store=store, server=server, address=address, world_id=world_id,
                    timeout=timeout, infos=infos, process_index=position,
                    devices=local_devices, seal=seal.with_nonce(nonce), joined=joined,
                    instance_seal=seal.with_nonce(joined.instance),
                    elastic=epochs.Membership(seal, groups, 0) if elastic else None)
        world._refuse_if_refused()
        if elastic and world.process_index == 0:
            epochs.publish_epoch(store, seal, world._epoch_record(0, [], []))
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
    def nonce(self) -> str:
        """The random nonce of this world's instance (of its current epoch, elastic): the
        same in every member, new for every world formed; keys ``verify``'s digests."""
        return self._joined.instance if self._joined is not None else ""

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
        return f"{label(info)} (process {position}, pid {info['pid']} on {info['host']})"

    # ------------------------------------------------------------------ collectives

    @property
    def broken(self) -> str | None:
        """Why this world can run no further collectives (the first cause), or None.

        A metadata collective that timed out, went out of step or read a payload that
        failed its checks leaves the processes' step counters apart, and a refit that
        failed while moving bytes leaves the transports in an unknown state: either marks
        the world broken, and every later collective or refit raises ``WorldBroken`` at
        once. Bad input never does (it is refused identically everywhere, in step).
        """
        return self._broken

    def mark_broken(self, cause: str) -> None:
        """Refuse every later collective, naming ``cause`` (the first cause is kept)."""
        if self._broken is None:
            self._broken = cause
            logger.warning("world %r is broken: %s", self._world_id, cause)

    @contextlib.contextmanager
    def exclusive(self, what: str = "a collective") -> Iterator[None]:
        """Hold the world for one thread: collectives (and refits) of a world run one at a
        time, so the processes' step counters stay in step.

        Raises:
            RefitError: another thread of this process is inside a collective of this world.
        """
        if not self._lock.acquire(blocking=False):
            if self._closing:
                raise RefitError(f"world {self._world_id!r} is closed")
            raise RefitError(f"{what} was called on world {self._world_id!r} while another "
                             f"thread of this process runs one; a world's collectives and "
                             f"refits run one at a time (use one thread, or a lock)")
        if self._closing and self._depth == 0:     # nested steps of a running call go on
            self._lock.release()
            raise RefitError(f"world {self._world_id!r} is closed")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._lock.release()

    @contextlib.contextmanager
    def limited(self, seconds: float) -> Iterator[None]:
        """Every wait inside (collectives, creating transports) ends within ``seconds``
        from now, whatever its own timeout: a refit bounds its whole call this way."""
        outer = (self._limit, self._limit_seconds)
        deadline = time.monotonic() + seconds
        if self._limit is None or deadline < self._limit:
            self._limit, self._limit_seconds = deadline, float(seconds)
        try:
            yield
        finally:
            self._limit, self._limit_seconds = outer

    def _wait_seconds(self, timeout: float | None = None) -> float:
        """``timeout`` (default the world's), cut to what ``limited`` leaves."""
        return self._wait(timeout)[0]

    def _wait(self, timeout: float | None) -> tuple[float, str]:
        """``_wait_seconds`` and how a message says it ran out: the same words in every
        process (the seconds a limit leaves differ between processes; the limit does not)."""
        timeout = self._timeout if timeout is None else float(timeout)
        if self._limit is not None and self._limit - time.monotonic() < timeout:
            left = max(self._limit - time.monotonic(), 0.05)
            return left, f"at the end of its call's {format_seconds(self._limit_seconds)} limit"
        return timeout, f"after {format_seconds(timeout)}"

    def _next_prefix(self, kind: str = "transport") -> str:
        return self._next_op(kind)[0]

    def _next_op(self, kind: str) -> tuple[str, int]:
        self._ensure_open()
        self._num_ops += 1
        return f"{self._root}/op{self._num_ops}", self._num_ops

    def _fail(self, error: CommunicationError, since: float | None = None) -> Exception:
        """Mark the world broken by its first cause, and return it: the world's published
        refusal (a process that disagreed on the world joined after us), else the end a
        member posted first (``waiting``: a fixed world posts ``error`` unless one is
        there, so every member raises one error), else ``error``. ``since``: when the
        failed step began (the refusal counts for steps begun within the join timeout)."""
        cause = self._refusal(since) or self._post_end(
            error_name(error), f"{error} (raised first by "
                               f"{self.describe_process(self._process_index)})") or error
        self.mark_broken(f"{type(cause).__name__}: {cause}")
        return cause

    def _post_end(self, error: str, message: str) -> Exception | None:
        """Post that this process ends the world (a fixed world's; an elastic one goes on
        without a lost member); the end that holds, or None."""
        if self._elastic is not None or self._store is None or self.num_processes < 2:
            return None
        return waiting.post_end(self._store, self._seal,
                                waiting.ended_key(self._root, self._seal.nonce),
                                self._process_index, error, message)

    def _refusal(self, since: float | None = None) -> Exception | None:
        """The world's published refusal (``WorldMismatch``, or the error a join found),
        looked up (one store round trip) for steps begun (``since``, default now) within
        one join timeout of joining."""
        joined = self._joined
        begun = time.monotonic() if since is None else since
        if joined is None or self._store is None or begun > self._refusal_until:
            return None
        return refusal(self._store, self._instance_seal, joined.refused_key)

    def _refuse_if_refused(self) -> None:
        """At the end of a join: a process that disagreed came while we formed (this
        process saw its record, or another published the refusal), so the members may
        already wait for us in the first collective: wake them, close, and raise it."""
        joined = self._joined
        refused = (joined.refused if joined is not None else None) or self._refusal()
        if refused is not None:
            prefix, op = self._next_op("join")
            error = self._refuse_step(prefix, op, refused)
            self.close()
            raise error

    def _refuse_step(self, prefix: str, op: int, refused: Exception) -> Exception:
        """Raise ``refused`` from step ``op``: first write this process's payload of that
        step as a wake-up, so the members waiting on it fail now (their payload check
        fails and their failure path reads the same refusal), not at their timeout."""
        me = self._process_index
        with contextlib.suppress(RuntimeError):
            self._store.set(f"{prefix}/{me}", self._seal.seal("world-mismatch", op, me,
                                                              json.dumps(None)))
        return self._fail(refused)

    def _exchange(self, kind: str, obj: Any, writes: bool, readers: Sequence[int],
                  timeout: float | None, partial: bool = False) -> list[Any]:
        """One collective step: write a sealed ``obj`` (when ``writes``), wait for the
        payloads of processes ``readers``, check and open them, clean up. With
        ``partial``, the processes settle which payloads count (see ``waiting.settled``) and a
        timeout returns those (None for the rest) instead of raising; the caller must then
        mark the world broken (it knows the first cause)."""
        body = json.dumps(obj)      # TypeError before anything is posted
        begun = time.monotonic()
        count_collective(kind)      # for count_comm(); nothing when no counter is active
        with self.exclusive(kind):
            prefix, op = self._next_op(kind)
            me = self._process_index
            timeout, ran_out = self._wait(timeout)
            keys = [f"{prefix}/{p}" for p in readers]
            try:
                refused = self._refusal()
                if refused is not None:
                    raise self._refuse_step(prefix, op, refused)
                if writes:
                    self._store.set(f"{prefix}/{me}", self._seal.seal(kind, op, me, body))
                arrived = [True] * len(keys)
                try:
                    self._wait_keys(keys, readers, time.monotonic() + timeout, partial,
                                    f"{kind} (collective #{op})", begun)
                except TransportTimeout as e:
                    try:
                        arrived = [bool(self._store.check([k])) for k in keys]
                    except RuntimeError:
                        arrived = [False] * len(keys)
                    if not partial or self._refusal(begun) is not None:
                        names = "; ".join(self.describe_process(p)
                                          for p, a in zip(readers, arrived) if not a)
                        raise TransportTimeout(f"{kind} (collective #{op}) in world "
                                               f"{self._world_id!r} timed out {ran_out}: "
                                               f"never arrived: {names}") from e
                if partial:
                    arrived = waiting.settled(self, prefix, op, kind, readers, arrived)
                got = [k for k, a in zip(keys, arrived) if a]
                values = iter(self._store.multi_get(got) if got else [])
                raws = [next(values) if a else None for a in arrived]
                # the last reader deletes the keys, so a long-lived world does not grow the store
                if int(self._store.add(f"{prefix}/done", 1)) == self.num_processes:
                    for k in [f"{prefix}/done", f"{prefix}/settled"][:1 + partial] + keys:
                        self._store.delete_key(k)
            except CommunicationError as e:
                raise self._fail(e, begun) from e.__cause__
            except RuntimeError as e:       # the store connection itself failed
                raise self._fail(CommunicationError(
                    f"{kind} (collective #{op}) in world {self._world_id!r}: the rendezvous "
                    f"store failed: {e}"), begun) from e
            try:
                return [None if v is None else self._seal.open(
                    v, key=k, kind=kind, op=op, process=p,
                    what=f"from {self.describe_process(p)}")
                    for k, p, v in zip(keys, readers, raws)]
            except CommunicationError as e:
                raise self._fail(e, begun) from None

    def _wait_keys(self, keys: list[str], readers: Sequence[int], deadline: float,
                   partial: bool, what: str = "a collective", begun: float = 0.0) -> None:
        """Wait for the payloads at ``keys``, naming the missing readers every
        ``waiting.REPORT_SECONDS``. It stops before the deadline once a reader still
        missing is known not to come: its process, on this node, no longer runs
        (``epochs.gone``; a partial collective, a refit's outcome, stops only when every
        missing one is, or in an elastic world left); or (not partial) the world's
        refusal or end was posted (``_fail`` then raises it)."""
        if partial:
            def stop(missing: list[int]) -> None:
                if self._all_gone(missing):
                    raise TransportTimeout(f"gone: {missing}")
        else:
            def stop(missing: list[int]) -> None:
                self._stop_if_over(missing, what, begun)
        reporter = waiting.Reporter(f"world {self._world_id!r}: {what}")
        waiting.wait_for(self._store, keys, readers, deadline, reporter,
                         self.describe_process, stop)

    def _stop_if_over(self, missing: list[int], what: str, begun: float) -> None:
        """Raise when a wait on the processes ``missing`` cannot end well: some of them no
        longer run (this node), or a member posted the world's end (or, within the join
        timeout, its refusal): ``_fail`` turns the raise into that first cause."""
        dead = [p for p in missing if epochs.gone(self._infos[p], ())]
        if dead:
            raise TransportError(
                f"{what} in world {self._world_id!r}: "
                f"{'; '.join(self.describe_process(p) for p in dead)} no longer "
                f"run{'s' if len(dead) == 1 else ''} (exited on this node) and never "
                f"arrived: it ends the world")
        if self._refusal(begun) is not None or (self._elastic is None and waiting.read_end(
                self._store, self._seal, waiting.ended_key(self._root, self._seal.nonce))
                is not None):
            raise CommunicationError(f"{what}: the world was ended by another process")

    def allgather_json(self, obj: Any, *, timeout: float | None = None,
                       kind: str = "allgather", partial: bool = False) -> list[Any]:
        """Every process's ``obj``, in process order. JSON values only.

        Args:
            obj: this process's value.
            timeout: seconds to wait for the others (default: the world's).
            kind: names the collective; every process must pass the same, and a process
                that entered another one at this step is reported (``CollectiveMismatch``).

        Raises:
            TypeError: ``obj`` is not JSON-serializable (raised before anything is posted,
                so the other processes are not left waiting on a half-done collective).
            TransportTimeout: some process never called it; names them. The world is
                then broken (``broken``), as after any communication failure here.
            CollectiveMismatch / AuthenticationError: a payload was from another
                collective, not one of this world's, or (with a token) not signed.

        With ``partial=True`` a timeout returns the values that arrived, None for the
        processes that never did; the caller must then mark the world broken
        (``mark_broken``), naming the first cause. Which values arrived is settled once
        (the first process to finish waiting decides, every other takes its decision, one
        extra store round trip), so every survivor gets the same list: a refit's outcome
        exchange builds the same message on every survivor from it.
        """
        return self._exchange(kind, obj, True, range(self.num_processes), timeout, partial)

    def broadcast_json(self, obj: Any = None, root_process: int = 0, *,
                       timeout: float | None = None, kind: str = "broadcast") -> Any:
        """``obj`` of process ``root_process``, in every process. JSON values only."""
        if not 0 <= root_process < self.num_processes:
            raise RefitError(f"root_process {root_process} is not a process position "
                             f"(0..{self.num_processes - 1})")
        (value,) = self._exchange(kind, obj if self._process_index == root_process else None,
                                  self._process_index == root_process, [root_process],
                                  timeout)
        return value

    def barrier(self, *, timeout: float | None = None, kind: str = "barrier") -> None:
        """Wait until every process reaches this barrier."""
        self._exchange(kind, None, True, range(self.num_processes), timeout)

    # ------------------------------------------------------------------ lifetime

    def _ensure_open(self) -> None:
        if self._closed:
            raise RefitError(f"world {self._world_id!r} is closed")
        if not self.admitted:
            raise RefitError(f"world {self._world_id!r}: this process is not admitted yet "
                             f"(World.join(..., wait=False)); call admit() or a refit first")
        if self._broken is not None:
            raise WorldBroken(f"world {self._world_id!r} is broken and runs no further "
                              f"collectives: {self._broken}; join a new world (another "
                              f"world_id) to continue")

    def close(self, wait: float | None = None) -> None:
        """Close the transports and leave the store. Idempotent; also at ``with`` exit, and
        at interpreter exit for a world still open then (``wait`` 5 s).

        Args:
            wait: seconds to wait for a collective or refit running in another thread
                (``refit.start()``); default the world's timeout + 5 s: its waits are
                bounded by it, and closing under it would garble its outcome.
        """
        if self._closed:
            return
        self._closing = True        # refuses new collectives while we wait for a running one
        wait = self._timeout + 5.0 if wait is None else wait
        held = self._lock.acquire(timeout=wait)
        if not held:
            logger.warning("world %r: a collective of another thread did not finish within "
                           "%s; closing under it", self._world_id, format_seconds(wait))
        try:
            self._close()
        finally:
            if held:
                self._lock.release()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._broken is None and self._store is not None:
            # peers waiting for this process (now or at their next collective) stop at once
            self._post_end("RefitError", f"world {self._world_id!r}: "
                           f"{self.describe_process(self._process_index)} closed its world"
                           f"{self._why} and takes part in no further collective; close the "
                           f"world in every process (join a new one to go on)")
        _OPEN.discard(self)
        self._close_transports()
        self._close_links()         # links parked at an epoch change, not taken up
        if self._joined is not None and self._store is not None and self._elastic is None:
            retire(self._store, self._joined)       # an elastic world outlives its members
        self._store = None
        if self._server is not None:
            self._server.close()

    def _close_transports(self) -> None:
        for kind, t in self._transports.items():
            if kind == "auto":
                continue        # a view of the others
            try:
                t.close()
            except Exception:   # noqa: BLE001 - the others still close (and their threads end)
                logger.warning("world %r: closing its %s transport failed", self._world_id,
                               kind, exc_info=True)
        self._transports.clear()
        self._counted.clear()
        for name in ("_caps", "_routes"):       # what routes gathered: per member set
            self.__dict__.pop(name, None)

    def __enter__(self) -> World:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:     # the peers' error names why this process left
            self._why = f" on {type(exc).__name__}: {str(exc)[:500]}"
        self.close()

    def __repr__(self) -> str:
        return (f"World(world_id={self._world_id!r}, address={self._address!r}, "
                f"process_index={self._process_index}, num_processes={self.num_processes}, "
                f"rank_ids={list(self._rank_ids)}, num_ranks={self.num_ranks})")
