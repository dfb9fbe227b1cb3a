"""What the integrity digest costs: xreshard's keyed digest (runtime/digest.py) against the
checksum it replaced (xr64x2, weighted word sums mod 2**64: fast, but blind to two flipped
sign bits) and the standard library's crc32 and blake2b, side by side in one process over
the same bytes.

Each figure is the median of ``--reps`` passes over a ``--mib`` buffer (uint8, resident),
as GB/s of input; the ratios are against xr64x2 from the same run. ``threads`` is the
digest as the library runs it (inputs of 32 MiB and more split over up to 4 threads),
``1 thread`` the same with that split off.

    python benchmarks/bench_digest.py [--mib 256] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from xreshard.runtime import digest  # noqa: E402


def xr64x2(data: np.ndarray) -> tuple[int, int]:
    """The replaced checksum, as it was (rows of 2,048 words, tiles of 64 rows), for the
    baseline: row sums and column sums of the uint64 words, weighted by odd constants."""
    row = 2048 * 8
    full = data.size // row
    words = data[:full * row].view("<u8").reshape(full, 2048)
    sums = np.empty(full, np.uint64)
    col = np.zeros(2048, np.uint64)
    part = np.empty(2048, np.uint64)
    for i in range(0, full, 64):
        tile = words[i:i + 64]
        np.add.reduce(tile, axis=1, out=sums[i:i + 64])
        np.add.reduce(tile, axis=0, out=part)
        col += part
    p = (np.arange(full, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
    q = (np.arange(2048, dtype=np.uint64) * np.uint64(2) + np.uint64(3))
    with np.errstate(over="ignore"):
        return (int(np.add.reduce(sums * p, dtype=np.uint64)),
                int(np.add.reduce(col * q, dtype=np.uint64)))


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 256, args.mib << 20, dtype=np.uint8)
    key = digest.Key.of("bench_digest")
    threads = digest._THREADS

    def one_thread() -> str:
        digest._THREADS = 1
        try:
            return digest.checksum(data, key)
        finally:
            digest._THREADS = threads

    runs = {
        "xr64x2 (replaced)": lambda: xr64x2(data),
        "digest, threads": lambda: digest.checksum(data, key),
        "digest, 1 thread": one_thread,
        "zlib.crc32": lambda: zlib.crc32(data),
        "blake2b": lambda: hashlib.blake2b(data).digest(),
    }
    seconds = {k: timed(fn, args.reps) for k, fn in runs.items()}
    base = seconds["xr64x2 (replaced)"]
    rows = {k: {"GB/s": round(data.nbytes / s / 1e9, 2), "time_vs_xr64x2": round(s / base, 2)}
            for k, s in seconds.items()}
    out = {"mib": args.mib, "reps": args.reps, "threads": threads,
           "load": os.getloadavg()[0], "runs": rows}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.mib} MiB, median of {args.reps}, load {out['load']:.1f}, "
          f"up to {threads} digest threads")
    for k, r in rows.items():
        print(f"  {k:20s} {r['GB/s']:6.2f} GB/s   time x{r['time_vs_xr64x2']:.2f} of xr64x2")


if __name__ == "__main__":
    main()
