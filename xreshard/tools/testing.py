"""Test helpers: run a plan with every rank in one process, and the multi-process launcher.

``launch(fn, [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0)])``
runs ``fn(ctx)`` in fresh processes of mixed roles, collects their JSON results and
tracebacks, and kills everything at the timeout (see :mod:`xreshard.tools.launch`); roles with
``gpus=`` pin one GPU set per process for multi-GPU pytest runs.

``run_local`` executes a plan on numpy local arrays exactly as the real executor moves
regions (from the sender's local array to the receiver's, located through the layouts),
never assembling a global array, so planner tests check bytes, not just counts.

``ColdMemo`` is a layout memo that remembers nothing and hands out cold twins (benchmarks
and tests measure what the memo and interning save with it).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping

import numpy as np

from ..dtypes import numpy_dtype
from ..ir.layout import Layout, LayoutMemo, Region
from ..planner.plan import Plan
from ..runtime.copies import view_of

from .launch import Context, LaunchError, LaunchTimeout, Result, Role, launch  # noqa: E402

__all__ = ["ColdMemo", "Context", "LaunchError", "LaunchTimeout", "Result", "Role", "launch",
           "local_arrays_from_global", "numpy_dtype", "run_local"]


class ColdMemo(LayoutMemo):
    """A layout memo that remembers nothing: every ``get`` builds anew and hands out an
    equal layout outside the intern tables, its caches cold (what building a layout cost
    before interning and the memo). Give it to a refit (``refit.layout_memo = ColdMemo()``)
    or an adapter's bind to measure what they save."""

    def get(self, key: Any, make: Any) -> Layout:
        return make()._uninterned()


def _poisoned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array whose bytes are all 0xA5, so an element nobody writes is noticed."""
    return np.full(math.prod(shape) * dtype.itemsize, 0xA5, np.uint8).view(dtype).reshape(shape)


def _storage(layout: Layout, rank: int, dtype: np.dtype) -> Any:
    if layout.is_product:
        return _poisoned(layout.local_shape(rank), dtype)
    return [_poisoned(r.shape, dtype) for r in layout.regions(rank)]


def local_arrays_from_global(layout: Layout, rank: int, global_array: np.ndarray) -> Any:
    """What ``rank`` holds of ``global_array`` under ``layout`` (to build test inputs)."""
    if layout.is_product:
        per_dim = layout.dim_intervals(rank)
        if per_dim is None:
            return np.empty(tuple(0 for _ in layout.shape), global_array.dtype)
        idx = [np.concatenate([np.arange(s, e) for s, e in ivs]) if ivs else np.arange(0)
               for ivs in per_dim]
        return global_array[np.ix_(*idx)] if idx else global_array.copy()
    return [global_array[r.slices()].copy() for r in layout.regions(rank)]


def run_local(plan: Plan, sources: Mapping[int, Mapping[str, Any]],
              check_senders: bool = True) -> dict[int, dict[str, Any]]:
    """Execute ``plan`` with every rank in this process.

    Args:
        plan: the plan.
        sources: ``sources[rank][name]`` is a source rank's local array (a list of arrays,
            one per region, for explicit-form layouts).
        check_senders: also derive every transfer from the senders' side and check both
            sides agree (what the real executor relies on).

    Returns:
        ``{dst rank: {name: local array}}`` for every destination rank.
    """
    dst_ranks = sorted({r for name in plan.names for r in plan.dst_layouts[name].ranks})
    out: dict[int, dict[str, Any]] = {}
    for rank in dst_ranks:
        out[rank] = {}
        for name in plan.names:
            layout = plan.dst_layouts[name]
            if rank in layout.ranks:
                out[rank][name] = _storage(layout, rank, numpy_dtype(layout.dtype))
    received: Counter[tuple[str, Region, int, int]] = Counter()
    for rank in dst_ranks:
        moves = [t for t in plan.transfers_for(rank) if t.dst == rank]
        moves += plan.local_copies_for(rank)
        for t in moves:
            assert t.src != t.dst or t in plan.local_copies_for(rank)
            src_view = view_of(sources[t.src][t.name], plan.src_layouts[t.name], t.src, t.region)
            dst_layout = plan.dst_layouts[t.name]
            wire = numpy_dtype(plan.wire_dtypes[t.name])
            data = src_view.astype(wire, copy=False).astype(numpy_dtype(dst_layout.dtype),
                                                            copy=False)
            view_of(out[rank][t.name], dst_layout, rank, t.region)[...] = data
            if t.src != t.dst:
                received[(t.name, t.region, t.src, t.dst)] += 1
    if check_senders:
        sent: Counter[tuple[str, Region, int, int]] = Counter()
        src_ranks = sorted({r for name in plan.names for r in plan.src_layouts[name].ranks})
        for rank in src_ranks:
            for t in plan.transfers_for(rank):
                if t.src == rank:
                    assert t.dst != rank, f"rank {rank} sends to itself: {t}"
                    sent[(t.name, t.region, t.src, t.dst)] += 1
        if sent != received:
            raise AssertionError(f"senders and receivers disagree: only sent "
                                 f"{list((sent - received).items())[:5]}, only received "
                                 f"{list((received - sent).items())[:5]}")
    return out
