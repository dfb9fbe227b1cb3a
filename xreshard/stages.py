"""The schedules a refit runs: rounds of half the staging budget when pipelining, and the
two stages of a relayed refit (``RefitConfig.relay``, see :mod:`xreshard.relay`).

Stage 1 sends across domains into views of the real destination memory; stage 2 forwards
inside domains what stage 1 brought. No barrier separates them: a pair that talked in
stage 1 continues its message numbers (tags) in stage 2, so a tag is never reused within a
call, and a forward leaves only once its sender's own stage 1 completed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .layout import Layout
from .plan import Plan, PlanCache, plan
from .schedule import Schedule, peer_counts, schedule

__all__ = ["Stages", "half_schedule", "stage2_schedule", "stages_of"]

logger = logging.getLogger(__name__)


class Stages:
    """A relayed refit: stage 1's plan into views of the real destination memory, stage 2's
    plan forwarding inside domains (None when nothing is forwarded)."""

    def __init__(self, dst_layouts: dict[str, Layout], layouts: Any, plan1: Plan,
                 plan2: Plan | None, bytes_gather_broadcast: int):
        self.dst_layouts = dst_layouts          # the real (merged) destination layouts
        self.layouts = layouts                  # relay.RelayLayouts
        self.plan1 = plan1
        self.plan2 = plan2
        self.bytes_gather_broadcast = bytes_gather_broadcast
        #: pipelined? -> (the stage-1 schedule it follows, the stage-2 schedule)
        self.schedules: dict[bool, tuple[Schedule, Schedule]] = {}

    def stage2(self, sched1: Schedule, pipeline: bool, ranks: list[int], bucket_bytes: int,
               staging_bytes: int) -> Schedule:
        """Stage 2's schedule after ``sched1`` (kept while stage 1's schedule is)."""
        got = self.schedules.get(pipeline)
        if got is None or got[0] is not sched1:
            assert self.plan2 is not None
            staging = staging_bytes // 2 if pipeline else staging_bytes
            got = self.schedules[pipeline] = (sched1, stage2_schedule(
                self.plan2, sched1, ranks, bucket_bytes, max(1, staging)))
        return got[1]


def stages_of(direct: Plan, world: Any, relay: str, wire_dtype: Any,
              cache: PlanCache) -> Stages | None:
    """The two plans of a relayed refit, or None for the direct plan: ``relay`` "off", or
    "auto" when nothing would be forwarded."""
    if relay == "off":
        return None
    from .relay import relay_layouts
    layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, world)
    if relay == "auto" and not layouts.forwards:
        return None
    plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology=world,
                 wire_dtype=wire_dtype, cache=cache)
    plan2 = plan(layouts.stage2_src, layouts.stage2_dst, topology=world,
                 cache=cache) if layouts.forwards else None
    logger.debug("refit relays %d bytes inside domains", layouts.bytes_relayed)
    return Stages(dict(direct.dst_layouts), layouts, plan1, plan2,
                  direct.stats.bytes_gather_broadcast)


def half_schedule(p: Plan, ranks: list[int], bucket_bytes: int, staging_bytes: int) -> Schedule:
    """The schedule of a pipelined call: two rounds share the staging budget, so rounds of
    half of it (every process picks the same: checked at refit/check)."""
    paired = {r for m in ranks for t in p.transfers_for(m) for r in (t.src, t.dst)}
    return schedule(p, list(ranks), peer_counts(p, sorted(paired)), bucket_bytes=bucket_bytes,
                    staging_bytes=max(1, staging_bytes // 2))


def stage2_schedule(plan2: Plan, sched1: Schedule, ranks: list[int], bucket_bytes: int,
                    staging_bytes: int) -> Schedule:
    """Stage 2's schedule for this process's ranks. A pair that also talked in stage 1
    continues its message numbers (tags) after stage 1's: no barrier separates the stages,
    so a tag is never reused within a call. Both ends of a pair see the pair's stage-1
    buckets, so they agree on the offset."""
    paired = {r for m in ranks for t in plan2.transfers_for(m) for r in (t.src, t.dst)}
    sched = schedule(plan2, ranks, peer_counts(plan2, sorted(paired)),
                     bucket_bytes=bucket_bytes, staging_bytes=staging_bytes)
    first: dict[tuple[int, int], int] = {}
    for rnd in sched1.rounds:
        for b in rnd:
            first[(b.src, b.dst)] = max(first.get((b.src, b.dst), 0), b.tag + 1)
    if not first:
        return sched
    rounds = tuple(tuple(dataclasses.replace(b, tag=b.tag + first.get((b.src, b.dst), 0))
                         for b in rnd) for rnd in sched.rounds)
    return Schedule(rounds, sched.local_copies, sched.max_round_bytes)
