"""Quantizing ahead (issue 20, CPU speed): a sender's FP8 items are quantized on a worker
thread while the call checks and plans, with the last call's schedule. Real refits of one
process (5 ranks, numpy sides, FP8 destinations): the call takes the work when the
schedule stayed and discards it when it changed; the worker is joined whatever happens;
the destination bytes are vLLM's quantization of the values either way."""

from __future__ import annotations

import contextlib
import importlib.util
import threading

import numpy as np
import pytest

import xreshard as xr
from xreshard.runtime import quantized as qmod
from xreshard.runtime.quantize_ahead import QuantAhead
from xreshard.tools.testing import local_arrays_from_global

from .test_fp8_refit import _case, _expected, _garbage, _sharded, _values

#: the refit world's rendezvous store is torch's (the JAX-only CI leg has no torch)
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="the world rendezvous needs torch")


@contextlib.contextmanager
def _solo():
    with xr.serve() as server, xr.World.join(server.address, "fp8-ahead", 5,
                                             num_processes=1, index=0, timeout=30) as world:
        yield world


def _send(src, values):
    return xr.Bound(dict(src), {(r, n): local_arrays_from_global(lay, r, values[n])
                                for n, lay in src.items() for r in lay.ranks})


def _receive(dst, quantized):
    bindings = {(r, n): _garbage(lay.local_shape(r), lay.dtype)
                for n, lay in dst.items() for r in lay.ranks}
    return xr.Bound(dict(dst), bindings, quantized=dict(quantized)), bindings


def _held(dst, bindings):
    return {key: arr.view(np.uint8).tobytes() for key, arr in sorted(bindings.items())}


def _check(dst, bindings, quantized, values, wire=None):
    want = _expected(values, quantized, wire)
    for (r, name), arr in bindings.items():
        region = dst[name].regions(r)[0]
        assert arr.view(np.uint8).tobytes() == \
            want[name][region.slices()].view(np.uint8).tobytes(), (r, name)


def _no_worker() -> bool:
    return not any(t.name == "xreshard-fp8-ahead" for t in threading.enumerate())


def _config(**kw):
    return xr.RefitConfig(**{"bucket_bytes": 4096, "timeout": 60, **kw})


def _fresh(src, seed):
    return {n: _values(lay.shape, seed + i) for i, (n, lay) in enumerate(src.items())}


@needs_torch
@pytest.mark.parametrize("staging", [1 << 20, 2048])
def test_the_call_takes_the_work_ahead_when_the_schedule_stays(staging):
    """Second and third calls: same schedule, new source arrays each time. Every FP8 item
    is quantized by the worker (a 2 KiB window: held back and let go as items are taken),
    and the bytes equal the whole tensors' quantization and a refit without the worker."""
    src, dst, quantized = _case()
    with _solo() as world:
        receive, bindings = _receive(dst, quantized)
        values = _fresh(src, 0)
        refit = xr.Refit(world, send=_send(src, values), receive=receive,
                         config=_config(staging_bytes=staging))
        refit()
        assert refit.quant_ahead.last == {}         # no schedule to start from yet
        for seed in (10, 20):
            values = _fresh(src, seed)
            refit(send=_send(src, values))
            last = refit.quant_ahead.last
            assert last["used"] and last["items"] > 0 and last["error"] is None
            assert last["taken"] + last["by_call"] == last["items"] and last["taken"] > 0
            _check(dst, bindings, quantized, values)
            assert _no_worker()
        ahead_bytes = _held(dst, bindings)

        receive2, bindings2 = _receive(dst, quantized)
        plain = xr.Refit(world, send=_send(src, values), receive=receive2,
                         config=_config(staging_bytes=staging))
        plain.quant_ahead = QuantAhead(enabled=False)
        plain()
        plain()
        assert plain.quant_ahead.last == {}
        assert _held(dst, bindings2) == ahead_bytes


@needs_torch
def test_the_work_is_discarded_when_the_schedule_changes():
    """A source bound with another dtype (float32 values, wire_dtype bf16): the call
    plans again, the worker's items (of the bf16 schedule) are not taken, and the codes
    are those of the exported bf16 values."""
    src, dst, quantized = _case()
    with _solo() as world:
        receive, bindings = _receive(dst, quantized)
        refit = xr.Refit(world, send=_send(src, _fresh(src, 0)), receive=receive,
                         config=_config(wire_dtype="bfloat16"))
        refit()
        src32 = {n: lay.with_dtype("float32") for n, lay in src.items()}
        values = {n: v.astype(np.float32) + np.float32(1e-5) for n, v in _fresh(src, 5).items()}
        report = refit(send=_send(src32, values))
        assert report.replanned
        last = refit.quant_ahead.last
        assert last["items"] > 0 and not last["used"] and last["taken"] == 0
        _check(dst, bindings, quantized, values, wire="bfloat16")
        assert _no_worker()
        refit(send=_send(src32, values))        # the float32 schedule stays: taken
        assert refit.quant_ahead.last["used"] and refit.quant_ahead.last["taken"] > 0
        _check(dst, bindings, quantized, values, wire="bfloat16")


@needs_torch
def test_the_worker_is_joined_when_the_call_fails():
    """Refused in refit/check (a source of another shape) and failing while moving (a
    receiver's unpack raises): the call raises, and no worker thread outlives it."""
    src, dst, quantized = _case()
    with _solo() as world:
        receive, bindings = _receive(dst, quantized)
        refit = xr.Refit(world, send=_send(src, _fresh(src, 0)), receive=receive,
                         config=_config())
        refit()
        wrong = dict(src, w=_sharded((512, 256), "bfloat16", range(4), (2, 2), (0, 1)))
        with pytest.raises(xr.PlanError):
            refit(send=_send(wrong, _fresh(wrong, 1)))
        assert _no_worker()
        refit(send=_send(src, _fresh(src, 2)))      # planned again for the right shape

        unpack = qmod.unpack

        def broken(*a, **kw):
            raise RuntimeError("unpack failed on purpose")
        qmod.unpack = broken
        try:
            with pytest.raises(Exception, match="unpack failed on purpose"):
                refit(send=_send(src, _fresh(src, 3)))
        finally:
            qmod.unpack = unpack
        assert refit.quant_ahead.last["used"] and _no_worker()


@needs_torch
def test_a_failing_worker_leaves_its_items_to_the_call(monkeypatch):
    """The worker's quantizer raises: the pack steps quantize those items themselves and
    the bytes are right."""
    src, dst, quantized = _case()
    step = qmod.quantize_step

    def flaky(*a, **kw):
        if threading.current_thread().name == "xreshard-fp8-ahead":
            raise RuntimeError("worker failed on purpose")
        return step(*a, **kw)
    with _solo() as world:
        receive, bindings = _receive(dst, quantized)
        refit = xr.Refit(world, send=_send(src, _fresh(src, 0)), receive=receive,
                         config=_config())
        refit()
        monkeypatch.setattr(qmod, "quantize_step", flaky)
        values = _fresh(src, 3)
        refit(send=_send(src, values))
        last = refit.quant_ahead.last
        assert last["used"] and "worker failed on purpose" in last["error"]
        assert last["taken"] == 0 and last["by_call"] == last["items"]
        _check(dst, bindings, quantized, values)
        assert _no_worker()


@pytest.mark.parametrize("how", ["read-only aligned", "writeable aligned", "unaligned"])
def test_the_jax_quantizer_reads_a_jax_buffers_memory_in_place(how):
    """``quantize_values`` in a JAX process: a read-only 64-byte aligned view (how the JAX
    adapter binds a CPU shard) is aliased, not copied; every way gives the host
    quantizer's bytes (itself checked against vLLM's in tests/test_quant.py)."""
    pytest.importorskip("jax")
    from xreshard.ir.formats import BlockFP8
    from xreshard.quant import host
    from xreshard.runtime.quantized import quantize_values

    x = _values((512, 384), 7)      # >= JAX_MIN_ELEMENTS: the jitted quantizer
    raw = np.empty(x.nbytes + 128, np.uint8)
    off = (-raw.ctypes.data) % 64 + (2 if how == "unaligned" else 0)
    held = raw[off:off + x.nbytes].view(x.dtype).reshape(x.shape)
    held[...] = x
    if how == "read-only aligned":
        held.flags.writeable = False
    codes, scales = quantize_values(held, BlockFP8(), "w")
    want_codes, want_scales = host.quantize_block_fp8(x, BlockFP8())
    assert codes.view(np.uint8).tobytes() == want_codes.view(np.uint8).tobytes()
    assert scales.view(np.uint32).tobytes() == want_scales.view(np.uint32).tobytes()
    assert np.array_equal(held, x)      # read, never written
