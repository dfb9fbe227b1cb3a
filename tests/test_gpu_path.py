"""The GPU data path's logic, on CPU (issue 13): what runs the same on both devices.

- dtypes: a binding may be a raw-bits view of its tensor (what DLPack gives when the
  importer has no bf16 / float8 type: the old CUDA branch bound bf16 as int16). The
  executor must copy such bindings as bits, never value-cast them (a refit once reported
  success and left 5.5e-40 where 6.84 was sent).
- the torch adapter binds CPU and CUDA tensors through one path (export bits, view back).
- the adapters keep no sent array alive after a refit (JAX donation needs that).
- a checkout on PYTHONPATH imports the adapters without an install.
- the executor's device bookkeeping (one staging arena per device, alignment, the cast
  refusal) with fake devices.

Real CUDA runs of the same paths are in scripts/gpu_check.sh and tests/test_gpu*.py.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest

import xreshard as xr
from xreshard.dtypes import as_dtype, bits, numpy_dtype
from xreshard.runtime.execute import Executor
from xreshard.planner.schedule import peer_counts, schedule
from xreshard.tools.testing import local_arrays_from_global
from xreshard.transport.base import RecordingTransport
from xreshard.transport.local import LocalTransport

REPO = Path(__file__).resolve().parents[1]
ml_dtypes = pytest.importorskip("ml_dtypes")

# bf16 6.84375 is 0x40DB: value-cast from int16 16603 it would become 16603.0 (and an
# int16 -> bf16 -> ... round trip leaves garbage like 5.5e-40 where 6.84 was sent)
BF16_VALUES = np.array([6.84375, -1.5, 3.0e38, 1e-40, np.inf, -0.0], np.float32)


def _values(name: str, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    with np.errstate(over="ignore"):
        base = np.resize(BF16_VALUES, n) * np.linspace(1, 2, n, dtype=np.float32)
        return base.astype(numpy_dtype(name)).reshape(shape)


def _raw(arr: np.ndarray, signed: bool = True) -> np.ndarray:
    """A raw-bits view, as DLPack hands a bf16 / float8 buffer to an importer without it."""
    k = arr.dtype.itemsize
    return arr.view({1: np.uint8, 2: np.int16 if signed else np.uint16, 4: np.int32,
                     8: np.uint64}[k])


def _run(src_layouts, dst_layouts, src_values, *, wire=None, raw_src=True, raw_dst=True,
         bucket=1 << 20):
    plan = xr.plan(src_layouts, dst_layouts, wire_dtype=wire)
    ranks = sorted({r for lay in (*src_layouts.values(), *dst_layouts.values())
                    for r in lay.ranks})
    sched = schedule(plan, ranks, peer_counts(plan, ranks), bucket_bytes=bucket,
                     staging_bytes=1 << 22)
    src_b, dst_b, dst_typed = {}, {}, {}
    for n, lay in src_layouts.items():
        for r in lay.ranks:
            a = local_arrays_from_global(lay, r, src_values[n])
            src_b[(r, n)] = _raw(a) if raw_src else a
    for n, lay in dst_layouts.items():
        for r in lay.ranks:
            typed = np.zeros(lay.local_shape(r), numpy_dtype(lay.dtype))
            dst_typed[(r, n)] = typed
            dst_b[(r, n)] = _raw(typed, signed=r % 2 == 0) if raw_dst else typed
    rec = RecordingTransport(LocalTransport(ranks))
    stats = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, rec,
                     timeout=10).run()
    return plan, stats, rec, dst_typed


def _expected(dst_layout, rank, src_value, wire):
    value = src_value.astype(numpy_dtype(wire)).astype(numpy_dtype(dst_layout.dtype))
    return local_arrays_from_global(dst_layout, rank, value)


# ---------------------------------------------------------------------------- item 3

@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"])
def test_raw_bits_bindings_move_bit_exact(dtype):
    """Strided packs, unpacks, zero-copy and same-rank copies with int16 / uint8 bindings
    of bf16 / float8 tensors: every destination bit equals the source bit."""
    shape = (12, 10)
    src = {"w": xr.Layout.from_placements(shape, dtype, xr.Mesh((2,)), ["S1"])}
    # rank 1 is on both sides: it copies its own columns locally
    dst = {"w": xr.Layout.from_placements(shape, dtype, xr.Mesh((3,), (1, 2, 3)), ["S0"])}
    value = _values(dtype, shape)
    plan, stats, rec, got = _run(src, dst, {"w": value})
    for (r, n), arr in got.items():
        assert arr.tobytes() == _expected(dst[n], r, value, dtype).tobytes(), (r, n)
    assert rec.bytes_sent == plan.stats.bytes_moved == stats.bytes_sent
    assert stats.bytes_local > 0


def test_raw_bits_contiguous_regions_are_zero_copy():
    """The zero-copy test reads the layout's dtype, not the array's: a raw int16 view of a
    bf16 tensor is sent and received in place."""
    src = {"w": xr.Layout.replicated((8, 4), "bfloat16", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.from_placements((8, 4), "bfloat16", xr.Mesh((2,), (1, 2)), ["S0"])}
    value = _values("bfloat16", (8, 4))
    _, stats, _, got = _run(src, dst, {"w": value})
    assert stats.num_zero_copy == 4 and stats.staging_bytes == 0
    for (r, n), arr in got.items():
        assert arr.tobytes() == _expected(dst[n], r, value, "bfloat16").tobytes()


@pytest.mark.parametrize("src_dtype, wire, dst_dtype", [
    ("float32", "bfloat16", "bfloat16"),      # the fp32 master weights -> bf16 refit
    ("bfloat16", "float32", "float32"),       # a raw bf16 source cast up
    ("bfloat16", "bfloat16", "float32"),      # the receiver's cast
    ("float32", "bfloat16", "float32"),       # both sides cast (through the wire dtype)
    ("float32", "float8_e4m3fn", "float8_e4m3fn"),
])
def test_casts_read_raw_bindings_as_their_layout_dtype(src_dtype, wire, dst_dtype):
    shape = (6, 8)
    src = {"w": xr.Layout.from_placements(shape, src_dtype, xr.Mesh((2,)), ["S1"])}
    dst = {"w": xr.Layout.from_placements(shape, dst_dtype, xr.Mesh((3,), (1, 2, 3)),
                                          ["S0"])}
    value = _values(src_dtype, shape)
    _, _, _, got = _run(src, dst, {"w": value}, wire=wire)
    for (r, n), arr in got.items():
        assert arr.tobytes() == _expected(dst[n], r, value, wire).tobytes(), (r, n)


def test_mixed_dtype_buckets_keep_every_item_aligned():
    """Items of one message are laid out widest dtype first, so a 4-byte item never starts
    at an odd 2-byte offset (CUDA faults on misaligned loads)."""
    mesh1, mesh2 = xr.Mesh((1,), (0,)), xr.Mesh((1,), (1,))
    src = {"a": xr.Layout.replicated((3, 5), "bfloat16", mesh1),     # 30 bytes
           "b": xr.Layout.replicated((3, 3), "float32", mesh1),      # 36 bytes
           "c": xr.Layout.replicated((7,), "float8_e5m2", mesh1),
           "d": xr.Layout.replicated((2, 3), "float64", mesh1)}
    dst = {n: xr.Layout.replicated(lay.shape, lay.dtype, mesh2) for n, lay in src.items()}
    # transposed source views: no item is contiguous, all go through staging
    values = {n: _values(lay.dtype, lay.shape) for n, lay in src.items()}
    plan = xr.plan(src, dst)
    sched = schedule(plan, [0, 1], peer_counts(plan, [0, 1]), bucket_bytes=1 << 20,
                     staging_bytes=1 << 20)
    (bucket,) = [b for rnd in sched.rounds for b in rnd if b.src == 0]
    assert len(bucket.items) == 4
    src_b = {(0, n): np.asfortranarray(v).T.T for n, v in values.items()}
    dst_b = {(1, n): np.zeros(lay.shape, numpy_dtype(lay.dtype)) for n, lay in dst.items()}
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                  LocalTransport([0, 1]), timeout=10)
    for it, off in ex._packed(bucket):
        assert off % numpy_dtype(ex.wire[it.name]).itemsize == 0, (it.name, off)
    ex.run()
    for n, v in values.items():
        assert dst_b[(1, n)].tobytes() == v.tobytes()


def test_dtype_views_are_zero_copy_both_ways():
    a = _values("bfloat16", (4, 6))[:, ::2]
    raw = _raw(a)
    back = as_dtype(raw, "bfloat16")
    assert back.dtype == numpy_dtype("bfloat16") and np.shares_memory(back, a)
    assert bits(back).dtype == np.uint16 and np.shares_memory(bits(back), a)
    assert as_dtype(a, "bfloat16") is a
    with pytest.raises(xr.LayoutError, match=r"cannot hold float32 values"):
        as_dtype(raw, "float32")


# ---------------------------------------------------------------------------- torch adapter

def test_torch_tensor_view_is_one_path_for_cpu_and_cuda(monkeypatch):
    """tensor_view exports bf16 / float8 as bits on every device, then views them back:
    with a device exporter that, like CuPy's DLPack import, returns whatever integer array
    it was given, the binding still says bfloat16 and shares the tensor's memory."""
    torch = pytest.importorskip("torch")
    from xreshard.adapters import torch as xtorch

    seen = []

    def device_export(t):       # what cupy.from_dlpack gives for an int16 / uint8 tensor
        seen.append(t.dtype)
        return t.numpy()

    monkeypatch.setattr(xtorch, "_export", device_export)
    for dtype, bits_dtype in [(torch.bfloat16, torch.int16), (torch.float8_e4m3fn, torch.uint8),
                              (torch.float32, torch.float32)]:
        t = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
        view = xtorch.tensor_view(t[:, 1:5])
        assert seen[-1] == bits_dtype
        assert view.dtype == numpy_dtype(str(dtype))
        assert view.__array_interface__["data"][0] == t[:, 1:5].data_ptr()
        assert view.tobytes() == t[:, 1:5].contiguous().view(torch.uint8).numpy().tobytes()


def test_refit_into_raw_bf16_bindings_never_corrupts():
    """The issue's repro, end to end: JAX bf16 -> a torch bf16 tensor bound through a raw
    int16 view (what the CUDA branch used to bind), then through tensor_view. The refit
    either delivers 6.84375 bit for bit or refuses before moving anything (the binding
    check may insist on typed views); it never reports success over wrong bytes."""
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters.torch import tensor_view

    cpu, other = jax.devices("cpu")[:2]     # rank 1 (other) holds the torch tensor
    value = _values("bfloat16", (16, 8))
    layout = xr.Layout.replicated((16, 8), "bfloat16", xr.Mesh((1,), (1,)))
    with xr.serve() as server:
        with xr.World.join(server.address, "local", [cpu, other], num_processes=1, index=0,
                           timeout=30) as world:
            mesh = jax.sharding.Mesh(np.array([cpu]), ("x",))
            params = {"w": jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("x")))}
            for bind in (lambda t: t.view(torch.int16).numpy(), tensor_view):
                out = torch.zeros((16, 8), dtype=torch.bfloat16)
                refit = xr.Refit(world, send=params,
                                 receive=xr.Bound({"w": layout}, {(1, "w"): bind(out)}))
                try:
                    refit()
                except xr.RefitError as e:
                    assert bind is not tensor_view, e
                    assert "int16" in str(e) and "bfloat16" in str(e), e
                    assert not out.view(torch.int16).numpy().any()
                    continue
                assert out.view(torch.int16).numpy().tobytes() == value.tobytes()
                assert float(out[0, 0]) == 6.84375


# ---------------------------------------------------------------------------- item 5

def test_jax_adapter_keeps_no_sent_array_alive():
    """Binding (and dropping the binding) leaves no reference to the sent arrays in the
    adapter's memos: the trainer's old params die with the caller's last reference, so
    JAX can donate them."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters import jax as xjax

    devices = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    params = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x"))),
              "k": jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, P(None, "x")))}
    refs = [weakref.ref(a) for a in params.values()]
    bound = xjax.bind(params, "send", ranks={d.id: i for i, d in enumerate(devices)},
                      transpose=frozenset({"k"}))
    assert len(bound.bindings) == 4
    del bound, params
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_refit_keeps_no_sent_jax_array_alive():
    """After refit() returns, dropping the caller's params frees them (the issue measured
    donated params staying alive). Needs the adapter (above) and Refit dropping its
    executor bindings and its reference to ``send=`` after each call."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("torch")        # the world's store is torch's TCPStore
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    src_dev, dst_dev = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.array([src_dev]), ("x",))
    out = np.zeros((8, 4), np.float32)
    layout = xr.Layout.replicated((8, 4), "float32", xr.Mesh((1,), (1,)))
    with xr.serve() as server:
        with xr.World.join(server.address, "local", [src_dev, dst_dev], num_processes=1,
                           index=0, timeout=30) as world:
            refit = xr.Refit(world, receive=xr.Bound({"w": layout}, {(1, "w"): out}))
            refs = []
            for step in range(2):
                params = {"w": jax.device_put(jnp.full((8, 4), float(step)),
                                              NamedSharding(mesh, P()))}
                refs.append(weakref.ref(params["w"]))
                refit(send=params)
                assert (out == step).all()
                del params
                gc.collect()
                assert [r() for r in refs] == [None] * len(refs), f"step {step}"


# ---------------------------------------------------------------------------- item 1

_CHECKOUT_CHILD = textwrap.dedent("""
    import json, sys
    # what a checkout on PYTHONPATH sees on a machine where xreshard is not installed
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in
                        (type(f).__module__ + getattr(f, "__name__", ""))
                        and "Editable" not in getattr(f, "__name__", type(f).__name__)]
    sys.path[:] = [p for p in sys.path if "__editable__" not in p]
    sys.path_importer_cache.clear()
    import numpy as np
    import jax, jax.numpy as jnp, torch
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr
    from xreshard.adapters import jax as xjax, torch as xtorch

    src_dev, dst_dev = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.array([src_dev]), ("x",))
    value = np.arange(48, dtype=np.float32).reshape(6, 8)
    out = torch.zeros((6, 8), dtype=torch.bfloat16)
    layout = xr.Layout.replicated((6, 8), "bfloat16", xr.Mesh((1,), (1,)))
    with xr.serve() as server:
        with xr.World.join(server.address, "local", [src_dev, dst_dev], num_processes=1,
                           index=0, timeout=30) as world:
            refit = xr.Refit(world, send={"w": jax.device_put(jnp.asarray(value),
                                                               NamedSharding(mesh, P()))},
                             receive=xr.Bound({"w": layout}, {(1, "w"): xtorch.tensor_view(out)}),
                             config=xr.RefitConfig(wire_dtype="bfloat16"))
            refit()
    print(json.dumps({"files": [xr.__file__, xjax.__file__, xtorch.__file__],
                      "ok": torch.equal(out, torch.from_numpy(value).to(torch.bfloat16)),
                      "finders": [type(f).__name__ for f in sys.meta_path]}))
""")


def test_checkout_on_pythonpath_imports_adapters_and_refits():
    """A fresh interpreter with no editable-install finder imports xreshard and its
    adapters from the checkout on PYTHONPATH (the GPU machine runs the checkout that way)
    and runs a JAX -> torch refit."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "JAX_NUM_CPU_DEVICES": "2"}
    proc = subprocess.run([sys.executable, "-c", _CHECKOUT_CHILD], capture_output=True,
                          text=True, timeout=300, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"]
    assert not any("Editable" in f for f in out["finders"]), out["finders"]
    for f in out["files"]:
        assert Path(f).resolve().is_relative_to(REPO / "xreshard"), f
    assert Path(out["files"][1]).parent == REPO / "xreshard" / "adapters"


# ---------------------------------------------------------------------------- items 4, 6, 8

class _OnDevice(np.ndarray):
    """A host array that says it lives on a (fake) CUDA device; views inherit it."""

    def __array_finalize__(self, obj):
        self.fake_device = getattr(obj, "fake_device", None)


def _on_device(arr: np.ndarray, dev: int) -> _OnDevice:
    out = arr.view(_OnDevice)
    out.fake_device = dev
    return out


@pytest.fixture
def fake_devices(monkeypatch):
    """The executor's device hooks, recorded: which device is current for every copy and
    allocation, which devices were preflighted and waited for."""
    import contextlib
    from xreshard.runtime import execute

    log = {"current": None, "allocs": [], "copies": [], "waits": [], "preflight": [],
           "ordered": []}

    @contextlib.contextmanager
    def device_ctx(dev):
        before, log["current"] = log["current"], dev
        try:
            yield
        finally:
            log["current"] = before

    real_copy = execute.copy_into

    def copy_into(xp, out, out_dtype, src, src_dtype):
        log["copies"].append((log["current"], getattr(out, "fake_device", None),
                              getattr(src, "fake_device", None)))
        real_copy(xp, out, out_dtype, src, src_dtype)

    def device_alloc(n):
        log["allocs"].append((log["current"], n))
        return _on_device(np.empty(n, np.uint8), log["current"])

    monkeypatch.setattr(execute, "_device_ctx", device_ctx)
    monkeypatch.setattr(execute, "device_of", lambda a: getattr(a, "fake_device", None))
    monkeypatch.setattr(execute, "copy_into", copy_into)
    monkeypatch.setattr(execute, "_device_alloc", device_alloc)
    monkeypatch.setattr(execute, "_wait_devices", lambda devs, *a: log["waits"].append(devs))
    monkeypatch.setattr(execute, "_order_after_current", lambda devs: log["ordered"].append(devs))
    monkeypatch.setattr(execute, "cuda_preflight", lambda dev: log["preflight"].append(dev))
    return log


def _multi_gpu_run(wire=None, dst_dtype="bfloat16"):
    """One process, ranks 0..2 on CUDA devices 0, 1, 2: rank 0 and 1 send column halves,
    ranks 1 and 2 receive row halves (rank 1 copies its overlap locally)."""
    shape = (12, 10)
    src = {"w": xr.Layout.from_placements(shape, "bfloat16", xr.Mesh((2,)), ["S1"])}
    dst = {"w": xr.Layout.from_placements(shape, dst_dtype, xr.Mesh((2,), (1, 2)), ["S0"])}
    value = _values("bfloat16", shape)
    plan = xr.plan(src, dst, wire_dtype=wire)
    sched = schedule(plan, [0, 1, 2], peer_counts(plan, [0, 1, 2]), bucket_bytes=64,
                     staging_bytes=1 << 20)
    src_b = {(r, "w"): _on_device(_raw(local_arrays_from_global(src["w"], r, value)), r)
             for r in (0, 1)}
    dst_b = {(r, "w"): _on_device(np.zeros(dst["w"].local_shape(r),
                                           numpy_dtype(dst_dtype)), r) for r in (1, 2)}
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b,
                  LocalTransport([0, 1, 2]), timeout=10)
    return ex, dst, value, dst_b


def test_copies_and_staging_run_on_each_ranks_device(fake_devices):
    ex, dst, value, dst_b = _multi_gpu_run()
    stats = ex.run()
    for (r, n), arr in dst_b.items():
        assert np.asarray(arr).tobytes() == _expected(dst[n], r, value, "bfloat16").tobytes()
    log = fake_devices
    # one arena per device that stages, allocated under that device
    assert sorted(k for k in ex._arena) == sorted({cur for cur, _ in log["allocs"]})
    assert all(ex._arena[dev].fake_device == dev for dev in ex._arena)
    assert stats.staging_bytes == sum(n for _, n in log["allocs"])
    # every copy ran under the device of the array it writes, reading the same device
    assert log["copies"] and all(cur == out for cur, out, _ in log["copies"])
    assert all(src in (None, cur) for cur, _, src in log["copies"])
    assert stats.bytes_local > 0
    # preflight once per device, then one wait on every device at the end
    assert log["preflight"] == [0, 1, 2] and log["waits"] == [[0, 1, 2]]


def test_staging_is_reused_per_device_across_runs(fake_devices):
    ex, *_ = _multi_gpu_run()
    ex.run()
    arenas = dict(ex._arena)
    ex.run()
    assert all(ex._arena[d] is arenas[d] for d in arenas)


def test_gpu_casts_cupy_cannot_run_are_refused_before_moving(fake_devices, monkeypatch):
    from xreshard.runtime import execute
    monkeypatch.setattr(execute, "cupy_knows", lambda name: name != "bfloat16")
    ex, _, _, dst_b = _multi_gpu_run(wire="float32", dst_dtype="float32")
    with pytest.raises(xr.RefitError, match=r"casts this refit needs cannot run on the GPU: "
                                            r"'w' \(receive, rank 1\): float32 <-> bfloat16 "
                                            r"on CUDA device 1|'w' \(send, rank 0\): bfloat16 "
                                            r"<-> float32 on CUDA device 0: bfloat16 "
                                            r"arithmetic needs CuPy >= 14"):
        ex.run()
    assert fake_devices["copies"] == [] and fake_devices["preflight"] == []
    assert all(not np.asarray(a).any() for a in dst_b.values())


def test_float8_casts_on_gpu_are_refused_with_the_reason(fake_devices):
    shape = (4, 4)
    src = {"w": xr.Layout.replicated(shape, "float32", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated(shape, "float8_e4m3fn", xr.Mesh((1,), (1,)))}
    plan = xr.plan(src, dst, wire_dtype="float8_e4m3fn")
    sched = schedule(plan, [0, 1], peer_counts(plan, [0, 1]), bucket_bytes=1 << 20,
                     staging_bytes=1 << 20)
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes,
                  {(0, "w"): _on_device(np.ones(shape, np.float32), 0)},
                  {(1, "w"): _on_device(np.zeros(shape, np.uint8), 1)},
                  LocalTransport([0, 1]), timeout=10)
    with pytest.raises(xr.RefitError, match=r"'w' \(send, rank 0\): float32 <-> float8_e4m3fn "
                                            r"on CUDA device 0: CuPy has no float8 kernels"):
        ex.run()


def test_a_rank_bound_on_two_devices_is_refused(fake_devices):
    ex, *_ = _multi_gpu_run()
    ex.dst_bindings[(1, "w")] = _on_device(np.asarray(ex.dst_bindings[(1, "w")]).copy(), 2)
    with pytest.raises(xr.RefitError, match=r"rank 1 has bindings in two places \(CUDA device "
                                            r"1 and CUDA device 2, tensor 'w'\)"):
        ex.run()


def test_install_hints_name_both_cuda_majors():
    from xreshard.transport.nccl import install_hint
    assert "xreshard[nccl-cu13]" in install_hint(13) and "cupy-cuda13x" in install_hint(13)
    assert "xreshard[nccl-cu12]" in install_hint(12) and "nvidia-nccl-cu12" in install_hint(12)
    both = install_hint(0)
    assert "nccl-cu13" in both and "nccl-cu12" in both


def test_widened_copies_move_fewer_larger_elements_only_when_aligned():
    from xreshard.runtime.copies import widened
    ptr = lambda a: a.__array_interface__["data"][0]      # noqa: E731
    base = np.zeros((8, 128), np.uint16)
    out = np.zeros((8, 64), np.uint16)
    o, s = widened(out, base[:, :64], ptr)                  # 128 B runs, 8-byte aligned
    assert o.dtype == s.dtype == np.uint64 and o.shape == s.shape == (8, 16)
    assert np.shares_memory(o, out) and np.shares_memory(s, base)
    assert widened(out, base[:, 2:66], ptr)[1].dtype == np.uint32    # 4-byte aligned start
    assert widened(out, base[:, 1:65], ptr)[1].dtype == np.uint16    # 2-byte aligned only
    assert widened(out[:, :63], base[:, :63], ptr)[0].dtype == np.uint16   # odd run
    t = base[:64, :8].T                                     # transposed: last dim strided
    assert widened(np.zeros((8, 64), np.uint16), t, ptr)[1] is t
    # a widened copy is the same bytes
    src = np.arange(8 * 128, dtype=np.uint16).reshape(8, 128)
    o, s = widened(out, src[:, 64:], ptr)
    np.copyto(o, s)
    assert out.tobytes() == np.ascontiguousarray(src[:, 64:]).tobytes()


# ---------------------------------------------------------------------------- gpu_check dry runs

def test_gpu_check_executor_cases_dry_run_on_cpu():
    """scripts/gpu_check.sh part (a), its logic on CPU: same cases, numpy bindings, the
    local transport in place of the folded NCCL communicator."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from .test_gpu_refit import executor_cases
    report = executor_cases("cpu")
    assert report["ok"], json.dumps(report, indent=1, default=str)[-4000:]
    cases = report["cases"]
    assert len(cases) == 8
    assert cases["bf16_in_place_row_range"]["pointer_identity"]
    assert cases["several_staging_rounds"]["num_rounds"] >= 4
    assert cases["fp32_to_bf16_wire_cast"]["matches_torch_cast"]


@pytest.mark.slow
def test_gpu_check_two_processes_dry_run_on_cpu(tmp_path):
    """Part (b)'s harness on CPU: two real processes (JAX, torch) over gloo, JSON back."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from .test_gpu_refit import two_processes
    report = two_processes("cpu", timeout=60, logs=tmp_path)
    assert report["ok"], json.dumps(report, indent=1, default=str)[-4000:]
    assert list(report["attempts"]) == ["hostid"]
    assert {p["returncode"] for p in report["attempts"]["hostid"]["processes"].values()} == {0}


def test_gpu_check_bandwidth_dry_run_on_cpu(tmp_path):
    """Part (c)'s benchmark with numpy: the executor's copy path is exact on every region."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "c.json"
    bench_gpu.main(["--device", "cpu", "--pack-size", "256", "--iters", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert len(report["pack"]["regions"]) == 6
    assert all(r["exact"] for r in report["pack"]["regions"])


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")], check=True,
                   timeout=30)


def test_cuda_preflight_names_what_is_missing():
    """Here CuPy is installed but no CUDA driver is: the preflight fails before any byte
    moves, naming the step and the packages of the installed CUDA major."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is visible here")
    except Exception:
        pass
    from xreshard.runtime.execute import cuda_preflight
    with pytest.raises(xr.RefitError, match=r"CUDA device 0 cannot run the refit's copy kernels: "
                                            r"allocating on the device failed: .*pip install "
                                            r"'xreshard\[gpu-cu1[23]\]'"):
        cuda_preflight(0)
