"""The transposing copy alone: ``xreshard.runtime.copies.copy_into`` of a transposed Flax
kernel against numpy's square-tiled copy (the kernel before 2026-12-05, kept here as the
reference) on the shard shapes of ``bench_refit.py`` and of real models.

Each case copies ``[rows, cols]`` elements between a row-major array and the transpose of
a row-major ``[cols, rows]`` array, in the direction the sender packs (``pack``: the
source is the transposed view, as a trainer packs a Flax ``[in, out]`` kernel into
staging) or the receiver unpacks (``unpack``: the destination is). ``--cold`` (the
default) cycles through distinct arrays of about 64 MiB in all, so the source comes from
memory, as in a refit; ``--hot`` repeats one array (in cache). Per case: the old tiling's
GB/s and the ratio old / new time (> 1: the new kernel is faster) from the least
``time.process_time()`` of ``--reps`` passes; ``--torch`` adds ``torch`` ``copy_`` for
reference (not used by xreshard's host path). Every copy is checked bit-exact.

    python benchmarks/bench_transpose.py [--hot] [--reps 5] [--torch] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20

#: (rows, cols, dtype, where it comes from); rows x cols is the canonical [out, in] region
SHAPES = [
    (896, 608, "bfloat16", "bench_refit mlp shard (hidden 896, TP=4)"),
    (608, 896, "bfloat16", "bench_refit mlp shard, row-parallel"),
    (2432, 224, "bfloat16", "bench_refit down shard"),
    (896, 224, "bfloat16", "bench_refit o shard"),
    (4096, 4096, "bfloat16", "Llama-7B q/o"),
    (4096, 4096, "float32", "Llama-7B q/o, fp32 master"),
    (4096, 1024, "bfloat16", "Llama-7B q/o shard, TP=4"),
    (1024, 4096, "bfloat16", "Llama-7B q shard, TP=4"),
    (4096, 11008, "bfloat16", "Llama-7B down"),
    (11008, 4096, "bfloat16", "Llama-7B gate/up"),
    (896, 4864, "bfloat16", "Qwen2-0.5B down"),
    (4864, 896, "float32", "Qwen2-0.5B gate/up, fp32"),
    (14336, 4096, "bfloat16", "Llama-3-8B gate/up"),
    (3072, 768, "float32", "GPT-2 mlp, fp32"),
    (1001, 333, "bfloat16", "odd sizes"),
]


def old_tiled(out: np.ndarray, src: np.ndarray) -> None:
    """The square tiles ``copies.copy_into`` used at main 79b3bff (bits, same dtype)."""
    t = 512 if out.dtype.itemsize <= 2 else 256
    rows, cols = out.shape
    for i in range(0, rows, t):
        for j in range(0, cols, t):
            np.copyto(out[i:i + t, j:j + t], src[i:i + t, j:j + t], casting="no")


def new_copy(dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    from xreshard.runtime.copies import copy_into
    return lambda out, src: copy_into(np, out, dtype, src, dtype)


def torch_copy(out: np.ndarray, src: np.ndarray) -> None:
    import torch
    torch.from_numpy(out).copy_(torch.from_numpy(src))


def pairs_of(rows: int, cols: int, dtype: str, direction: str, total: int
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(out, src)`` pairs of unsigned bits (what ``copy_into`` copies for equal dtypes)."""
    from xreshard.dtypes import numpy_dtype
    bits = {2: np.uint16, 4: np.uint32}[np.dtype(numpy_dtype(dtype)).itemsize]
    n = max(1, total // (rows * cols * np.dtype(bits).itemsize))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        kernel = rng.integers(0, np.iinfo(bits).max, (cols, rows), dtype=bits)   # [in, out]
        if direction == "pack":
            out.append((np.empty((rows, cols), bits), kernel.T))
        else:                       # a receiver writes a transposed view from staging
            out.append((np.empty((cols, rows), bits).T, np.ascontiguousarray(kernel.T)))
    return out


def timed(fn: Callable, pairs: list, reps: int) -> float:
    fn(*pairs[0])
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for out, src in pairs:
            fn(out, src)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hot", action="store_true", help="one array, in cache")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="add torch copy_ for reference")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import xreshard
    total = 4 * MiB if args.hot else 64 * MiB
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"xreshard from {Path(xreshard.__file__).parent}; {'hot' if args.hot else 'cold'} "
          f"(~{total // MiB} MiB per pass), least CPU s of {args.reps}; load {load}")
    print("| rows x cols | dtype | dir | shape of | old GB/s | new GB/s | old / new |"
          + (" torch / new |" if args.torch else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.torch else ""))
    rows_out: list[dict[str, Any]] = []
    for rows, cols, dtype, what in SHAPES:
        for direction in ("pack", "unpack"):
            pairs = pairs_of(rows, cols, dtype, direction, total)
            want = [np.ascontiguousarray(s) for _, s in pairs[:2]]
            nbytes = sum(o.nbytes for o, _ in pairs)
            t_old = timed(old_tiled, pairs, args.reps)
            t_new = timed(new_copy(dtype), pairs, args.reps)
            for (out, _), w in zip(pairs, want):
                assert out.tobytes() == w.tobytes(), (rows, cols, dtype, direction)
            row = {"rows": rows, "cols": cols, "dtype": dtype, "direction": direction,
                   "what": what, "old_gbps": nbytes / t_old / 1e9,
                   "new_gbps": nbytes / t_new / 1e9, "old_over_new": t_old / t_new}
            line = (f"| {rows} x {cols} | {dtype} | {direction} | {what} | "
                    f"{row['old_gbps']:.2f} | {row['new_gbps']:.2f} | **{t_old / t_new:.2f}** |")
            if args.torch:
                t_torch = timed(torch_copy, pairs, args.reps)
                row["torch_over_new"] = t_torch / t_new
                line += f" {t_torch / t_new:.2f} |"
            rows_out.append(row)
            print(line, flush=True)
    if args.json:
        print(json.dumps({"load": load, "hot": args.hot, "cases": rows_out}))


if __name__ == "__main__":
    main()
