"""The executor's host paths around staging: gather a bucket's runs of small items into
its message (:func:`pack_runs`), and land a received message into host bindings
(:func:`unpack_host`, keeping the views for the next call of the same prepared call).

Split out of ``execute.py`` (the :class:`~xreshard.runtime.execute.Executor` calls them
with its program cache, item codecs and the stage's bindings); every other byte goes
through the item codecs (:mod:`.codecs.items`) and :func:`.copies.copy_into`.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import numpy as np

from ..planner.schedule import Bucket
from .codecs.items import ItemCodecs
from .codecs.items import item as _item
from .codecs.items import message_view
from .copies import array_module, copy_into
from .programs import Programs

__all__ = ["pack_runs", "unpack_host"]


def pack_runs(programs: Programs, items: ItemCodecs, bindings: Mapping, b: Bucket,
              buf: np.ndarray) -> None:
    """Host packing of a bucket of many items: consecutive small items of one dtype that
    need no cast are gathered by one ``np.concatenate`` into their run of the message
    (one C call instead of a copy per item; thousands of tiny tensors share a bucket),
    typed with ``casting="no"``: bits as they are; numpy refuses a binding of another
    numpy dtype (a raw-bits view), and that run is gathered as bits instead."""
    rows = getattr(bindings, "rows", None)      # binding.RowBindings
    for run in programs.runs(b, 0):
        if run.small and len(run.steps) > 1:
            if rows and run.keys and _rows_into(
                    programs.row_plan(run, rows), bindings,
                    bindings.blocks, run, buf):  # type: ignore[attr-defined]
                continue
            parts = list(map(bindings.__getitem__, run.keys)) if run.keys else [
                bindings[e.key] if e.whole else _item(bindings[e.key], e.index, e.slices)
                for e in run.steps]
            _gather(parts, buf[run.lo:run.hi], run)
            continue
        for e in run.steps:
            items.of(e).pack(e, buf, bindings)


def _rows_into(plan: tuple | None, bindings: Mapping, blocks: list, run: Any,
               buf: np.ndarray) -> bool:
    """Pack run ``run`` by its ``plan`` (``Programs.row_plan``): a segment of rows is
    copied out of its block, its bytes as they are (a run's items need no cast); the
    other segments are gathered as :func:`pack_runs` gathers a run. False (nothing
    copied) when there is no plan or a block does not hold its segment's bytes."""
    if plan is None:
        return False
    segments = []
    for lo, hi, block, *rest in plan:
        if block is None:
            continue
        blk = blocks[block] if block < len(blocks) else None
        first, end = rest
        if blk is None or not blk.flags.c_contiguous or blk.ndim == 0 or end > blk.shape[0]:
            return False
        rows = blk.reshape(blk.shape[0], -1).view(np.uint8)[first:end]
        if rows.size != hi - lo:
            return False
        segments.append((lo, hi, rows))
    for lo, hi, rows in segments:
        np.copyto(buf[lo:hi], rows.reshape(-1))
    for lo, hi, block, *rest in plan:
        if block is None:
            _gather(list(map(bindings.__getitem__, rest[0])), buf[lo:hi], run)
    return True


def _gather(parts: list, out: np.ndarray, run: Any) -> None:
    """``parts`` (bindings of a run's items) one after another into ``out`` (bytes)."""
    try:
        np.concatenate(parts, axis=None, out=out.view(run.typed), casting="no")
    except TypeError:       # some binding is not typed as its dtype: as bits
        np.concatenate([p.view(run.bits) for p in parts], axis=None, out=out.view(run.bits),
                       casting="no")


def unpack_host(programs: Programs, items: ItemCodecs, bindings: Mapping, b: Bucket,
                buf: np.ndarray) -> None:
    """Unpacking from host staging: a small item that needs no cast into a host array is
    one assignment of the message's bytes seen as the array's own dtype (so its bits are
    copied, as :func:`copy_into` copies them); anything else goes through
    :func:`copy_into`."""
    base = buf.base if buf.base is not None else buf
    at = buf.__array_interface__["data"][0]
    landing = programs.landing(b)
    if landing is not None and landing[0] is base and landing[1] == at and all(
            map(operator.is_, map(bindings.get, landing[3]), landing[4])):
        # the call before unpacked this bucket from the same staging bytes into the same
        # arrays (this call's check passed): its views stand, one assignment per item
        for dst, src in landing[2]:
            dst[...] = src
        return
    ndarray = np.ndarray
    pairs: list[tuple[Any, Any, Any, Any]] | None = []
    for run in programs.runs(b, 1):
        for e in run.steps:
            if e.quant is not None:
                items.fp8.unpack(e, buf, bindings)
                pairs = None
                continue
            arr = bindings[e.key]
            if run.small and type(arr) is ndarray:
                dst = arr if e.whole else _item(arr, e.index, e.slices)
                # the same dtype on both sides: item assignment copies bits, no cast
                src = buf[e.lo:e.hi].view(dst.dtype).reshape(e.shape)
                dst[...] = src
                if pairs is not None:
                    pairs.append((e.key, arr, dst, src))
                continue
            pairs = None
            dst = _item(arr, e.index, e.slices)
            # a transposed step's message view is column-major: copy_into transposes
            copy_into(array_module(dst), dst, e.dtype, message_view(buf, e), e.wire)
    programs.keep_landing(b, base, at, pairs)
