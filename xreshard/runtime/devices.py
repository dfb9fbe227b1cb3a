"""Where bindings live and what their devices can run: the executor's CUDA side.

Which CUDA device holds each rank's bindings (:func:`binding_devices`), whether CuPy can
compute a dtype there (:func:`cupy_knows`), a once-per-device check that the copy kernels
compile and run (:func:`cuda_preflight`), and :func:`device_problems`, which a refit asks
before any byte moves so that every process refuses the same refit. Host memory is
``None`` throughout. Split out of ``execute.py``; ``xreshard.runtime.execute`` re-exports every
public name.

Streams. The executor packs, unpacks and copies on xreshard's own non-blocking stream of
each device (:func:`own_stream`), never on the legacy default stream that torch's default
stream is (a pack there would serialize with every legacy-stream kernel of the process, and
theirs with it). Bindings are ordered onto the binding thread's current CuPy stream when
they are made (DLPack's handshake; :func:`capture_streams` keeps the caller's streams for a
refit started in a thread); :func:`order_after_current` makes the own streams wait for it,
and :func:`wait_devices` waits on the host for everything queued on them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import RefitError
from ..ir.layout import Layout
from ..transport.base import TransportTimeout, event_done

#: (rank, tensor name) -> binding
Bindings = Mapping[tuple[int, str], Any]

__all__ = ["Bindings", "binding_devices", "capture_streams", "cast_problems", "cuda_preflight",
           "cupy_knows", "cupy_missing", "device_alloc", "device_ctx", "device_of",
           "device_problems", "host_alloc", "order_after_current", "own_stream",
           "wait_devices"]

_OWN_STREAMS: dict[int, Any] = {}


def own_stream(dev: int) -> Any:
    """xreshard's non-blocking CuPy stream on CUDA device ``dev`` (one per process)."""
    s = _OWN_STREAMS.get(dev)
    if s is None:
        import cupy
        with cupy.cuda.Device(dev):
            s = _OWN_STREAMS.setdefault(dev, cupy.cuda.Stream(non_blocking=True))
    return s


@contextlib.contextmanager
def _on_device(dev: int) -> Any:
    import cupy
    with cupy.cuda.Device(dev), own_stream(dev):
        yield


def device_ctx(dev: int | None) -> Any:
    """``cupy.cuda.Device(dev)`` with xreshard's own stream there current (CuPy kernels,
    copies and allocations go to the current device and stream), or nothing for host
    memory."""
    if dev is None:
        return contextlib.nullcontext()
    return _on_device(dev)


def order_after_current(devices: Sequence[int]) -> None:
    """Make xreshard's own stream of each device wait for what this thread's current CuPy
    stream there holds (the producers the bindings were ordered after), without a host
    wait: an event, as DLPack's handshake does."""
    import cupy
    for dev in devices:
        with cupy.cuda.Device(dev):
            current = cupy.cuda.get_current_stream()
            mine = own_stream(dev)
            if current.ptr != mine.ptr:
                mine.wait_event(current.record())


def capture_streams() -> Callable[[], Any]:
    """This thread's current CuPy stream of every device, kept so that another thread can
    make them current (``with capture_streams()():``): a refit started with
    ``Refit.start`` binds and orders in its own thread, where CuPy's current stream (per
    thread) would be the default one, not the caller's. Imports nothing: without CuPy
    loaded there is nothing to keep."""
    cupy: Any = sys.modules.get("cupy")
    streams: list[tuple[int, Any]] = []
    if cupy is not None:
        try:
            for dev in range(int(cupy.cuda.runtime.getDeviceCount())):
                with cupy.cuda.Device(dev):
                    s = cupy.cuda.get_current_stream()
                if s.ptr not in (0, 1, 2):     # the default streams: the thread has them
                    streams.append((dev, s))
        except Exception:       # noqa: BLE001 - no device, no driver: nothing to keep
            streams = []

    @contextlib.contextmanager
    def enter() -> Any:
        entered: list[tuple[int, Any]] = []
        try:
            for dev, s in streams:      # CuPy makes a stream current only under its device
                with cupy.cuda.Device(dev):
                    s.__enter__()
                entered.append((dev, s))
            yield
        finally:
            for dev, s in reversed(entered):
                with cupy.cuda.Device(dev):
                    s.__exit__(None, None, None)
    return enter


def host_alloc(n: int) -> Any:
    return np.empty(n, np.uint8)


def device_alloc(n: int) -> Any:
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


def wait_devices(devices: Sequence[int], deadline: float, timeout: float) -> None:
    """Wait on the host until every copy queued so far on each device's own stream (see
    :func:`own_stream`) ran: an event recorded there, polled with the run's deadline.

    Raises:
        TransportTimeout: the copies did not finish in time.
        CudaError: CUDA reported a hard error (``cudaEventQuery`` returns the errors of
            earlier asynchronous work), at once, with CUDA's text.
    """
    import cupy
    events = []
    for dev in devices:
        with cupy.cuda.Device(dev):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(own_stream(dev))
            events.append((dev, ev))
    where = f"the refit's copies on CUDA device(s) {list(devices)}"
    interval = 1e-5
    while True:
        late = [dev for dev, ev in events
                if not event_done(cupy.cuda.runtime, ev.ptr, where)]
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


@functools.cache
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
    from ..transport.nccl_setup import install_hint
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
            f"CUDA headers and libnvrtc of its CUDA major version: {install_hint()}; or "
            f"install the CUDA toolkit matching the CuPy wheel") from e
    _PREFLIGHT_DONE.add(device)


def binding_devices(*sides: Bindings, of: Callable[[Any], int | None] | None = None
                    ) -> dict[int, int | None]:
    """CUDA device ordinal of each rank's bindings over ``sides`` (None: host memory).

    Raises:
        RefitError: a rank has bindings on two devices.
    """
    of = of or device_of
    out: dict[int, int | None] = {}
    ndarray = np.ndarray
    for bindings in sides:
        for (rank, name), b in bindings.items():
            if type(b) is ndarray and out.get(rank, 0) is None:
                continue                # host memory again (the common case, per tensor)
            arrays = b if isinstance(b, list) else [b]
            for a in arrays:
                dev = of(a)
                if out.setdefault(rank, dev) != dev:
                    raise RefitError(
                        f"rank {rank} has bindings in two places ({_where(out[rank])} and "
                        f"{_where(dev)}, tensor {name!r}); a rank is one device - bind "
                        f"each rank's tensors on its own device")
    return out


def cast_problems(bindings: Bindings, layouts: Mapping[str, Layout],
                  wire: Callable[[str], str], devices: Mapping[int, int | None],
                  side: str, knows: Callable[[str], bool] | None = None) -> list[str]:
    """Casts between a binding's dtype and its wire dtype that would run on a GPU where
    CuPy cannot compute them."""
    knows = knows or cupy_knows
    problems = []
    for (rank, name) in bindings:
        if devices.get(rank) is None or name not in layouts:
            continue
        have, want = layouts[name].dtype, wire(name)
        if have == want:
            continue
        for d in (have, want):
            if not knows(d):
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
        problems += cast_problems(bindings, layouts, functools.partial(wire, side), devices,
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
