"""Single-GPU bandwidth of the refit's data path, against plain device-to-device copies.

1. pack / unpack: the executor's own copy (``xreshard.runtime.execute.copy_into``: bits views,
   widened to the largest element the region allows) of a region of a 512 MiB bf16 weight
   into a contiguous staging buffer and back, vs ``cudaMemcpyAsync`` D2D of the same bytes.
   Also CuPy's plain ``copyto`` of the uint16 view, and torch's ``copy_`` when installed.
   The bar (issue 13): pack and unpack at >= 70% of the D2D copy's bandwidth for every
   region whose contiguous runs are >= 2 KiB; short runs and a transpose are reported, not
   held to it.
2. NCCL send/recv to self of ``--size-gib`` of bf16 bytes through ``NcclTransport`` (a
   1-rank communicator, one group), vs one D2D copy of the same bytes. Bar: >= 30% of the
   copy's bandwidth (a floor that catches a broken or host-bound path, not a tuned figure).

Every time is device time between CUDA events around the kernels (the NCCL ones on the
transport's own stream); pack/unpack and their copies are timed as ``--back-to-back`` calls
(default 10) between one pair of events, so that a short kernel (a 32 MiB region: ~20 us)
is not timed as the host's launch latency of one call; the median of ``--iters`` after two warm-ups. GB/s counts the
bytes moved once (not read + write). The NCCL group's wall time (what a refit waits for)
is reported beside it. ``--device cpu`` dry-runs the same code with numpy and wall-clock
timers.

    python benchmarks/bench_gpu.py [--size-gib 2] [--iters 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BAR = 0.70          # pack/unpack time may be at most 1/0.70 of the D2D copy's
NCCL_BAR = 0.30     # NCCL send/recv to self: at least this fraction of the D2D copy's bandwidth


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


#: calls timed back to back between one pair of events (per-call time = total / this): a
#: single call of a ~20 us kernel would time the host's launch latency, not the copy
BACK_TO_BACK = 10


class Timer:
    """Median milliseconds per call of a function: ``reps`` calls back to back between
    CUDA events on GPU (wall clock on CPU), the total divided by ``reps``."""

    def __init__(self, xp: Any, reps: int = BACK_TO_BACK):
        self.xp = xp
        self.cuda = xp.__name__ == "cupy"
        self.reps = max(1, reps)

    def __call__(self, fn: Callable[[], None], iters: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, stop = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                for _ in range(self.reps):
                    fn()
                stop.record()
                stop.synchronize()
                times.append(self.xp.cuda.get_elapsed_time(start, stop) / self.reps)
            else:
                t0 = time.perf_counter()
                for _ in range(self.reps):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / self.reps)
        return statistics.median(times)


def _memcpy(xp, dst, src, nbytes: int) -> None:
    if xp.__name__ == "cupy":
        rt = xp.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice,
                       xp.cuda.get_current_stream().ptr)
    else:
        xp.copyto(dst[:nbytes // dst.itemsize], src[:nbytes // src.itemsize])


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def bench_pack(xp, torch, iters: int, size: int = 16384, reps: int = BACK_TO_BACK) -> dict:
    from xreshard.runtime.execute import copy_into

    rows = cols = size                        # 512 MiB of bf16 at 16384, seen as uint16
    timer = Timer(xp, reps)
    weight = xp.arange(rows * cols, dtype=xp.uint16).reshape(rows, cols)
    stacked = weight.reshape(8, rows // 8, cols)
    k = cols // 16
    # (label, region, contiguous run in bytes, held to the bar)
    cases = [
        ("rows [0:n/2) contiguous", weight[:rows // 2], cols * rows, True),
        ("cols [0:n/2) long runs", weight[:, :cols // 2], cols, True),
        ("cols [0:n/16) runs", weight[:, :k], k * 2, k * 2 >= 2048),
        ("cols [0:64) 128 B runs", weight[:, :64], 128, False),
        ("3-D [:, :, n/4:3n/4)", stacked[:, :, cols // 4:3 * cols // 4], cols, True),
        ("transposed cols->rows", weight[:, :cols // 4].T, 2, False),
    ]
    scratch = xp.empty(rows * cols, dtype=xp.uint16)
    out: dict[str, Any] = {"weight": [rows, cols], "dtype": "bfloat16", "bar": BAR, "regions": []}
    print(f"\n== pack/unpack of regions of a [{rows}, {cols}] bf16 weight ==")
    print(f"{'region':26s} {'MiB':>6s} {'memcpy':>7s} {'pack':>7s} {'ratio':>6s} "
          f"{'unpack':>7s} {'ratio':>6s} {'copyto':>7s} {'ratio':>6s}   (GB/s)")
    for label, region, run, held in cases:
        nbytes = region.size * 2
        staging = scratch[:region.size].reshape(region.shape)
        flat_src = weight.reshape(-1)[:region.size]
        copy_ms = timer(lambda: _memcpy(xp, scratch, flat_src, nbytes), iters)
        pack_ms = timer(lambda: copy_into(xp, staging, "bfloat16", region, "bfloat16"), iters)
        unpack_ms = timer(lambda: copy_into(xp, region, "bfloat16", staging, "bfloat16"), iters)
        plain_ms = timer(lambda: xp.copyto(staging, region), iters)
        # the executor's copies must be right, not only fast
        copy_into(xp, staging, "bfloat16", region, "bfloat16")
        exact = bool((staging == region).all())
        row = {"region": label, "bytes": nbytes, "run_bytes": run, "held_to_bar": held,
               "memcpy_gbps": _gbps(nbytes, copy_ms), "pack_gbps": _gbps(nbytes, pack_ms),
               "unpack_gbps": _gbps(nbytes, unpack_ms), "copyto_gbps": _gbps(nbytes, plain_ms),
               "pack_ratio": copy_ms / pack_ms, "unpack_ratio": copy_ms / unpack_ms,
               "copyto_ratio": copy_ms / plain_ms, "exact": exact}
        if torch is not None:
            t_region, t_staging = torch.from_dlpack(region), torch.from_dlpack(staging)
            torch.cuda.synchronize()
            t_ms = _time_torch(torch, lambda: t_staging.copy_(t_region), iters, reps=reps)
            row.update(torch_gbps=_gbps(nbytes, t_ms), torch_ratio=copy_ms / t_ms)
        row["ok"] = exact and (not held or (row["pack_ratio"] >= BAR
                                            and row["unpack_ratio"] >= BAR))
        out["regions"].append(row)
        print(f"{label:26s} {nbytes / 2**20:6.0f} {row['memcpy_gbps']:7.0f} "
              f"{row['pack_gbps']:7.0f} {row['pack_ratio']:6.2f} {row['unpack_gbps']:7.0f} "
              f"{row['unpack_ratio']:6.2f} {row['copyto_gbps']:7.0f} {row['copyto_ratio']:6.2f}"
              f"{'' if row['ok'] else '   BELOW BAR' if exact else '   WRONG BYTES'}"
              f"{'' if held else '   (not held to the bar)'}", flush=True)
    print(f"ratio = memcpy time / copy time; bar {BAR:.2f} for regions with runs >= 2 KiB")
    out["ok"] = all(r["ok"] for r in out["regions"])
    return out


def _time_torch(torch, fn, iters: int, warmup: int = 2, reps: int = BACK_TO_BACK) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return statistics.median(times)


def bench_nccl_self(cupy, size_gib: float, iters: int) -> dict:
    from xreshard.transport.nccl import NcclTransport

    nbytes = int(size_gib * 2**30) // 2 * 2
    timer = Timer(cupy, reps=1)      # GiB-sized: one call is far from launch-bound
    src_c = cupy.empty(nbytes, dtype=cupy.uint8)
    words = src_c[:nbytes // 4 * 4].view(cupy.uint32)     # a cheap pseudo-random pattern
    words[...] = cupy.arange(words.size, dtype=cupy.uint32)
    words *= 2654435761
    del words
    dst_c = cupy.empty_like(src_c)
    print(f"\n== NCCL send/recv to self, {nbytes / 2**30:.2f} GiB of bf16 bytes ==")
    start = time.perf_counter()
    t = NcclTransport(DictStore(), 1, {0: 0}, key="bench/nccl", timeout=120)
    init_s = time.perf_counter() - start
    print(f"communicator init: {init_s:.2f} s")
    stream = t.stream(0)
    try:
        walls, device_ms = [], []
        for i in range(iters + 1):
            dst_c.fill(0)
            cupy.cuda.Device(0).synchronize()            # benchmark only: isolate the group
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(stream)
            start = time.perf_counter()
            with t.group(timeout=120):
                t.send(src_c, 0, 0, 0)
                t.recv(dst_c, 0, 0, 0)
            end.record(stream)
            end.synchronize()
            if i:                                        # the first group connects: warm-up
                walls.append((time.perf_counter() - start) * 1e3)
                device_ms.append(cupy.cuda.get_elapsed_time(begin, end))
        ok = not bool((src_c != dst_c).any())
        nccl_ms = statistics.median(device_ms)
        wall_ms = statistics.median(walls)
    finally:
        t.close()
    copy_ms = timer(lambda: _memcpy(cupy, dst_c, src_c, nbytes), iters)
    ratio = copy_ms / nccl_ms
    print(f"{'path':34s} {'ms':>8s} {'GB/s':>7s} {'vs memcpy':>10s}")
    print(f"{'cudaMemcpyAsync D2D (events)':34s} {copy_ms:8.2f} {_gbps(nbytes, copy_ms):7.0f} "
          f"{1.0:10.2f}")
    print(f"{'NcclTransport group (events)':34s} {nccl_ms:8.2f} {_gbps(nbytes, nccl_ms):7.0f} "
          f"{ratio:10.2f}")
    print(f"{'NcclTransport group (wall)':34s} {wall_ms:8.2f} {_gbps(nbytes, wall_ms):7.0f} "
          f"{copy_ms / wall_ms:10.2f}")
    print(f"byte-exact: {ok}   (vs memcpy = memcpy time / path time; bar {NCCL_BAR:.2f})")
    return {"bytes": nbytes, "init_seconds": init_s, "memcpy_gbps": _gbps(nbytes, copy_ms),
            "nccl_gbps": _gbps(nbytes, nccl_ms), "nccl_ratio": ratio,
            "nccl_wall_gbps": _gbps(nbytes, wall_ms), "bar": NCCL_BAR,
            "ok": ok and ratio >= NCCL_BAR}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=2.0, help="NCCL self-transfer size")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pack-size", type=int, default=16384, help="the weight is N x N bf16")
    ap.add_argument("--back-to-back", type=int, default=BACK_TO_BACK,
                    help="pack/unpack calls timed between one pair of events")
    ap.add_argument("--skip-pack", action="store_true")
    ap.add_argument("--skip-nccl", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: dry run with numpy (no NCCL)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {}
    torch = None
    if args.device == "cpu":
        import numpy as xp
        report["device"] = "cpu (dry run)"
    else:
        import cupy as xp
        from cupy.cuda import nccl
        try:
            import torch
            if not torch.cuda.is_available():
                torch = None
        except ImportError:
            torch = None
        props = xp.cuda.runtime.getDeviceProperties(0)
        report["device"] = props["name"].decode()
        print(f"device 0: {report['device']}, CuPy {xp.__version__}, NCCL "
              f"{nccl.get_version()}, torch {torch.__version__ if torch else 'absent'}")
    ok = True
    if not args.skip_pack:
        report["pack"] = bench_pack(xp, torch, args.iters, args.pack_size, args.back_to_back)
        ok &= report["pack"]["ok"]
    if not args.skip_nccl and args.device == "cuda":
        report["nccl_self"] = bench_nccl_self(xp, args.size_gib, args.iters)
        ok &= report["nccl_self"]["ok"]
    report["ok"] = bool(ok)
    pack = report.get("pack", {})
    held = [r for r in pack.get("regions", []) if r["held_to_bar"]]
    worst = min((min(r["pack_ratio"], r["unpack_ratio"]) for r in held), default=None)
    nccl = report.get("nccl_self")
    report["figure"] = (f"pack/unpack worst {worst:.2f} of D2D over {len(held)} regions held"
                        if worst is not None else "no pack region measured") + (
        f"; NCCL self {nccl['nccl_ratio']:.2f} of D2D ({nccl['nccl_gbps']:.0f} GB/s)"
        if nccl else "")
    report["bar"] = (f"pack and unpack >= {BAR:.2f} x cudaMemcpyAsync D2D bandwidth of the same "
                     f"bytes (regions with runs >= 2 KiB); NCCL send/recv to self >= "
                     f"{NCCL_BAR:.2f} x the same copy; CUDA events around the kernels; "
                     f"every region bit-exact")
    print(f"figure: {report['figure']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
