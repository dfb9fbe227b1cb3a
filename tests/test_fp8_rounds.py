"""FP8 pairs in several rounds (issue 20, the CPU speed bar; ``FP8_ROUNDS`` is 1 by
default, set to 4 here): a pair that sends quantized whole blocks is cut into at least
``FP8_ROUNDS`` rounds, the same buckets on both peers,
and the pipelined executor quantizes each round when it packs it, after the earlier
rounds went to the wire - so quantizing overlaps the wire instead of preceding all of it.
"""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.dtypes import numpy_dtype
from xreshard.ir.formats import BlockFP8, QuantizedTensor
from xreshard.planner import schedule as sched_mod
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.planner.schedule import paired_counts, schedule
from xreshard.quant import host
from xreshard.runtime import quantized as qmod
from xreshard.runtime.wire import Wire
from xreshard.tools.testing import local_arrays_from_global

BF16 = numpy_dtype("bfloat16")
FP8 = "float8_e4m3fn"


def _layouts(shape=(1024, 512), senders=2):
    """bf16 values row-split over ``senders`` ranks, block-FP8 codes and scales on one
    receiver (rank ``senders``): every block lies whole in one sender."""
    qt = QuantizedTensor("w", "w_scale", BlockFP8(), shape)
    src = {"w": xr.Layout.product(shape, "bfloat16", xr.Mesh((senders,), tuple(range(senders))),
                                  [(0, 0)])}
    one = xr.Mesh((1,), (senders,))
    dst = {"w": xr.Layout.product(shape, FP8, one, []),
           "w_scale": xr.Layout.product(qt.scale_shape, "float32", one, [])}
    return src, dst, {"w": qt}


def _prepared(ranks, bucket=1 << 30, staging=1 << 30, shape=(1024, 512), senders=2):
    src, dst, quantized = _layouts(shape, senders)
    options = CallOptions(bucket_bytes=bucket, staging_bytes=staging, halved=True)
    return prepare(src, dst, None, options, ranks=ranks, quantized=quantized)


def _pair(sched, src, dst):
    return [b for rnd in sched.rounds for b in rnd if (b.src, b.dst) == (src, dst)]


def test_a_quantized_pair_takes_at_least_fp8_rounds_rounds_of_whole_blocks(monkeypatch):
    monkeypatch.setattr(sched_mod, "FP8_MIN_ROUND_BYTES", 1)
    monkeypatch.setattr(sched_mod, "FP8_ROUNDS", 4)
    whole = _prepared(range(3)).schedule
    for src in (0, 1):
        buckets = _pair(whole, src, 2)
        assert len({b.round for b in buckets}) >= sched_mod.FP8_ROUNDS, buckets
        items = [it for b in buckets for it in b.items]
        assert all(it.quantized for it in items)
        for it in items:        # whole 128 x 128 blocks
            assert all(a % 128 == 0 and b % 128 == 0 for a, b in zip(it.region.starts,
                                                                      it.region.stops))
        # the pair's items cover its rows 512 * src : 512 * (src + 1) exactly once
        rows = sorted((it.region.starts[0], it.region.stops[0]) for it in items)
        assert rows[0][0] == 512 * src and rows[-1][1] == 512 * (src + 1)
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    # each peer alone derives the same buckets for its pairs
    for src in (0, 1):
        assert _pair(_prepared([src]).schedule, src, 2) == _pair(whole, src, 2)
        assert _pair(_prepared([2]).schedule, src, 2) == _pair(whole, src, 2)


def test_the_fp8_rounds_respect_the_floor_and_the_plain_bucket_size(monkeypatch):
    """At the default floor a small pair stays one round; a bucket size below a
    ``FP8_ROUNDS``-th of the pair still cuts it finer; a pair without quantized bytes
    keeps the plain size; ``FP8_ROUNDS = 1`` (the default) changes nothing."""
    monkeypatch.setattr(sched_mod, "FP8_ROUNDS", 4)
    small = _prepared(range(3)).schedule            # 2 x 256 KiB of FP8: under the floor
    assert {b.round for b in _pair(small, 0, 2)} == {0}
    fine = _prepared(range(3), bucket=16 << 10).schedule
    assert len({b.round for b in _pair(fine, 0, 2)}) == 16
    src, dst, _ = _layouts()
    dst = {"w": dst["w"].with_dtype("bfloat16")}
    plan = xr.plan(src, dst)
    plain = schedule(plan, range(3), paired_counts(plan, range(3)), bucket_bytes=1 << 30,
                     staging_bytes=1 << 30, quantized={})
    assert {b.round for b in _pair(plain, 0, 2)} == {0}
    assert sched_mod.fp8_pair_bytes(plan.transfers_for(2), 1 << 30, {"w": 2}, {}) == 1 << 30
    monkeypatch.setattr(sched_mod, "FP8_ROUNDS", 1)
    monkeypatch.setattr(sched_mod, "FP8_MIN_ROUND_BYTES", 1)
    assert {b.round for b in _pair(_prepared(range(3)).schedule, 0, 2)} == {0}


@pytest.mark.parametrize("pipeline", [True, False])
def test_fp8_rounds_are_quantized_as_packed_and_land_bit_exact(monkeypatch, pipeline):
    """The pipelined executor hands round k to the wire before it quantizes round k+1 (no
    quantizing of everything up front), and the receiver holds vLLM's bytes."""
    from xreshard.config import Tuning
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.local import LocalTransport

    monkeypatch.setattr(sched_mod, "FP8_MIN_ROUND_BYTES", 1)
    monkeypatch.setattr(sched_mod, "FP8_ROUNDS", 4)
    src, dst, quantized = _layouts()
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((1024, 512)) * 0.02).astype(np.float32).astype(BF16)
    src_b = {(r, "w"): local_arrays_from_global(src["w"], r, values) for r in (0, 1)}
    dst_b = {(2, n): np.zeros(lay.local_shape(2), numpy_dtype(lay.dtype)) for n, lay in
             dst.items()}
    for arr in dst_b.values():          # a byte never written shows
        arr.view(np.uint8)[...] = 0x55
    options = CallOptions(bucket_bytes=1 << 30, staging_bytes=1 << 30, halved=pipeline)
    prepared = prepare(src, dst, None, options, ranks=range(3), quantized=quantized)
    assert prepared.schedule.num_rounds >= sched_mod.FP8_ROUNDS
    events: list[tuple[str, int]] = []
    real_step, real_send = qmod.quantize_step, Wire.send

    def quantize_step(e, bindings, *args):
        events.append(("quantize", e.key[0]))
        return real_step(e, bindings, *args)

    def send(self, buf, b):
        events.append(("send", b.round))
        return real_send(self, buf, b)

    monkeypatch.setattr(qmod, "quantize_step", quantize_step)
    monkeypatch.setattr(Wire, "send", send)
    stats, _ = run(prepared, stage_bindings(prepared, src_b, dst_b), LocalTransport(),
                   timeout=30, programs={},
                   tuning=Tuning(executor="pipelined" if pipeline else "rounds"))
    codes, scales = host.quantize_block_fp8(values, BlockFP8())
    assert dst_b[(2, "w")].view(np.uint8).tobytes() == codes.view(np.uint8).tobytes()
    assert dst_b[(2, "w_scale")].view(np.uint32).tobytes() == scales.view(np.uint32).tobytes()
    assert stats.pipelined == pipeline
    if pipeline:
        kinds = [k for k, _ in events]
        assert kinds.count("quantize") == sum(len(b.items) for r in prepared.schedule.rounds
                                              for b in r)
        first_send = kinds.index("send")
        assert [r for k, r in events[:first_send + 1] if k == "send"] == [0]
        # round 0 reached the wire while most of the quantizing was still to come
        assert kinds[first_send + 1:].count("quantize") >= \
            kinds.count("quantize") * (sched_mod.FP8_ROUNDS - 1) // sched_mod.FP8_ROUNDS
