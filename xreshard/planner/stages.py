"""The plans a refit runs: rounds of half the staging budget when pipelining, and the two
plans of a relayed refit (``RefitConfig.relay``, see :mod:`xreshard.planner.relay`).

Stage 1 sends across domains into views of the real destination memory; stage 2 forwards
inside domains what stage 1 brought. ``relay.overlapped_schedule`` merges both into one
schedule, each forward in the first round after the stage-1 rounds that land its bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from ..ir.layout import Layout
from .plan import Plan, PlanCache, plan
from .schedule import Schedule, peer_counts, schedule

__all__ = ["Stages", "half_schedule", "stages_of"]

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
