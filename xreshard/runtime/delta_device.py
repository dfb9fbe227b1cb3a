"""Delta refit with device bindings (``RefitConfig(delta=True)`` on GPU memory).

The host delta codec (:mod:`.codecs.delta`) with its memory hooks pointed at the devices:

```
 sender rank s (device d)                          receiver rank r (device e)
 encoder thread: new bytes of the bucket           header (32 bytes, device) sizes the
   (the bound view, or packed on d)                  receive
   baseline on d (Tuning(delta_baseline=           payload: the encoded message only,
   "device")) or uploaded from the host              into device memory (NCCL)
   diff + encode with JAX (jitted) or torch        validated on the host (a copy of the
   ops on d: only the message is built               message, its size), applied in place
 baseline <- message applied / bytes copied          with torch ops on e
```

FP8 destinations quantized on the way: the sender's pack quantizes the bucket's whole
blocks with the device quantizer (:mod:`.quantize_device`) and the encoder diffs the packed
bytes (scales, then codes, and split blocks' bf16 pieces; unit 1), as the host path does
(:func:`.delta_encode.delta_spans`). The receiver gathers the bucket's base into scratch on
its device in message order (codes and scales read from the destination, split blocks'
pieces uploaded from the bytes it kept of the last call, :mod:`.delta_land`), applies the
delta there and writes it back: codes and scales in place, the pieces into the scratch it
then quantizes with the device quantizer (``quantized.finish``), their bytes kept on the
host as the next call's base.

Which framework runs the ops: :func:`xreshard.runtime.device_ops.ops_for` (a JAX trainer
diffs with jitted JAX, a torch process with torch ops; ``Tuning(device_kernels=...)``
overrides). Where a sender keeps its baselines: ``Tuning(delta_baseline="host")`` (the
default: as many bytes of host memory as it sends, uploaded for each diff: one PCIe crossing
of the baseline per call) or ``"device"`` (as many bytes of device memory, no transfer;
``RefitReport.delta["baseline_device_bytes"]``). The fences, the encoding choice and the
message bytes are the host path's (tests compare them byte for byte).

Tests without a GPU run this same code on host bindings, the arrays numpy instead of CuPy
and the ops on the framework's CPU device (``Tuning.host_device_ops``, see
:class:`.codecs.kernels.Kernels`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import Tuning
from ..delta.host import apply_numpy
from ..dtypes import bits_dtype
from ..planner.schedule import Bucket
from .copies import array_module, copy_into
from .codecs.delta import DeltaCodec
from .delta_encode import Encoded, Encoder, delta_spans, delta_unit
from .delta_land import binding_view
from .devices import order_after_current
from .codecs.kernels import Kernels
from .device_ops import DeviceOps, is_host

__all__ = ["DeviceDeltaCodec", "DeviceEncoder", "device_path", "device_delta_problems"]


def device_path(*bindings: Mapping[Any, Any], tuning: Tuning | None = None) -> bool:
    """Whether a delta call over these bindings takes the device path: some binding is
    device memory, or ``tuning.host_device_ops`` asks for it (:class:`.codecs.kernels.Kernels`)."""
    return Kernels.of(tuning).device_path(*bindings)


def device_delta_problems(tuning: Tuning, sends: bool, receives: bool) -> list[list[str]]:
    """What keeps a process with device bindings from a delta call, as ``refit/check``
    error entries: no framework to run the device ops of the sides it holds."""
    found = []
    for role, holds in (("send", sends), ("receive", receives)):
        if not holds:
            continue
        try:
            Kernels.of(tuning).ops(role)
        except Exception as e:      # noqa: BLE001 - said on every process, before moving
            found.append(["RefitError", f"RefitConfig(delta=True) with device bindings: {e}"])
    return found


class DeviceEncoder(Encoder):
    """The encoder of the device path: one worker thread (the framework queues the diffs
    on its device; a thread keeps the host's waits for the counts off the calling thread,
    which meanwhile posts the previous round's payloads), buckets in schedule order."""

    def __init__(self, codec: DeviceDeltaCodec, jobs: Sequence[tuple[Bucket, Any]]):
        self.codec = codec          # before the base class starts encoding the jobs
        super().__init__(codec.ex, jobs, threads=1)

    def _encode(self, b: Bucket, base: Any) -> Encoded | None:
        if self._stop.is_set():
            return None
        t0 = time.perf_counter()
        codec = self.codec
        ex = codec.ex
        unit = delta_unit(ex, b)
        assert unit is not None, "a bucket that cannot go as a delta was given to encode"
        with ex._on(b.src):
            new = codec._new_bytes(b, self._scratch)
            old = codec._near(b.src, base, self._scratch)
        header, message = codec.send_ops.encode(old, new, unit)
        out = Encoded(message, header, time.perf_counter() - t0)
        with self._lock:
            self.finished = max(self.finished, time.perf_counter())
        return out


class DeviceDeltaCodec(DeltaCodec):
    """:class:`~.codecs.delta.DeltaCodec` on device memory (see the module docstring): its
    memory hooks on the devices, its groups round after round (as on a GPU).

    Args:
        delta: the call's ``delta_wire.DeltaCall``.
        tuning: ``delta_baseline`` (where baselines live).
        kernels: which framework's ops run the diff and the apply (from ``Tuning``).
    """

    def __init__(self, delta: Any, tuning: Tuning = Tuning(), kernels: Kernels | None = None):
        super().__init__(delta)
        kernels = Kernels.of(tuning) if kernels is None else kernels
        self.baseline_on = tuning.delta_baseline
        self.send_ops: DeviceOps = kernels.ops("send")
        self.recv_ops: DeviceOps = kernels.ops("receive")

    def pipelines(self, ex: Any) -> bool:
        return False        # groups on the calling thread, as on a GPU

    def start(self, ex: Any) -> None:
        ex._device = ex._devices()      # the encoder starts before the rounds
        gpus = sorted({d for d in ex._device.values() if d is not None})
        if gpus:
            # the encoder's threads pack on xreshard's own streams at once: those must wait
            # for the bindings' producers (a JAX step still running: async dispatch) before
            # any encoder starts, not only once the rounds begin (Executor._run)
            order_after_current(gpus)
        super().start(ex)

    def _takes(self, encoder: Encoder) -> bool:
        return isinstance(encoder, DeviceEncoder)

    # ------------------------------------------------------------ sender

    def _new_encoder(self, jobs: Sequence[tuple[Bucket, Any]], *,
                     forwards: bool = False) -> Encoder:
        return DeviceEncoder(self, jobs)

    def _new_bytes(self, b: Bucket, scratch: threading.local) -> Any:
        """Bucket ``b``'s new bytes on its sender's device: the bound view itself (one
        contiguous item) or packed into the encoder's scratch there."""
        view = self.ex._zero_copy_send(b)
        if view is not None:
            return view
        buf = self._scratch_of(scratch, "new", b.src, b.nbytes)
        self.ex._pack(b, buf)
        return buf

    def _near(self, rank: int, base: Any, scratch: threading.local) -> Any:
        """The baseline ``base`` where ``rank``'s bytes are: itself, or a host baseline
        uploaded into the encoder's scratch on the device."""
        if is_host(base) == (self.ex._device.get(rank) is None):
            return base
        buf = self._scratch_of(scratch, "old", rank, base.nbytes)
        buf.set(base)       # host -> device, on the current (own) stream
        return buf

    def _scratch_of(self, scratch: threading.local, what: str, rank: int, nbytes: int) -> Any:
        key = (what, self.ex._device.get(rank))
        held = getattr(scratch, "bufs", None)
        if held is None:
            held = scratch.bufs = {}
        buf = held.get(key)
        if buf is None or buf.nbytes < nbytes:
            held[key] = None
            buf = held[key] = self._buffer(rank, nbytes)
        return buf[:nbytes]

    def _baseline_alloc(self, b: Bucket) -> Callable[[int], Any] | None:
        if self.baseline_on == "device":
            return lambda n: self._buffer(b.src, n)
        return None

    def _keep_dense(self, base: Any, new: Any) -> None:
        if is_host(base) and is_host(new):
            np.copyto(base, new)
            return
        from .devices import own_stream
        dev = new.device.id if not is_host(new) else base.device.id
        own_stream(dev).synchronize()           # the packs of ``new`` ran there
        if is_host(base):
            new.get(out=base)
        elif is_host(new):
            base.set(new)
        else:
            import cupy
            with cupy.cuda.Device(dev):
                cupy.copyto(base, new)
                cupy.cuda.get_current_stream().synchronize()

    def _advance(self, enc: Encoded, base: Any) -> None:
        unit = enc.header.itemsize
        message = self._host(enc.message)
        if self.baseline_on == "device":
            self.recv_ops.apply(message, base, unit)
        else:
            apply_numpy(message, base.view(bits_dtype(unit)))

    # ------------------------------------------------------------ memory

    def _buffer(self, rank: int, nbytes: int) -> Any:
        dev = self.ex._device.get(rank)
        if dev is None:
            return np.empty(nbytes, np.uint8)
        import cupy
        with self.ex._on(rank):
            return cupy.empty(nbytes, np.uint8)

    def _outgoing(self, rank: int, data: np.ndarray) -> Any:
        device = self.ex._device.get(rank)
        if device is None:
            return data
        buf = self._buffer(rank, data.nbytes)
        with self.ex._on(rank):
            buf.set(data)
        from .devices import own_stream
        own_stream(device).synchronize()    # sent from the transport's stream
        return buf

    def _host(self, buf: Any) -> np.ndarray:
        return buf if is_host(buf) else buf.get()

    # ------------------------------------------------------------ receiver

    def _apply(self, b: Bucket, buf: Any) -> None:
        """Apply the delta ``buf`` (None: nothing changed) to bucket ``b``'s destination
        items in place on their device: one contiguous plain item directly; otherwise the
        bucket's base is gathered into scratch there in message order (a plain item in its
        wire dtype, an FP8 item's scales then codes, split blocks' pieces from the bytes
        kept of the last call: :mod:`.delta_land`), the delta applied to it, and written
        back (the pieces into their scratch, which the receiver quantizes after the rounds,
        and kept for the next call). Nothing is written when the message is malformed."""
        spans = delta_spans(self.ex, b)
        assert spans is not None and spans.diffed == ((0, b.nbytes),), \
            "a bucket's message is its diffed bytes (programs.packed: no gaps)"
        unit = spans.unit
        bindings = self.ex.tables[b.stage].dst_bindings
        steps = self.ex.programs.program(b, 1)
        views = [binding_view(bindings, e.key, e.index, e.slices) for e in steps]
        pieces = any(spans.rest)
        held = self.delta.pieces_base(b, sum(e.hi - e.lo for e, r in zip(steps, spans.rest)
                                             if r)) if pieces else None
        if buf is None:         # nothing changed: the pieces' base is this call's too
            assert held is not None
            sizes = np.cumsum([0] + [e.hi - e.lo for e, r in zip(steps, spans.rest) if r])
            self._land_pieces(b, steps, spans.rest, views,
                              [held[lo:hi] for lo, hi in zip(sizes[:-1], sizes[1:])])
            return
        message = self._host(buf)
        if len(views) == 1 and not pieces and steps[0].quant is None and \
                views[0].flags.c_contiguous and getattr(views[0].flags, "writeable", True):
            self.recv_ops.apply(message, views[0].reshape(-1).view(np.uint8), unit)
            return
        target = self._buffer(b.dst, b.nbytes)
        with self.ex._on(b.dst):
            xp = array_module(target)
            at = 0
            for e, rest, view in zip(steps, spans.rest, views):
                if rest:
                    _upload(target[e.lo:e.hi], held[at:at + e.hi - e.lo])  # type: ignore
                    at += e.hi - e.lo
                elif e.quant is not None:
                    for part, item in _fp8_parts(e, target, view, bindings):
                        _typed(part, item)[...] = _as_bits(item)
                else:
                    copy_into(xp, target[e.lo:e.hi].view(e.bits).reshape(e.shape), e.wire,
                              view, e.dtype)
        self.recv_ops.apply(message, target, unit)
        with self.ex._on(b.dst):
            for e, rest, view in zip(steps, spans.rest, views):
                if rest:
                    continue
                if e.quant is not None:
                    for part, item in _fp8_parts(e, target, view, bindings):
                        _as_bits(item)[...] = _typed(part, item)
                else:
                    copy_into(xp, view, e.dtype,
                              target[e.lo:e.hi].view(e.bits).reshape(e.shape), e.wire)
            if pieces:
                self._land_pieces(b, steps, spans.rest, views, [
                    target[e.lo:e.hi] for e, r in zip(steps, spans.rest) if r])

    def _land_pieces(self, b: Bucket, steps: Sequence[Any], rest: Sequence[bool],
                     views: Sequence[Any], parts: Sequence[Any]) -> None:
        """Write bucket ``b``'s split blocks' pieces ``parts`` (their bytes, host or device,
        in message order) into their scratch on the device and keep their bytes (host
        memory: only pieces of split blocks) as the base of the next call's delta."""
        kept = []
        with self.ex._on(b.dst):
            items = [(e, view) for e, piece, view in zip(steps, rest, views) if piece]
            for (e, view), part in zip(items, parts):
                if is_host(part) != is_host(view):
                    up = self._buffer(b.dst, part.nbytes)
                    _upload(up, part)
                    part = up
                copy_into(array_module(view), view, e.dtype,
                          part.view(e.bits).reshape(e.shape), e.wire)
                kept.append(self._host(part))
        self.delta.keep_pieces(b, np.concatenate(kept))


def _upload(seg: Any, data: np.ndarray) -> None:
    """Host bytes ``data`` into the contiguous executor array ``seg`` (same size)."""
    if is_host(seg):
        np.copyto(seg, data)
    else:
        seg.set(data)       # on the current (own) stream


def _fp8_parts(e: Any, buf: Any, codes: Any, bindings: Mapping[Any, Any]
               ) -> list[tuple[Any, Any]]:
    """FP8 step ``e``'s ``(bytes of the message buffer buf, binding view)``: its scales,
    then its codes (the message's order, :func:`.quantized.pack`)."""
    q = e.quant
    scales = binding_view(bindings, q.scale_key, q.scale_index, q.scale_slices)
    return [(buf[e.lo:e.lo + q.scale_bytes], scales), (buf[e.lo + q.scale_bytes:e.hi], codes)]


def _as_bits(view: Any) -> Any:
    """A binding view as unsigned ints of its element size, so that bits are copied,
    never cast (as :func:`.quantized._put`), or itself where it cannot be seen so."""
    try:
        return view.view(bits_dtype(view.dtype.itemsize))
    except (TypeError, ValueError):      # a view numpy cannot reinterpret: as typed
        return view


def _typed(part: Any, view: Any) -> Any:
    """Contiguous bytes ``part`` as :func:`_as_bits` sees ``view`` (its shape)."""
    return part.view(_as_bits(view).dtype).reshape(view.shape)
