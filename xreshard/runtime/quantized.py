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
  own, :meth:`Scratch.key`), which :func:`finish` quantizes once every round has landed;
* same-rank copies (:func:`copy_local`) do both at once.

Host bindings only: quantizing on a GPU inside the executor needs a CUDA quantizer
(TODO(issue 20): a CuPy or torch kernel on xreshard's stream); device bindings are refused
before anything moves.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np

from ..dtypes import numpy_dtype
from ..ir.formats import MXFP8
from .copies import copy_into

__all__ = ["pack", "unpack", "copy_local", "finish", "scratch_bindings", "quantize_values",
           "count", "copies", "refuse_devices", "with_scratch", "quantized_problems",
           "quantized_report"]


#: regions at least this big are quantized by JAX's jitted quantizer in a process that has
#: JAX loaded (a JAX trainer); smaller ones by numpy (no compile per shape for them)
JAX_MIN_ELEMENTS = 1 << 16


def quantize_values(values: np.ndarray, fmt: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of ``values`` (numpy, a dtype the format quantizes).

    Identical bytes whichever runs (``tests/test_quant.py``): in a process that has JAX
    loaded (a JAX trainer, whose CPU arrays are host memory), large regions go through
    :mod:`xreshard.quant.jax_ops` on its CPU device - jitted per shape, ~5x numpy's
    throughput per CPU-second (``benchmarks/RESULTS.md``); else :mod:`xreshard.quant.host`.
    """
    jax = sys.modules.get("jax")
    if jax is not None and values.size >= JAX_MIN_ELEMENTS:
        from ..quant import jax_ops
        if isinstance(fmt, MXFP8) or values.dtype != numpy_dtype("bfloat16"):
            codes, scales = jax_ops.quantize(jax.device_put(values, jax.devices("cpu")[0]),
                                             fmt, name=name)
        else:       # bf16 bits, imported without a copy where aligned (a JAX buffer's are)
            bits = np.ascontiguousarray(values).view(np.uint16)
            try:
                x = jax.numpy.from_dlpack(bits, copy=False)
            except (BufferError, ValueError, TypeError, RuntimeError):
                x = jax.device_put(bits, jax.devices("cpu")[0])
            codes, scales = jax_ops.quantize_bf16_bits(x, fmt)
        return np.asarray(codes), np.asarray(scales)
    from ..quant import host
    fn = host.quantize_mxfp8 if isinstance(fmt, MXFP8) else host.quantize_block_fp8
    return fn(values, fmt, name=name)


def _values(src: Any, src_dtype: str, values: str) -> np.ndarray:
    """The region ``src`` (a binding view holding ``src_dtype``) as ``values`` values,
    cast as the wire casts (``copy_into``), contiguous (``src`` itself when it is)."""
    if src_dtype == values and isinstance(src, np.ndarray) and src.flags.c_contiguous:
        return src.view(numpy_dtype(values))
    out = np.empty(src.shape, numpy_dtype(values))
    copy_into(np, out, values, src, src_dtype)
    return out


def _put(dst: Any, data: np.ndarray) -> None:
    """Copy the bits of ``data`` into the binding view ``dst`` (same element size)."""
    dst[...] = data.view(dst.dtype).reshape(dst.shape)


def pack(e: Any, buf: np.ndarray, bindings: Mapping, item: Any) -> None:
    """Quantize the region of FP8 step ``e`` from its source binding into ``buf``."""
    q = e.quant
    src = item(bindings[e.key], e.index, e.slices)
    codes, scales = quantize_values(_values(src, e.dtype, q.values), q.format, e.key[1])
    buf[e.lo:e.lo + q.scale_bytes] = scales.reshape(-1).view(np.uint8)
    buf[e.lo + q.scale_bytes:e.hi] = codes.reshape(-1).view(np.uint8)


def unpack(e: Any, buf: np.ndarray, bindings: Mapping, item: Any) -> None:
    """Write FP8 step ``e``'s codes and scales from ``buf`` into their bindings."""
    q = e.quant
    _put(item(bindings[e.key], e.index, e.slices), buf[e.lo + q.scale_bytes:e.hi])
    _put(item(bindings[q.scale_key], q.scale_index, q.scale_slices),
         buf[e.lo:e.lo + q.scale_bytes])


def _write(quant: Any, rank: int, name: str, region: Any, values: np.ndarray,
           dst_bindings: Mapping) -> None:
    """Quantize ``values`` (the region ``region`` of ``name``, whole blocks) into the
    codes' and the scales' bindings of ``rank``."""
    qt = quant.tensors[name]
    codes, scales = quantize_values(values, qt.format, name)
    lay = quant.codes[name]
    i, slices = lay.locate(rank, region)
    b = dst_bindings[(rank, name)]
    _put((b if lay.is_product else b[i])[slices], codes)
    slay = quant.scales[name]
    i, slices = slay.locate(rank, qt.format.scale_region(region, qt.shape, name))
    b = dst_bindings[(rank, qt.scale)]
    _put((b if slay.is_product else b[i])[slices], scales)


def copies(quant: Any, c: Any) -> bool:
    """Whether same-rank copy ``c`` is of a tensor quantized on the way."""
    return quant is not None and c.stage == 0 and c.name in quant.tensors


def copy_local(c: Any, quant: Any, tables: Any) -> int:
    """A same-rank copy of a tensor quantized on the way: whole blocks quantized into the
    destination, the rest into its scratch. Returns its bytes."""
    src_layout, src_bindings = tables.src_layouts[c.name], tables.src_bindings
    dst_bindings = tables.dst_bindings
    i, slices = src_layout.locate(c.rank, c.region)
    b = src_bindings[(c.rank, c.name)]
    values = _values((b if src_layout.is_product else b[i])[slices], src_layout.dtype,
                     quant.wire[c.name])
    if c.quantized:
        _write(quant, c.rank, c.name, c.region, values, dst_bindings)
        return c.nbytes
    s = quant.scratch_for(c.rank, c.name, c.region)
    rel = tuple(slice(a - o, z - o) for a, z, o in zip(c.region.starts, c.region.stops,
                                                       s.region.starts))
    dst_bindings[s.key][rel] = values
    return c.nbytes


def refuse_devices(quant: Any) -> None:
    """Raise ``RefitError`` when a call that quantizes on the way has device bindings."""
    if quant is not None:
        from ..errors import RefitError
        raise RefitError(f"quantizing on the way ({sorted(quant.tensors)[:3]}) runs on host "
                         "bindings only for now; send these tensors from host memory, or "
                         "quantize them in the trainer")


def with_scratch(quant: Any, dsts: Any, cache: dict | None) -> list:
    """Each stage's destination bindings, stage 0's with the receivers' scratch buffers."""
    dsts = list(dsts)
    if quant is not None:
        dsts[0] = {**dsts[0], **scratch_bindings(quant, cache)}
    return dsts


def scratch_bindings(quant: Any, cache: dict | None) -> dict:
    """``Scratch.key`` -> a buffer of the scratch's region in its wire dtype, kept in
    ``cache`` (the call's program cache) across runs."""
    if quant is None:
        return {}
    cache = {} if cache is None else cache
    out = cache.get("quant scratch")
    if out is None:
        out = {s.key: np.zeros(s.region.shape, numpy_dtype(quant.wire[s.name]))
               for ss in quant.scratch.values() for s in ss}
        cache["quant scratch"] = out
    return out


def finish(quant: Any, dst_bindings: Mapping) -> int:
    """Quantize every split block from its scratch into the destination (after every round
    and copy landed). Returns the bytes quantized (in the wire dtype)."""
    if quant is None:
        return 0
    done = 0
    for ss in quant.scratch.values():
        for s in ss:
            qt = quant.tensors[s.name]
            buf = dst_bindings[s.key]
            for blocks in s.blocks:
                region = qt.format.data_region(blocks, qt.shape)
                rel = tuple(slice(a - o, z - o) for a, z, o in zip(
                    region.starts, region.stops, s.region.starts))
                values = np.ascontiguousarray(buf[rel])
                _write(quant, s.rank, s.name, region, values, dst_bindings)
                done += values.nbytes
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


def quantized_problems(prepared: Any, config: Any) -> list[list[str]]:
    """What a refit's config cannot do with a call that quantizes on the way, as error
    entries (``[class name, message]``) for the refit's exchange: the same in every
    process, before any byte moves."""
    if prepared.quant is None or not config.verify:
        return []
    return [["RefitError", f"RefitConfig.verify cannot check tensors quantized on the way "
             f"({sorted(prepared.quant.tensors)[:3]}...): the receiver's codes are not the "
             "sender's bytes; TODO(issue 20): digest the codes the sender quantized - "
             "set verify=False for this refit"]]


def quantized_report(prepared: Any, stats: Any) -> dict[str, int] | None:
    """``RefitReport.quantized``: this process's FP8 and split-block bytes both ways, and
    the world totals (None when the call quantizes nothing on the way)."""
    if prepared.quant is None:
        return None
    out = {k: 0 for k in ("fp8_sent", "bf16_sent", "fp8_received", "bf16_received")}
    out.update(stats.quantized)
    out.update(prepared.quant.totals)
    return out
