"""The executor: the only stage that touches memory and the network.

For each round of a schedule it packs buckets from source bindings into staging (or sends
the bound view itself when a bucket is one contiguous run), posts every send and receive
of the round in one transport group, then unpacks received staging into destination
bindings. Casting happens on the sender at pack time, so the wire carries the smaller
dtype.

Pipelined (the default for host bindings): one thread, the *wire*, runs the transport
groups one after another, while the calling thread packs and unpacks around it:

```
 calling thread  pack 0 | pack 1 | local copies  | unpack 0 | pack 2 | unpack 1 | pack 3 ...
 wire thread          group 0 ........ | group 1 ............... | group 2 .........
```

Each send is handed to the wire as soon as it is packed (a transport that starts posts at
once, gloo or shm, moves message i while i+1 packs), round k+1 is packed while round k is
in flight, and round k is unpacked while round k+1 is. Staging is double-buffered: round
k and k+1 live in the arena side by side (round k at its bottom when k is even, at its
top when odd), so the arena is the largest sum of two consecutive rounds' staging, which
must fit ``staging_bytes`` x the ranks sharing it (the refit schedules with half the
budget per round for that); a schedule whose consecutive rounds do not fit runs round
after round. Only one thread ever touches the transport, so a transport needs nothing
beyond the grouped protocol (and NCCL's groupStart/End semantics hold: the wire opens a
group, posts, closes it). Device (CUDA) bindings run round after round: their copies and
NCCL calls are queued asynchronously on the device's current stream already, and that
stream is per thread in CuPy, so a second thread would need cross-stream events.

A *binding* is what a rank holds of a tensor, in the tensor's canonical coordinates: an
array (numpy on CPU, CuPy on GPU) for product layouts, a list of arrays (one per region)
for explicit ones. Bindings may be strided views (a transposed Flax kernel, one row range
of vLLM's fused qkv); ``layout.locate(rank, region)`` says where a region sits in them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .dtypes import ITEMSIZE, as_dtype, bits, bits_dtype, dtype_name, itemsize, numpy_dtype
from .errors import RefitError
from .layout import Layout, Region
from .schedule import Bucket, Schedule
from .transport.base import Transport, TransportTimeout

logger = logging.getLogger(__name__)

#: (rank, tensor name) -> binding
Bindings = Mapping[tuple[int, str], Any]

__all__ = ["Bindings", "ExecStats", "Executor", "copy_into", "cuda_preflight",
           "cupy_knows", "device_of", "gc_paused", "numpy_dtype", "view_of", "widened"]


_GC_LOCK = threading.Lock()
_GC_STATE = [0, False]      # nesting depth, whether the collector was on at the first entry
#: benchmarks switch the pause off to measure what it saves
PAUSE_GC = True


@contextlib.contextmanager
def gc_paused() -> Any:
    """Pause Python's cyclic garbage collector for a block (nested and threads: the last to
    leave restores it).

    A refit call allocates ~100 short-lived objects per tensor (views, slices, tuples);
    with thousands of tensors that triggers collections that traverse the whole heap of the
    process (a JAX or torch process holds millions of objects): measured, about half of a
    3,000-tensor call. Nothing the block allocates is cyclic garbage, and what it leaves is
    collected at the collector's next turn after the block. The collector is per process:
    while a refit started with ``Refit.start`` runs, the caller's own cyclic garbage waits
    for the refit's end too (reference counting still frees everything else).
    """
    if not PAUSE_GC:
        yield
        return
    with _GC_LOCK:
        if _GC_STATE[0] == 0:
            _GC_STATE[1] = gc.isenabled()
            gc.disable()
        _GC_STATE[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_STATE[0] -= 1
            if _GC_STATE[0] == 0 and _GC_STATE[1]:
                gc.enable()


def _xp(arr: Any) -> Any:
    """The array module of ``arr``: numpy, or CuPy for device arrays."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # only device bindings get here
    return cupy


_TILE = 256


def copy_into(xp: Any, out: Any, out_dtype: str, src: Any, src_dtype: str) -> None:
    """``out[...] = src`` (same shape): bits when the dtypes are equal, values cast otherwise.

    ``out_dtype`` / ``src_dtype`` are the canonical dtypes the arrays hold, whatever the
    arrays' own dtypes say: a binding may be a raw-bits view (a bf16 tensor seen as
    ``uint16``), so an equal pair is copied as same-size unsigned ints and never
    value-cast, on numpy and CuPy alike.

    A 2-D source or destination whose inner dim is the strided one (a transposed Flax
    kernel) is copied in square tiles so both sides stay in cache: numpy's plain strided
    copy of a transpose runs at a fraction of memory bandwidth.
    """
    if out_dtype == src_dtype:
        out, src = bits(out), bits(src)
        if xp is not np:
            out, src = widened(out, src, _device_ptr)
        casting = "no"
    else:
        out, src = as_dtype(out, out_dtype), as_dtype(src, src_dtype)
        casting = "unsafe"
    if xp is np and out.ndim == 2 and out.size > _TILE * _TILE and (
            src.strides[0] < src.strides[1] or out.strides[0] < out.strides[1]):
        # 512 x 512 two-byte tiles ran ~20% faster than 256 x 256 here (bf16 kernels)
        t = 2 * _TILE if out.dtype.itemsize <= 2 else _TILE
        rows, cols = out.shape
        for i in range(0, rows, t):
            for j in range(0, cols, t):
                np.copyto(out[i:i + t, j:j + t], src[i:i + t, j:j + t], casting=casting)
        return
    xp.copyto(out, src, casting=casting)


def widened(out: Any, src: Any, ptr: Callable[[Any], int]) -> tuple[Any, Any]:
    """Same-shape bit views ``(out, src)`` re-viewed with the widest unsigned element (up
    to 8 bytes) that both allow, so a copy kernel moves fewer, larger elements.

    Both must have a contiguous last dim whose byte length, every other stride and the data
    pointer (``ptr(arr)``) divide by the new size: a bf16 region with 16 KiB runs copies as
    uint64, 4x fewer elements. Anything else (a transposed view) comes back unchanged.
    """
    k = out.dtype.itemsize
    if out.ndim == 0 or out.size == 0 or k >= 8:
        return out, src
    row = out.shape[-1] * k
    for w in (8, 4, 2):
        if w <= k:
            break
        if row % w == 0 and all(a.strides[-1] == k and ptr(a) % w == 0
                                and all(st % w == 0 for st in a.strides[:-1])
                                for a in (out, src)):
            wide = bits_dtype(w)
            return out.view(wide), src.view(wide)
    return out, src


def _device_ptr(arr: Any) -> int:
    return int(arr.data.ptr)


def view_of(binding: Any, layout: Layout, rank: int, region: Region) -> Any:
    """The part of ``binding`` (held by ``rank``) that stores ``region``."""
    i, slices = layout.locate(rank, region)
    arr = binding if layout.is_product else binding[i]
    return arr[slices + (Ellipsis,)]


@dataclass
class ExecStats:
    """What one process moved in one run."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    num_messages: int = 0
    num_zero_copy: int = 0
    num_rounds: int = 0
    staging_bytes: int = 0
    pipelined: bool = False
    seconds: float = 0.0
    per_round_seconds: list[float] = field(default_factory=list)


class Executor:
    """Runs a schedule between bindings over a transport.

    Device bindings (CuPy arrays over torch / JAX GPU memory) are packed, unpacked and
    copied on the current CuPy stream of the device that holds them, under that device
    (a process with several GPUs keeps one staging arena per device). Before the first
    run on a device, :func:`cuda_preflight` compiles and runs the copy kernels once, so a
    missing NVRTC or header fails with a clear error instead of mid-refit.

    Contract: when :meth:`run` returns, every byte of every destination has landed and
    every read of every source is done, for any stream: the executor waits (on the host,
    within ``timeout``) for an event recorded after its last copy on each device. So the
    caller may read destinations on its current stream (torch, vLLM, a side stream) and
    overwrite or donate sources without a device synchronize.

    Args:
        schedule: this process's buckets (see :mod:`xreshard.schedule`).
        src_layouts / dst_layouts: layouts of every tensor on each side. Their dtypes are
            the truth: a binding may be a raw-bits view of its tensor (see copy_into).
        wire_dtypes: dtype on the wire per tensor.
        src_bindings / dst_bindings: ``(rank, name) -> binding`` for this process's ranks.
        transport: moves the buckets (routes same-process pairs to a local copy).
        timeout: seconds each round may take.
        alloc: ``alloc(nbytes)`` -> a 1-D uint8 staging array; called under the rank's
            CUDA device for device bindings. Default: numpy for host bindings, CuPy for
            device ones.
        pipeline: overlap packing, the wire and unpacking (see the module docstring);
            None reads ``XRESHARD_EXECUTOR`` (``pipelined``, the default, or ``rounds``).
            Every process of a refit must choose the same (the refit schedules rounds of
            half the budget when pipelining).
        staging_bytes: the most staging one rank may hold; the pipelined arena (two
            rounds) stays within it times the ranks sharing the arena, else rounds run one
            after another. None: no cap.
    """

    def __init__(self, schedule: Schedule, src_layouts: Mapping[str, Layout],
                 dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str],
                 src_bindings: Bindings, dst_bindings: Bindings, transport: Transport,
                 timeout: float, alloc: Callable[[int], Any] | None = None,
                 pipeline: bool | None = None, staging_bytes: int | None = None):
        self.schedule = schedule
        self.src_layouts = src_layouts
        self.dst_layouts = dst_layouts
        # canonical names: an array's own dtype may be raw bits (see copy_into)
        self.wire = {n: d if isinstance(d, str) and d in ITEMSIZE else dtype_name(d)
                     for n, d in wire_dtypes.items()}
        self.src_bindings = src_bindings
        self.dst_bindings = dst_bindings
        self.transport = transport
        self.timeout = timeout
        self._alloc = alloc
        self.pipeline = pipelined_by_default() if pipeline is None else bool(pipeline)
        self._programs = _programs_for(schedule, src_layouts, dst_layouts, wire_dtypes)
        self.staging_bytes = staging_bytes
        #: staging per CUDA device ordinal (None: host memory), reused across runs
        self._arena: dict[int | None, Any] = {}

    # ------------------------------------------------------------ views

    def _src(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.src_bindings[(rank, name)], self.src_layouts[name], rank, region)

    def _dst(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.dst_bindings[(rank, name)], self.dst_layouts[name], rank, region)

    def _program(self, b: Bucket, side: int) -> list[tuple]:
        """How to pack (side 0) or unpack (side 1) bucket ``b``: per item, in message order,
        (binding key, buffer index or None, slices, byte range, wire bits dtype, shape,
        wire dtype, binding dtype). Geometry only, so it is computed once per bucket and
        reused by every call with the same schedule and layouts (see ``_programs_for``)."""
        key = (id(b), side)
        prog = self._programs.get(key)
        if prog is None:
            layouts = self.src_layouts if side == 0 else self.dst_layouts
            rank = b.src if side == 0 else b.dst
            prog = []
            for it, off in self._packed(b):
                lay = layouts[it.name]
                i, slices = lay.locate(rank, it.region)
                wire = self.wire[it.name]
                prog.append(((rank, it.name), None if lay.is_product else i,
                             slices + (Ellipsis,), off, off + it.nbytes,
                             bits_dtype(itemsize(wire)), it.region.shape, wire, lay.dtype))
            self._programs[key] = prog
        return prog

    def _zero_copy_send(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        key, i, sl, _, _, _, _, wire, dtype = self._program(b, 0)[0]
        if dtype != wire:
            return None
        arr = self.src_bindings[key]
        view = (arr if i is None else arr[i])[sl]
        if not view.flags.c_contiguous:
            return None
        return view.reshape(-1).view(np.uint8)

    def _zero_copy_recv(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        key, i, sl, _, _, _, _, wire, dtype = self._program(b, 1)[0]
        if dtype != wire:
            return None
        arr = self.dst_bindings[key]
        view = (arr if i is None else arr[i])[sl]
        if not view.flags.c_contiguous or not getattr(view.flags, "writeable", True):
            return None
        return view.reshape(-1).view(np.uint8)

    # ------------------------------------------------------------ pack / unpack

    def _packed(self, b: Bucket) -> list[tuple[Any, int]]:
        """A bucket's items with their byte offsets in its message.

        Widest wire dtype first: element sizes are powers of two, so every item then starts
        at a multiple of its own element size (the message starts 256-byte aligned in
        staging). CUDA faults on misaligned loads; numpy would only be slower. Both peers
        derive the same order from the same bucket.
        """
        items = sorted(b.items, key=lambda it: -itemsize(self.wire[it.name]))
        out, off = [], 0
        for it in items:
            out.append((it, off))
            off += it.nbytes
        return out

    def _pack(self, b: Bucket, buf: Any) -> None:
        bindings = self.src_bindings
        xp = _xp(buf)
        if xp is np and len(b.items) > 1:
            return self._pack_runs(b, buf)
        for key, i, sl, lo, hi, wide, shape, wire, dtype in self._program(b, 0):
            arr = bindings[key]
            out = buf[lo:hi].view(wide).reshape(shape)
            copy_into(xp, out, wire, (arr if i is None else arr[i])[sl], dtype)

    def _pack_runs(self, b: Bucket, buf: np.ndarray) -> None:
        """Host packing of a bucket of many items: consecutive small items that need no
        cast are gathered by one ``np.concatenate`` into their run of the message (one C
        call instead of a copy per item; thousands of tiny tensors share a bucket)."""
        key = (id(b), 2)
        runs = self._programs.get(key)
        if runs is None:
            runs = []
            for e in self._program(b, 0):
                small = e[7] == e[8] and e[4] - e[3] <= _RUN_ITEM_BYTES
                if small and runs and runs[-1][0] and runs[-1][3] == e[5]:
                    runs[-1][1].append(e)
                    runs[-1][2] = e[4]
                else:
                    runs.append([small, [e], e[4], e[5]])
            runs = [(small, tuple(es), es[0][3], hi, wide) for small, es, hi, wide in runs]
            self._programs[key] = runs
        bindings = self.src_bindings
        for small, entries, lo, hi, wide in runs:
            if small and len(entries) > 1:
                parts = []
                for key_, i, sl, _, _, _, _, _, _ in entries:
                    arr = bindings[key_]
                    parts.append((arr if i is None else arr[i])[sl].view(wide).reshape(-1))
                np.concatenate(parts, out=buf[lo:hi].view(wide))
                continue
            for key_, i, sl, lo_, hi_, wide_, shape, wire, dtype in entries:
                arr = bindings[key_]
                out = buf[lo_:hi_].view(wide_).reshape(shape)
                copy_into(np, out, wire, (arr if i is None else arr[i])[sl], dtype)

    def _unpack(self, b: Bucket, buf: Any) -> None:
        bindings = self.dst_bindings
        for key, i, sl, lo, hi, wide, shape, wire, dtype in self._program(b, 1):
            arr = bindings[key]
            dst = (arr if i is None else arr[i])[sl]
            data = buf[lo:hi].view(wide).reshape(shape)
            copy_into(_xp(dst), dst, dtype, data, wire)

    def _local_copy(self, t: Any) -> int:
        src = self._src(t.src, t.name, t.region)
        dst = self._dst(t.dst, t.name, t.region)
        wire = self.wire[t.name]
        src_dtype, dst_dtype = self.src_layouts[t.name].dtype, self.dst_layouts[t.name].dtype
        xp = _xp(dst)
        if src_dtype != wire and dst_dtype != wire:
            # the cast the wire would have made, then the receiver's
            src, src_dtype = as_dtype(src, src_dtype).astype(numpy_dtype(wire)), wire
        copy_into(xp, dst, dst_dtype, src, src_dtype)
        return t.nbytes

    # ------------------------------------------------------------ devices

    def _devices(self) -> dict[int, int | None]:
        """CUDA device ordinal of each local rank's bindings (None: host memory)."""
        return binding_devices(self.src_bindings, self.dst_bindings)

    def _on(self, rank: int) -> Any:
        """Context for work on ``rank``'s device: ``cupy.cuda.Device`` or nothing."""
        return _device_ctx(self._device.get(rank))

    def _cast_problems(self) -> list[str]:
        """Casts this process would run on a GPU that CuPy cannot compute."""
        problems = []
        for side, bindings, layouts in (("send", self.src_bindings, self.src_layouts),
                                        ("receive", self.dst_bindings, self.dst_layouts)):
            problems += cast_problems(bindings, layouts, lambda n: self.wire[n], self._device,
                                      side)
        return sorted(set(problems))

    # ------------------------------------------------------------ run

    def _round_needs(self) -> list[dict[int | None, int]]:
        """Staging bytes each round takes, per device (None: host memory)."""
        needs = []
        for buckets in self.schedule.rounds:
            total: dict[int | None, int] = {}
            for b in buckets:
                if b.src in self._local_src and self._zero_copy_send(b) is None:
                    dev = self._device.get(b.src)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
                if b.dst in self._local_dst and self._zero_copy_recv(b) is None:
                    dev = self._device.get(b.dst)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
            needs.append(total)
        return needs

    def _staging_needed(self) -> dict[int | None, int]:
        need: dict[int | None, int] = {}
        for total in self._round_needs():
            for dev, n in total.items():
                need[dev] = max(need.get(dev, 0), n)
        return need

    def _double_buffered(self, needs: list[dict[int | None, int]]
                         ) -> dict[int | None, int] | None:
        """Arena bytes per device that hold any two consecutive rounds side by side, or
        None when that exceeds ``staging_bytes`` x the local ranks on the device."""
        arena: dict[int | None, int] = {}
        for k, total in enumerate(needs):
            nxt = needs[k + 1] if k + 1 < len(needs) else {}
            for dev in set(total) | set(nxt):
                arena[dev] = max(arena.get(dev, 0), total.get(dev, 0) + nxt.get(dev, 0))
        if self.staging_bytes is not None:
            ranks: dict[int | None, int] = {}
            for r in self._local_src | self._local_dst:
                dev = self._device.get(r)
                ranks[dev] = ranks.get(dev, 0) + 1
            for dev, n in arena.items():
                if n > self.staging_bytes * max(ranks.get(dev, 1), 1):
                    return None
        return arena

    def _staging(self, need: dict[int | None, int]) -> None:
        if self._arena is None:         # a caller reset it
            self._arena = {}
        for dev, n in need.items():
            have = self._arena.get(dev)
            if have is not None and len(have) >= n:
                continue
            self._arena[dev] = None     # free the old one first
            with _device_ctx(dev):
                alloc = self._alloc or (_host_alloc if dev is None else _device_alloc)
                self._arena[dev] = alloc(n)

    def _take(self, offsets: dict[int | None, int], rank: int, nbytes: int) -> Any:
        dev = self._device.get(rank)
        off = offsets.get(dev, 0)
        offsets[dev] = off + _aligned(nbytes)
        return self._arena[dev][off:off + nbytes]

    def run(self) -> ExecStats:
        """Move everything; raises RefitError (TransportTimeout on a silent peer).

        When it returns, destinations are written and sources read, on every stream (see
        the class docstring).
        """
        with gc_paused():
            return self._run()

    def _run(self) -> ExecStats:
        stats = ExecStats()
        t0 = time.perf_counter()
        self._local_src = {r for r, _ in self.src_bindings}
        self._local_dst = {r for r, _ in self.dst_bindings}
        self._device = self._devices()
        gpus = sorted({d for d in self._device.values() if d is not None})
        if gpus:
            problems = self._cast_problems()
            if problems:
                raise RefitError("casts this refit needs cannot run on the GPU: "
                                 + "; ".join(problems[:10]) + " - send the tensor in its "
                                 "own dtype (wire_dtype), or cast it in the framework first")
            for dev in gpus:
                cuda_preflight(dev)
        ok = False
        try:
            arena = None
            if self.pipeline and not gpus and len(self.schedule.rounds) > 0:
                needs = self._round_needs()
                arena = self._double_buffered(needs)
            if arena is not None:
                self._staging(arena)
                stats.staging_bytes = sum(arena.values())
                stats.pipelined = True
                self._pipelined(needs, arena, stats)
            else:
                for t in self.schedule.local_copies:
                    with self._on(t.dst):
                        stats.bytes_local += self._local_copy(t)
                need = self._staging_needed()
                self._staging(need)
                stats.staging_bytes = sum(need.values())
                for buckets in self.schedule.rounds:
                    self._round(buckets, stats)
            ok = True
        finally:
            if gpus:    # also after a failure: no copy may still read or write afterwards
                try:
                    _wait_devices(gpus, time.monotonic() + self.timeout, self.timeout)
                except Exception as e:
                    if ok:
                        raise
                    logger.warning("after a failed refit, waiting for its copies failed "
                                   "too: %s", e)
        stats.num_rounds = len(self.schedule.rounds)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _recv_buffers(self, buckets: Sequence[Bucket], offsets: dict[int | None, int],
                      stats: ExecStats) -> tuple[list[tuple[Any, Bucket]],
                                                 list[tuple[Bucket, Any]]]:
        """Where each of this process's receives in ``buckets`` lands: the destination view
        itself (zero-copy) or staging taken at ``offsets``. Returns ``(buffer, bucket)``
        for every receive and ``(bucket, staging)`` for those to unpack."""
        recvs: list[tuple[Any, Bucket]] = []
        unpack: list[tuple[Bucket, Any]] = []
        for b in buckets:
            if b.dst in self._local_dst:
                buf = self._zero_copy_recv(b)
                if buf is None:
                    buf = self._take(offsets, b.dst, b.nbytes)
                    unpack.append((b, buf))
                else:
                    stats.num_zero_copy += 1
                recvs.append((buf, b))
                stats.bytes_received += b.nbytes
        return recvs, unpack

    def _round(self, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        tr = time.perf_counter()
        offsets: dict[int | None, int] = {}
        recvs, unpack = self._recv_buffers(buckets, offsets, stats)
        with self.transport.group(self.timeout):
            # receives first, so peers' sends can start while this process packs
            for buf, b in recvs:
                self.transport.recv(buf, b.src, b.dst, b.tag)
            # transports that start posts at once (gloo) move message i while i+1 packs
            for b in buckets:
                if b.src in self._local_src:
                    buf = self._zero_copy_send(b)
                    if buf is None:
                        buf = self._take(offsets, b.src, b.nbytes)
                        with self._on(b.src):
                            self._pack(b, buf)
                    else:
                        stats.num_zero_copy += 1
                    self.transport.send(buf, b.src, b.dst, b.tag)
                    stats.bytes_sent += b.nbytes
                    stats.num_messages += 1
        for b, buf in unpack:
            with self._on(b.dst):
                self._unpack(b, buf)
        stats.per_round_seconds.append(time.perf_counter() - tr)

    # ------------------------------------------------------------ pipelined run

    def _pipelined(self, needs: list[dict[int | None, int]], arena: dict[int | None, int],
                   stats: ExecStats) -> None:
        """Rounds overlapped: the wire thread runs round k's group while this thread packs
        round k+1 and unpacks round k-1 (host bindings only)."""
        rounds = self.schedule.rounds
        wire = _Wire(self.transport, self.timeout)
        pending: dict[int, list[tuple[Bucket, Any]]] = {}
        started: dict[int, float] = {}

        def finish(k: int) -> None:
            wire.wait(k)
            for b, buf in pending.pop(k):
                self._unpack(b, buf)
            stats.per_round_seconds.append(time.perf_counter() - started.pop(k))

        try:
            for k, buckets in enumerate(rounds):
                if k >= 2:
                    finish(k - 2)       # frees round k's half of the arena
                started[k] = time.perf_counter()
                # round k sits at the bottom of the arena when k is even, at its top when
                # odd: two consecutive rounds never overlap (see _double_buffered)
                offsets = {dev: 0 if k % 2 == 0 else arena[dev] - needs[k].get(dev, 0)
                           for dev in arena}
                recvs, unpack = self._recv_buffers(buckets, offsets, stats)
                pending[k] = unpack
                wire.open(k, recvs)
                for b in buckets:
                    if b.src in self._local_src:
                        buf = self._zero_copy_send(b)
                        if buf is None:
                            buf = self._take(offsets, b.src, b.nbytes)
                            self._pack(b, buf)
                        else:
                            stats.num_zero_copy += 1
                        wire.send(buf, b)
                        stats.bytes_sent += b.nbytes
                        stats.num_messages += 1
                wire.close(k)
                if k == 0:      # same-rank copies overlap the first round's wire
                    for t in self.schedule.local_copies:
                        stats.bytes_local += self._local_copy(t)
            if not rounds:
                for t in self.schedule.local_copies:
                    stats.bytes_local += self._local_copy(t)
            for k in sorted(pending):
                finish(k)
        except BaseException as e:
            wire.abort(e)
            raise
        finally:
            wire.stop()


class _Wire:
    """The thread that runs an executor's transport groups, one after another.

    The calling thread hands it ``open(k, receives)``, then each send as soon as it is
    packed, then ``close(k)``; the wire opens round k's group, posts the receives, posts
    each send as it comes and closes the group (which waits for every post, within the
    timeout). ``wait(k)`` returns once round k's group exited, or raises what it raised.
    """

    def __init__(self, transport: Transport, timeout: float):
        self.transport = transport
        self.timeout = timeout
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self._failed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="xreshard-wire", daemon=True)
        self._thread.start()

    def open(self, k: int, recvs: list[tuple[Any, Bucket]]) -> None:
        self._check()
        self._done[k] = threading.Event()
        self._q.put(("open", k, recvs))

    def send(self, buf: Any, b: Bucket) -> None:
        self._check()
        self._q.put(("send", buf, b))

    def close(self, k: int) -> None:
        self._q.put(("close", k, None))

    def _check(self) -> None:
        if self._failed.is_set():
            assert self._error is not None
            raise self._error

    def wait(self, k: int) -> None:
        """Until round k's group exited; raises the wire's error (a timeout names the peer)."""
        done = self._done[k]
        # the group bounds its own waits by the timeout; this bound only guards against a
        # transport that does not
        deadline = time.monotonic() + 2 * self.timeout + 5.0
        while not done.wait(0.05):
            if self._failed.is_set():
                break
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{self.transport.name}: round {k} did not complete "
                                       f"within {self.timeout} s (the transport did not "
                                       f"return from its group)")
        self._check()

    def abort(self, e: BaseException) -> None:
        """The calling thread failed: the open group exits with ``e`` (no more posts)."""
        self._q.put(("abort", e, None))

    def stop(self) -> None:
        """End the thread once it finished what it was handed (its waits are bounded)."""
        self._q.put(("stop", None, None))
        self._thread.join(2 * self.timeout + 5.0)

    def _loop(self) -> None:
        group = None
        k = -1
        while True:
            op, a, b = self._q.get()
            if op == "stop":
                if group is not None:       # never closed: the caller failed
                    with contextlib.suppress(BaseException):
                        group.__exit__(RuntimeError, RuntimeError("executor stopped"), None)
                return
            if self._failed.is_set():
                continue                    # drain: nothing more is posted after a failure
            try:
                if op == "open":
                    k = a
                    group = self.transport.group(self.timeout)
                    group.__enter__()
                    for buf, bk in b:
                        self.transport.recv(buf, bk.src, bk.dst, bk.tag)
                elif op == "send":
                    self.transport.send(a, b.src, b.dst, b.tag)
                elif op == "close":
                    g, group = group, None
                    g.__exit__(None, None, None)
                    self._done[a].set()
                elif op == "abort":
                    g, group = group, None
                    if g is not None:
                        with contextlib.suppress(BaseException):
                            g.__exit__(type(a), a, a.__traceback__)
                    self._fail(a)
            except BaseException as e:      # noqa: BLE001 - raised in the calling thread
                if group is not None and op != "close":
                    g, group = group, None
                    with contextlib.suppress(BaseException):
                        g.__exit__(type(e), e, e.__traceback__)
                group = None
                self._fail(e)
                if k in self._done:
                    self._done[k].set()

    def _fail(self, e: BaseException) -> None:
        if self._error is None:
            self._error = e
        self._failed.set()


#: id(schedule) -> (schedule, src layouts, dst layouts, wire dtypes, programs): the pack
#: and unpack programs of the last few schedules, valid while the same objects are passed
_PROGRAMS: dict[int, tuple] = {}


def _programs_for(schedule: Schedule, src_layouts: Mapping[str, Layout],
                  dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str]) -> dict:
    """The program cache of this schedule (refits pass the same plan and schedule objects on
    every call until they replan; layouts and schedules are immutable)."""
    ent = _PROGRAMS.get(id(schedule))
    if ent is None or not (ent[0] is schedule and ent[1] is src_layouts
                           and ent[2] is dst_layouts and ent[3] is wire_dtypes):
        if len(_PROGRAMS) >= 8:
            _PROGRAMS.clear()
        ent = (schedule, src_layouts, dst_layouts, wire_dtypes, {})
        _PROGRAMS[id(schedule)] = ent
    return ent[4]


def pipelined_by_default() -> bool:
    """``XRESHARD_EXECUTOR``: ``pipelined`` (default) or ``rounds``."""
    kind = os.environ.get("XRESHARD_EXECUTOR", "pipelined").strip().lower()
    if kind not in ("pipelined", "rounds"):
        raise RefitError(f"XRESHARD_EXECUTOR={kind!r}: expected 'pipelined' or 'rounds'")
    return kind == "pipelined"


#: items up to this size are gathered together when packed on the host (see _pack_runs)
_RUN_ITEM_BYTES = 1 << 14

_ALIGN = 256    # staging offsets: what cudaMalloc guarantees, enough for any element


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _device_ctx(dev: int | None) -> Any:
    """``cupy.cuda.Device(dev)`` (CuPy kernels and allocations go to the current device),
    or nothing for host memory."""
    if dev is None:
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.Device(dev)


def _host_alloc(n: int) -> Any:
    return np.empty(n, np.uint8)


def _device_alloc(n: int) -> Any:
    import cupy
    return cupy.empty(n, np.uint8)


def _where(dev: int | None) -> str:
    return "host memory" if dev is None else f"CUDA device {dev}"


def device_of(arr: Any) -> int | None:
    """CUDA device ordinal of a CuPy array, None for a numpy (host) array."""
    if isinstance(arr, np.ndarray):
        return None
    device = getattr(arr, "device", None)       # cupy.ndarray.device: a cupy.cuda.Device
    if device is None or not hasattr(device, "id"):
        raise RefitError(f"a binding is a {type(arr).__module__}.{type(arr).__name__}; "
                         "bindings are numpy arrays (host) or CuPy arrays (CUDA)")
    return int(device.id)


def _wait_devices(devices: Sequence[int], deadline: float, timeout: float) -> None:
    """Wait on the host until every copy queued so far on each device's current CuPy
    stream ran: an event recorded there, polled with the run's deadline."""
    import cupy
    events = []
    for dev in devices:
        with cupy.cuda.Device(dev):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record()                     # on this device's current stream
            events.append((dev, ev))
    interval = 1e-5
    while True:
        late = [dev for dev, ev in events if not ev.done]
        if not late:
            return
        if time.monotonic() >= deadline:
            raise TransportTimeout(
                f"the refit's copies on CUDA device(s) {late} did not finish within "
                f"{timeout} s; the GPU is stuck or oversubscribed")
        time.sleep(interval)
        interval = min(interval * 2, 2e-3)


# ---------------------------------------------------------------------------- CUDA checks

_BF16_NEEDS = "CuPy >= 14 with ml_dtypes and numpy >= 2.1.2"


@functools.lru_cache(maxsize=None)
def cupy_knows(name: str) -> bool:
    """Whether CuPy's kernels (and DLPack import) handle the canonical dtype ``name``.

    bf16 needs CuPy >= 14 with ml_dtypes and numpy >= 2.1.2 (CuPy enables its bf16 loops
    only then); float8 is never computed by CuPy. Either still moves as bits.
    """
    if name.startswith("float8"):
        return False
    if name != "bfloat16":
        return True
    try:
        from cupy._util import bf16_loop    # CuPy >= 14: () when bf16 is off
    except ImportError:
        return False
    return bool(bf16_loop())


def cupy_missing(name: str) -> str:
    """Why CuPy cannot compute with ``name``, and what to do."""
    if name.startswith("float8"):
        return "CuPy has no float8 kernels (float8 moves as bytes, but is never cast here)"
    import importlib.metadata as md
    try:
        import cupy
        have = f"CuPy {cupy.__version__}"
    except ImportError:
        have = "no CuPy"
    try:
        have += f", numpy {np.__version__}, ml_dtypes {md.version('ml_dtypes')}"
    except md.PackageNotFoundError:
        have += f", numpy {np.__version__}, no ml_dtypes"
    return f"{name} arithmetic needs {_BF16_NEEDS} (found {have})"


_PREFLIGHT_DONE: set[int] = set()


def cuda_preflight(device: int) -> None:
    """Once per process and device: compile and run what the executor runs on a GPU.

    A strided copy (pack/unpack) and, where CuPy can, an fp32 -> bf16 cast. CuPy compiles
    kernels with NVRTC at first use; a missing ``libnvrtc``, CUDA headers or a driver too
    old for the CuPy build would otherwise surface in the middle of a refit, after peers
    started sending.

    Raises:
        RefitError: naming what is missing and the packages that bring it.
    """
    if device in _PREFLIGHT_DONE:
        return
    from .transport.nccl import install_hint
    try:
        import cupy
    except ImportError as e:
        raise RefitError(f"device bindings need CuPy: {install_hint()}") from e
    step = "allocating on the device"
    try:
        with cupy.cuda.Device(device):
            a = cupy.arange(64, dtype=cupy.uint16).reshape(8, 8)
            step = "compiling a copy kernel (NVRTC)"
            out = cupy.empty((8, 4), dtype=cupy.uint16)
            cupy.copyto(out, a[:, ::2], casting="no")
            step = "running a copy kernel"
            if out.get().tolist() != a.get()[:, ::2].tolist():
                raise RuntimeError("a strided copy returned wrong values")
            if cupy_knows("bfloat16"):
                step = "compiling a bf16 cast kernel (NVRTC, cuda_bf16.h)"
                bf16 = numpy_dtype("bfloat16")
                x = cupy.asarray(np.array([1.0, -2.5, 6.84375], np.float32))
                y = cupy.empty(3, dtype=bf16)
                cupy.copyto(y, x, casting="unsafe")
                if y.view(cupy.uint16).get().tolist() != \
                        np.array([1.0, -2.5, 6.84375], np.float32).astype(bf16) \
                        .view(np.uint16).tolist():
                    raise RuntimeError("an fp32 -> bf16 cast returned wrong bits")
            cupy.cuda.get_current_stream().synchronize()
    except Exception as e:
        raise RefitError(
            f"CUDA device {device} cannot run the refit's copy kernels: {step} failed: "
            f"{type(e).__name__}: {e}. CuPy compiles its kernels with NVRTC and needs the "
            f"CUDA headers and libnvrtc of its CUDA major version: {install_hint()} "
            f"(they bring NVRTC through cuda-toolkit[nvrtc,cudart]), or install the CUDA "
            f"toolkit matching the CuPy wheel") from e
    _PREFLIGHT_DONE.add(device)


def binding_devices(*sides: Bindings) -> dict[int, int | None]:
    """CUDA device ordinal of each rank's bindings over ``sides`` (None: host memory).

    Raises:
        RefitError: a rank has bindings on two devices.
    """
    out: dict[int, int | None] = {}
    ndarray = np.ndarray
    for bindings in sides:
        for (rank, name), b in bindings.items():
            if type(b) is ndarray and out.get(rank, 0) is None:
                continue                # host memory again (the common case, per tensor)
            arrays = b if isinstance(b, list) else [b]
            for a in arrays:
                dev = device_of(a)
                if out.setdefault(rank, dev) != dev:
                    raise RefitError(
                        f"rank {rank} has bindings in two places ({_where(out[rank])} and "
                        f"{_where(dev)}, tensor {name!r}); a rank is one device - bind "
                        f"each rank's tensors on its own device")
    return out


def cast_problems(bindings: Bindings, layouts: Mapping[str, Layout],
                  wire: Callable[[str], str], devices: Mapping[int, int | None],
                  side: str) -> list[str]:
    """Casts between a binding's dtype and its wire dtype that would run on a GPU where
    CuPy cannot compute them."""
    problems = []
    for (rank, name) in bindings:
        if devices.get(rank) is None or name not in layouts:
            continue
        have, want = layouts[name].dtype, wire(name)
        if have == want:
            continue
        for d in (have, want):
            if not cupy_knows(d):
                problems.append(f"{name!r} ({side}, rank {rank}): {have} <-> {want} on CUDA "
                                f"device {devices[rank]}: {cupy_missing(d)}")
                break
    return problems


def device_problems(sides: Mapping[str, tuple[Bindings, Mapping[str, Layout]]],
                    wire: Callable[[str, str], str]) -> list[str]:
    """What would make this process's part of a refit fail on its devices, found before
    any byte moves (so the refit can refuse it on every rank): bindings of one rank on
    two devices, casts CuPy cannot run, a device whose copy kernels do not compile.

    Args:
        sides: ``{"send" | "receive": (bindings, layouts)}``.
        wire: ``wire(side, name)`` -> the wire dtype of that tensor.
    """
    try:
        devices = binding_devices(*(b for b, _ in sides.values()))
    except RefitError as e:
        return [str(e)]
    gpus = sorted({d for d in devices.values() if d is not None})
    if not gpus:
        return []
    problems = []
    for side, (bindings, layouts) in sides.items():
        problems += cast_problems(bindings, layouts, lambda n, s=side: wire(s, n), devices,
                                  side)
    if problems:
        return ["casts this refit needs cannot run on the GPU: " + "; ".join(
            sorted(set(problems))[:10]) + " - send the tensor in its own dtype (wire_dtype), "
            "or cast it in the framework first"]
    for dev in gpus:
        try:
            cuda_preflight(dev)
        except (ImportError, RuntimeError, RefitError) as e:
            problems.append(str(e))
    return problems
