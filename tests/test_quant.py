"""Quantizers (xreshard.quant) byte for byte against each other and against vLLM's own.

The references are vLLM 0.32's functions, called here on the same inputs:
``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, torch.compile'd, as vLLM runs it)
and ``mxfp8_e4m3_quantize`` (the custom op, which on a CPU runs
``_mxfp8_e4m3_quantize_torch``). NaN codes are compared as NaN: the sign vLLM gives a
NaN is the hardware's (see xreshard.quant); every other byte is compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xreshard.ir.formats import BlockFP8, FormatError, MXFP8
from xreshard.quant import host

from .vllm_cases import importorskip_vllm

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

BF16 = ml_dtypes.bfloat16
FORMATS = [BlockFP8(), BlockFP8(ue8m0=True), BlockFP8((64, 32), "float8_e4m3fnuz"),
           BlockFP8((1, 2))]
SPECIALS = np.array([0.0, -0.0, 1e-40, -1e-39, 9.2e-41, 448.0, -448.0, 3.3895e38,
                     -3.3895e38, 1e-4, 65504.0, 2.0 ** -126, -2.0 ** -133], np.float32)


def as_torch(x: np.ndarray):
    """A torch tensor of ``x``'s values (bf16 through its bits)."""
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def raw(a) -> np.ndarray:
    """Bytes of codes or scales (numpy, jax or torch) as unsigned ints."""
    if isinstance(a, torch.Tensor):
        a = a.view(torch.uint8).numpy() if a.element_size() == 1 else \
            a.contiguous().numpy().view(np.uint32)
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_same(got, want, nan_code: int | None = None, what: str = "codes") -> None:
    """Equal bytes; with ``nan_code``, a NaN code of either sign in ``want`` matches it."""
    got, want = raw(got), raw(want)
    assert got.shape == want.shape, what
    bad = got != want
    if nan_code is not None:
        bad &= ~((got == nan_code) & ((want & 0x7F) == (nan_code & 0x7F)))
    if want.dtype == np.uint32:          # a NaN scale matches any NaN
        bad &= ~(((got & 0x7FFFFFFF) > 0x7F800000) & ((want & 0x7FFFFFFF) > 0x7F800000))
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} differ, first at " \
        f"{np.argwhere(bad)[0].tolist()}: {got[bad][:4]} vs {want[bad][:4]}"


def weights(rng, shape, dtype=BF16, spread: float = 0.0) -> np.ndarray:
    """N(0, 0.02) weights, rows scaled by 2**U(-spread, spread), some special values."""
    x = rng.standard_normal(shape) * 0.02 * np.exp2(rng.uniform(-spread, spread,
                                                                 shape[:-1] + (1,)))
    flat = x.reshape(-1)
    k = min(len(SPECIALS), flat.size // 3)
    flat[rng.choice(flat.size, k, replace=False)] = SPECIALS[:k]
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype)


# ---------------------------------------------------------------------------- vLLM

def vllm_block(x: np.ndarray, fmt: BlockFP8):
    """vLLM's own per_block_cast_to_fp8 per matrix (its fnuz platform patched in)."""
    importorskip_vllm()
    from vllm.utils import deep_gemm

    fn = deep_gemm.per_block_cast_to_fp8
    t = as_torch(x)
    if fmt.dtype == "float8_e4m3fnuz":      # the ROCm MI300 path, eagerly (no recompile)
        from vllm.platforms import current_platform
        fn = fn._torchdynamo_orig_callable
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(current_platform), "fp8_dtype", lambda self=None: torch.float8_e4m3fnuz)
            mp.setattr(type(current_platform), "is_fp8_fnuz", lambda self=None: True)
            return _per_matrix(fn, t, fmt)
    return _per_matrix(fn, t, fmt)


def _per_matrix(fn, t, fmt):
    mats = t.reshape((-1,) + tuple(t.shape[-2:]))
    outs = [fn(m, list(fmt.block), use_ue8m0=fmt.ue8m0) for m in mats]
    codes = torch.stack([o[0] for o in outs]).reshape(t.shape)
    scales = torch.stack([o[1] for o in outs])
    return codes, scales.reshape(tuple(t.shape[:-2]) + tuple(scales.shape[-2:]))


def vllm_mxfp8(x: np.ndarray):
    importorskip_vllm()
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

    return mxfp8_e4m3_quantize(as_torch(x))


def nan_code(fmt) -> int:
    return 0x80 if fmt.dtype == "float8_e4m3fnuz" else 0x7F


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", [(300, 200), pytest.param((256, 512), marks=pytest.mark.slow),
                                   pytest.param((1, 1), marks=pytest.mark.slow),
                                   pytest.param((129, 257), marks=pytest.mark.slow),
                                   pytest.param((3, 130, 140), marks=pytest.mark.slow)])
def test_block_fp8_equals_vllm_per_block_cast_to_fp8(fmt, shape):
    x = weights(np.random.default_rng(sum(shape)), shape, spread=6)
    codes, scales = host.quantize_block_fp8(x, fmt)
    want_codes, want_scales = vllm_block(x, fmt)
    assert_same(codes, want_codes, nan_code(fmt))
    assert_same(scales, want_scales, what="scales")
    assert codes.dtype == np.dtype(getattr(ml_dtypes, fmt.dtype))
    assert scales.shape == fmt.scale_shape(shape)


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_mxfp8_equals_vllm_mxfp8_e4m3_quantize(dtype):
    rng = np.random.default_rng(1)
    spread = 10 if dtype == np.float16 else 60
    x = weights(rng, (3, 100, 256), dtype, spread=spread)
    codes, scales = host.quantize_mxfp8(x)
    want_codes, want_scales = vllm_mxfp8(x)
    assert_same(codes, want_codes, 0x7F)
    assert_same(scales, want_scales, what="scales")


@pytest.mark.slow
def test_every_bf16_amax_gives_vllms_scale():
    """Every finite bf16 magnitude as the amax of a group/block: the scale (and the
    codes of the group) are vLLM's - including ceil(log2) near powers of two."""
    mags = np.arange(0, 0x7F80, dtype=np.uint16)
    x = np.zeros((mags.size, 32), np.uint16)
    x[:, 0], x[:, 1], x[:, 2], x[:, 3] = mags, mags >> 1, mags | 0x8000, (mags * 7) % 0x7F80
    x = x.view(BF16)
    codes, scales = host.quantize_mxfp8(x)
    want = vllm_mxfp8(x)
    assert_same(codes, want[0], 0x7F)
    assert_same(scales, want[1], what="scales")
    pairs = x[:, :2].copy()            # block (1, 2): one block per bf16 amax
    for fmt in (BlockFP8((1, 2)), BlockFP8((1, 2), ue8m0=True)):
        codes, scales = host.quantize_block_fp8(pairs, fmt)
        want = vllm_block(pairs, fmt)
        assert_same(codes, want[0], 0x7F)
        assert_same(scales, want[1], what="scales")


def test_nan_and_infinity_blocks():
    """A NaN makes its block (group) NaN with a NaN scale; an infinity gives scale inf,
    zeros around it and NaN (inf * 0) at it - as vLLM; NaN codes are canonical."""
    x = np.full((256, 256), 0.01, np.float32)
    x[3, 5] = np.nan
    x[130, 7] = np.inf
    x[131, 8] = -np.inf
    x[200, 200] = -3.0
    x = x.astype(BF16)
    codes, scales = host.quantize_block_fp8(x)
    assert np.isnan(scales[0, 0]) and scales[1, 0] == np.inf
    c = raw(codes)
    assert (c[:128, :128] == 0x7F).all()
    assert c[130, 7] == 0x7F and c[131, 8] == 0x7F and c[130, 9] == 0 and c[129, 0] == 0
    assert_same(codes, vllm_block(x, BlockFP8())[0], 0x7F)
    mx_codes, mx_scales = host.quantize_mxfp8(x)
    want = vllm_mxfp8(x)
    assert_same(mx_codes, want[0], 0x7F)
    assert_same(mx_scales, want[1], what="scales")
    assert mx_scales[3, 0] == 0 and mx_scales[130, 0] == 254
    assert raw(mx_codes)[130, 7] == 0x7E and raw(mx_codes)[131, 8] == 0xFE   # +-448


def test_zero_blocks_take_the_amax_clamp():
    x = np.zeros((128, 256), BF16)
    x[:, 128:] = np.float32(1e-6).astype(BF16)
    codes, scales = host.quantize_block_fp8(x)
    assert scales.tolist() == [[np.float32(1e-4) / np.float32(448.0)] * 2]
    assert not raw(codes)[:, :128].any()
    assert (codes[:, 128:].astype(np.float32) == 4.5).all()       # 1e-6 * 448 / 1e-4
    assert (host.quantize_mxfp8(np.zeros((2, 64), BF16))[1] == 0).all()


# ---------------------------------------------------------------------------- the pieces

@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_cast_equals_torchs_on_a_dense_sample_of_float32(dtype):
    """torch's float32 -> fp8 cast (saturating e4m3fn; fnuz's NaN past 256), on every
    4099th float32 bit pattern of both signs (and the neighbours of each code's midpoint)."""
    bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    mids = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, dtype)).astype(np.float32)
    mids = mids[np.isfinite(mids)]
    mids = np.unique((mids[:-1] + mids[1:]) / 2).view(np.uint32)
    near = (mids[:, None].astype(np.int64) + np.arange(-2, 3)).astype(np.uint32).ravel()
    v = np.concatenate([bits, near, near | np.uint32(0x80000000)]).view(np.float32)
    want = torch.from_numpy(v.copy()).to(getattr(torch, dtype)).view(torch.uint8).numpy()
    assert_same(host.e4m3_codes(v, dtype), want, 0x80 if "fnuz" in dtype else 0x7F)


def test_ceil_log2_equals_torchs_float32_log2_near_powers_of_two():
    k = np.arange(-149, 128)
    frac = np.concatenate([np.arange(0, 64), (np.array(host.ceil_log2_thresholds()) +
                                              np.arange(-2, 3)[:, None]).ravel()]).astype(np.int64)
    frac = np.unique(frac[(frac >= 0) & (frac < 1 << 23)])
    y = np.ldexp(1.0 + frac[None, :] * 2.0 ** -23, k[:, None]).astype(np.float32).ravel()
    y = y[np.isfinite(y) & (y > 0)]
    want = torch.ceil(torch.log2(torch.from_numpy(y))).numpy()
    assert (host.ceil_log2(y) == want).all()


def test_bad_input_is_refused_naming_the_tensor():
    with pytest.raises(FormatError, match="'w1'.*quantizes bfloat16, float16, float32 "
                                          "values, not int8"):
        host.quantize_block_fp8(np.zeros((4, 4), np.int8), name="w1")
    with pytest.raises(FormatError, match="'w2' of shape \\(4, 40\\).*40 % 32 != 0"):
        host.quantize_mxfp8(np.zeros((4, 40), np.float32), name="w2")
    with pytest.raises(FormatError, match="at least 2 dims"):
        host.quantize_block_fp8(np.zeros(4, np.float32), name="w3")


def test_dequantize_is_close_to_the_values():
    x = weights(np.random.default_rng(3), (256, 384), spread=2)
    x[np.abs(x.astype(np.float32)) > 1e30] = 0
    for fmt, quant in ((BlockFP8(), host.quantize_block_fp8), (MXFP8(), host.quantize_mxfp8)):
        codes, scales = quant(x, fmt)
        back = host.dequantize(codes, scales, fmt)
        xf = x.astype(np.float32)
        err = np.abs(back - xf)     # half an ulp of 3 mantissa bits, or of a subnormal code
        assert (err <= np.abs(xf) * 2 ** -4 + np.abs(xf).max() * 2 ** -18).all(), fmt


# ---------------------------------------------------------------------------- three implementations

def _jax():
    return pytest.importorskip("jax")


def all_three(x: np.ndarray, fmt):
    """(numpy, jax, torch-ops) results for ``x`` in ``fmt``."""
    jax = _jax()
    from xreshard.quant import jax_ops, torch_ops

    return [host.quantize_block_fp8(x, fmt) if isinstance(fmt, BlockFP8) else
            host.quantize_mxfp8(x, fmt),
            jax_ops.quantize(jax.numpy.asarray(x), fmt),
            torch_ops.quantize(as_torch(x), fmt, ops="torch")]


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), lead=st.integers(0, 2),
       spread=st.floats(0, 60), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       fmt=st.sampled_from(FORMATS + [MXFP8()]))
def test_numpy_jax_and_torch_give_vllms_bytes(rows, cols, lead, spread, seed, dtype, fmt):
    """Random shapes (ragged tails, stacked experts), magnitudes and special values: the
    three implementations agree byte for byte, and with vLLM's function."""
    if isinstance(fmt, MXFP8):
        cols = -(-cols // 32) * 32
    shape = (2,) * lead + (rows, cols)
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = weights(np.random.default_rng(seed), shape, dt,
                spread=min(spread, 8) if dtype == "float16" else spread)
    (codes, scales), *others = all_three(x, fmt)
    for got_codes, got_scales in others:
        assert_same(got_codes, codes)
        assert_same(got_scales, scales, what="scales")
    want = vllm_mxfp8(x) if isinstance(fmt, MXFP8) else vllm_block(x, fmt)
    assert_same(codes, want[0], nan_code(fmt))
    assert_same(scales, want[1], what="scales")


@pytest.mark.parametrize("dtype,formats", [
    ("bfloat16", (BlockFP8(), MXFP8())),
    pytest.param("bfloat16", (BlockFP8((1, 32)),), marks=pytest.mark.slow),
    pytest.param("float32", (BlockFP8(), BlockFP8((1, 32)), MXFP8()), marks=pytest.mark.slow),
])
def test_all_three_on_every_special_block(dtype, formats):
    """NaN, infinities, subnormal groups (MXFP8 scales them up to normal floats: XLA
    flushes subnormals, the JAX path must not), bf16 max."""
    x = np.zeros((8, 256), np.float32)
    x[0, :32] = 1e-39                      # a subnormal bf16 group
    x[1, :32] = np.linspace(-2e-38, 2e-38, 32)
    x[2, 0], x[3, 1], x[4, 2] = np.nan, np.inf, -np.inf
    x[5, :] = 3.3895e38
    x[6, 64:96] = 1.6e-36                  # amax / 448 subnormal: scale byte 1 or 0
    x[7, :32] = 2.0 ** -118 * 1.5
    xs = x.astype(BF16 if dtype == "bfloat16" else np.float32)
    for fmt in formats:
        (codes, scales), *others = all_three(xs, fmt)
        for got_codes, got_scales in others:
            assert_same(got_codes, codes)
            assert_same(got_scales, scales, what="scales")
        want = vllm_mxfp8(xs) if isinstance(fmt, MXFP8) else vllm_block(xs, fmt)
        assert_same(codes, want[0], 0x7F)
        assert_same(scales, want[1], what="scales")


def test_jax_quantizes_on_the_arrays_devices_and_per_shard():
    """A sharded array quantizes as the global tensor; each shard's own (block-aligned)
    data quantizes on its device to the same bytes - what a sender does in a refit."""
    jax = _jax()
    from jax.sharding import NamedSharding, PartitionSpec as P

    from xreshard.quant import jax_ops, quantize

    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 JAX devices")
    x = weights(np.random.default_rng(5), (256, 512))
    mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
    arr = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    codes, scales = quantize(arr, BlockFP8())
    want_codes, want_scales = host.quantize_block_fp8(x)
    assert_same(codes, want_codes)
    assert_same(scales, want_scales, what="scales")
    for shard in arr.addressable_shards:
        c, s = jax_ops.quantize(shard.data, BlockFP8())
        assert c.devices() == {shard.device} and s.devices() == {shard.device}
        cols = shard.index[1]
        assert_same(c, want_codes[:, cols])
        assert_same(s, want_scales[:, cols.start // 128:cols.stop // 128], what="scales")


def test_quantize_dispatches_on_where_the_values_live():
    from xreshard.quant import quantize

    x = weights(np.random.default_rng(6), (128, 256))
    want = host.quantize_block_fp8(x)
    got = quantize(as_torch(x), BlockFP8())
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == torch.float8_e4m3fn
    assert_same(got[0], want[0])
    assert_same(quantize(x, BlockFP8())[0], want[0])
