"""The peer protocol under the ``shm`` and ``cuda_ipc`` transports: records through the
world's store, per-pair round numbers, acknowledgements, and a watcher for dead peers.

Decision record: both same-host transports move bytes without a communicator (the
receiver reads the sender's memory: a shared segment, a ``process_vm_readv``, a CUDA IPC
mapping), so both need the same small protocol around the bytes, and only the bytes differ.
It lives here once:

- **Records.** What a receiver needs (segment and offset, pid and address, IPC handle) is
  a JSON record in the store under ``<key>/m/<src>/<dst>/<tag>/<round>``, sealed with the
  world's ``Seal`` and bound to its key, round and writer (``Records``).
- **Rounds and acks.** Each ordered pair of processes numbers the groups in which it
  exchanged (``_seq_out``/``_seq_in``); a receiver acknowledges a round under
  ``<key>/a/<sender>/<receiver>/<round>`` once its copies have landed, and a sender's group
  exit waits for one ack per peer, so no buffer is reused while a peer still reads it. A
  failed receiver answers its pending acks with the error, so its senders raise at once.
- **Bounded waits that notice death and failure.** Every wait ends at the group's
  deadline; a watcher thread (``Watch``) checks the awaited peers' pids and wakes a wait
  on one that died, so a killed peer raises in about a quarter second, naming it. Pids are
  only watched for peers this process sees as themselves (the world checks pid and start
  time both ways: in another pid namespace a pid names a stranger). A peer whose group
  failed publishes it (sealed, ``<key>/failed/<process>``) and the watcher wakes waits on
  it too, pids or not, so the processes waiting for its next posts raise with its cause
  instead of at their timeout.

A transport subclasses ``PeerTransport`` and supplies its posts, its ``_complete`` (the
bytes) and, if it holds more than the protocol's state, ``_fail`` and ``close``.

Rejected: a copy of this protocol per transport (the two copies had already drifted: one
wrapped its dead-peer error in a "store failed" one); acks through a collective barrier
(every process would wait for the slowest pair, and a barrier has no per-peer timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..errors import CommunicationError
from .base import TransportError, TransportTimeout, format_seconds

__all__ = ["PeerTransport", "Records", "Watch", "Recv", "Round", "process_start_time", "alive",
           "own_start_time", "visible"]

logger = logging.getLogger(__name__)


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def process_start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (tells a live pid from a reused one); None if unknown."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def own_start_time() -> str | None:
    """This process's start time as ``process_start_time`` reads it for others. Read
    through ``/proc/self``: in a pid namespace whose ``/proc`` is the parent's,
    ``/proc/<getpid()>`` is another process."""
    fields = _stat_fields("self")
    return fields[19] if fields is not None and len(fields) > 19 else None


def visible(pid: Any, start: Any, mapped: str | None = None) -> bool:
    """Whether this process sees the peer that published ``pid`` and ``start`` (its own
    ``own_start_time``) as that very process: ``/proc/<pid>`` here is a live process with
    that start time, and, when ``mapped`` (a file the peer maps now) is given and the
    peer's maps are readable, it maps that file.

    False across pid namespaces (another process, or none, has that pid here), so a
    watcher armed only for visible peers never declares a live peer dead. Start times are
    clock ticks since boot, the same in every pid namespace of the host; the maps check
    rules out another process that started in the same tick with the same pid.
    """
    if not isinstance(pid, int) or not isinstance(start, str):
        return False
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X") or len(fields) <= 19 or fields[19] != start:
        return False
    if mapped is None:
        return True
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(mapped in line for line in f)
    except OSError:     # not readable (hidepid, another user): pid and start time decide
        return True


def alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs; zombies count as dead."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return start is None or (len(fields) > 19 and fields[19] == start)


class Records:
    """The JSON records a transport writes into the store, sealed with the world's ``Seal``
    when it has one (signed with the world's token: a process without it can neither forge
    a record nor move one to another message, round or writer) and bound to their key."""

    def __init__(self, seal: Any, me: int):
        self.seal = seal
        self.me = me

    def pack(self, kind: str, key: str, seq: int, obj: Mapping[str, Any]) -> str:
        body = json.dumps({"key": key, **obj})
        return body if self.seal is None else self.seal.seal(kind, seq, self.me, body)

    def unpack(self, kind: str, key: str, seq: int, writer: int, raw: bytes | str,
               dead: Mapping[str, int]) -> dict[str, Any]:
        if key in dead:     # our watcher's wake-up overwrote it: the writer died
            return {"dead": dead[key]}
        if self.seal is None:
            rec = json.loads(raw)
        else:
            rec = self.seal.open(raw, key=key, kind=kind, op=seq, process=writer)
        if not isinstance(rec, dict) or rec.get("key", key) != key:
            raise TransportError(f"store key {key!r} holds a record written for "
                                 f"{rec.get('key') if isinstance(rec, dict) else rec!r}: "
                                 f"replayed or misplaced")
        return rec


class Watch:
    """Wakes a store wait on a peer that died or failed: a thread checks the awaited peers'
    pids (``{"dead": pid}``) and, with ``failed``, whether they published a failure
    (``{"failed": message}``: a peer that raised in a group no longer posts, and its
    receivers would otherwise wait for its next round until their timeout), and sets the
    awaited keys to that through its own store client (the waiting client is blocked inside
    ``wait``). The same thread deletes the keys this process has consumed (``discard``),
    off the critical path, so a long-lived world does not grow the store.

    Args:
        failed: ``failed(client, peer)`` -> the failure ``peer`` published, or None. It
            does not depend on pids, so peers without one (another pid namespace) are
            watched for it too.
    """

    INTERVAL_S = 0.25

    def __init__(self, connect: Any, pids: Mapping[int, tuple[int, str | None]], name: str,
                 failed: Any = None):
        self._connect = connect
        self._pids = pids
        self._failed = failed
        self._name = name
        self._active: dict[str, int] = {}
        self._trash: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.dead: dict[str, int] = {}
        self.failed: dict[str, str] = {}

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"xreshard-{self._name}-watch")
            self._thread.start()

    @contextlib.contextmanager
    def waiting(self, keys: list[str], peer: int) -> Iterator[None]:
        if self._connect is None or (peer not in self._pids and self._failed is None):
            yield
            return
        with self._lock:
            for key in keys:
                self._active[key] = peer
            self._start()
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._active.pop(key, None)

    def discard(self, keys: list[str]) -> None:
        """Delete ``keys`` from the store soon (they were read and are never read again)."""
        if self._connect is None:
            return      # no second client: the keys stay (tests with fake stores)
        with self._lock:
            self._trash.extend(keys)
            self._start()

    def _client_or_none(self) -> Any:
        if self._client is None:
            try:
                self._client = self._connect()
            except Exception:   # noqa: BLE001 - the waiter still has its timeout
                logger.debug("%s watcher could not connect to the store", self._name,
                             exc_info=True)
        return self._client

    def _loop(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            with self._lock:
                active = list(self._active.items())
                trash, self._trash = self._trash, []
            client = self._client_or_none() if (trash or active) else None
            # without a client (the store did not answer) the trash is dropped and the
            # waiters keep their timeout; a dead pid is still recorded
            if client is not None:
                for key in trash:
                    with contextlib.suppress(Exception):
                        client.delete_key(key)
            failures: dict[int, str | None] = {}
            for key, peer in active:
                try:
                    pid = self._pids.get(peer)
                    if pid is not None and not alive(*pid):
                        self.dead[key] = pid[0]
                        if client is not None:
                            client.set(key, json.dumps({"dead": pid[0]}))
                        continue
                    if self._failed is None or client is None:
                        continue
                    if peer not in failures:        # one look per peer and interval
                        failures[peer] = self._failed(client, peer)
                    why = failures[peer]
                    if why is not None:
                        self.failed[key] = why
                        client.set(key, json.dumps({"failed": why}))
                except Exception:   # noqa: BLE001 - the waiter still has its timeout
                    logger.debug("%s watcher could not wake %s", self._name, key,
                                 exc_info=True)

    def stop(self) -> None:
        """Stop the thread; delete what is still in the trash (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.INTERVAL_S + 1)
        with self._lock:
            trash, self._trash = self._trash, []
        client = self._client_or_none() if trash else None
        if client is not None:
            for key in trash:
                with contextlib.suppress(Exception):
                    client.delete_key(key)


@dataclass
class Recv:
    """A posted receive: ``buf`` gets ``src``'s message ``tag`` from process ``peer``."""
    buf: Any
    src: int
    dst: int
    tag: int
    peer: int


@dataclass
class Round:
    """One group's posts; a transport extends it with what its bytes need."""
    deadline: float
    recvs: list[Any] = field(default_factory=list)
    send_seq: dict[int, int] = field(default_factory=dict)    # peer -> seq this round
    recv_seq: dict[int, int] = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)     # records to publish at exit
    keep: list[Any] = field(default_factory=list)             # buffers peers read from
    keys: set[tuple] = field(default_factory=set)             # (kind, src, dst, tag) posted


class PeerTransport:
    """The protocol state and steps shared by the same-host transports (see the module).

    Args:
        store: the world's store (``TCPStore``-like: set/get/wait/multi_get/multi_set).
        key: a key prefix unique to this transport (the world's collective prefix).
        rank_process: ``rank_process[rank]`` is the process position of world ``rank``.
        process_index: this process's position.
        peers: the process positions this transport may exchange with (same host).
        pids: ``{process: (pid, start time or None)}`` for the liveness checks; a process
            missing here is only waited for until the timeout.
        process_labels: a name per process position, for error messages.
        connect: makes another client of the store, for the thread that wakes a wait on
            a peer that died (and for a transport's own reader threads). Without it a dead
            peer is noticed at the timeout.
        seal: the world's ``xreshard.runtime.store.Seal``: records are signed and bound to their
            key, round and writer (None: plain JSON, for tests).
    """

    name = "peer"
    _kind = "peer"      # the records' kind for the seal; acks are "<kind>-ack"

    def __init__(self, store: Any, key: str, rank_process: Sequence[int], process_index: int,
                 peers: Sequence[int], pids: Mapping[int, tuple[int, str | None]] | None,
                 process_labels: Sequence[str] | None, connect: Any, seal: Any):
        self._store = store
        self._records = Records(seal, process_index)
        self._key = key
        self._rank_process = tuple(rank_process)
        self._me = process_index
        self._peers = frozenset(peers)
        self._pids = dict(pids or {})
        n = max(self._rank_process, default=0) + 1
        self._labels = tuple(process_labels or (f"process {p}" for p in range(n)))
        self._connect = connect
        self._watch = Watch(connect, self._pids, self.name, self._published_failure)
        self._gen = 0                                   # groups this process ran
        self._seq_out: dict[int, int] = {}              # peer -> rounds it acknowledged
        self._seq_in: dict[int, int] = {}               # peer -> rounds we acknowledged
        self._round: Round | None = None
        self._broken: str | None = None

    # ------------------------------------------------------------------ posts

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportError(f"{self.name} transport unusable after an earlier failure: "
                                 f"{self._broken}")

    def _msg_key(self, seq: int, src: int, dst: int, tag: int) -> str:
        return f"{self._key}/m/{src}/{dst}/{tag}/{seq}"

    def _ack_key(self, sender: int, receiver: int, seq: int) -> str:
        return f"{self._key}/a/{sender}/{receiver}/{seq}"

    def _failed_key(self, process: int) -> str:
        return f"{self._key}/failed/{process}"

    def _published_failure(self, client: Any, peer: int) -> str | None:
        """What ``peer`` published when its transport failed (through ``client``), if it
        did and the record is its own (sealed: an outsider cannot fake one)."""
        key = self._failed_key(peer)
        if not client.check([key]):
            return None
        try:
            rec = self._records.unpack(self._kind + "-failed", key, 0, peer, client.get(key),
                                       {})
        except (CommunicationError, ValueError):
            return None
        error = rec.get("error")
        return error if isinstance(error, str) else None

    def _owns(self, rank: int) -> bool:
        """Whether this transport may post for ``rank`` here (its process is this one)."""
        return self._rank_process[rank] == self._me

    _owned = "in this process"      # what ``_owns`` checks, for its error

    def _remote(self, local_rank: int, remote_rank: int, what: str) -> int:
        """The process of ``remote_rank``, after checking both ranks, that this process
        owns ``local_rank`` and that the pair spans two processes."""
        n = len(self._rank_process)
        if not (0 <= local_rank < n and 0 <= remote_rank < n):
            raise TransportError(f"{self.name} {what}: ranks {local_rank}, {remote_rank} not "
                                 f"in 0..{n - 1}")
        if not self._owns(local_rank):
            raise TransportError(f"{self.name} {what}: rank {local_rank} is not {self._owned} "
                                 f"({self._labels[self._me]})")
        peer = self._rank_process[remote_rank]
        if peer == self._me:
            raise TransportError(f"{self.name} {what}: ranks {local_rank} and {remote_rank} "
                                 f"are both in this process; move them with the local "
                                 f"transport")
        return peer

    def _open_round(self, what: str, src: int, dst: int, tag: int) -> Any:
        if self._round is None:
            raise TransportError(f"{self.name} {what} {src}->{dst} tag {tag} posted outside "
                                 f"`with transport.group(timeout=...)`")
        return self._round

    def _dup(self, rnd: Round, key: tuple, what: str) -> None:
        if key in rnd.keys:
            raise TransportError(f"{self.name} {what} {key[1]}->{key[2]} tag {key[3]} posted "
                                 f"twice in one group")
        rnd.keys.add(key)

    def _send_seq(self, rnd: Round, peer: int) -> int:
        """The round number of this group's sends to ``peer`` (the same for all of them)."""
        seq = rnd.send_seq.get(peer)
        if seq is None:
            seq = rnd.send_seq[peer] = self._seq_out.get(peer, 0) + 1
        return seq

    def _add_recv(self, rnd: Round, recv: Recv) -> None:
        if recv.peer not in rnd.recv_seq:
            rnd.recv_seq[recv.peer] = self._seq_in.get(recv.peer, 0) + 1
        rnd.recvs.append(recv)

    # ------------------------------------------------------------------ the group

    def _new_round(self, deadline: float) -> Round:
        return Round(deadline=deadline)

    def _complete(self, rnd: Any, timeout: float) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _group(self, timeout: float) -> Iterator[None]:
        """The frame of ``group``: collect posts, then ``_complete`` them within ``timeout``
        s of entering; any failure makes the transport unusable (``_fail``)."""
        self._check_usable()
        if self._round is not None:
            raise TransportError(f"{self.name} transport groups do not nest")
        self._gen += 1
        self._round = self._new_round(time.monotonic() + timeout)
        try:
            yield
            rnd = self._round
        except BaseException:
            # posts of a block that raised are never completed: peers time out like with
            # gloo; our published records must not be read after we reuse the buffers
            self._cleanup(None, "a group's block raised before its posts completed")
            raise
        finally:
            self._round = None
        try:
            self._complete(rnd, timeout)
        except BaseException as e:
            self._cleanup(rnd, str(e), f"{type(e).__name__}: {e}")
            raise

    def _cleanup(self, rnd: Round | None, why: str, tell: str | None = None) -> None:
        """After a failure: publish it (peers waiting for this process's next posts learn
        it within a watcher interval), tell the senders (``tell``), make the transport
        unusable and release what it holds. Nothing raised here replaces the failure that
        called it (a segment name another user owns, a store gone): it is logged."""
        key = self._failed_key(self._me)
        steps = [lambda: self._fail(why)]
        if rnd is not None and tell is not None:
            steps.insert(0, lambda: self._tell_senders(rnd, tell))
        if self._store is not None:
            steps.insert(0, lambda: self._store.set(key, self._records.pack(
                self._kind + "-failed", key, 0, {"error": f"{self._labels[self._me]}: {why}"})))
        for step in steps:
            try:
                step()
            except Exception:   # noqa: BLE001 - the caller raises the first cause
                logger.warning("%s: cleanup after a failure (%s) failed too; raising the "
                               "failure", self.name, why, exc_info=True)
        self._broken = self._broken or why

    def _fail(self, why: str) -> None:
        self._broken = why

    def abort(self, why: str) -> None:
        """This process failed in the middle of a call, maybe between groups (its executor
        raised): publish it as a failed group does, so a peer waiting for this process's
        next posts or acks raises within a watcher interval instead of at its timeout; the
        transport is unusable afterwards."""
        if self._broken is None:
            self._cleanup(None, why)

    def _publish(self, rnd: Round) -> None:
        """Write the records held back for the group's exit (one store round trip)."""
        if rnd.pending:
            self._store.multi_set(list(rnd.pending), list(rnd.pending.values()))

    def _fetch(self, keys: list[str], peer: int, seq: int, rnd: Round,
               timeout: float) -> list[Any]:
        """Wait for the records ``keys`` of ``peer``'s round ``seq``; their raw values."""
        self._wait(keys, peer, rnd.deadline, timeout,
                   f"{len(keys)} message(s) to this process (round {seq}) from")
        return self._store.multi_get(keys)

    def _ack(self, peer: int, seq: int) -> None:
        """Tell ``peer`` that its round ``seq`` has landed here."""
        key = self._ack_key(peer, self._me, seq)
        self._store.set(key, self._records.pack(self._kind + "-ack", key, seq, {}))
        self._seq_in[peer] = seq

    def _tell_senders(self, rnd: Round, why: str) -> None:
        """A failed receiver answers its senders' pending acks with the error, so they raise
        at once instead of at the timeout."""
        for peer, seq in rnd.recv_seq.items():
            if self._seq_in.get(peer) == seq:
                continue        # acknowledged already
            key = self._ack_key(peer, self._me, seq)
            with contextlib.suppress(Exception):
                self._store.set(key, self._records.pack(
                    self._kind + "-ack", key, seq, {"error": f"{self._labels[self._me]}: {why}"}))

    def _await_acks(self, rnd: Round, timeout: float) -> None:
        """Wait for every peer this round sent to to acknowledge it."""
        for peer, seq in sorted(rnd.send_seq.items()):
            key = self._ack_key(self._me, peer, seq)
            what = f"the ack of this process's sends (round {seq}) from"
            self._wait([key], peer, rnd.deadline, timeout, what)
            ack = self._records.unpack(self._kind + "-ack", key, seq, peer,
                                       self._store.get(key), self._watch.dead)
            self._watch.discard([key])
            if "error" in ack:
                raise TransportError(f"{self.name}: {what} {self._labels[peer]}: the receiver "
                                     f"failed: {ack['error']}")
            if "dead" in ack:
                raise TransportError(f"{self.name}: {what} {self._labels[peer]} never came: "
                                     f"that process (pid {ack['dead']}) died")
            self._seq_out[peer] = seq

    def _wait(self, keys: list[str], peer: int, deadline: float, timeout: float,
              what: str, store: Any = None) -> None:
        """Wait for ``keys`` until ``deadline``; the watcher wakes us if ``peer`` dies.
        ``store``: the client to wait on (a reader thread's own; default the transport's)."""
        left = deadline - time.monotonic()
        if left > 0:
            with self._watch.waiting(keys, peer):
                try:
                    (store or self._store).wait(keys, datetime.timedelta(seconds=left))
                    ok = True
                except RuntimeError as e:
                    msg = str(e).lower()
                    if "timeout" not in msg and "timed out" not in msg:
                        raise TransportError(f"{self.name}: the store failed while waiting "
                                             f"for {what} {self._labels[peer]}: {e}") from e
                    ok = False
            if ok:
                dead = next((self._watch.dead[k] for k in keys if k in self._watch.dead), None)
                if dead is not None:
                    raise TransportError(f"{self.name}: {what} {self._labels[peer]} never "
                                         f"came: that process (pid {dead}) died")
                failed = next((self._watch.failed[k] for k in keys
                               if k in self._watch.failed), None)
                if failed is not None:
                    raise TransportError(f"{self.name}: {what} {self._labels[peer]} never "
                                         f"came: that process failed: {failed}")
                return
        raise TransportTimeout(f"{self.name}: {what} {self._labels[peer]} did not arrive "
                               f"within {format_seconds(timeout)}: the peer never posted its "
                               f"side or is stuck")

    # ------------------------------------------------------------------ lifetime

    def _closing(self) -> bool:
        """Mark the transport closed and stop the watcher; False if it was closed already."""
        if self._broken == "closed":
            return False
        self._broken = "closed"
        self._watch.stop()
        return True
