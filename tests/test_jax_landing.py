"""A one-process JAX -> JAX refit (issue 35, ``bench_peers``): each byte between two ranks
of the process is copied once, and a warm call lands in host buffers whose arrays were
dropped, never in memory a live array, view, capsule or pending computation still sees.

Real JAX arrays with real NamedShardings on 4 CPU devices, in a one-process world whose
ranks are the devices (same-rank bytes are local copies, the rest goes through the
``local`` transport), as ``benchmarks/bench_peers.py`` runs it.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("torch")      # the world's store is torch's TCPStore

import xreshard as xr  # noqa: E402

SHAPE = (64, 96)        # bf16; each destination shard is 16 x 96, half of it from each side


def _devices() -> list:
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return jax.local_devices()[:4]


def _solo(devices: list) -> Any:
    server = xr.serve()
    world = xr.World.join(server.address, "solo", devices, num_processes=1, index=0,
                          timeout=30)
    return server, world


def _source(devices: list, value: np.ndarray) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    return jax.device_put(jax.numpy.asarray(value).view(jax.numpy.bfloat16),
                          NamedSharding(mesh, P("x", "y")))


def _template(devices: list, reverse: bool = False, shape: tuple = SHAPE) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec as P
    order = devices[::-1] if reverse else devices
    dst = NamedSharding(jax.sharding.Mesh(np.array(order), ("z",)), P("z"))
    return jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16, sharding=dst)


def _values(n: int, shape: tuple = SHAPE) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    # finite bf16 of either sign (no NaN: the last case computes with them)
    return [rng.integers(0, 0x7E00, shape, dtype=np.uint16) | (rng.integers(0, 2, shape,
            dtype=np.uint16) << 15) for _ in range(n)]


def _bits(a: Any) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("reverse", [False, True])
def test_bytes_between_ranks_of_one_process_land_in_the_destination_once(reverse):
    """Every received region is a row range of a wider destination shard (strided): it
    lands there straight from the source's view, with no staging and no unpack."""
    devices = _devices()
    server, world = _solo(devices)
    try:
        refit = xr.Refit(world, receive={"w": _template(devices, reverse)},
                         config=xr.RefitConfig(timeout=30))
        for v in _values(3):
            report = refit(send={"w": _source(devices, v)})
            assert np.array_equal(_bits(refit.received["w"]), v)
            assert report.staging_bytes == 0, report
            # every message: sent from the source's view, received into the region
            assert report.num_zero_copy == 2 * report.num_messages > 0, report
    finally:
        world.close()
        server.close()


def test_a_warm_call_lands_in_the_buffers_of_dropped_arrays():
    """The third call on lands in the host memory of the call before last (its arrays
    were dropped): it allocates no destination memory, and every call is bit-exact."""
    import jax._src.lib as jax_lib
    if getattr(getattr(jax_lib, "_jax", None), "collect_garbage", None) is None:
        pytest.skip("this JAX has no _jax.collect_garbage: dropped arrays' memory is only "
                    "recycled after a garbage collection")
    devices = _devices()
    server, world = _solo(devices)
    shape = (512, 1024)             # 1 MiB: far above the call's own allocations
    nbytes = int(np.prod(shape)) * 2
    try:
        refit = xr.Refit(world, receive={"w": _template(devices, shape=shape)},
                         config=xr.RefitConfig(timeout=30))
        values = _values(6, shape)
        sources = [_source(devices, v) for v in values]
        peaks = []
        for x, v in zip(sources, values):
            gc.collect()
            tracemalloc.start()
            refit(send={"w": x})
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            assert np.array_equal(_bits(refit.received["w"]), v)
        # calls 1-2 allocate the destination shards; later ones none (metadata only)
        assert min(peaks[:2]) >= nbytes, peaks
        assert max(peaks[2:]) < nbytes // 2, peaks
    finally:
        world.close()
        server.close()


def test_recycling_never_writes_memory_that_something_still_sees():
    """Arrays of earlier calls kept alive in every way JAX allows (the array, a numpy view
    of it only, one of its shards only, a DLPack capsule only, a donating computation's
    output, a computation reading a dropped array) keep their call's bytes while later
    calls land in whatever of the earlier calls' memory was let go (the shards not kept)."""
    devices = _devices()
    server, world = _solo(devices)
    try:
        refit = xr.Refit(world, receive={"w": _template(devices)},
                         config=xr.RefitConfig(timeout=30))
        values = _values(12)
        held: list[tuple[int, str, Any]] = []

        def keep(k: int, arr: Any) -> None:
            how = k % 6
            if how == 0:
                held.append((k, "array", arr))
            elif how == 1:
                held.append((k, "numpy view", np.asarray(arr)))
            elif how == 2:
                shard = arr.addressable_shards[1]
                held.append((k, "shard 1", shard.data))
            elif how == 3:
                held.append((k, "capsule", arr.addressable_shards[2].data.__dlpack__()))
            elif how == 4:
                same = jax.jit(lambda a: a, donate_argnums=0)(arr)
                held.append((k, "donated", same))
            else:       # a computation reading it, still running when the next call lands
                twice = jax.jit(lambda a: a.astype(jax.numpy.float32) * 2 + 1)
                held.append((k, "pending", twice(arr)))

        for k, v in enumerate(values):
            refit(send={"w": _source(devices, v)})
            keep(k, refit.received["w"])
        refit(send={"w": _source(devices, values[0])})      # lands in dropped memory
        for k, how, got in held:
            want = values[k]
            if how in ("array", "numpy view", "donated"):
                assert np.array_equal(_bits(got), want), (k, how)
            elif how == "shard 1":
                assert np.array_equal(_bits(got), want[16:32]), (k, how)
            elif how == "capsule":
                assert np.array_equal(_capsule_bits(got, want[32:48].size),
                                      want[32:48].reshape(-1)), (k, how)
            else:
                exact = want.view(jax.numpy.bfloat16).astype(np.float32) * 2 + 1
                assert np.array_equal(np.asarray(got), exact), (k, how)
    finally:
        world.close()
        server.close()


def _capsule_bits(capsule: Any, n: int) -> np.ndarray:
    """The ``n`` uint16 at the data address of an unconsumed DLPack capsule (numpy cannot
    import a bf16 DLTensor)."""
    import ctypes

    from xreshard.adapters.jax import _capsule_data
    return np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(_capsule_data(capsule)))


@pytest.mark.parametrize("features,delete", [({"delta": True, "verify": True}, False),
                                             ({"delta": True}, True), ({"atomic": True}, True),
                                             ({"check_writes": True}, False)])
def test_recycled_buffers_with_features_are_bit_exact(features, delete):
    """Delta (its base is where the last call's arrays live: recycled memory is other
    memory, the call goes dense, never a delta onto another call's bytes), verify, atomic
    and check_writes over the recycled destinations: every call bit-exact, a few elements
    changed between calls; ``delete``: the received arrays are deleted after each check, so
    every earlier call's memory is free for the next."""
    devices = _devices()
    server, world = _solo(devices)
    try:
        refit = xr.Refit(world, receive={"w": _template(devices)},
                         config=xr.RefitConfig(timeout=30, **features))
        rng = np.random.default_rng(3)
        v = _values(1)[0]
        for _ in range(6):
            v = v.copy()
            v.reshape(-1)[rng.choice(v.size, 20, replace=False)] ^= 1
            refit(send={"w": _source(devices, v)})
            assert np.array_equal(_bits(refit.received["w"]), v)
            if delete:
                refit.received["w"].delete()
    finally:
        world.close()
        server.close()


def test_a_call_looks_at_each_kept_buffer_at_most_once(monkeypatch):
    """A receiver of many tensors whose caller still holds the arrays of earlier calls (as
    ``Refit.received`` does): each take must not rescan the buffers already found held (the
    first version did, 12,000 shards took 26 s a call). Counted, not timed: the looks at
    kept buffers per call stay under two per take."""
    from xreshard.adapters import jax_landing

    looks = []
    real = jax_landing._references
    monkeypatch.setattr(jax_landing, "_references", lambda kept, i: looks.append(1) or
                        real(kept, i))
    landing, held, n = jax_landing.Landing(), [], 2000
    for call in range(4):
        looks.clear()
        take = landing.begin()
        bufs = [take((16, 8), np.float32) for _ in range(n)]
        held.append(bufs)           # every call's buffers still seen by the caller
        landing.given()
        assert len(looks) <= 2 * n, (call, len(looks))
    looks.clear()
    freed = {b.ctypes.data for b in held[2]}    # the call before last's: kept by the landing
    del held[:3]                    # the caller drops them: the next call lands there
    take = landing.begin()
    again = [take((16, 8), np.float32) for _ in range(n)]
    assert len(looks) <= 2 * n
    assert {a.ctypes.data for a in again} == freed
