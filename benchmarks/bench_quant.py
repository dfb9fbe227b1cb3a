"""How fast the FP8 quantizers run on this machine, in GB/s of BF16 input, side by side.

Every quantizer of :mod:`xreshard.quant` (numpy on one thread and on all, the jitted JAX
function, torch's eager ops) against two baselines in the same process on the same bytes:
a *plain* jitted JAX block quantizer (``x * (448 / amax)`` cast by XLA: the issue's
reference point, ~0.4 GB/s on 2 cores; it is not bit-exact with vLLM) and vLLM's own
``per_block_cast_to_fp8`` (torch.compile'd) / ``mxfp8_e4m3_quantize`` when vLLM is
installed. Before timing, every exact implementation's bytes are checked equal to the
numpy ones (and to vLLM's). Each figure is the median of ``--reps`` wall-clock runs.

    python benchmarks/bench_quant.py [--rows 4096] [--cols 4096] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds of this process) of ``reps`` calls after one
    warm-up (compiles, allocates pools). CPU seconds say what a call costs on a machine
    other processes load: wall time there is the scheduler's share."""
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def raw(a: Any) -> np.ndarray:
    a = np.asarray(a) if not hasattr(a, "view") or isinstance(a, np.ndarray) else a
    if hasattr(a, "numpy"):                       # torch
        import torch
        a = a.view(torch.uint8).numpy() if a.element_size() == 1 else a.numpy()
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def runners(x: np.ndarray, fmt: Any) -> dict[str, Callable[[], Any]]:
    """name -> zero-argument function quantizing ``x`` (inputs placed beforehand)."""
    import jax
    import jax.numpy as jnp
    import torch

    from xreshard.quant import host, jax_ops, torch_ops

    numpy_fn = host.quantize_mxfp8 if fmt.kind == "mxfp8" else host.quantize_block_fp8
    jx = jnp.asarray(x)
    tx = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    out = {
        "numpy, 1 thread": lambda: numpy_fn(x, fmt, threads=1),
        f"numpy, {host.default_threads()} threads": lambda: numpy_fn(x, fmt),
        "jax (jit)": lambda: jax.block_until_ready(jax_ops.quantize(jx, fmt)),
        "torch ops": lambda: torch_ops.quantize(tx, fmt, ops="torch"),
    }
    if fmt.kind != "mxfp8":
        rows, cols = x.shape
        plain = jax.jit(lambda v: (v.astype(jnp.float32).reshape(rows // 128, 128, cols // 128, 128)
                                   * (448.0 / jnp.maximum(jnp.abs(v.astype(jnp.float32)).reshape(
                                       rows // 128, 128, cols // 128, 128).max(axis=(1, 3),
                                                                            keepdims=True), 1e-4))
                                   ).astype(jnp.float8_e4m3fn))
        out["baseline: plain jitted JAX (not exact)"] = lambda: jax.block_until_ready(plain(jx))
    try:
        import vllm  # noqa: F401
    except ImportError:
        return out
    if fmt.kind == "mxfp8":
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
            mxfp8_e4m3_quantize)
        out["baseline: vLLM mxfp8_e4m3_quantize"] = lambda: mxfp8_e4m3_quantize(tx)
    else:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
        out["baseline: vLLM per_block_cast_to_fp8"] = lambda: per_block_cast_to_fp8(
            tx, list(fmt.block), use_ue8m0=False)
    return out


def check(results: dict[str, Any], reference: Any) -> dict[str, bool]:
    """Which exact implementations gave the reference's bytes (codes and scales)."""
    want = [raw(reference[0]), raw(reference[1])]
    return {name: all(np.array_equal(raw(a), w) for a, w in zip(got, want))
            for name, got in results.items() if not name.startswith("baseline: plain")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    import ml_dtypes

    from xreshard.ir.formats import BlockFP8, MXFP8

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(ml_dtypes.bfloat16)
    report: dict[str, Any] = {"shape": [args.rows, args.cols], "input_bytes": x.nbytes,
                              "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}
    for fmt in (BlockFP8(), MXFP8()):
        fns = runners(x, fmt)
        outputs = {name: fn() for name, fn in fns.items()}
        exact = check(outputs, outputs["numpy, 1 thread"])
        rows = {}
        for name, fn in fns.items():
            seconds, cpu = timed(fn, args.reps)
            rows[name] = {"seconds": seconds, "gb_per_s": x.nbytes / seconds / 1e9,
                          "gb_per_cpu_s": x.nbytes / max(cpu, 1e-9) / 1e9,
                          "bytes_equal_numpy": exact.get(name)}
        plain = rows.get("baseline: plain jitted JAX (not exact)")
        for row in rows.values():
            if plain:
                row["over_plain_jax"] = row["gb_per_s"] / plain["gb_per_s"]
        report[str(fmt)] = rows
        if not args.json:
            print(f"\n{fmt} of a {args.rows}x{args.cols} bf16 tensor "
                  f"({x.nbytes / 2**20:.0f} MiB), median of {args.reps}:")
            print(f"  {'quantizer':40s} {'GB/s':>6s} {'x plain JAX':>11s} {'GB/CPU-s':>9s}"
                  "  bytes == numpy")
            for name, row in rows.items():
                ratio = f"{row['over_plain_jax']:.2f}" if "over_plain_jax" in row else "-"
                same = {None: "-", True: "yes", False: "NO"}[row["bytes_equal_numpy"]]
                print(f"  {name:40s} {row['gb_per_s']:6.3f} {ratio:>11s} "
                      f"{row['gb_per_cpu_s']:9.3f}  {same}")
        if not all(exact.values()):
            print(f"ERROR: {fmt}: an implementation's bytes differ: {exact}", file=sys.stderr)
            sys.exit(1)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"\n{report['cpus']} CPUs, load average {report['load_avg']:.1f} at the start")


if __name__ == "__main__":
    main()
