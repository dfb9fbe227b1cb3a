"""xreshard: weight refit between differently sharded jobs, shard to shard.

Importing this package imports numpy only; framework bridges live in ``xreshard.adapters``
and import their framework when used.
"""

from .errors import (AuthenticationError, BindingError, CollectiveMismatch, CommunicationError,
                     LayoutError, PlanError, RefitError, TransportError, TransportTimeout,
                     VerificationError, WorldBroken, XreshardError)
from .layout import Layout, Mesh, Region, Split
from .plan import Plan, PlanCache, PlanStats, Transfer, plan
from .binding import Bound
from .commcount import CommCounts, count_comm
from .refit import Refit, RefitConfig, RefitReport
from .topology import Topology
from .world import StoreServer, World, serve

__all__ = [
    "AuthenticationError", "BindingError", "CollectiveMismatch", "CommunicationError",
    "TransportError", "TransportTimeout", "VerificationError", "WorldBroken",
    "Bound", "CommCounts", "Layout", "LayoutError", "Mesh", "Plan", "PlanCache", "PlanError", "PlanStats",
    "Refit", "RefitConfig", "RefitError", "RefitReport", "Region", "Split", "StoreServer",
    "Topology", "Transfer", "World", "XreshardError", "count_comm", "plan", "serve",
]
__version__ = "0.1.0"
