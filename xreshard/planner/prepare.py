"""A prepared call: everything one refit call will run, decided before any byte moves.

``prepare`` is a pure function of values (layouts, a topology, options, the ranks it
prepares for) and returns one immutable :class:`PreparedCall`; the runtime runs it
(``xreshard.runtime.execute.run``) against bindings, a transport, staging and a cache of
pack programs that its owner (a ``Refit``) keeps. The same inputs give the same call in
every process, so no plan or schedule ever crosses processes.

```
 src_layouts, dst_layouts ──┐
 topology (hosts, processes)├─ prepare() ─> PreparedCall ─> run(prepared, bindings, ...)
 CallOptions, ranks         ┘     direct plan                  stage bindings: sources,
                                  stages: (plan, where its       destinations, or views
                                    bindings come from), ...     of the destinations
                                  schedule: rounds of buckets,   one executor, one run
                                    each naming its stage
                                  forwarded: {(name, stage)}
```

What it holds:

* ``direct``: the plan from the real sources to the real destinations (its layouts are
  what the runtime fits bindings to; its statistics are the call's).
* ``stages``: the plans the call runs, in order. A direct call has one stage, the direct
  plan. A relayed call (``relay="on"``/``"auto"``, see :mod:`xreshard.planner.relay`)
  has stage 0 (sources -> views of the destination memory, across domains) and, when
  anything is forwarded, stage 1 (views of what stage 0 wrote -> views of the rest of the
  destination memory, inside domains). Each :class:`Stage` says where its two sides'
  bindings come from (:data:`SOURCES`, :data:`DESTINATIONS`, :data:`DESTINATION_VIEWS`),
  so the runtime binds every stage the same way.
* ``schedule``: this process's buckets over all stages, by round. Every bucket and
  same-rank copy carries its ``stage``; a tensor is keyed by ``(name, stage)``, never
  renamed. Which schedule: full rounds (``rounds`` executor, or a process with device
  bindings), rounds of half of ``staging_bytes`` (``halved``: the pipelined host
  executor keeps two rounds in flight), or the overlapped relay schedule (either size).
* ``quant``: the tensors quantized on the way in stage 0 and their receivers' scratch; a
  relayed call forwards their finished codes and scales in stage 1 as plain tensors
  (:mod:`xreshard.planner.relay`, "FP8 through a relay").
* ``forwarded``: the ``(name, stage)`` whose sends read what this call received (a relay's
  stage 1): the executor sends them only once the rounds that wrote them landed.
* wire dtypes per stage (``wire_dtype(name, stage)``): what a tensor is on the wire.

Extension points (how the next stages slot in; none is a branch in ``Refit``):

* **Wire formats.** Today a tensor's wire format is a dtype (a cast on the sender at pack
  time). A quantized format (FP8 blocks with scales, quantized on the sender or the
  receiver) or a delta encoding becomes a per-``(name, stage)`` format value next to the
  wire dtype: ``prepare`` decides it from the options, the schedule sizes items by its
  wire bytes, and the runtime's pack/unpack programs dispatch on it (encode at pack,
  decode at unpack). Where a format needs a pass of its own (a receiver-side dequantize
  into the final memory), it is one more :class:`Stage` whose destination bindings come
  from a new binding source (e.g. ``"scratch"``), run by the same executor.
* **Membership epochs.** A prepared call is valid for one membership of the world: an
  epoch field (the world's membership epoch it was prepared for) lets ``run`` refuse a
  stale call, and the ``Refit`` prepares again when the epoch moves, as it does today
  when a layout changes.
* **New binding sources** go in :data:`BINDING_SOURCES` and in the runtime's
  ``stage_bindings`` (one function), nowhere else.

Pure: imports only the IR and the rest of the planner (``tests/test_structure.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..ir.layout import Layout
from .plan import Plan, PlanCache, plan
from .quantize import Quantization, quantization, value_layouts, with_scratch
from .relay import (RelayLayouts, fp8_forwards, overlapped_schedule, relay_layouts,
                    split_at_forwarders)
from .schedule import Schedule, paired_counts, schedule

__all__ = ["BINDING_SOURCES", "CallOptions", "DESTINATIONS", "DESTINATION_VIEWS",
           "PreparedCall", "SOURCES", "Stage", "prepare"]

logger = logging.getLogger(__name__)

#: a stage side bound to the call's source bindings, as given
SOURCES = "sources"
#: a stage side bound to the call's destination bindings, as given
DESTINATIONS = "destinations"
#: a stage side bound to views of the call's destination memory, cut to the stage's layout
DESTINATION_VIEWS = "destination views"
BINDING_SOURCES = (SOURCES, DESTINATIONS, DESTINATION_VIEWS)


@dataclass(frozen=True)
class CallOptions:
    """What shapes a prepared call besides the layouts: the planning parts of
    ``RefitConfig`` and the processes' agreed ``Tuning``. Every process of a call must
    prepare with equal options."""

    bucket_bytes: int = 64 << 20
    """The most bytes in one message (``RefitConfig.bucket_bytes``)."""
    staging_bytes: int = 256 << 20
    """The most bytes one rank has in flight in one round (``RefitConfig.staging_bytes``)."""
    wire_dtype: Any = None
    """``RefitConfig.wire_dtype``: one dtype, a mapping name -> dtype, or None."""
    relay: str = "off"
    """``RefitConfig.relay``: "off", "on" or "auto"."""
    relay_overlap: bool = True
    """``Tuning.relay_overlap``: forwards overlap arrivals (False: stages back to back)."""
    halved: bool = False
    """Rounds of half of ``staging_bytes``: every process runs the pipelined host executor,
    which keeps two rounds in flight."""
    delta: bool = False
    """``RefitConfig.delta``: a relay's forwards run two rounds after their bytes arrive,
    not one (a forwarder encodes them from landed bytes, see :mod:`xreshard.planner.relay`)."""


@dataclass(frozen=True)
class Stage:
    """One plan of a call and where its bindings come from (see the module docstring)."""

    index: int
    plan: Plan
    src_from: str
    """Where the sending side's bindings come from: one of :data:`BINDING_SOURCES`."""
    dst_from: str
    """Where the receiving side's bindings come from: one of :data:`BINDING_SOURCES`."""

    def __post_init__(self) -> None:
        for side in (self.src_from, self.dst_from):
            assert side in BINDING_SOURCES, side

    @property
    def src_layouts(self) -> Mapping[str, Layout]:
        return self.plan.src_layouts

    @property
    def dst_layouts(self) -> Mapping[str, Layout]:
        return self.plan.dst_layouts

    @property
    def wire_dtypes(self) -> Mapping[str, str]:
        return self.plan.wire_dtypes


@dataclass(frozen=True)
class PreparedCall:
    """Everything one refit call runs, for the local ranks ``ranks`` (see the module
    docstring). Immutable; built by :func:`prepare`."""

    options: CallOptions
    ranks: tuple[int, ...]
    direct: Plan
    """The plan from the real sources to the real destinations."""
    stages: tuple[Stage, ...]
    relay: RelayLayouts | None
    """The relay's stage layouts (``options.relay`` not "off" and relaying), else None."""
    schedule: Schedule
    forwarded: frozenset[tuple[str, int]]
    quant: Quantization | None = None
    """The stage-0 tensors quantized on the way (:mod:`xreshard.planner.quantize`), with
    this process's receivers' scratch buffers; None when nothing is."""

    @property
    def plan(self) -> Plan:
        """The first stage's plan (the direct plan when nothing relays)."""
        return self.stages[0].plan

    @property
    def bytes_moved(self) -> int:
        """Bytes every stage moves between ranks, over the whole world."""
        return sum(s.plan.stats.bytes_moved for s in self.stages)

    def wire_dtype(self, name: str, stage: int = 0) -> str:
        """The dtype tensor ``name`` of ``stage`` has on the wire."""
        return self.stages[stage].plan.wire_dtypes[name]


def prepare(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
            topology: Any = None, options: CallOptions = CallOptions(), *,
            ranks: Iterable[int], cache: PlanCache | None = None,
            quantized: Mapping[str, Any] | None = None) -> PreparedCall:
    """Prepare one refit call for the local ranks ``ranks``.

    Args:
        src_layouts / dst_layouts: ``{tensor name: Layout}`` of each side (merged over
            every process: the same in every process).
        topology: a ``Topology`` (or anything with ``process_of`` / ``host_of``), or None
            (every rank its own host and process: nothing relays).
        options: the :class:`CallOptions`.
        ranks: the world ranks whose buckets the schedule holds (a process's own; every
            rank of the world for a whole-world replay).
        cache: plan templates to reuse across calls (``PlanCache``).
        quantized: name -> ``QuantizedTensor`` of the destinations stored quantized (the
            codes under the name, the scales under its ``scale``); those a sender offers
            unquantized are quantized on the way (:mod:`xreshard.planner.quantize`).

    Returns:
        The :class:`PreparedCall`.

    Raises:
        PlanError: the layouts do not fit together (see :func:`xreshard.planner.plan.plan`).
        FormatError: a quantized destination cannot take what is offered to it.
    """
    ranks = tuple(sorted(set(ranks)))
    quant = quantization(src_layouts, dst_layouts, quantized or {}, options.wire_dtype)
    if quant is not None:
        return _prepare_quantized(src_layouts, dst_layouts, topology, options, ranks, cache,
                                  quant)
    direct = plan(src_layouts, dst_layouts, topology, wire_dtype=options.wire_dtype,
                  cache=cache)
    staging = max(1, options.staging_bytes // 2) if options.halved else options.staging_bytes
    sizes: dict[str, Any] = dict(bucket_bytes=options.bucket_bytes, staging_bytes=staging)
    layouts = None
    if options.relay != "off":
        layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology)
        if options.relay == "auto" and not layouts.forwards:
            layouts = None
    if layouts is None:
        stages: tuple[Stage, ...] = (Stage(0, direct, SOURCES, DESTINATIONS),)
        sched = schedule(direct, ranks, paired_counts(direct, ranks), **sizes)
        return PreparedCall(options, ranks, direct, stages, None, sched, frozenset())
    plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology,
                 wire_dtype=options.wire_dtype, cache=cache)
    stages = (Stage(0, plan1, SOURCES, DESTINATION_VIEWS),)
    if not layouts.forwards:
        sched = schedule(plan1, ranks, paired_counts(plan1, ranks), **sizes)
        return PreparedCall(options, ranks, direct, stages, layouts, sched, frozenset())
    plan2 = plan(layouts.stage2_src, layouts.stage2_dst, topology, cache=cache)
    stages += (Stage(1, plan2, DESTINATION_VIEWS, DESTINATION_VIEWS),)
    logger.debug("refit relays %d bytes inside domains", layouts.bytes_relayed)
    sched = overlapped_schedule(plan1, plan2, ranks, overlap=options.relay_overlap,
                                lag=2 if options.delta else 1, **sizes)
    forwarded = frozenset((name, 1) for name in layouts.stage2_src)
    return PreparedCall(options, ranks, direct, stages, layouts, sched, forwarded)


def _prepare_quantized(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                       topology: Any, options: CallOptions, ranks: tuple[int, ...],
                       cache: PlanCache | None, quant: Quantization) -> PreparedCall:
    """A call whose quantized destinations are planned as their values (see
    :mod:`xreshard.planner.quantize`): the scheduler cuts their transfers into quantized
    whole blocks and the rest. Relayed (``options.relay``) when some domain forwards."""
    direct = plan(src_layouts, value_layouts(dst_layouts, quant), topology,
                  wire_dtype=options.wire_dtype, cache=cache)
    staging = max(1, options.staging_bytes // 2) if options.halved else options.staging_bytes
    if options.relay != "off":
        relayed = _relay_quantized(direct, topology, options, ranks, cache, quant, staging)
        if relayed is not None:
            return relayed
    sched = schedule(direct, ranks, paired_counts(direct, ranks),
                     bucket_bytes=options.bucket_bytes, staging_bytes=staging,
                     quantized=quant.tensors)
    return PreparedCall(options, ranks, direct, (Stage(0, direct, SOURCES, DESTINATIONS),),
                        None, sched, frozenset(), with_scratch(quant, direct, ranks))


def _relay_quantized(direct: Plan, topology: Any, options: CallOptions,
                     ranks: tuple[int, ...], cache: PlanCache | None, quant: Quantization,
                     staging: int) -> PreparedCall | None:
    """The relayed call of a refit with quantized destinations, or None when nothing would
    be forwarded (the direct call then). Stage 1 quantizes on the way as a direct call
    does, into pieces cut along whole blocks; stage 2 forwards the forwarders' finished
    codes and scales as they are, as tensors of their own (``quant.codes`` and
    ``quant.scales`` dtypes), so a replica's bytes are its forwarder's, which are the
    quantizer's. A tensor whose forwarded blocks a forwarder would receive split across
    senders (it quantizes those only after every round) is not relayed: see
    :mod:`xreshard.planner.relay`, "FP8 through a relay"."""
    blocks = {n: qt.format.block_shape(len(qt.shape)) for n, qt in quant.tensors.items()}
    kw: dict[str, Any] = dict(wire_dtype=options.wire_dtype, cache=cache)
    layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology, blocks=blocks)
    plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology, **kw)
    split = split_at_forwarders(quant.tensors, plan1, layouts)
    if split:
        logger.debug("not relayed (blocks split at a forwarder): %s", sorted(split))
        layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology,
                                blocks=blocks, direct=split)
        plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology, **kw)
    if not layouts.forwards:
        return None
    src2, dst2 = fp8_forwards(layouts, quant.tensors)
    plan2 = plan(src2, dst2, topology, cache=cache)
    sched = overlapped_schedule(plan1, plan2, ranks, overlap=options.relay_overlap,
                                lag=2 if options.delta else 1, quantized=quant.tensors,
                                bucket_bytes=options.bucket_bytes, staging_bytes=staging)
    q = with_scratch(quant, plan1, ranks)
    assert q is not None        # quant is not None here, nor is its scratch
    scales = {qt.scale for qt in quant.tensors.values()}
    forwarded_fp8 = sum(t.nbytes for t in plan2.iter_transfers()
                        if t.name in quant.tensors or t.name in scales)
    q = Quantization(q.tensors, q.codes, q.scales, q.wire, q.scratch,
                     {**q.totals, "fp8_forwarded_world": forwarded_fp8})
    stages = (Stage(0, plan1, SOURCES, DESTINATION_VIEWS),
              Stage(1, plan2, DESTINATION_VIEWS, DESTINATION_VIEWS))
    return PreparedCall(options, ranks, direct, stages, layouts, sched,
                        frozenset((name, 1) for name in src2), q)
