"""xreshard: weight refit between differently sharded jobs, shard to shard.

Importing this package imports numpy only; framework bridges live in ``xreshard.adapters``
and import their framework when used.
"""

from .errors import (AuthenticationError, BindingError, CollectiveMismatch, CommunicationError,
                     LayoutError, PlanError, RefitError, TransportError, TransportTimeout,
                     VerificationError, WorldBroken, WorldMismatch, XreshardError)
from .ir.layout import Layout, Mesh, Region, Split
from .planner.plan import Plan, PlanCache, PlanStats, Transfer, plan
from .runtime.binding import Bound, Rebuilt
from .runtime.commcount import CommCounts, count_comm
from .runtime.refit import Refit, RefitConfig, RefitReport, Tuning
from .ir.topology import Topology
from .runtime.world import StoreServer, World, serve

__all__ = [
    "AuthenticationError", "BindingError", "CollectiveMismatch", "CommunicationError",
    "TransportError", "TransportTimeout", "VerificationError", "WorldBroken", "WorldMismatch",
    "Bound", "CommCounts", "Layout", "LayoutError", "Mesh", "Plan", "PlanCache", "PlanError",
    "PlanStats",
    "Rebuilt", "Refit", "RefitConfig", "RefitError", "RefitReport", "Region", "Split",
    "StoreServer",
    "Topology", "Transfer", "Tuning", "World", "XreshardError", "count_comm", "plan", "serve",
]
__version__ = "0.1.0"
