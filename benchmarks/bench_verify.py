"""What ``RefitConfig(verify=...)`` costs: refits with verify off, True and "sample", side by
side in the same processes.

The model and the processes are bench_refit's (imported, not copied): one JAX process (4
CPU devices, TP=4) sends a Llama-like bf16 model to two torch processes holding DTensors
(TP=2), over ``transport="auto"`` (shm on one host) or ``--transport gloo``.

Three ``Refit`` objects over the same tensors, ``RefitConfig(verify=False / True /
"sample")``, are called in turn ``--reps`` times in the same processes; each call's time is
the slowest process's (every phase starts after a world barrier). Beside them, each
process times ``verify.checksum`` over its own bytes of the model (what the hashing alone
costs here). Every destination byte is checked after each warm-up refit and at the end.
(A byte corrupted after the move is caught in tests/test_verify.py.)

    python benchmarks/bench_verify.py [--gib 0.5] [--reps 5] [--transport auto|gloo]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_refit as br  # noqa: E402  (the model, the processes, the checks)

MiB = 2 ** 20
TIMEOUT = 600.0
BUDGET = 0.15           # the bar: verify=True costs at most 15% of the refit


def has_verify_config() -> bool:
    import xreshard as xr
    return "verify" in {f.name for f in dataclasses.fields(xr.RefitConfig)}


def local_arrays(is_trainer: bool, params: Any, views: Any) -> list[np.ndarray]:
    """This process's bytes of the model: the trainer's JAX shards, a receiver's views."""
    if is_trainer:
        return [np.asarray(s.data) for a in params.values() for s in a.addressable_shards]
    return list(views.values())


def hash_seconds(arrays: list[np.ndarray]) -> tuple[float, int]:
    """What checksumming these arrays costs here, apart from any refit."""
    from xreshard.runtime import verify

    t0 = time.perf_counter()
    for a in arrays:
        verify.checksum(a)
    return time.perf_counter() - t0, sum(a.nbytes for a in arrays)


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    if not has_verify_config():
        raise SystemExit("RefitConfig has no verify= field: this xreshard predates issue 8")
    is_trainer = ctx.role.group == "trainer"
    specs = br.model_specs(cfg["gib"])
    dtype = "bfloat16"
    if not is_trainer:
        import torch
        torch.set_num_threads(1)
        br.torch_group(ctx, br.ROLLOUT_TP, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=TIMEOUT)
    modes = {"off": False, "true": True, "sample": "sample"}
    base = dict(bucket_bytes=cfg["bucket_mib"] * MiB, staging_bytes=cfg["staging_mib"] * MiB,
                timeout=TIMEOUT, transport=cfg["transport"])
    params = views = None
    if is_trainer:
        params = br.jax_params(specs, dtype, "out_in")
        refits = {k: xr.Refit(world, send=params, config=xr.RefitConfig(verify=v, **base),
                              name=k) for k, v in modes.items()}
        # a Refit keeps no reference to sent JAX arrays: the trainer passes them each call
        calls = {k: (lambda r=r: r(send=params)) for k, r in refits.items()}
    else:
        state = br.dtensors(specs, dtype)
        views = br.local_views(state)
        refits = {k: xr.Refit(world, receive=state, config=xr.RefitConfig(verify=v, **base),
                              name=k) for k, v in modes.items()}
        calls = dict(refits)

    for k, call in calls.items():               # warm-up: plans, transports; check bytes
        world.barrier(timeout=TIMEOUT)
        call()
        if not is_trainer:
            br.check_rollout(views, specs, dtype, ctx.role.index, f"refit verify={k}")
            br.zero(views)

    times: dict[str, list[float]] = {}
    verified: dict[str, int] = {}
    hashing: list[float] = []
    for rep in range(cfg["reps"]):
        for k, call in calls.items():
            box: list = []
            times.setdefault(f"refit:{k}", []).append(br.timed(world, lambda: box.append(call())))
            verified[k] = getattr(box[0], "verified", 0) or 0
        world.barrier(timeout=TIMEOUT)
        seconds, nbytes = hash_seconds(local_arrays(is_trainer, params, views))
        hashing.append(seconds)
    if not is_trainer:
        br.check_rollout(views, specs, dtype, ctx.role.index, "after the timed refits")
    mine = {"label": world.describe_process(world.process_index).split(" (")[0],
            "times": times, "verified": verified, "hash_seconds": hashing,
            "hash_bytes": nbytes, "moved": refits["off"].plan.stats.bytes_moved}
    everyone = world.allgather_json(mine, timeout=TIMEOUT)
    world.close()
    if not is_trainer:
        import torch.distributed as dist
        dist.destroy_process_group()
    return {"processes": everyone}


def slowest(procs: list[dict], key: str) -> list[float]:
    """Per repetition, the slowest process's time."""
    return [max(vals) for vals in zip(*(p["times"][key] for p in procs))]


def summarize(res: dict, cfg: dict, command: str) -> str:
    procs = res["processes"]
    specs = br.model_specs(cfg["gib"])
    model = sum(int(np.prod(s)) for _, s, _ in specs) * 2
    lines = []
    w = lines.append
    w(f"Model: {len(specs)} bf16 tensors, {model / 2**30:.3f} GiB; JAX TP=4 (1 process) -> "
      f"torch TP=2 (2 processes); transport={cfg['transport']}, {cfg['reps']} repetitions, "
      f"medians of the slowest process per repetition.")
    w("")
    refit = statistics.median(slowest(procs, "refit:off"))
    w("| verify | refit s (median of the slowest process) | extra vs off | extra / refit | "
      "transfers compared |")
    w("|---|---|---|---|---|")
    ratio = 0.0
    for k in ("off", "true", "sample"):
        t = statistics.median(slowest(procs, f"refit:{k}"))
        w(f"| {k} | {t:.3f} | {t - refit:+.3f} s | {(t - refit) / refit:+.1%} | "
          f"{procs[0]['verified'].get(k, 0)} |")
        if k == "true":
            ratio = (t - refit) / refit
    w("")
    w("Checksums alone, each process over its own bytes of the model (all processes at once, "
      "as in a refit):")
    w("")
    w("| process | MiB | seconds | GB/s |")
    w("|---|---|---|---|")
    for p in procs:
        sec = statistics.median(p["hash_seconds"])
        w(f"| {p['label']} | {p['hash_bytes'] / MiB:.0f} | {sec:.3f} | "
          f"{p['hash_bytes'] / sec / 1e9:.1f} |")
    w("")
    verdict = "meets" if ratio <= BUDGET else "MISSES"
    w(f"verify=True costs {ratio:+.1%} of the refit: {verdict} the issue's bar of "
      f"{BUDGET:.0%}.")
    w("")
    w(f"Command: `{command}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="model size in GiB (bf16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", choices=("auto", "gloo"), default="auto")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args(argv)
    cfg = {"gib": args.gib, "reps": args.reps, "transport": args.transport,
           "bucket_mib": args.bucket_mib, "staging_mib": args.staging_mib}
    command = "python " + " ".join(["benchmarks/bench_verify.py",
                                    *(sys.argv[1:] if argv is None else argv)])
    from xreshard.tools.launch import Role, launch

    roles = [Role("jax", "trainer", 0, num_devices=br.TRAINER_TP)] + [
        Role("torch", "rollout", i) for i in range(br.ROLLOUT_TP)]
    t0 = time.perf_counter()
    results = launch("bench_verify:child", roles, args=(cfg,), timeout=args.timeout)
    print(summarize(results[0].value, cfg, command))
    print(f"\nMachine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, {__import__('os').cpu_count()} CPUs; whole run "
          f"{time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
