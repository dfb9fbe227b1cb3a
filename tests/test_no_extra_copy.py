"""A warm plain call makes no extra copy (issue 35, item 2).

With delta, atomic, verify, check_writes, FP8 and relay all off, each byte a call moves is
copied as few times as the message needs: a large contiguous item goes out as the JAX
shard's own memory and lands in the destination's own memory (the transport's copy is the
only one), and small items are packed into staging once and unpacked from it once.

Real JAX arrays with real NamedShardings on 4 CPU devices, bound by the JAX adapter as a
refit binds them; the destinations are host arrays as the torch adapter binds them (ranks
4 and 5); the executor runs the plan over a same-process transport that records every
posted buffer. The second run reuses the first's staging and programs, as every warm call
of a Refit does; it is the one examined.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import xreshard as xr  # noqa: E402
from xreshard.planner.schedule import peer_counts, schedule  # noqa: E402
from xreshard.runtime.execute import Executor  # noqa: E402
from xreshard.transport.local import LocalTransport  # noqa: E402

BIG = (4096, 64)            # 256 KiB per JAX shard: its own bucket, one contiguous run
SMALL = (64, 32)            # 2 KiB per shard: many share a bucket
N_SMALL = 200


class _Posts:
    """A same-process transport that keeps every posted buffer."""

    name = "posts"

    def __init__(self, ranks: list[int]):
        self.inner = LocalTransport(ranks)
        self.sends: dict[tuple[int, int, int], Any] = {}
        self.recvs: dict[tuple[int, int, int], Any] = {}

    def group(self, timeout: float) -> Any:
        return self.inner.group(timeout)

    def send(self, buf: Any, src: int, dst: int, tag: int) -> None:
        self.sends[(src, dst, tag)] = buf
        self.inner.send(buf, src, dst, tag)

    def recv(self, buf: Any, src: int, dst: int, tag: int) -> None:
        self.recvs[(src, dst, tag)] = buf
        self.inner.recv(buf, src, dst, tag)

    def close(self) -> None:
        self.inner.close()


def _tree() -> tuple[dict, dict[int, int]]:
    from jax.sharding import NamedSharding, PartitionSpec as P
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    devices = jax.local_devices()[:4]
    mesh = jax.make_mesh((4,), ("tp",), devices=devices)
    sharding = NamedSharding(mesh, P("tp"))
    rng = np.random.default_rng(0)
    tree = {"big": jax.device_put(rng.standard_normal(BIG).astype(np.float32), sharding)}
    for i in range(N_SMALL):
        tree[f"s{i:03d}"] = jax.device_put(rng.standard_normal(SMALL).astype(np.float32),
                                           sharding)
    return tree, {d.id: i for i, d in enumerate(devices)}


def test_warm_plain_call_sends_large_items_in_place_and_small_ones_once():
    from xreshard.adapters.jax import bind

    tree, ranks = _tree()
    src = bind(tree, "send", ranks=ranks)
    dmesh = xr.Mesh((2,), (4, 5))
    dst_layouts = {n: xr.Layout.from_placements(lay.shape, lay.dtype, dmesh, ["S0"])
                   for n, lay in src.layouts.items()}
    plan = xr.plan(src.layouts, dst_layouts)
    world = list(range(6))
    sched = schedule(plan, world, peer_counts(plan, world), bucket_bytes=1 << 18,
                     staging_bytes=1 << 22)
    dst = {(r, n): np.zeros(lay.local_shape(r), np.float32)
           for n, lay in dst_layouts.items() for r in lay.ranks}
    arena: dict = {}
    programs: dict = {}

    def call(bound: Any = None) -> tuple[Any, _Posts, Any]:
        bound = bind(tree, "send", ranks=ranks) if bound is None else bound
        posts = _Posts(world)
        stats = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes,
                         bound.bindings, dst, posts, timeout=30, arena=arena,
                         programs=programs).run()
        return stats, posts, bound

    call()                                      # cold: plans its programs, fills staging
    for a in dst.values():
        a[...] = 0
    numpy_data = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces([numpy_data])
        bound = bind(tree, "send", ranks=ranks)     # warm: views of the shards
        bound_data = tracemalloc.take_snapshot().filter_traces([numpy_data])
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        stats, posts, bound = call(bound)       # the warm run: pack, move, unpack
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # binding copies nothing: no numpy data allocated (views only)
    assert sum(s.size_diff for s in bound_data.compare_to(before, "filename")) <= 0

    # bit-exact
    for (r, n), got in dst.items():
        rows = BIG[0] // 2 if n == "big" else SMALL[0] // 2
        want = np.asarray(tree[n])[(r - 4) * rows:(r - 3) * rows]
        assert got.tobytes() == want.tobytes(), (r, n)

    staging = [a for a in arena.values() if a is not None]
    assert len(staging) == 1
    buckets = [b for r in sched.rounds for b in r]
    big = [b for b in buckets if [it.name for it in b.items] == ["big"]]
    small = [b for b in buckets if all(it.name != "big" for it in b.items)]
    assert len(big) + len(small) == len(buckets) and big and all(len(b.items) > 1 for b in small)
    assert set(posts.sends) == set(posts.recvs) == {(b.src, b.dst, b.tag) for b in buckets}
    for b in big:
        # the large item: the JAX shard's own memory out, the destination's own memory in
        out, into = posts.sends[(b.src, b.dst, b.tag)], posts.recvs[(b.src, b.dst, b.tag)]
        assert np.shares_memory(out, bound.bindings[(b.src, "big")])
        assert np.shares_memory(into, dst[(b.dst, "big")])
        assert not np.shares_memory(out, staging[0]) and not np.shares_memory(into, staging[0])
    for b in small:
        # small items: packed into staging and received into staging (then unpacked)
        out, into = posts.sends[(b.src, b.dst, b.tag)], posts.recvs[(b.src, b.dst, b.tag)]
        assert np.shares_memory(out, staging[0]) and np.shares_memory(into, staging[0])
    assert stats.num_zero_copy == 2 * len(big)
    # staging is exactly the small messages, each side once: no item is staged twice
    small_bytes = sum(b.nbytes for b in small)
    assert small_bytes == 4 * N_SMALL * (SMALL[0] // 4) * SMALL[1] * 4
    assert stats.staging_bytes == sum(-(-b.nbytes // 256) * 256 for b in small) * 2
    assert stats.bytes_sent == sum(b.nbytes for b in buckets)
    # and the run allocates no copy of anything: what it allocates (slices, the
    # executor's bookkeeping) is far below one small message
    assert peak < min(b.nbytes for b in small) // 2, peak

