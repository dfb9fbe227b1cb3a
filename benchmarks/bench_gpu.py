"""Single-GPU bandwidth of the refit's data path, against plain device-to-device copies.

1. pack / unpack: copying a strided region of a bf16 weight into a contiguous staging buffer
   (and back) with CuPy (and torch when installed), vs ``cudaMemcpyAsync`` D2D of the same
   bytes. The ratio says what strided packing costs over the copy engine's best case.
2. NCCL send/recv to self of ~4 GiB of bf16 bytes through ``NcclTransport`` (a 1-rank
   communicator, one group), vs one D2D copy of the same bytes.

GB/s counts the bytes moved once (not read + write). Device times come from CUDA events.
The NCCL time is wall-clock around the ``with group`` block, because that is what a refit
waits for. It includes issuing the group and the event polling.

    python benchmarks/bench_gpu.py [--size-gib 4] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class DictStore:
    """The rendezvous store of a 1-rank world: everything is local."""

    def __init__(self):
        self._d: dict[str, bytes] = {}

    def set(self, key, value):
        self._d[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self._d[key]

    def check(self, keys):
        return all(k in self._d for k in keys)


def _time_events(cupy, fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _memcpy(cupy, dst, src, nbytes: int) -> None:
    rt = cupy.cuda.runtime
    rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice,
                   cupy.cuda.get_current_stream().ptr)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def bench_pack(cupy, torch, iters: int) -> None:
    rows = cols = 16384                         # a 512 MiB bf16 weight, seen as uint16
    weight = cupy.random.randint(0, 1 << 16, (rows, cols), dtype=cupy.uint16)
    stacked = weight.reshape(8, 2048, cols)
    cases = [
        ("rows [0:8192) contiguous", weight[:8192]),
        ("cols [0:8192) 16 KiB runs", weight[:, :8192]),
        ("cols [0:1024) 2 KiB runs", weight[:, :1024]),
        ("cols [0:64) 128 B runs", weight[:, :64]),
        ("3-D [:, :, 4096:12288)", stacked[:, :, 4096:12288]),
        ("transposed cols->rows", weight[:, :4096].T),
    ]
    scratch = cupy.empty(rows * cols, dtype=cupy.uint16)
    tw = torch.from_dlpack(weight) if torch is not None else None
    print(f"\n== pack/unpack of regions of a [{rows}, {cols}] bf16 weight (uint16 view) ==")
    head = f"{'region':28s} {'MiB':>7s} {'memcpy GB/s':>12s} {'pack GB/s':>10s} {'ratio':>6s} " \
           f"{'unpack GB/s':>12s} {'ratio':>6s}"
    if tw is not None:
        head += f" {'torch pack':>11s} {'ratio':>6s}"
    print(head)
    for label, region in cases:
        nbytes = region.size * 2
        staging = scratch[:region.size].reshape(region.shape)
        flat_src = weight.reshape(-1)[:region.size]
        copy_ms = _time_events(cupy, lambda: _memcpy(cupy, scratch, flat_src, nbytes), iters)
        pack_ms = _time_events(cupy, lambda: cupy.copyto(staging, region), iters)
        unpack_ms = _time_events(cupy, lambda: cupy.copyto(region, staging), iters)
        line = (f"{label:28s} {nbytes / 2**20:7.0f} {_gbps(nbytes, copy_ms):12.0f} "
                f"{_gbps(nbytes, pack_ms):10.0f} {copy_ms / pack_ms:6.2f} "
                f"{_gbps(nbytes, unpack_ms):12.0f} {copy_ms / unpack_ms:6.2f}")
        if tw is not None:
            t_region = torch.from_dlpack(region)
            t_staging = torch.from_dlpack(staging)
            # torch runs on its own current stream: time it with torch's events
            torch.cuda.synchronize()
            t_ms = _time_torch(torch, lambda: t_staging.copy_(t_region), iters)
            line += f" {_gbps(nbytes, t_ms):11.0f} {copy_ms / t_ms:6.2f}"
        print(line, flush=True)
    print("ratio = memcpy time / pack time (1.00 = as fast as a plain copy of the same bytes)")


def _time_torch(torch, fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def bench_nccl_self(cupy, torch, size_gib: float, iters: int) -> None:
    from xreshard.transport.nccl import NcclTransport

    nbytes = int(size_gib * 2**30) // 2 * 2
    if torch is not None:
        src_bf16 = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
        src = src_bf16.view(torch.uint8)
        dst = torch.empty_like(src)
        src_c, dst_c = cupy.from_dlpack(src), cupy.from_dlpack(dst)
        torch.cuda.synchronize()
    else:
        src_c = cupy.random.randint(0, 1 << 16, nbytes // 2, dtype=cupy.uint16).view(cupy.uint8)
        dst_c = cupy.empty_like(src_c)
        src, dst = src_c, dst_c
    print(f"\n== NCCL send/recv to self, {nbytes / 2**30:.2f} GiB of bf16 bytes ==")
    start = time.perf_counter()
    t = NcclTransport(DictStore(), 1, {0: 0}, key="bench/nccl", timeout=120)
    print(f"communicator init: {time.perf_counter() - start:.2f} s")
    try:
        walls = []
        for i in range(iters + 1):
            dst_c.fill(0)
            cupy.cuda.Device(0).synchronize()            # benchmark only: isolate the group
            start = time.perf_counter()
            with t.group(timeout=120):
                t.send(src, 0, 0, 0)
                t.recv(dst, 0, 0, 0)
            if i:                                        # the first group connects: warm-up
                walls.append((time.perf_counter() - start) * 1e3)
        ok = not bool((src_c != dst_c).any())
        nccl_ms = statistics.median(walls)
    finally:
        t.close()
    copy_ms = _time_events(cupy, lambda: _memcpy(cupy, dst_c, src_c, nbytes), iters)
    kern_ms = _time_events(cupy, lambda: cupy.copyto(dst_c, src_c), iters)
    print(f"{'path':34s} {'ms':>8s} {'GB/s':>7s} {'vs memcpy':>10s}")
    print(f"{'cudaMemcpyAsync D2D':34s} {copy_ms:8.2f} {_gbps(nbytes, copy_ms):7.0f} {1.0:10.2f}")
    print(f"{'cupy.copyto (copy kernel)':34s} {kern_ms:8.2f} {_gbps(nbytes, kern_ms):7.0f} "
          f"{copy_ms / kern_ms:10.2f}")
    print(f"{'NcclTransport group (wall)':34s} {nccl_ms:8.2f} {_gbps(nbytes, nccl_ms):7.0f} "
          f"{copy_ms / nccl_ms:10.2f}")
    print(f"byte-exact: {ok}   (vs memcpy = memcpy time / path time)")
    if not ok:
        raise SystemExit("NCCL self send/recv corrupted data")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="NCCL self-transfer size")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-pack", action="store_true")
    ap.add_argument("--skip-nccl", action="store_true")
    args = ap.parse_args(argv)
    import cupy
    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    from cupy.cuda import nccl
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device 0: {props['name'].decode()}, CuPy {cupy.__version__}, NCCL "
          f"{nccl.get_version()}, torch {torch.__version__ if torch else 'absent'}")
    if not args.skip_pack:
        bench_pack(cupy, torch, args.iters)
    if not args.skip_nccl:
        bench_nccl_self(cupy, torch, args.size_gib, args.iters)


if __name__ == "__main__":
    main()
