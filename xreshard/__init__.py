"""xreshard: weight refit between differently sharded jobs, shard to shard.

Importing this package imports numpy only; framework bridges live in ``xreshard.adapters``
and import their framework when used.
"""

from .errors import LayoutError, PlanError, RefitError, XreshardError
from .layout import Layout, Mesh, Region, Split
from .plan import Plan, PlanCache, PlanStats, Transfer, plan
from .topology import Topology

__all__ = [
    "Layout", "LayoutError", "Mesh", "Plan", "PlanCache", "PlanError", "PlanStats", "RefitError",
    "Region", "Split", "Topology", "Transfer", "XreshardError", "plan",
]
__version__ = "0.1.0"
