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
                                  schedule: rounds of buckets,   (or the receivers'
                                    each naming its stage        scratch); refused at
                                  forwarded: {(name, stage)}     another epoch; one
                                  formats, scratch stage, epoch  executor, one run
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
* ``formats`` (the formats phase, :mod:`xreshard.planner.formats`): every ``(name,
  stage)`` item's format (``Plain``, ``Cast(wire)``, ``Fp8(format, wire, split)``) and the
  call's framing (``FIXED``, or ``SIZED`` for delta); ``formats.quant``, its FP8 part: the
  tensors quantized on the way in stage 0 and their receivers' scratch; a relayed call
  forwards their finished codes and scales in stage 1 as plain tensors
  (:mod:`xreshard.planner.relay`, "FP8 through a relay").
* ``scratch_stage``: the receivers' finishing of FP8 blocks split across senders (their
  pieces travel in stage 0 in the wire dtype into the receiver's scratch). A
  :class:`Stage` of index ``len(stages)`` whose sources are the receivers' scratch
  (:data:`SCRATCH`) and whose destinations are the codes and scales
  (:data:`DESTINATIONS`); the formats phase marks each split tensor as an item of it
  (``Fp8(..., split=True)``) and the schedule holds its work as same-rank copies of that
  stage (one per group of split blocks, no wire bytes), which the executor runs after
  every round, like a relay's forwards. None for a process without such a receiver.
  Kept apart from ``stages``, which are the plans that move bytes between ranks.
* ``forwarded``: the ``(name, stage)`` whose sends read what this call received (a relay's
  stage 1): the executor sends them only once the rounds that wrote them landed.
* ``epoch``: the membership epoch of the world the call was prepared for (``World.epoch``;
  None outside a world).
* wire dtypes per stage (``wire_dtype(name, stage)``): what a tensor is on the wire.

Extension points (how the next features slot in; none is a branch in ``Refit``):

* **Wire formats**: ``prepare`` is one path, plan -> relay stages -> formats -> scratch
  stage -> schedule; the formats phase gives every ``(name, stage)`` one format value and
  the call one framing, the schedule sizes items by it (FP8 items as scales + codes), and
  the runtime runs each as a codec (``xreshard.runtime.codecs``: the item's pack/unpack, a
  delta call's ``SIZED`` message codec). A new format is one more value here and one more
  codec there; a format whose receiver finishes what arrived (as split FP8 blocks) adds
  its work as copies of the scratch stage.
* **Membership epochs.** A prepared call is valid for one membership of the world: it
  carries that epoch (``PreparedCall.epoch``), and ``run`` refuses it in a world at
  another (:class:`EpochMismatch`, before any byte moves; every process of the world sees
  the same epochs, so every process refuses). The ``Refit`` that holds a call drops it
  (and its rank maps) when the world's epoch moves and prepares again at the next call.
* **New binding sources** go in :data:`BINDING_SOURCES` and where the runtime binds
  stages: ``metadata.stage_bindings`` for the call's two sides and views of them,
  ``execute.run`` for :data:`SCRATCH` (buffers the call owns, kept in its program cache).

Pure: imports only the IR and the rest of the planner (``tests/test_structure.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from ..errors import RefitError
from ..ir.layout import Layout
from .formats import Formats, formats, wire_orders
from .plan import Plan, PlanCache, plan
from .quantize import Quantization, quantization, value_layouts, with_scratch
from .relay import (RelayLayouts, fp8_forwards, overlapped_schedule, relay_layouts,
                    split_at_forwarders)
from .schedule import Copy, Schedule, paired_counts, schedule

__all__ = ["BINDING_SOURCES", "CallOptions", "DESTINATIONS", "DESTINATION_VIEWS",
           "EpochMismatch", "PreparedCall", "SCRATCH", "SOURCES", "Stage", "prepare"]

logger = logging.getLogger(__name__)

#: a stage side bound to the call's source bindings, as given
SOURCES = "sources"
#: a stage side bound to the call's destination bindings, as given
DESTINATIONS = "destinations"
#: a stage side bound to views of the call's destination memory, cut to the stage's layout
DESTINATION_VIEWS = "destination views"
#: a stage side bound to the receivers' scratch buffers of split FP8 blocks
#: (``Scratch.key`` -> a buffer in the wire dtype, kept with the call's program cache)
SCRATCH = "scratch"
BINDING_SOURCES = (SOURCES, DESTINATIONS, DESTINATION_VIEWS, SCRATCH)


class EpochMismatch(RefitError):
    """A prepared call runs in a world at another membership epoch than the one it was
    prepared for: its ranks, rank maps and schedule describe other members. Raised by
    ``run`` before any byte moves; prepare the call again (a ``Refit`` does so itself at
    its next call after the members changed)."""


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
    canonical_wire: bool = False
    """Every item's wire bytes row-major in canonical coordinates, whatever the senders'
    storage order (set by the extensions that check what crossed: verify, check_writes):
    no ``Formats.transposed`` (:func:`xreshard.planner.formats.wire_orders`)."""


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
    formats: Formats = Formats({})
    """Every ``(name, stage)`` item's format and the call's framing (the formats phase,
    :mod:`xreshard.planner.formats`)."""
    scratch_stage: Stage | None = None
    """The receivers' finishing of split FP8 blocks (index ``len(stages)``; sources: their
    :data:`SCRATCH`, destinations: the codes and scales), run as the schedule's same-rank
    copies of that stage once every round landed; None when no local receiver has any."""
    epoch: int | None = None
    """The membership epoch of the world this call was prepared for (``World.epoch``):
    ``run`` refuses it in a world at another epoch. None: not tied to one (a call prepared
    outside a world, e.g. by a test or a simulation)."""

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

    def check_epoch(self, epoch: int | None) -> None:
        """Refuse to run in a world at membership epoch ``epoch`` when this call was
        prepared for another (either None: nothing to compare).

        Raises:
            EpochMismatch: the epochs differ.
        """
        if self.epoch is not None and epoch is not None and epoch != self.epoch:
            raise EpochMismatch(
                f"this call was prepared for membership epoch {self.epoch} of its world, "
                f"which is now at epoch {epoch} (its members changed): its ranks and "
                f"schedule describe the old members; nothing was moved. Prepare the call "
                f"again for the current members")


def prepare(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
            topology: Any = None, options: CallOptions = CallOptions(), *,
            ranks: Iterable[int], cache: PlanCache | None = None,
            quantized: Mapping[str, Any] | None = None, epoch: int | None = None,
            stored_transposed: Mapping[str, Iterable[int]] | None = None) -> PreparedCall:
    """Prepare one refit call for the local ranks ``ranks``: plan, relay stages, formats,
    schedule (one path for every call: a quantized destination is planned as its values,
    :mod:`xreshard.planner.quantize`, and its format is FP8).

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
        epoch: the membership epoch of the world the call is for (``World.epoch``), kept
            in :attr:`PreparedCall.epoch`; None: not tied to one.
        stored_transposed: name -> the sending ranks that hold their part of the 2-D
            tensor transposed (``[in, out]`` row-major), from every process's metadata:
            where all its senders do (and its receivers spread the transposing), its plain
            and cast items travel in that order
            (:func:`xreshard.planner.formats.wire_orders`); None: every item row-major.

    Returns:
        The :class:`PreparedCall`.

    Raises:
        PlanError: the layouts do not fit together (see :func:`xreshard.planner.plan.plan`).
        FormatError: a quantized destination cannot take what is offered to it.
    """
    ranks = tuple(sorted(set(ranks)))
    quant = quantization(src_layouts, dst_layouts, quantized or {}, options.wire_dtype)
    # plan: a quantized destination as the values its codes are quantized from
    direct = plan(src_layouts, dst_layouts if quant is None else value_layouts(dst_layouts, quant),
                  topology, wire_dtype=options.wire_dtype, cache=cache)
    # relay stages
    relayed = _relay_stages(direct, topology, options, cache, quant) \
        if options.relay != "off" else None
    layouts: RelayLayouts | None = None
    stages: tuple[Stage, ...] = (Stage(0, direct, SOURCES, DESTINATIONS),)
    src2: Mapping[str, Layout] = {}
    if relayed is not None:
        layouts, stages, src2 = relayed
    # formats: every (name, stage) item's, the FP8 ones' scratch for this process
    q = with_scratch(quant, stages[0].plan, ranks)
    if q is not None and len(stages) > 1:
        scales = {qt.scale for qt in q.tensors.values()}
        forwarded_fp8 = sum(t.nbytes for t in stages[1].plan.iter_transfers()
                            if t.name in q.tensors or t.name in scales)
        q = Quantization(q.tensors, q.codes, q.scales, q.wire, q.scratch,
                         {**q.totals, "fp8_forwarded_world": forwarded_fp8})
    # the scratch stage: this process's receivers finish their split blocks
    scratch_stage = None
    if q is not None and any(q.scratch.values()):
        scratch_stage = Stage(len(stages), stages[0].plan, SCRATCH, DESTINATIONS)
    orders = wire_orders(stored_transposed or {}, direct, topology,
                         options.canonical_wire or relayed is not None)
    fmts = formats(stages, q, delta=options.delta,
                   scratch_stage=None if scratch_stage is None else scratch_stage.index,
                   transposed=orders)
    # schedule: items sized by their format
    staging = max(1, options.staging_bytes // 2) if options.halved else options.staging_bytes
    sizes: dict[str, Any] = dict(bucket_bytes=options.bucket_bytes, staging_bytes=staging,
                                 quantized=fmts.fp8() or None)
    if len(stages) == 1:
        plan1 = stages[0].plan
        sched = schedule(plan1, ranks, paired_counts(plan1, ranks), **sizes)
    else:
        assert layouts is not None
        logger.debug("refit relays %d bytes inside domains", layouts.bytes_relayed)
        sched = overlapped_schedule(stages[0].plan, stages[1].plan, ranks,
                                    overlap=options.relay_overlap,
                                    lag=2 if options.delta else 1, **sizes)
    if scratch_stage is not None:
        assert q is not None
        sched = replace(sched, local_copies=sched.local_copies
                        + _finishing(q, scratch_stage.index))
    return PreparedCall(options, ranks, direct, stages, layouts, sched,
                        frozenset((name, 1) for name in src2), fmts, scratch_stage, epoch)


def _finishing(q: Quantization, stage: int) -> tuple[Copy, ...]:
    """The scratch stage's work: per group of split blocks a receiver gathered in its
    scratch, a same-rank copy of ``stage`` quantizing the group's whole blocks from the
    scratch into the codes and scales (no wire bytes: ``nbytes`` 0)."""
    out = []
    for (rank, name), ss in q.scratch.items():
        qt = q.tensors[name]
        for s in ss:
            for blocks in s.blocks:
                out.append(Copy(name, qt.format.data_region(blocks, qt.shape), rank, 0,
                                stage, True))
    return tuple(out)


def _relay_stages(direct: Plan, topology: Any, options: CallOptions,
                  cache: PlanCache | None, quant: Quantization | None
                  ) -> tuple[RelayLayouts, tuple[Stage, ...], Mapping[str, Layout]] | None:
    """A relayed call's stages (``options.relay`` "on" or "auto"), with stage 1's sources
    (what is forwarded), or None when the call goes direct: "auto" with nothing to forward,
    or a call with quantized destinations where nothing would be forwarded.

    Stage 0 runs from the sources to views of the destination memory, across domains;
    stage 1 forwards inside domains. Quantized destinations relay along whole blocks: stage
    0 quantizes on the way into pieces cut along whole blocks, and stage 1 forwards the
    forwarders' finished codes and scales as they are, as tensors of their own, so a
    replica's bytes are its forwarder's, which are the quantizer's. A tensor whose
    forwarded blocks a forwarder would receive split across senders (it quantizes those only
    after every round) is not relayed: see :mod:`xreshard.planner.relay`, "FP8 through a
    relay"."""
    kw: dict[str, Any] = dict(wire_dtype=options.wire_dtype, cache=cache)
    if quant is None:
        layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology)
        if options.relay == "auto" and not layouts.forwards:
            return None
        plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology, **kw)
        stage0 = Stage(0, plan1, SOURCES, DESTINATION_VIEWS)
        if not layouts.forwards:
            return layouts, (stage0,), {}
        src2, dst2 = layouts.stage2_src, layouts.stage2_dst
    else:
        blocks = {n: qt.format.block_shape(len(qt.shape)) for n, qt in quant.tensors.items()}
        layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology,
                                blocks=blocks)
        plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology, **kw)
        split = split_at_forwarders(quant.tensors, plan1, layouts)
        if split:
            logger.debug("not relayed (blocks split at a forwarder): %s", sorted(split))
            layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, topology,
                                    blocks=blocks, direct=split)
            plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology, **kw)
        if not layouts.forwards:
            return None
        stage0 = Stage(0, plan1, SOURCES, DESTINATION_VIEWS)
        src2, dst2 = fp8_forwards(layouts, quant.tensors)
    plan2 = plan(src2, dst2, topology, cache=cache)
    return layouts, (stage0, Stage(1, plan2, DESTINATION_VIEWS, DESTINATION_VIEWS)), src2
