"""Quantizing on the way, in the executor: the pack, unpack and finish steps of FP8 items.

What the planner decided (:mod:`xreshard.planner.quantize`) the executor does per region,
inside its pipeline:

* **pack** an FP8 item: read the region's values from the source binding, cast them to
  the dtype the trainer exports (``QuantStep.values``), quantize them
  (:func:`quantize_values`: JAX's jitted quantizer in a JAX process, numpy's otherwise;
  vLLM's bytes either way) and write the scales, then the codes, into the message; the pipelined
  executor does this while the wire moves the previous messages, so quantizing overlaps
  the transport instead of adding to it;
* **unpack** an FP8 item: codes into the codes' binding, scales into the scales';
* rest items land in scratch buffers (ordinary unpacks: the scratch is a binding of its
  own, :meth:`Scratch.key`), which the call's scratch stage quantizes once every round has
  landed (:func:`finish_copy`: the stage's same-rank copies, run by the executor like any
  stage's; :func:`finish` runs them outside an executor);
* same-rank copies (:func:`copy_local`) do both at once;
* ``RefitConfig(verify=...)`` hashes, per transfer, what the sender quantizes and what the
  receiver holds (:func:`sent_bytes`, :func:`received_bytes`), and per group of split
  blocks what their receiver quantized (:func:`finished_bytes`).

Device bindings quantize on their device (:mod:`.quantize_device`: JAX's jitted or torch's
quantizer, the same bytes); the dispatch is in :func:`quantize_values`, :func:`_values` and
:func:`scratch_bindings`.
"""

from __future__ import annotations

import ctypes
import sys
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

import numpy as np

from ..dtypes import bits_dtype, itemsize, numpy_dtype
from ..ir.formats import MXFP8
from ..planner.quantize import core_of, rest_boxes
from .copies import array_module, copy_into, view_of

__all__ = ["pack", "unpack", "copy_local", "finish", "finish_copy", "settle",
           "scratch_bindings", "quantize_values",
           "count", "copies", "refuse_devices", "sent_bytes",
           "received_bytes", "finished_bytes", "transfer_streams", "digest_transfer",
           "digest_finished", "FINISHED", "quantized_report", "quantize_step", "AHEAD"]


#: regions at least this big are quantized by JAX's jitted quantizer in a process that has
#: JAX loaded (a JAX trainer); smaller ones by numpy (no compile per shape for them)
JAX_MIN_ELEMENTS = 1 << 16


def quantize_values(values: Any, fmt: Any, name: str, dtype: str | None = None,
                    role: str = "send", kernels: Any = None) -> tuple[Any, Any]:
    """``(codes, scales)`` of ``values`` (a dtype the format quantizes; ``dtype``: the
    canonical one, when ``values`` is a raw-bits view).

    Device memory is quantized on its device (:func:`.quantize_device.quantize`; ``role``:
    "send" or "receive" picks the framework there, with ``kernels``, the call's
    :class:`.codecs.kernels.Kernels`; None: the defaults).

    Identical bytes whichever runs (``tests/test_quant.py``): in a process that has JAX
    loaded (a JAX trainer, whose CPU arrays are host memory), large regions go through
    :mod:`xreshard.quant.jax_ops` on its CPU device - jitted per shape, ~5x numpy's
    throughput per CPU-second (``benchmarks/RESULTS.md``); else :mod:`xreshard.quant.host`.
    """
    from . import quantize_device
    from .codecs.kernels import HOST
    kernels = HOST if kernels is None else kernels
    if kernels.takes_device(values):
        return quantize_device.quantize(values, fmt, name, dtype, role, kernels)
    jax = sys.modules.get("jax")
    if jax is not None and values.size >= JAX_MIN_ELEMENTS:
        from ..quant import jax_ops
        if isinstance(fmt, MXFP8) or values.dtype != numpy_dtype("bfloat16"):
            codes, scales = jax_ops.quantize(jax.device_put(values, jax.devices("cpu")[0]),
                                             fmt, name=name)
        else:       # bf16 bits, imported without a copy where aligned (a JAX buffer's are)
            bits = np.ascontiguousarray(values).view(np.uint16)
            codes, scales = jax_ops.quantize_bf16_bits(_jax_bits(jax, bits), fmt)
        # read back (waits for XLA) while ``values`` still holds the memory it read
        return np.asarray(codes), np.asarray(scales)
    from ..quant import host
    fn = host.quantize_mxfp8 if isinstance(fmt, MXFP8) else host.quantize_block_fp8
    return fn(values, fmt, name=name, threads=kernels.quant_threads)


def _jax_bits(jax: Any, bits: np.ndarray) -> Any:
    """``bits`` (uint16, C-contiguous) as a CPU ``jax.Array``, aliased without a copy where
    XLA can (64-byte aligned: a JAX buffer's own memory), else copied. A read-only view (how
    the JAX adapter binds a CPU shard) cannot go through DLPack as it is, so its memory is
    aliased through a writeable view of its address: XLA only reads it, and the caller
    holds ``bits`` until the results are read back. Saves a copy of every quantized byte
    (the region went through ``device_put`` before)."""
    if bits.size and bits.ctypes.data % 64 == 0:
        view = bits
        if not bits.flags.writeable:
            raw = (ctypes.c_uint8 * bits.nbytes).from_address(bits.ctypes.data)
            view = np.frombuffer(raw, np.uint16).reshape(bits.shape)
        try:
            return jax.numpy.from_dlpack(view, copy=False)
        except (BufferError, ValueError, TypeError, RuntimeError):
            pass
    return jax.device_put(bits, jax.devices("cpu")[0])


def _values(src: Any, src_dtype: str, values: str) -> np.ndarray:
    """The region ``src`` (a binding view holding ``src_dtype``) as ``values`` values,
    cast as the wire casts (``copy_into``), contiguous (``src`` itself when it is)."""
    if src_dtype == values and isinstance(src, np.ndarray) and src.flags.c_contiguous:
        return src.view(numpy_dtype(values))
    if not isinstance(src, np.ndarray):     # device memory: bits of ``values`` there
        xp = array_module(src)
        out = xp.empty(src.shape, bits_dtype(itemsize(values)))
        copy_into(xp, out, values, src, src_dtype)
        return out
    out = np.empty(src.shape, numpy_dtype(values))
    copy_into(np, out, values, src, src_dtype)
    return out


def _put(dst: Any, data: np.ndarray) -> None:
    """Copy the bits of ``data`` into the binding view ``dst`` (same element size), as
    unsigned ints: numpy copies an ml_dtypes float8 array through the dtype's own copy
    function, ~3x slower than bytes."""
    bits = bits_dtype(dst.dtype.itemsize)
    try:
        dst = dst.view(bits)
    except (TypeError, ValueError):      # a view numpy cannot reinterpret: as typed
        bits = dst.dtype
    dst[...] = data.view(bits).reshape(dst.shape)


#: the work quantized ahead that this thread's executor run takes its FP8 items from
#: (``quantize_ahead.QuantAhead.used`` sets it around the run), or None
AHEAD: ContextVar[Any] = ContextVar("xreshard_fp8_ahead", default=None)


def _region(binding: Any, i: int | None, slices: tuple) -> Any:
    return (binding if i is None else binding[i])[slices]


def quantize_step(e: Any, bindings: Mapping, item: Any = _region, kernels: Any = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of FP8 step ``e``'s region of its source binding (cast to the
    values the trainer exports first; ``item(binding, index, slices)`` cuts the region):
    what :func:`pack` writes."""
    q = e.quant
    src = item(bindings[e.key], e.index, e.slices)
    return quantize_values(_values(src, e.dtype, q.values), q.format, e.key[1], q.values,
                           kernels=kernels)


def pack(e: Any, buf: np.ndarray, bindings: Mapping, item: Any, kernels: Any = None) -> None:
    """Write the scales, then the codes, of FP8 step ``e`` into ``buf``: as quantized
    ahead (:data:`AHEAD`: see :mod:`xreshard.runtime.quantize_ahead`), or quantized here
    from its source binding."""
    q = e.quant
    ahead = AHEAD.get()
    got = ahead.take(e) if ahead is not None else None
    codes, scales = quantize_step(e, bindings, item, kernels) if got is None else got
    buf[e.lo:e.lo + q.scale_bytes] = scales.reshape(-1).view(np.uint8)
    buf[e.lo + q.scale_bytes:e.hi] = codes.reshape(-1).view(np.uint8)


def unpack(e: Any, buf: np.ndarray, bindings: Mapping, item: Any) -> None:
    """Write FP8 step ``e``'s codes and scales from ``buf`` into their bindings."""
    q = e.quant
    _put(item(bindings[e.key], e.index, e.slices), buf[e.lo + q.scale_bytes:e.hi])
    _put(item(bindings[q.scale_key], q.scale_index, q.scale_slices),
         buf[e.lo:e.lo + q.scale_bytes])


def _dst_views(quant: Any, rank: int, name: str, region: Any, dst_bindings: Mapping
               ) -> tuple[Any, Any]:
    """The views of ``rank``'s codes and scales bindings that hold the whole blocks
    ``region`` of ``name``."""
    qt = quant.tensors[name]
    lay = quant.codes[name]
    i, slices = lay.locate(rank, region)
    b = dst_bindings[(rank, name)]
    codes = (b if lay.is_product else b[i])[slices]
    slay = quant.scales[name]
    i, slices = slay.locate(rank, qt.format.scale_region(region, qt.shape, name))
    b = dst_bindings[(rank, qt.scale)]
    return codes, (b if slay.is_product else b[i])[slices]


def _write(quant: Any, rank: int, name: str, region: Any, values: np.ndarray,
           dst_bindings: Mapping, kernels: Any = None) -> None:
    """Quantize ``values`` (the region ``region`` of ``name``, whole blocks) into the
    codes' and the scales' bindings of ``rank``."""
    codes, scales = quantize_values(values, quant.tensors[name].format, name,
                                    quant.wire[name], "receive", kernels)
    codes_view, scales_view = _dst_views(quant, rank, name, region, dst_bindings)
    _put(codes_view, codes)
    _put(scales_view, scales)


def copies(quant: Any, c: Any) -> bool:
    """Whether same-rank copy ``c`` is of a tensor quantized on the way."""
    return quant is not None and c.stage == 0 and c.name in quant.tensors


def copy_local(c: Any, quant: Any, tables: Any, kernels: Any = None) -> int:
    """A same-rank copy of a tensor quantized on the way: whole blocks quantized into the
    destination, the rest into its scratch. Returns its bytes."""
    src_layout, src_bindings = tables.src_layouts[c.name], tables.src_bindings
    dst_bindings = tables.dst_bindings
    i, slices = src_layout.locate(c.rank, c.region)
    b = src_bindings[(c.rank, c.name)]
    values = _values((b if src_layout.is_product else b[i])[slices], src_layout.dtype,
                     quant.wire[c.name])
    if c.quantized:
        _write(quant, c.rank, c.name, c.region, values, dst_bindings, kernels)
        return c.nbytes
    s = quant.scratch_for(c.rank, c.name, c.region)
    rel = tuple(slice(a - o, z - o) for a, z, o in zip(c.region.starts, c.region.stops,
                                                       s.region.starts))
    dst_bindings[s.key][rel] = values
    return c.nbytes


def refuse_devices(quant: Any, sends: bool = True, receives: bool = True,
                   kernels: Any = None) -> None:
    """Raise ``RefitError`` when a call that quantizes on the way has device bindings this
    process cannot quantize on their device (neither JAX nor torch installed)."""
    from .quantize_device import device_problems
    from .codecs.kernels import HOST
    found = device_problems(quant, sends, receives, HOST if kernels is None else kernels)
    if found:
        from ..errors import RefitError
        raise RefitError("; ".join(found) + "; nothing was moved. Send these tensors from "
                         "host memory, or quantize them in the trainer (xreshard.quant."
                         "quantize on the device) and offer the codes and scales")


def scratch_bindings(quant: Any, cache: dict | None, dst_bindings: Mapping | None = None
                     ) -> dict:
    """``Scratch.key`` -> a buffer of the scratch's region in its wire dtype, kept in
    ``cache`` (the call's program cache) across runs; in the memory of its receiver's
    ``dst_bindings`` (a device: :func:`.quantize_device.scratch_like`)."""
    if quant is None:
        return {}
    cache = {} if cache is None else cache
    out = cache.get("quant scratch")
    if out is None:
        from .quantize_device import scratch_like
        out = {s.key: scratch_like(dst_bindings or {}, s.rank, s.region.shape,
                                   quant.wire[s.name])
               for ss in quant.scratch.values() for s in ss}
        cache["quant scratch"] = out
    return out


def finish_copy(c: Any, quant: Any, tables: Any, kernels: Any = None) -> int:
    """A same-rank copy of the scratch stage (``PreparedCall.scratch_stage``): quantize the
    whole blocks ``c.region`` of ``c.name`` from receiver ``c.rank``'s scratch (the stage's
    sources) into its codes and scales (the stage's destinations), once every round and
    copy that writes the scratch landed. Moves no wire bytes: returns ``c.nbytes`` (0)."""
    s = quant.scratch_for(c.rank, c.name, c.region)
    _finish(quant, s, c.region, tables.src_bindings[s.key], tables.dst_bindings, kernels)
    return c.nbytes


def _finish(quant: Any, s: Any, region: Any, buf: Any, dst_bindings: Mapping,
            kernels: Any) -> int:
    """Quantize the whole blocks ``region`` of scratch ``s`` (held in ``buf``) into the
    codes and scales of its receiver. Returns the bytes read (in the wire dtype)."""
    values = array_module(buf).ascontiguousarray(buf[_relative(region, s.region)])
    _write(quant, s.rank, s.name, region, values, dst_bindings, kernels)
    return values.nbytes


def settle(dst_bindings: Mapping) -> None:
    """Wait for the split blocks quantized into ``dst_bindings`` on a device (see
    :func:`.quantize_device.settle`); nothing for host memory."""
    from .quantize_device import settle as settle_device
    settle_device(dst_bindings)


def finish(quant: Any, dst_bindings: Mapping, kernels: Any = None) -> int:
    """Quantize every split block from its scratch into the destination, outside an
    executor (``dst_bindings`` holds the scratch buffers too): the scratch stage's copies
    (:func:`finish_copy`) one after another, each on xreshard's own stream of the scratch's
    device (the rounds' unpacks wrote the scratch there: a non-blocking stream, unordered
    with the caller's). Returns the bytes quantized (in the wire dtype)."""
    if quant is None:
        return 0
    from .devices import device_ctx
    from .device_ops import is_host
    done = 0
    for ss in quant.scratch.values():
        for s in ss:
            qt = quant.tensors[s.name]
            buf = dst_bindings[s.key]
            with device_ctx(None if is_host(buf) else buf.device.id):
                for blocks in s.blocks:
                    done += _finish(quant, s, qt.format.data_region(blocks, qt.shape), buf,
                                    dst_bindings, kernels)
    settle(dst_bindings)
    return done


def count(quant: Any, b: Any, stats: Any, way: str) -> None:
    """Add bucket ``b``'s FP8 item bytes (codes + scales) and its values of quantized
    tensors (split blocks, in the wire dtype) to ``stats.quantized["fp8_<way>"]`` and
    ``["bf16_<way>"]`` (``way``: "sent" or "received")."""
    if quant is None or b.stage != 0:
        return
    fp8 = sum(it.nbytes for it in b.items if it.quantized)
    bf16 = sum(it.nbytes for it in b.items if not it.quantized and it.name in quant.tensors)
    for key, n in ((f"fp8_{way}", fp8), (f"bf16_{way}", bf16)):
        stats.quantized[key] = stats.quantized.get(key, 0) + n


# ---------------------------------------------------------------------------- verify=

def _relative(region: Any, outer: Any) -> tuple[slice, ...]:
    return tuple(slice(a - o, z - o) for a, z, o in zip(region.starts, region.stops,
                                                       outer.starts))


def _bytes(a: Any) -> np.ndarray:
    from .quantize_device import host_bytes
    return host_bytes(a)


def sent_bytes(quant: Any, name: str, region: Any, src: Any, src_dtype: str
               ) -> Iterator[np.ndarray]:
    """What a receiver of transfer ``region`` of ``name`` must hold, as the sender computes
    it from its source view ``src`` (holding ``src_dtype``), in the order
    :func:`received_bytes` reads it: the scales then the codes of the region's whole blocks
    (quantized here again, by the function the executor runs: the same bytes), then each
    rest box's values in the wire dtype (the pieces of split blocks the receiver finishes).
    ``RefitConfig(verify=...)`` hashes this stream on the sender."""
    qt = quant.tensors[name]
    values = _values(src, src_dtype, quant.wire[name])
    core = core_of(qt, region)
    if core is not None:
        yield from _quantized_bytes(values[_relative(core, region)], qt.format, name,
                                    quant.wire[name])
    for box in rest_boxes(region, core):
        yield _bytes(values[_relative(box, region)])


def received_bytes(quant: Any, rank: int, name: str, region: Any, dst_bindings: Mapping
                   ) -> Iterator[np.ndarray]:
    """What receiver ``rank`` holds of transfer ``region`` of ``name`` after the move, in
    :func:`sent_bytes`' order: the scales and codes of the region's whole blocks from the
    destination bindings, the rest boxes from the scratch they landed in
    (``dst_bindings`` holds :func:`scratch_bindings`). The split blocks the receiver then
    quantized from that scratch are its own computation, by the function checked equal
    to vLLM's; what the check proves is that their pieces arrived intact."""
    qt = quant.tensors[name]
    core = core_of(qt, region)
    if core is not None:
        yield from _held_bytes(quant, rank, name, core, dst_bindings)
    for box in rest_boxes(region, core):
        s = quant.scratch_for(rank, name, box)
        yield _bytes(dst_bindings[s.key][_relative(box, s.region)])


def transfer_streams(quant: Any, t: Any, rank: int, src_bindings: Mapping,
                     dst_bindings: Mapping, src_layout: Any
                     ) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """``("send" | "recv", byte pieces)`` for the sides of transfer ``t`` (of a tensor
    quantized on the way) that ``rank`` holds bindings of: :func:`sent_bytes` from its
    source view, :func:`received_bytes` from its destination (host bindings: the executor
    refuses device ones)."""
    if t.src == rank and (t.src, t.name) in src_bindings:
        view = view_of(src_bindings[(t.src, t.name)], src_layout, t.src, t.region)
        yield "send", sent_bytes(quant, t.name, t.region, view, src_layout.dtype)
    if t.dst == rank and (t.dst, t.name) in dst_bindings:
        yield "recv", received_bytes(quant, t.dst, t.name, t.region, dst_bindings)


def digest_transfer(out: Any, quant: Any, t: Any, key: str, rank: int, src_bindings: Mapping,
                    dst_bindings: Mapping, src_layout: Any, stream_hex: Any) -> int:
    """File the digests of transfer ``t`` (of a tensor quantized on the way) under ``key``
    in ``out.send`` / ``out.recv`` (a ``verify.Digests``) for the sides ``rank`` holds,
    unless filed already: :func:`sent_bytes` and :func:`received_bytes` (``dst_bindings``
    holds the receivers' scratch buffers too); ``stream_hex(pieces) -> (digest, bytes)``.
    Returns the bytes hashed."""
    n = 0
    for side, pieces in transfer_streams(
            quant, t, rank, src_bindings if key not in out.send else {},
            dst_bindings if key not in out.recv else {}, src_layout):
        (out.send if side == "send" else out.recv)[key], k = stream_hex(pieces)
        n += k
    return n


def digest_finished(out: Any, quant: Any, local: Any, dst_bindings: Mapping, stream_hex: Any,
                    wanted: Any, key_of: Any) -> int:
    """File the digests of the split blocks each of the ``local`` receivers quantized
    itself (:func:`finished_bytes`), both ways, as a transfer from the receiver to itself
    (``wanted(key, elements)``: whether this call hashes it; ``key_of``: verify's key of a
    transfer, handed in so that this module does not import verify, which imports it).
    Returns the bytes hashed."""
    n = 0
    for rank in local:
        for name, region, expected, held in finished_bytes(quant, rank, dst_bindings):
            key = key_of(name, region, rank, rank)
            if not wanted(key, region.size):
                continue
            out.send[key], k1 = stream_hex(expected)
            out.recv[key], k2 = stream_hex(held)
            n += k1 + k2
    return n


#: what verify files the split blocks a receiver quantized under: the tensor's name plus this
FINISHED = " (split blocks quantized by the receiver)"


def finished_bytes(quant: Any, rank: int, dst_bindings: Mapping
                   ) -> Iterator[tuple[str, Any, Iterator[np.ndarray], Iterator[np.ndarray]]]:
    """For each group of split blocks receiver ``rank`` quantized from its scratch
    (:func:`finish`): ``(name, region, expected, held)``, ``expected`` the scales and codes
    quantizing the scratch gives, ``held`` those in the destination bindings, in the same
    order. No sender holds a split block whole, so this half of ``verify`` is the
    receiver's own: its pieces are checked against their senders by :func:`received_bytes`,
    and this says the destination holds their quantization."""
    for (r, name), ss in sorted(quant.scratch.items()):
        if r != rank or (rank, name) not in dst_bindings:
            continue
        qt = quant.tensors[name]
        for s in ss:
            for blocks in s.blocks:
                region = qt.format.data_region(blocks, qt.shape)
                yield (name + FINISHED, region,
                       _quantized_bytes(dst_bindings[s.key][_relative(region, s.region)],
                                        qt.format, name, quant.wire[name], "receive"),
                       _held_bytes(quant, rank, name, region, dst_bindings))


def _quantized_bytes(values: Any, fmt: Any, name: str, dtype: str | None = None,
                     role: str = "send") -> Iterator[np.ndarray]:
    codes, scales = quantize_values(array_module(values).ascontiguousarray(values), fmt,
                                    name, dtype, role)
    yield _bytes(scales)
    yield _bytes(codes)


def _held_bytes(quant: Any, rank: int, name: str, region: Any, dst_bindings: Mapping
                ) -> Iterator[np.ndarray]:
    codes, scales = _dst_views(quant, rank, name, region, dst_bindings)
    yield _bytes(scales)
    yield _bytes(codes)


def quantized_report(prepared: Any, stats: Any) -> dict[str, int] | None:
    """``RefitReport.quantized``: this process's FP8 and split-block bytes both ways, and
    the world totals (None when the call quantizes nothing on the way)."""
    if prepared.formats.quant is None:
        return None
    out = {k: 0 for k in ("fp8_sent", "bf16_sent", "fp8_received", "bf16_received")}
    out.update(stats.quantized)
    out.update(prepared.formats.quant.totals)
    return out
