"""Delta kernels in jitted JAX, on the arrays' own devices (the trainer's side of a delta
refit from JAX). Same format and same bytes as :mod:`xreshard.delta.codec`'s numpy kernels.

Finding the changes is one jitted pass over both versions (bits compared as unsigned
words: 8- and 16-byte elements as 2 or 4 ``uint32`` words, so it works without
``jax_enable_x64``); it returns the changed count and the run count, which the host reads
(two scalars) to choose the encoding. Compacting the changed values and the runs is a
second jitted pass whose output length is the count rounded up to a power of two (a
static shape: at most log2(n) compilations per region size), so only about ``count``
elements leave the device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .codec import (BITMASK, DENSE, RUNS, DeltaFormatError, Encoded, Header, choose,
                    dense_wins_without_runs, parse)

__all__ = ["encode_jax", "apply_jax", "encode_bytes", "apply_bytes", "byte_words"]

_LIMIT = (1 << 31) - 1      # JAX counts in int32 without x64


def _jax() -> Any:
    from ..extras import require
    return require("jax", "jax", "the JAX delta kernels")


def _words(x: Any) -> Any:
    """``x`` flattened, as unsigned words ``(n,)`` or ``(n, k)`` (k uint32 words for 8- and
    16-byte elements)."""
    jax = _jax()
    jnp = jax.numpy
    isz = x.dtype.itemsize
    word = {1: jnp.uint8, 2: jnp.uint16}.get(isz, jnp.uint32)
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(flat, word)


@functools.cache
def _find() -> Any:
    jax = _jax()
    jnp = jax.numpy

    @jax.jit
    def find(old: Any, new: Any) -> tuple[Any, Any, Any]:
        diff = old != new
        if diff.ndim == 2:
            diff = diff.any(axis=1)
        prev = jnp.concatenate([jnp.zeros(1, bool), diff[:-1]])
        return diff, diff.sum(dtype=jnp.int32), (diff & ~prev).sum(dtype=jnp.int32)
    return find


@functools.cache
def _compact() -> Any:
    jax = _jax()
    jnp = jax.numpy

    @functools.partial(jax.jit, static_argnames=("kind", "cap", "cap_runs"))
    def compact(diff: Any, new: Any, nruns: Any, *, kind: int, cap: int, cap_runs: int
                ) -> tuple:
        (idx,) = jnp.nonzero(diff, size=cap, fill_value=0)
        values = new[idx]
        if kind == BITMASK:
            return jnp.packbits(diff, bitorder="little"), values
        prev = jnp.concatenate([jnp.zeros(1, bool), diff[:-1]])
        nxt = jnp.concatenate([diff[1:], jnp.zeros(1, bool)])
        (starts,) = jnp.nonzero(diff & ~prev, size=cap_runs, fill_value=0)
        (lasts,) = jnp.nonzero(diff & ~nxt, size=cap_runs, fill_value=0)
        # the table is nruns starts then nruns lengths: lengths go in at offset nruns
        table = jnp.zeros(2 * cap_runs, jnp.uint32)
        table = jax.lax.dynamic_update_slice(table, starts.astype(jnp.uint32), (0,))
        table = jax.lax.dynamic_update_slice(
            table, (lasts + 1 - starts).astype(jnp.uint32), (nruns,))
        return table, values
    return compact


def _cap(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def _one_device(x: Any, what: str) -> None:
    if len(x.sharding.device_set) != 1:
        raise ValueError(f"{what}: the delta kernels take one device's buffer (a rank's "
                         f"bucket); this array spans {len(x.sharding.device_set)} devices - "
                         "encode each addressable shard (x.addressable_shards[i].data)")


def encode_jax(old: Any, new: Any) -> Encoded:
    """Encode ``new`` against the baseline ``old`` (single-device ``jax.Array`` of the same
    shape and dtype, on the same device); sections stay on the device."""
    _jax()                  # a missing JAX says how to install it before anything runs
    _one_device(old, "baseline")
    _one_device(new, "new")
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"baseline {old.shape} {old.dtype} and new {new.shape} {new.dtype}: a "
                         "delta compares two versions of the same region")
    isz, n = new.dtype.itemsize, int(np.prod(new.shape, dtype=np.int64))
    if n > _LIMIT:
        raise DeltaFormatError(f"{n} elements: the JAX kernels take regions under 2**31 "
                               "elements (buckets are far smaller)")
    if isz not in (1, 2, 4, 8, 16):
        raise DeltaFormatError(f"elements of {isz} bytes; the delta format takes 1-16")
    return _encode_words(_words(old), _words(new), isz, n)


def byte_words(x: Any, itemsize: int, what: str) -> Any:
    """A flat uint8 array (a bucket's bytes) as words of ``itemsize``-byte elements: ``(n,)``
    unsigned ints up to 4 bytes, ``(n, itemsize // 4)`` uint32 for 8 and 16 (no x64)."""
    jax = _jax()
    jnp = jax.numpy
    if x.ndim != 1 or x.dtype != jnp.uint8:
        raise ValueError(f"{what}: expected a flat uint8 array, got {x.shape} {x.dtype}")
    if itemsize not in (1, 2, 4, 8, 16) or x.shape[0] % itemsize:
        raise DeltaFormatError(f"{what}: {x.shape[0]} bytes are not whole elements of "
                               f"{itemsize} bytes (the delta format takes 1-16)")
    if itemsize == 1:
        return x
    if itemsize <= 4:
        return jax.lax.bitcast_convert_type(x.reshape(-1, itemsize),
                                            {2: jnp.uint16, 4: jnp.uint32}[itemsize])
    return jax.lax.bitcast_convert_type(x.reshape(-1, itemsize // 4, 4), jnp.uint32)


def encode_bytes(old: Any, new: Any, itemsize: int) -> Encoded:
    """:func:`encode_jax` of two flat uint8 arrays (one device's buffers: a bucket's bytes,
    as the executor holds them) whose elements are ``itemsize`` bytes: the same message as
    the numpy kernels give for those elements (8- and 16-byte elements need no x64)."""
    _one_device(old, "baseline")
    _one_device(new, "new")
    if old.shape != new.shape:
        raise ValueError(f"baseline of {old.shape[0]} bytes, new of {new.shape[0]}: a delta "
                         "compares two versions of the same region")
    n = new.shape[0] // itemsize if itemsize else 0
    if n > _LIMIT:
        raise DeltaFormatError(f"{n} elements: the JAX kernels take regions under 2**31 "
                               "elements (buckets are far smaller)")
    return _encode_words(byte_words(old, itemsize, "baseline"),
                         byte_words(new, itemsize, "new"), itemsize, n)


def _encode_words(o: Any, w: Any, isz: int, n: int) -> Encoded:
    if n == 0:      # nothing to compare; choose() says dense, as for every backend
        return Encoded(Header(choose(0, 0, 0, isz), isz, 0, 0, 0), (np.zeros(0, np.uint8),))
    diff, count, nruns = _find()(o, w)
    count = int(count)
    if count and dense_wins_without_runs(n, count, isz):
        return Encoded(Header(DENSE, isz, n, n, 0), (w,))
    nruns = int(nruns)
    kind = choose(n, count, nruns, isz)
    if kind == DENSE:
        return Encoded(Header(DENSE, isz, n, n, 0), (w,))
    header = Header(kind, isz, n, count, nruns if kind == RUNS else 0)
    if count == 0:
        return Encoded(header, (np.zeros(0, np.uint8),) * 2)
    return Encoded(header, _compact()(diff, w, np.int32(nruns), kind=kind, cap=_cap(count),
                                      cap_runs=_cap(max(nruns, 1))))


def apply_jax(message: Any, target: Any, *, on_host: bool = False) -> Any:
    """A new ``jax.Array`` on ``target``'s device: ``target`` (one device's buffer) with
    ``message`` applied (JAX arrays are immutable). Validates on the host before any
    device work. ``on_host``: a CPU buffer, applied by the host kernels to a copy."""
    jax = _jax()
    _one_device(target, "target")
    device = next(iter(target.sharding.device_set))
    if on_host:
        from .host import apply_numpy
        return jax.device_put(apply_numpy(message, np.array(target)), device)
    w = _words(target)
    msg = parse(message, target.dtype.itemsize, w.shape[0])
    values = jax.device_put(np.asarray(msg.values).view(np.dtype(w.dtype.name)).reshape(
        (-1,) + w.shape[1:]), device)
    if msg.header.kind == DENSE:
        out = values
    elif msg.header.count == 0:
        return target
    else:
        idx = msg.mask().nonzero()[0] if msg.header.kind == BITMASK else msg.indices()
        out = w.at[jax.device_put(idx.astype(np.int32), device)].set(values)
    jnp = jax.numpy
    back = out.astype(bool) if target.dtype == jnp.bool_ else \
        jax.lax.bitcast_convert_type(out, target.dtype)
    return jax.device_put(back.reshape(target.shape), device)


def apply_bytes(message: Any, target: Any, itemsize: int) -> Any:
    """:func:`apply_jax` to a flat uint8 array (a bucket's bytes on one device) whose
    elements are ``itemsize`` bytes: a new flat uint8 array on its device (validated on
    the host first: a malformed message raises with nothing computed)."""
    jax = _jax()
    jnp = jax.numpy
    _one_device(target, "target")
    device = next(iter(target.sharding.device_set))
    w = byte_words(target, itemsize, "target")
    msg = parse(message, itemsize, w.shape[0])
    if msg.header.kind != DENSE and msg.header.count == 0:
        return target
    values = jax.device_put(np.asarray(msg.values).view(np.dtype(w.dtype.name)).reshape(
        (-1,) + w.shape[1:]), device)
    if msg.header.kind == DENSE:
        out = values
    else:
        idx = msg.mask().nonzero()[0] if msg.header.kind == BITMASK else msg.indices()
        out = w.at[jax.device_put(idx.astype(np.int32), device)].set(values)
    if itemsize == 1:
        return out
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(-1)
