"""How the executor copies between views: bits or casts, tiled transposes, wide elements.

Every byte the executor packs, unpacks or copies locally goes through :func:`copy_into`,
and :mod:`xreshard.runtime.verify` hashes through it too, so both see the same bytes. Split out of
``execute.py``; ``xreshard.runtime.execute`` re-exports every public name.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..dtypes import as_dtype, bits, bits_dtype
from ..ir.layout import Layout, Region

__all__ = ["array_module", "copy_into", "view_of", "widened"]


def array_module(arr: Any) -> Any:
    """The array module of ``arr``: numpy, or CuPy for device arrays."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # only device bindings get here
    return cupy


_TILE = 256


def copy_into(xp: Any, out: Any, out_dtype: str, src: Any, src_dtype: str) -> None:
    """``out[...] = src`` (same shape): bits when the dtypes are equal, values cast otherwise.

    ``out_dtype`` / ``src_dtype`` are the canonical dtypes the arrays hold, whatever the
    arrays' own dtypes say: a binding may be a raw-bits view (a bf16 tensor seen as
    ``uint16``), so an equal pair is copied as same-size unsigned ints and never
    value-cast, on numpy and CuPy alike.

    A 2-D source or destination (not both) whose inner dim is the strided one (a
    transposed Flax kernel) is copied in tiles so both sides stay in cache
    (:func:`_transposed_into`): numpy's plain strided copy of a transpose runs at a
    fraction of memory bandwidth.
    """
    if out_dtype == src_dtype:
        out, src = bits(out), bits(src)
        if xp is not np:
            out, src = widened(out, src, _device_ptr)
        casting: Any = "no"
    else:
        out, src = as_dtype(out, out_dtype), as_dtype(src, src_dtype)
        casting = "unsafe"
    if xp is np and out.ndim == 2 and out.size > _TILE * _TILE and (
            src.strides[0] < src.strides[1]) != (out.strides[0] < out.strides[1]):
        # one side column-major, the other not; both column-major (a transposed message
        # of a transposed kernel) is a plain copy, which numpy walks in memory order
        _transposed_into(out, src, casting)
        return
    xp.copyto(out, src, casting=casting)


# A transposing copy reads one side down its columns: each of a square tile's t columns
# (t = 512 two-byte or 256 wider elements) is a run of cache lines one row stride apart.
# When that stride is a multiple of a large power of two (a kernel of 512, 1024, 4096 or
# 14336 bf16 columns) those lines fall into a few cache sets and evict each other before
# the tile is done with them: square tiles ran at 0.6 GB/s on a 4096 x 4096 bf16 kernel
# against 2-4 GB/s on other widths. Such a copy (the stride's power-of-two factor times t
# reaches _CONFLICT) goes through a small scratch block whose row pitch is not a multiple
# of it: one copy of plain row runs into it, then the transposing copy out of it, which
# stays in cache. Below that (a stride of 19 x 1 KiB with fp32 tiles) the tiles ran as fast.
_CONFLICT = 512 * 1024  # bytes: power-of-two factor of the column stride x tile columns
_STRIP = 128            # rows of the destination per scratch block
_CHUNK = 512            # columns of the destination per scratch block
_PAD = 8                # elements: the scratch's pitch is _STRIP + _PAD


def _transposed_into(out: np.ndarray, src: np.ndarray, casting: Any) -> None:
    """``out[...] = src`` for 2-D host arrays one of which walks its rows contiguously and
    the other its columns (``benchmarks/bench_transpose.py`` times the tilings)."""
    if out.strides[0] < out.strides[1]:
        out, src = out.T, src.T         # the same copy, in the destination's row order
    rows, cols = out.shape
    if _through_scratch(out, src):
        h = min(rows, _STRIP)
        scratch = np.empty((min(cols, _CHUNK), h + _PAD), src.dtype)
        columns = src.T                 # columns[j, i] == src[i, j], rows contiguous
        for i in range(0, rows, h):
            n = min(h, rows - i)
            for j in range(0, cols, _CHUNK):
                m = min(_CHUNK, cols - j)
                block = scratch[:m, :n]
                np.copyto(block, columns[j:j + m, i:i + n])
                np.copyto(out[i:i + n, j:j + m], block.T, casting=casting)
        return
    t = _tile(out)
    for i in range(0, rows, t):
        for j in range(0, cols, t):
            np.copyto(out[i:i + t, j:j + t], src[i:i + t, j:j + t], casting=casting)


def _tile(out: np.ndarray) -> int:
    # 512 x 512 two-byte tiles ran ~20% faster than 256 x 256 here (bf16 kernels)
    return 2 * _TILE if out.dtype.itemsize <= 2 else _TILE


def _through_scratch(out: np.ndarray, src: np.ndarray) -> bool:
    """Whether :func:`_transposed_into` copies ``out[...] = src`` (``out`` in row order)
    through a scratch block: ``out``'s rows and ``src``'s columns are contiguous and the
    largest power of two dividing ``src``'s column stride, times the tile's columns,
    reaches ``_CONFLICT``."""
    stride = abs(src.strides[1])
    return (out.strides[1] == out.dtype.itemsize and src.strides[0] == src.dtype.itemsize
            and (stride & -stride) * _tile(out) >= _CONFLICT)


def widened(out: Any, src: Any, ptr: Callable[[Any], int]) -> tuple[Any, Any]:
    """Same-shape bit views ``(out, src)`` re-viewed with the widest unsigned element (up
    to 8 bytes) that both allow, so a copy kernel moves fewer, larger elements.

    Both must have a contiguous last dim whose byte length, every other stride and the data
    pointer (``ptr(arr)``) divide by the new size: a bf16 region with 16 KiB runs copies as
    uint64, 4x fewer elements. Anything else (a transposed view) comes back unchanged.
    """
    k = out.dtype.itemsize
    if out.ndim == 0 or out.size == 0 or k >= 8:
        return out, src
    row = out.shape[-1] * k
    for w in (8, 4, 2):
        if w <= k:
            break
        if row % w == 0 and all(a.strides[-1] == k and ptr(a) % w == 0
                                and all(st % w == 0 for st in a.strides[:-1])
                                for a in (out, src)):
            wide = bits_dtype(w)
            return out.view(wide), src.view(wide)
    return out, src


def _device_ptr(arr: Any) -> int:
    return int(arr.data.ptr)


def view_of(binding: Any, layout: Layout, rank: int, region: Region) -> Any:
    """The part of ``binding`` (held by ``rank``) that stores ``region``."""
    i, slices = layout.locate(rank, region)
    arr = binding if layout.is_product else binding[i]
    return arr[slices + (Ellipsis,)]
