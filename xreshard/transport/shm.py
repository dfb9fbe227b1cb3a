"""The ``shm`` transport: CPU buffers between processes of one host through POSIX shared memory.

Decision record: gloo over TCP loopback moves 2-8 GB/s on a host whose memcpy does ~17 GB/s,
because every byte crosses the kernel's socket buffers twice. Processes of one host can
instead share pages. The sender exposes what it sends in a POSIX shared-memory segment and
the receiver copies it straight into its receive buffer (the destination view itself when
the executor receives in place), one copy in all:

- a send buffer that lives in one of this transport's segments (staging from
  :meth:`ShmTransport.alloc`) is exposed where it is;
- a contiguous source buffer in the sender's private memory (a JAX shard, a torch
  parameter: neither can be moved into a POSIX segment) is exposed in place too: the
  receiver reads it with ``process_vm_readv`` (Linux cross-memory attach, the one-copy path
  of MPI's shared-memory transports), straight into its receive buffer. The world probes
  it per pair at creation (seccomp, ptrace policy or pid namespaces may refuse it);
- only where that probe failed is the buffer copied into the segment this process keeps
  for that peer (two copies: into the segment, out of it).

The receive buffer may be a destination's own region, a strided view whose rows are
contiguous (a row-parallel shard's half of each row; :meth:`ShmTransport.takes_views`, as
``LocalTransport`` takes them in one process): a pull then hands ``process_vm_readv`` a local
iovec per row (at most ``IOV_MAX`` per call) against the message's one remote iovec, and
a segment's bytes are copied into the rows, so the bytes land once, with no staging and no
unpack by the executor. Only the receiver's side changes: a message is contiguous bytes
on the sender and in the records either way. The kernel pays ~80-100 ns per local iovec,
so for short rows this runs at the staged path's speed (448-byte rows 2.0 against 2.1
GB/s, 1,216-byte 2.5 against 2.3); what it saves is the staging (11.8 MiB per receiver of
the 128 MiB benchmark, 52 MiB at 1 GiB, where receivers spend 5-11% less CPU). A remote
iovec per row instead (whole rows from two messages in one call) measured half as fast:
the kernel pins the remote pages per remote iovec.

Segment names, offsets and sizes (or the pid and address to read) travel through the
world's store as JSON, written after the bytes are in place (the store round trip orders
the write before the receiver's read): one record per message to a peer that copies out of
segments; to a peer that pulls, the records go in batches as the sends are posted (the
first at 1 MiB of messages, each next at four times that, up to 32 MiB; the last, at the
group's exit, says that nothing more comes), so the receiver reads the first messages while
the sender still packs the next ones, and a round of hundreds of messages costs a few store
writes, not one each (nor one at the exit, after all the packing). The receiver reads those
batches ahead on a thread with its own store client (``shm_reader.py``): batch k+1's round
trip runs while it pulls batch k (on a loaded 2-core host a store round trip stalled for 4-7
ms while both receivers pulled; inline, every such stall sat between two pulls). Its ack
stays on the receiving thread: written behind it by the reader (so the receiver unpacks
during the round trip) it reached the sender no sooner (3.6-4.7 ms after the last pull,
inline 0.6-4.9, load 8-10), and the sender's group exit and outcome wait for it. That
protocol (sealed records, round numbers, acks, bounded waits, the dead-peer watcher) is
``peers.py``'s, shared with cuda_ipc; this module decides only where the bytes are and how
they move.

Segments: one per (sender process, receiver process), sized by the largest round and
reused across refits while the sizes stay; a round that needs more spills into a new
segment and the next round gets one segment of the new size. The receiver is the only
reader of its pair segment, so it unlinks the name as soon as it mapped it: from then on
the kernel frees the memory when the last of the two processes unmaps or dies, and a
SIGKILL leaves nothing in ``/dev/shm``. Staging segments from ``alloc`` are read by several
peers, so they keep their name until ``close``; a failure (timeout, dead peer) removes
every name of this world's prefix that this user owns, the dead peer's included.

Names. ``/dev/shm`` is shared by every user of the host (and by containers run with
``--ipc=host``), and any of them can create a name first. So no name can be derived from
what others see: a name is ``/xr<tag>_<process>_<kind><n>_<random>``, where the tag is
drawn by the world's members and exchanged over the signed store (not the probe's name;
it shows once a segment exists) and ``<random>``, 64 bits drawn per segment, is what
nobody can guess; receivers learn names only from the sealed records. A creation that finds its
name taken (``EEXIST``, ``EACCES``: another user got there first) draws another name.
Cleanup unlinks only names this user owns, and a name it cannot remove never replaces the
error that made it clean up.

Safety: a receiver never reads a buffer the sender is still writing (the record is
published after the copy) or has moved on from: a send completes only when the receiver
acknowledged it (the sender's group exit waits for one ack per peer), and each segment
carries in its first 64 bytes the sender's group number, which the record repeats and the
receiver checks before and after its copy. Every wait is bounded by the group's timeout,
and a watcher thread checks the awaited peers' pids and wakes the wait when one died, so
a killed peer raises in about a quarter second, naming it. Pairs route here only when
each process sees the other under the pid and start time it published (the world checks
both ways), so the watcher never looks up a stranger: across pid namespaces (containers
sharing ``/dev/shm`` only) a pid names another process, or none, and such pairs take gloo.

Rejected: copying every private buffer into a segment (measured: the sender's copy makes
a one-sender refit 0.37 of the memcpy bound, the pull 1.0+; pipelined in chunks it still
copies every byte twice, 224 MiB for a 112 MiB refit, with three processes on two cores);
transparent huge pages on either side of the pull (measured no faster, often slower); one
``process_vm_readv`` with an iovec per message of a batch instead of a call each (as
fast); ``vmsplice`` through pipes (one copy too, but pipe-sized chunks and two syscalls per
chunk); ``multiprocessing.shared_memory`` (its resource tracker unlinks and warns about
segments another process created; ``track=False`` needs Python 3.13), so segments are made
with ``_posixshmem`` + ``mmap`` as that module does underneath; readiness flags polled in
the segment itself (faster for tiny messages, but a busy loop on two shared cores, and the
store already gives bounded waits); one segment per message (thousands of mmaps per refit).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import secrets
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .base import TransportError
from .peers import PeerTransport, Recv, Round, alive, process_start_time
from ..dtypes import bits
from .shm_memory import (ALIGN, HEADER_BYTES, MAGIC, SHM_DIR, Segment, as_numpy, can_pull,
                         create_probe, probe_name, probe_path, pull, pull_rows, read_probe,
                         remove_shm, row_runs, shm_names)
from .shm_reader import BatchReader

__all__ = ["ShmTransport", "shm_names", "remove_shm", "HEADER_BYTES", "probe_name", "probe_path",
           "create_probe", "read_probe", "process_start_time", "pull", "can_pull"]

logger = logging.getLogger(__name__)

@dataclass
class _Round(Round):
    used: dict[int, int] = field(default_factory=dict)        # peer -> bytes put in its segment
    # pulling peers: records not yet published, and how many batches went out already
    batch: dict[int, list[list[Any]]] = field(default_factory=dict)
    batch_bytes: dict[int, int] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)


#: a pulling peer's records go out in batches (one store write each) as the sends are
#: posted, so its reads overlap the sender's packing; the first batch is published at
#: this many bytes and each next one at four times the last, up to ``_BATCH_MAX`` (few
#: batches: each costs the receiver a store round trip, which a loaded host makes slow)
_BATCH_FIRST = 1 << 20
_BATCH_MAX = 32 << 20


class ShmTransport(PeerTransport):
    """Grouped point-to-point moves of CPU byte buffers through POSIX shared memory.

    Args:
        tag: the segment name tag: a secret of this world transport, exchanged over the
            signed store (never derived from a name others can see in ``/dev/shm``).
        pull_peers: the peers that can read this process's memory and this process theirs
            with ``process_vm_readv`` (probed both ways by the world; needs their pids).

    The other arguments are ``PeerTransport``'s (store, key, ranks, peers, pids, labels,
    the watcher's ``connect``, the records' ``seal``).
    """

    name = "shm"
    _kind = "shm"

    def __init__(self, store: Any, key: str, tag: str, rank_process: Sequence[int],
                 process_index: int, peers: Sequence[int],
                 pids: Mapping[int, tuple[int, str | None]] | None = None,
                 process_labels: Sequence[str] | None = None, connect: Any = None,
                 pull_peers: Sequence[int] = (), seal: Any = None):
        super().__init__(store, key, rank_process, process_index, peers, pids,
                         process_labels, connect, seal)
        self.prefix = f"xr{tag}_"
        self._out: dict[int, Segment] = {}             # peer -> its pair segment
        self._next_size: dict[int, int] = {}            # peer -> size of its next one
        self._spill: dict[int, list[Segment]] = {}     # this round's overflow segments
        self._want: dict[int, int] = {}                 # peer -> bytes the next round needs
        self._drop: dict[int, list[str]] = {}           # names the peer may unmap
        self._staging: list[Segment] = []              # from alloc(), exposed in place
        self._mapped: dict[str, Segment] = {}          # peers' segments mapped here
        self._num = 0
        self._reader: BatchReader | None = None       # reads pull batches ahead
        self._pull = frozenset(p for p in pull_peers if p in self._pids)
        self.bytes_pulled = 0           # received straight from the sender's memory
        self.bytes_copied_in = 0        # sender-side copies into pair segments
        self.bytes_in_place = 0         # sends exposed where they were (staging)
        self.bytes_received = 0
        self.bytes_into_rows = 0        # received straight into strided rows (takes_views)

    # ------------------------------------------------------------------ segments

    def _new_segment(self, kind: str, size: int) -> Segment:
        self._num += 1
        _unlink_at_exit(self)       # if never closed (an exception on the way out, exit())
        taken = []
        for _ in range(_NAME_TRIES):
            name = f"{self.prefix}{self._me}_{kind}{self._num}_{_random_part()}"
            try:
                return Segment(name, HEADER_BYTES + size, create=True)
            except (FileExistsError, PermissionError) as e:
                # another user (or container) created it first: never ours, draw again
                taken.append(f"{name} ({e.strerror})")
        raise TransportError(f"shm: {_NAME_TRIES} fresh segment names in {SHM_DIR} were all "
                             f"taken ({'; '.join(taken[:3])}, ...): another process is "
                             f"creating names there; set XRESHARD_SHM=0 to use gloo")

    def alloc(self, nbytes: int) -> np.ndarray:
        """A staging buffer in shared memory: sends from it are exposed with no copy.

        Pass as the executor's ``alloc`` (``Executor(..., alloc=transport.alloc)``). The
        memory stays mapped until ``close``.
        """
        self._check_usable()
        seg = self._new_segment("s", max(int(nbytes), 1))
        self._staging.append(seg)
        return seg.arr[HEADER_BYTES:HEADER_BYTES + int(nbytes)]

    @property
    def segment_bytes(self) -> int:
        """Bytes of shared memory this process created and still maps."""
        segs = [*self._out.values(), *self._staging, *(s for v in self._spill.values() for s in v)]
        return sum(s.size for s in segs)

    def _exposed(self, arr: np.ndarray) -> tuple[Segment, int] | None:
        if not self._staging:
            return None
        start = int(arr.ctypes.data)
        for seg in self._staging:
            off = start - seg.address
            if HEADER_BYTES <= off and off + arr.nbytes <= seg.size:
                return seg, off
        return None

    def _place(self, peer: int, arr: np.ndarray) -> tuple[Segment, int, bool]:
        """Copy ``arr`` into this process's segment for ``peer``: (segment, offset, whether
        the receiver unlinks it)."""
        rnd = self._round
        assert rnd is not None
        n = arr.nbytes
        want = self._want.get(peer, 0)
        self._want[peer] = want + _aligned(n)
        seg = self._out.get(peer)
        if seg is None and peer in self._next_size:
            # made when first needed, so its receiver maps and unlinks it this round: a
            # segment made ahead for a round that never comes would outlive a crash
            seg = self._out[peer] = self._new_segment("p", self._next_size.pop(peer))
        used = rnd.used.get(peer, 0)
        if seg is not None and HEADER_BYTES + used + n <= seg.size:
            if used == 0:
                seg.header[1] = self._gen
            rnd.used[peer] = used + _aligned(n)
            off = HEADER_BYTES + used
        else:
            # the round outgrew the pair segment: spill into segments of growing size;
            # the next round gets one segment of this round's total (see _resize)
            spills = self._spill.setdefault(peer, [])
            key = -1 - peer                     # spill fill level, kept beside ``used``
            fill = rnd.used.get(key, 0)
            if not spills or HEADER_BYTES + fill + n > spills[-1].size:
                spills.append(self._new_segment("p", max(n, want)))
                spills[-1].header[1] = self._gen
                fill = 0
            seg = spills[-1]
            off = HEADER_BYTES + fill
            rnd.used[key] = fill + _aligned(n)
        np.copyto(seg.arr[off:off + n], arr, casting="no")
        self.bytes_copied_in += n
        return seg, off, True

    # ------------------------------------------------------------------ posts

    def _peer_of(self, local_rank: int, remote_rank: int, tag: int, what: str) -> int:
        peer = self._remote(local_rank, remote_rank, what)
        if peer not in self._peers:
            raise TransportError(f"shm {what}: rank {remote_rank} is on "
                                 f"{self._labels[peer]}, which shares no memory with this "
                                 f"process (another host); use gloo for that pair")
        if tag < 0:
            raise TransportError(f"shm {what}: tag {tag} is negative")
        return peer

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        rnd = self._open_round("send", src_rank, dst_rank, tag)
        peer = self._peer_of(src_rank, dst_rank, tag, "send")
        self._dup(rnd, ("s", src_rank, dst_rank, tag), "send")
        arr = as_numpy(buf)
        if arr.nbytes == 0:
            return                      # both sides skip: the protocol gives equal lengths
        seq = self._send_seq(rnd, peer)
        where = self._exposed(arr)
        if where is None and peer in self._pull:
            # the receiver reads it where it is; the group's exit waits for its ack, so the
            # buffer stays alive and unchanged until then
            rnd.keep.append(arr)
            self.bytes_in_place += arr.nbytes
            record: dict[str, Any] = {"addr": int(arr.ctypes.data), "n": arr.nbytes,
                                      "gen": self._gen}
        else:
            if where is not None:
                seg, off = where
                seg.header[1] = self._gen
                unlink = False
                self.bytes_in_place += arr.nbytes
            else:
                seg, off, unlink = self._place(peer, arr)
            record = {"seg": seg.name, "size": seg.size, "off": off, "n": arr.nbytes,
                      "gen": self._gen, "unlink": unlink}
        drop = self._drop.pop(peer, None)
        if drop:
            record["drop"] = drop
        if peer in self._pull:
            self._batch(rnd, peer, seq, [src_rank, dst_rank, tag, record])
            return
        key = self._msg_key(seq, src_rank, dst_rank, tag)
        self._store.set(key, self._records.pack("shm", key, seq, record))

    def _batch_key(self, sender: int, receiver: int, seq: int, batch: int) -> str:
        return f"{self._key}/b/{sender}/{receiver}/{seq}/{batch}"

    def _batch(self, rnd: _Round, peer: int, seq: int, message: list[Any]) -> None:
        """Hold ``message`` (``[src, dst, tag, record]``) for a pulling ``peer``; publish the
        held ones as one batch once they reach the batch's size (see ``_BATCH_FIRST``)."""
        held = rnd.batch.setdefault(peer, [])
        held.append(message)
        n = rnd.batch_bytes.get(peer, 0) + message[3]["n"]
        rnd.batch_bytes[peer] = n
        k = rnd.batches.get(peer, 0)
        if n >= min(_BATCH_FIRST << (2 * k), _BATCH_MAX):
            key, value = self._batch_record(rnd, peer, seq, more=True)
            self._store.set(key, value)

    def _batch_record(self, rnd: _Round, peer: int, seq: int, more: bool) -> tuple[str, str]:
        """The next batch of records held for ``peer`` (sealed), emptying what is held;
        ``more`` says whether another batch of this round follows."""
        k = rnd.batches.get(peer, 0)
        rnd.batches[peer] = k + 1
        key = self._batch_key(self._me, peer, seq, k)
        value = self._records.pack("shm", key, seq, {"msgs": rnd.batch.pop(peer, []),
                                                     "more": more})
        rnd.batch_bytes[peer] = 0
        return key, value

    def takes_views(self, src_rank: int, dst_rank: int) -> bool:
        """Whether a receive ``src_rank -> dst_rank`` may be a strided host view whose last
        dim is contiguous (a row range of a wider destination, see ``base.takes_view``): for
        every pair this process receives through shm. The bytes land in its rows in C
        order with no staging: pulled with a local iovec per row (``pull_rows``), or copied
        out of the sender's segment into the rows. The sender and the records do not change
        (a message is contiguous bytes either way)."""
        n = len(self._rank_process)
        return (0 <= src_rank < n and 0 <= dst_rank < n
                and self._rank_process[dst_rank] == self._me
                and self._rank_process[src_rank] in self._peers)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        rnd = self._open_round("recv", src_rank, dst_rank, tag)
        peer = self._peer_of(dst_rank, src_rank, tag, "recv")
        self._dup(rnd, ("r", src_rank, dst_rank, tag), "recv")
        arr = as_numpy(buf, rows=True)
        if not arr.flags.writeable:
            raise TransportError(f"shm recv {src_rank}->{dst_rank} tag {tag}: the receive "
                                 f"buffer is read-only")
        if arr.nbytes == 0:
            return
        self._add_recv(rnd, Recv(arr, src_rank, dst_rank, tag, peer))

    # ------------------------------------------------------------------ the group

    def group(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Collect posts (sends are copied and published as they are posted; to a pulling
        peer, in batches); on exit publish what is held, land every receive (read in place
        or copied out of its sender's segment) as its record arrives, acknowledge, and wait
        for the acks of this process's sends, all within ``timeout`` s of entering.

        Raises:
            TransportTimeout: a peer did not publish or acknowledge in time; names it, the
                ranks and the tag. The transport is unusable afterwards (as after any
                failure), and this world's segments are removed.
            TransportError: a peer died (its pid is gone), a record disagrees with the
                receive (size, sequence), or the transport was closed.
        """
        return self._group(timeout)

    def _new_round(self, deadline: float) -> _Round:
        return _Round(deadline=deadline)

    def _complete(self, rnd: _Round, timeout: float) -> None:
        # the last batch to every pulling peer this round sent to (an empty one says that
        # nothing more comes), with the records held back, in one store round trip
        for peer in rnd.send_seq:
            if peer in self._pull:
                key, value = self._batch_record(rnd, peer, rnd.send_seq[peer], more=False)
                rnd.pending[key] = value
        self._publish(rnd)
        by_peer: dict[int, list[Recv]] = {}
        for r in rnd.recvs:
            by_peer.setdefault(r.peer, []).append(r)
        for peer, recvs in by_peer.items():
            if peer in self._pull:
                self._receive_batches(peer, recvs, rnd, timeout)
            else:
                for r in recvs:
                    self._receive(r, rnd, timeout)
            self._ack(peer, rnd.recv_seq[peer])
        self._await_acks(rnd, timeout)
        self._resize(rnd)

    def _receive_batches(self, peer: int, recvs: list[Recv], rnd: _Round,
                         timeout: float) -> None:
        """Every receive from pulling ``peer``: its batches in order, each message landed
        as its batch arrives (while the sender still packs the next ones). The batches are
        read ahead on the transport's reader thread (its own store client), so the store's
        round trip for batch k+1 runs while this thread pulls batch k's bytes."""
        seq = rnd.recv_seq[peer]
        want = {(r.src, r.dst, r.tag): r for r in recvs}
        with self._read_ahead(peer, seq, rnd, timeout) as batches:
            for rec in batches:
                for src, dst, tag, msg in rec["msgs"]:
                    r = want.pop((src, dst, tag), None)
                    if r is None:
                        raise TransportError(f"shm recv from {self._labels[peer]}: it sent "
                                             f"{src}->{dst} tag {tag} (round {seq}), which "
                                             f"this process did not post a receive for")
                    self._land(r, msg)
        if want:
            missing = ", ".join(f"{s}->{d} tag {t}" for s, d, t in sorted(want)[:5])
            raise TransportError(f"shm recv from {self._labels[peer]}: its round {seq} ended "
                                 f"without {len(want)} message(s) this process posted a "
                                 f"receive for ({missing})")

    def _read_batch(self, store: Any, peer: int, seq: int, k: int, rnd: _Round,
                    timeout: float, stop: threading.Event | None = None
                    ) -> dict[str, Any] | None:
        """Wait for batch ``k`` of ``peer``'s round ``seq`` on ``store`` and open it; None
        when ``stop`` was set meanwhile (the reader's wake-up, see ``BatchReader``)."""
        key = self._batch_key(peer, self._me, seq, k)
        self._wait([key], peer, rnd.deadline, timeout,
                   f"batch {k} of the messages to this process (round {seq}) from", store)
        if stop is not None and stop.is_set():
            return None
        raw = store.get(key)
        self._watch.discard([key])
        rec = self._records.unpack("shm", key, seq, peer, raw, self._watch.dead)
        if "dead" in rec:     # the watcher's wake-up; _wait raised unless it raced
            raise TransportError(f"shm: {self._labels[peer]} (pid {rec['dead']}) died")
        return rec

    def _read_ahead(self, peer: int, seq: int, rnd: _Round,
                    timeout: float) -> contextlib.AbstractContextManager[Iterator[dict]]:
        """``peer``'s batches of round ``seq`` in order, read on the reader thread; inline
        (each one waited for when the last is landed) without a second store client."""
        if self._reader is None and self._connect is not None:
            try:
                self._reader = BatchReader(self._connect(), self.name)
            except Exception:   # noqa: BLE001 - reading inline works, only later
                logger.debug("shm: no second store client; batches read inline",
                             exc_info=True)
                self._connect = None
        if self._reader is None:
            return contextlib.nullcontext(self._inline_batches(peer, seq, rnd, timeout))
        return self._reader.read(
            lambda k: self._batch_key(peer, self._me, seq, k),
            lambda client, k, stop: self._read_batch(client, peer, seq, k, rnd, timeout, stop),
            self._wake, rnd.deadline, f"batches of round {seq} from {self._labels[peer]}")

    def _wake(self, key: str) -> None:
        """Wake the reader's wait on ``key`` (a marker it never opens), and drop the key."""
        with contextlib.suppress(Exception):       # the store is gone: it waits its deadline
            self._store.set(key, json.dumps({"stop": True}))
            self._watch.discard([key])

    def _inline_batches(self, peer: int, seq: int, rnd: _Round,
                        timeout: float) -> Iterator[dict]:
        k = 0
        while True:
            rec = self._read_batch(self._store, peer, seq, k, rnd, timeout)
            assert rec is not None
            yield rec
            if not rec["more"]:
                return
            k += 1

    def _receive(self, r: Recv, rnd: _Round, timeout: float) -> None:
        seq = rnd.recv_seq[r.peer]
        key = self._msg_key(seq, r.src, r.dst, r.tag)
        self._wait([key], r.peer, rnd.deadline, timeout,
                   f"message {r.src}->{r.dst} tag {r.tag} (round {seq}) from")
        raw = self._store.get(key)
        self._watch.discard([key])
        rec = self._records.unpack("shm", key, seq, r.peer, raw, self._watch.dead)
        if "dead" in rec:     # the watcher's wake-up; _wait raised unless it raced a record
            raise TransportError(f"shm: {self._labels[r.peer]} (pid {rec['dead']}) died")
        self._land(r, rec)

    def _land(self, r: Recv, rec: Mapping[str, Any]) -> None:
        """Copy message ``rec`` (its record) into receive ``r``'s buffer."""
        where = f"shm recv {r.src}->{r.dst} tag {r.tag} from {self._labels[r.peer]}"
        for name in rec.get("drop", ()):
            seg = self._mapped.pop(name, None)
            if seg is not None:
                seg.close()
        if rec["n"] != r.buf.nbytes:
            raise TransportError(f"{where}: the sender posted {rec['n']} bytes, the receive "
                                 f"buffer has {r.buf.nbytes}")
        if "addr" in rec:
            if r.peer not in self._pull:
                raise TransportError(f"{where}: the sender asks to be read in place, but this "
                                     f"pair was not probed for process_vm_readv")
            try:
                if r.buf.flags.c_contiguous:
                    pull(self._pids[r.peer][0], int(r.buf.ctypes.data), rec["addr"], rec["n"])
                else:       # a destination's rows: the kernel scatters into them
                    pull_rows(self._pids[r.peer][0], row_runs(r.buf), rec["addr"], rec["n"])
                    self.bytes_into_rows += rec["n"]
            except OSError as e:
                raise TransportError(f"{where}: reading {rec['n']} bytes in place failed "
                                     f"(did the sender die?): {e}") from e
            self.bytes_received += rec["n"]
            self.bytes_pulled += rec["n"]
            return
        seg = self._mapped.get(rec["seg"])
        if seg is None or seg.size != rec["size"]:
            try:
                seg = Segment(rec["seg"], rec["size"], create=False)
            except FileNotFoundError as e:
                raise TransportError(f"{where}: segment {rec['seg']!r} is gone (the sender "
                                     f"closed or failed)") from e
            self._mapped[rec["seg"]] = seg
            if rec.get("unlink"):
                seg.unlink()        # we are its only reader: no name left behind from now on
        self._check_gen(seg, rec, where, "before")
        off, n = rec["off"], rec["n"]
        if r.buf.flags.c_contiguous:
            np.copyto(r.buf, seg.arr[off:off + n], casting="no")
        else:               # a destination's rows, in their C order
            out = bits(r.buf)
            np.copyto(out, seg.arr[off:off + n].view(out.dtype).reshape(out.shape),
                      casting="no")
            self.bytes_into_rows += n
        self._check_gen(seg, rec, where, "after")
        self.bytes_received += n

    @staticmethod
    def _check_gen(seg: Segment, rec: Mapping[str, Any], where: str, when: str) -> None:
        magic, gen = (int(x) for x in seg.header)
        if magic != MAGIC or gen != rec["gen"]:
            raise TransportError(f"{where}: segment {rec['seg']!r} holds sender round {gen} "
                                 f"{when} the copy, the record says {rec['gen']} (the sender "
                                 f"moved on; a protocol bug)")

    def _resize(self, rnd: _Round) -> None:
        """After a round that spilled: one segment of the new size from the next round on
        (every receiver acknowledged, so none reads the old ones any more)."""
        for peer, spills in self._spill.items():
            if not spills:
                continue
            old = self._out.pop(peer, None)
            drop = [s.name for s in spills] + ([old.name] if old is not None else [])
            for s in spills + ([old] if old is not None else []):
                s.unlink()
                s.close()
            self._drop.setdefault(peer, []).extend(drop)
            self._next_size[peer] = self._want.get(peer, 0)
        self._spill.clear()
        self._want.clear()

    # ------------------------------------------------------------------ lifetime

    def _fail(self, why: str) -> None:
        self._broken = why
        self._release()
        # a dead peer cannot remove its segments; the failure is the world's, so every
        # name of this world's prefix goes (live peers fail too and stop using them)
        remove_shm(self.prefix)

    def _release(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        segs = [*self._out.values(), *self._staging, *(s for v in self._spill.values() for s in v)]
        for s in segs:
            s.unlink()
        for s in [*segs, *self._mapped.values()]:
            s.close()
        self._out.clear()
        self._spill.clear()
        self._staging.clear()
        self._mapped.clear()

    def close(self) -> None:
        """Unmap and unlink every segment this process made; remove those of dead peers."""
        if not self._closing():
            return
        self._release()
        self.remove_own_names()
        for peer in self._peers:
            pid = self._pids.get(peer)
            if pid is not None and not alive(*pid):
                remove_shm(f"{self.prefix}{peer}_")

    def remove_own_names(self) -> None:
        """Unlink the names of every segment this process made (mapped ones stay valid)."""
        remove_shm(f"{self.prefix}{self._me}_")

    def __repr__(self) -> str:
        return (f"ShmTransport(prefix={self.prefix!r}, process={self._me}, "
                f"peers={sorted(self._peers)})")


_LIVE: weakref.WeakSet[ShmTransport] = weakref.WeakSet()


def _unlink_at_exit(transport: ShmTransport) -> None:
    """Remember ``transport`` so that a process exiting without closing it (an exception on
    the way out) still removes the names of the segments it made. Only SIGKILL skips this;
    then the receivers (who unlink what they mapped) and the survivors' failure path cover
    it. The exit hook is registered on the first segment, not at import."""
    if not _LIVE and not getattr(_unlink_at_exit, "registered", False):
        atexit.register(_at_exit)
        _unlink_at_exit.registered = True   # type: ignore[attr-defined]
    _LIVE.add(transport)


def _at_exit() -> None:
    for t in list(_LIVE):
        with contextlib.suppress(Exception):
            t.remove_own_names()


_NAME_TRIES = 8


def _random_part() -> str:
    """The unguessable part of a segment name (64 bits)."""
    return secrets.token_hex(8)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
