"""Pack and unpack programs: how each item of a bucket is read from (or written into) its
binding, computed once per bucket from geometry alone and reused by every run.

A program is a tuple of :class:`Step` (one per item, in message order); a bucket's program
is also cut into :class:`Run` s of consecutive small items that need no cast, which the
host path gathers (pack) or scatters (unpack) with one numpy call each. Both depend only
on the schedule and the stage tables' layouts and wire dtypes, so a cache of them
(:class:`Programs`) lives as long as the prepared call it was made for: the ``Refit``
that owns the call owns the cache.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..dtypes import ITEMSIZE, bits_dtype, dtype_name, itemsize, numpy_dtype
from ..ir.layout import Layout
from ..planner.schedule import Bucket, Item

__all__ = ["Programs", "QuantStep", "Run", "Step", "Tables", "canonical_wire"]

#: items up to this size are gathered together when packed on the host (see Run)
RUN_ITEM_BYTES = 1 << 14


class Tables(NamedTuple):
    """What the executor reads and writes for one stage of a call."""

    src_layouts: Mapping[str, Layout]
    dst_layouts: Mapping[str, Layout]
    wire_dtypes: Mapping[str, Any]
    src_bindings: Mapping[tuple[int, str], Any]
    """``(rank, name) -> binding`` of this process's sending ranks."""
    dst_bindings: Mapping[tuple[int, str], Any]
    """``(rank, name) -> binding`` of this process's receiving ranks."""


class Step(NamedTuple):
    """How one item of a bucket is packed from (side 0) or unpacked into (side 1) its
    binding: ``bindings[key][index][slices]`` <-> ``message[lo:hi]``."""

    key: tuple[int, str]
    """``(rank, name)`` in the stage's bindings of that side."""
    index: int | None       # type: ignore[assignment]  # a field, not tuple.index
    """Which buffer of an explicit binding (a list); None: the product binding's array."""
    slices: tuple
    lo: int
    hi: int
    bits: Any
    """The unsigned numpy dtype of the wire element size (how the message is viewed)."""
    shape: tuple[int, ...]
    wire: str
    """The dtype on the wire."""
    dtype: str
    """The dtype the binding holds (its layout's)."""
    whole: bool
    """The step covers its binding's whole local array (no slicing needed)."""
    quant: Any = None
    """An FP8 item (whole blocks quantized by the sender): its :class:`QuantStep`; None
    for every other item (see :mod:`xreshard.planner.quantize`)."""
    transposed: bool = False
    """The message holds the 2-D item in its senders' storage order, ``region.T``
    row-major (``Formats.transposed``): the senders hold ``[in, out]`` kernels, so a whole
    shard is sent as it is and the receivers transpose while unpacking."""


class QuantStep(NamedTuple):
    """What an FP8 item adds to its :class:`Step`: the message holds the scales at
    ``[lo, lo + scale_bytes)``, then the codes up to ``hi``; ``scale_key``,
    ``scale_index`` and ``scale_slices`` locate the scales in the receiver's binding."""

    format: Any
    values: str
    """The dtype quantized from: the binding's values are cast to it first (the
    ``wire_dtype`` the trainer exports)."""
    scale_bytes: int
    scale_key: tuple[int, str] | None
    scale_index: int | None
    scale_slices: tuple


class Run(NamedTuple):
    """Consecutive steps of a program that the host path moves with one numpy call when
    ``small`` (items of at most ``RUN_ITEM_BYTES``, one binding dtype, no cast)."""

    small: bool
    steps: tuple[Step, ...]
    lo: int
    hi: int
    bits: Any
    typed: Any
    """The numpy dtype of the run's items (None unless ``small``)."""
    keys: tuple | None = None
    """The steps' binding keys when every step is ``whole`` (its binding is the item as
    it is: gathered by key, no slicing), else None."""


def canonical_wire(wire_dtypes: Mapping[str, Any]) -> dict[str, str]:
    """Wire dtypes by canonical name (an array's own dtype may be raw bits)."""
    return {n: d if isinstance(d, str) and d in ITEMSIZE else dtype_name(d)
            for n, d in wire_dtypes.items()}


def packed(b: Bucket, wire: Mapping[str, str]) -> list[tuple[Item, int]]:
    """A bucket's items with their byte offsets in its message.

    Widest wire dtype first (an FP8 item counts as 4 bytes wide: its float32 scales lead):
    element sizes are powers of two, so every item then starts at a multiple of its own
    element size (the message starts 256-byte aligned in staging).
    CUDA faults on misaligned loads; numpy would only be slower. Both peers derive the
    same order from the same bucket.
    """
    items = sorted(b.items, key=lambda it: -(4 if it.quantized else itemsize(wire[it.name])))
    out, off = [], 0
    for it in items:
        out.append((it, off))
        off += it.nbytes
    return out


class Programs:
    """The programs of one schedule with one set of stage tables, by bucket and side.

    Args:
        tables: per stage, the layouts and wire dtypes the programs read (their bindings
            are not used: programs are geometry only).
        cache: a dict kept across runs of the same prepared call (its owner resets it when
            the call changes), or None for this executor alone.
        quant: the call's FP8 part (``Formats.quant``), or None.
        transposed: the ``(name, stage)`` whose 2-D items travel in their senders' storage
            order (``Formats.transposed``): their steps are :attr:`Step.transposed`.
    """

    def __init__(self, tables: tuple[Tables, ...], cache: dict | None = None,
                 quant: Any = None, transposed: frozenset = frozenset()):
        self._tables = tables
        self._quant = quant
        self._transposed = transposed
        self._cache: dict = {} if cache is None else cache
        # the wire dtypes of a prepared call are the same objects call after call: named
        # once per call, not once per tensor and call
        given = tuple(t.wire_dtypes for t in tables)
        kept = self._cache.get("wire")
        if kept is None or len(kept[0]) != len(given) or any(
                a is not b for a, b in zip(kept[0], given)):
            kept = self._cache["wire"] = (given, tuple(map(canonical_wire, given)))
        self._wire = kept[1]

    def wire(self, stage: int) -> Mapping[str, str]:
        return self._wire[stage]

    def program(self, b: Bucket, side: int) -> tuple[Step, ...]:
        """How to pack (side 0) or unpack (side 1) bucket ``b``, item by item."""
        key = (id(b), side)
        prog = self._cache.get(key)
        if prog is None:
            tables = self._tables[b.stage]
            layouts = tables.src_layouts if side == 0 else tables.dst_layouts
            wires = self._wire[b.stage]
            rank = b.src if side == 0 else b.dst
            flipped = self._transposed
            steps = []
            for it, off in packed(b, wires):
                if self._quant is not None and b.stage == 0 and it.name in self._quant.tensors:
                    steps.append(self._quant_step(it, off, rank, side))
                    continue
                lay = layouts[it.name]
                i, slices = lay.locate(rank, it.region)
                wire = wires[it.name]
                whole = lay.is_product and len(it.region.shape) == lay.ndim and all(
                    s.start == 0 and s.stop == n
                    for s, n in zip(slices, lay.local_shape(rank)))
                steps.append(Step((rank, it.name), None if lay.is_product else i,
                                  slices + (Ellipsis,), off, off + it.nbytes,
                                  bits_dtype(itemsize(wire)), it.region.shape, wire,
                                  lay.dtype, whole, None, bool(flipped) and len(
                                      it.region.shape) == 2 and (it.name, b.stage) in flipped))
            prog = self._cache[key] = tuple(steps)
        return prog

    def _quant_step(self, it: Any, off: int, rank: int, side: int) -> Step:
        """The step of an item of a tensor quantized on the way: an FP8 item (codes and
        scales), or on the receiving side a rest item, which lands in its scratch."""
        q = self._quant
        qt, wire = q.tensors[it.name], q.wire[it.name]
        tables = self._tables[0]
        if not it.quantized and side == 1:
            s = q.scratch_for(rank, it.name, it.region)
            slices = tuple(slice(a - o, b - o) for a, b, o in zip(
                it.region.starts, it.region.stops, s.region.starts)) + (Ellipsis,)
            return Step(s.key, None, slices, off, off + it.nbytes, bits_dtype(itemsize(wire)),
                        it.region.shape, wire, wire, False)
        layouts = tables.src_layouts if side == 0 else q.codes
        lay = layouts[it.name]
        i, slices = lay.locate(rank, it.region)
        if not it.quantized:
            return Step((rank, it.name), None if lay.is_product else i, slices + (Ellipsis,),
                        off, off + it.nbytes, bits_dtype(itemsize(wire)), it.region.shape,
                        wire, lay.dtype, False)
        fmt = qt.format
        scale_bytes = fmt.blocks(it.region, qt.shape).size * itemsize(fmt.scale_dtype)
        skey = sindex = None
        sslices: tuple = ()
        if side == 1:
            slay = q.scales[it.name]
            sindex, sslices = slay.locate(rank, fmt.scale_region(it.region, qt.shape, it.name))
            skey, sindex, sslices = (rank, qt.scale), (None if slay.is_product else sindex), \
                sslices + (Ellipsis,)
        quant = QuantStep(fmt, wire, scale_bytes, skey, sindex, sslices)
        return Step((rank, it.name), None if lay.is_product else i, slices + (Ellipsis,), off,
                    off + it.nbytes, bits_dtype(1), it.region.shape, fmt.dtype,
                    lay.dtype if side == 0 else fmt.dtype, False, quant)

    def local(self, c: Any) -> tuple:
        """Where same-rank copy ``c`` reads and writes: ``(source buffer index or None,
        source slices, destination buffer index or None, destination slices)`` in the
        bindings of its stage (``Layout.locate`` once per prepared call, not per call)."""
        key = (id(c), "local")
        got = self._cache.get(key)
        if got is None:
            tables = self._tables[c.stage]
            ends = []
            for lay in (tables.src_layouts[c.name], tables.dst_layouts[c.name]):
                i, slices = lay.locate(c.rank, c.region)
                ends += [None if lay.is_product else i, slices + (Ellipsis,)]
            got = self._cache[key] = tuple(ends)
        return got

    def row_plan(self, run: Run, rows: Mapping) -> tuple | None:
        """Run ``run`` (its keys) cut into segments: ``(message lo, hi, block, first row,
        end row)`` for consecutive rows of one block (``binding.RowBindings``: ``rows`` is
        its key -> (block, row) map), ``(message lo, hi, None, keys)`` for bindings
        gathered one by one; None when the run has no segment of rows or more than one
        segment per 4 items (gathering it whole is as cheap then). Made once per run and
        ``rows``."""
        key = (id(run), "rows")
        got = self._cache.get(key)
        if got is not None and got[0] is rows:
            return got[1]
        assert run.keys is not None
        plan: list[list] = []
        for step, k in zip(run.steps, run.keys):
            at = rows.get(k)
            last = plan[-1] if plan and plan[-1][1] == step.lo else None  # bytes abut
            if at is None:
                if last is not None and last[2] is None:
                    last[1] = step.hi
                    last[3].append(k)
                else:
                    plan.append([step.lo, step.hi, None, [k]])
            elif last is not None and last[2] == at[0] and last[4] == at[1]:
                last[1], last[4] = step.hi, at[1] + 1
            else:
                plan.append([step.lo, step.hi, at[0], at[1], at[1] + 1])
        useful = any(seg[2] is not None for seg in plan) and len(plan) * 4 <= len(run.steps)
        made = tuple((lo, hi, None, tuple(rest[0])) if block is None else (lo, hi, block, *rest)
                     for lo, hi, block, *rest in plan) if useful else None
        self._cache[key] = (rows, made)
        return made

    def landing(self, b: Bucket) -> Any:
        """What the executor kept of bucket ``b``'s last host unpack (see
        ``hostcopy.unpack_host``), or None."""
        return self._cache.get((id(b), "landing"))

    def keep_landing(self, b: Bucket, base: Any, at: int, pairs: list | None) -> None:
        """Keep bucket ``b``'s host unpack from staging ``base`` at address ``at``:
        ``pairs`` of (key, binding, destination view, staging view) per item, or None:
        as ``(base, at, [(destination, staging)], [key], [binding])``."""
        self._cache[(id(b), "landing")] = None if not pairs else (
            base, at, [(d, s) for _, _, d, s in pairs], [k for k, _, _, _ in pairs],
            [a for _, a, _, _ in pairs])

    def runs(self, b: Bucket, side: int) -> tuple[Run, ...]:
        """Bucket ``b``'s program cut into :class:`Run` s (see there)."""
        key = (id(b), 2 + side)
        runs = self._cache.get(key)
        if runs is not None:
            return runs
        raw: list[list] = []
        for e in self.program(b, side):
            small = e.wire == e.dtype and e.hi - e.lo <= RUN_ITEM_BYTES and e.quant is None \
                and not e.transposed
            if small and raw and raw[-1][0] and raw[-1][3] == e.bits and raw[-1][4] == e.dtype:
                raw[-1][1].append(e)
                raw[-1][2] = e.hi
            else:
                raw.append([small, [e], e.hi, e.bits, e.dtype])
        runs = self._cache[key] = tuple(
            Run(small, tuple(es), es[0].lo, hi, bits, numpy_dtype(dtype) if small else None,
                tuple(e.key for e in es) if all(e.whole for e in es) else None)
            for small, es, hi, bits, dtype in raw)
        return runs
