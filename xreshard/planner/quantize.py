"""Quantizing on the way: which bytes of a quantized destination travel as FP8, per block.

A destination tensor stored quantized (:class:`~xreshard.ir.formats.QuantizedTensor`:
e4m3 codes plus scales) is planned as the *values* the sender holds (bf16, after any
``wire_dtype`` cast): the plan says which region goes from which sender to which receiver,
as for any tensor. This module then decides, per transfer and per block, what the wire
carries:

* the blocks lying whole inside a transfer's region (one sender holds every element the
  receiver needs of them) are quantized by the **sender** at pack time and travel as codes
  plus scales: half the bytes of bf16 (an *FP8 item*);
* the rest of the region (pieces of blocks other transfers also write: a block straddling
  two senders' shards, or a quota boundary) travels in the wire dtype and lands in a
  **scratch** buffer of the receiver, which quantizes those *split blocks* with the same
  function once every round has landed.

Per transfer::

    transfer region (rows 100:400 of a 128-block grid)
    rows 100:128 | 128:384             | 384:400
    bf16 (rest)  | FP8 item: 2 blocks  | bf16 (rest)
                   (codes + scales)

Both peers derive the same items from the same transfer, so nothing is negotiated. The
decision is per transfer region, not per block list: the blocks inside a box are a box,
and the rest is at most two boxes per dim. Quantizing a block-aligned region as a tensor
of its own gives the bytes the whole tensor's quantization gives there (the grid is the
tensor's, anchored at its origin; a tail block is partial only at the tensor's end, which
an aligned region then also ends at).

The scale tensor of a quantized destination has no source and no transfer of its own: its
regions are written with the codes (an FP8 item's scales, or the receiver's quantization of
its split blocks). What the planner sees (:func:`value_layouts`) is the codes' layout in
the wire dtype, without the scale tensor.

Pure: imports only the IR and the planner (``tests/test_structure.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..dtypes import dtype_name, itemsize
from ..ir.formats import QUANTIZABLE, FormatError, QuantizedTensor
from ..ir.geometry import Region
from ..ir.layout import Layout

__all__ = ["Quantization", "Scratch", "quantization", "split_quantized", "rest_boxes",
           "core_of", "quantized_bytes"]


@dataclass(frozen=True)
class Scratch:
    """Where one receiving rank gathers the split blocks of one tensor before quantizing
    them: ``region`` (tensor coordinates, whole blocks) in the wire dtype; ``blocks`` the
    block regions (scale coordinates) inside it to quantize once every round landed."""

    rank: int
    name: str
    index: int
    region: Region
    blocks: tuple[Region, ...]

    @property
    def key(self) -> tuple[int, str]:
        """The scratch buffer's ``(rank, name)`` key among the stage's destination bindings
        (a name no tensor has: it ends with a NUL and its index)."""
        return (self.rank, f"{self.name}\0scratch{self.index}")


@dataclass(frozen=True)
class Quantization:
    """The quantized destinations of a call: stage 0 tensors the senders offer unquantized.

    Attributes:
        tensors: name -> its :class:`QuantizedTensor` (codes under the name, scales under
            ``tensor.scale``).
        codes: name -> the codes' destination layout (the format's code dtype).
        scales: name -> the scale tensor's destination layout.
        wire: name -> the dtype the values are quantized from (and in which the split
            blocks travel): the sender's dtype, or the ``wire_dtype`` cast of it.
        scratch: for each of the call's receiving ranks, the scratch buffers of its split
            blocks (see :class:`Scratch`), by ``(rank, name)``.
        totals: world totals of the quantized tensors' transfers (:func:`wire_totals`).
    """

    tensors: Mapping[str, QuantizedTensor]
    codes: Mapping[str, Layout]
    scales: Mapping[str, Layout]
    wire: Mapping[str, str]
    scratch: Mapping[tuple[int, str], tuple[Scratch, ...]] = field(default_factory=dict)
    totals: Mapping[str, int] = field(default_factory=dict)

    def scratch_for(self, rank: int, name: str, region: Region) -> Scratch:
        """The scratch of ``rank`` that holds the rest region ``region`` of ``name``."""
        for s in self.scratch.get((rank, name), ()):
            if s.region.contains(region):
                return s
        raise AssertionError(f"no scratch of rank {rank} holds {name}{region}")


def _wire_of(name: str, src: Layout, wire_dtype: Any) -> str:
    if isinstance(wire_dtype, Mapping):
        wire_dtype = wire_dtype.get(name)
    return dtype_name(wire_dtype) if wire_dtype is not None else src.dtype


def quantization(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                 quantized: Mapping[str, QuantizedTensor], wire_dtype: Any = None
                 ) -> Quantization | None:
    """The tensors of ``quantized`` that this call quantizes on the way, checked.

    A declared quantized destination is quantized on the way when the sender offers its
    values (its source dtype is not the codes' dtype and no source offers the scales);
    a sender that offers codes and scales itself moves them as they are.

    Raises:
        FormatError: a sender offers a dtype the format cannot quantize (or offers the
            scales without the codes' dtype), or the codes' and scales' layouts do not fit
            the format (naming the tensor), the same in every process.
    """
    tensors, codes, scales, wire = {}, {}, {}, {}
    for name, qt in sorted(quantized.items()):
        if name not in dst_layouts or qt.scale not in dst_layouts or name not in src_layouts:
            continue
        src = src_layouts[name]
        if qt.scale in src_layouts or src.dtype == qt.format.dtype:
            if src.dtype != qt.format.dtype:
                raise FormatError(f"{name!r} is stored as {qt.format}; the sender offers "
                                  f"its scales {qt.scale!r} but {src.dtype} values - send "
                                  f"{qt.format.dtype} codes with them, or the values alone")
            continue
        qt.check_offer(src.dtype)
        w = _wire_of(name, src, wire_dtype)
        if w not in QUANTIZABLE:
            raise FormatError(f"{name!r} is stored as {qt.format}: wire_dtype {w} cannot be "
                              f"quantized; use one of {', '.join(QUANTIZABLE)}")
        qt.check_layouts(dst_layouts[name], dst_layouts[qt.scale])
        tensors[name], wire[name] = qt, w
        codes[name], scales[name] = dst_layouts[name], dst_layouts[qt.scale]
    if not tensors:
        return None
    return Quantization(tensors, codes, scales, wire)


def value_layouts(dst_layouts: Mapping[str, Layout], q: Quantization | None
                  ) -> dict[str, Layout]:
    """What the planner plans: each quantized tensor's codes layout in its wire dtype (the
    values that move), and no scale tensor (it has no source)."""
    if q is None:
        return dict(dst_layouts)
    drop = {t.scale for t in q.tensors.values()}
    return {name: (lay.with_dtype(q.wire[name]) if name in q.tensors else lay)
            for name, lay in dst_layouts.items() if name not in drop}


# ---------------------------------------------------------------------------- regions

def rest_boxes(region: Region, core: Region | None) -> list[Region]:
    """``region`` minus ``core`` (a box inside it) as disjoint boxes, dim by dim."""
    if core is None:
        return [region]
    out = []
    starts, stops = list(region.starts), list(region.stops)
    for d in range(region.ndim):
        if starts[d] < core.starts[d]:
            out.append(Region(tuple(starts), tuple(stops[:d] + [core.starts[d]] + stops[d + 1:])))
        if core.stops[d] < stops[d]:
            out.append(Region(tuple(starts[:d] + [core.stops[d]] + starts[d + 1:]),
                              tuple(stops)))
        starts[d], stops[d] = core.starts[d], core.stops[d]
    return out


def core_of(qt: QuantizedTensor, region: Region) -> Region | None:
    """The block-aligned part of ``region`` made of the blocks lying whole inside it
    (tensor coordinates), or None."""
    blocks = qt.format.whole_blocks(region, qt.shape)
    return None if blocks is None else qt.format.data_region(blocks, qt.shape)


def fp8_nbytes(qt: QuantizedTensor, region: Region) -> int:
    """Wire bytes of an aligned ``region`` sent quantized: its codes plus its scales."""
    nblocks = qt.format.blocks(region, qt.shape).size
    return region.size * itemsize(qt.format.dtype) + nblocks * itemsize(qt.format.scale_dtype)


def quantized_bytes(qt: QuantizedTensor, region: Region, wire_itemsize: int
                    ) -> tuple[int, int]:
    """``(FP8 bytes, rest bytes)`` that a transfer of ``region`` puts on the wire: its
    whole blocks as codes plus scales, the rest in the wire dtype (``wire_itemsize``)."""
    core = core_of(qt, region)
    if core is None:
        return 0, region.size * wire_itemsize
    return fp8_nbytes(qt, core), (region.size - core.size) * wire_itemsize


def scale_nbytes(qt: QuantizedTensor, region: Region) -> int:
    """Bytes of the scales of an aligned ``region`` (they lead its FP8 item)."""
    return qt.format.blocks(region, qt.shape).size * itemsize(qt.format.scale_dtype)


def split_quantized(qt: QuantizedTensor, region: Region, wire_itemsize: int, max_bytes: int,
                    split: Any) -> list[tuple[Region, int, bool]]:
    """A transfer's region as items: ``(region, wire bytes, quantized)``.

    The core of whole blocks is cut into FP8 items of at most ``max_bytes`` along whole
    blocks (``split`` is the scheduler's :func:`~.schedule.split_region`, applied to the
    block grid with a block's wire bytes as its element size); the rest into items in the
    wire dtype (``split`` on elements).
    """
    core = core_of(qt, region)
    out: list[tuple[Region, int, bool]] = []
    if core is not None:
        fmt = qt.format
        blocks = fmt.blocks(core, qt.shape)
        per_block = math.prod(fmt.block_shape(len(qt.shape))) * itemsize(fmt.dtype) \
            + itemsize(fmt.scale_dtype)
        for part in split(blocks, per_block, max(max_bytes, per_block)):
            data = fmt.data_region(part, qt.shape)
            out.append((data, fp8_nbytes(qt, data), True))
    for box in rest_boxes(region, core):
        for part in split(box, wire_itemsize, max_bytes):
            out.append((part, part.size * wire_itemsize, False))
    return out


# ---------------------------------------------------------------------------- receivers

def _touch(a: Region, b: Region) -> bool:
    return all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(a.starts, a.stops, b.starts,
                                                             b.stops))


def _hull(a: Region, b: Region) -> Region:
    return Region(tuple(map(min, a.starts, b.starts)), tuple(map(max, a.stops, b.stops)))


def scratches(q: Quantization, rank: int, received: Iterable[tuple[str, Region]]
              ) -> dict[tuple[int, str], tuple[Scratch, ...]]:
    """The scratch buffers of ``rank`` for the ``(name, region)`` it receives (transfers
    and same-rank copies of quantized tensors): the rest boxes' blocks, grouped into
    disjoint hulls (two rest boxes of one split block share a scratch)."""
    boxes: dict[str, list[Region]] = {}
    for name, region in received:
        qt = q.tensors[name]
        for box in rest_boxes(region, core_of(qt, region)):
            boxes.setdefault(name, []).append(qt.format.blocks(box, qt.shape))
    out = {}
    for name, blocks in sorted(boxes.items()):
        groups: list[tuple[Region, list[Region]]] = []
        for b in dict.fromkeys(blocks):
            hull, members = b, [b]
            while True:         # absorb every group the hull touches, until none does
                hit = [g for g in groups if _touch(g[0], hull)]
                if not hit:
                    break
                for g in hit:
                    groups.remove(g)
                    hull, members = _hull(g[0], hull), g[1] + members
            groups.append((hull, members))
        qt = q.tensors[name]
        out[(rank, name)] = tuple(
            Scratch(rank, name, i, qt.format.data_region(hull, qt.shape), tuple(members))
            for i, (hull, members) in enumerate(sorted(groups, key=lambda g: g[0].starts)))
    return out


def with_scratch(q: Quantization | None, plan: Any, ranks: Iterable[int]) -> Quantization | None:
    """``q`` with the scratch buffers of the receiving ``ranks`` of ``plan`` and the
    world totals of its transfers."""
    if q is None:
        return None
    scratch: dict[tuple[int, str], tuple[Scratch, ...]] = {}
    for rank in ranks:
        got = [(t.name, t.region) for t in plan.transfers_for(rank)
               if t.dst == rank and t.name in q.tensors]
        got += [(t.name, t.region) for t in plan.local_copies_for(rank) if t.name in q.tensors]
        scratch.update(scratches(q, rank, got))
    return Quantization(q.tensors, q.codes, q.scales, q.wire, scratch, wire_totals(q, plan))


def wire_totals(q: Quantization | None, plan: Any) -> dict[str, int]:
    """World totals over every transfer of the quantized tensors (same-rank copies
    excluded): ``fp8_world`` wire bytes sent quantized (codes + scales), ``bf16_world``
    bytes sent in the wire dtype for receivers to quantize, and ``unquantized_world`` what
    all of it would be in the wire dtype."""
    out = {"fp8_world": 0, "bf16_world": 0, "unquantized_world": 0}
    if q is None:
        return out
    for t in plan.iter_transfers():
        qt = q.tensors.get(t.name)
        if qt is None:
            continue
        isz = itemsize(q.wire[t.name])
        fp8, rest = quantized_bytes(qt, t.region, isz)
        out["unquantized_world"] += t.region.size * isz
        out["fp8_world"] += fp8
        out["bf16_world"] += rest
    return out
