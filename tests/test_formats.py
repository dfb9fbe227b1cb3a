"""Quantized formats as values (xreshard.ir.formats): validation, JSON, block geometry,
layouts checked against the format, and the torch declaration of a quantized destination."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from xreshard.ir.formats import (BlockFP8, FormatError, MXFP8, QuantizedTensor,
                                 format_from_dict)
from xreshard.ir.layout import Layout, Mesh, Region


def test_formats_validate_and_round_trip_through_json():
    for fmt in (BlockFP8(), BlockFP8((64, 32), "float8_e4m3fnuz", True), MXFP8()):
        assert format_from_dict(json.loads(json.dumps(fmt.to_dict()))) == fmt
        assert hash(format_from_dict(fmt.to_dict())) == hash(fmt)
    assert str(BlockFP8()) == "block_fp8(128x128)" and str(MXFP8()) == "mxfp8"
    assert BlockFP8([128, 128]) == BlockFP8()                  # lists from JSON
    for bad, match in (((128, 0), "two positive ints"), ((128,), "two positive ints"),
                       ((128.0, 128), "two positive ints")):
        with pytest.raises(FormatError, match=match):
            BlockFP8(bad)
    with pytest.raises(FormatError, match="codes must be one of"):
        BlockFP8(dtype="bfloat16")
    with pytest.raises(FormatError, match="MXFP8 codes are float8_e4m3fn"):
        MXFP8("float8_e4m3fnuz")
    with pytest.raises(FormatError, match="unknown quantized format"):
        format_from_dict({"format": "nvfp4"})
    assert BlockFP8().fp8_max == 448.0 and BlockFP8(dtype="float8_e4m3fnuz").fp8_max == 224.0


def test_geometry_of_a_ragged_tensor():
    fmt, shape = BlockFP8(), (300, 256)
    assert fmt.scale_shape(shape) == (3, 2)
    r = Region.of([(0, 200), (0, 128)])
    assert str(fmt.blocks(r, shape)) == "[0:2, 0:1]"
    assert str(fmt.whole_blocks(r, shape)) == "[0:1, 0:1]"
    assert not fmt.is_aligned(r, shape)
    tail = Region.of([(256, 300), (0, 256)])                 # the partial tail block row
    assert fmt.is_aligned(tail, shape) and str(fmt.scale_region(tail, shape)) == "[2:3, 0:2]"
    assert str(fmt.data_region(Region.of([(2, 3), (1, 2)]), shape)) == "[256:300, 128:256]"
    assert fmt.whole_blocks(Region.of([(1, 127), (0, 256)]), shape) is None
    with pytest.raises(FormatError, match="'w' of shape \\(300, 256\\): region \\[0:200, "
                                          "0:128\\] cuts a 128-wide block of dim 0"):
        fmt.scale_region(r, shape, "w")
    experts = (4, 256, 128)                                  # stacked: per expert blocks
    assert fmt.scale_shape(experts) == (4, 2, 1) and fmt.block_shape(3) == (1, 128, 128)
    assert MXFP8().scale_shape((4, 64)) == (4, 2)
    with pytest.raises(FormatError, match="40 % 32 != 0"):
        MXFP8().scale_shape((4, 40))
    assert fmt.wire_bytes((256, 256)) == 256 * 256 + 4 * 4
    assert fmt.wire_bytes((256, 256)) / (256 * 256 * 2) < 0.52


@settings(deadline=None)
@given(shape=st.tuples(st.integers(1, 700), st.integers(1, 700)),
       a=st.tuples(st.integers(0, 700), st.integers(0, 700)),
       b=st.tuples(st.integers(0, 700), st.integers(0, 700)),
       block=st.sampled_from([(128, 128), (1, 32), (64, 96)]))
def test_geometry_properties(shape, a, b, block):
    """blocks covers the region, whole_blocks lies inside it, and a region is aligned iff
    it is exactly the elements of its blocks."""
    fmt = BlockFP8(block)
    starts = tuple(min(x, y, n - 1) for x, y, n in zip(a, b, shape))
    stops = tuple(max(min(max(x, y), n), s + 1) for x, y, n, s in zip(a, b, shape, starts))
    r = Region(starts, stops)
    cover = fmt.data_region(fmt.blocks(r, shape), shape)
    assert cover.contains(r)
    inner = fmt.whole_blocks(r, shape)
    if inner is not None:
        assert r.contains(fmt.data_region(inner, shape))
    assert fmt.is_aligned(r, shape) == (cover == r)
    if fmt.is_aligned(r, shape):
        assert inner == fmt.scale_region(r, shape)
    rows, cols = fmt.scale_shape(shape)               # block rows tile the tensor exactly
    assert sum(fmt.data_region(Region.of([(i, i + 1), (0, cols)]), shape).size
               for i in range(rows)) == math.prod(shape)


def _tp(shape, dtype, n, placements):
    return Layout.from_placements(shape, dtype, Mesh((n,), axis_names=("tp",)), placements)


def test_layouts_are_checked_against_the_format():
    q = QuantizedTensor("w", "w_scale_inv", BlockFP8(), (512, 256))
    assert QuantizedTensor.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    q.check_layouts(_tp((512, 256), "float8_e4m3fn", 4, ["S0"]),
                    _tp((4, 2), "float32", 4, ["S0"]))
    q.check_layouts(_tp((512, 256), "float8_e4m3fn", 2, ["S1"]),
                    _tp((4, 2), "float32", 2, ["S1"]))
    with pytest.raises(FormatError, match="region \\[0:64, 0:256\\] cuts a 128-wide block"):
        q.check_layouts(_tp((512, 256), "float8_e4m3fn", 8, ["S0"]),
                        _tp((4, 2), "float32", 4, ["S0"]))
    with pytest.raises(FormatError, match="'w_scale_inv' on rank 0 holds \\['\\[0:4, 0:2\\]'\\] "
                                          "but the blocks of 'w' there need scales"):
        q.check_layouts(_tp((512, 256), "float8_e4m3fn", 2, ["S0"]),
                        _tp((4, 2), "float32", 2, ["R"]))
    with pytest.raises(FormatError, match="'w_scale_inv'.*has layout \\(4, 2\\) bfloat16; "
                                          "expected \\(4, 2\\) float32"):
        q.check_layouts(_tp((512, 256), "float8_e4m3fn", 2, ["S0"]),
                        _tp((4, 2), "bfloat16", 2, ["S0"]))
    with pytest.raises(FormatError, match="'w': its layout is \\(512, 256\\) bfloat16 but "
                                          "block_fp8\\(128x128\\) stores it as"):
        q.check_layouts(_tp((512, 256), "bfloat16", 2, ["S0"]),
                        _tp((4, 2), "float32", 2, ["S0"]))
    q.check_offer("bfloat16")
    with pytest.raises(FormatError, match="'w' is stored as block_fp8\\(128x128\\): it can be "
                                          "filled from bfloat16, float16, float32 values"):
        q.check_offer("int8")
    with pytest.raises(FormatError, match="requested"):
        q.check_request(BlockFP8(ue8m0=True))
    with pytest.raises(FormatError, match="needs a scale tensor of its own name"):
        QuantizedTensor("w", "w", BlockFP8(), (4, 4))


# ---------------------------------------------------------------------------- torch

def test_torch_declares_a_quantized_destination():
    torch = pytest.importorskip("torch")
    from xreshard.adapters.torch import Quantized, Sharded, bind, quantized_layouts
    from xreshard.quant import quantize

    w = (torch.randn(300, 256) * 0.02).to(torch.bfloat16)
    codes, scales = quantize(w, BlockFP8())
    qt, codes_layout, scales_layout = quantized_layouts("w", Quantized(codes, scales))
    assert str(qt) == "w [300, 256] as block_fp8(128x128) (scales w_scale_inv)"
    assert codes_layout.dtype == "float8_e4m3fn" and scales_layout.shape == (3, 2)
    mesh = Mesh((2,), (0, 1), ("tp",))
    ok = Quantized(Sharded(codes[:128], mesh, ["S0"], (256, 256)),
                   Sharded(scales[:1], mesh, ["S0"], (2, 2)))
    assert quantized_layouts("w", ok)[0].scale_shape == (2, 2)
    cut = Quantized(Sharded(codes[:150], mesh, ["S0"], (300, 256)),
                    Sharded(scales[:2], mesh, ["S0"], (3, 2)))
    with pytest.raises(FormatError, match="region \\[0:150, 0:256\\] cuts a 128-wide block"):
        quantized_layouts("w", cut)
    bound = bind({"layer.w": Quantized(codes, scales)}, "receive", ranks=None, local_ranks=[0])
    assert bound.errors == [] and sorted(bound.layouts) == ["layer.w", "layer.w_scale_inv"]
    bad = bind({"layer.w": Quantized(codes, scales[:2])}, "receive", ranks=None,
               local_ranks=[0])
    assert bad.errors == ["'layer.w_scale_inv' (the scales of 'layer.w', block_fp8(128x128)) "
                          "has layout (2, 2) float32; expected (3, 2) float32"]
    mx = Quantized(*quantize(w[:, :224].contiguous(), MXFP8()), MXFP8())
    assert quantized_layouts("m", mx)[0].scale == "m_scale"


def test_the_docs_fp8_example_runs_as_written(capsys):
    """In this process (seconds), for the fast tier; test_docs runs it as a script of its
    own (over a minute on 2 loaded cores: a fresh interpreter's torch) in the slow tier."""
    import re
    from pathlib import Path

    pytest.importorskip("torch")
    doc = (Path(__file__).resolve().parent.parent / "docs" / "fp8.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(code, "docs/fp8.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torch.float8_e4m3fn (4, 2)"
    assert out[1] == ("mlp.down_proj.weight [512, 256] as block_fp8(128x128) "
                      "(scales mlp.down_proj.weight_scale_inv)")
    assert out[2].startswith("'w' of shape (512, 256): region [0:171, 0:256] cuts a 128-wide")
