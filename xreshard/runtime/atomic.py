"""Transactional destinations (``RefitConfig(atomic=True)``): receive into staging, commit
only once every process agreed that the call succeeded.

Decision record. A refit that fails while moving leaves in-place destinations (torch
tensors, DTensor shards, a custom engine's :class:`~xreshard.runtime.binding.Bound`) half
new, half old; without ``atomic`` the refit says so (``Refit.stale``). With it, the call
receives into a shadow buffer per destination binding and copies the shadows into the
real destinations only after ``refit/outcome`` showed every process succeeded (and, with
``verify``, the checksums matched): a failed call never touched a destination byte, and
the version does not advance.

- The shadows are refreshed from the destinations at the start of every call (one copy),
  so a commit that copies whole buffers writes back the previous bytes where the call
  wrote nothing (a rank that holds a region on both sides, a binding whose padding no
  tensor covers). Copying only the regions the plan writes would save that copy but tie
  this module to the schedule's geometry; rejected for now (``TODO(cost)``).
- Memory: one extra buffer of this process's destination bytes, kept across calls (the
  cost of a warm second copy of the inference shards; on a GPU, device memory). Time:
  two device-local copies of those bytes per call (refresh and commit), at memory
  bandwidth (CPU: memcpy; GPU: a device copy, then one stream synchronize so consumers on
  any stream see the commit).
- Rejected: double-buffering by swapping pointers (the engine's tensors are the ones it
  runs; torch and vLLM keep references to them, so the bytes must land in them);
  journaling the old bytes and rolling back on failure (a process that dies mid-rollback,
  or fails to hear the outcome, leaves a mix: the commit-after-agreement order cannot).
- JAX destinations are new arrays built after a successful call (``Refit.received``),
  atomic already: they are not shadowed.

A commit is local copies after the agreement: it cannot fail for another process's sake.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .binding import Bound
from ..dtypes import bits, bits_dtype

__all__ = ["Staging", "left"]


def left(atomic: bool, version: int) -> str:
    """What a failed call left in the destinations, in its message."""
    if atomic:
        return f"destinations kept at v{version} (atomic)"
    return f"destination left stale at v{version}"


def _empty_like(a: Any) -> Any:
    """A C-contiguous buffer of ``a``'s shape and dtype on ``a``'s device. On a device
    it is allocated as unsigned ints and viewed as ``a``'s dtype: CuPy refuses to allocate
    a dtype it has no C type for (float8: ``check_supported_dtype``), views any."""
    if isinstance(a, np.ndarray):
        return np.empty(a.shape, a.dtype)
    import cupy         # a device binding: CuPy is how the executor sees it
    with a.device:
        return cupy.empty(a.shape, bits_dtype(a.dtype.itemsize)).view(a.dtype)


def _copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` as a copy of bits: CuPy has no copy kernel for float8 (nor
    bf16 before 14), and a bit copy is exact for every dtype."""
    if isinstance(dst, np.ndarray):
        dst[...] = src
        return
    with dst.device:
        bits(dst)[...] = bits(src)


def _arrays(binding: Any) -> list[Any]:
    return list(binding) if isinstance(binding, (list, tuple)) else [binding]


class Staging:
    """The shadows of one Refit's destination bindings in this process, kept across calls.

    ``stage(bound)`` returns a :class:`Bound` with the same layouts whose bindings are the
    shadows (refreshed from ``bound``); ``commit()`` copies them into ``bound``'s bindings.
    """

    def __init__(self) -> None:
        self._shadows: dict[tuple[int, str], list[Any]] = {}
        self._pending: list[tuple[Any, Any]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of staging held (the memory ``atomic`` costs in this process)."""
        return sum(int(s.nbytes) for shadows in self._shadows.values() for s in shadows)

    def stage(self, bound: Bound) -> Bound:
        """The destination ``bound`` with every binding replaced by its shadow, which
        holds the destination's current bytes."""
        shadowed: dict[tuple[int, str], Any] = {}
        pairs: list[tuple[Any, Any]] = []
        devices: set[Any] = set()
        kept: dict[tuple[int, str], list[Any]] = {}
        for key, binding in bound.bindings.items():
            real = _arrays(binding)
            old = self._shadows.get(key, [])
            shadows = [s if i < len(old) and _fits(old[i], r) else _empty_like(r)
                       for i, (s, r) in enumerate(zip(old + [None] * len(real), real))]
            for s, r in zip(shadows, real):
                _copy(s, r)
                pairs.append((r, s))
                if not isinstance(r, np.ndarray):
                    devices.add(r.device)
            kept[key] = shadows
            shadowed[key] = shadows if isinstance(binding, (list, tuple)) else shadows[0]
        self._shadows = kept        # destinations gone since the last call free theirs
        _synchronize(devices)
        self._pending = pairs
        return Bound(bound.layouts, shadowed, finish=bound.finish, errors=bound.errors,
                     local_only=bound.local_only)

    def commit(self) -> None:
        """Copy the staged bytes into the destinations (after every process agreed)."""
        pairs, self._pending = self._pending, None
        if not pairs:
            return
        devices: set[Any] = set()
        for real, shadow in pairs:
            _copy(real, shadow)
            if not isinstance(real, np.ndarray):
                devices.add(real.device)
        _synchronize(devices)

    def abandon(self) -> None:
        """Forget a failed call's staged bytes (the destinations were never touched)."""
        self._pending = None


def _fits(shadow: Any, real: Any) -> bool:
    return (shadow is not None and type(shadow) is type(real) and shadow.shape == real.shape
            and shadow.dtype == real.dtype
            and getattr(shadow, "device", None) == getattr(real, "device", None))


def _synchronize(devices: set[Any]) -> None:
    """Order the copies with every stream of their devices: the executor's streams after
    a refresh, the consumers' (any stream) after a commit."""
    for device in devices:
        with device:
            device.synchronize()
