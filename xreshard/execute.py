"""The executor: the only stage that touches memory and the network.

For each round of a schedule it packs buckets from source bindings into staging (or sends
the bound view itself when a bucket is one contiguous run), posts every send and receive
of the round in one transport group, then unpacks received staging into destination
bindings. Casting happens on the sender at pack time, so the wire carries the smaller
dtype.

A *binding* is what a rank holds of a tensor, in the tensor's canonical coordinates: an
array (numpy on CPU, CuPy on GPU) for product layouts, a list of arrays (one per region)
for explicit ones. Bindings may be strided views (a transposed Flax kernel, one row range
of vLLM's fused qkv); ``layout.locate(rank, region)`` says where a region sits in them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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
           "cupy_knows", "device_of", "numpy_dtype", "view_of", "widened"]


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
        rows, cols = out.shape
        for i in range(0, rows, _TILE):
            for j in range(0, cols, _TILE):
                np.copyto(out[i:i + _TILE, j:j + _TILE], src[i:i + _TILE, j:j + _TILE],
                          casting=casting)
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
    """

    def __init__(self, schedule: Schedule, src_layouts: Mapping[str, Layout],
                 dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str],
                 src_bindings: Bindings, dst_bindings: Bindings, transport: Transport,
                 timeout: float, alloc: Callable[[int], Any] | None = None):
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
        #: staging per CUDA device ordinal (None: host memory), reused across runs
        self._arena: dict[int | None, Any] = {}

    # ------------------------------------------------------------ views

    def _src(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.src_bindings[(rank, name)], self.src_layouts[name], rank, region)

    def _dst(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.dst_bindings[(rank, name)], self.dst_layouts[name], rank, region)

    def _zero_copy_send(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        it = b.items[0]
        if self.src_layouts[it.name].dtype != self.wire[it.name]:
            return None
        view = self._src(b.src, it.name, it.region)
        if not view.flags.c_contiguous:
            return None
        return view.reshape(-1).view(np.uint8)

    def _zero_copy_recv(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        it = b.items[0]
        if self.dst_layouts[it.name].dtype != self.wire[it.name]:
            return None
        view = self._dst(b.dst, it.name, it.region)
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
        for it, off in self._packed(b):
            src = self._src(b.src, it.name, it.region)
            wire = self.wire[it.name]
            out = buf[off:off + it.nbytes].view(bits_dtype(itemsize(wire))).reshape(
                it.region.shape)
            copy_into(_xp(out), out, wire, src, self.src_layouts[it.name].dtype)

    def _unpack(self, b: Bucket, buf: Any) -> None:
        for it, off in self._packed(b):
            dst = self._dst(b.dst, it.name, it.region)
            wire = self.wire[it.name]
            data = buf[off:off + it.nbytes].view(bits_dtype(itemsize(wire))).reshape(
                it.region.shape)
            copy_into(_xp(dst), dst, self.dst_layouts[it.name].dtype, data, wire)

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

    def _staging_needed(self) -> dict[int | None, int]:
        need: dict[int | None, int] = {}
        for buckets in self.schedule.rounds:
            total: dict[int | None, int] = {}
            for b in buckets:
                if b.src in self._local_src and self._zero_copy_send(b) is None:
                    dev = self._device.get(b.src)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
                if b.dst in self._local_dst and self._zero_copy_recv(b) is None:
                    dev = self._device.get(b.dst)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
            for dev, n in total.items():
                need[dev] = max(need.get(dev, 0), n)
        return need

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

    def _round(self, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        tr = time.perf_counter()
        offsets: dict[int | None, int] = {}
        unpack: list[tuple[Bucket, Any]] = []
        with self.transport.group(self.timeout):
            # receives first, so peers' sends can start while this process packs
            for b in buckets:
                if b.dst in self._local_dst:
                    buf = self._zero_copy_recv(b)
                    if buf is None:
                        buf = self._take(offsets, b.dst, b.nbytes)
                        unpack.append((b, buf))
                    else:
                        stats.num_zero_copy += 1
                    self.transport.recv(buf, b.src, b.dst, b.tag)
                    stats.bytes_received += b.nbytes
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
    for bindings in sides:
        for (rank, name), b in bindings.items():
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
