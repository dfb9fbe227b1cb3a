"""The refit-level half of bench_delta.py (issue 22 phase 2): dense vs
``RefitConfig(delta=True)`` side by side, between two processes over gloo. Run it through
``python benchmarks/bench_delta.py`` (see its docstring)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20


class Throttled:
    """A transport that moves at most ``gbps`` Gb/s through this process: each group
    lasts at least its bytes (sent and received) over the rate."""

    def __init__(self, inner: Any, gbps: float):
        self.inner, self.rate = inner, gbps * 1e9 / 8
        self.name = f"throttled({inner.name})"
        self._bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        t0, self._bytes = time.perf_counter(), 0
        with self.inner.group(timeout):
            yield
        rest = t0 + self._bytes / self.rate - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def send(self, buf: Any, src: int, dst: int, tag: int) -> None:
        self._bytes += buf.nbytes
        self.inner.send(buf, src, dst, tag)

    def recv(self, buf: Any, src: int, dst: int, tag: int) -> None:
        self._bytes += buf.nbytes
        self.inner.recv(buf, src, dst, tag)


#: ``--fp8``: the tensors' rows (a multiple of the 128-row blocks)
FP8_COLUMNS = 1024


def versions(cfg: dict, fraction: float) -> Iterator[dict[str, np.ndarray]]:
    """Version 0, 1, ... of every tensor (bf16 bits as uint16): each one ``fraction`` of
    the elements one ulp off the last, at random places (the same in both processes);
    with ``--fp8`` matrices of :data:`FP8_COLUMNS` columns (changed in place: flat)."""
    n = int(cfg["tensor_mib"] * MiB) // 2
    count = max(1, int(cfg["model_mib"] // cfg["tensor_mib"]))
    rng = np.random.default_rng(0)
    shape = (n // FP8_COLUMNS, FP8_COLUMNS) if cfg.get("fp8") else (n,)
    cur = {f"w{i}": (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
           .__rshift__(16).astype(np.uint16).reshape(shape) for i in range(count)}
    k = int(round(n * fraction))
    while True:
        yield cur
        nxt = {}
        for name, arr in cur.items():
            arr = arr.copy()
            pos = rng.choice(n, k, replace=False) if k < n else slice(None)
            arr.reshape(-1)[pos] ^= np.uint16(1)
            nxt[name] = arr
        cur = nxt


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    world = ctx.join(groups=["trainer", "rollout"])
    if cfg["link_gbps"]:
        plain = world.transport
        world.transport = lambda kind="auto": Throttled(plain(kind), cfg["link_gbps"])
    cuda = cfg.get("device") == "cuda"
    base = dict(transport="nccl" if cuda else "gloo", timeout=600)
    tuning = xr.Tuning(delta_baseline=cfg.get("baseline", "host"))
    rows = []
    for fraction in cfg["fractions"]:
        made = versions(cfg, fraction)
        receive = receive_dense = None
        dense = delta = None
        times: dict[str, list] = {"dense": [], "delta": [], "diff": [], "dense_bytes": [],
                                  "delta_bytes": [], "ahead_items": [], "ahead_seconds": [],
                                  "delta_cpu": [], "dense_plan": [], "delta_plan": [],
                                  "dense_move": [], "delta_move": [], "dense_cpu": []}
        for rep in range(cfg["reps"] + 1):          # rep 0 seeds the baselines
            v = next(made)
            if trainer:
                import jax
                import jax.numpy as jnp
                send = {k: jax.device_put(jnp.asarray(a).view(jnp.bfloat16), jax.devices()[0])
                        for k, a in v.items()}
                jax.block_until_ready(send)
            elif receive is None:
                # The dense Refit gets its own destinations: a delta's base is what the
                # last delta call wrote, and any other write (a dense refit's included)
                # is an outside write its fence refuses.
                receive, receive_dense = (_destinations(v, "cuda" if cuda else "cpu",
                                                        cfg.get("fp8", False))
                                          for _ in range(2))
            if dense is None:
                dense = xr.Refit(world, send=send if trainer else None, receive=receive_dense,
                                 config=xr.RefitConfig(**base), name=f"dense{fraction}")
                delta = xr.Refit(world, send=send if trainer else None, receive=receive,
                                 config=xr.RefitConfig(delta=True, **base),
                                 tuning=tuning, name=f"delta{fraction}")
            # Both processes start each timed call together (the receiver checks the last
            # rep and makes the next version meanwhile: without the barrier the first call
            # of a rep waited for that), and the two take turns going first.
            def timed_dense() -> Any:
                world.barrier(timeout=600)
                cpu = time.process_time()
                got = dense(send=send) if trainer else dense()
                times["dense_cpu"].append(time.process_time() - cpu)
                return got

            def timed_delta() -> tuple[Any, float]:
                world.barrier(timeout=600)
                cpu = time.process_time()       # this process's CPU-seconds in the call
                got = delta(send=send) if trainer else delta()
                return got, time.process_time() - cpu

            if rep % 2:
                rd = timed_dense()
                rx, cpu = timed_delta()
            else:
                rx, cpu = timed_delta()
                rd = timed_dense()
            if not trainer:
                _check(receive, v, fraction)
            if rep:
                times["dense"].append(rd.seconds)
                times["delta"].append(rx.seconds)
                times["diff"].append((rx.delta or {}).get("encode_seconds", 0.0))
                times["dense_bytes"].append(rd.bytes_sent)
                times["delta_bytes"].append(rx.bytes_sent)
                times["delta_cpu"].append(cpu)
                for k, r in (("dense", rd), ("delta", rx)):    # refit/check + plan; the move
                    times[k + "_plan"].append(r.plan_seconds)
                    times[k + "_move"].append(r.move_seconds)
                if trainer:     # the FP8 items the trainer quantized ahead in the delta call
                    ahead = delta.quant_ahead.last or {}
                    times["ahead_items"].append(ahead.get("items", 0))
                    times["ahead_seconds"].append(ahead.get("worker_seconds", 0.0))
            send = None
        rows.append({k: statistics.median(v) if v else 0 for k, v in times.items()}
                    | {"changed": fraction})
    world.close()
    return {"rows": rows}


def _destinations(v: dict, device: str, fp8: bool) -> dict:
    """Zeroed destinations of ``v``'s tensors: bf16, or block-FP8 codes and scales."""
    import torch
    if not fp8:
        return {k: torch.zeros(a.shape, dtype=torch.bfloat16, device=device)
                for k, a in v.items()}
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8
    fmt = BlockFP8()
    return {k: Quantized(torch.zeros(a.shape, dtype=torch.float8_e4m3fn, device=device),
                         torch.zeros(fmt.scale_shape(a.shape), dtype=torch.float32,
                                     device=device), fmt) for k, a in v.items()}


def _check(receive: dict, v: dict, fraction: float) -> None:
    """Every destination byte equals ``v`` (bf16), or its codes and scales the reference
    quantizer's (vLLM's bytes, tests/test_quant.py)."""
    import torch
    for k, a in v.items():
        got = receive[k]
        if hasattr(got, "codes"):
            from xreshard.dtypes import numpy_dtype
            from xreshard.quant.host import quantize_block_fp8
            codes, scales = quantize_block_fp8(a.view(numpy_dtype("bfloat16")), got.format)
            same = got.codes.cpu().view(torch.uint8).numpy().tobytes() == codes.tobytes() \
                and got.scales.cpu().numpy().tobytes() == scales.tobytes()
        else:
            same = got.view(torch.int16).cpu().numpy().view(np.uint16).tobytes() == a.tobytes()
        if not same:
            raise AssertionError(f"changed {fraction}: {k} not bit-exact")


def bars(row: dict, link: bool, gpu: bool = False) -> list[tuple[str, bool]]:
    """The issue's bars for one row (name, met); ``gpu``: the GPU target instead."""
    f = row["changed"]
    out = []
    if gpu:
        if f == 0.01:
            out.append(("bytes_ratio <= 0.08", row["bytes_ratio"] <= 0.08))
            out.append(("time_ratio <= 0.15 on a GPU", row["time_ratio"] <= 0.15))
        if f == 1.0:
            out.append(("time_ratio <= 1.10", row["time_ratio"] <= 1.10))
        return out
    if link:
        if f == 0.01:
            out.append(("time_ratio <= 0.2 at 1 Gb/s", row["time_ratio"] <= 0.2))
        return out
    if f == 0.01:
        out.append(("bytes_ratio <= 0.08", row["bytes_ratio"] <= 0.08))
        bound = 1.15 * max(row["bytes_ratio"] * row["dense_seconds"], row["diff_seconds"])
        out.append((f"delta_seconds <= 1.15 x max(bytes_ratio x dense, diff) = {bound:.3f}",
                    row["delta_seconds"] <= bound))
    if f == 0.001:
        out.append(("bytes_ratio <= 0.01", row["bytes_ratio"] <= 0.01))
    if f == 1.0:
        out.append(("time_ratio <= 1.10", row["time_ratio"] <= 1.10))
    return out


def refit_main(args: Any, fractions: list[float],
               demo: Callable[[], dict]) -> int:
    from xreshard.tools.launch import Role, launch

    cfg = {"fractions": fractions, "model_mib": args.model_mib, "tensor_mib": args.tensor_mib,
           "reps": args.reps if args.reps != 5 else 3, "link_gbps": args.link_gbps,
           "device": args.device, "baseline": args.baseline, "fp8": args.fp8}
    link = f", transport throttled to {args.link_gbps:g} Gb/s per process" \
        if args.link_gbps else ""
    where = ("JAX (GPU 0) -> torch (cuda:0), NCCL between 2 processes on one GPU, baselines "
             f"on the {'GPU' if args.baseline == 'device' else 'host'}"
             if args.device == "cuda" else "JAX (1 CPU device) -> torch, gloo between 2 "
             "processes")
    into = " into block-FP8 destinations (quantized on the way)" if args.fp8 else ""
    print(f"delta refit: {args.model_mib:g} MiB of bf16 in {args.tensor_mib:g} MiB tensors"
          f"{into}, {where}{link}; dense and delta=True side by side, median of "
          f"{cfg['reps']}; load average {os.getloadavg()[0]:.1f}", flush=True)
    roles = [Role("jax", "trainer", 0, num_devices=1), Role("torch", "rollout", 0)]
    env = None
    if args.device == "cuda":       # two ranks of one GPU: NCCL >= 2.30 (see gpu_check.sh)
        roles = [Role("jax", "trainer", 0, gpus=(0,)), Role("torch", "rollout", 0, gpus=(0,))]
        env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    results = launch("bench_delta_refit:child", roles, args=(cfg,), timeout=3600, env=env)
    rows, met = [], True
    for r, rr in zip(results[0].value["rows"], results[1].value["rows"]):
        row = {"changed": r["changed"], "bytes_ratio": r["delta_bytes"] / r["dense_bytes"],
               "time_ratio": r["delta"] / r["dense"], "dense_seconds": r["dense"],
               "delta_seconds": r["delta"], "diff_seconds": r["diff"],
               "link_gbps": args.link_gbps, "ahead_items": r["ahead_items"],
               "ahead_seconds": r["ahead_seconds"], "delta_cpu_seconds": r["delta_cpu"],
               # the receiver's own calls (its commit checksum after the outcome included)
               "receiver_time_ratio": rr["delta"] / rr["dense"],
               # the calls' refit/check + planning and their move, per process (medians)
               "phases": {who: {k: x[k] for k in ("dense_plan", "dense_move", "delta_plan",
                                                  "delta_move", "dense_cpu", "delta_cpu")}
                          for who, x in (("trainer", r), ("receiver", rr))}}
        row["bars"] = {} if args.fp8 else {      # the bars are of bf16 refits
            name: ok for name, ok in bars(row, bool(args.link_gbps), args.device == "cuda")}
        met = met and all(row["bars"].values())
        rows.append(row)
        print(f"  changed {row['changed']:<6g} bytes_ratio {row['bytes_ratio']:.4f} "
              f"time_ratio {row['time_ratio']:.3f} | dense {row['dense_seconds']:.3f} s, "
              f"delta {row['delta_seconds']:.3f} s (trainer CPU {row['delta_cpu_seconds']:.3f} s)"
              f", diff {row['diff_seconds']:.3f} s"
              + (f", quantized ahead {row['ahead_items']:g} items in "
                 f"{row['ahead_seconds']:.3f} s" if args.fp8 else "") + " | "
              + ("; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in row["bars"].items())
                 or "no bar"), flush=True)
    print("demo model (xreshard.tools.demo), one optax Adam step at lr 1e-6:", flush=True)
    changed = demo()
    for label, d in changed.items():
        print(f"  {label}: {d['changed'] * 100:.3f}% of {d['elements']:,} BF16 weights "
              "changed bits", flush=True)
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end", flush=True)
    if args.json:
        print(json.dumps({"refit": rows, "demo_adam_lr1e-6": changed}))
    return 0 if met else 1
