"""The ``nccl`` transport: grouped point-to-point moves between CUDA ranks through CuPy's NCCL.

Decision record.

Why CuPy's binding (``cupy.cuda.nccl.NcclCommunicator``, ``groupStart``/``groupEnd``,
``send``/``recv``, ``check_async_error``, ``abort``): it is a maintained, compiled wrapper of
the same ``libnccl`` every other option loads, it takes raw device pointers and stream
handles (so JAX, torch and CuPy buffers all go through DLPack zero-copy), its long calls
(``groupEnd``, ``send``, ``recv``) release the GIL, and it owns nothing but the communicator.
Rejected:

- ``torch.distributed`` NCCL process groups: they need (or create) torch's default group
  and put the communicator's lifecycle, streams and watchdog in torch's hands; the
  inference engine runs its own groups in the same process and must not see ours.
- raw ctypes over ``libnccl`` (vLLM's ``pynccl_wrapper.py``): more code over the same
  library; vLLM needs it for CUDA-graph-capturable collectives, which a refit does not use.
- NCCL M2N (``ncclReshard``): a reshard collective over a caller's communicator, not a
  point-to-point primitive; it could sit behind this transport later, not replace it.

vLLM's NCCL wrapper says CuPy "often gets stuck when initializing the NCCL communicator".
An init waits for every rank, so a missing or wedged peer blocks it forever. This module:

1. Runs a store barrier before NCCL (``rendezvous``, in ``nccl_setup.py`` with the CuPy
   and NCCL discovery). Every rank posts an arrival key, and every process
   waits for all of them with a deadline. A rank that never arrives is named in a
   ``TransportTimeout``, and nothing in NCCL was started, so nothing leaks.
2. Calls the NCCL init (``ncclCommInitRank`` per local rank) between ``groupStart`` and
   ``groupEnd`` on a dedicated daemon thread. Inside a group NCCL defers the real work to
   ``ncclGroupEnd``, which CuPy calls without the GIL. The caller waits with a deadline.
3. Cannot use a non-blocking init. ``ncclCommInitRankConfig`` with ``blocking=0`` is not
   reachable: CuPy's ``NcclConfig`` has only ``split_share``, and its ``check_status``
   treats ``ncclInProgress`` as an error. ``NCCL_COMM_BLOCKING=0`` is process-wide, read
   once, and would also flip torch's and vLLM's communicators.
4. On expiry raises ``TransportTimeout`` but does not abort the half-built communicator.
   NCCL's abort of a *blocking* communicator does not join an init still running in
   another thread (``ncclGroupJobAbort`` joins only non-blocking group jobs), so it would
   free the communicator under that thread. The init thread is abandoned instead. If it
   ever returns, it aborts the communicators itself. A process that hit this should be
   restarted.
5. Polls ``ncclCommGetAsyncError`` (``check_async_error``) in every wait.

Point-to-point rules (``base.py``): one ``groupStart``/``groupEnd`` per
``with transport.group(timeout)``. NCCL has no tags: sends and receives between two ranks
pair up in issue order. Both sides therefore sort their posts by (peer, tag). Both derive
the same buckets from the plan, so the k-th send pairs with the k-th receive. Each local
device gets a dedicated non-blocking stream.

Ordering with the frameworks uses streams and events, never a device-wide sync. Torch and
JAX buffers are imported with ``cupy.from_dlpack`` while our stream is current. DLPack then
makes *our* stream wait for the producer: torch records an event on its current stream,
and JAX waits on the buffer's definition event. For CuPy buffers we record an event on the
caller's current stream. The group's exit records one event per device on our streams
after ``groupEnd`` and polls it with the deadline. So when the ``with`` block exits, the
bytes have landed and any later work on any stream sees them.

On a timeout after the posts were enqueued, the communicators are aborted (nothing else
is inside NCCL then). On a timeout while a thread is still inside ``ncclGroupEnd`` (NCCL
connects to a peer the first time the two exchange data and waits for it there), they
are abandoned as in 4. Either way the transport is unusable afterwards. The error names
the peers and tags.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import RefitError
from .base import CudaError, TransportError, TransportTimeout, event_done
from .nccl_epochs import Resizable
from .nccl_setup import (NoCudaDeviceError, cuda_major, format_version, import_cupy,
                         install_hint, multi_rank_gpu, ranks_str, rendezvous, visible_devices)

__all__ = [
    "NcclTransport", "NoCudaDeviceError", "Post", "cuda_major", "install_hint",
    "rendezvous", "wait_or_abort",
]

logger = logging.getLogger(__name__)

_NCCL_UINT8 = 1                 # ncclUint8: the transport moves bytes, never typed data
_KDL_CUDA = 2                   # DLPack device type of CUDA device memory
_ABORT_GRACE_S = 10.0           # how long an abort or destroy may take before we give up on it
_BUSY_GRACE_S = 1.0             # how long a failing group's NCCL call may take to return
_ACTIVE_KEYS: set[str] = set()  # store keys of this process's live communicators


# ---------------------------------------------------------------------------- waiting

@dataclasses.dataclass(frozen=True, slots=True)
class Post:
    """One posted message, as error messages name it."""

    kind: str           # "send" or "recv"
    src_rank: int
    dst_rank: int
    tag: int
    nbytes: int

    @property
    def peer(self) -> int:
        return self.dst_rank if self.kind == "send" else self.src_rank

    def __str__(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} {way} rank {self.peer} tag {self.tag} ({self.nbytes} B)"


def _describe(posts: Sequence[Post], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in posts[:limit])
    more = len(posts) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def wait_or_abort(pending: Sequence[Any], comms: Sequence[Any], posts: Sequence[Post], *,
                  where: str, stage: str, timeout: float, deadline: float,
                  abort: Callable[[], str], clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll until every object in ``pending`` reports ``.done``, at most until ``deadline``.

    Each round also checks every communicator's asynchronous error
    (``comm.check_async_error()``, i.e. ``ncclCommGetAsyncError``). The sleep between polls
    doubles from 10 us to 2 ms, so a short group is not slowed and a long one costs
    nothing. A hard CUDA error seen while polling (``cudaEventQuery`` returns the errors of
    earlier asynchronous work; CuPy raises them) aborts the communicators and raises at
    once: the peers then see NCCL's remote error instead of waiting out their timeout.

    Args:
        pending: objects with a boolean ``done`` that raises ``CudaError`` on a CUDA error
            (``_EventDone`` over CuPy events; a plain ``cupy.cuda.Event`` hides them).
        comms: objects with ``check_async_error()`` (``NcclCommunicator``).
        posts: what the group moves, for the error message.
        where: this process's ranks, e.g. ``"rank 0 (CUDA device 0)"``.
        stage: what is being waited for, for the error message.
        timeout: the group's timeout in seconds, for the error message.
        deadline: ``clock()`` value at which to give up.
        abort: called once on failure; aborts or abandons the communicators and returns a
            sentence saying which.

    Raises:
        TransportTimeout: the deadline passed; names the peers and tags.
        CudaError: CUDA reported a hard error; carries CUDA's text.
        TransportError: NCCL reported an asynchronous error.
    """
    interval = 1e-5
    while True:
        try:
            if all(p.done for p in pending):
                return
        except CudaError as e:          # an illegal address, an ECC error, ...
            note = abort()
            raise CudaError(f"nccl group on {where} failed while {stage}: {e}, with posts: "
                            f"{_describe(posts)}. {note} CUDA errors of this kind leave the "
                            f"process's CUDA context unusable: restart it") from e
        for comm in comms:
            try:
                comm.check_async_error()
            except Exception as e:      # cupy NcclError: ncclRemoteError, ncclSystemError, ...
                note = abort()
                raise TransportError(
                    f"nccl group on {where} failed while {stage}: NCCL reported an "
                    f"asynchronous error ({e}) with posts: {_describe(posts)}. {note}") from e
        now = clock()
        if now >= deadline:
            note = abort()
            peers = sorted({p.peer for p in posts})
            raise TransportTimeout(
                f"nccl group on {where} timed out after {timeout} s while {stage}; still "
                f"waiting for: {_describe(posts)}. Peer rank(s) {ranks_str(peers)} did not "
                f"post the matching sends/receives, or died. {note} Check that every rank "
                f"runs the same schedule and is alive, then create a new NcclTransport on "
                f"every rank")
        sleep(min(interval, deadline - now))
        interval = min(interval * 2, 2e-3)


def _order_posts(posts: Sequence[Post], local_ranks: Sequence[int],
                 world_size: int) -> list[int]:
    """Check a group's posts; return their indices in NCCL issue order.

    NCCL pairs the sends and receives of two ranks in issue order, so both sides issue
    them sorted by (local rank, peer, tag), a key both derive from the plan.
    """
    seen: set[tuple[str, int, int, int]] = set()
    for p in posts:
        local = p.src_rank if p.kind == "send" else p.dst_rank
        if local not in local_ranks:
            side = "sender" if p.kind == "send" else "receiver"
            raise RefitError(f"{p.kind} {p.src_rank}->{p.dst_rank} tag {p.tag}: the {side} "
                             f"rank {local} is not hosted by this transport (local ranks "
                             f"{ranks_str(sorted(local_ranks))})")
        if not 0 <= p.peer < world_size:
            raise RefitError(f"{p}: rank {p.peer} is not in the communicator "
                             f"(ranks 0..{world_size - 1})")
        if p.tag < 0:
            raise RefitError(f"{p}: tags are non-negative ints")
        k = (p.kind, p.src_rank, p.dst_rank, p.tag)
        if k in seen:
            raise RefitError(f"{p} is posted twice in one group; (src, dst, tag) must be "
                             f"unique within a group")
        seen.add(k)

    def issue_key(i: int) -> tuple[int, int, int, int]:
        p = posts[i]
        local = p.src_rank if p.kind == "send" else p.dst_rank
        return (local, p.peer, p.tag, 0 if p.kind == "send" else 1)

    return sorted(range(len(posts)), key=issue_key)


class _EventDone:
    """A CuPy event seen as a pollable whose ``.done`` raises ``CudaError`` on a CUDA error
    (``cupy.cuda.Event.done`` would say False until the timeout: see ``base.event_done``)."""

    def __init__(self, event: Any, runtime: Any, where: str):
        self._event, self._runtime, self._where = event, runtime, where

    @property
    def done(self) -> bool:
        return event_done(self._runtime, self._event.ptr, self._where)


class _Done:
    """A future seen as a pollable: ``.done`` is a property, as on ``cupy.cuda.Event``."""

    def __init__(self, fut: concurrent.futures.Future):
        self._fut = fut

    @property
    def done(self) -> bool:
        return self._fut.done()


class _Worker:
    """One daemon thread that issues every NCCL call of a transport.

    NCCL's group state is per thread, and a call stuck inside NCCL must not block the
    caller or process exit, so a ThreadPoolExecutor (joined at exit) will not do.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._current: concurrent.futures.Future | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the running job; True when none is running."""
        if self._current is not None:
            concurrent.futures.wait([self._current], timeout=timeout)
        return not self.busy

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._current = fut
        self._jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:      # delivered to the waiting caller
                fut.set_exception(e)
            # the job's closure holds the group's buffers (the caller's sent arrays): drop
            # it now, not when the next job arrives, so they are not pinned after a refit
            del job, fn, fut


# ---------------------------------------------------------------------------- transport

@dataclasses.dataclass(slots=True)
class _Op:
    post: Post
    local_rank: int
    device: int
    ptr: int
    array: Any          # the CuPy view (and through it the caller's buffer) stays alive
    source: Any


class NcclTransport(Resizable):
    """Moves byte buffers between CUDA ranks over one NCCL communicator.

    The communicator spans world ranks ``0..world_size-1`` (NCCL rank = world rank). It is
    created once, by the constructor on every process together, and reused by every group.
    A process hosting several GPUs creates its ranks in one NCCL group call.

    Example (each process; ``store`` is the world's ``TCPStore``)::

        t = NcclTransport(store, world_size=8, devices={2: 0, 3: 1}, key="xreshard/nccl/0")
        with t.group(timeout=60):
            t.send(buf_a, src_rank=2, dst_rank=5, tag=0)     # torch / JAX / CuPy uint8
            t.recv(buf_b, src_rank=6, dst_rank=3, tag=0)
        # here every byte has landed

    Args:
        store: rendezvous store (``set``/``get``, ideally ``check``), e.g. torch ``TCPStore``.
        world_size: ranks in the communicator; every rank must be a CUDA rank.
        devices: ``{world rank: CUDA device ordinal}`` for the ranks this process hosts.
        key: store key prefix, unique per communicator creation (include a generation).
        timeout: seconds allowed for the rendezvous and NCCL's init together.

    Raises:
        ImportError: CuPy (with NCCL) is not installed.
        NoCudaDeviceError: no CUDA device is visible to this process.
        RefitError: bad ranks or devices.
        TransportTimeout: some rank never arrived, or NCCL's init did not finish in time.
    """

    name = "nccl"

    def __init__(self, store: Any, world_size: int, devices: Mapping[int, int], *,
                 key: str = "xreshard/nccl", timeout: float = 300.0,
                 comms: Mapping[int, Any] | None = None):
        cupy, nccl = import_cupy()
        count, why = visible_devices(cupy)
        if count == 0:
            raise NoCudaDeviceError(
                f"the nccl transport needs a CUDA device, but no CUDA device is visible to "
                f"this process ({why}; CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}) - run it on a GPU "
                f"host, or use the gloo transport for CPU ranks (select_backend picks 'gloo' "
                f"when every rank is 'cpu')")
        self._cupy, self._nccl = cupy, nccl
        self._store = store
        self._devices = _check_devices(devices, world_size, count,
                                       multi_rank_gpu(int(nccl.get_version())))
        self.world_size = world_size
        self.key = key
        self._local = tuple(sorted(self._devices))
        self._where = (f"rank(s) {ranks_str(self._local)} (CUDA device(s) "
                       f"{ranks_str([self._devices[r] for r in self._local])})")
        if key in _ACTIVE_KEYS:
            raise RefitError(f"an nccl transport with key {key!r} already exists in this "
                             f"process; reuse it, or close it first and pass a fresh key")
        self._closed = False
        self._broken: str | None = None
        self._pending: list[_Op] | None = None
        self._comms: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}
        for dev in sorted(set(self._devices.values())):
            with cupy.cuda.Device(dev):
                self._streams[dev] = cupy.cuda.Stream(non_blocking=True)
                self._events[dev] = cupy.cuda.Event(disable_timing=True)
        self._worker = _Worker(f"xreshard-nccl[{key}]")
        _ACTIVE_KEYS.add(key)
        if comms is not None:       # made from another communicator (shrunk, grown)
            self._comms = {r: comms[r] for r in self._local}
            return
        try:
            self._init(timeout)
        except BaseException:
            _ACTIVE_KEYS.discard(key)
            self._closed = True
            self._worker.stop()     # a stuck init job keeps the thread until NCCL returns
            raise

    # ------------------------------------------------------------------ creation

    def _init(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        uid = rendezvous(self._store, self.key, self.world_size, self._local, timeout)
        cancelled = threading.Event()
        made: list[Any] = []
        fut = self._worker.submit(lambda: self._init_comms(uid, made, cancelled))
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            cancelled.set()
            self._broken = "its NCCL init timed out"
            raise TransportTimeout(
                f"nccl communicator init ({self.key!r}) on {self._where} timed out after "
                f"{timeout} s: every rank arrived at the rendezvous, but ncclCommInitRank did "
                f"not complete - a peer died or hangs inside NCCL's init, or NCCL cannot "
                f"connect (check NCCL_SOCKET_IFNAME, firewalls; rerun with NCCL_DEBUG=INFO). "
                f"The half-built communicator was abandoned, not aborted (CuPy makes "
                f"blocking communicators, which NCCL cannot abort safely mid-init); restart "
                f"this process before retrying") from None
        except Exception as e:
            self._broken = "its NCCL init failed"
            raise TransportError(f"nccl communicator init ({self.key!r}) on {self._where} "
                                 f"failed: {e}") from e
        self._comms = dict(zip(self._local, made))
        logger.info("nccl communicator %r: ranks %s of %d on CUDA devices %s, NCCL %s, "
                    "%.2f s", self.key, list(self._local), self.world_size,
                    [self._devices[r] for r in self._local],
                    format_version(int(self._nccl.get_version())), time.monotonic() - start)

    def _init_comms(self, uid: bytes, made: list[Any], cancelled: threading.Event) -> None:
        """On the worker: create every local rank's communicator in one NCCL group."""
        cupy, nccl = self._cupy, self._nccl
        ok = False
        try:
            nccl.groupStart()
            try:
                for rank in self._local:
                    with cupy.cuda.Device(self._devices[rank]):
                        made.append(_new_communicator(nccl, self.world_size, uid, rank))
            finally:
                nccl.groupEnd()     # the real init; blocks (without the GIL) until all ranks join
            ok = True
        finally:
            if not ok or cancelled.is_set():    # this thread is the only one inside: safe
                for comm in made:
                    with contextlib.suppress(Exception):
                        comm.abort()

    # ------------------------------------------------------------------ protocol

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        """Collect posts; on exit issue them in one NCCL group and wait, at most ``timeout`` s."""
        self._check_usable()
        if self._pending is not None:
            raise RefitError("nccl transport groups do not nest: close the open "
                             "`with transport.group(...)` block first")
        self._pending = []
        try:
            yield
            ops = self._pending
        finally:
            self._pending = None
        if ops:
            self._run(ops, timeout)

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        """Post a send of ``buf`` (1-D contiguous uint8 on ``src_rank``'s GPU) to ``dst_rank``."""
        self._post("send", buf, src_rank, dst_rank, tag, src_rank)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        """Post a receive into ``buf`` (1-D contiguous uint8 on ``dst_rank``'s GPU)."""
        self._post("recv", buf, src_rank, dst_rank, tag, dst_rank)

    def stream(self, device: int) -> Any:
        """The CuPy stream this transport's NCCL calls run on for ``device`` (benchmarks time
        the transfers with CUDA events recorded on it)."""
        return self._streams[device]

    def close(self) -> None:
        """Destroy the communicators (local; no peer takes part). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _ACTIVE_KEYS.discard(self.key)
        if self._broken is None and self._comms and not self._worker.busy:
            fut = self._worker.submit(lambda: [c.destroy() for c in self._comms.values()])
            try:
                fut.result(timeout=_ABORT_GRACE_S)
            except concurrent.futures.TimeoutError:
                logger.warning("nccl communicator %r: ncclCommDestroy did not return within "
                               "%.0f s; abandoned", self.key, _ABORT_GRACE_S)
        self._worker.stop()

    def __enter__(self) -> NcclTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NcclTransport(key={self.key!r}, world_size={self.world_size}, "
                f"devices={dict(sorted(self._devices.items()))})")

    # ------------------------------------------------------------------ internals

    @property
    def usable(self) -> bool:
        """False once closed or given up after a failure (it is then made again)."""
        return not self._closed and self._broken is None

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError(f"nccl transport {self.key!r} is closed")
        if self._broken is not None:
            raise TransportError(f"nccl transport {self.key!r} is unusable: {self._broken}; "
                                 f"create a new one (fresh key) on every rank")

    def _post(self, kind: str, buf: Any, src_rank: int, dst_rank: int, tag: int,
              local: int) -> None:
        if self._pending is None:
            raise RefitError(f"nccl {kind} posted outside a group: post inside "
                             f"`with transport.group(timeout):`")
        if local not in self._devices:
            raise RefitError(f"nccl {kind} {src_rank}->{dst_rank} tag {tag}: rank {local} is "
                             f"not hosted by this process (local ranks "
                             f"{ranks_str(self._local)})")
        device = self._devices[local]
        array, ptr = self._as_device_bytes(buf, device, f"{kind} {src_rank}->{dst_rank} tag {tag}")
        post = Post(kind, src_rank, dst_rank, tag, int(array.nbytes))
        self._pending.append(_Op(post, local, device, ptr, array, buf))

    def _as_device_bytes(self, buf: Any, device: int, what: str) -> tuple[Any, int]:
        """A CuPy view of ``buf`` (zero-copy) ordered after its producer on our stream."""
        cupy = self._cupy
        dtype = str(getattr(buf, "dtype", "?")).removeprefix("torch.")
        if dtype != "uint8":
            raise RefitError(f"nccl {what}: buffers are uint8, got dtype {dtype} - pass a "
                             f"uint8 view (torch: t.view(torch.uint8); JAX: "
                             f"jax.lax.bitcast_convert_type; CuPy: a.view(cupy.uint8))")
        try:
            dev_type, dev_id = buf.__dlpack_device__()
        except AttributeError:
            raise RefitError(f"nccl {what}: {type(buf).__name__} is not a DLPack array; pass a "
                             f"torch CUDA tensor, a single-device JAX array or a CuPy array") \
                from None
        if int(dev_type) != _KDL_CUDA or int(dev_id) != device:
            raise RefitError(f"nccl {what}: the buffer is on DLPack device "
                             f"({int(dev_type)}, {int(dev_id)}) but this rank's GPU is CUDA "
                             f"device {device} ({_KDL_CUDA}, {device}) - move it there; CPU "
                             f"buffers go through the gloo transport")
        stream = self._streams[device]
        with cupy.cuda.Device(device):
            if isinstance(buf, cupy.ndarray):
                array = buf
                stream.wait_event(cupy.cuda.get_current_stream().record())
            else:
                with stream:        # DLPack: the producer makes `stream` wait for its work
                    array = cupy.from_dlpack(buf)
        if array.ndim != 1 or not array.flags.c_contiguous:
            raise RefitError(f"nccl {what}: buffers are 1-D and contiguous, got shape "
                             f"{tuple(array.shape)} strides {tuple(array.strides)} - pack it "
                             f"into a staging buffer first")
        return array, int(array.data.ptr)

    def _run(self, ops: list[_Op], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        order = _order_posts([o.post for o in ops], self._local, self.world_size)
        ops = [ops[i] for i in order if ops[i].post.nbytes > 0]
        posts = [o.post for o in ops]
        if not ops:
            return
        comms = list(self._comms.values())
        fut = self._worker.submit(lambda: self._issue(ops))
        wait_or_abort([_Done(fut)], comms, posts, where=self._where,
                      stage="issuing the group (ncclGroupEnd also connects to new peers)",
                      timeout=timeout, deadline=deadline, abort=self._abort)
        try:
            events = fut.result()
        except Exception as e:
            note = self._abort()
            raise TransportError(f"nccl group on {self._where} failed with posts "
                                 f"{_describe(posts)}: {e}. {note}") from e
        wait_or_abort(events, comms, posts, where=self._where,
                      stage="the transfers ran on the GPU", timeout=timeout,
                      deadline=deadline, abort=self._abort)

    def _issue(self, ops: Sequence[_Op]) -> list[Any]:
        """On the worker: issue ``ops`` in one NCCL group; return one event per device."""
        cupy, nccl = self._cupy, self._nccl
        nccl.groupStart()
        try:
            for op in ops:
                comm = self._comms[op.local_rank]
                stream = self._streams[op.device].ptr
                with cupy.cuda.Device(op.device):
                    if op.post.kind == "send":
                        comm.send(op.ptr, op.post.nbytes, _NCCL_UINT8, op.post.dst_rank, stream)
                    else:
                        comm.recv(op.ptr, op.post.nbytes, _NCCL_UINT8, op.post.src_rank, stream)
        finally:
            nccl.groupEnd()
        events = []
        for dev in sorted({op.device for op in ops}):
            with cupy.cuda.Device(dev):
                self._events[dev].record(self._streams[dev])
                events.append(_EventDone(self._events[dev], cupy.cuda.runtime,
                                         f"the nccl transfers on CUDA device {dev}"))
        return events

    def _abort(self) -> str:
        """Abort the communicators if no thread is inside NCCL on them, else abandon them."""
        self._broken = "a group timed out or failed and its communicator was given up"
        if not self._worker.wait_idle(_BUSY_GRACE_S):
            # Abort does not wait for a thread inside a blocking communicator's call and frees
            # the communicator under it; abort it from that thread once it returns instead.
            self._worker.submit(self._abort_comms)
            return ("The communicator was abandoned, not aborted: a thread is still inside "
                    "ncclGroupEnd on it (it is aborted if that call ever returns); restart "
                    "this process to release it.")
        fut = self._worker.submit(self._abort_comms)
        try:
            fut.result(timeout=_ABORT_GRACE_S)
        except concurrent.futures.TimeoutError:
            return f"ncclCommAbort did not return within {_ABORT_GRACE_S:.0f} s."
        except Exception as e:
            return f"ncclCommAbort failed: {e}."
        return "The communicator was aborted."

    def _abort_comms(self) -> None:
        for comm in self._comms.values():
            comm.abort()


def _new_communicator(nccl: Any, world_size: int, uid: bytes, rank: int) -> Any:
    try:
        return nccl.NcclCommunicator(world_size, uid, rank)            # CuPy >= 14: bytes
    except TypeError:                                                  # CuPy 13: signed chars
        return nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid),
                                     rank)


def _check_devices(devices: Mapping[int, int], world_size: int, count: int,
                   multi_rank: tuple[bool, str] = (False, "")) -> dict[int, int]:
    """The ranks' devices, checked. ``multi_rank`` (``nccl_setup.multi_rank_gpu``): whether
    NCCL takes two ranks of one GPU here, and what that needs when it does not."""
    if world_size < 1:
        raise RefitError(f"world_size must be >= 1, got {world_size}")
    if not devices:
        raise RefitError("devices is empty: pass {world rank: CUDA device} for the ranks this "
                         "process hosts")
    out: dict[int, int] = {}
    by_device: dict[int, int] = {}
    for rank, dev in sorted(devices.items()):
        rank, dev = int(rank), int(dev)
        if not 0 <= rank < world_size:
            raise RefitError(f"rank {rank} is not in the communicator (ranks 0..{world_size - 1})")
        if not 0 <= dev < count:
            raise RefitError(f"rank {rank} is mapped to CUDA device {dev}, but this process "
                             f"sees {count} device(s) (0..{count - 1}); check "
                             f"CUDA_VISIBLE_DEVICES")
        if dev in by_device and not multi_rank[0]:
            raise RefitError(f"ranks {by_device[dev]} and {rank} both map to CUDA device {dev}; "
                             f"{multi_rank[1]}")
        by_device[dev] = rank
        out[rank] = dev
    return out
