"""How a delta lands on host memory (the receiver's half of :mod:`.codecs.delta`): applied
in place to the destination items, and the bf16 pieces of FP8 blocks split across
senders diffed against the bytes their receiver last received.

A delta message is applied to the bucket's items in message order, each item's bytes in
its destination when they can be written in place (a contiguous view of the wire dtype;
an FP8 item's scales, then its codes), else read into scratch, applied and written back.

**Split blocks' pieces.** A piece of an FP8 block that several senders hold lands in its
receiver's scratch (:class:`xreshard.planner.quantize.Scratch`), which the receiver
quantizes once every round landed. The scratch is no fenced base (it belongs to the
program cache: a re-plan makes new scratch, and an ``atomic`` call does not stage it), so
a delta is not applied to it. Instead the receiver keeps, per sending pair and bucket,
the pieces' bytes it last received (:meth:`.delta_wire.DeltaCall.keep_pieces`, a few
bytes: only pieces of split blocks), under the pair's version fence: they are taken as
the call's bucket lands (dense: read back from the scratch; a delta: the kept bytes with
the delta applied, then written to the scratch) and become the base only when the
outcome confirmed the call (:meth:`.delta_wire.DeltaState.commit`; a failed call keeps
the last confirmed ones, or none). So the sender diffs the pieces like any item (its
baseline holds them too) and a piece that did not change costs nothing on the wire.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..delta.host import apply_parts
from ..dtypes import bits_dtype
from .copies import copy_into

__all__ = ["apply_host", "keep_landed_pieces", "binding_view", "gather"]


def apply_host(ex: Any, call: Any, b: Any, spans: Any, buf: np.ndarray | None) -> None:
    """Apply the delta ``buf`` (None: nothing changed) to bucket ``b``'s items on
    executor ``ex``'s host memory (``spans``: the bucket's ``delta_encode.Spans``): the
    destination items in place, split blocks' pieces to the bytes kept of the last call,
    then written into their scratch and kept for this one."""
    bits = bits_dtype(spans.unit)
    bindings = ex.tables[b.stage].dst_bindings
    steps = ex.programs.program(b, 1)
    held = None
    if any(spans.rest):
        held = call.pieces_base(b, sum(e.hi - e.lo for e, r in zip(steps, spans.rest) if r))
    parts, back, pieces, at = [], [], [], 0
    for e, rest in zip(steps, spans.rest):
        if rest:        # a piece of split blocks: its base is the bytes kept
            assert held is not None
            part = held[at:at + e.hi - e.lo]
            at += e.hi - e.lo
            pieces.append((e, part))
            parts.append(part.view(bits))
            continue
        if e.quant is None:
            views = [(binding_view(bindings, e.key, e.index, e.slices), e.bits, e.shape)]
        else:           # the message holds its scales, then its codes
            q = e.quant
            views = [(binding_view(bindings, q.scale_key, q.scale_index, q.scale_slices),
                      None, None), (binding_view(bindings, e.key, e.index, e.slices), None,
                                    None)]
        for view, vbits, shape in views:
            part = _writable_bytes(view)
            if part is None:
                part = _read_bits(view, vbits, shape, e)
                back.append((view, vbits, shape, e, part))
            parts.append(part.view(bits))
    if buf is not None and buf.nbytes:
        apply_parts(buf, parts, spans.unit, spans.nbytes // spans.unit)
    for view, vbits, shape, e, part in back:
        _write_bits(view, vbits, shape, e, part)
    for e, part in pieces:
        copy_into(np, binding_view(bindings, e.key, e.index, e.slices), e.dtype,
                  part.view(e.bits).reshape(e.shape), e.wire)
    if held is not None:
        call.keep_pieces(b, held)


def keep_landed_pieces(ex: Any, call: Any, b: Any, spans: Any) -> None:
    """Bucket ``b`` landed dense: keep its split blocks' pieces as they landed in their
    scratch (the wire dtype: the bytes sent; host bytes, copied from a device's scratch)
    for the next call's delta."""
    from .quantize_device import host_bytes
    bindings = ex.tables[b.stage].dst_bindings
    got = [host_bytes(binding_view(bindings, e.key, e.index, e.slices))
           for e, rest in zip(ex.programs.program(b, 1), spans.rest) if rest]
    call.keep_pieces(b, np.concatenate(got))


def binding_view(bindings: Any, key: Any, index: int | None, slices: tuple) -> Any:
    arr = bindings[key]
    return (arr if index is None else arr[index])[slices]


def _writable_bytes(view: Any) -> np.ndarray | None:
    """``view``'s memory as bytes, when it is a contiguous writeable numpy array."""
    if isinstance(view, np.ndarray) and view.flags.c_contiguous and view.flags.writeable:
        return view.reshape(-1).view(np.uint8)
    return None


def _read_bits(view: Any, bits: Any, shape: Any, e: Any) -> np.ndarray:
    """A contiguous copy of ``view``'s bytes (a plain item: as its wire dtype; an FP8
    item's scales or codes: as they are)."""
    if bits is None:
        return np.ascontiguousarray(view).reshape(-1).view(np.uint8)
    scratch = np.empty(e.hi - e.lo, np.uint8)
    copy_into(np, scratch.view(bits).reshape(shape), e.wire, view, e.dtype)
    return scratch


def _write_bits(view: Any, bits: Any, shape: Any, e: Any, part: np.ndarray) -> None:
    if bits is not None:
        copy_into(np, view, e.dtype, part.view(bits).reshape(shape), e.wire)
        return
    typed = bits_dtype(view.dtype.itemsize)
    try:
        view.view(typed)[...] = part.view(typed).reshape(view.shape)
    except (TypeError, ValueError):      # a view numpy cannot reinterpret: as typed
        view[...] = part.view(view.dtype).reshape(view.shape)


def gather(out: np.ndarray, pieces: Any) -> None:
    """Copy ``pieces`` back to back into ``out`` (a dense bucket's diffed bytes into its
    baseline)."""
    if len(pieces) == 1:
        np.copyto(out, pieces[0])
        return
    at = 0
    for p in pieces:
        out[at:at + p.nbytes] = p
        at += p.nbytes
