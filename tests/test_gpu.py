"""The nccl transport on a real GPU (one is enough): ``pytest -m gpu``.

Skipped cleanly where torch or CuPy sees no CUDA device. scripts/gpu_check.sh runs these on
a GPU machine. Single-GPU coverage: a 1-rank communicator sending to itself inside a group,
zero-copy imports from torch and JAX, stream ordering after a torch producer, and the
failure paths (absent peer at the rendezvous, at NCCL's init, and an unmatched receive).
The paths that can leave a thread inside NCCL run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

# JAX would otherwise take 75% of the GPU at first use, next to torch's and CuPy's pools.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO = Path(__file__).resolve().parents[1]


def _why_no_gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        return "CuPy is not installed (pip install 'xreshard[gpu-cu13]')"
    if not nccl.available:
        return "CuPy cannot load NCCL"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:
        return f"CuPy sees no CUDA device ({e})"
    return None


_WHY = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]

_keys = iter(range(10**6))


def _store():
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=60))


@pytest.fixture(scope="module")
def store():
    return _store()


@pytest.fixture(scope="module")
def transport(store):
    from xreshard.transport.nccl import NcclTransport
    t = NcclTransport(store, 1, {0: 0}, key="gpu-test/nccl/shared", timeout=120)
    yield t
    t.close()


def _fresh(store, **kw):
    from xreshard.transport.nccl import NcclTransport
    return NcclTransport(store, kw.pop("world_size", 1), kw.pop("devices", {0: 0}),
                         key=f"gpu-test/nccl/{next(_keys)}", **kw)


def _rand(n: int):
    import torch
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")


# ---------------------------------------------------------------------------- moves

def test_send_recv_to_self_byte_exact(transport):
    import torch
    sizes = [1, 4097, 3 << 20, 64 << 20]
    srcs = [_rand(n) for n in sizes]
    dsts = [torch.zeros_like(s) for s in srcs]
    with transport.group(timeout=60):
        for tag, (s, d) in reversed(list(enumerate(zip(srcs, dsts)))):   # post order is free
            transport.recv(d, 0, 0, tag)
            transport.send(s, 0, 0, tag)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_communicator_is_reused_across_groups_and_buffer_kinds(transport):
    import cupy
    import torch
    comms = dict(transport._comms)
    for round_ in range(3):
        src = cupy.random.randint(0, 256, 1 << 20, dtype=cupy.uint8)
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
        with transport.group(timeout=60):
            transport.send(src, 0, 0, round_)
            transport.recv(dst, 0, 0, round_)
        assert torch.equal(torch.from_dlpack(src), dst)
    assert transport._comms == comms


def test_zero_byte_posts_are_no_ops(transport):
    import torch
    empty = torch.empty(0, dtype=torch.uint8, device="cuda:0")
    with transport.group(timeout=10):
        transport.send(empty, 0, 0, 0)
        transport.recv(empty.clone(), 0, 0, 0)


def test_send_waits_for_the_torch_producer_stream(transport):
    """The producer's stream is still writing when the send is posted: DLPack's stream
    handshake must make our stream wait (no device-wide sync anywhere)."""
    import torch
    n = 256 << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)            # ~0.1 s of GPU time before the fill
        src.fill_(7)
        with transport.group(timeout=60):         # posted while `side` is torch's current stream
            transport.send(src, 0, 0, 0)
            transport.recv(dst, 0, 0, 0)
    assert int(dst.min()) == 7 and int(dst.max()) == 7


# ---------------------------------------------------------------------------- zero-copy

def test_torch_buffer_is_imported_zero_copy(transport):
    import torch
    t = _rand(1 << 16)
    array, ptr = transport._as_device_bytes(t, 0, "test")
    assert ptr == t.data_ptr() == array.data.ptr
    array[:4] = 42                                 # the same memory, seen from torch
    torch.cuda.synchronize()
    assert t[:4].tolist() == [42] * 4


def test_jax_buffer_is_imported_zero_copy_and_sent(transport):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np
    import torch
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend here ({e}); set JAX_PLATFORMS=cuda,cpu")
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, 256, 1 << 20,
                                                                     dtype=np.uint8)), gpu)
    array, ptr = transport._as_device_bytes(x, 0, "test")
    assert ptr == x.unsafe_buffer_pointer() == array.data.ptr
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    with transport.group(timeout=60):
        transport.send(x, 0, 0, 0)
        transport.recv(dst, 0, 0, 0)
    assert np.array_equal(dst.cpu().numpy(), np.asarray(x))


def test_bad_buffers_are_refused(transport):
    import torch
    from xreshard.errors import RefitError
    cases = [
        (torch.zeros(8, dtype=torch.bfloat16, device="cuda:0"), r"buffers are uint8, got dtype "
                                                                 r"bfloat16"),
        (torch.zeros(2, 4, dtype=torch.uint8, device="cuda:0"), r"1-D and contiguous"),
        (torch.zeros(8, dtype=torch.uint8, device="cuda:0")[::2], r"1-D and contiguous"),
        (torch.zeros(8, dtype=torch.uint8), r"DLPack device \(1, 0\) but this rank's GPU is "
                                            r"CUDA device 0"),
    ]
    for buf, match in cases:
        with pytest.raises(RefitError, match=match):
            with transport.group(timeout=5):
                transport.send(buf, 0, 0, 0)
    with pytest.raises(RefitError, match=r"posted outside a group"):
        transport.send(_rand(4), 0, 0, 0)


def test_key_reuse_close_and_use_after_close(store):
    from xreshard.errors import RefitError
    from xreshard.transport.base import TransportError
    from xreshard.transport.nccl import NcclTransport
    t = NcclTransport(store, 1, {0: 0}, key="gpu-test/nccl/reuse", timeout=60)
    with pytest.raises(RefitError, match=r"already exists in this process"):
        NcclTransport(store, 1, {0: 0}, key="gpu-test/nccl/reuse", timeout=60)
    t.close()
    t.close()
    with pytest.raises(TransportError, match=r"is closed"):
        with t.group(timeout=1):
            pass


# ---------------------------------------------------------------------------- failures

def test_absent_peer_times_out_at_the_rendezvous(store):
    from xreshard.transport.base import TransportTimeout
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"rank\(s\) \[1\] never arrived"):
        _fresh(store, world_size=2, timeout=3)
    assert time.monotonic() - start < 6


def _run_child(code: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    out["process_s"] = time.monotonic() - start
    return out


_PRELUDE = """
    import json, os, time, traceback
    from datetime import timedelta
    from torch.distributed import TCPStore
    from xreshard.transport.nccl import NcclTransport
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    def report(**kw):
        print(json.dumps(kw), flush=True)
        os._exit(0)       # a thread may still sit inside NCCL: do not wait for it
"""


def test_absent_peer_times_out_inside_nccl_init():
    """Rank 1 'arrives' at the store but never calls NCCL: the init must give up on time."""
    out = _run_child(_PRELUDE + """
    store.set("k/arrived/1", b"{}")               # a peer that dies between barrier and init
    start = time.monotonic()
    try:
        NcclTransport(store, 2, {0: 0}, key="k", timeout=5)
        report(ok=False, why="init returned")
    except Exception as e:
        report(ok=True, kind=type(e).__name__, msg=str(e), elapsed=time.monotonic() - start)
    """, timeout=120)
    assert out["ok"], out
    assert out["kind"] == "TransportTimeout", out
    assert "ncclCommInitRank did not complete" in out["msg"]
    assert out["elapsed"] < 8, out


def test_unmatched_receive_times_out_and_names_the_peer():
    """A receive whose send never comes: the group's wait must end with an error naming
    rank 0 / tag 3 within the timeout (plus the abort's grace)."""
    out = _run_child(_PRELUDE + """
    import torch
    t = NcclTransport(store, 1, {0: 0}, key="k", timeout=60)
    buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    start = time.monotonic()
    try:
        with t.group(timeout=3):
            t.recv(buf, 0, 0, 3)
        report(ok=False, why="group returned")
    except Exception as e:
        report(ok=True, kind=type(e).__name__, msg=str(e), elapsed=time.monotonic() - start)
    """, timeout=120)
    assert out["ok"], out
    assert out["kind"] in ("TransportTimeout", "TransportError"), out
    assert "recv from rank 0 tag 3" in out["msg"], out
    assert out["elapsed"] < 3 + 11, out
