"""The version fences of a delta refit (``RefitConfig(delta=True)``, see :mod:`.delta_wire`):
what a receiver's destination memory is (where it lives, a checksum of each tensor) and what
every process claimed at ``refit/check``."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

__all__ = ["where_of", "sums_of", "claimed", "key_of"]


#: fingerprints of at least this many bytes are checksummed on several threads
_PARALLEL_BYTES = 1 << 24
_FINGERPRINT_THREADS = max(1, min(4, os.cpu_count() or 1))


def claimed(gathered: Sequence[Any]) -> tuple[dict, dict, set]:
    """From every process's claims: ``(src, dst) -> (call, digest)`` of the senders'
    baselines and of the receivers' bases, and the pairs whose sender sends every bucket
    dense this call."""
    send: dict[tuple[int, int], tuple] = {}
    recv: dict[tuple[int, int], tuple] = {}
    whole: set[tuple[int, int]] = set()
    for g in gathered:
        if not isinstance(g, dict):
            continue
        for s, r, call, digest in g.get("send") or ():
            send[(int(s), int(r))] = (call, digest)
        for r, call, pairs in g.get("recv") or ():
            for s, digest in pairs:
                recv[(int(s), int(r))] = (call, digest)
        whole.update((int(s), int(r)) for s, r in g.get("dense_pairs") or ())
    return send, recv, whole


def _arrays(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def key_of(key: Any) -> str:
    return repr(key)


def where_of(dst: Any) -> str:
    """Where this process's destination memory lives: its buffers' addresses and shapes
    (other memory holds no base: a JAX receiver gets new arrays every call)."""
    if dst is None:
        return ""
    where = hashlib.sha256()
    for key in sorted(dst.bindings, key=repr):
        for arr in _arrays(dst.bindings[key]):
            where.update(repr((key, _address(arr), arr.shape, arr.strides)).encode())
    return where.hexdigest()


def sums_of(dst: Any, keys: Any = None) -> dict[str, str]:
    """A checksum of each destination binding's bytes (``keys``: those only), by its key."""
    from . import verify
    keys = sorted(dst.bindings if keys is None else keys, key=repr)
    arrays = [(k, a) for k in keys for a in _arrays(dst.bindings[k])]
    # by content, never torch write counters: fused optimizers, ``.data`` and numpy views
    # write without moving them (see xreshard.runtime.writes); numpy sums release the GIL,
    # so tensors are checksummed on several threads
    if len(arrays) > 1 and sum(a.nbytes for _, a in arrays) >= _PARALLEL_BYTES:
        from concurrent.futures import ThreadPoolExecutor

        from .handle import caller_streams
        # the pool's threads read device arrays on this thread's streams (those the
        # producers were ordered onto), not on their own legacy stream of device 0
        streams = caller_streams()

        def checksum(a: Any) -> str:
            with streams(), _device_of(a):
                return verify.checksum(a)
        with ThreadPoolExecutor(min(len(arrays), _FINGERPRINT_THREADS)) as pool:
            digests = list(pool.map(checksum, [a for _, a in arrays]))
    else:
        digests = [verify.checksum(a) for _, a in arrays]
    out: dict[str, list[str]] = {}
    for (k, _), d in zip(arrays, digests):
        out.setdefault(key_of(k), []).append(d)
    return {k: "/".join(v) for k, v in out.items()}


def _device_of(arr: Any) -> Any:
    """The device context of a CuPy array (its kernels run there), or nothing."""
    import contextlib
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is None or not isinstance(arr, cupy.ndarray):
        return contextlib.nullcontext()
    return cupy.cuda.Device(arr.device.id)


def _address(arr: Any) -> int:
    """Where ``arr``'s data starts: host (numpy) or device (CUDA Array Interface)."""
    face = getattr(arr, "__array_interface__", None) or arr.__cuda_array_interface__
    return int(face["data"][0])
