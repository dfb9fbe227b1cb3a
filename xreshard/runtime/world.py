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
import threading
import time
import weakref
from typing import Any, Iterable, Iterator, Sequence

from ..errors import (CommunicationError, RefitError, WorldBroken, error_name)
from ..config import Tuning
from . import epochs, waiting
from .epochs import Request
from .joining import KEY_ROOT, Joined, refusal, retire
from .store import Seal, StoreServer, parse_address, serve
from ..ir.topology import Topology
from ..transport.base import Transport, TransportTimeout, format_seconds
from ..transport.routed import RenumberedTransport, RoutedTransport
from .world_membership import Membership, join_world
from .world_transports import WorldTransports
from .commcount import count_collective

__all__ = ["StoreServer", "World", "RoutedTransport", "RenumberedTransport", "serve",
           "parse_address"]

logger = logging.getLogger(__name__)

#: seconds between two looks (a store round trip) for the world's refusal before a
#: collective: members learn of a late process that disagreed within this much more; a
#: refit's check and outcome, 25 ms apart, look once
REFUSAL_LOOK_S = 0.1

# Open worlds (weakly), closed at interpreter exit: one left open (an exception on its way
# out) has its store and gloo clients torn down by C++ destructors under their threads,
# and the process aborts ("terminate called without an active exception", exit -6).
_OPEN: weakref.WeakSet[World] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for world in list(_OPEN):
        with contextlib.suppress(Exception):    # exiting: the others still close
            world.close(wait=5.0)               # a daemon thread's collective: 5 s at most


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

    A world is composed of two components with their own state: ``membership``
    (:class:`~xreshard.runtime.world_membership.Membership`: the processes and their
    ranks, and an elastic world's epochs, admissions and exclusions) and ``transports``
    (:class:`~xreshard.runtime.world_transports.WorldTransports`: the transports made,
    their routes, the communicators kept across epochs). The world itself keeps the store
    and its collectives (the step counter, the seal of this instance, the lock, whether
    it is broken or closed); its methods below are the public face of both components.
    """

    def __init__(self, *, store: Any, server: StoreServer | None, address: str,
                 world_id: str, timeout: float, infos: list[dict[str, Any]],
                 process_index: int, devices: Sequence[Any], seal: Seal | None = None,
                 joined: Joined | None = None, instance_seal: Seal | None = None,
                 groups: Sequence[str] | None = None, elastic: bool = False, epoch: int = 0,
                 consumed: Sequence[str] = (), tuning: Tuning | None = None):
        self._store: Any = store
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
        self._num_ops = 0
        self._trash: list[str] = []     # keys every process read: deleted at the next wait
        self._refusal_looked = -REFUSAL_LOOK_S      # when a collective last looked
        self._closed = False
        self._closing = False
        self._why = ""          # what made this process close it (``__exit__``'s exception)
        self._depth = 0         # nesting of ``exclusive`` in the thread that holds it
        self.membership = Membership(self, self._seal, groups, infos, process_index, devices,
                                     elastic=elastic, epoch=epoch, consumed=consumed)
        self.transports = WorldTransports(self, tuning or Tuning.from_env())
        _OPEN.add(self)

    def _enter_epoch(self, joined: Joined, nonce: str, infos: list[dict[str, Any]],
                     position: int) -> None:
        """This process's collectives move to the membership's new epoch (``joined``):
        a new seal and key root, the step counter from 0, and the new member set."""
        m = self.membership
        wid = epochs.epoch_world_id(self._world_id, m.epoch)
        self._seal = m.base.at_epoch(m.epoch, nonce)
        self._joined = joined
        self._instance_seal = Seal(m.base.token, wid).with_nonce(joined.instance)
        self._refusal_until = time.monotonic() + self._timeout
        self._refusal_looked = -REFUSAL_LOOK_S
        self._root = f"{KEY_ROOT}/{wid}"
        self._num_ops = 0
        self._broken = None
        m.set_members(infos, position)

    # ------------------------------------------------------------------ joining

    @classmethod
    def join(cls, address: str, group: str, devices: Sequence[Any] | int, *,
             num_processes: int, index: int | None = None,
             groups: Sequence[str] | None = None, host: str | None = None,
             timeout: float = 300.0, world_id: str = "default",
             is_server: bool = False, token: str | bytes | None = None,
             elastic: bool = False, wait: bool = True, unit: str | None = None,
             tuning: Tuning | None = None) -> World:
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
                (one tensor-parallel engine's workers; ``Membership.excluded``).
            tuning: this process's :class:`~xreshard.config.Tuning` for the world's
                transports (``shm``, ``shm_pull``: which fast paths this process offers);
                default ``Tuning.from_env()``, read once here.

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
        return join_world(cls, address, group, devices, num_processes=num_processes,
                          index=index, groups=groups, host=host, timeout=timeout,
                          world_id=world_id, is_server=is_server, token=token,
                          elastic=elastic, wait=wait, unit=unit, tuning=tuning)

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
    def closed(self) -> bool:
        return self._closed

    # Membership's, kept where callers outside the library use them (README, docs/,
    # tests); the library's own machinery calls ``world.membership`` directly.
    @property
    def rank_ids(self) -> tuple[int, ...]:
        """This process's world ranks, in local device order."""
        return self.membership.rank_ids

    @property
    def num_ranks(self) -> int:
        return self.membership.num_ranks

    @property
    def num_processes(self) -> int:
        return self.membership.num_processes

    @property
    def process_index(self) -> int:
        """This process's position in the world's process order."""
        return self.membership.process_index

    @property
    def processes(self) -> list[dict[str, Any]]:
        """Per-process info in process order: group, index, host, pid, num_ranks,
        device_kinds, devices (strings) and ranks."""
        return self.membership.processes

    @property
    def topology(self) -> Topology:
        """Process (= process position) and host of every rank, for the planner."""
        return self.membership.topology

    @property
    def groups(self) -> tuple[str, ...]:
        """Group names in rank order."""
        return self.membership.groups_in_rank_order

    @property
    def local_devices(self) -> tuple[Any, ...]:
        """This process's devices, as given to ``World.join``."""
        return self.membership.devices

    @property
    def epoch(self) -> int:
        """The membership epoch: 0 as the world formed, +1 at each change of members."""
        return self.membership.epoch

    @property
    def elastic(self) -> bool:
        """Whether this world's members may change (``World.join(elastic=True)``)."""
        return self.membership.elastic

    @property
    def members(self) -> tuple[str, ...]:
        """The members' labels (``"rollout[1]"``) in process order, this epoch."""
        return self.membership.members

    @property
    def admitted(self) -> bool:
        """False while a process that joined a running world with ``wait=False`` has not
        been admitted (its first refit call, or ``admit()``, admits it)."""
        return self.membership.admitted

    def group_ranks(self, name: str) -> tuple[int, ...]:
        """The ranks of group ``name``, ascending."""
        return self.membership.group_ranks(name)

    def process_of(self, rank: int) -> int:
        """The position of the process hosting ``rank``."""
        return self.membership.rank_process[self.membership.check_rank(rank)]

    def device_kind(self, rank: int) -> str:
        """"cpu" or "cuda" (or another torch/JAX platform name) for ``rank``."""
        return self.membership.rank_kind[self.membership.check_rank(rank)]

    def is_local(self, rank: int) -> bool:
        """Whether ``rank`` lives in this process."""
        return rank in self.membership.local

    def local_device(self, rank: int) -> Any:
        """The device object this process passed to ``join`` for its ``rank``."""
        return self.membership.local_device(rank)

    def describe_process(self, position: int) -> str:
        """``"trainer[0] (process 2, pid 123 on host-a)"``, for error messages."""
        return self.membership.describe_process(position)

    def excluded(self, missing: Iterable[int]) -> list[int]:
        """The positions excluded with the lost ``missing`` (``Membership.excluded``)."""
        return self.membership.excluded(missing)

    def pending(self) -> list[Request]:
        """Join and leave requests no epoch has acted on yet (one store read)."""
        return self.membership.requests()

    def publish(self, key: str, kind: str, body: Any, numbered: bool = False) -> None:
        """``Membership.publish``: a signed entry every process of the world reads."""
        self.membership.publish(key, kind, body, numbered)

    def published(self, key: str, kind: str) -> Any:
        """``Membership.published``: what ``publish`` wrote at ``key``, or None."""
        return self.membership.published(key, kind)

    def admit(self) -> None:
        """Ask to join the running world; wait until admitted (``Membership.admit``)."""
        self.membership.admit()

    def leave(self) -> None:
        """Leave an elastic world: ask out, then close (``Membership.leave``)."""
        self.membership.leave()

    def advance(self, lost: Iterable[int], joins: Iterable[Request], deadline: float,
                renew: bool = False) -> bool:
        """Move every survivor to the next epoch (collective: ``Membership.advance``)."""
        return self.membership.advance(lost, joins, deadline, renew)

    # The transports', kept where callers outside the library use them; the library's
    # own machinery calls ``world.transports`` (``WorldTransports``) directly.
    def transport(self, kind: str = "auto") -> Transport:
        """The transport of ``kind``, made once (``WorldTransports.transport``)."""
        return self.transports.transport(kind)

    def route(self, src_rank: int, dst_rank: int) -> str:
        """The kind "auto" moves ``src_rank -> dst_rank`` with (``WorldTransports``)."""
        return self.transports.route(src_rank, dst_rank)

    @property
    def comm_steps(self) -> dict[str, str]:
        """What happened to this process's communicators since the last epoch change."""
        return self.transports.comm_steps

    @property
    def comm_counts(self) -> dict[str, int]:
        """How many of this process's communicators each action touched, cumulative."""
        return self.transports.comm_counts

    def renew_transports(self) -> None:
        """Make the transports anew at the next use (``WorldTransports.renew``)."""
        self.transports.renew()

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

    def _fail(self, error: Exception, since: float | None = None) -> Exception:
        """Mark the world broken by its first cause, and return it: the world's published
        refusal (a process that disagreed on the world joined after us), else the end a
        member posted first (``waiting``: a fixed world posts ``error`` unless one is
        there, so every member raises one error), else ``error``. ``since``: when the
        failed step began (the refusal counts for steps begun within the join timeout)."""
        cause = self._refusal(since) or self._post_end(
            error_name(error), f"{error} (raised first by "
                               f"{self.describe_process(self.process_index)})") or error
        self.mark_broken(f"{type(cause).__name__}: {cause}")
        return cause

    def _post_end(self, error: str, message: str) -> Exception | None:
        """Post that this process ends the world (a fixed world's; an elastic one goes on
        without a lost member); the end that holds, or None."""
        if self.elastic or self._store is None or self.num_processes < 2:
            return None
        return waiting.post_end(self._store, self._seal,
                                waiting.ended_key(self._root, self._seal.nonce),
                                self.process_index, error, message)

    def _refusal(self, since: float | None = None) -> Exception | None:
        """The world's published refusal (``WorldMismatch``, or the error a join found),
        looked up (one store round trip) for steps begun (``since``, default now) within
        one join timeout of joining."""
        joined, seal = self._joined, self._instance_seal
        begun = time.monotonic() if since is None else since
        if joined is None or seal is None or self._store is None or begun > self._refusal_until:
            return None
        return refusal(self._store, seal, joined.refused_key)

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
        me = self.process_index
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
            me = self.process_index
            timeout, ran_out = self._wait(timeout)
            keys = [f"{prefix}/{p}" for p in readers]
            try:
                if begun - self._refusal_looked >= REFUSAL_LOOK_S:
                    self._refusal_looked = begun
                    refused = self._refusal()
                    if refused is not None:
                        raise self._refuse_step(prefix, op, refused)
                if writes:
                    self._store.set(f"{prefix}/{me}", self._seal.seal(kind, op, me, body))
                self._empty_trash()         # while the others arrive
                arrived = [True] * len(keys)
                try:
                    waiting.wait_payloads(self, keys, readers, time.monotonic() + timeout,
                                          partial, f"{kind} (collective #{op})", begun)
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
                # the last reader deletes the keys, so a long-lived world does not grow the
                # store: at its next collective, while it waits (not on this one's path)
                if int(self._store.add(f"{prefix}/done", 1)) == self.num_processes:
                    self._trash += [f"{prefix}/done", f"{prefix}/settled"][:1 + partial] + keys
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

    def _empty_trash(self) -> None:
        """Delete the keys of collectives every process has read (see ``_exchange``)."""
        trash, self._trash = self._trash, []
        for k in trash:
            self._store.delete_key(k)

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
        (value,) = self._exchange(kind, obj if self.process_index == root_process else None,
                                  self.process_index == root_process, [root_process],
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
                           f"{self.describe_process(self.process_index)} closed its world"
                           f"{self._why} and takes part in no further collective; close the "
                           f"world in every process (join a new one to go on)")
        _OPEN.discard(self)
        with contextlib.suppress(Exception):        # the last collective's keys, if ours
            if self._store is not None:
                self._empty_trash()
        self.transports.close()
        self.transports.links.close()       # links parked at an epoch change, not taken up
        if self._joined is not None and self._store is not None and not self.elastic:
            retire(self._store, self._joined)       # an elastic world outlives its members
        self._store = None
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> World:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:     # the peers' error names why this process left
            self._why = f" on {type(exc).__name__}: {str(exc)[:500]}"
        self.close()

    def __repr__(self) -> str:
        return (f"World(world_id={self._world_id!r}, address={self._address!r}, "
                f"process_index={self.process_index}, num_processes={self.num_processes}, "
                f"rank_ids={list(self.rank_ids)}, num_ranks={self.num_ranks})")
