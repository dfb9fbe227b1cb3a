"""The pipelined executor: bit-exact against the round-by-round one, staging within the
budget (two rounds side by side), and a failure mid-pipeline raises and stops the wire."""

from __future__ import annotations

import contextlib
import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xreshard as xr
from xreshard.errors import TransportError, TransportTimeout
from xreshard.dtypes import numpy_dtype
from xreshard.runtime.execute import Executor
from xreshard.planner.schedule import peer_counts, schedule
from xreshard.tools.testing import local_arrays_from_global
from xreshard.transport.base import RecordingTransport
from xreshard.transport.local import LocalTransport

from .test_plan import product_layouts


def _setup(src_layouts, dst_layouts, *, bucket, staging, wire=None):
    plan = xr.plan(src_layouts, dst_layouts, wire_dtype=wire)
    ranks = sorted({r for lay in (*src_layouts.values(), *dst_layouts.values())
                    for r in lay.ranks})
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=bucket,
                     staging_bytes=staging)
    values = {n: (np.arange(math.prod(lay.shape)) * 7 + 3).astype(numpy_dtype(lay.dtype))
              .reshape(lay.shape) for n, lay in src_layouts.items()}
    src_b = {(r, n): local_arrays_from_global(lay, r, values[n])
             for n, lay in src_layouts.items() for r in lay.ranks}
    dst_b = {(r, n): np.zeros(lay.local_shape(r), numpy_dtype(lay.dtype))
             for n, lay in dst_layouts.items() for r in lay.ranks}
    return plan, ranks, sched, values, src_b, dst_b


def _expected(dst_layouts, values, r, n):
    return local_arrays_from_global(dst_layouts[n], r,
                                    values[n].astype(numpy_dtype(dst_layouts[n].dtype)))


def _transposed(shape):
    """Source bindings that are transposed views (packed through staging)."""
    return np.ascontiguousarray(np.zeros(shape[::-1])).T


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), shape=st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple),
       bucket=st.sampled_from([16, 64, 1 << 20]), wire=st.sampled_from([None, "bfloat16"]))
def test_pipelined_is_bit_exact_and_moves_what_rounds_move(data, shape, bucket, wire):
    src = {"t": data.draw(product_layouts(shape))}
    dst = {"t": data.draw(product_layouts(shape))}
    out = {}
    for pipeline in (True, False):
        plan, ranks, sched, values, src_b, dst_b = _setup(src, dst, bucket=bucket,
                                                          staging=4 * bucket, wire=wire)
        rec = RecordingTransport(LocalTransport(ranks))
        stats = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, rec,
                         timeout=10, pipeline=pipeline).run()
        assert stats.pipelined == (pipeline and sched.num_rounds > 0)
        for (r, n), arr in dst_b.items():
            want = _expected(dst, {n: v.astype(numpy_dtype(wire or src[n].dtype))
                                   for n, v in values.items()}, r, n)
            assert arr.tobytes() == want.tobytes(), (pipeline, r, n)
        out[pipeline] = (sorted(rec.sends), stats.bytes_sent, stats.bytes_received)
    assert out[True] == out[False]


def _many_rounds(staging):
    """One sender, four receivers, packed through staging (the sender's view is a
    transpose), many rounds."""
    src = {"w": xr.Layout.replicated((64, 256), "float32", xr.Mesh((1,)))}
    dst = {"w": xr.Layout.from_placements((64, 256), "float32",
                                          xr.Mesh((4,), (1, 2, 3, 4)), ["S1"])}
    plan, ranks, sched, values, src_b, dst_b = _setup(src, dst, bucket=1 << 20,
                                                      staging=staging)
    t = np.ascontiguousarray(values["w"].T).T           # same values, transposed memory
    src_b[(0, "w")] = t
    return src, dst, plan, ranks, sched, values, src_b, dst_b


def test_double_buffered_staging_stays_within_the_budget():
    budget = 1 << 14
    # the refit schedules rounds of half the budget when it pipelines
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(budget // 2)
    assert sched.num_rounds >= 4
    allocs = []

    def alloc(n):
        allocs.append(n)
        return np.empty(n, np.uint8)

    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                  LocalTransport(ranks), timeout=10, alloc=alloc, pipeline=True,
                  staging_bytes=budget)
    stats = ex.run()
    assert stats.pipelined
    # five ranks share the host arena: the budget is per rank
    assert stats.staging_bytes <= budget * len(ranks) and sum(allocs) == stats.staging_bytes
    for (r, n), arr in dst_b.items():
        assert arr.tobytes() == _expected(dst, values, r, n).tobytes()
    # full-budget rounds do not fit twice: round after round, never over the budget
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(budget)
    tight = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                     LocalTransport(ranks), timeout=10, pipeline=True,
                     staging_bytes=sched.max_round_bytes // len(ranks) + 1)
    assert not tight.run().pipelined


class _Failing:
    """A local transport whose ``fail_round``-th group fails at exit."""

    name = "failing"

    def __init__(self, ranks, fail_round, exc):
        self.inner = LocalTransport(ranks)
        self.fail_round, self.exc = fail_round, exc
        self.groups = 0

    @contextlib.contextmanager
    def group(self, timeout):
        self.groups += 1
        with self.inner.group(timeout):
            yield
        if self.groups == self.fail_round:
            raise self.exc

    def send(self, *a):
        self.inner.send(*a)

    def recv(self, *a):
        self.inner.recv(*a)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("exc", [TransportTimeout("recv from rank 3 tag 2 timed out"),
                                 TransportError("peer died")])
def test_a_failing_round_mid_pipeline_raises_and_stops_the_wire(exc):
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(1 << 13)
    assert sched.num_rounds >= 4
    tr = _Failing(ranks, 2, exc)
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, tr,
                  timeout=10, pipeline=True)
    with pytest.raises(type(exc), match=str(exc)):
        ex.run()
    assert tr.groups <= 3           # nothing is posted after the failure is seen
    assert not [t for t in threading.enumerate() if t.name == "xreshard-wire"]


def test_a_failing_pack_mid_pipeline_raises_and_closes_the_open_group():
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(1 << 13)
    tr = _Failing(ranks, -1, None)
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, tr,
                  timeout=10, pipeline=True)
    packs = []
    real = ex._pack

    def pack(b, buf):
        packs.append(b)
        if len(packs) == 3:
            raise RuntimeError("pack failed")
        real(b, buf)

    ex._pack = pack
    with pytest.raises(RuntimeError, match="pack failed"):
        ex.run()
    assert not [t for t in threading.enumerate() if t.name == "xreshard-wire"]
    assert tr.inner._sends is None          # the open group was exited, not left open


class _Silent(_Failing):
    """A peer that never posts in the second round: that group waits its timeout, then
    raises (as gloo and shm do)."""

    @contextlib.contextmanager
    def group(self, timeout):
        self.groups += 1
        if self.groups != 2:
            with self.inner.group(timeout):
                yield
            return
        yield
        threading.Event().wait(timeout)
        raise TransportTimeout(f"silent peer: round 2 did not complete within {timeout} s")

    def send(self, *a):
        if self.groups != 2:
            self.inner.send(*a)

    def recv(self, *a):
        if self.groups != 2:
            self.inner.recv(*a)


def test_a_silent_peer_mid_pipeline_raises_the_transport_timeout():
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(1 << 13)
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                  _Silent(ranks, -1, None), timeout=0.5, pipeline=True)
    with pytest.raises(TransportTimeout, match="silent peer"):
        ex.run()


class _BadPost(_Failing):
    """A transport whose third send post raises (gloo: a post that fails at once)."""

    def send(self, *a):
        self.sends = getattr(self, "sends", 0) + 1
        if self.sends == 3:
            raise TransportError("post failed")
        self.inner.send(*a)


def test_a_failing_post_mid_pipeline_raises_and_exits_its_group():
    src, dst, plan, ranks, sched, values, src_b, dst_b = _many_rounds(1 << 13)
    tr = _BadPost(ranks, -1, None)
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, tr,
                  timeout=10, pipeline=True)
    with pytest.raises(TransportError, match="post failed"):
        ex.run()
    assert tr.inner._sends is None
    assert not [t for t in threading.enumerate() if t.name == "xreshard-wire"]


def test_executor_from_the_environment():
    """XRESHARD_EXECUTOR gives Tuning's default executor (read once, where a Refit is
    built); an unknown kind is refused."""
    from xreshard.config import Tuning
    from xreshard.errors import RefitError
    assert Tuning.from_env({"XRESHARD_EXECUTOR": "rounds"}).executor == "rounds"
    assert Tuning.from_env({"XRESHARD_EXECUTOR": "pipelined"}).executor == "pipelined"
    assert Tuning.from_env({}) == Tuning()
    with pytest.raises(RefitError, match="XRESHARD_EXECUTOR='fast'"):
        Tuning.from_env({"XRESHARD_EXECUTOR": "fast"})
    with pytest.raises(RefitError, match="Tuning.executor"):
        Tuning(executor="fast")


def test_gc_paused_nests_and_restores():
    import gc
    from xreshard.runtime.execute import gc_paused
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with gc_paused(enabled=False):          # Tuning(pause_gc=False)
        assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()       # a caller's own choice is kept
    finally:
        gc.enable()
