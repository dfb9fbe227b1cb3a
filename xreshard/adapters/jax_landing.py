"""Where a receiving JAX refit lands each shard: host buffers that JAX adopts without a
copy, recycled across calls once nothing but the refit holds them.

Decision record (issue 35, the one-process JAX refit against ``jax.device_put``):

* A received shard is written into a 64-byte aligned numpy buffer, and
  ``jax.device_put(buffer, cpu_device)`` adopts that buffer as the array's memory (JAX
  0.10 on CPU: the same address, no copy). JAX keeps a Python reference on the numpy
  owner for as long as its buffer lives, and drops it when the buffer is freed; it has to,
  or numpy would free memory under it. That reference is what tells a free buffer here.
* A fresh buffer costs its page faults when first written: 8 ms per 32 MiB on this host
  (4 GB/s, the kernel zeroing each page), 0.9 ms to write the same bytes again. On a
  loaded machine a fresh 2 MiB page can take far longer (``bench_peers``' slow reps). So a
  :class:`Landing` keeps the owners it handed to JAX in its last two calls, and the next
  call lands in one whose only reference is the Landing's own: its arrays were deleted or
  dropped (every view of one, every DLPack capsule and every pending computation holds the
  JAX buffer, which holds the owner), so no live array can see the write. Two calls, not
  one: the arrays of the call before are still ``Refit.received`` (and the caller's) while
  the next call binds.
* The cost: between calls a Landing keeps the memory of the received tree the caller
  dropped, at most one call's buffers (the call before last's are let go when a call
  hands out its own). A receiving refit holds two trees at its peak either way (the
  caller's old arrays while the new ones land).
* JAX releases those references late: a freed buffer's decref waits in a list that the
  next garbage collection empties (:func:`_released` empties it when a call binds).
* Only a Refit's own binding recycles (its ``BindContext.cache`` carries the Landing);
  the public ``xreshard.adapters.jax.bind`` allocates fresh buffers every time.

Rejected: the source's own single-device array as a destination shard (no copy at all)
when a destination shard equals a source shard: it would hand the trainer's buffer to the
receiver, which a later donation by the trainer invalidates under the receiver.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["ALIGN", "Landing", "adopted", "aligned_empty", "shard_buffers"]

#: bytes: what XLA's CPU client needs to adopt a host buffer without copying it
ALIGN = 64


def _view(raw: Any, shape: Sequence[int], dtype: Any) -> Any:
    """The ``ALIGN``-aligned typed view of ``shape`` at the start of owner ``raw``."""
    off = (-raw.ctypes.data) % ALIGN
    n = math.prod(shape) * dtype.itemsize
    return raw[off:off + n].view(dtype).reshape(shape)


def _owner(shape: Sequence[int], dtype: Any) -> Any:
    import numpy as np
    return np.empty(max(math.prod(shape) * dtype.itemsize, 1) + ALIGN, np.uint8)


def aligned_empty(shape: Sequence[int], dtype: Any) -> Any:
    """A numpy array whose data is ``ALIGN``-byte aligned (what XLA's CPU views require)."""
    import numpy as np
    dtype = np.dtype(dtype)
    return _view(_owner(shape, dtype), shape, dtype)


def _released() -> None:
    """Let JAX drop the references it still holds for buffers it freed: it defers those
    Python decrefs to a list that each garbage collection empties (``jax._src.lib`` hooks
    ``_jax.collect_garbage`` into ``gc.callbacks``; a refit pauses the collector), so a
    dropped array's numpy owner still reads as held until then. Only references JAX
    already let go of are dropped; without that function nothing is recycled early."""
    lib = sys.modules.get("jax._src.lib")
    collect = getattr(getattr(lib, "_jax", None), "collect_garbage", None)
    if collect is not None:
        collect()


def _references(kept: list[Any], i: int) -> int:
    """References on ``kept[i]``: the list's and the call's argument when nothing else holds
    it (:data:`_ALONE`); JAX's adopted buffer (any array, view or capsule of it) adds one.
    No local name binds the object (an interpreter may or may not count one)."""
    return sys.getrefcount(kept[i])


#: what :func:`_references` reads for an object only a list holds, on this interpreter
_ALONE = _references([object()], 0)


class Landing:
    """The host buffers a receiving JAX refit hands to JAX, kept to land a later call in
    (see the module). One per refit side; a refit's calls do not overlap (its lock).

    Kept owners are pooled by size, and a take looks at each at most once per call: one
    found still held is set aside for the next call (nothing this call does frees it), so
    a call's takes cost O(its buffers) however many arrays the caller still holds."""

    def __init__(self) -> None:
        # owners by byte size, older call first
        self._recent: tuple[dict[int, list[Any]], dict[int, list[Any]]] = ({}, {})
        self._taken: dict[int, list[Any]] = {}      # this call's owners
        self._held: list[Any] = []      # the last call's owners found still held

    def begin(self) -> Any:
        """A call binds: whatever a failed call took is let go; JAX's deferred releases
        are done first (see :func:`_released`). Returns :meth:`take`."""
        self._taken = {}
        self._put_back_held()
        if any(self._recent):
            _released()
        return self.take

    def take(self, shape: Sequence[int], dtype: Any) -> Any:
        """An aligned buffer of ``shape``/``dtype`` for this call: a kept owner of the
        right size that nothing else holds (its bytes are stale: the refit writes every
        element of a destination shard), else a new one."""
        import numpy as np
        dtype = np.dtype(dtype)
        need = max(math.prod(shape) * dtype.itemsize, 1) + ALIGN
        raw = None
        for age, pool in enumerate(self._recent):
            owners = pool.get(need)
            while owners and raw is None:
                if _references(owners, len(owners) - 1) <= _ALONE:
                    raw = owners.pop()
                elif age:       # the last call's: kept for the next call
                    self._held.append(owners.pop())
                else:           # the call before last's: let go at this call's end anyway
                    owners.pop()
            if raw is not None:
                break
        if raw is None:
            raw = _owner(shape, dtype)
        self._taken.setdefault(need, []).append(raw)
        return _view(raw, shape, dtype)

    def given(self) -> None:
        """This call's buffers went to JAX: keep them and the last call's; the owners of
        the call before last that were not taken again are let go."""
        self._put_back_held()
        self._recent = (self._recent[1], self._taken)
        self._taken = {}

    def _put_back_held(self) -> None:
        for raw in self._held:
            self._recent[1].setdefault(raw.nbytes, []).append(raw)
        self._held = []


def shard_buffers(leaf: Any, name: str, flip: bool, product: bool, new_buffer: Any,
                  rank_of: Any, bindings: dict) -> list[tuple[Any, Any]]:
    """``[(device, buffer)]``: a new (or recycled) host buffer per addressable device of
    template ``leaf``, each bound as ``(world rank, name)`` (transposed back when the
    canonical layout is flipped, in a list when it is explicit)."""
    import numpy as np
    from xreshard.dtypes import numpy_dtype
    from xreshard.errors import LayoutError
    sharding = leaf.sharding
    shard_shape = sharding.shard_shape(tuple(leaf.shape))
    dtype = numpy_dtype(str(np.dtype(leaf.dtype)))
    buffers = []
    for device in sorted(sharding.addressable_devices, key=lambda d: d.id):
        if device.platform != "cpu":
            raise LayoutError(f"{name!r}: receiving into GPU JAX arrays is not supported "
                              "yet; receive into CPU arrays or torch tensors")
        buf = new_buffer(shard_shape, dtype)
        buffers.append((device, buf))
        view = buf.T if flip else buf
        bindings[(rank_of(device), name)] = view if product else [view]
    return buffers


def adopted(jax: Any, pending: Sequence[tuple[Any, list[tuple[Any, Any]] | None]],
            landing: Landing | None, stacked: Sequence[Any] = ()) -> list[Any]:
    """The received arrays: each leaf's ``(device, buffer)`` pairs adopted by JAX
    (``jax.device_put`` of an aligned host buffer to a CPU device keeps the buffer as the
    array's memory) and assembled with ``jax.make_array_from_single_device_arrays``; a leaf
    without buffers comes out of one of the ``stacked`` receives
    (:func:`xreshard.adapters.jax_stack.unstacked`). The buffers are then the
    ``landing``'s to recycle (see :class:`Landing`)."""
    from xreshard.adapters.jax_stack import unstacked
    done: dict[int, Any] = {}
    for chunk in stacked:
        done.update(zip(chunk.at, unstacked(jax, chunk)))
    out = []
    for i, (leaf, buffers) in enumerate(pending):
        if buffers is None:
            out.append(done[i])
            continue
        arrays = [jax.device_put(buf, device) for device, buf in buffers]
        out.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), leaf.sharding,
                                                            arrays))
    if landing is not None:
        landing.given()
    return out
