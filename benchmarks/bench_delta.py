"""Delta refit, phase 1: what finding and encoding the changes of a bucket costs, per
backend, and how much of a model changes after one RL-sized optimizer step.

``--kernels`` (this phase): a bf16 bucket of ``--mib`` MiB (the refit's default bucket is
64 MiB) and a new version of it in which a fraction of the elements changed, at random
places, by one unit in the last place (what an Adam step at RL learning rates does to the
few BF16 weights it changes at all). For each backend (numpy on host buffers, jitted JAX
and torch ops on CPU here) and each changed fraction, ``xreshard.delta.encode`` (compare
bits, count, choose, compact) is timed, median of ``--reps``, beside a plain copy of the
bucket in the same process (the memory-speed baseline: finding the changes reads both
versions, a copy reads one and writes one). Then the message is applied to a copy of the
baseline (``delta.apply``), timed the same way, and checked bit for bit.

It also trains the demo model (``xreshard.tools.demo``) for one optax Adam step at learning
rate 1e-6 and prints the fraction of its BF16 weights whose bits changed (fp32 master
weights cast to bf16, as RL trainers send them; and bf16 parameters updated in place).

    python benchmarks/bench_delta.py --kernels [--mib 64] [--reps 5] [--changed 1.0,0.01,0.001]
        [--backends numpy] [--baseline-rev 292bb00] [--json]

``--baseline-rev REV`` also times the numpy kernels as they were at git revision ``REV``
on the same buffers in the same run (before/after a kernel change, side by side).

Without ``--kernels`` (phase 2): the refit itself. Two processes over gloo: a JAX trainer
(one CPU device) sends ``--model-mib`` MiB of bf16 tensors (``--tensor-mib`` each) to a
torch process (plain CPU tensors), through two Refits of one world side by side: a dense
one and one with ``RefitConfig(delta=True)``. Per changed fraction, each repetition makes
a new version of every tensor (that fraction of the elements one ulp off the last
version, at random places), refits it dense, then with delta (against the last version),
and the receiver checks every byte after each delta call. Per fraction: ``bytes_ratio``
(delta wire bytes / dense), ``time_ratio`` (delta call / dense call, the trainer's
``report.seconds``, median of ``--reps``), ``dense_seconds``, ``delta_seconds`` and
``diff_seconds`` (the trainer's finding and encoding of the changes in the same delta
calls, ``report.delta["encode_seconds"]``), and the issue's bars. ``--link-gbps G``
throttles this script's own transport to G Gb/s per process (a cross-datacenter link).

    python benchmarks/bench_delta.py [--changed 1.0,0.01,0.001] [--model-mib 256]
        [--tensor-mib 16] [--reps 3] [--link-gbps 1] [--fp8] [--json]

``--fp8``: the receiver stores every tensor block-FP8 (codes + scales, quantized on the
way by the trainer), both Refits; each delta row also says the trainer's CPU-seconds in
the delta call (all its threads) and how many FP8 items it quantized ahead
(``quantize_ahead``) in how many seconds.

``--device cuda [--baseline device]``: the same on one GPU, both processes on GPU 0 over
NCCL (the device path: the trainer diffs with jitted JAX on the GPU, only the messages
cross, the receiver applies them with torch ops; issue 22's GPU target is ``time_ratio``
<= 0.15 at 0.01).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()                                    # warm-up: compilation, first-touch pages
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def versions(mib: float, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(baseline, new) bf16 buckets; ``fraction`` of the elements differ by one ulp."""
    from xreshard.dtypes import numpy_dtype

    rng = np.random.default_rng(seed)
    n = int(mib * MiB) // 2
    old = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(numpy_dtype("bfloat16"))
    new = old.copy()
    k = int(round(n * fraction))
    pos = rng.choice(n, k, replace=False) if k < n else np.arange(n)
    new.view(np.uint16)[pos] ^= np.uint16(1)
    return old, new


def kernel_at(rev: str) -> Any:
    """``xreshard/delta/host.py`` as it was at git revision ``rev`` (the numpy kernels
    before a change, timed beside the current ones in the same run), as a module of the
    ``xreshard.delta`` package (its codec is the current one)."""
    import importlib.util
    import subprocess
    import tempfile

    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:xreshard/delta/host.py"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "host_at_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("xreshard.delta._host_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "xreshard.delta"
    spec.loader.exec_module(module)
    return module


def backends() -> dict[str, tuple[Callable[[np.ndarray], Any], str]]:
    """Row name -> (how the backend holds a host array, on its CPU device; kernels).

    ``auto`` picks the numpy kernels for CPU-resident buffers (read in place); ``device``
    forces the backend's own kernels (jitted XLA, torch ops): what runs on an accelerator,
    measured here on the CPU.
    """
    out: dict[str, tuple[Callable[[np.ndarray], Any], str]] = {"numpy": (lambda a: a, "auto")}
    try:
        import jax
        cpu = jax.devices("cpu")[0]
        for kernels in ("auto", "device"):
            out[f"jax/{kernels}"] = (lambda a: jax.device_put(a, cpu), kernels)
    except ImportError:
        pass
    try:
        import torch
        for kernels in ("auto", "device"):
            out[f"torch/{kernels}"] = (
                lambda a: torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16),
                kernels)
    except ImportError:
        pass
    return out


def ready(x: Any) -> Any:
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()
    return x


def host_bytes(x: Any) -> bytes:
    from xreshard.delta import host_view
    return host_view(x).tobytes()


def kernel_rows(mib: float, fractions: list[float], reps: int, device_reps: int,
                only: list[str] | None = None, rev: str | None = None) -> list[dict]:
    from xreshard import delta

    rows = []
    before = kernel_at(rev) if rev else None
    for fraction in fractions:
        old, new = versions(mib, fraction)
        copy_into = np.empty_like(new)
        copy_s = median_seconds(lambda: np.copyto(copy_into, new), reps)
        want = delta.encode(old, new).to_bytes()
        if before is not None:          # the kernel at ``rev``, same buffers, same run
            enc_s = median_seconds(lambda: before.encode_numpy(old, new), reps)
            same = before.encode_numpy(old, new).to_bytes().tobytes() == want.tobytes()
            rows.append({"backend": f"numpy@{rev}", "changed": fraction, "mib": mib,
                         "encode_seconds": enc_s, "encode_gbps": new.nbytes / enc_s / 1e9,
                         "encode_vs_copy": enc_s / copy_s, "copy_gbps": new.nbytes / copy_s / 1e9,
                         "same_bytes_as_numpy": same})
            print(f"  {rows[-1]['backend']:12s} changed {fraction:<6g} diff+encode "
                  f"{enc_s * 1e3:8.2f} ms = {rows[-1]['encode_gbps']:6.2f} GB/s "
                  f"({rows[-1]['encode_vs_copy']:5.2f}x a copy) | same bytes: {same}",
                  flush=True)
        for name, (hold, kernels) in backends().items():
            if only and name not in only:
                continue
            o, w = hold(old), hold(new)
            n_reps = device_reps if kernels == "device" else reps

            def encode() -> Any:
                msg = delta.encode(o, w, kernels=kernels)
                for s in msg.sections:
                    ready(s)
                return msg
            enc_s = median_seconds(encode, n_reps)
            msg = encode()
            same = msg.to_bytes().tobytes() == want.tobytes()
            target = hold(old.copy())
            apply_s = median_seconds(lambda: ready(delta.apply(want, target, kernels=kernels)),
                                     n_reps)
            out = delta.apply(want, hold(old.copy()), kernels=kernels)
            rows.append({"backend": name, "changed": fraction, "mib": mib, "kind": msg.kind,
                         "bytes_ratio": msg.nbytes / new.nbytes,
                         "encode_seconds": enc_s, "encode_gbps": new.nbytes / enc_s / 1e9,
                         "encode_vs_copy": enc_s / copy_s, "apply_seconds": apply_s,
                         "apply_gbps": new.nbytes / apply_s / 1e9, "copy_seconds": copy_s,
                         "copy_gbps": new.nbytes / copy_s / 1e9,
                         "same_bytes_as_numpy": same,
                         "applied_bit_exact": host_bytes(out) == new.tobytes()})
            print_row(rows[-1])
    return rows


def print_row(r: dict) -> None:
    print(f"  {r['backend']:12s} changed {r['changed']:<6g} {r['kind']:7s} bytes {r['bytes_ratio']:.4f} "
          f"of dense | diff+encode {r['encode_seconds'] * 1e3:8.2f} ms = "
          f"{r['encode_gbps']:6.2f} GB/s ({r['encode_vs_copy']:5.2f}x a copy at "
          f"{r['copy_gbps']:.2f} GB/s) | apply {r['apply_gbps']:6.2f} GB/s | same bytes as "
          f"numpy: {r['same_bytes_as_numpy']}, applied bit-exact: {r['applied_bit_exact']}",
          flush=True)


def demo_changed_fraction(lr: float = 1e-6, seed: int = 0) -> dict:
    """One optax Adam step of the demo model at ``lr``: the fraction of its BF16 weights
    whose bits changed (fp32 master weights cast to bf16, and bf16 parameters)."""
    import jax
    import jax.numpy as jnp
    import optax

    from xreshard.delta import changed_fraction
    from xreshard.tools.demo import DemoConfig, forward, nest, tensor_specs

    cfg = DemoConfig()
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(seed)
    flat = {s.path: (np.ones(s.stored_shape, np.float32) if s.path.endswith("/scale") else
                     (rng.standard_normal(s.stored_shape) * 0.05).astype(np.float32))
            for s in specs}

    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1)), jnp.int32)

    def loss(p: dict) -> Any:
        logits = forward(p, tokens[:, :-1], cfg, jnp)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    out = {}
    for label, dtype in (("fp32 master -> bf16", jnp.float32), ("bf16 params", jnp.bfloat16)):
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), nest(flat))
        opt = optax.adam(lr)
        grads = jax.grad(loss)(params)
        updates, _ = opt.update(grads, opt.init(params), params)
        stepped = optax.apply_updates(params, updates)
        before = [np.asarray(a.astype(jnp.bfloat16)) for a in jax.tree_util.tree_leaves(params)]
        after = [np.asarray(a.astype(jnp.bfloat16)) for a in jax.tree_util.tree_leaves(stepped)]
        n = sum(a.size for a in before)
        changed = sum(changed_fraction(a, b) * a.size for a, b in zip(before, after))
        out[label] = {"elements": n, "changed": changed / n}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", action="store_true", help="phase 1: the delta kernels alone")
    ap.add_argument("--mib", type=float, default=64.0, help="bucket size (MiB of bf16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device-reps", type=int, default=2,
                    help="repetitions of the JAX/torch device kernels (slow on a CPU)")
    ap.add_argument("--changed", default="1.0,0.01,0.001", help="changed fractions")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--backends", default=None,
                    help="kernels: only these rows (numpy,jax/auto,jax/device,torch/auto,...)")
    ap.add_argument("--baseline-rev", default=None,
                    help="kernels: also time the numpy kernels of this git revision, same run")
    ap.add_argument("--model-mib", type=float, default=256.0, help="refit: model size (MiB)")
    ap.add_argument("--tensor-mib", type=float, default=16.0, help="refit: tensor size (MiB)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="refit: throttle the transport to this many Gb/s per process")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="refit: cuda runs both processes on GPU 0 over NCCL (the device "
                         "path: the diff with jitted JAX on the GPU, applied with torch ops)")
    ap.add_argument("--fp8", action="store_true",
                    help="refit: block-FP8 destinations, quantized on the way")
    ap.add_argument("--baseline", default="host", choices=["host", "device"],
                    help="refit: where the trainer keeps its baselines (Tuning.delta_baseline)")
    args = ap.parse_args(argv)
    fractions = [float(x) for x in args.changed.split(",")]
    if not args.kernels:
        from bench_delta_refit import refit_main
        return refit_main(args, fractions, demo_changed_fraction)
    print(f"delta kernels: a {args.mib:g} MiB bf16 bucket, median of {args.reps}, "
          f"{platform.machine()} {platform.processor() or ''} ({__import__('os').cpu_count()} "
          "CPUs), JAX and torch on CPU", flush=True)
    rows = kernel_rows(args.mib, fractions, args.reps, args.device_reps,
                       args.backends.split(",") if args.backends else None, args.baseline_rev)
    print("demo model (xreshard.tools.demo), one optax Adam step at lr 1e-6:", flush=True)
    demo = demo_changed_fraction()
    for label, d in demo.items():
        print(f"  {label}: {d['changed'] * 100:.3f}% of {d['elements']:,} BF16 weights "
              "changed bits", flush=True)
    if args.json:
        print(json.dumps({"kernels": rows, "demo_adam_lr1e-6": demo}))
    bad = [r for r in rows if not (r["same_bytes_as_numpy"] and r.get("applied_bit_exact", True))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
