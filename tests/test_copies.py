"""The transposing copy (``runtime/copies.py``): every byte of a transposed Flax kernel
copied exactly, through square tiles and through the scratch block that power-of-two
strides take (``benchmarks/bench_transpose.py`` times them)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import xreshard as xr
from xreshard.dtypes import numpy_dtype
from xreshard.planner.schedule import peer_counts, schedule
from xreshard.runtime import copies
from xreshard.runtime.copies import copy_into
from xreshard.runtime.execute import Executor
from xreshard.tools.testing import local_arrays_from_global
from xreshard.transport.base import RecordingTransport
from xreshard.transport.local import LocalTransport

BITS = {"bfloat16": np.uint16, "float32": np.uint32}


def _kernel(rng, shape, dtype):
    """Random bits of ``dtype`` (NaN payloads and all) in a row-major array."""
    bits = BITS[dtype]
    return rng.integers(0, np.iinfo(bits).max, shape, dtype=bits, endpoint=True).view(
        numpy_dtype(dtype))


# (the row-major kernel's shape, the region of its transpose copied, dtype, whether packing
# it / unpacking into it takes the scratch block: the pitch of the side read down its
# columns (the kernel's when packing, the region's in staging when unpacking) is a multiple
# of 1 KiB for bf16 tiles, 2 KiB for fp32 ones); every region exceeds 256 x 256 elements
# (smaller ones are one numpy copy)
CASES = [
    ((1024, 129), np.s_[:, :], "bfloat16", False, True),     # pitch 258 B / 2 KiB
    ((513, 300), np.s_[:, :], "float32", False, False),      # 1200 B / 2052 B
    ((513, 512), np.s_[:, :], "bfloat16", True, False),      # 512 x 513: one past a chunk
    ((1000, 512), np.s_[:, :], "float32", True, False),      # 512 x 1000, fp32, 2 KiB
    ((700, 256), np.s_[:, :], "float32", False, False),      # 1 KiB pitch: fp32 tiles
    ((512, 640), np.s_[:, :], "bfloat16", False, True),      # 640 x 512
    ((1537, 4096), np.s_[10:139, 3:900], "bfloat16", True, False),  # 129 x 897, 8 KiB pitch
    ((1100, 4096), np.s_[7:300, 1:1025], "bfloat16", True, True),    # 293 x 1024, 2 B in
    ((1, 66048), np.s_[:, :], "bfloat16", True, False),      # one column
    ((70001, 512), np.s_[:1, :], "bfloat16", True, False),   # one row
    ((130, 512), np.s_[1:, 1:], "bfloat16", True, False),    # 511 x 129, starts 2 B in
]


@pytest.mark.parametrize("kshape, region, dtype, scratch, _", CASES)
def test_a_transposed_source_is_packed_bit_exact(kshape, region, dtype, scratch, _):
    """The sender's direction: a [in, out] kernel's transpose into row-major staging, as
    the same dtype (bits: NaN payloads kept) and typed as raw bits on either side."""
    rng = np.random.default_rng(1)
    src = _kernel(rng, kshape, dtype).T[region]
    assert src.size > 256 * 256
    want = np.ascontiguousarray(src).view(BITS[dtype])
    assert copies._through_scratch(np.empty(src.shape, src.dtype), src) == scratch
    for out_view, src_view in ((None, None), (BITS[dtype], None), (None, BITS[dtype])):
        out = np.full(src.shape, 7, numpy_dtype(dtype))
        o = out if out_view is None else out.view(out_view)
        s = src if src_view is None else src.view(src_view)
        copy_into(np, o, dtype, s, dtype)
        assert out.view(BITS[dtype]).tobytes() == want.tobytes()


@pytest.mark.parametrize("kshape, region, dtype, _, scratch", CASES)
def test_a_transposed_destination_is_unpacked_bit_exact(kshape, region, dtype, _, scratch):
    """The receiver's direction: row-major staging into a kernel's transposed view, only
    the region's bytes written (the rest of the kernel keeps its bytes)."""
    rng = np.random.default_rng(2)
    kernel = np.full(kshape, 7, BITS[dtype])
    dst = kernel.T[region]
    src = _kernel(rng, dst.shape, dtype)
    assert copies._through_scratch(dst.T, src.T) == scratch
    copy_into(np, dst.view(numpy_dtype(dtype)), dtype, src, dtype)
    assert np.ascontiguousarray(dst).tobytes() == src.view(BITS[dtype]).tobytes()
    untouched = np.ones(kshape, bool)
    untouched.T[region] = False
    assert (kernel[untouched] == 7).all()


@pytest.mark.parametrize("kshape, region", [((1000, 512), np.s_[:, :]),
                                            ((1537, 1024), np.s_[10:139, 3:900]),
                                            ((300, 513), np.s_[:, :])])
def test_a_transposing_copy_that_casts_gives_numpys_values(kshape, region):
    """fp32 -> bf16 on the way out (a wire dtype) and bf16 -> fp32 on the way in, through
    both tilings: the bytes of numpy's own cast of the same values."""
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal(kshape, dtype=np.float32).T[region]
    out = np.empty(f32.shape, ml_dtypes.bfloat16)
    copy_into(np, out, "bfloat16", f32, "float32")
    want = np.ascontiguousarray(f32).astype(ml_dtypes.bfloat16)
    assert out.tobytes() == want.tobytes()
    back = np.zeros(kshape, np.float32).T[region]
    copy_into(np, back, "float32", out, "bfloat16")
    assert np.ascontiguousarray(back).tobytes() == want.astype(np.float32).tobytes()


def test_both_sides_transposed_is_a_plain_copy_of_the_same_bytes():
    rng = np.random.default_rng(4)
    src = _kernel(rng, (512, 640), "bfloat16").T
    kernel = np.zeros((512, 640), np.uint16)
    copy_into(np, kernel.T, "bfloat16", src, "bfloat16")
    assert kernel.tobytes() == src.T.view(np.uint16).tobytes()


@pytest.mark.parametrize("dtype, wire", [("bfloat16", None), ("float32", "bfloat16")])
def test_refit_of_transposed_kernels_on_both_sides_is_bit_exact(dtype, wire):
    """Executor, every rank in this process: a [1024, 1024] weight held as transposed
    kernels by both sides (TP=2 on rows -> TP=2 on columns), so the sender packs and the
    receiver unpacks through the scratch block (1 KiB strides), with and without a cast
    to the wire dtype."""
    shape = (1024, 1024)
    src = {"w": xr.Layout.from_placements(shape, dtype, xr.Mesh((2,), (0, 1)), ["S0"])}
    dst = {"w": xr.Layout.from_placements(shape, dtype, xr.Mesh((2,), (2, 3)), ["S1"])}
    plan = xr.plan(src, dst, wire_dtype=wire)
    ranks = [0, 1, 2, 3]
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=1 << 20,
                     staging_bytes=1 << 23)
    rng = np.random.default_rng(5)
    value = rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtype(dtype))
    src_b = {(r, "w"): np.ascontiguousarray(local_arrays_from_global(src["w"], r, value).T).T
             for r in (0, 1)}
    dst_b = {(r, "w"): np.zeros(dst["w"].local_shape(r)[::-1], numpy_dtype(dtype)).T
             for r in (2, 3)}
    for a in src_b.values():
        assert copies._through_scratch(np.empty((512, 512), a.dtype), a[:, :512])
    for pipeline in (True, False):
        for a in dst_b.values():
            a[...] = 0
        Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                 RecordingTransport(LocalTransport(ranks)), timeout=10,
                 pipeline=pipeline).run()
        on_wire = value.astype(numpy_dtype(wire)) if wire else value
        for r in (2, 3):
            want = local_arrays_from_global(dst["w"], r, on_wire.astype(numpy_dtype(dtype)))
            assert np.ascontiguousarray(dst_b[(r, "w")]).tobytes() == want.tobytes(), \
                (pipeline, r)
