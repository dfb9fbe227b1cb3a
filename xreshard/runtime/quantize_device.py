"""Quantizing on the way with device bindings: FP8 on the device that holds the values.

What :mod:`.quantized` does per region runs where the region's bytes are:

* a sender holding whole blocks on a GPU quantizes them there (a JAX trainer with its
  jitted quantizer, :mod:`xreshard.quant.jax_ops`; a torch sender with torch ops,
  :mod:`xreshard.quant.torch_ops`) and packs codes + scales into its device staging: only
  they cross the wire, no host round trip;
* a receiver on a GPU lands the pieces of split blocks in scratch on its device and
  quantizes them there with torch ops (its codes and scales never leave the device);
* host bindings keep numpy's and the host JAX quantizer (:func:`.quantized.quantize_values`).

Every path gives the bytes of :mod:`xreshard.quant.host` (vLLM's functions, byte for
byte; ``tests/test_quant.py``), so a call mixing host and device processes is consistent.
Which framework runs them is the call's :class:`.codecs.kernels.Kernels` (from ``Tuning``:
``device_kernels``; without a GPU, ``host_device_ops`` runs host bindings through these
same functions with the framework's CPU ops, tests only).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..dtypes import bits_dtype, dtype_name, itemsize
from .codecs.kernels import HOST, Kernels
from .device_ops import is_host

__all__ = ["quantize", "takes_device", "scratch_like", "host_bytes", "device_problems",
           "settle"]


def takes_device(values: Any, kernels: Kernels = HOST) -> bool:
    """Whether ``values`` are quantized by the device path: device memory, or host memory
    with ``kernels.on_host`` set."""
    return kernels.takes_device(values)


def quantize(values: Any, fmt: Any, name: str, dtype: str | None = None,
             role: str = "send", kernels: Kernels = HOST) -> tuple[Any, Any]:
    """``(codes, scales)`` of ``values`` (an executor array holding the canonical dtype
    ``dtype``, default its own) on its device, as arrays of bits in its memory: the
    bytes of :mod:`xreshard.quant.host`. ``role``: "send" (a sender's whole blocks) or
    "receive" (split blocks a receiver finishes), which picks the framework
    with ``kernels`` (:meth:`.codecs.kernels.Kernels.ops`)."""
    dtype = dtype or dtype_name(values.dtype)
    if not values.flags.c_contiguous:
        xp = np if is_host(values) else __import__("cupy")
        values = xp.ascontiguousarray(values)
    return kernels.ops(role).quantize(values, dtype, fmt, name)


def scratch_like(dst_bindings: Mapping[Any, Any], rank: int, shape: tuple[int, ...],
                 dtype: str) -> Any:
    """Zeroed scratch of ``shape`` (canonical ``dtype``, as bits on a device) in the memory
    of receiving ``rank``'s bindings: where its split blocks land and are quantized."""
    for (r, _), b in dst_bindings.items():
        if r != rank:
            continue
        arr = b[0] if isinstance(b, (list, tuple)) and b else b
        if arr is not None and not is_host(arr):
            import cupy
            with cupy.cuda.Device(arr.device.id):
                return cupy.zeros(shape, bits_dtype(itemsize(dtype)))
        break
    from ..dtypes import numpy_dtype
    return np.zeros(shape, numpy_dtype(dtype))


def host_bytes(a: Any) -> np.ndarray:
    """``a``'s bytes in row-major order as a flat host uint8 array (a device array is
    copied to the host: ``RefitConfig(verify=...)`` hashes on the host)."""
    if not is_host(a):
        a = a.get()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def device_problems(quant: Any, sends: bool, receives: bool,
                    kernels: Kernels = HOST) -> list[str]:
    """What keeps a process with device bindings from quantizing on the way: no framework
    to run the quantizers on the device (named per side)."""
    if quant is None:
        return []
    found = []
    for role, holds in (("send", sends), ("receive", receives)):
        if holds:
            try:
                kernels.ops(role)
            except Exception as e:      # noqa: BLE001 - reported before any byte moves
                names = ", ".join(sorted(quant.tensors)[:3])
                found.append(f"tensors quantized on the way ({names}): {e}")
    return found


def settle(bindings: Mapping[Any, Any]) -> None:
    """Wait for the copies queued on the current stream and on xreshard's own stream of
    each device holding one of
    ``bindings`` (the receivers' split blocks written after the executor's rounds, whose
    end waits on xreshard's own streams only). Nothing for host memory."""
    devices = set()
    for b in bindings.values():
        for arr in (b if isinstance(b, (list, tuple)) else (b,)):
            if not is_host(arr):
                devices.add(arr.device.id)
    if devices:
        import cupy

        from .devices import own_stream
        for dev in sorted(devices):
            with cupy.cuda.Device(dev):
                cupy.cuda.get_current_stream().synchronize()
                own_stream(dev).synchronize()   # quantized.finish writes there
