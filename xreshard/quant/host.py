"""Quantizing on the host with numpy: bit-exact with vLLM's functions, and fast.

Decision record. numpy has no fused kernels, so each elementwise step is a pass over
memory; the plain formula (bf16 -> float32, multiply, ``astype(float8_e4m3fn)``) runs at
~0.1 GB/s of bf16 on one core, ml_dtypes' cast alone costing 11 ns an element. So:

* work in block rows of ``block[0]`` rows, cut into column chunks that stay in the L2
  cache, in per-thread workspaces written with ``out=`` (a fresh 128 KiB array is a page
  fault per 4 KiB);
* compute the float32 -> e4m3 cast with integer ops instead of ml_dtypes: for finite
  ``v >= 0`` torch's cast is ``min(normal(v), subnormal(v))`` where ``normal`` is its
  round-to-nearest-even bit trick applied to ``max(v, 2**-6)`` and ``subnormal`` its
  ``v + 2**14`` trick (they agree on [2**-6, 2**-5) and ``subnormal`` is larger above);
  checked against torch's cast on every 7th float32 bit pattern when written, and by the
  tests on every 4099th and around every code's rounding midpoint;
* compute ``amax`` as an integer max of the magnitude bits (ordered like the values, NaN
  above infinity, so a NaN block still has a NaN amax), and the sign from the input's
  bits; blocks holding NaN or infinity take a slow exact path;
* split block rows over threads (numpy releases the GIL in its loops).

Rejected: ml_dtypes casts (slow, and their overflow rule is not torch's saturation);
lookup tables gathered per element (``np.take`` converts indices to intp: slower than the
arithmetic); computing in float64 (not the reference's float32 rounding).
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..dtypes import dtype_name, numpy_dtype
from ..ir.formats import QUANTIZABLE, BlockFP8, FormatError, MXFP8

__all__ = ["quantize_block_fp8", "quantize_mxfp8", "dequantize", "e4m3_codes", "block_scales",
           "ceil_log2_thresholds", "ceil_log2", "CAST", "default_threads"]

#: torch's float32 -> fp8 cast, per code type: (first normal's bits, rebias, magic float
#: for the subnormal trick, its bits, saturated max code, NaN code, first overflow bits)
CAST = {
    "float8_e4m3fn": (121 << 23, (0x7FFFF - (120 << 23)) % (1 << 32), 16384.0, 0x46800000,
                      0x7E, 0x7F, 0x43F00000),
    "float8_e4m3fnuz": (120 << 23, (0x7FFFF - (119 << 23)) % (1 << 32), 8192.0, 0x46000000,
                        None, 0x80, 0x43800000),
}

_ABS = np.uint32(0x7FFFFFFF)
_TINY = np.float32(np.finfo(np.float32).tiny)
_CHUNK_ELEMENTS = 1 << 17          # per workspace array (512 KiB of uint32): fewer numpy calls


def default_threads() -> int:
    """Threads a host quantizer uses unless told (``Tuning.quant_threads`` reaches it
    through the executor's kernels): the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:          # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------- the cast

def e4m3_codes(v: np.ndarray, dtype: str = "float8_e4m3fn") -> np.ndarray:
    """uint8 codes of float32 ``v`` cast to ``dtype`` as torch casts (any values: NaN,
    infinities, overflow, subnormals); NaN codes canonical (see :mod:`xreshard.quant`)."""
    norm_min, rebias, magic, magic_bits, sat, nan_code, over = CAST[dtype]
    b = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    a = b & _ABS
    n = np.maximum(a, np.uint32(norm_min))
    n += (n >> np.uint32(20)) & np.uint32(1)
    n += np.uint32(rebias)
    n >>= np.uint32(20)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (a.view(np.float32) + np.float32(magic)).view(np.uint32) - np.uint32(magic_bits)
    np.minimum(n, s, out=n)
    if sat is not None:
        np.minimum(n, np.uint32(sat), out=n)
    code = n.astype(np.uint8)
    sign = ((b >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    if nan_code == 0x80:            # e4m3fnuz: no negative zero; >= 256 is NaN
        sign *= code.astype(bool)
        code[a >= np.uint32(over)] = 0
        sign[a >= np.uint32(over)] = 0x80
    code |= sign
    code[a > np.uint32(0x7F800000)] = nan_code
    return code


@functools.cache
def ceil_log2_thresholds() -> tuple[int, ...]:
    """``t[k + 149]``: the largest 23-bit fraction ``f`` for which float32's correctly
    rounded ``log2(2**k * (1 + f / 2**23))`` is still ``k`` (so ``ceil`` gives ``k``),
    for ``k`` in [-149, 127]. Near a power of two the rounded log2 lands on the integer:
    ``ceil(log2(y))`` is then ``k``, not ``k + 1`` as exact arithmetic says."""
    out = []
    for k in range(-149, 128):
        if k == 0:
            out.append(0)        # log2 of 1 + f is a tiny positive float: ceil is 1
            continue
        m = abs(k)
        if k > 0 or m & (m - 1):
            half = 2.0 ** (math.floor(math.log2(m)) - 24)
        else:                    # -2**j: the floats just above it are twice as dense
            half = 2.0 ** (int(math.log2(m)) - 25)
        out.append(max(math.ceil(math.expm1(half * math.log(2)) * 2 ** 23) - 1, 0))
    return tuple(out)


def ceil_log2(y: np.ndarray) -> np.ndarray:
    """``ceil(log2(y))`` of positive finite float32 ``y`` as float32 ``torch.log2`` then
    ``ceil`` compute it (int32; -inf is not produced: ``y`` is at least its tiny)."""
    m, e = np.frexp(y.astype(np.float64))           # exact: y = m * 2**e, m in [0.5, 1)
    k = e.astype(np.int32) - 1
    frac = (m * 2.0 - 1.0) * 2.0 ** 23               # an integer (y has <= 24 bits)
    thr = np.asarray(ceil_log2_thresholds(), dtype=np.float64)[k + 149]
    return k + (frac > thr).astype(np.int32)


# ---------------------------------------------------------------------------- inputs

def _as_input(x: Any, fmt: Any, name: str) -> tuple[np.ndarray, str]:
    """(x as a numpy array of its own dtype, the canonical dtype name)."""
    x = np.asarray(x)
    try:
        dtype = dtype_name(x.dtype)
    except Exception:            # noqa: BLE001 - reported below with the format
        dtype = str(x.dtype)
    if dtype not in QUANTIZABLE:
        raise FormatError(f"{name!r}: {fmt} quantizes {', '.join(QUANTIZABLE)} values, "
                          f"not {dtype} - cast first (to the dtype the trainer exports)")
    fmt.check_shape(x.shape, name)
    return np.ascontiguousarray(x), dtype


def _abs_bits(src: np.ndarray, dtype: str, a: np.ndarray) -> None:
    """Write float32 magnitude bits of ``src`` (2-D, same shape as ``a``) into ``a``."""
    if dtype == "bfloat16":
        np.left_shift(src.view(np.uint16), np.uint32(16), out=a, dtype=np.uint32)
    else:
        np.copyto(a.view(np.float32), src)       # float16 -> float32 is exact
    np.bitwise_and(a, _ABS, out=a)


def _sign_byte(src: np.ndarray, dtype: str) -> np.ndarray:
    """0x80 where ``src`` is negative (NaN included), else 0 (uint8, src's shape)."""
    if dtype == "bfloat16":
        high = src.view(np.uint8)[..., 1::2]             # little-endian high byte
        return high & np.uint8(0x80)
    bits = src.view(np.uint16 if dtype == "float16" else np.uint32)
    top = 8 * bits.itemsize - 8
    return ((bits >> bits.dtype.type(top)) & bits.dtype.type(0x80)).astype(np.uint8)


def _to_float32(src: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return np.left_shift(src.view(np.uint16), np.uint32(16),
                             dtype=np.uint32).view(np.float32)
    return src.astype(np.float32)


# ---------------------------------------------------------------------------- block FP8

class _Workspace:
    """One thread's scratch arrays for chunks of up to ``rows`` x ``width`` elements."""

    def __init__(self, rows: int, width: int) -> None:
        self.a: Any = np.empty(rows * width, np.uint32)
        self.n: Any = np.empty(rows * width, np.uint32)
        self.t: Any = np.empty(rows * width, np.uint32)

    def views(self, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = rows * cols
        return (self.a[:k].reshape(rows, cols), self.n[:k].reshape(rows, cols),
                self.t[:k].reshape(rows, cols))


def _chunk_width(rows: int, group: int) -> int:
    """Columns per chunk: a multiple of ``group`` keeping ``rows`` x it near the L2 target."""
    return max(group, (_CHUNK_ELEMENTS // max(rows, 1)) // group * group)


def block_scales(amax_bits: np.ndarray, fmt: BlockFP8) -> np.ndarray:
    """float32 scale-inverses from per-block amax bits: vLLM's ``clamp(1e-4) / fp8_max``,
    rounded up to a power of two with ``ue8m0``."""
    amax = amax_bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        sf = np.maximum(amax, np.float32(1e-4)) / np.float32(fmt.fp8_max)
        if fmt.ue8m0:
            finite = np.isfinite(sf)
            e = ceil_log2(np.where(finite, sf, np.float32(1.0)))
            sf = np.where(finite, np.ldexp(np.float32(1.0), e).astype(np.float32), sf)
    sf[np.isnan(sf)] = np.float32(np.nan)        # canonical NaN bits
    return sf


def _scaled_codes(a: np.ndarray, n: np.ndarray, t: np.ndarray, mult: np.ndarray,
                  group: int, dtype: str, saturate: bool, block_rows: int = 1) -> None:
    """Codes of magnitude bits ``a`` times ``mult``, into ``n``; ``a`` is clobbered.

    ``a`` is viewed as ``(R, block_rows, C // group, group)`` and ``mult`` broadcasts over
    that (one factor per block, or per MXFP8 group with ``block_rows`` 1). Block FP8
    never needs ``saturate``: ``|x| * (1 / scale)`` stays below 464.
    """
    norm_min, rebias, magic, magic_bits, sat = CAST[dtype][:5]
    v = a.view(np.float32)
    v4 = v.reshape(a.shape[0], block_rows, -1, group)
    np.multiply(v4, mult, out=v4)
    np.maximum(a, np.uint32(norm_min), out=n)
    np.right_shift(n, np.uint32(20), out=t)
    np.bitwise_and(t, np.uint32(1), out=t)
    np.add(n, t, out=n)
    np.add(n, np.uint32(rebias), out=n)
    np.right_shift(n, np.uint32(20), out=n)
    np.add(v, np.float32(magic), out=v)
    np.subtract(a, np.uint32(magic_bits), out=a)
    np.minimum(n, a, out=n)
    if saturate:
        np.minimum(n, np.uint32(sat), out=n)


def _store(dst: np.ndarray, n: np.ndarray, src: np.ndarray, dtype: str, code_dtype: str
           ) -> None:
    """Write the magnitude codes ``n`` (uint32, possibly wider) and ``src``'s signs."""
    np.copyto(dst, n[:, :dst.shape[1]], casting="unsafe")      # the low byte: the code
    sign = _sign_byte(src, dtype)
    if code_dtype == "float8_e4m3fnuz":                        # no negative zero
        sign *= dst.astype(bool)
    dst |= sign


def _block_band(x: np.ndarray, dtype: str, r0: int, fmt: BlockFP8, out: np.ndarray,
                scales: np.ndarray, ws: _Workspace) -> None:
    """Quantize the band of block rows starting at row ``r0`` of the 2-D ``x`` (as many
    block rows as fit a workspace chunk) into ``out`` and ``scales``, chunk by chunk."""
    b0, b1 = fmt.block
    band = _band_rows(b0, b1)
    rows = min(band, x.shape[0] - r0)
    prows = -(-rows // b0) * b0
    width = _chunk_width(band, b1)
    for c0 in range(0, x.shape[1], width):
        c1 = min(x.shape[1], c0 + width)
        cols, padded = c1 - c0, -(-(c1 - c0) // b1) * b1
        src = x[r0:r0 + rows, c0:c1]
        a, n, t = ws.views(prows, padded)
        _abs_bits(src, dtype, a[:rows, :cols])
        a[:rows, cols:] = 0                  # zero padding: a tail block's amax ignores it
        a[rows:] = 0
        amax = a.reshape(prows // b0, b0, padded // b1, b1).max(axis=(1, 3))
        sf = block_scales(amax, fmt)
        scales[r0 // b0:r0 // b0 + len(sf), c0 // b1:c0 // b1 + sf.shape[1]] = sf
        finite = amax < np.uint32(0x7F800000)
        inv = np.float32(1.0) / np.where(finite, sf, np.float32(1.0))
        _scaled_codes(a.reshape(prows // b0, b0 * padded), n.reshape(prows // b0, -1),
                      t.reshape(prows // b0, -1), inv[:, None, :, None],
                      b1, fmt.dtype, saturate=False, block_rows=b0)
        dst = out[r0:r0 + rows, c0:c1]
        _store(dst, n[:rows], src, dtype, fmt.dtype)
        for i, j in zip(*np.nonzero(~finite)):                 # NaN or infinity: exact path
            rs = slice(i * b0, min((i + 1) * b0, rows))
            cs = slice(j * b1, min((j + 1) * b1, cols))
            vals = _to_float32(np.ascontiguousarray(src[rs, cs]), dtype)
            with np.errstate(invalid="ignore", divide="ignore"):
                dst[rs, cs] = e4m3_codes(vals * (np.float32(1.0) / sf[i, j]), fmt.dtype)


def _band_rows(b0: int, b1: int) -> int:
    """Rows per band: whole block rows, as many as keep a chunk near the target size."""
    return b0 * max(1, _CHUNK_ELEMENTS // (b0 * max(b1, 1024)))


def quantize_block_fp8(x: Any, fmt: BlockFP8 = BlockFP8(), *, name: str = "tensor",
                       threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of ``x`` in block FP8, byte for byte vLLM's
    ``per_block_cast_to_fp8(x, fmt.block, use_ue8m0=fmt.ue8m0)`` (see :mod:`xreshard.quant`).

    Args:
        x: bfloat16 (ml_dtypes), float16 or float32 values, at least 2-D; leading dims are
            quantized one index at a time (stacked experts).
        fmt: the format (block size, e4m3fn or e4m3fnuz codes, ue8m0 scales).
        name: the tensor's name, for errors.
        threads: worker threads (default :func:`default_threads`).

    Returns:
        codes (``fmt.dtype`` as ml_dtypes, ``x``'s shape) and float32 scale-inverses of
        shape ``fmt.scale_shape(x.shape)``.

    Raises:
        FormatError: ``x`` is not 2-D or more, or not of a dtype that can be quantized.
    """
    x, dtype = _as_input(x, fmt, name)
    codes = np.empty(x.shape, np.uint8)
    scales: Any = np.empty(fmt.scale_shape(x.shape), np.float32)
    mats = x.reshape((-1,) + x.shape[-2:])
    out3 = codes.reshape(mats.shape)
    sc3 = scales.reshape((-1,) + scales.shape[-2:])
    band = _band_rows(*fmt.block)
    jobs = [(m, r0) for m in range(mats.shape[0]) for r0 in range(0, mats.shape[1], band)]
    _run(jobs, lambda job, ws: _block_band(mats[job[0]], dtype, job[1], fmt, out3[job[0]],
                                           sc3[job[0]], ws),
         band, _chunk_width(band, fmt.block[1]), threads)
    return codes.view(numpy_dtype(fmt.dtype)), scales


def _run(jobs: list, fn: Any, rows: int, width: int, threads: int | None) -> None:
    """Run ``fn(job, workspace)`` over ``jobs`` on up to ``threads`` threads, one
    ``rows`` x ``width`` workspace per thread."""
    threads = min(threads or default_threads(), len(jobs))
    if threads <= 1:
        ws = _Workspace(rows, width)
        for job in jobs:
            fn(job, ws)
        return
    per = [jobs[i::threads] for i in range(threads)]

    def worker(mine: list) -> None:
        ws = _Workspace(rows, width)
        for job in mine:
            fn(job, ws)
    with ThreadPoolExecutor(threads, thread_name_prefix="xreshard-quant") as pool:
        for f in [pool.submit(worker, mine) for mine in per]:
            f.result()


# ---------------------------------------------------------------------------- MXFP8

#: 2**(127 - s) as float32 for every E8M0 scale byte s in 0..254 (2**-127 is subnormal,
#: exactly representable): ``x / 2**(s - 127)`` is ``x * _POW[s]``, both exact
_POW = np.ldexp(np.float32(1.0), 127 - np.arange(255)).astype(np.float32)


def _mx_scale_bytes(amax_bits: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes from per-group amax bits: ``clamp(ceil(log2(max(amax, tiny) /
    448)) + 127, 0, 254)``; 254 for an infinite amax, 0 for NaN (what torch's float ->
    uint8 cast gives on x86 and CUDA)."""
    amax = np.maximum(amax_bits.view(np.float32), _TINY)
    finite = amax_bits < np.uint32(0x7F800000)
    y = np.where(finite, amax, np.float32(1.0)) / np.float32(448.0)
    sb = np.clip(ceil_log2(y) + 127, 0, 254)
    sb[amax_bits == np.uint32(0x7F800000)] = 254
    sb[amax_bits > np.uint32(0x7F800000)] = 0
    return sb.astype(np.uint8)


def _mx_rows(x: np.ndarray, dtype: str, r0: int, rows: int, out: np.ndarray,
             scales: np.ndarray, ws: _Workspace) -> None:
    """Quantize rows ``r0 : r0 + rows`` of the 2-D ``x`` (columns a multiple of 32)."""
    group = MXFP8.group
    rows = min(rows, x.shape[0] - r0)
    width = _chunk_width(rows, group)
    for c0 in range(0, x.shape[1], width):
        c1 = min(x.shape[1], c0 + width)
        src = x[r0:r0 + rows, c0:c1]
        a, n, t = ws.views(rows, c1 - c0)
        _abs_bits(src, dtype, a)
        amax = a.reshape(rows, -1, group).max(axis=2)
        sb = _mx_scale_bytes(amax)
        scales[r0:r0 + rows, c0 // group:c1 // group] = sb
        _scaled_codes(a, n, t, _POW[sb][:, None, :, None], group, "float8_e4m3fn",
                      saturate=True)
        dst = out[r0:r0 + rows, c0:c1]
        _store(dst, n, src, dtype, "float8_e4m3fn")
        nan = amax > np.uint32(0x7F800000)
        if nan.any():                        # x / NaN: every code of the group is NaN
            dst.reshape(rows, -1, group)[nan] = 0x7F


def quantize_mxfp8(x: Any, fmt: MXFP8 = MXFP8(), *, name: str = "tensor",
                   threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of ``x`` in MXFP8, byte for byte vLLM's
    ``_mxfp8_e4m3_quantize_torch(x)`` (see :mod:`xreshard.quant`).

    Args:
        x: bfloat16, float16 or float32 values, at least 2-D, last dim a multiple of 32.
        fmt: ``MXFP8()``.
        name: the tensor's name, for errors.
        threads: worker threads (default :func:`default_threads`).

    Returns:
        float8_e4m3fn codes of ``x``'s shape and uint8 E8M0 scales ``[..., K / 32]``.
    """
    x, dtype = _as_input(x, fmt, name)
    codes = np.empty(x.shape, np.uint8)
    scales: Any = np.empty(fmt.scale_shape(x.shape), np.uint8)
    mat = x.reshape(-1, x.shape[-1])
    out2, sc2 = codes.reshape(mat.shape), scales.reshape(mat.shape[0], -1)
    rows = 128
    jobs = list(range(0, mat.shape[0], rows))
    _run(jobs, lambda r0, ws: _mx_rows(mat, dtype, r0, rows, out2, sc2, ws),
         rows, _chunk_width(rows, MXFP8.group), threads)
    return codes.view(numpy_dtype(fmt.dtype)), scales


# ---------------------------------------------------------------------------- back

def dequantize(codes: Any, scales: Any, fmt: Any) -> np.ndarray:
    """float32 values of ``codes`` and ``scales`` in ``fmt``: what a kernel multiplies
    with (``code * scale`` per block; ``code * 2**(scale - 127)`` for MXFP8)."""
    codes = np.asarray(codes)
    values = codes.view(numpy_dtype(fmt.dtype)).astype(np.float32)
    scales = np.asarray(scales)
    if isinstance(fmt, MXFP8):
        mult = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    else:
        mult = scales.astype(np.float32)
    blk = fmt.block_shape(codes.ndim)
    for d, b in enumerate(blk):
        if b > 1:
            mult = np.repeat(mult, b, axis=d)
    return values * mult[tuple(slice(0, n) for n in codes.shape)]
