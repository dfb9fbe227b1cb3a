"""Messages that name the fix: a Refit without a World, reversed dims, names on one side
only, a port in use, and reports that say what went on the wire (issue 34)."""

from __future__ import annotations

import errno
import socket

import pytest

import xreshard as xr
from xreshard.config import RefitReport
from xreshard.ir.layout import Mesh


def _layout(shape: tuple[int, ...]) -> xr.Layout:
    return xr.Layout.replicated(shape, "float32", Mesh((1,), (0,), ("x",)))


@pytest.mark.parametrize("world", ["127.0.0.1:7", "tcp://127.0.0.1:7", None])
def test_a_refit_without_a_world_says_how_to_join_one(world):
    with pytest.raises(xr.RefitError, match=r"the World every process joined.*World\.join\("
                                            r".*xreshard\.serve\(\)"):
        xr.Refit(world, send={})


def test_reversed_dims_suggest_transpose():
    with pytest.raises(xr.PlanError, match=r"'up\.weight' source \(64, 256\) vs destination \("
                                           r"256, 64\) \(reversed: pass transpose=\{'up\.weight'"):
        xr.plan({"up.weight": _layout((64, 256))}, {"up.weight": _layout((256, 64))})
    with pytest.raises(xr.PlanError) as e:                  # not reversed: no hint
        xr.plan({"w": _layout((64, 256))}, {"w": _layout((64, 128))})
    assert "transpose" not in str(e.value)


def test_names_on_one_side_suggest_the_nearest_names_and_names():
    src = {"layers/0/mlp/up/kernel": _layout((4, 4)), "embed": _layout((8, 4))}
    dst = {"model.layers.0.mlp.up_proj.weight": _layout((4, 4)),
           "model.embed_tokens.weight": _layout((8, 4))}
    with pytest.raises(xr.PlanError) as e:
        xr.plan(src, dst)
    text = str(e.value)
    assert ("nearest names: {'embed': 'model.embed_tokens.weight', 'layers/0/mlp/up/kernel': "
            "'model.layers.0.mlp.up_proj.weight'}") in text, text
    assert "names={source: destination}" in text and "rules=" in text


def test_a_port_in_use_is_an_os_error_not_bad_input():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1") as e:
            xr.serve(port=taken.getsockname()[1])
        assert not isinstance(e.value, xr.RefitError) and e.value.errno == errno.EADDRINUSE
    finally:
        taken.close()


def _report(**kw) -> RefitReport:
    base = dict(version=2, seconds=0.1, plan_seconds=0.05, bytes_sent=203 * 1024,
                bytes_received=0, bytes_local=0, bytes_moved_world=4 << 20,
                bytes_gather_broadcast_world=12 << 20, num_rounds=1, num_messages=2,
                num_zero_copy=0, staging_bytes=0, replanned=False, move_seconds=0.02)
    return RefitReport(**{**base, **kw})


def test_a_delta_report_says_what_went_on_the_wire_and_that_it_was_delta():
    text = str(_report(delta={"bytes_wire": 203 * 1024, "bytes_dense": 4 << 20,
                              "num_delta": 3}))
    assert "world moved" not in text, text
    assert ("delta: this process's senders put 203 KiB on the wire for 4.00 MiB dense "
            "(buckets encoded: 3); world planned 4.00 MiB dense") in text, text


def test_an_fp8_report_says_what_went_on_the_wire():
    text = str(_report(bytes_moved_world=3 << 20, quantized={
        "fp8_world": 1 << 20, "bf16_world": 0, "unquantized_world": 2 << 20}))
    assert "world moved 2.00 MiB (FP8 destinations; 3.00 MiB in the wire dtype)" in text, text
    assert "world moved 3.00 MiB" in str(_report(bytes_moved_world=3 << 20))


def test_a_first_call_says_its_setup_includes_first_use_imports():
    assert "(first call: planning and first-use imports 50.0 ms)" in str(
        _report(version=1, replanned=True))
    assert "(planning 50.0 ms)" in str(_report(version=3, replanned=True))
