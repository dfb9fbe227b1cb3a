"""Framework ops on the executor's device memory: the delta diff and apply, FP8 quantizing.

The executor holds device bindings and staging as CuPy arrays (over torch's or JAX's CUDA
memory, :mod:`.devices`). What it computes on them beyond copies runs in the framework of
the process, on the device that holds the bytes, with no host round trip of the data:

* a JAX process diffs (:func:`xreshard.delta.jax_kernels.encode_bytes`, jitted) and
  quantizes (:mod:`xreshard.quant.jax_ops`, jitted) with JAX;
* a torch process (a torch trainer, a vLLM or DTensor receiver) with torch ops
  (:mod:`xreshard.delta.torch_kernels`, :mod:`xreshard.quant.torch_ops`);
* a receiver applies a delta in place with torch ops where torch is loaded (JAX arrays are
  immutable: a JAX-only process applies into a new array and copies it back).

A :class:`DeviceOps` sees the executor's arrays through DLPack (zero-copy, both ways), so
the same code runs on a CuPy array on a GPU and on a numpy array on the host, which is how
it is tested on machines without a GPU: ``Tuning(host_device_ops="jax"|"torch")``
(environment ``XRESHARD_TEST_DEVICE_OPS``, read by ``Tuning.from_env`` only; for tests)
makes a process take the device path for its host bindings too, with those ops on the
framework's CPU device (:class:`.codecs.kernels.Kernels`).

Ordering. The executor's copies run on xreshard's own stream of each device
(:func:`.devices.own_stream`), the framework's ops on the framework's stream; every entry
point here waits for the own stream before it reads, and for the framework's work before
it returns (the diff needs its counts on the host anyway). Correct first: on a GPU these
waits cost microseconds per bucket.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import numpy as np

from ..delta.codec import DENSE, Header, align8, section_bytes
from ..dtypes import bits_dtype
from ..errors import RefitError

__all__ = ["DeviceOps", "ops_for", "ENV", "KINDS", "is_host", "COUNTS"]

#: internal, tests only: ``Tuning.host_device_ops`` from the environment (``Tuning.from_env``)
ENV = "XRESHARD_TEST_DEVICE_OPS"
KINDS = ("jax", "torch")
#: what this process ran on device memory, by "<work>/<framework>" (encode, apply,
#: quantize): how tests see which path a call took
COUNTS: collections.Counter = collections.Counter()


def is_host(arr: Any) -> bool:
    return isinstance(arr, np.ndarray)


def _available(kind: str) -> bool:
    if kind in sys.modules:
        return True
    import importlib.util
    return importlib.util.find_spec(kind) is not None


def ops_for(role: str, prefer: str = "auto") -> DeviceOps:
    """The ops this process runs for ``role``: ``"send"`` (diff, quantize) or
    ``"receive"`` (apply, quantize split blocks).

    ``prefer``: ``"jax"`` or ``"torch"`` (``Tuning.device_kernels``, or its
    ``host_device_ops``: :class:`.codecs.kernels.Kernels`), or ``"auto"``: a sender uses
    JAX when this process loaded JAX (a JAX trainer) and torch otherwise; a receiver uses
    torch when it can (in place), JAX otherwise.

    Raises:
        RefitError: neither framework can be imported (naming what device work needed it).
    """
    kind = None if prefer == "auto" else prefer
    if kind is None:
        order = ("jax", "torch") if role == "send" and "jax" in sys.modules else ("torch", "jax")
        kind = next((k for k in order if _available(k)), None)
        if kind is None:
            work = "diff or quantize what it sends" if role == "send" else \
                "apply or quantize what it receives"
            raise RefitError(
                f"this process binds device memory and its refit needs device work to "
                f"{work}, which runs with JAX or torch ops on the device, but neither is "
                "installed here; install torch or jax, or hold these tensors in host memory")
    if kind not in KINDS:
        raise RefitError(f"device kernels {kind!r}: expected 'auto', 'jax' or 'torch'")
    return DeviceOps(kind)


#: XLA's GPU executables refuse parameters not aligned to this (``CheckAlignment``,
#: ``kEntryParameterAlignBytes``); a DLPack view of such an address imports, then fails
XLA_ALIGN = 16


def _aligned(flat: Any) -> Any:
    """The contiguous 1-D CuPy array ``flat`` itself, or a copy at an address XLA accepts
    (a bound view starts where its item starts: a row range of a (N, 3) bf16 table)."""
    if int(flat.data.ptr) % XLA_ALIGN == 0:
        return flat
    import cupy
    with cupy.cuda.Device(flat.device.id):
        out = cupy.empty(flat.shape, flat.dtype)      # CuPy allocates 256-byte aligned
        out[...] = flat
    return out


_TORCH_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}


class DeviceOps:
    """JAX or torch ops over the executor's arrays (CuPy on a GPU, numpy on the host).

    Args:
        kind: ``"jax"`` or ``"torch"``.
    """

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise RefitError(f"device ops {kind!r}: expected one of {KINDS}")
        self.kind = kind

    def __repr__(self) -> str:
        return f"DeviceOps({self.kind!r})"

    # ------------------------------------------------------------ views

    def wrap(self, buf: Any, unit: int = 1) -> Any:
        """A framework array over the contiguous executor array ``buf`` (any dtype), its
        bytes seen as elements of ``unit`` bytes (1-D): torch zero-copy; JAX zero-copy on
        a GPU (DLPack), a copy on the host (XLA's CPU client may not alias numpy)."""
        flat = buf.reshape(-1).view(np.uint8)
        if self.kind == "torch":
            import torch
            t = torch.from_numpy(flat) if is_host(flat) else torch.from_dlpack(flat)
            return t.view(getattr(torch, _TORCH_WORDS[unit])) if unit != 1 else t
        import jax
        x = jax.device_put(flat, jax.devices("cpu")[0]) if is_host(flat) \
            else jax.dlpack.from_dlpack(_aligned(flat))
        if unit == 1:
            return x
        from ..delta.jax_kernels import byte_words
        return byte_words(x, unit, "buffer")

    def wrap_typed(self, arr: Any, dtype: str) -> Any:
        """A framework array of the canonical dtype ``dtype`` with ``arr``'s shape over its
        bits (``arr`` contiguous; a raw-bits view is fine)."""
        from ..dtypes import itemsize
        size = itemsize(dtype)
        shape = tuple(arr.shape)
        if self.kind == "torch":
            import torch
            return self.wrap(arr, 1).view(getattr(torch, dtype)).reshape(shape)
        import jax
        if size not in (1, 2, 4):
            raise RefitError(f"{dtype}: the JAX quantizers take 1-, 2- and 4-byte floats")
        return jax.lax.bitcast_convert_type(self.wrap(arr, size),
                                            getattr(jax.numpy, dtype)).reshape(shape)

    def unwrap(self, x: Any, like: Any) -> Any:
        """The framework array ``x`` as an executor array of ``like``'s kind (numpy or
        CuPy), its bytes as uint8 (1-D), zero-copy where the framework allows."""
        if self.kind == "torch":
            import torch
            u8 = x.contiguous().reshape(-1).view(torch.uint8)
            if is_host(like):
                return u8.numpy()
            import cupy
            # torch exports only from its current device (``__dlpack__``: "Can't export
            # tensors on a different CUDA device index"), which is CuPy's cudaSetDevice
            with cupy.cuda.Device(u8.device.index):
                return cupy.from_dlpack(u8)
        import jax
        import jax.numpy as jnp
        u8 = x.reshape(-1) if x.dtype == jnp.uint8 else \
            jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint8).reshape(-1)
        if is_host(like):
            return np.asarray(u8)
        import cupy
        return cupy.from_dlpack(u8)

    def ready(self, like: Any) -> None:
        """Wait for the executor's own stream of ``like``'s device (nothing on the host)."""
        if is_host(like):
            return
        from .devices import own_stream
        own_stream(like.device.id).synchronize()

    def done(self, like: Any) -> None:
        """Wait for the framework's work on ``like``'s device (nothing on the host)."""
        if is_host(like):
            return
        if self.kind == "torch":
            import torch
            torch.cuda.synchronize(like.device.id)
        # JAX: every result handed back was read through DLPack after block_until_ready

    # ------------------------------------------------------------ delta

    def encode(self, old: Any, new: Any, unit: int) -> tuple[Header, Any]:
        """Encode ``new`` against ``old`` (executor arrays of the same bytes, contiguous;
        elements of ``unit`` bytes) on their device: ``(header, message)``, the message an
        executor array like ``new`` (header included, byte for byte
        :meth:`xreshard.delta.codec.Encoded.to_bytes`), or None when dense wins (send the
        bucket itself)."""
        self.ready(new)
        COUNTS[f"encode/{self.kind}"] += 1
        if self.kind == "torch":
            from ..delta.torch_kernels import encode_torch
            enc = encode_torch(self.wrap(old, unit), self.wrap(new, unit))
        else:
            from ..delta.jax_kernels import encode_bytes
            enc = encode_bytes(self.wrap(old), self.wrap(new), unit)
        if enc.header.kind == DENSE:
            return enc.header, None
        message = self._assemble(enc.header, enc.sections, new)
        self.done(new)
        return enc.header, message

    def _assemble(self, header: Header, sections: Any, like: Any) -> Any:
        """Header + sections into one message on the sections' device (zero padding, as
        :func:`xreshard.delta.codec.assemble`)."""
        head = np.frombuffer(header.pack(), np.uint8)
        sizes = section_bytes(header)
        if not header.count:        # nothing changed: the header alone, where ``like`` is
            if is_host(like):
                return head.copy()
            import cupy
            with cupy.cuda.Device(like.device.id):
                return cupy.asarray(head)
        if self.kind == "torch":
            import torch
            parts: list[Any] = [None]
            device = None
            for i, (sec, size) in enumerate(zip(sections, sizes)):
                u8 = sec.contiguous().reshape(-1).view(torch.uint8)[:size]
                device = u8.device
                parts.append(u8)
                pad = (align8(size) - size) if i < len(sizes) - 1 else 0
                if pad:
                    parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            parts[0] = torch.from_numpy(head.copy()).to(device or "cpu")
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
            assert out.numel() == header.nbytes
            return self.unwrap(out, like)
        import jax
        import jax.numpy as jnp
        parts = []
        device = None
        for i, (sec, size) in enumerate(zip(sections, sizes)):
            if isinstance(sec, np.ndarray):
                sec = jnp.asarray(sec)
            u8 = sec.reshape(-1) if sec.dtype == jnp.uint8 else \
                jax.lax.bitcast_convert_type(sec.reshape(-1), jnp.uint8).reshape(-1)
            device = next(iter(u8.devices()))
            parts.append(u8[:size])
            pad = (align8(size) - size) if i < len(sizes) - 1 else 0
            if pad:
                parts.append(jnp.zeros(pad, jnp.uint8))
        parts.insert(0, jax.device_put(head, device) if device is not None else jnp.asarray(head))
        out = jnp.concatenate([jax.device_put(p, device) for p in parts]) \
            if device is not None else parts[0]
        out.block_until_ready()
        assert out.size == header.nbytes
        return self.unwrap(out, like)

    def apply(self, message: np.ndarray, target: Any, unit: int) -> None:
        """Apply the host message (validated first: nothing is written when it is
        malformed) to the contiguous executor array ``target`` (elements of ``unit``
        bytes), in place, on its device."""
        self.ready(target)
        COUNTS[f"apply/{self.kind}"] += 1
        if self.kind == "torch":
            from ..delta.torch_kernels import apply_torch
            apply_torch(message, self.wrap(target, unit))
            self.done(target)
            return
        from ..delta.jax_kernels import apply_bytes
        out = apply_bytes(message, self.wrap(target), unit)
        out.block_until_ready()
        flat = target.reshape(-1).view(np.uint8)
        flat[...] = self.unwrap(out, target)

    # ------------------------------------------------------------ FP8

    def quantize(self, values: Any, dtype: str, fmt: Any, name: str) -> tuple[Any, Any]:
        """``(codes, scales)`` of the contiguous executor array ``values`` (holding the
        canonical dtype ``dtype``) in ``fmt``, on its device, as executor arrays of bits
        (uint8 codes, the scales' own width) in the codes' and the scales' shapes: the
        bytes of :func:`xreshard.quant.host.quantize_block_fp8` / ``quantize_mxfp8``."""
        self.ready(values)
        COUNTS[f"quantize/{self.kind}"] += 1
        x = self.wrap_typed(values, dtype)
        if self.kind == "torch":
            from ..quant import torch_ops
            codes, scales = torch_ops.quantize(x, fmt, name=name, ops="torch")
        else:
            from ..quant import jax_ops
            codes, scales = jax_ops.quantize(x, fmt, name=name)
            codes.block_until_ready()
            scales.block_until_ready()
        out_codes = self.unwrap(codes, values).reshape(tuple(codes.shape))
        size = scales.dtype.itemsize
        out_scales = self.unwrap(scales, values).view(bits_dtype(size)).reshape(
            tuple(scales.shape))
        self.done(values)
        return out_codes, out_scales

