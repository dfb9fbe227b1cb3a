"""Pausing Python's cyclic garbage collector for the length of a refit call (nested and
across threads), split from :mod:`xreshard.runtime.execute` (which re-exports it)."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

__all__ = ["gc_paused"]


_GC_LOCK = threading.Lock()
_GC_STATE = [0, False]      # nesting depth, whether the collector was on at the first entry


@contextlib.contextmanager
def gc_paused(enabled: bool = True) -> Any:
    """Pause Python's cyclic garbage collector for a block (nested and threads: the last to
    leave restores it).

    A refit call allocates ~100 short-lived objects per tensor (views, slices, tuples);
    with thousands of tensors that triggers collections that traverse the whole heap of the
    process (a JAX or torch process holds millions of objects): measured, about half of a
    3,000-tensor call. Nothing the block allocates is cyclic garbage, and what it leaves is
    collected at the collector's next turn after the block. The collector is per process:
    while a refit started with ``Refit.start`` runs, the caller's own cyclic garbage waits
    for the refit's end too (reference counting still frees everything else).

    Args:
        enabled: False runs the block with the collector as it is (``Tuning.pause_gc``).
    """
    if not enabled:
        yield
        return
    with _GC_LOCK:
        if _GC_STATE[0] == 0:
            _GC_STATE[1] = gc.isenabled()
            gc.disable()
        _GC_STATE[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_STATE[0] -= 1
            if _GC_STATE[0] == 0 and _GC_STATE[1]:
                gc.enable()
