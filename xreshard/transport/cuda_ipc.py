"""The ``cuda_ipc`` transport: device buffers between processes on one GPU (or GPUs with peer
access) through CUDA IPC handles.

Decision record: NCCL (before 2.30) refuses two ranks on one device, so a trainer and an
inference engine colocated on one GPU had no path at all; and between peer-accessible GPUs
of one host a direct device-to-device copy needs no communicator. The sender exports what
it sends as a CUDA IPC memory handle (CuPy's runtime ``ipcGetMemHandle``) and the receiver
maps it (``ipcOpenMemHandle``) and copies straight into its receive buffer with
``memcpyAsync`` on its own stream: one device-to-device copy in all.

- **Few handles.** A handle names a whole allocation, not a tensor: the sender exports one
  handle per allocation its sends live in (the executor's staging, JAX's BFC pool, torch's
  caching-allocator segments) and every message carries (handle, offset). Awex exhausted
  the driver with one handle per tensor; here an 8 GiB model in a handful of pools opens a
  handful of handles. The sender's exports are cached by CUDA buffer id
  (``CU_POINTER_ATTRIBUTE_BUFFER_ID``, never reused in a process: a freed and reallocated
  buffer gets a new id, hence a new handle).
- **Memory without a handle is staged.** ``cudaIpcGetMemHandle`` works on ``cudaMalloc``
  allocations only (CUDA Runtime API, cudaIpcGetMemHandle); torch's
  ``expandable_segments:True`` (cuMemCreate) and ``cudaMallocAsync`` pools have none. Such
  a send is copied on the sender's stream into xreshard's own staging (a plain
  ``cudaMalloc``, kept per device across groups) and exported from there: one more
  device copy, a warning once, never a refusal. A send that cannot be moved at all
  publishes an error record, so its receivers raise at once instead of at the timeout.
- **Mappings live one group.** CUDA leaves use of a mapping undefined once the exporter
  frees the memory (cudaIpcGetMemHandle: "calling cudaFree on an exported memory region
  before calling cudaIpcCloseMemHandle in the importing context will result in undefined
  behavior"), and a sender frees at will between refits (``empty_cache``, an OOM retry).
  So the receiver closes every mapping it opened in a group once that group's copies have
  finished and before it acknowledges: after the ack the sender may free anything. A group
  needing more than ``max_open`` mappings waits for its copies so far before closing any.
  An allocation is opened once per process, whichever of its GPUs copies from it (CUDA
  lets one context per device open a process's handle: cuIpcOpenMemHandle).
- **Ordering with events, not syncs.** The sender imports each buffer through DLPack with
  its stream current (the producer's stream is ordered before it, as in the nccl transport)
  and records an interprocess event after it; the receiver's stream waits on that event
  before its copies. The receiver polls its own event with the group's deadline, then
  acknowledges; the sender's group exit waits for the acks, so a buffer is never reused
  while a peer still reads it. A hard CUDA error in that poll raises ``CudaError`` at once
  (the senders hear of it through the acks).
- **A clear refusal.** Ranks on different devices without peer access are refused when
  posted (and "auto" never routes them here: ``select.choose_routes``).

Metadata (handles as hex, offsets, sizes, event handles) travels through the world's store
as JSON, one record per message (zero-byte messages too), published together at the
group's exit, under the peer protocol of ``peers.py`` (sealed records, round numbers, acks,
the dead-peer watcher). Devices are named by their full 16-byte UUID
(``cuDeviceGetUuid_v2``): CuPy's property dict cuts it at the first zero byte.
Rejected: copying tensors into <= 5 GB dtype blocks before exporting (Awex; a second copy of
every byte on the sender); torch's ``_share_cuda_`` (torch only, not JAX or CuPy buffers);
mappings cached across refits (use after the exporter's free); NCCL over two ranks of one
device (refused by NCCL before 2.30).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..extras import require
from .base import TransportError, TransportTimeout, event_done
from .peers import PeerTransport, Recv, Round

__all__ = ["CudaIpcTransport", "local_cuda_caps", "CupyCuda", "format_uuid"]

logger = logging.getLogger(__name__)

_EVENT_DISABLE_TIMING = 0x2
_EVENT_INTERPROCESS = 0x4
_IPC_LAZY_PEER_ACCESS = 0x1
_MEMCPY_DEFAULT = 4
_POINTER_ATTRIBUTE_BUFFER_ID = 7
_ALIGN = 256                    # staging offsets, as cudaMalloc aligns


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (as nvidia-smi prints) of 16 raw bytes."""
    if len(raw) != 16:
        raise TransportError(f"a CUDA device UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _import_cupy() -> Any:
    return require("cupy", "gpu", "the cuda_ipc transport")


class CupyCuda:
    """The CUDA calls the transport makes, through CuPy's runtime and the driver (ctypes).

    Everything device-specific sits here so that the transport's logic (grouping, caching,
    acknowledgements, refusals) is tested on CPU with a fake of this class.
    """

    def __init__(self) -> None:
        import ctypes
        self.cp = _import_cupy()
        self.rt = self.cp.cuda.runtime
        self._ctypes = ctypes
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise ImportError(f"the cuda_ipc transport needs the CUDA driver (libcuda.so.1): "
                              f"{e}") from e
        self._streams: dict[int, Any] = {}

    # -------------------------------------------------------------- devices

    def device_count(self) -> int:
        return int(self.rt.getDeviceCount())

    def device_uuid(self, device: int) -> str:
        """The device's full UUID from the driver (``cuDeviceGetUuid_v2``; ``_v1`` before
        CUDA 11.4). CuPy's ``getDeviceProperties()["uuid"]`` is a C string: it stops at the
        first zero byte, and two GPUs whose UUIDs agree up to it would compare equal."""
        c = self._ctypes
        dev = c.c_int()
        raw = (c.c_char * 16)()
        err = self._cu.cuInit(0)
        if err == 0:
            err = self._cu.cuDeviceGet(c.byref(dev), c.c_int(device))
        if err == 0:
            get = getattr(self._cu, "cuDeviceGetUuid_v2", None) or self._cu.cuDeviceGetUuid
            err = get(c.byref(raw), dev)
        if err != 0:
            raise TransportError(f"cuda_ipc: the driver cannot tell the UUID of CUDA device "
                                 f"{device} (CUresult {err})")
        return format_uuid(bytes(raw))

    def can_access_peer(self, device: int, peer: int) -> bool:
        return bool(self.rt.deviceCanAccessPeer(device, peer))

    def stream(self, device: int) -> Any:
        s = self._streams.get(device)
        if s is None:
            with self.cp.cuda.Device(device):
                s = self._streams[device] = self.cp.cuda.Stream(non_blocking=True)
        return s

    # -------------------------------------------------------------- buffers

    def pointer(self, buf: Any, device: int) -> tuple[int, int, Any]:
        """(device pointer, bytes, keep-alive) of a contiguous device buffer, with our stream
        ordered after the buffer's producer (DLPack for torch/JAX, an event for CuPy)."""
        cp = self.cp
        stream = self.stream(device)
        with cp.cuda.Device(device):
            if isinstance(buf, cp.ndarray):
                stream.wait_event(cp.cuda.get_current_stream().record())
                arr = buf
            else:
                with stream:
                    arr = cp.from_dlpack(buf)
        if not arr.flags.c_contiguous:
            raise TransportError("cuda_ipc moves contiguous buffers only")
        if arr.device.id != device:
            raise TransportError(f"cuda_ipc: the buffer is on cuda:{arr.device.id}, its rank "
                                 f"on cuda:{device}")
        return int(arr.data.ptr), int(arr.nbytes), arr

    def allocation(self, ptr: int, device: int) -> tuple[int, int, int]:
        """(base, size, buffer id) of the allocation holding ``ptr``."""
        c = self._ctypes
        base, size, bid = c.c_uint64(), c.c_size_t(), c.c_uint64()
        with self.cp.cuda.Device(device):
            err = self._cu.cuMemGetAddressRange_v2(c.byref(base), c.byref(size), c.c_uint64(ptr))
            if err == 0:
                err = self._cu.cuPointerGetAttribute(c.byref(bid), _POINTER_ATTRIBUTE_BUFFER_ID,
                                                     c.c_uint64(ptr))
        if err != 0:
            raise TransportError(f"cuda_ipc: the driver cannot find the allocation of pointer "
                                 f"{ptr:#x} (CUresult {err})")
        return int(base.value), int(size.value), int(bid.value)

    def mem_handle(self, base: int, device: int) -> bytes:
        with self.cp.cuda.Device(device):
            return bytes(self.rt.ipcGetMemHandle(base))

    def open_mem(self, handle: bytes, device: int) -> int:
        with self.cp.cuda.Device(device):
            return int(self.rt.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))

    def close_mem(self, ptr: int, device: int) -> None:
        with self.cp.cuda.Device(device):
            self.rt.ipcCloseMemHandle(ptr)

    def staging(self, nbytes: int, device: int) -> tuple[int, Any]:
        """(pointer, keep-alive) of ``nbytes`` of exportable device memory: a plain
        ``cudaMalloc`` (``cupy.cuda.Memory``), never a pool or a virtual-memory segment."""
        with self.cp.cuda.Device(device):
            mem = self.cp.cuda.Memory(nbytes)
        return int(mem.ptr), mem

    # -------------------------------------------------------------- events and copies

    def ipc_event(self, device: int) -> int:
        with self.cp.cuda.Device(device):
            return int(self.rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS))

    def event(self, device: int) -> int:
        with self.cp.cuda.Device(device):
            return int(self.rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING))

    def event_handle(self, event: int) -> bytes:
        return bytes(self.rt.ipcGetEventHandle(event))

    def open_event(self, handle: bytes, device: int) -> int:
        with self.cp.cuda.Device(device):
            return int(self.rt.ipcOpenEventHandle(handle))

    def destroy_event(self, event: int) -> None:
        self.rt.eventDestroy(event)

    def record(self, event: int, device: int) -> None:
        self.rt.eventRecord(event, self.stream(device).ptr)

    def wait_event(self, device: int, event: int) -> None:
        self.rt.streamWaitEvent(self.stream(device).ptr, event, 0)

    def copy(self, dst: int, src: int, nbytes: int, device: int) -> None:
        with self.cp.cuda.Device(device):
            self.rt.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, self.stream(device).ptr)

    def query(self, event: int) -> bool:
        """Whether the work before ``event`` finished; a CUDA error raises ``CudaError``
        (see ``base.event_done``: CuPy returns error statuses, it does not raise them)."""
        return event_done(self.rt, event, "cuda_ipc")

def local_cuda_caps(ordinals: Sequence[int | None], api: Any = None) -> dict[str, Any]:
    """What this process publishes for ``choose_routes``: the uuid of each rank's device
    (``None`` for CPU ranks) and the device uuids it can read through IPC (its own, and
    every visible device all of its devices have peer access to).

    Without CuPy or a driver the process takes no IPC pair (a warning says why).
    """
    try:
        api = api or CupyCuda()
        count = api.device_count()
        uuids = [api.device_uuid(i) for i in range(count)]
    except Exception as e:      # noqa: BLE001 - any failure: this process takes no IPC pair
        logger.warning("cuda_ipc unavailable in this process (%s: %s); its GPU pairs go "
                       "through nccl", type(e).__name__, e)
        return {"cuda_devices": [None] * len(ordinals), "cuda_reach": []}
    own = sorted({o for o in ordinals if o is not None})
    reach = [uuids[j] for j in range(count)
             if j in own or (own and all(api.can_access_peer(i, j) for i in own))]
    return {"cuda_devices": [None if o is None else uuids[o] for o in ordinals],
            "cuda_reach": reach}


@dataclass
class _Recv(Recv):
    device: int
    ptr: int = 0        # imported when posted: our stream then follows the posting stream
    nbytes: int = 0


@dataclass
class _Round(Round):
    staged: dict[int, int] = field(default_factory=dict)  # device -> staging offset in use
    errors: list[str] = field(default_factory=list)       # sends that could not be posted


class CudaIpcTransport(PeerTransport):
    """Grouped point-to-point moves of device byte buffers through CUDA IPC handles.

    Args:
        store: the world's store.
        key: a key prefix unique to this transport.
        rank_process: process position of every world rank.
        process_index: this process's position.
        peers: the processes this transport exchanges with.
        devices: ``{local rank: CUDA ordinal}`` for this process's CUDA ranks.
        pids: ``{process: (pid, start time)}`` for the dead-peer watcher (same host).
        process_labels: names of the processes, for errors.
        can_reach: ``can_reach(src_rank, dst_rank)``: both devices readable by both sides
            (``Routes.ipc_ok``); a post for a pair it refuses raises.
        connect: a second store client for the watcher (see ``PeerTransport``).
        api: the CUDA calls (``CupyCuda()`` by default; a fake in CPU tests).
        max_open: the most peer allocations mapped here at once (within a group; every
            mapping is closed at the end of the group that opened it).
        seal: the world's ``Seal`` for the records (see ``PeerTransport``).
    """

    name = "cuda_ipc"
    _kind = "ipc"

    def __init__(self, store: Any, key: str, rank_process: Sequence[int], process_index: int,
                 peers: Sequence[int], devices: Mapping[int, int], *,
                 pids: Mapping[int, tuple[int, str | None]] | None = None,
                 process_labels: Sequence[str] | None = None,
                 can_reach: Callable[[int, int], bool] | None = None, connect: Any = None,
                 api: Any = None, max_open: int = 256, seal: Any = None):
        super().__init__(store, key, rank_process, process_index, peers, pids,
                         process_labels, connect, seal)
        self._devices = dict(devices)
        self._can_reach = can_reach
        self._api = api if api is not None else CupyCuda()
        self._max_open = max(1, max_open)
        self._handles: dict[int, tuple[str, int, int]] = {}       # buffer id -> (hex, base, size)
        self._unexportable: set[int] = set()                      # buffer ids without a handle
        self._warned = False
        self._stage: dict[int, tuple[int, int, Any]] = {}         # device -> (ptr, size, keep)
        self._events: dict[int, tuple[int, str]] = {}             # device -> (ipc event, hex)
        self._done: dict[int, int] = {}                           # device -> completion event
        self._opened: dict[tuple, tuple[int, int]] = {}           # this group's -> (ptr, device)
        self._peer_events: dict[tuple, int] = {}
        self.num_exported = 0       # handles exported (allocations), cumulative
        self.num_opened = 0         # peer handles opened here, cumulative
        self.num_staged = 0         # sends copied into staging first (no IPC handle)
        self.bytes_received = 0

    # ------------------------------------------------------------------ posts

    _owned = "a CUDA rank of this process"

    def _owns(self, rank: int) -> bool:
        return super()._owns(rank) and rank in self._devices

    def _peer_of(self, local_rank: int, remote_rank: int, src: int, dst: int, what: str) -> int:
        peer = self._remote(local_rank, remote_rank, what)
        if self._can_reach is not None and not self._can_reach(src, dst):
            raise TransportError(f"cuda_ipc {what} {src}->{dst}: the ranks are on different "
                                 f"devices without peer access ({self._labels[peer]}); use "
                                 f"transport='nccl', or 'auto' which routes such pairs there")
        if peer not in self._peers:
            raise TransportError(f"cuda_ipc {what} {src}->{dst}: {self._labels[peer]} is not "
                                 f"an IPC peer of this process (another host?)")
        return peer

    def _export(self, ptr: int, device: int) -> tuple[str, int, int, int] | None:
        """(handle hex, buffer id, allocation size, offset of ``ptr``): one handle per
        allocation, cached by buffer id; None when the allocation has no IPC handle."""
        try:
            base, size, bid = self._api.allocation(ptr, device)
        except TransportError as e:     # the driver does not know it as an allocation
            self._unexportable_once(ptr, device, e)
            return None
        if bid in self._unexportable:
            return None
        got = self._handles.get(bid)
        if got is None or got[1] != base:
            try:
                handle = self._api.mem_handle(base, device)
            except Exception as e:   # noqa: BLE001 - staged instead; the driver says why
                self._unexportable.add(bid)
                self._unexportable_once(base, device, e)
                return None
            got = self._handles[bid] = (handle.hex(), base, size)
            self.num_exported += 1
        return got[0], bid, got[2], ptr - got[1]

    def _unexportable_once(self, ptr: int, device: int, why: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("cuda_ipc: the memory at %#x on cuda:%d has no IPC handle (%s: "
                           "torch's expandable segments or a cudaMallocAsync pool); such sends "
                           "are copied into xreshard's staging first", ptr, device, why)

    def _staged(self, ptr: int, nbytes: int, device: int, rnd: _Round) -> int:
        """Copy ``nbytes`` at ``ptr`` into this device's staging (exportable memory, kept
        across groups and grown when a round needs more) on our stream; its address."""
        off = rnd.staged.get(device, 0)
        have = self._stage.get(device)
        if have is None or off + nbytes > have[1]:
            if have is not None:
                rnd.keep.append(have[2])        # this round's earlier copies still live there
            size = max(nbytes, 2 * have[1] if have is not None else nbytes)
            base, keep = self._api.staging(size, device)
            have = self._stage[device] = (base, size, keep)
            off = 0
        self._api.copy(have[0] + off, ptr, nbytes, device)
        rnd.staged[device] = off + -(-nbytes // _ALIGN) * _ALIGN
        self.num_staged += 1
        return have[0] + off

    def _event(self, device: int) -> tuple[int, str]:
        got = self._events.get(device)
        if got is None:
            ev = self._api.ipc_event(device)
            got = self._events[device] = (ev, self._api.event_handle(ev).hex())
        return got

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._check_usable()
        rnd = self._open_round("send", src_rank, dst_rank, tag)
        self._dup(rnd, ("s", src_rank, dst_rank, tag), "send")
        peer = self._peer_of(src_rank, dst_rank, src_rank, dst_rank, "send")
        device = self._devices[src_rank]
        ptr, nbytes, keep = self._api.pointer(buf, device)
        seq = self._send_seq(rnd, peer)
        key = self._msg_key(seq, src_rank, dst_rank, tag)
        if nbytes == 0:         # its receiver awaits a record all the same
            rnd.pending[key] = self._records.pack("ipc", key, seq, {"n": 0, "gen": self._gen})
            return
        rnd.keep.append(keep)
        try:
            exported = self._export(ptr, device)
            if exported is None:
                exported = self._export(self._staged(ptr, nbytes, device, rnd), device)
            if exported is None:
                raise TransportError("xreshard's own staging has no IPC handle either")
        except Exception as e:     # noqa: BLE001 - published: the receiver fails at once
            why = (f"cuda_ipc send {src_rank}->{dst_rank} tag {tag} ({nbytes} bytes on "
                   f"cuda:{device}) from {self._labels[self._me]} cannot be moved: "
                   f"{type(e).__name__}: {e}")
            rnd.errors.append(why)
            rnd.pending[key] = self._records.pack("ipc", key, seq, {"error": why})
            return
        handle, bid, size, off = exported
        ev, ev_hex = self._event(device)
        # recorded after each import (and staging copy): the event covers every producer
        self._api.record(ev, device)
        rnd.pending[key] = self._records.pack(
            "ipc", key, seq, {"h": handle, "bid": bid, "size": size, "off": off, "n": nbytes,
                              "ev": ev_hex, "gen": self._gen})

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._check_usable()
        rnd = self._open_round("recv", src_rank, dst_rank, tag)
        self._dup(rnd, ("r", src_rank, dst_rank, tag), "recv")
        peer = self._peer_of(dst_rank, src_rank, src_rank, dst_rank, "recv")
        device = self._devices[dst_rank]
        # imported now, with the poster's stream current: the copy into ``buf`` follows what
        # was queued on it before (the executor's unpack of the staging's previous round)
        ptr, nbytes, keep = self._api.pointer(buf, device)
        rnd.keep.append(keep)
        self._add_recv(rnd, _Recv(buf, src_rank, dst_rank, tag, peer, device, ptr, nbytes))

    # ------------------------------------------------------------------ the group

    def group(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Collect posts; on exit publish the sends, copy every receive on this process's
        streams after its producer's event, wait for the copies, close the mappings,
        acknowledge, and wait for the acks of this process's sends, all within
        ``timeout`` s of entering.

        Raises:
            TransportTimeout: a peer did not publish or acknowledge, or the copies did not
                finish, in time; names the peer.
            CudaError: CUDA reported a hard error while the copies ran.
            TransportError: a refused pair, a size mismatch, a dead peer, a send that could
                not be moved (here or, through its record, at its sender).
        """
        return self._group(timeout)

    def _new_round(self, deadline: float) -> _Round:
        return _Round(deadline=deadline)

    def _open(self, peer: int, rec: Mapping[str, Any], device: int, used: set[int],
              rnd: _Round, timeout: float) -> int:
        """The address here of ``rec``'s allocation, mapped once per process and group."""
        key = (peer, rec["bid"], rec["h"])
        got = self._opened.get(key)
        if got is not None:
            return got[0]
        if len(self._opened) >= self._max_open:
            # never unmap what a queued copy still reads: let them finish first
            self._finish_copies(used, rnd, timeout)
            self._close_mappings()
        ptr = self._api.open_mem(bytes.fromhex(rec["h"]), device)
        self.num_opened += 1
        self._opened[key] = (ptr, device)
        return ptr

    def _close_mappings(self) -> None:
        for ptr, dev in self._opened.values():
            with contextlib.suppress(Exception):
                self._api.close_mem(ptr, dev)
        self._opened.clear()

    def _complete(self, rnd: _Round, timeout: float) -> None:
        self._publish(rnd)
        if rnd.errors:      # published as error records: the receivers raise them too
            raise TransportError("; ".join(rnd.errors))
        used: set[int] = set()
        ok = False
        try:
            self._copy_all(rnd, used, timeout)
            self._finish_copies(used, rnd, timeout)
            ok = True
        finally:
            if ok or self._drained(used):
                self._close_mappings()
            else:       # a copy may still read them: leaking beats unmapping under it
                logger.warning("cuda_ipc: %d peer mapping(s) left open after a failed group "
                               "(their copies could not be waited for)", len(self._opened))
                self._opened.clear()
        for peer, seq in rnd.recv_seq.items():
            self._ack(peer, seq)
        self._await_acks(rnd, timeout)

    def _copy_all(self, rnd: _Round, used: set[int], timeout: float) -> None:
        """Queue every receive's copy on this process's streams, after its producer's event."""
        by_peer: dict[int, list[_Recv]] = {}
        for r in rnd.recvs:
            by_peer.setdefault(r.peer, []).append(r)
        for peer, recvs in by_peer.items():
            seq = rnd.recv_seq[peer]
            keys = [self._msg_key(seq, r.src, r.dst, r.tag) for r in recvs]
            records = [self._records.unpack("ipc", k, seq, peer, v, self._watch.dead)
                       for k, v in zip(keys, self._fetch(keys, peer, seq, rnd, timeout))]
            self._watch.discard(keys)
            waited: set[tuple] = set()
            for r, rec in zip(recvs, records):
                where = f"cuda_ipc recv {r.src}->{r.dst} tag {r.tag} from {self._labels[peer]}"
                if "dead" in rec:
                    raise TransportError(f"{where}: that process (pid {rec['dead']}) died")
                if "error" in rec:
                    raise TransportError(f"{where}: the sender failed: {rec['error']}")
                ptr, nbytes = r.ptr, r.nbytes
                if rec["n"] != nbytes:
                    raise TransportError(f"{where}: the sender posted {rec['n']} bytes, the "
                                         f"receive buffer has {nbytes}")
                if nbytes == 0:
                    continue
                base = self._open(peer, rec, r.device, used, rnd, timeout)
                ev_key = (peer, rec["ev"], r.device)
                ev = self._peer_events.get(ev_key)
                if ev is None:
                    ev = self._peer_events[ev_key] = self._api.open_event(
                        bytes.fromhex(rec["ev"]), r.device)
                if ev_key not in waited:      # once per producer event and round
                    waited.add(ev_key)
                    self._api.wait_event(r.device, ev)
                self._api.copy(ptr, base + rec["off"], nbytes, r.device)
                used.add(r.device)
                self.bytes_received += nbytes

    def _finish_copies(self, devices: set[int], rnd: _Round, timeout: float) -> None:
        """Record an event after the copies on each used device and poll it to the deadline
        (the bytes have landed when this returns; later work on any stream sees them)."""
        events = []
        for d in sorted(devices):
            ev = self._done.get(d)
            if ev is None:
                ev = self._done[d] = self._api.event(d)
            self._api.record(ev, d)
            events.append((d, ev))
        pause = 1e-5       # an 8 GiB copy takes ~4 ms on an H200: poll finely, then back off
        for d, ev in events:
            while not self._api.query(ev):
                if time.monotonic() >= rnd.deadline:
                    raise TransportTimeout(f"cuda_ipc: the copies on cuda:{d} did not finish "
                                           f"within {timeout} s (a producer event never fired?)")
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)

    def _drained(self, devices: set[int]) -> bool:
        """After a failure: whether the copies queued on ``devices`` have finished (one look,
        so the senders hear of the failure at once), so their mappings may be closed."""
        try:
            self._finish_copies(devices, _Round(deadline=time.monotonic()), 0)
            return True
        except Exception:       # noqa: BLE001 - a stuck or broken device: keep the mappings
            return False

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Destroy the events and free the staging; the transport is unusable after."""
        if not self._closing():
            return
        self._close_mappings()
        for ev in [*(e for e, _ in self._events.values()), *self._done.values()]:
            with contextlib.suppress(Exception):
                self._api.destroy_event(ev)
        self._events.clear()
        self._done.clear()
        self._peer_events.clear()
        self._handles.clear()
        self._stage.clear()

    def __repr__(self) -> str:
        return (f"CudaIpcTransport(process={self._me}, peers={sorted(self._peers)}, "
                f"devices={self._devices})")
