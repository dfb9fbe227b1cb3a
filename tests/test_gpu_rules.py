"""The GPU path against the CUDA, CuPy, torch and JAX rules it must respect, on CPU (issue 18).

Each test drives the real code through the smallest fake of one rule (``fake_cupy.py``
names the CuPy/CUDA rules it models; others are named at the test) and failed on the code
before issue 18. The cuda_ipc transport's own items are in test_cuda_ipc.py; the real
GPU runs of the same paths are in scripts/gpu_check.sh.

| item (issue 18)                               | test                                         |
|-----------------------------------------------|----------------------------------------------|
| 1 the check's evidence comes back             | test_gpu_check_dry_run_leaves_two_files...   |
| 4 verify on strided fp8                       | test_device_checksum_of_strided_fp8_...      |
| 5 aliasing of device memory                   | test_device_bindings_that_alias_are_...      |
| 7 fp8 JAX sends hold a reference              | test_fp8_jax_send_binding_holds_a_...        |
| 8 Refit.start on the caller's streams         | test_started_refit_runs_on_the_caller_s_...  |
| own non-blocking streams                      | test_device_work_runs_on_xreshard_s_own_...  |
| hard CUDA errors raised at once               | test_*_cuda_error_*                          |
| CuPy copies on the right device               | test_local_copies_between_two_gpus_...       |
| NCCL_MULTI_RANK_GPU_ENABLE                    | test_two_ranks_on_one_gpu_*                  |
| the NCCL library clash                        | test_nccl_wheel_clash_*, test_extras_*       |
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import xreshard as xr
from xreshard.transport.base import CudaError, TransportError, TransportTimeout

from . import fake_cupy

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cupy(monkeypatch):
    """The fake CuPy as ``cupy`` for this test, with fresh streams of xreshard's own."""
    from xreshard.runtime import devices
    module = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setattr(devices, "_OWN_STREAMS", {}, raising=False)
    yield module
    fake_cupy.runtime.eventQuery = fake_cupy._event_query


# ---------------------------------------------------------------------------- streams

def test_device_work_runs_on_xreshard_s_own_non_blocking_stream(cupy):
    """Packs and unpacks ran on the legacy default stream, which torch's default stream is.
    Now ``device_ctx`` makes xreshard's own non-blocking stream current, one per device,
    and ``order_after_current`` makes it wait (an event, no host wait) for the stream the
    bindings were ordered onto."""
    from xreshard.runtime.devices import device_ctx, order_after_current
    caller = fake_cupy.Stream()
    with fake_cupy.Device(0), caller:
        order_after_current([0])
        with device_ctx(0):
            own = cupy.cuda.get_current_stream(0)
    assert own is not fake_cupy.Stream.null and own.non_blocking
    assert [e.recorded_on for e in own.waited] == [caller]
    with device_ctx(0):
        assert cupy.cuda.get_current_stream(0) is own          # one per device, reused
    with device_ctx(1):
        assert cupy.cuda.get_current_stream(1) not in (own, fake_cupy.Stream.null)
    assert cupy.cuda.get_current_stream(0) is fake_cupy.Stream.null    # restored


def test_wait_devices_raises_a_cuda_error_at_once_not_a_timeout(cupy):
    """CuPy's ``eventQuery`` returns an error status instead of raising it, and
    ``Event.done`` read it as "not yet": a sticky CUDA error (every later query returns it,
    CUDA Programming Guide, error checking) became a timeout after the whole
    ``RefitConfig.timeout``."""
    from xreshard.runtime.devices import wait_devices
    fake_cupy.runtime.eventQuery = lambda ptr: 700          # the context's sticky error
    t0 = time.monotonic()
    with pytest.raises(CudaError, match=r"CUDA device\(s\) \[0\].*cudaErrorIllegalAddress: "
                                        r"an illegal memory access was encountered"):
        wait_devices([0], time.monotonic() + 3, 3)
    assert time.monotonic() - t0 < 1
    assert issubclass(CudaError, TransportError)
    from xreshard.errors import error_from, error_name
    crossed = error_from(error_name(CudaError("x")), "x")     # as it crosses processes
    assert type(crossed) is CudaError


def test_nccl_waits_abort_and_raise_a_cuda_error_at_once():
    from xreshard.transport.nccl import Post, _EventDone, wait_or_abort
    runtime = SimpleNamespace(eventQuery=lambda ptr: 700,
                              CUDARuntimeError=fake_cupy.CUDARuntimeError)
    pending = [_EventDone(SimpleNamespace(ptr=5), runtime, "the nccl transfers on CUDA "
                                                         "device 0")]
    aborted = []
    t0 = time.monotonic()
    with pytest.raises(CudaError, match=r"while the transfers ran.*cudaErrorIllegalAddress.*"
                                        r"send to rank 1 tag 0 .*aborted"):
        wait_or_abort(pending, [], [Post("send", 0, 1, 0, 8)], where="rank(s) [0]",
                      stage="the transfers ran", timeout=30, deadline=time.monotonic() + 30,
                      abort=lambda: aborted.append(1) or "The communicator was aborted.")
    assert aborted == [1] and time.monotonic() - t0 < 1


# ---------------------------------------------------------------------------- local copies

def test_local_copies_between_two_gpus_of_one_process_use_the_right_device(cupy):
    """A CuPy kernel runs on the thread's current device (and refuses arrays of another):
    ``dst[...] = src`` between ranks on GPUs 1 and 0 failed, or ran on the wrong device.
    The copy is one memcpy on the receive's posting stream, after the send's."""
    from xreshard.transport.local import LocalTransport
    src = fake_cupy.on_device(np.arange(64, dtype=np.uint8), 1)
    dst = fake_cupy.on_device(np.zeros(64, np.uint8), 0)
    s_src, s_dst = [None], [None]
    t = LocalTransport([0, 1])
    with t.group(5):
        with fake_cupy.Device(1):
            s_src[0] = fake_cupy.Stream(non_blocking=True)
            with s_src[0]:
                t.send(src, 1, 0, 0)
        with fake_cupy.Device(0):
            s_dst[0] = fake_cupy.Stream(non_blocking=True)
            with s_dst[0]:
                t.recv(dst, 1, 0, 0)
    assert np.array_equal(np.asarray(dst), np.arange(64))
    # one memcpy, queued under the receiver's device on the stream its receive was posted on
    assert fake_cupy.runtime.copies[-1:] == [(0, s_dst[0].ptr, 64)]
    # the receiver's stream waited for the sender's, and the sender's for the copy
    assert [e.recorded_on for e in s_dst[0].waited] == [s_src[0]]
    assert [e.recorded_on for e in s_src[0].waited] == [s_dst[0]]


# ---------------------------------------------------------------------------- item 5: aliasing

class DeviceView:
    """A strided view of fake device memory, known to xreshard only through the CUDA Array
    Interface (as a CuPy array or a torch CUDA tensor is): not a numpy array, so the old
    host-only check never looked at it. The memory is a host buffer's, never read here."""

    def __init__(self, base: np.ndarray, offset: int, shape, strides, dtype="bfloat16"):
        from xreshard.dtypes import numpy_dtype
        self.dtype = numpy_dtype(dtype)
        self.shape, self.strides = tuple(shape), tuple(strides)
        self.ptr = base.__array_interface__["data"][0] + offset
        self.size = int(np.prod(self.shape))
        self.itemsize = self.dtype.itemsize
        self.nbytes = self.size * self.itemsize
        c = self.strides == tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize
                                  for i in range(len(self.shape)))
        self.flags = SimpleNamespace(c_contiguous=c, f_contiguous=False, writeable=True)
        self.device = SimpleNamespace(id=0)

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.ptr, False), "shape": self.shape, "strides": self.strides,
                "typestr": self.dtype.str, "version": 3}


def _bound(arrays: dict[str, DeviceView], rank: int) -> xr.Bound:
    return xr.Bound({n: xr.Layout.replicated(a.shape, "bfloat16", xr.Mesh((1,), (rank,)))
                     for n, a in arrays.items()},
                    {(rank, n): a for n, a in arrays.items()})


def test_device_bindings_that_alias_are_refused_before_any_byte_moves(monkeypatch):
    """Issue 18 item 5: destinations sharing device memory with each other or with a source
    (an in-place reshard of CuPy/torch CUDA memory) wrote wrong bytes and reported
    success; they are refused by address range like host arrays."""
    from xreshard.runtime import devices
    from xreshard.runtime.binding import side_problems
    monkeypatch.setattr(devices, "device_problems", lambda sides, wire: [])
    mem = np.zeros(1 << 16, np.uint8)                     # one device allocation
    row = 64 * 2
    # a [32, 64] bf16 weight; the destination q is rows 0..15, k is rows 8..23: overlap
    q = DeviceView(mem, 0, (16, 64), (row, 2))
    k = DeviceView(mem, 8 * row, (16, 64), (row, 2))
    v = DeviceView(mem, 16 * row, (16, 64), (row, 2))
    # interleaved column halves of one buffer share no element: allowed
    left = DeviceView(mem, 40 * row, (16, 32), (row, 2))
    right = DeviceView(mem, 40 * row + 64, (16, 32), (row, 2))
    problems = side_problems({"receive": _bound({"q": q, "k": k}, 1)}, [1], lambda r: True,
                             None)
    assert len(problems) == 1 and problems[0][0] == "BindingError"
    assert "'k' on rank 1 and 'q' on rank 1 share memory" in problems[0][1]
    assert side_problems({"receive": _bound({"l": left, "r": right, "v": v}, 1)}, [1],
                         lambda r: True, None) == []
    # a receive that overwrites what a send of the same process still reads
    problems = side_problems({"send": _bound({"w": q}, 0), "receive": _bound({"w": v}, 1)},
                             [0, 1], lambda r: True, None)
    assert problems == []
    problems = side_problems({"send": _bound({"w": q}, 0), "receive": _bound({"w": k}, 1)},
                             [0, 1], lambda r: True, None)
    assert problems and problems[0][0] == "BindingError"
    assert "receive 'w' on rank 1 shares memory with send 'w' on rank 0" in problems[0][1]


def test_an_aliased_device_refit_fails_on_every_rank_before_moving(monkeypatch):
    """Through a Refit (one process, two ranks): refused at refit/check, nothing moves."""
    pytest.importorskip("torch")            # the rendezvous store is torch's TCPStore
    from xreshard.runtime import devices, execute
    monkeypatch.setattr(devices, "device_problems", lambda sides, wire: [])
    ran = []
    monkeypatch.setattr(execute.Executor, "run", lambda self: ran.append(1))
    mem = np.zeros(1 << 14, np.uint8)
    src = DeviceView(mem, 0, (16, 64), (128, 2))
    dst = DeviceView(mem, 1024, (16, 64), (128, 2))          # rows 8..23: overlaps rows 8..15
    with xr.serve() as server:
        world = xr.World.join(server.address, "local", 2, num_processes=1, index=0,
                              timeout=30)
        try:
            refit = xr.Refit(world, send=_bound({"w": src}, 0), receive=_bound({"w": dst}, 1))
            with pytest.raises(xr.BindingError, match=r"receive bindings alias send bindings: "
                                                      r"receive 'w' on rank 1 shares memory"):
                refit()
        finally:
            world.close()
    assert ran == []


# ---------------------------------------------------------------------------- item 4: verify

def test_device_checksum_of_strided_fp8_hashes_its_raw_bits(cupy):
    """Issue 18 item 4: ``verify=True`` made a strided fp8 region contiguous with a CuPy
    kernel, which has no float8 ("Unsupported dtype"). The region is hashed as its raw
    bits; the digest equals the host path's for the same bytes."""
    from xreshard.dtypes import numpy_dtype
    from xreshard.runtime.verify import checksum
    for dtype in ("float8_e4m3fn", "bfloat16"):
        values = (np.arange(48 * 40, dtype=np.float32).reshape(48, 40) % 37 - 18) / 4
        host = values.astype(numpy_dtype(dtype))
        device = fake_cupy.on_device(host, 0)
        for region in (device[:, 8:31], device[5:40:3, ::2], device.T):
            assert not region.flags.c_contiguous
            assert checksum(region) == checksum(np.asarray(region)), dtype


# ---------------------------------------------------------------------------- item 7: fp8 JAX

class _GpuArray:
    """A real (CPU) jax.Array that says it lives on a GPU, so ``host_view`` takes its CUDA
    branch. Everything else is the real array's: its DLPack export and its buffer."""

    def __init__(self, x):
        self.x = x
        self.dtype, self.shape = x.dtype, x.shape

    def devices(self):
        return [SimpleNamespace(platform="gpu", local_hardware_id=0)]

    def __dlpack__(self, stream=None):
        return self.x.__dlpack__()            # a CPU array takes no stream

    def unsafe_buffer_pointer(self):
        return self.x.unsafe_buffer_pointer()

    def block_until_ready(self):
        return self.x.block_until_ready()


class _Interface:
    def __init__(self, ptr, shape, dtype):
        self.__array_interface__ = {"data": (ptr, False), "shape": tuple(shape),
                                    "typestr": np.dtype(dtype).str, "version": 3}


def test_fp8_jax_send_binding_holds_a_reference_donation_honours(monkeypatch):
    """Issue 18 item 7: fp8 sends were wrapped from ``unsafe_buffer_pointer()``, which holds
    nothing on the buffer: a step donating the array (``jit(donate_argnums=...)``) freed it
    while ``Refit.start`` still read it. The binding now keeps an unconsumed DLPack capsule:
    JAX's rule (PjRt) is that a buffer with external references is not donated (the step
    gets a copy). Real JAX on CPU enforces that rule the same way it does on GPU."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from xreshard.adapters.jax import host_view

    owners = []

    class UnownedMemory:                      # cupy.cuda.UnownedMemory(ptr, size, owner, dev)
        def __init__(self, ptr, size, owner, device):
            self.ptr, self.owner = ptr, owner
            owners.append(owner)

    def ndarray(shape, dtype, memptr):       # cupy.ndarray over that memory (host here)
        return np.asarray(_Interface(memptr.mem.ptr + memptr.offset, shape, dtype))

    def from_dlpack(x):
        raise TypeError("CuPy has no float8 DLPack type")

    stream = SimpleNamespace(ptr=0)
    cuda = SimpleNamespace(Device=lambda i: contextlib.nullcontext(),
                           get_current_stream=lambda: stream, UnownedMemory=UnownedMemory,
                           MemoryPointer=lambda mem, off: SimpleNamespace(mem=mem, offset=off))
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda, ndarray=ndarray,
                                                              from_dlpack=from_dlpack))
    step = jax.jit(lambda a: (a.astype(jnp.float32) * 2).astype(a.dtype), donate_argnums=0)
    value = (np.arange(4096, dtype=np.float32) % 13 - 6).astype(jnp.float8_e4m3fn)
    x = jnp.asarray(value)
    view = host_view(_GpuArray(x))
    assert np.array_equal(view.view(np.uint8), value.view(np.uint8))
    step(x)                                   # the trainer's next step donates the params
    assert not x.is_deleted()                 # ... and got a copy: the refit still reads x
    assert np.array_equal(view.view(np.uint8), value.view(np.uint8))
    # once the refit dropped its bindings, the next step donates as it should
    del view, owners[:]
    x2 = jnp.asarray(value)
    view2 = host_view(_GpuArray(x2))
    del view2, owners[:]
    step(x2)
    assert x2.is_deleted()


# ---------------------------------------------------------------------------- item 8: streams

def test_started_refit_runs_on_the_caller_s_current_torch_stream(monkeypatch):
    """Issue 18 item 8: ``Refit.start`` bound torch tensors in its own thread, where torch's
    current stream (per thread: ``c10::cuda::getCurrentCUDAStream``) is the default one, so
    DLPack ordered the copies after the wrong stream. ``start()`` now captures the caller's
    current streams and the thread makes them current. The fake models only that rule."""
    torch = pytest.importorskip("torch")
    from xreshard.runtime.handle import RefitHandle
    local = threading.local()

    @contextlib.contextmanager
    def stream(s):
        before = getattr(local, "s", "default")
        local.s = s
        try:
            yield
        finally:
            local.s = before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: getattr(local, "s",
                                                                            "default"))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    with stream("side"):        # the caller wrote its weights on a side stream
        handle = RefitHandle(SimpleNamespace(version=0), None, None,
                             lambda s, r: torch.cuda.current_stream(0))
        handle.start()
    assert handle.wait(30) == "side"
    assert torch.cuda.current_stream(0) == "default"


# ---------------------------------------------------------------------------- NCCL

def test_two_ranks_on_one_gpu_follow_nccl_2_30_s_multi_rank_switch():
    from xreshard.errors import RefitError
    from xreshard.transport.nccl import _check_devices
    from xreshard.transport.nccl_setup import multi_rank_gpu
    on = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert _check_devices({0: 0, 1: 0}, 2, 1, multi_rank_gpu(23003, on)) == {0: 0, 1: 0}
    with pytest.raises(RefitError, match=r"ranks 0 and 1 both map to CUDA device 0; NCCL "
                                         r"2\.30\.3 allows several ranks on one GPU only with "
                                         r"NCCL_MULTI_RANK_GPU_ENABLE=1 set in every process"):
        _check_devices({0: 0, 1: 0}, 2, 1, multi_rank_gpu(23003, {}))
    assert "predates 2.30" in multi_rank_gpu(22907, on)[1]
    assert "NCCL 2.29.7 allows one rank per GPU" in multi_rank_gpu(22907, {})[1]


def test_two_ranks_on_one_gpu_in_a_world_name_the_switch(monkeypatch):
    from xreshard.errors import RefitError
    from xreshard.runtime.world_transports import WorldTransports
    from xreshard.transport import nccl_setup
    version = [22907]
    nccl = SimpleNamespace(get_version=lambda: version[0])
    monkeypatch.setattr(nccl_setup, "import_cupy", lambda: (None, nccl))
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    with pytest.raises(RefitError, match=r"ranks 0 and 2 share GPU GPU-a.*NCCL 2\.29\.7 allows "
                                         r"one rank per GPU.*NCCL >= 2\.30.*"
                                         r"NCCL_MULTI_RANK_GPU_ENABLE=1"):
        WorldTransports._refuse_shared_gpu(0, 2, "GPU-a")
    version[0] = 23007
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    WorldTransports._refuse_shared_gpu(0, 2, "GPU-a")        # allowed


def _dist(site: Path, name: str, version: str, lib: bytes | None) -> None:
    import base64
    import hashlib
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(lib).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"nvidia/nccl/lib/libnccl.so.2,sha256={digest},{len(lib)}\n")


def test_nccl_wheel_clash_names_the_wheel_that_replaced_torch_s(tmp_path):
    """Both NCCL wheels write nvidia/nccl/lib/libnccl.so.2: the one installed last owns the
    file, told by the sha256 its RECORD lists."""
    from xreshard.transport.nccl_setup import nccl_wheel_clash
    cu12, cu13 = b"libnccl built for CUDA 12", b"libnccl built for CUDA 13"
    _dist(tmp_path, "nvidia-nccl-cu12", "2.32.3", cu12)
    _dist(tmp_path, "nvidia-nccl-cu13", "2.29.7", cu13)
    lib = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(cu12)                       # xreshard[nccl] installed after torch
    why = nccl_wheel_clash("13.0", paths=[str(tmp_path)])
    assert why is not None
    assert "nvidia-nccl-cu12 2.32.3's" in why and "needs nvidia-nccl-cu13" in why
    assert "pip uninstall -y nvidia-nccl-cu12 && pip install --force-reinstall --no-deps " \
           "nvidia-nccl-cu13==2.29.7" in why
    assert nccl_wheel_clash("12.8", paths=[str(tmp_path)]) is None
    lib.write_bytes(cu13)
    from xreshard.transport import nccl_setup
    nccl_setup._sha256.cache_clear()
    assert nccl_wheel_clash("13.0", paths=[str(tmp_path)]) is None
    assert nccl_wheel_clash(None, paths=[str(tmp_path)]) is None


def test_extras_never_bring_an_nccl_of_another_cuda_major_than_their_name():
    """No extra may replace the NCCL torch brings: the extras to install beside a CUDA
    torch (``gpu-cu12`` / ``gpu-cu13``) bring no NCCL wheel at all, and an extra that does
    names its CUDA major (the same wheel torch of that major pins)."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for major in ("12", "13"):
        assert not any("nccl" in r for r in extras[f"gpu-cu{major}"])
        assert any(r.startswith(f"cupy-cuda{major}x") for r in extras[f"gpu-cu{major}"])
        assert f"nvidia-nccl-cu{major}" in extras[f"nccl-cu{major}"]
    for name, reqs in extras.items():
        for r in reqs:
            if r.startswith("nvidia-nccl-cu"):
                assert f"cu{r[len('nvidia-nccl-cu'):][:2]}" in name, (name, r)
    assert "nccl" not in extras             # the CUDA 12 NCCL under a name without a major
    install = (REPO / "docs" / "install.md").read_text()    # the README links it
    assert "xreshard[gpu-cu13]" in install and "xreshard[nccl-cu13]" in install


# ---------------------------------------------------------------------------- item 1: gpu_check

#: issue 33: the parts of each run, in order (correctness by value; the probes beside
#: the paths they probe)
GPU_CHECK_PARTS = {
    "check": ["env", "a_executor", "d_cases", "b_nccl_processes", "h_delta_device",
              "b1_slow_producer", "i_fp8_device", "i_fp8_delta", "b2_split_blocks",
              "a3_fp8_stage", "pytest_gpu", "a1_shrink", "g_relay", "g_relay_delta",
              "f_ipc_torch"],
    "bench": ["env", "c_bandwidth", "e_cuda_ipc", "j_delta_bench", "k_fp8_bench"],
}


@pytest.mark.parametrize("mode", ["check", "bench"])
def test_gpu_check_dry_run_leaves_two_files_and_runs_no_gpu_part(tmp_path, mode):
    """Issues 18 and 33: what a GPU run hands back is at most 8 files from $OUT and the
    last 12,000 characters of output; each of the two runs must end within 300 s on a
    fresh machine. The dry run walks every part of its run, leaves exactly summary.json
    and gpu_check.tgz, marks every GPU part "not run" (never "ok") with its cap, the caps
    sum within the budget less its reserve (under 300 s), "complete" is apart from "ok",
    and the verdict is the last line printed."""
    out = tmp_path / "out"
    env = {**os.environ, "XRESHARD_GPU_CHECK_DRY": "1", "OUT": str(out),
           "PYTHON": sys.executable}
    env.pop("GPU_CHECK_PARTS", None)
    env.pop("GPU_CHECK_BUDGET_S", None)
    argv = ["bash", str(REPO / "scripts" / "gpu_check.sh")] + (["bench"] if mode == "bench"
                                                               else [])
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode != 0, run.stdout        # a dry run never passes the check
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tgz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["dry"] is True
    assert summary["complete"] is False and summary["mode"] == mode
    parts = summary["parts"]
    names = [p["name"] for p in parts]
    assert names == GPU_CHECK_PARTS[mode]
    for p in parts:
        assert {"name", "status", "figure", "bar", "seconds", "cap_s"} <= set(p), p
        assert isinstance(p["bar"], str) and p["bar"]
        assert p["status"] == "not run", p
        assert "MISSING" not in p["why_not_run"], p
        assert f"[{p['name']}] not run (dry run; cap {p['cap_s']}s)" in run.stdout
    caps = sum(p["cap_s"] for p in parts)
    assert caps == summary["caps_s"] and summary["caps_fit"] is True
    assert caps <= summary["budget_s"] - summary["reserve_s"] and summary["budget_s"] < 300
    lines = run.stdout.splitlines()
    assert lines[-1].startswith(f"VERDICT gpu_check {mode}: ok=False complete=False"), lines[-1]
    assert len(lines) <= 4 * len(parts) + 12
    assert len(run.stdout) < 12000
    with tarfile.open(out / "gpu_check.tgz") as tgz:
        members = tgz.getnames()
    assert any(m.endswith("gpu_check.log") for m in members)
    assert not any("jax-cache" in m for m in members)


def test_gpu_check_refuses_an_unknown_run(tmp_path):
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "benchmark"],
                         env={**os.environ, "OUT": str(tmp_path / "out")},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2 and "usage" in run.stderr
