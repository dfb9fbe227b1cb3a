"""Quantizing ``jax.Array``s where they live: one jitted function per shape and format.

The same integer formulation as :mod:`xreshard.quant.host` (magnitude bits, an integer
``amax``, torch's float32 -> e4m3 cast as bit arithmetic), so XLA fuses it into one loop
over the array on its own devices: no host round trip, no float8 cast of XLA's own (its
overflow rule is not torch's saturation).

XLA's CPU code flushes subnormal float32 operands and results to zero (vLLM's torch code
does not), so nothing subnormal is ever computed with here:

* block FP8 is immune: a subnormal ``x`` times ``1 / scale`` (at most 448 / 1e-4) is far
  below e4m3's smallest code either way, and ``amax`` is clamped to 1e-4;
* MXFP8 scales a group by up to ``2**127``, which makes subnormal inputs normal: a
  subnormal ``x`` is rebuilt from its integer mantissa times ``2**-100`` and every power
  of two is applied in two normal halves; the scale byte of a group whose ``amax / 448``
  is subnormal is computed from ``amax``'s integer significand.

Divisions are where backends differ: XLA's GPU backend compiles float32 division to
``div.full.f32`` (``-nvptx-prec-divf32=1``, not correctly rounded), vLLM's torch divides as
IEEE does. So no float is divided on the device: block FP8's per-block ``amax / fp8_max``
and ``1 / scale`` run on the host with numpy (one uint32 per 128 x 128 block goes down, two
float32 come back: one small round trip per tensor), and MXFP8's ``amax / 448`` is an
integer division rounded as IEEE's (:func:`div_exact_bits`; its scale is a power of two,
so the codes only multiply). The bytes are vLLM's on every backend.

A sharded array is quantized as one global tensor (XLA partitions the jitted function;
shard edges off the block grid make it communicate). A refit quantizes each addressable
shard's whole blocks on that shard's device: ``quantize(shard.data, fmt)``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..ir.formats import QUANTIZABLE, BlockFP8, FormatError, MXFP8
from .host import CAST, ceil_log2_thresholds

__all__ = ["block_scales_on_host", "div_exact_bits", "quantize", "quantize_block_fp8",
           "quantize_bf16_bits", "quantize_mxfp8"]


def _import_jax() -> Any:
    from ..extras import require
    return require("jax", "jax", "quantizing jax.Arrays")


def quantize(x: Any, fmt: Any, *, name: str = "tensor") -> tuple[Any, Any]:
    """``(codes, scales)`` of the ``jax.Array`` ``x`` in ``fmt``, on ``x``'s devices."""
    if isinstance(fmt, MXFP8):
        return quantize_mxfp8(x, fmt, name=name)
    if isinstance(fmt, BlockFP8):
        return quantize_block_fp8(x, fmt, name=name)
    raise FormatError(f"{name!r}: {fmt!r} is not a quantized format (BlockFP8 or MXFP8)")


def _check(x: Any, fmt: Any, name: str) -> str:
    dtype = dtype_name(x.dtype)
    if dtype not in QUANTIZABLE:
        raise FormatError(f"{name!r}: {fmt} quantizes {', '.join(QUANTIZABLE)} values, not "
                          f"{dtype} - cast first (to the dtype the trainer exports)")
    fmt.check_shape(x.shape, name)
    return dtype


def quantize_block_fp8(x: Any, fmt: BlockFP8 = BlockFP8(), *, name: str = "tensor"
                       ) -> tuple[Any, Any]:
    """Block FP8 of ``x`` (see :func:`xreshard.quant.host.quantize_block_fp8`): codes as
    ``fmt.dtype`` and float32 scale-inverses, jitted, on ``x``'s devices."""
    _check(x, fmt, name)
    return _block_fn(fmt)(x)


def quantize_bf16_bits(bits: Any, fmt: BlockFP8 = BlockFP8()) -> tuple[Any, Any]:
    """:func:`quantize_block_fp8` of bf16 values given as their uint16 bits (a host buffer
    imported without a copy: DLPack carries no bfloat16)."""
    return _block_fn(fmt)(bits)


def quantize_mxfp8(x: Any, fmt: MXFP8 = MXFP8(), *, name: str = "tensor") -> tuple[Any, Any]:
    """MXFP8 of ``x`` (see :func:`xreshard.quant.host.quantize_mxfp8`): e4m3fn codes and
    uint8 scales ``[..., K / 32]``, jitted, on ``x``'s devices."""
    _check(x, fmt, name)
    return _mx_fn(float(fmt.fp8_max))(x)


def block_scales_on_host(amax_bits: np.ndarray, fmt: BlockFP8) -> tuple[np.ndarray, np.ndarray]:
    """``(scales, inverses)`` of per-block amax bits, with numpy's IEEE division: the
    host quantizer's scales (:func:`xreshard.quant.host.block_scales`, vLLM's
    ``clamp(1e-4) / fp8_max``) and ``1 / scale`` (0 for a block that is not finite)."""
    from .host import block_scales
    sf = block_scales(np.ascontiguousarray(amax_bits, np.uint32), fmt)
    finite = amax_bits < np.uint32(0x7F800000)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(finite, np.float32(1.0) / np.where(finite, sf, np.float32(1.0)),
                       np.float32(0.0)).astype(np.float32)
    return sf, inv


def div_exact_bits(jnp: Any, lax: Any, a: Any, divisor: float) -> Any:
    """float32 bits of ``a / divisor`` rounded as IEEE division rounds (to nearest, ties
    to even), in integer arithmetic: XLA's GPU backend compiles float32 division to
    ``div.full.f32`` (``-nvptx-prec-divf32=1``: up to 2 ulp off, not correctly rounded),
    so a float division there is not vLLM's (torch's is IEEE).

    ``a``: bits (uint32) of positive normal floats; ``divisor``: ``c * 2**p`` with ``c``
    odd and below 16 (448 = 7 * 2**6, 240 = 15 * 2**4, 57344 = 7 * 2**13). Quotients that
    are not normal floats (below 2**-126) are the caller's to handle."""
    c, p = _odd_part(divisor)
    e = (a >> 23).astype(jnp.int32)
    n = ((a & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)) << 5      # < 2**29
    q = n // jnp.uint32(c)                                              # >= 2**24 for c < 16
    sticky = (n - q * jnp.uint32(c)) != 0
    s = (32 - lax.clz(q).astype(jnp.int32)) - 24                        # 1..5
    su = s.astype(jnp.uint32)
    m = q >> su
    rest = q & ((jnp.uint32(1) << su) - 1)
    half = jnp.uint32(1) << (su - 1)
    up = (rest > half) | ((rest == half) & (sticky | ((m & 1) == 1)))
    m = m + up.astype(jnp.uint32)
    carry = m == jnp.uint32(1 << 24)
    m = jnp.where(carry, jnp.uint32(1 << 23), m)
    e = e - 5 - p + s + carry.astype(jnp.int32)
    return (jnp.maximum(e, 0).astype(jnp.uint32) << 23) | (m & jnp.uint32(0x7FFFFF))


def _odd_part(value: float) -> tuple[int, int]:
    """``(c, p)`` with ``value == c * 2**p``, ``c`` odd and below 16."""
    v, p = int(value), 0
    if v != value or v <= 0:
        raise FormatError(f"fp8_max {value} is not a positive integer")
    while v % 2 == 0:
        v, p = v // 2, p + 1
    if v >= 16:
        raise FormatError(f"fp8_max {value}: the exact division takes c * 2**p, c < 16")
    return v, p


# ---------------------------------------------------------------------------- pieces

def _bits(jnp: Any, lax: Any, x: Any) -> Any:
    """float32 bits of ``x`` (integer ops only: a bf16 subnormal stays exact); uint16 ``x``
    holds bf16 bits."""
    if x.dtype in (jnp.bfloat16, jnp.uint16):
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _cast(jnp: Any, lax: Any, a: Any, dtype: str, saturate: bool) -> Any:
    """torch's float32 -> ``dtype`` cast of non-negative float32 bits ``a`` (no NaN), as
    uint32 magnitude codes (see :func:`xreshard.quant.host.e4m3_codes`)."""
    norm_min, rebias, magic, magic_bits, sat = CAST[dtype][:5]
    n = jnp.maximum(a, jnp.uint32(norm_min))
    n = (n + ((n >> 20) & 1) + jnp.uint32(rebias)) >> 20
    v = lax.bitcast_convert_type(a, jnp.float32) + jnp.float32(magic)
    s = lax.bitcast_convert_type(v, jnp.uint32) - jnp.uint32(magic_bits)
    n = jnp.minimum(n, s)
    return jnp.minimum(n, jnp.uint32(sat)) if saturate else n


def _finish(jnp: Any, lax: Any, code: Any, sign: Any, nan: Any, dtype: str) -> Any:
    """Codes with their signs, NaN where ``nan``, as ``dtype`` (via uint8 bits)."""
    nan_code = CAST[dtype][5]
    if nan_code == 0x80:                        # e4m3fnuz: no negative zero
        sign = jnp.where(code == 0, jnp.uint32(0), sign)
    code = jnp.where(nan, jnp.uint32(nan_code), code | sign).astype(jnp.uint8)
    return lax.bitcast_convert_type(code, getattr(jnp, dtype))


def _ceil_log2(jnp: Any, bits: Any) -> Any:
    """``ceil(log2(y))`` of positive normal float32 ``y`` (its bits) as torch computes it."""
    thr = jnp.asarray(np.asarray(ceil_log2_thresholds(), dtype=np.uint32))
    k = (bits >> 23).astype(jnp.int32) - 127
    frac = bits & jnp.uint32(0x7FFFFF)
    return k + (frac > thr[jnp.clip(k + 149, 0, 276)]).astype(jnp.int32)


# ---------------------------------------------------------------------------- block FP8

def _tree_max(jnp: Any, lax: Any, v: Any, axis: int) -> Any:
    """``v.max(axis)`` as a tree of elementwise maxima: XLA fuses it into one vectorized
    loop, where its own integer reduce runs ~10x slower on CPU."""
    axis %= v.ndim
    while v.shape[axis] > 1:
        n, h = v.shape[axis], v.shape[axis] // 2
        m = jnp.maximum(lax.slice_in_dim(v, 0, h, axis=axis),
                        lax.slice_in_dim(v, h, 2 * h, axis=axis))
        v = m if n % 2 == 0 else jnp.concatenate(
            [m, lax.slice_in_dim(v, 2 * h, n, axis=axis)], axis=axis)
    return jnp.squeeze(v, axis)


def _magnitudes(jnp: Any, lax: Any, x: Any) -> tuple[Any, int]:
    """Magnitude bits of ``x`` as a signed int of its own width (ordered like the
    values, NaN above infinity; small ints reduce fastest), and the shift to float32; uint16
    ``x`` holds bf16 bits."""
    if x.dtype in (jnp.bfloat16, jnp.uint16):
        return lax.bitcast_convert_type(x, jnp.int16) & jnp.int16(0x7FFF), 16
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return b & jnp.int32(0x7FFFFFFF), 0


@functools.cache
def _block_fn(fmt: BlockFP8) -> Any:
    """Two jitted functions, per-block scales then codes: in one, XLA fuses the end of
    the amax tree into the elementwise loop and redoes it per element (5x slower)."""
    jax = _import_jax()
    jnp, lax = jax.numpy, jax.lax
    b0, b1 = fmt.block

    def geometry(x: Any) -> tuple[list, int, int, int, int, list]:
        *lead, m, n = x.shape
        rows, cols = -(-m // b0), -(-n // b1)
        return lead, m, n, rows, cols, [(0, 0)] * len(lead) + [(0, rows * b0 - m),
                                                               (0, cols * b1 - n)]

    def scales(x: Any) -> Any:
        """Per-block amax bits (uint32); the divisions are the host's (see run)."""
        lead, m, n, rows, cols, pad = geometry(x)
        mag, shift = _magnitudes(jnp, lax, x)
        amax = _tree_max(jnp, lax, jnp.pad(mag, pad).reshape(*lead, rows, b0, cols * b1), -2)
        amax = _tree_max(jnp, lax, amax.reshape(*lead, rows, cols, b1), -1)
        return amax.astype(jnp.uint32) << shift

    def codes(x: Any, inv: Any, nan_block: Any) -> Any:
        lead, m, n, rows, cols, pad = geometry(x)
        bits = _bits(jnp, lax, x)
        a = jnp.pad(bits & jnp.uint32(0x7FFFFFFF), pad).reshape(*lead, rows * b0, cols, b1)
        v = lax.bitcast_convert_type(a, jnp.float32) * jnp.repeat(inv, b0, axis=-2)[..., None]
        code = _cast(jnp, lax, lax.bitcast_convert_type(v, jnp.uint32), fmt.dtype, False)
        # a NaN block is all NaN (x * NaN); an infinity in an infinite block is inf * 0
        nan = jnp.repeat(nan_block, b0, axis=-2)[..., None] | (a >= jnp.uint32(0x7F800000))
        code = code.reshape(*lead, rows * b0, cols * b1)[..., :m, :n]
        nan = nan.reshape(*lead, rows * b0, cols * b1)[..., :m, :n]
        return _finish(jnp, lax, code, (bits >> 24) & jnp.uint32(0x80), nan, fmt.dtype)

    scales_fn, codes_fn = jax.jit(scales), jax.jit(codes)

    def run(x: Any) -> tuple[Any, Any]:
        # ``amax / fp8_max`` and ``1 / scale`` with IEEE division, on the host: XLA's GPU
        # division (div.full.f32) is not correctly rounded, vLLM's is. One uint32 per
        # block (1/16384 of the values) goes down and two float32 come back.
        amax = scales_fn(x)
        host = np.asarray(amax)
        sf, inv = block_scales_on_host(host, fmt)
        where = amax.sharding
        return (codes_fn(x, jax.device_put(inv, where),
                         jax.device_put(host > np.uint32(0x7F800000), where)),
                jax.device_put(sf, where))

    return run


# ---------------------------------------------------------------------------- MXFP8

def _mx_scale_bytes(jnp: Any, lax: Any, amax: Any, fp8_max: float) -> Any:
    """E8M0 bytes of per-group amax bits (see :func:`xreshard.quant.host._mx_scale_bytes`),
    subnormal ``amax / 448`` included, without computing a subnormal float; the division
    in integers, rounded as IEEE's (:func:`div_exact_bits`)."""
    tiny = jnp.uint32(0x00800000)
    amax_n = jnp.maximum(amax, tiny)                   # the clamp to float32's tiny
    y = div_exact_bits(jnp, lax, jnp.minimum(amax_n, jnp.uint32(0x7F7FFFFF)), fp8_max)
    sb = _ceil_log2(jnp, y) + 127
    # amax in (448 * 2**-127, 448 * 2**-126): amax / 448 is subnormal, n * 2**-149 with
    # n = round(M * 2**(E + 120) / 7) for amax = M * 2**(E - 23); its float32 log2 rounds
    # up past -127 (scale byte 1) only when n > 2**22 + 11
    low = amax_n < jnp.uint32(0x04E00000)              # 448 * 2**-126 = 1.75 * 2**-118
    e = (amax_n >> 23).astype(jnp.int32) - 127
    q = ((amax_n & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)) << \
        jnp.clip(e + 120, 0, 2).astype(jnp.uint32)
    n_sub = (2 * q + 7) // 14
    sub = jnp.where((e + 120 >= 1) & (n_sub > (1 << 22) + 11), 1, 0)
    sb = jnp.where(low, sub, jnp.clip(sb, 0, 254))
    sb = jnp.where(amax == jnp.uint32(0x7F800000), 254, sb)
    return jnp.where(amax > jnp.uint32(0x7F800000), 0, sb).astype(jnp.int32)


def _pow2(jnp: Any, lax: Any, k: Any) -> Any:
    """2**k as float32 for k in [-126, 127]."""
    return lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


@functools.cache
def _mx_fn(fp8_max: float) -> Any:
    """Scale bytes, then codes, in two jitted functions (as :func:`_block_fn`)."""
    jax = _import_jax()
    jnp, lax = jax.numpy, jax.lax
    group = MXFP8.group

    def scales(x: Any) -> tuple[Any, Any]:
        *lead, k = x.shape
        mag, shift = _magnitudes(jnp, lax, x)
        amax = mag.reshape(*lead, k // group, group).max(axis=-1).astype(jnp.uint32) << shift
        return _mx_scale_bytes(jnp, lax, amax, fp8_max), amax > jnp.uint32(0x7F800000)

    def codes(x: Any, sb: Any, nan_group: Any) -> Any:
        *lead, k = x.shape
        bits = _bits(jnp, lax, x)
        a = (bits & jnp.uint32(0x7FFFFFFF)).reshape(*lead, k // group, group)
        # x * 2**(127 - sb), exact: a subnormal x is its mantissa * 2**-100 * 2**-49, and
        # the power of two is applied in two halves that are both normal floats
        sub = (a >> 23) == 0
        xf = jnp.where(sub, (a & jnp.uint32(0x7FFFFF)).astype(jnp.float32) * _pow2(
            jnp, lax, jnp.int32(-100)), lax.bitcast_convert_type(a, jnp.float32))
        shift = jnp.where(sub, (127 - sb)[..., None] - 49, (127 - sb)[..., None])
        half = shift >> 1
        v = (xf * _pow2(jnp, lax, half)) * _pow2(jnp, lax, shift - half)
        code = _cast(jnp, lax, lax.bitcast_convert_type(v, jnp.uint32), "float8_e4m3fn", True)
        nan = jnp.broadcast_to(nan_group[..., None], a.shape)
        return _finish(jnp, lax, code.reshape(*lead, k), (bits >> 24) & jnp.uint32(0x80),
                       nan.reshape(*lead, k), "float8_e4m3fn")

    scales_fn, codes_fn = jax.jit(scales), jax.jit(codes)

    def run(x: Any) -> tuple[Any, Any]:
        sb, nan_group = scales_fn(x)
        return codes_fn(x, sb, nan_group), sb.astype(jnp.uint8)

    return run
