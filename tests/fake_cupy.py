"""A fake of the few CuPy pieces the GPU path's CPU tests reach (install it with the
``fake_cupy`` fixture of the tests that use it: ``monkeypatch.setitem(sys.modules, "cupy",
fake_cupy.module())``).

"Device memory" is host memory; devices, streams and events are bookkeeping. Each piece
models one CUDA or CuPy rule, and only that one, named where it is modelled:

- the current device and each device's current stream are per thread (CuPy
  ``cupy/cuda/stream.pyx`` ``_ThreadLocal``; ``cudaSetDevice`` is per host thread), and a
  stream can only be made current while its device is (``check_stream_device_match``);
- an elementwise kernel (``a[...] = b``, ``ascontiguousarray`` of a strided array) runs on
  the current device and refuses arrays of another one ("Array device must be same as
  the current device"), and refuses dtypes CuPy has no kernels for, such as float8
  ("Unsupported dtype");
- ``runtime.eventQuery`` returns cudaSuccess, cudaErrorNotReady (600) or the error of an
  earlier asynchronous launch, and does not raise (CuPy ``runtime.pyx`` ``eventQuery``;
  CUDA Runtime API, cudaEventQuery); ``Event.done`` is ``status == 0``;
- ``runtime.memcpyAsync`` with cudaMemcpyDefault copies between any two devices of a
  process (unified addressing).
"""

from __future__ import annotations

import ctypes
import threading
import types
from typing import Any

import numpy as np

NOT_READY = 600


class CUDARuntimeError(RuntimeError):
    TEXT = {600: "cudaErrorNotReady: device not ready",
            700: "cudaErrorIllegalAddress: an illegal memory access was encountered"}

    def __init__(self, status: int):
        self.status = status
        super().__init__(self.TEXT.get(status, f"cudaError {status}"))


class _State(threading.local):
    def __init__(self):
        self.device = 0
        self.devices: list[int] = []
        self.streams: dict[int, list[Any]] = {}
        self.stream_devices: list[int] = []


_tls = _State()
_ids = iter(range(1, 10**9))


class Device:
    def __init__(self, device: int | None = None):
        self.id = _tls.device if device is None else int(device)

    def __enter__(self):
        _tls.devices.append(_tls.device)
        _tls.device = self.id
        return self

    def __exit__(self, *exc):
        _tls.device = _tls.devices.pop()


class Event:
    """An event; ``status`` says what ``runtime.eventQuery`` answers for it (0: done)."""

    registry: dict[int, "Event"] = {}

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.ptr = next(_ids)
        self.status = 0
        self.recorded_on: Any = None
        Event.registry[self.ptr] = self

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream if stream is not None else get_current_stream()
        self.status = self.recorded_on.status

    @property
    def done(self) -> bool:
        return runtime.eventQuery(self.ptr) == 0


class Stream:
    """A stream of a device; ``status`` is what events recorded on it will report."""

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.ptr = 0 if null else next(_ids)
        self.device_id = -1 if null else _tls.device
        self.non_blocking = non_blocking
        self.waited: list[Event] = []
        self.status = 0

    def __enter__(self):
        dev = _tls.device if self.device_id == -1 else self.device_id
        if dev != _tls.device:
            raise RuntimeError(f"The device that the stream is created on ({dev}) does not "
                               f"match with the current device ({_tls.device})")
        _tls.streams.setdefault(dev, []).append(self)
        _tls.stream_devices.append(dev)     # which stack to pop, as CuPy records it
        return self

    def __exit__(self, *exc):
        _tls.streams[_tls.stream_devices.pop()].pop()

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        """Copies here are synchronous host copies: nothing to wait for."""


Stream.null = Stream(null=True)


def get_current_stream(device_id: int = -1) -> Stream:
    dev = _tls.device if device_id == -1 else device_id
    stack = _tls.streams.get(dev)
    return stack[-1] if stack else Stream.null


def _event_query(ptr: int) -> int:
    return Event.registry[ptr].status


def _memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    runtime.copies.append((_tls.device, stream, nbytes))
    ctypes.memmove(dst, src, nbytes)


#: ``copies``: (current device, stream, bytes) of every memcpyAsync, for the tests to read
runtime = types.SimpleNamespace(eventQuery=_event_query, memcpyAsync=_memcpy_async,
                                CUDARuntimeError=CUDARuntimeError, copies=[],
                                getDeviceCount=lambda: 2, memcpyDefault=4)


class ndarray(np.ndarray):
    """A CuPy array: host memory that says which device it is on."""

    def __array_finalize__(self, obj: Any) -> None:
        self.device_id = getattr(obj, "device_id", _tls.device)

    @property
    def device(self) -> Any:
        return types.SimpleNamespace(id=self.device_id)

    @property
    def data(self) -> Any:          # cupy.cuda.MemoryPointer: .ptr
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def __setitem__(self, key: Any, value: Any) -> None:
        _kernel_check(self, value)
        super().__setitem__(key, value)

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        host = np.asarray(self).copy()
        if out is not None:
            out[...] = host
            return out
        return host


ndarray.__module__ = "cupy._core.core"


def _kernel_check(*arrays: Any) -> None:
    for a in arrays:
        if isinstance(a, ndarray) and a.device_id != _tls.device:
            raise ValueError(f"Array device must be same as the current device: array "
                             f"device = {a.device_id} while current = {_tls.device}")
        if isinstance(a, np.ndarray) and a.dtype.kind not in "biufc?":
            raise TypeError(f"Unsupported dtype {a.dtype}")


def asarray(a: Any, dtype: Any = None) -> ndarray:
    return np.array(a, dtype=dtype).view(ndarray)


def on_device(a: np.ndarray, device: int) -> ndarray:
    out = np.array(a).view(ndarray)
    out.device_id = device
    return out


def ascontiguousarray(a: ndarray) -> ndarray:
    if a.flags.c_contiguous:
        return a
    _kernel_check(a)                # a copy kernel: the array's dtype must be CuPy's
    return np.ascontiguousarray(a).view(ndarray)


def zeros(n: Any, dtype: Any) -> ndarray:
    return np.zeros(n, dtype).view(ndarray)


def stack(arrays: list[Any], axis: int = 0) -> ndarray:
    return np.stack([np.asarray(a) for a in arrays], axis=axis).view(ndarray)


def concatenate(arrays: list[Any]) -> ndarray:
    return np.concatenate([np.asarray(a) for a in arrays]).view(ndarray)


def multiply(a: Any, b: Any, dtype: Any = None) -> ndarray:
    """CuPy's elementwise multiply: uint32 operands with ``dtype=uint64`` give exact
    products, as CuPy casts the operands first."""
    return np.multiply(np.asarray(a), np.asarray(b), dtype=dtype).view(ndarray)


def module() -> types.ModuleType:
    """The fake as a module, for ``sys.modules["cupy"]``."""
    m = types.ModuleType("cupy")
    m.__version__ = "14.2.0+fake"
    m.ndarray = ndarray
    m.uint8, m.uint16, m.uint32, m.uint64 = np.uint8, np.uint16, np.uint32, np.uint64
    for f in (asarray, ascontiguousarray, zeros, stack, concatenate, multiply):
        setattr(m, f.__name__, f)
    m.cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event,
                                   get_current_stream=get_current_stream, runtime=runtime)
    return m
