"""What ``RefitConfig(check_writes=True)`` costs: refits of a torch sender with the check off
and on, side by side in the same processes.

bench_refit's Llama-like bf16 model (imported, not copied), sent by two torch processes
holding DTensors (TP=2, the trainer) to two torch processes holding DTensors (TP=2, the
rollout), over ``transport="auto"`` (shm on one host) or ``--transport gloo``. Two ``Refit``
objects over the same tensors, ``check_writes=False`` and ``True``, are called in turn
``--reps`` times, both as a blocking call and as ``refit.start()`` + ``handle.wait()`` on
the trainer; each call's time is the slowest process's (every phase starts after a world
barrier). For the started refits the table also gives how long ``start()`` takes to return
on the trainer (with the check, it hashes the sent tensors before returning). Beside them,
each trainer process times the check's digests of its own tensors alone. Every
destination byte is checked after the warm-up and at the end.

    python benchmarks/bench_writes.py [--gib 0.5] [--reps 5] [--transport auto|gloo]
"""

from __future__ import annotations

import argparse
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

import bench_refit as br  # noqa: E402  (the model, the process groups, the checks)
from bench_verify import MiB, TIMEOUT, slowest  # noqa: E402
TP = br.ROLLOUT_TP      # both sides: DTensors over 2 torch processes


def fill_pattern(views: dict[str, np.ndarray], specs, dtype: str, me: int) -> None:
    """The trainer's local shards hold the values ``br.check_rollout`` expects."""
    for k, (name, shape, kind) in enumerate(specs):
        starts, stops = br.local_box(shape, kind, TP, me)
        np.copyto(br.bits(views[name]), br.bits(br.pattern(k, starts, stops, dtype)))


def digest_seconds(state: dict[str, Any]) -> tuple[float, int]:
    """What taking the check's digests of these tensors costs here, apart from any refit."""
    from xreshard.adapters.torch_writes import Taken

    tensors = {k: v.to_local() for k, v in state.items()}
    t0 = time.perf_counter()
    Taken(tensors).digests()
    return time.perf_counter() - t0, sum(t.numel() * t.element_size()
                                         for t in tensors.values())


def child(ctx: Any, cfg: dict) -> dict:
    import torch
    import xreshard as xr

    is_trainer = ctx.role.group == "trainer"
    specs = br.model_specs(cfg["gib"])
    dtype = "bfloat16"
    torch.set_num_threads(1)
    br.torch_group(ctx, TP, ctx.role.index, ctx.role.group)
    world = ctx.join(groups=["trainer", "rollout"], timeout=TIMEOUT)
    state = br.dtensors(specs, dtype)
    views = br.local_views(state)
    if is_trainer:
        fill_pattern(views, specs, dtype, ctx.role.index)
    base = dict(bucket_bytes=cfg["bucket_mib"] * MiB, staging_bytes=cfg["staging_mib"] * MiB,
                timeout=TIMEOUT, transport=cfg["transport"])
    side = {"send": state} if is_trainer else {"receive": state}
    refits = {k: xr.Refit(world, **side, config=xr.RefitConfig(check_writes=v, **base),
                          name=k) for k, v in (("off", False), ("on", True))}

    for k, refit in refits.items():            # warm-up: plans, transports; check bytes
        world.barrier(timeout=TIMEOUT)
        refit()
        if not is_trainer:
            br.check_rollout(views, specs, dtype, ctx.role.index, f"check_writes {k}")
            br.zero(views)

    times: dict[str, list[float]] = {}
    returns: dict[str, list[float]] = {}
    hashing: list[float] = []
    nbytes = 0
    for _ in range(cfg["reps"]):
        for k, refit in refits.items():
            times.setdefault(f"call:{k}", []).append(br.timed(world, refit))

            def started(refit: Any = refit, k: str = k) -> None:
                if not is_trainer:
                    refit()
                    return
                t0 = time.perf_counter()
                handle = refit.start()
                returns.setdefault(k, []).append(time.perf_counter() - t0)
                handle.wait()
            times.setdefault(f"start:{k}", []).append(br.timed(world, started))
        world.barrier(timeout=TIMEOUT)
        if is_trainer:
            seconds, nbytes = digest_seconds(state)
            hashing.append(seconds)
    if not is_trainer:
        br.check_rollout(views, specs, dtype, ctx.role.index, "after the timed refits")
    mine = {"label": world.describe_process(world.process_index).split(" (")[0],
            "times": times, "returns": returns, "hash_seconds": hashing,
            "hash_bytes": nbytes, "moved": refits["off"].plan.stats.bytes_moved}
    everyone = world.allgather_json(mine, timeout=TIMEOUT)
    world.close()
    torch.distributed.destroy_process_group()
    return {"processes": everyone}


def summarize(res: dict, cfg: dict, command: str) -> str:
    procs = res["processes"]
    specs = br.model_specs(cfg["gib"])
    model = sum(int(np.prod(s)) for _, s, _ in specs) * 2
    lines: list[str] = []
    w = lines.append
    w(f"Model: {len(specs)} bf16 tensors, {model / 2**30:.3f} GiB; torch DTensor TP=2 (2 "
      f"processes) -> torch DTensor TP=2 (2 processes); transport={cfg['transport']}, "
      f"{cfg['reps']} repetitions, medians of the slowest process per repetition.")
    w("")
    w("| call | check_writes=False s | check_writes=True s | True / False |")
    w("|---|---|---|---|")
    for what, label in (("call", "refit() (blocking)"), ("start", "start() + wait()")):
        off = statistics.median(slowest(procs, f"{what}:off"))
        on = statistics.median(slowest(procs, f"{what}:on"))
        w(f"| {label} | {off:.3f} | {on:.3f} | {on / off:.2f}x |")
    trainers = [p for p in procs if p["returns"]]
    off = statistics.median(max(v) for v in zip(*(p["returns"]["off"] for p in trainers)))
    on = statistics.median(max(v) for v in zip(*(p["returns"]["on"] for p in trainers)))
    w(f"| start() returns (trainer) | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | "
      f"+{(on - off) * 1e3:.1f} ms |")
    w("")
    w("The check's digests alone, each trainer process over its own tensors (both at once):")
    w("")
    w("| process | MiB | seconds | GB/s |")
    w("|---|---|---|---|")
    for p in trainers:
        sec = statistics.median(p["hash_seconds"])
        w(f"| {p['label']} | {p['hash_bytes'] / MiB:.0f} | {sec:.3f} | "
          f"{p['hash_bytes'] / sec / 1e9:.1f} |")
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
    command = "python " + " ".join(["benchmarks/bench_writes.py",
                                    *(sys.argv[1:] if argv is None else argv)])
    from xreshard.tools.launch import Role, launch

    roles = [Role("torch", g, i) for g in ("trainer", "rollout") for i in range(TP)]
    t0 = time.perf_counter()
    results = launch("bench_writes:child", roles, args=(cfg,), timeout=args.timeout)
    print(summarize(results[0].value, cfg, command))
    print(f"\nMachine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, {__import__('os').cpu_count()} CPUs; whole run "
          f"{time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
