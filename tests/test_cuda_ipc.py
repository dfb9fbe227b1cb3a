"""The cuda_ipc transport.

On CPU: its logic over a fake of the CUDA calls (``FakeCuda``: "device memory" is numpy,
two "processes" share one fake GPU), two transports in one process with their groups in
threads: byte-exact moves, one handle per allocation (not per message), handles cached
across refits and re-exported for a new allocation, the receiver's stream waiting on the
sender's event before copying, the LRU of opened handles, refusals and timeouts.

On a GPU (``gpu`` marker, skipped without one): a JAX process and a torch process on one
GPU refit through ``transport="auto"`` (which routes them to cuda_ipc), bit-exact.
scripts/gpu_check.sh runs the 8 GiB version with the bandwidth ratio (``bench``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from xreshard.transport.base import TransportError, TransportTimeout
from xreshard.transport.cuda_ipc import CudaIpcTransport, local_cuda_caps

MAPPED = 1 << 40        # a peer's mapping of an allocation lives at base + MAPPED


class FakeGpu:
    """One GPU's memory, shared by the fake "processes" on it.

    Models two CUDA rules the transport must respect: ``cudaIpcGetMemHandle`` works on
    ``cudaMalloc`` allocations only (``exportable=False`` stands for torch's expandable
    segments, cuMemCreate memory), and freeing an allocation while another process still
    maps it is undefined (CUDA Runtime API, cudaIpcGetMemHandle): ``free`` records it.
    """

    def __init__(self):
        self.allocs: dict[int, tuple[np.ndarray, int, bool]] = {}  # base -> (bytes, id, exportable)
        self.next_base = 1 << 20
        self.next_id = 1
        self.events: dict[int, int] = {}                        # event -> times recorded
        self.mapped: dict[int, set[int]] = {}                   # base -> processes mapping it
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def malloc(self, nbytes: int, exportable: bool = True) -> "FakeBuf":
        with self.lock:
            base = self.next_base
            self.next_base += (nbytes + 4095) // 4096 * 4096 + 4096
            self.allocs[base] = (np.zeros(nbytes, np.uint8), self.next_id, exportable)
            self.next_id += 1
        return FakeBuf(self, base, 0, nbytes)

    def free(self, buf: "FakeBuf") -> None:
        if self.mapped.get(buf.base):
            self.violations.append(f"freed {buf.base:#x} while processes "
                                   f"{sorted(self.mapped[buf.base])} still map it")
        del self.allocs[buf.base]

    def bytes_at(self, addr: int, n: int) -> np.ndarray:
        addr = addr - MAPPED if addr >= MAPPED else addr
        for base, (arr, _, _) in self.allocs.items():
            if base <= addr and addr + n <= base + arr.size:
                return arr[addr - base:addr - base + n]
        raise AssertionError(f"no allocation holds [{addr:#x}, +{n})")


class FakeBuf:
    """A contiguous device buffer: ``nbytes`` at ``offset`` of the allocation at ``base``."""

    def __init__(self, gpu: FakeGpu, base: int, offset: int, nbytes: int):
        self.gpu, self.base, self.offset, self.nbytes = gpu, base, offset, nbytes

    @property
    def ptr(self) -> int:
        return self.base + self.offset

    def view(self, offset: int, nbytes: int) -> "FakeBuf":
        return FakeBuf(self.gpu, self.base, self.offset + offset, nbytes)

    @property
    def host(self) -> np.ndarray:
        return self.gpu.bytes_at(self.ptr, self.nbytes)


class FakeCuda:
    """The ``CupyCuda`` interface over a ``FakeGpu`` for one "process"; logs what it asked.

    Copies are asynchronous, as on a CUDA stream: ``copy`` queues them and they run when an
    event recorded after them is queried, reading through the mapping then (a mapping
    closed before its copy ran is a violation). A process opens a peer's allocation from
    one device only (cuIpcOpenMemHandle: one context per device per exporting process).
    """

    _ids = iter(range(1, 10**6))

    def __init__(self, gpu: FakeGpu):
        self.gpu = gpu
        self.me = next(self._ids)
        self.log: list[tuple] = []
        self.exports = self.opens = 0
        self.closed: list[int] = []
        self.open_maps: dict[int, int] = {}          # mapped ptr -> device it was opened on
        self.queued: list[tuple[int, int, int]] = []
        self.complete = True
        self.error: Exception | None = None

    def pointer(self, buf, device):
        self.log.append(("import", buf.ptr))
        return buf.ptr, buf.nbytes, buf

    def allocation(self, ptr, device):
        for base, (arr, bid, _) in self.gpu.allocs.items():
            if base <= ptr < base + max(arr.size, 1):
                return base, arr.size, bid
        raise AssertionError(ptr)

    def mem_handle(self, base, device):
        if not self.gpu.allocs[base][2]:
            raise RuntimeError("cudaErrorInvalidValue: invalid argument")
        self.exports += 1
        return b"H" + base.to_bytes(8, "little") + bytes(55)

    def open_mem(self, handle, device):
        base = int.from_bytes(handle[1:9], "little")
        ptr = base + MAPPED
        if ptr in self.open_maps and self.open_maps[ptr] != device:
            raise RuntimeError("cudaErrorInvalidContext: invalid device context (this "
                               "process opened the handle from another device)")
        self.opens += 1
        self.open_maps[ptr] = device
        self.gpu.mapped.setdefault(base, set()).add(self.me)
        return ptr

    def _size(self, mapped: int) -> int:
        got = self.gpu.allocs.get(mapped - MAPPED)
        return got[0].size if got else 0

    def close_mem(self, ptr, device):
        if any(ptr <= src < ptr + self._size(ptr) for _, src, _ in self.queued):
            self.gpu.violations.append(f"closed mapping {ptr:#x} under a queued copy")
        self.closed.append(ptr)
        self.open_maps.pop(ptr, None)
        self.gpu.mapped.get(ptr - MAPPED, set()).discard(self.me)

    def staging(self, nbytes, device):
        buf = self.gpu.malloc(nbytes)
        return buf.ptr, buf

    def _new_event(self):
        with self.gpu.lock:
            ev = len(self.gpu.events) + 1
            self.gpu.events[ev] = 0
        return ev

    def ipc_event(self, device):
        return self._new_event()

    def event(self, device):
        return self._new_event()

    def event_handle(self, ev):
        return b"E" + ev.to_bytes(8, "little") + bytes(55)

    def open_event(self, handle, device):
        return int.from_bytes(handle[1:9], "little")

    def destroy_event(self, ev):
        pass

    def record(self, ev, device):
        self._run_queued()          # what an event waits for runs before it fires
        self.gpu.events[ev] += 1
        self.log.append(("record", ev))

    def wait_event(self, device, ev):
        assert self.gpu.events[ev] > 0, "waiting on an event never recorded"
        self.log.append(("wait", ev))

    def copy(self, dst, src, n, device):
        if src >= MAPPED and not any(p <= src < p + self._size(p) for p in self.open_maps):
            self.gpu.violations.append(f"copy from {src:#x}: not mapped here")
        self.queued.append((dst, src, n))
        self.log.append(("copy", dst, src, n))

    def _run_queued(self):
        for dst, src, n in self.queued:
            self.gpu.bytes_at(dst, n)[...] = self.gpu.bytes_at(src, n)
        self.queued.clear()

    def query(self, ev):
        if self.error is not None:
            raise self.error
        if self.complete:
            self._run_queued()
        return self.complete


def _store_pair():
    torch = pytest.importorskip("torch")
    server = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                        datetime.timedelta(seconds=10), wait_for_workers=False)

    def client():
        return torch.distributed.TCPStore("127.0.0.1", server.port, None, False,
                                          datetime.timedelta(seconds=10), wait_for_workers=False)
    return server, client


def _pair(**kw):
    """Processes 0 (rank 0) and 1 (rank 1) on one fake GPU (ordinal 0 in both)."""
    server, client = _store_pair()
    gpu = FakeGpu()
    apis = FakeCuda(gpu), FakeCuda(gpu)
    ts = [CudaIpcTransport(client(), "ipc", [0, 1], p, [1 - p], {p: 0}, api=apis[p],
                           process_labels=["trainer[0]", "rollout[0]"], **kw)
          for p in (0, 1)]
    ts[0]._server = server
    return gpu, apis, ts


def _both(fa, fb):
    out: list[Any] = [None, None]

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:   # noqa: BLE001 - returned to the test
            out[i] = e
    t = threading.Thread(target=run, args=(1, fb))
    t.start()
    run(0, fa)
    t.join(30)
    assert not t.is_alive()
    return out


def _fill(buf: FakeBuf, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, buf.nbytes, dtype=np.uint8)
    buf.host[...] = data
    return data


def _refit(ts, sends, recvs, timeout=10):
    def a():
        with ts[0].group(timeout):
            for tag, buf in enumerate(sends):
                ts[0].send(buf, 0, 1, tag)

    def b():
        with ts[1].group(timeout):
            for tag, buf in enumerate(recvs):
                ts[1].recv(buf, 0, 1, tag)
    return _both(a, b)


def test_one_handle_per_allocation_cached_across_refits_and_events_before_copies():
    gpu, apis, ts = _pair()
    pool, other = gpu.malloc(1 << 16), gpu.malloc(5000)       # the sender's allocations
    sends = [pool.view(i * 8192, 8000) for i in range(5)] + [other.view(8, 4000)]
    dst_pool = gpu.malloc(1 << 16)
    recvs = [dst_pool.view(i * 8192, s.nbytes) for i, s in enumerate(sends)]
    for step in range(3):
        want = [_fill(s, 10 * step + i) for i, s in enumerate(sends)]
        ra, rb = _refit(ts, sends, recvs)
        assert ra is None and rb is None, (ra, rb)
        assert all(np.array_equal(r.host, w) for r, w in zip(recvs, want))
        # six messages from two allocations: two handles, exported once (cached by buffer
        # id), mapped once per group and unmapped at its end
        assert apis[0].exports == 2
        assert apis[1].opens == 2 * (step + 1) == ts[1].num_opened
        assert len(apis[1].closed) == apis[1].opens and not apis[1].open_maps
    # the receiver's stream waits on the sender's event before its first copy
    kinds = [e[0] for e in apis[1].log]
    assert kinds.index("wait") < kinds.index("copy")
    assert ("record", apis[1].log[kinds.index("wait")][1]) in apis[0].log
    # a new allocation is a new buffer id: a new handle
    fresh = gpu.malloc(8000)
    want = _fill(fresh, 99)
    ra, rb = _refit(ts, [fresh], [recvs[0]])
    assert ra is None and rb is None and np.array_equal(recvs[0].host, want)
    assert apis[0].exports == 3
    for t in ts:
        t.close()
    assert gpu.violations == []


def test_mappings_end_with_their_group_so_the_sender_may_free_at_once():
    """Issue 18 item 6: a receiver used to keep peers' allocations mapped across refits, and
    a sender freeing them between refits (torch's empty_cache, an OOM retry) is undefined
    behaviour in CUDA. Each group now unmaps what it mapped once its copies finished."""
    gpu, apis, ts = _pair()
    src, dst = gpu.malloc(4096), gpu.malloc(4096)
    want = _fill(src, 3)
    ra, rb = _refit(ts, [src], [dst])
    assert ra is None and rb is None and np.array_equal(dst.host, want)
    gpu.free(src)                       # the trainer's allocator returns it to the driver
    assert gpu.violations == [] and not apis[1].open_maps
    for t in ts:
        t.close()


def test_a_mapping_is_never_closed_under_a_queued_copy():
    """With more allocations in one group than ``max_open``, the receiver waits for the
    copies queued so far before unmapping (the old LRU closed the first mapping while its
    copy still sat on the stream)."""
    gpu, apis, ts = _pair(max_open=1)
    bufs = [gpu.malloc(1024) for _ in range(3)]
    dst = gpu.malloc(3 * 1024)
    want = [_fill(b, b.base % 251) for b in bufs]
    ra, rb = _refit(ts, bufs, [dst.view(i * 1024, 1024) for i in range(3)])
    assert ra is None and rb is None, (ra, rb)
    assert np.array_equal(dst.host, np.concatenate(want))
    assert apis[1].opens == 3 and len(apis[1].closed) == 3
    assert gpu.violations == []
    for t in ts:
        t.close()


def test_one_allocation_received_on_two_gpus_of_one_process_is_opened_once():
    """A process with ranks on GPUs 0 and 1 receives two messages living in one allocation
    of its peer: CUDA lets one device of a process open a peer's handle; the transport maps
    it once and copies from that mapping on both devices."""
    server, client = _store_pair()
    gpu = FakeGpu()
    apis = FakeCuda(gpu), FakeCuda(gpu)
    ts = [CudaIpcTransport(client(), "ipc", [0, 1, 1], 0, [1], {0: 0}, api=apis[0]),
          CudaIpcTransport(client(), "ipc", [0, 1, 1], 1, [0], {1: 0, 2: 1}, api=apis[1])]
    pool = gpu.malloc(8192)
    sends = [pool.view(0, 4096), pool.view(4096, 4096)]
    want = [_fill(b, i) for i, b in enumerate(sends)]
    dst = [gpu.malloc(4096), gpu.malloc(4096)]

    def a():
        with ts[0].group(10):
            ts[0].send(sends[0], 0, 1, 0)
            ts[0].send(sends[1], 0, 2, 0)

    def b():
        with ts[1].group(10):
            ts[1].recv(dst[0], 0, 1, 0)
            ts[1].recv(dst[1], 0, 2, 0)
    ra, rb = _both(a, b)
    assert ra is None and rb is None, (ra, rb)
    assert all(np.array_equal(d.host, w) for d, w in zip(dst, want))
    assert apis[1].opens == 1 and gpu.violations == []
    for t in ts:
        t.close()
    del server


def test_zero_byte_messages_cross_and_do_not_hang_the_receiver():
    gpu, apis, ts = _pair()
    src, dst = gpu.malloc(64), gpu.malloc(64)
    want = _fill(src, 5)
    t0 = time.monotonic()
    ra, rb = _refit(ts, [src.view(0, 0), src], [dst.view(0, 0), dst], timeout=5)
    assert ra is None and rb is None, (ra, rb)
    assert np.array_equal(dst.host, want) and time.monotonic() - t0 < 4
    # a zero-byte send against a non-empty receive is a size mismatch, named
    gpu, apis, ts = _pair()
    ra, rb = _refit(ts, [gpu.malloc(8).view(0, 0)], [gpu.malloc(8)], timeout=5)
    assert isinstance(rb, TransportError) and "sender posted 0 bytes" in str(rb)


def test_memory_without_an_ipc_handle_is_staged_and_moves_bit_exact(caplog):
    """Issue 18 item 2: torch's ``expandable_segments:True`` memory has no IPC handle. The
    sender copies such sends into its own exportable staging (kept across groups) instead
    of failing and leaving the receivers to wait out the timeout."""
    gpu, apis, ts = _pair()
    segment = gpu.malloc(1 << 14, exportable=False)
    sends = [segment.view(0, 5000), segment.view(8192, 3000)]
    recvs = [gpu.malloc(5000), gpu.malloc(3000)]
    exports = []
    for step in range(3):
        want = [_fill(s, 7 * step + i) for i, s in enumerate(sends)]
        with caplog.at_level("WARNING", logger="xreshard.transport.cuda_ipc"):
            ra, rb = _refit(ts, sends, recvs)
        assert ra is None and rb is None, (ra, rb)
        assert all(np.array_equal(r.host, w) for r, w in zip(recvs, want))
        exports.append(apis[0].exports)
    assert ts[0].num_staged == 6
    assert exports[0] >= 1 and exports[2] == exports[0]     # the staging is reused
    assert sum("has no IPC handle" in r.message for r in caplog.records) == 1     # once
    for t in ts:
        t.close()
    assert gpu.violations == []


def test_a_send_that_cannot_move_fails_its_receiver_at_once():
    """The sender publishes an error record: the receiver raises it at once (not after
    waiting out its timeout), naming the sender and the CUDA error."""
    gpu, apis, ts = _pair()

    def no_staging(nbytes, device):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
    apis[0].staging = no_staging
    t0 = time.monotonic()
    ra, rb = _refit(ts, [gpu.malloc(64, exportable=False)], [gpu.malloc(64)], timeout=20)
    assert time.monotonic() - t0 < 10
    assert isinstance(ra, TransportError) and "out of memory" in str(ra)
    assert isinstance(rb, TransportError) and "the sender failed" in str(rb)
    assert "cudaErrorMemoryAllocation" in str(rb) and "trainer[0]" in str(rb)


def test_a_hard_cuda_error_in_the_copies_raises_at_once_on_both_sides():
    from xreshard.transport.base import CudaError
    gpu, apis, ts = _pair()
    apis[1].error = CudaError("cuda_ipc: CUDA reported cudaErrorIllegalAddress: an illegal "
                              "memory access was encountered")
    t0 = time.monotonic()
    ra, rb = _refit(ts, [gpu.malloc(64)], [gpu.malloc(64)], timeout=20)
    assert time.monotonic() - t0 < 10
    assert isinstance(rb, CudaError) and "illegal memory access" in str(rb)
    assert isinstance(ra, TransportError) and "illegal memory access" in str(ra)


class _FakeRuntime:
    """CuPy's runtime module as far as ``CupyCuda.query`` uses it. ``cudaEventQuery`` returns
    errors of earlier asynchronous work too (CUDA Runtime API, cudaEventQuery): CuPy raises
    them as ``CUDARuntimeError``, and a status other than 0 and 600 is one."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            self.status = status
            super().__init__({700: "cudaErrorIllegalAddress: an illegal memory access was "
                                   "encountered", 600: "cudaErrorNotReady: device not ready"
                              }.get(status, f"cudaError {status}"))

    def __init__(self, outcome):
        self.outcome = outcome

    def eventQuery(self, event):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("outcome", ["returned", "raised"])
def test_event_query_turns_cuda_errors_into_cuda_error_not_a_finished_copy(outcome):
    from xreshard.transport.base import CudaError
    from xreshard.transport.cuda_ipc import CupyCuda
    api = object.__new__(CupyCuda)          # no CuPy, no driver: only the runtime calls
    api.rt = _FakeRuntime(0)
    assert api.query(1) is True
    api.rt = _FakeRuntime(600)
    assert api.query(1) is False
    api.rt = _FakeRuntime(_FakeRuntime.CUDARuntimeError(600))
    assert api.query(1) is False
    api.rt = _FakeRuntime(700 if outcome == "returned" else _FakeRuntime.CUDARuntimeError(700))
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress: an illegal memory access"):
        api.query(1)


class _FakeDriver:
    """libcuda as ``CupyCuda.device_uuid`` calls it: two GPUs whose 16-byte UUIDs agree up
    to a zero byte (CuPy's property dict, a C string, cuts them there)."""

    UUIDS = [bytes.fromhex("5e1f0a00" + "11" * 12), bytes.fromhex("5e1f0a00" + "22" * 12)]

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal.value
        return 0

    def cuDeviceGetUuid_v2(self, out, dev):
        out._obj[:] = self.UUIDS[dev.value]
        return 0


def test_device_uuids_are_the_driver_s_full_16_bytes():
    """Issue 18 item 3: two GPUs with the same UUID prefix up to a zero byte compared equal
    (and select.choose_routes sent their pair to cuda_ipc)."""
    import ctypes
    from xreshard.transport.cuda_ipc import CupyCuda

    class Props:        # what CuPy returns: the UUID as a C string, cut at the zero byte
        def getDeviceProperties(self, device):
            return {"uuid": _FakeDriver.UUIDS[device].split(b"\0")[0]}
    api = object.__new__(CupyCuda)
    api.rt, api._cu, api._ctypes = Props(), _FakeDriver(), ctypes
    a, b = api.device_uuid(0), api.device_uuid(1)
    assert a != b
    assert a == "GPU-5e1f0a00-1111-1111-1111-111111111111"


def test_refusals_mismatches_and_timeouts():
    gpu, apis, ts = _pair(can_reach=lambda s, d: False)
    with pytest.raises(TransportError, match=r"send 0->1: the ranks are on different devices "
                                             r"without peer access.*transport='nccl'"):
        with ts[0].group(1):
            ts[0].send(gpu.malloc(8), 0, 1, 0)
    gpu, apis, ts = _pair()
    with pytest.raises(TransportError, match="outside"):
        ts[0].send(gpu.malloc(8), 0, 1, 0)
    with pytest.raises(TransportError, match="both in this process"):
        with ts[0].group(1):
            ts[0].send(gpu.malloc(8), 0, 0, 0)
    with pytest.raises(TransportError, match="unusable after an earlier failure"):
        with ts[0].group(1):
            pass
    gpu, apis, ts = _pair()
    ra, rb = _refit(ts, [gpu.malloc(100)], [gpu.malloc(99)], timeout=5)
    assert isinstance(rb, TransportError) and "sender posted 100 bytes" in str(rb)
    assert isinstance(ra, TransportError) and "the receiver failed" in str(ra)
    # copies that never finish: the receiver's poll runs into the deadline
    gpu, apis, ts = _pair()
    apis[1].complete = False
    t0 = time.monotonic()
    ra, rb = _refit(ts, [gpu.malloc(64)], [gpu.malloc(64)], timeout=1)
    assert isinstance(rb, TransportTimeout) and "did not finish within 1" in str(rb)
    assert isinstance(ra, TransportError) and time.monotonic() - t0 < 5
    # a sender that never posts
    gpu, apis, ts = _pair()
    with pytest.raises(TransportTimeout, match=r"1 message\(s\) .* from trainer\[0\] did not "
                                               r"arrive within 0.5 s"):
        with ts[1].group(0.5):
            ts[1].recv(gpu.malloc(8), 0, 1, 3)


def test_a_dead_sender_is_named_at_once():
    import subprocess
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()                         # a pid that no longer runs: the watcher sees it
    server, client = _store_pair()
    gpu = FakeGpu()
    t = CudaIpcTransport(client(), "ipc", [0, 1], 1, [0], {1: 0}, api=FakeCuda(gpu),
                         process_labels=["trainer[0]", "rollout[0]"],
                         pids={0: (gone.pid, None)}, connect=client)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=rf"^cuda_ipc: 1 message\(s\) to this process "
                                             rf"\(round 1\) from trainer\[0\] never came: "
                                             rf"that process \(pid {gone.pid}\) died$"):
        with t.group(10):
            t.recv(gpu.malloc(8), 0, 1, 0)
    assert time.monotonic() - t0 < 5
    t.close()
    del server


def test_caps_without_cupy_or_driver_take_no_ipc_pair():
    class Broken:
        def device_count(self):
            raise RuntimeError("no driver")
    assert local_cuda_caps([0, None], api=Broken()) == {"cuda_devices": [None, None],
                                                         "cuda_reach": []}

    class TwoGpus:
        def device_count(self):
            return 3

        def device_uuid(self, i):
            return f"GPU-{i}"

        def can_access_peer(self, i, j):
            return (i, j) in {(0, 1)}
    caps = local_cuda_caps([0, None], api=TwoGpus())
    assert caps == {"cuda_devices": ["GPU-0", None], "cuda_reach": ["GPU-0", "GPU-1"]}


def test_importing_the_module_imports_no_cupy():
    code = ("import sys, xreshard.transport.cuda_ipc; "
            "assert 'cupy' not in sys.modules and 'torch' not in sys.modules")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- on a GPU

def _why_no_gpu() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:   # noqa: BLE001
        return f"no CUDA device through CuPy ({type(e).__name__})"
    try:
        import torch
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except ImportError:
        return "torch is not installed"
    return None


def colocated(ctx: Any, gib: float, reps: int) -> dict:
    """A JAX trainer and a torch engine on GPU 0 of one host refit through "auto"; returns
    the route, bit-exactness and (with ``reps``) the refit and device-copy bandwidths."""
    import xreshard as xr

    nbytes = int(gib * 2**30) // 2 * 2
    rows = 4096
    cols = nbytes // 2 // rows
    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    config = xr.RefitConfig(timeout=120, bucket_bytes=1 << 30, staging_bytes=2 << 30)
    out: dict[str, Any] = {}
    if ctx.role.group == "trainer":
        import jax
        import jax.numpy as jnp
        dev = jax.devices("gpu")[0]
        # values exact in bf16 and position-dependent (a misplaced byte shows); one fused
        # kernel, no int32 temporary of the whole size (and no index past 2**31)
        with jax.default_device(dev):
            x = jax.jit(lambda: (((jnp.arange(rows, dtype=jnp.int32)[:, None] * 7
                                   + jnp.arange(cols, dtype=jnp.int32)[None, :] * 13) % 251)
                                 - 125).astype(jnp.bfloat16))()
        refit = xr.Refit(world, config=config)
        refit(send={"w": x})
    else:
        import torch
        from xreshard.adapters.torch import tensor_view
        w = torch.zeros((rows, cols), dtype=torch.bfloat16, device="cuda:0")
        layout = xr.Layout.replicated((rows, cols), "bfloat16",
                                      xr.Mesh((1,), (world.rank_ids[0],)))
        bound = xr.Bound({"w": layout}, {(world.rank_ids[0], "w"): tensor_view(w)})
        refit = xr.Refit(world, receive=bound, config=config)
        refit()
        torch.cuda.synchronize()
        c = torch.arange(cols, dtype=torch.int32, device="cuda:0")[None, :] * 13
        exact = True
        for r0 in range(0, rows, 256):          # 256 rows at a time: bounded temporaries
            r = torch.arange(r0, min(r0 + 256, rows), dtype=torch.int32, device="cuda:0")
            want = (((r[:, None] * 7 + c) % 251) - 125).to(torch.bfloat16)
            exact &= bool(torch.equal(w[r0:r0 + 256].view(torch.int16), want.view(torch.int16)))
        del want, c
        out["exact"] = exact
    auto = world.transport("auto")
    out["name"] = auto.name
    out["by_kind"] = auto.bytes_by_transport
    if reps:
        times = []
        for _ in range(reps):
            world.barrier()
            t0 = time.perf_counter()
            if ctx.role.group == "trainer":
                refit(send={"w": x})
            else:
                refit()
            times.append(time.perf_counter() - t0)
        out["refit_s"] = sorted(times)[len(times) // 2]
        # the transport alone: one buffer of the same size through the routed transport
        trainer_rank = world.group_ranks("trainer")[0]
        engine_rank = world.group_ranks("rollout")[0]
        if ctx.role.group == "trainer":
            import cupy
            with cupy.cuda.Device(0):
                raw = cupy.ones(nbytes, cupy.uint8)
        else:
            import torch
            raw = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        ipc = []
        for _ in range(reps + 1):
            world.barrier()
            t0 = time.perf_counter()
            with auto.group(120):
                if ctx.role.group == "trainer":
                    auto.send(raw, trainer_rank, engine_rank, 0)
                else:
                    auto.recv(raw, trainer_rank, engine_rank, 0)
            ipc.append(time.perf_counter() - t0)
        out["transport_s"] = sorted(ipc[1:])[len(ipc[1:]) // 2]
        if ctx.role.group != "trainer":
            import torch
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            dst = torch.empty_like(src)
            dst.copy_(src)
            torch.cuda.synchronize()
            copies = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            out["copy_s"] = sorted(copies)[len(copies) // 2]
            out["bytes"] = nbytes
    world.close()
    return out


def _launch_colocated(gib: float, reps: int, timeout: float) -> list[Any]:
    from xreshard.tools.launch import Role, launch
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    roles = [Role("jax", "trainer", 0, gpus=(0,), env=env),
             Role("torch", "rollout", 0, gpus=(0,), env=env)]
    # by name: under ``python -m tests.test_cuda_ipc`` this module is __main__
    return launch("tests.test_cuda_ipc:colocated", roles, args=(gib, reps), timeout=timeout)


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_jax_and_torch_on_one_gpu_refit_through_cuda_ipc_bit_exact():
    results = _launch_colocated(0.0625, 0, 240)
    trainer, engine = (r.value for r in results)
    assert trainer["name"] == engine["name"] == "auto(local+cuda_ipc)"
    assert engine["exact"] is True
    assert engine["by_kind"]["cuda_ipc"] == trainer["by_kind"]["cuda_ipc"] == 2**26


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.test_cuda_ipc bench --gib 8 --json OUT``: the gpu_check.sh step."""
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bench"])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", required=True)
    ap.add_argument("--timeout", type=float, default=50)
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"gib": args.gib}
    try:
        results = _launch_colocated(args.gib, args.reps, args.timeout)
        trainer, engine = (r.value for r in results)
        report.update(route=engine["name"], exact=engine["exact"], refit_s=engine["refit_s"],
                      transport_s=engine["transport_s"], copy_s=engine["copy_s"],
                      by_kind=engine["by_kind"])
        # the bar is on the whole refit; the transport alone shows what is left to
        # the refit's fixed costs (metadata exchange, outcome exchange)
        report["transport_fraction_of_copy"] = engine["copy_s"] / engine["transport_s"]
        report["refit_gbps"] = engine["bytes"] / engine["refit_s"] / 1e9
        report["copy_gbps"] = engine["bytes"] / engine["copy_s"] / 1e9
        report["fraction_of_copy"] = engine["copy_s"] / engine["refit_s"]
        report["ok"] = bool(engine["exact"] and report["fraction_of_copy"] >= 0.7
                            and "cuda_ipc" in engine["name"])
        report["figure"] = (f"refit {report['fraction_of_copy']:.2f} of a device copy "
                            f"({report['refit_gbps']:.0f} vs {report['copy_gbps']:.0f} GB/s), "
                            f"transport alone {report['transport_fraction_of_copy']:.2f}, "
                            f"route {report['route']}, bit-exact {report['exact']}")
    except Exception as e:   # noqa: BLE001 - reported, not raised
        report.update(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
    report["bar"] = (f"a JAX process -> a torch process on one GPU, {args.gib:g} GiB of bf16 "
                     f"through transport='auto' routed to cuda_ipc, bit-exact, the whole refit "
                     f"(median of {args.reps}, wall clock) at >= 0.7 x a torch device-to-device "
                     f"copy of the same bytes timed the same way")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------- mixed GPU worlds

def test_nccl_members_when_a_colocated_engine_takes_ipc_and_a_remote_one_nccl():
    from xreshard.transport.select import choose_routes
    # process 0: trainer on host a GPU-A (rank 0); 1: engine on the same GPU (rank 1);
    # 2: engine on host b (rank 2)
    caps = [{"host": "a", "cuda_devices": ["GPU-A"], "cuda_reach": ["GPU-A"]},
            {"host": "a", "cuda_devices": ["GPU-A"], "cuda_reach": ["GPU-A"]},
            {"host": "b", "cuda_devices": ["GPU-B"], "cuda_reach": ["GPU-B"]}]
    r = choose_routes([0, 1, 2], ["cuda"] * 3, caps)
    assert r.kind(0, 1) == "cuda_ipc" and r.kind(0, 2) == "nccl"
    assert r.kinds == ("cuda_ipc", "nccl")
    # between jobs only: the two engines never exchange, so NCCL spans ranks 0 and 2 and
    # never sees two ranks on GPU-A
    assert r.ranks_using("nccl", ["trainer", "rollout", "rollout"]) == (0, 2)
    assert r.ranks_using("nccl") == (0, 1, 2)


def test_renumbered_transport_maps_world_ranks_into_its_communicator():
    from xreshard.transport.local import LocalTransport
    from xreshard.runtime.world import RenumberedTransport
    t = RenumberedTransport(LocalTransport(), {0: 0, 5: 1}, "nccl")
    out = np.zeros(4, np.uint8)
    with t.group(1):
        t.send(np.arange(4, dtype=np.uint8), 0, 5, 3)
        t.recv(out, 0, 5, 3)
    assert out.tolist() == [0, 1, 2, 3]
    with pytest.raises(TransportError, match=r"nccl send 0->4: not both in its communicator "
                                             r"\(ranks \[0, 5\]\)"):
        t.send(out, 0, 4, 0)
    absent = RenumberedTransport(None, {0: 0, 5: 1}, "nccl")
    with absent.group(1):
        pass
    with pytest.raises(TransportError, match="not both in its communicator"):
        absent.recv(out, 0, 5, 0)
