"""The formats phase of a prepared call: what every item is on the wire, decided once.

After planning and the relay's stages, :func:`formats` gives every ``(name, stage)`` of a
call one :data:`Format` and the call one framing; the schedule sizes items by it and the
runtime's codecs (``xreshard.runtime.codecs``) run it:

```
 plan -> relay stages -> formats -> schedule
                         (name, stage) -> Plain | Cast(wire) | Fp8(format, split)
                         framing: FIXED | SIZED
                         transposed: {(name, stage)} in the senders' storage order
```

* :class:`Plain`: the source's bytes as they are (the wire dtype is the source's);
* :class:`Cast`: cast to ``wire`` by the sender at pack time;
* :class:`Fp8`: quantized on the way (:mod:`.quantize`): whole blocks quantized by their
  sender and sent as scales + codes; ``split`` when some blocks are split across senders
  and travel in the wire dtype into the receiver's scratch, finished by the receiver once
  every round landed: the call's *scratch stage* (``PreparedCall.scratch_stage``, sources
  the receivers' scratch, ``Quantization.scratch``), where such a tensor is one more item,
  ``Fp8(format, wire, split=True)``. A relay forwards the
  finished codes and scales in stage 1 as tensors of their own: :class:`Plain` there.

Wire order: an item's bytes are row-major in canonical coordinates, but a 2-D tensor
whose every sender holds it transposed (a JAX ``[in, out]`` kernel of an ``[out, in]``
weight) travels as ``region.T`` row-major where it is a plain or cast item of a direct
call (:func:`wire_orders`, ``Formats.transposed``): a sender posts such a whole shard as
it is, and the receivers transpose while unpacking (the work spread over them, off the
trainer).

Framing: :data:`FIXED` (a message is as long as the schedule says) or :data:`SIZED` (a
delta call: a message's length depends on the data, so each is announced by a header one
group ahead of its payload).

Pure: imports only the IR and the planner (``tests/test_structure.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .quantize import Quantization

__all__ = ["Cast", "FIXED", "Format", "Formats", "Fp8", "Plain", "SIZED", "formats",
           "wire_orders"]

#: a message is as long as the schedule says
FIXED = "fixed"
#: a message's length is announced by a header one group ahead (a delta call)
SIZED = "sized"


@dataclass(frozen=True)
class Plain:
    """The source's bytes as they are."""


@dataclass(frozen=True)
class Cast:
    """Cast to ``wire`` by the sender at pack time (the receiver casts back if needed)."""

    wire: str


@dataclass(frozen=True)
class Fp8:
    """Quantized on the way into ``format`` (``xreshard.ir.formats``), from values in the
    dtype ``wire``; ``split``: some blocks finish on the receiver (its scratch stage)."""

    format: Any
    wire: str
    split: bool = False


Format = Plain | Cast | Fp8
PLAIN = Plain()


@dataclass(frozen=True)
class Formats:
    """Every item's format and the call's framing (see the module docstring)."""

    items: Mapping[tuple[str, int], Format]
    framing: str = FIXED
    quant: Quantization | None = None
    """The FP8 part: the tensors quantized on the way and this process's receivers'
    scratch (the split blocks' stage), None when nothing is."""
    counts: Mapping[str, int] = field(default_factory=dict)
    """How many ``(name, stage)`` items have each format kind ("plain", "cast", "fp8")."""
    transposed: frozenset[tuple[str, int]] = frozenset()
    """The ``(name, stage)`` whose 2-D items travel in their senders' storage order,
    ``region.T`` row-major (:func:`wire_orders`); every other item is row-major."""

    def item(self, name: str, stage: int = 0) -> Format:
        """The format of tensor ``name`` in ``stage``."""
        return self.items[(name, stage)]

    def fp8(self) -> dict[str, Any]:
        """``name -> QuantizedTensor`` of the items sent as FP8 (what the schedule sizes
        as scales + codes)."""
        if self.quant is None:
            return {}
        return {n: self.quant.tensors[n] for (n, stage), f in self.items.items()
                if isinstance(f, Fp8) and stage == 0}


def formats(stages: Sequence[Any], quant: Quantization | None, *, delta: bool = False,
            scratch_stage: int | None = None, transposed: frozenset[str] = frozenset()
            ) -> Formats:
    """The formats of a call's ``stages`` (each with a ``plan``): FP8 for stage 0's tensors
    ``quant`` quantizes on the way, else a cast where the plan's wire dtype differs from
    the source's, else plain; ``delta``: the call frames its messages :data:`SIZED`.
    ``scratch_stage``: the index of the call's scratch stage (its receivers finish split
    blocks there), where each tensor with split blocks is one more item,
    ``Fp8(format, wire, split=True)``. ``transposed``: the tensors to send in their
    senders' storage order (:func:`wire_orders`), kept for stage 0's plain and cast items
    of a direct call only (see there)."""
    items: dict[tuple[str, int], Format] = {}
    split = {name for (_, name), ss in (quant.scratch.items() if quant else ()) if ss}
    counts: dict[str, int] = {}
    for st in stages:
        plan = st.plan
        for name, src in plan.src_layouts.items():
            wire = plan.wire_dtypes[name]
            f: Format
            if quant is not None and st.index == 0 and name in quant.tensors:
                f = Fp8(quant.tensors[name].format, quant.wire[name], name in split)
            elif wire != src.dtype:
                f = Cast(wire)
            else:
                f = PLAIN
            items[(name, st.index)] = f
            kind = type(f).__name__.lower()
            counts[kind] = counts.get(kind, 0) + 1
    if quant is not None and scratch_stage is not None:
        for name in sorted(split):
            items[(name, scratch_stage)] = Fp8(quant.tensors[name].format, quant.wire[name],
                                               True)
            counts["fp8"] = counts.get("fp8", 0) + 1
    flipped = frozenset() if delta or len(stages) != 1 else frozenset(
        (name, 0) for name in transposed
        if isinstance(items.get((name, 0)), (Plain, Cast))
        and stages[0].plan.src_layouts[name].ndim == 2)
    return Formats(items, SIZED if delta else FIXED, quant, counts, flipped)


def wire_orders(claims: Mapping[str, Iterable[int]], plan: Any, topology: Any = None,
                canonical: bool = False) -> frozenset[str]:
    """The tensors a call sends in their senders' storage order: 2-D tensors every
    sending rank of which (every rank the source layout gives elements) holds its part
    transposed, ``[in, out]`` row-major (``claims``: name -> the ranks that say so, from
    every process's metadata: the same in every process, so is this), and whose
    receiving processes take no more of its wire bytes each than its busiest sending
    process sends (``plan``'s transfers between processes of ``topology``; None: every
    rank its own process).

    The wire order is a sender's choice the receivers follow, so it must be one order per
    tensor: a tensor some sender holds row-major keeps canonical row-major bytes, as does
    everything when ``canonical`` (a feature of the call checks the wire's bytes:
    ``CallOptions.canonical_wire``). The transposing copy moves to the receivers, so it
    is moved only where that spreads it (two receivers of one trainer process halve it)
    and never where it would gather it (eight trainer processes into one engine process
    keep it on the eight). :func:`formats` keeps it further only for plain and cast items
    of a direct call: FP8 blocks, delta encoding (a ``SIZED`` call) and a relay's stages
    keep row-major bytes.
    """
    if canonical or not claims:
        return frozenset()
    src_layouts = plan.src_layouts
    agreed = set()
    for name, ranks in claims.items():
        lay = src_layouts.get(name)
        if lay is None or lay.ndim != 2:
            continue
        said = set(ranks)
        holders = [r for r in lay.ranks if lay.num_elements(r)]
        if holders and all(r in said for r in holders):
            agreed.add(name)
    if not agreed:
        return frozenset()

    def process(rank: int) -> Any:
        p = None if topology is None else topology.process_of(rank)
        return ("rank", rank) if p is None else p

    sent: dict[str, dict[Any, int]] = {}
    received: dict[str, dict[Any, int]] = {}
    for t in plan.iter_transfers():
        if t.name in agreed:
            ps, pd = process(t.src), process(t.dst)
            if ps != pd:        # a copy inside a process has no wire order
                by = sent.setdefault(t.name, {})
                by[ps] = by.get(ps, 0) + t.nbytes
                by = received.setdefault(t.name, {})
                by[pd] = by.get(pd, 0) + t.nbytes
    return frozenset(n for n in agreed
                     if n in sent and max(received[n].values()) <= max(sent[n].values()))
