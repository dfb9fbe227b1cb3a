"""Scheduler + executor with every rank in this process: bytes exact, bytes counted."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xreshard as xr
from xreshard.dtypes import numpy_dtype
from xreshard.runtime.execute import Executor
from xreshard.planner.schedule import peer_counts, schedule, split_region
from xreshard.tools.testing import local_arrays_from_global
from xreshard.transport.base import RecordingTransport
from xreshard.transport.local import LocalTransport

from .test_plan import product_layouts


def _run(src_layouts, dst_layouts, *, wire=None, bucket=1 << 20, staging=1 << 22, values=None):
    plan = xr.plan(src_layouts, dst_layouts, wire_dtype=wire)
    ranks = sorted({r for lay in (*src_layouts.values(), *dst_layouts.values()) for r in lay.ranks})
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=bucket,
                     staging_bytes=staging)
    values = values or {n: (np.arange(math.prod(l.shape)) + 1).astype(numpy_dtype(l.dtype))
                        .reshape(l.shape) for n, l in src_layouts.items()}
    src_b = {(r, n): local_arrays_from_global(l, r, values[n])
             for n, l in src_layouts.items() for r in l.ranks}
    dst_b = {(r, n): np.zeros(l.local_shape(r), numpy_dtype(l.dtype))
             for n, l in dst_layouts.items() for r in l.ranks}
    transport = RecordingTransport(LocalTransport(ranks))
    stats = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, transport,
                     timeout=10).run()
    for (r, n), arr in dst_b.items():
        want = local_arrays_from_global(dst_layouts[n], r,
                                        values[n].astype(numpy_dtype(dst_layouts[n].dtype)))
        assert arr.tobytes() == want.tobytes(), (r, n)
    return plan, sched, stats, transport


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), shape=st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple),
       bucket=st.sampled_from([1, 24, 1 << 20]))
def test_executor_bytes_exact_and_counted(data, shape, bucket):
    src = {"t": data.draw(product_layouts(shape))}
    dst = {"t": data.draw(product_layouts(shape))}
    plan, sched, stats, rec = _run(src, dst, bucket=bucket)
    assert rec.bytes_sent == plan.stats.bytes_moved == stats.bytes_sent
    assert all(s != d for s, d, _, _ in rec.sends)           # no rank sends to itself


def test_cast_on_sender_halves_the_wire():
    mesh = xr.Mesh((2,))
    src = {"w": xr.Layout.from_placements((6, 8), "float32", mesh, ["S1"])}
    dst = {"w": xr.Layout.from_placements((6, 8), "bfloat16", xr.Mesh((3,), (2, 3, 4)), ["S0"])}
    plan, _, _, rec = _run(src, dst, wire="bfloat16")
    assert rec.bytes_sent == 6 * 8 * 2


def test_staging_budget_bounds_bytes_in_flight():
    src = {"w": xr.Layout.replicated((1024, 64), "float32", xr.Mesh((1,)))}
    dst = {"w": xr.Layout.from_placements((1024, 64), "float32", xr.Mesh((4,), (1, 2, 3, 4)),
                                          ["S1"])}
    plan, sched, _, _ = _run(src, dst, bucket=1 << 20, staging=1 << 17)
    # rank 0 talks to 4 peers: each pair's buckets are 32 KiB, so 128 KiB per round, and
    # each 64 KiB shard takes two rounds
    assert sched.max_round_bytes == 1 << 17
    assert sched.num_rounds == 2


def test_split_region_outermost_first():
    r = xr.Region((0, 0), (4, 6))
    assert [str(x) for x in split_region(r, 4, 48)] == ["[0:2, 0:6]", "[2:4, 0:6]"]
    assert [str(x) for x in split_region(r, 4, 12)] == [
        f"[{i}:{i + 1}, {j}:{j + 3}]" for i in range(4) for j in (0, 3)]
    assert sum(x.size for x in split_region(xr.Region((0,), (7,)), 2, 4)) == 7


def test_zero_copy_for_contiguous_regions():
    src = {"w": xr.Layout.from_placements((8, 4), "float32", xr.Mesh((2,)), ["S0"])}
    dst = {"w": xr.Layout.replicated((8, 4), "float32", xr.Mesh((1,), (2,)))}
    _, _, stats, _ = _run(src, dst)
    # both row blocks are contiguous on both sides: 2 sends + 2 receives in place
    assert stats.num_zero_copy == 4 and stats.staging_bytes == 0


def test_many_small_items_bits_exact_whatever_the_binding_dtype():
    """Buckets of many small items (packed by runs, unpacked item by item): float32 and
    int32 items of one size interleaved, bf16 bound typed on one side and as raw uint16 bits
    on the other, NaN payloads, whole and sliced local arrays, a strided (transposed) source
    binding and an explicit-form destination: every destination byte equals the source's."""
    import ml_dtypes

    src_mesh, dst_mesh = xr.Mesh((4,), (0, 1, 2, 3)), xr.Mesh((2,), (4, 5))
    dtypes = ["float32", "int32", "bfloat16", "float32"]
    src, dst, values = {}, {}, {}
    rng = np.random.default_rng(0)
    for i in range(24):
        dtype = dtypes[i % 4]
        src[f"t{i}"] = xr.Layout.from_placements((8, 6), dtype, src_mesh, ["S0" if i % 3 else "S1"])
        dst[f"t{i}"] = xr.Layout.from_placements((8, 6), dtype, dst_mesh, ["S0"])
        bits = rng.integers(0, 1 << 16, (8, 6), dtype=np.uint16)
        bits[0, 0] = 0x7FC1        # a NaN with a payload (bf16), bits in the others
        values[f"t{i}"] = bits.astype(np.uint32).view(np.float32) if dtype != "bfloat16" \
            else bits.view(ml_dtypes.bfloat16)
        if dtype == "int32":
            values[f"t{i}"] = values[f"t{i}"].view(np.int32)
    dst["e"] = xr.Layout.explicit_form((4, 6), "float32", {4: [[(0, 2), (0, 6)]],
                                                             5: [[(2, 4), (0, 6)]]})
    src["e"] = xr.Layout.from_placements((4, 6), "float32", src_mesh, ["R"])
    values["e"] = np.arange(24, dtype=np.float32).reshape(4, 6)
    plan = xr.plan(src, dst)
    ranks = list(range(6))
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=1 << 20,
                     staging_bytes=1 << 22)
    src_b = {(r, n): local_arrays_from_global(l, r, values[n]) for n, l in src.items()
             for r in l.ranks}
    src_b[(0, "t1")] = np.ascontiguousarray(src_b[(0, "t1")].T).T     # strided, same values
    for (r, n), a in list(src_b.items()):
        if n in ("t2", "t6"):
            src_b[(r, n)] = a.view(np.uint16)         # bf16 as raw bits on the sender
    dst_b = {(r, n): (np.zeros(l.local_shape(r), numpy_dtype(l.dtype)) if l.is_product
                      else [np.zeros(reg.shape, np.float32) for reg in l.regions(r)])
             for n, l in dst.items() for r in l.ranks}
    for (r, n), a in list(dst_b.items()):
        if n in ("t2", "t10"):
            dst_b[(r, n)] = a.view(np.uint16)         # and on the receiver
    for pipeline in (True, False):
        for a in dst_b.values():
            for x in (a if isinstance(a, list) else [a]):
                x[...] = 0
        Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                 RecordingTransport(LocalTransport(ranks)), timeout=10,
                 pipeline=pipeline).run()
        for (r, n), arr in dst_b.items():
            want = local_arrays_from_global(dst[n], r, values[n])
            got = arr if isinstance(arr, list) else [arr]
            want = want if isinstance(want, list) else [want]
            assert [g.tobytes() for g in got] == [w.tobytes() for w in want], (pipeline, r, n)


def test_a_warm_unpack_lands_in_a_destination_replaced_between_runs():
    """The host unpack keeps each small bucket's landing (destination and staging views)
    for the next run of the same schedule; a destination array replaced in the bindings
    since is written, not the old one, and the others still are."""
    src_mesh, dst_mesh = xr.Mesh((2,), (0, 1)), xr.Mesh((2,), (2, 3))
    src = {f"t{i}": xr.Layout.from_placements((4, 3), "float32", src_mesh, ["S0"])
           for i in range(6)}
    dst = {n: xr.Layout.from_placements((4, 3), "float32", dst_mesh, ["S1"]) for n in src}
    plan = xr.plan(src, dst)
    ranks = list(range(4))
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=1 << 20,
                     staging_bytes=1 << 22)
    values = {n: np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * i
              for i, n in enumerate(src)}
    src_b = {(r, n): local_arrays_from_global(lay, r, values[n]) for n, lay in src.items()
             for r in lay.ranks}
    dst_b = {(r, n): np.zeros(lay.local_shape(r), np.float32) for n, lay in dst.items()
             for r in lay.ranks}
    arena: dict = {}
    programs: dict = {}
    for run in range(3):
        if run == 2:        # a new array for one destination, the old one zeroed
            old = dst_b[(2, "t3")]
            dst_b[(2, "t3")] = np.zeros_like(old)
            old[...] = 0
        for a in dst_b.values():
            a[...] = 0
        Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                 LocalTransport(ranks), timeout=10, arena=arena, programs=programs).run()
        for (r, n), arr in dst_b.items():
            want = local_arrays_from_global(dst[n], r, values[n])
            assert arr.tobytes() == want.tobytes(), (run, r, n)
    assert not old.any()


def test_programs_name_the_wire_dtypes_once_per_prepared_call():
    """A warm call's programs find the wire dtypes named by the call before (the same
    stage tables' objects), not renamed per tensor each call; other tables are named anew."""
    import ml_dtypes
    from xreshard.runtime.programs import Programs, Tables

    lay = xr.Layout.from_placements((4, 4), "float32", xr.Mesh((2,)), ["S0"])
    wire = {"a": "float32", "b": np.dtype(ml_dtypes.bfloat16)}
    tables = (Tables({"a": lay, "b": lay}, {"a": lay, "b": lay}, wire, {}, {}),)
    cache: dict = {}
    first = Programs(tables, cache).wire(0)
    assert first == {"a": "float32", "b": "bfloat16"}
    assert Programs(tables, cache).wire(0) is first
    other = (tables[0]._replace(wire_dtypes={"a": "bfloat16", "b": "float32"}),)
    assert Programs(other, cache).wire(0) == {"a": "bfloat16", "b": "float32"}
