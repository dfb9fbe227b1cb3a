"""Relay through destination replicas on CPU: direct vs relay back to back vs relay
overlapped, in the same processes.

One trainer process (host "t") sends a float32 model to four receiver processes that each
hold all of it, two declaring host "a" and two host "b" (``World.join(host=...)``; on CPU
a host is the relay's fast domain). Three refits of the same model run interleaved,
``--reps`` times each after a warm-up call; the table reports medians:

a. **direct** (``relay="off"``): the trainer sends 4 copies.
b. **relay, back to back**: the trainer sends 2 copies (one per host), the receivers
   forward the other 2, every forward after its sender's whole stage 1
   (``Refit(tuning=Tuning(relay_overlap=False))``: the same schedule, buckets and budget as
   c, only the rounds of the forwards differ).
c. **relay, overlapped** (``relay="on"``, the default schedule): each forward in the round
   after the one that brought its bytes, beside the next chunk of stage 1.

Each timed call starts after a world barrier; its time is the slowest process's. Every
destination byte is checked after each warm-up call. On one machine the "slow" and "fast"
links are the same loopback and the same cores, so what overlap can win here is bounded by
the CPU the processes share (``os.cpu_count()`` is printed).

    python benchmarks/bench_relay.py [--mib 256] [--reps 5] [--bucket-mib 4]
                                     [--staging-mib 64] [--transport gloo|auto] [--json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
TIMEOUT = 600.0
VARIANTS = ("direct", "relay back to back", "relay overlapped")


def specs(mib: float, num_tensors: int = 16) -> dict[str, tuple[int, int]]:
    """``num_tensors`` float32 matrices of 1,024 columns, ``mib`` MiB in all."""
    rows = max(1, int(mib * MiB / num_tensors / 4 / 1024))
    return {f"layer{i:02d}.weight": (rows, 1024) for i in range(num_tensors)}


def values(shapes: dict[str, tuple[int, int]], version: int) -> dict[str, np.ndarray]:
    return {n: (np.arange(r * c, dtype=np.float32).reshape(r, c) + 1000.0 * version + i)
            for i, (n, (r, c)) in enumerate(shapes.items())}


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    host = "t" if trainer else "ab"[ctx.role.index // 2]
    shapes = specs(cfg["mib"])
    out: dict = {"times": {v: [] for v in VARIANTS}, "reports": {}, "trainer": trainer}
    with ctx.join(1, timeout=TIMEOUT, host=host) as world:
        rank = world.rank_ids[0]
        refits = {}
        for v in VARIANTS:
            config = xr.RefitConfig(relay="off" if v == "direct" else "on", timeout=TIMEOUT,
                                    bucket_bytes=cfg["bucket_mib"] * MiB,
                                    staging_bytes=cfg["staging_mib"] * MiB,
                                    transport=cfg["transport"])
            tuning = xr.Tuning(relay_overlap=v != "relay back to back")
            refits[v] = xr.Refit(world, config=config, tuning=tuning, name=v)
        if trainer:
            vals = values(shapes, 1)
            side = xr.Bound({n: xr.Layout.replicated(a.shape, "float32", xr.Mesh((1,), (rank,)))
                             for n, a in vals.items()}, {(rank, n): a for n, a in vals.items()})
        else:
            dest = {n: np.full(s, -1, np.float32) for n, s in shapes.items()}
            side = xr.Bound({n: xr.Layout.explicit_form(s, "float32", {rank: [[(0, k) for k in s]]})
                             for n, s in shapes.items()},
                            {(rank, n): [a] for n, a in dest.items()}, local_only=set(dest))

        def call(v: str) -> Any:
            return refits[v](send=side) if trainer else refits[v](receive=side)

        for v in VARIANTS:
            r = call(v)
            out["reports"][v] = {"sent": r.bytes_sent, "forwarded": r.bytes_forwarded,
                                 "received": r.bytes_received, "rounds": r.num_rounds,
                                 "plan_s": r.plan_seconds}
            if not trainer:
                want = values(shapes, 1)
                out["reports"][v]["exact"] = all(np.array_equal(dest[n], want[n]) for n in dest)
                for a in dest.values():
                    a[...] = -1
        for _ in range(cfg["reps"]):
            for v in VARIANTS:
                world.barrier(timeout=TIMEOUT)
                t0 = time.perf_counter()
                call(v)
                out["times"][v].append(time.perf_counter() - t0)
        everyone = world.allgather_json(out, timeout=TIMEOUT)
    return {"everyone": everyone}


def summarize(everyone: list[dict], cfg: dict) -> dict:
    """Per variant: median over repetitions of the slowest process's time; bytes."""
    reps = len(everyone[0]["times"][VARIANTS[0]])
    rows = {}
    for v in VARIANTS:
        slowest = [max(p["times"][v][i] for p in everyone) for i in range(reps)]
        trainer = next(p["reports"][v] for p in everyone if p["trainer"])
        receivers = [p["reports"][v] for p in everyone if not p["trainer"]]
        rows[v] = {"median_s": statistics.median(slowest), "min_s": min(slowest),
                   "trainer_sent": trainer["sent"],
                   "forwarded": sum(r["forwarded"] for r in receivers),
                   "rounds": max(r["rounds"] for r in receivers),
                   "exact": all(r["exact"] for r in receivers)}
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256.0, help="model size in MiB (float32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=4)
    ap.add_argument("--staging-mib", type=int, default=64)
    ap.add_argument("--transport", choices=("gloo", "auto"), default="gloo",
                    help="gloo for every pair, or auto (shm inside a declared host)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = {"mib": args.mib, "reps": args.reps, "bucket_mib": args.bucket_mib,
           "staging_mib": args.staging_mib, "transport": args.transport}
    from xreshard.tools.launch import Role, launch

    roles = [Role("plain", "trainer", 0)] + [Role("plain", "rollout", i) for i in range(4)]
    t0 = time.perf_counter()
    results = launch("bench_relay:child", roles, args=(cfg,), timeout=args.timeout)
    rows = summarize(results[0].value["everyone"], cfg)
    model = sum(r * c * 4 for r, c in specs(args.mib).values())
    print(f"relay on CPU: 1 trainer (host t) -> 4 receivers (hosts a, a, b, b), "
          f"{model / MiB:.0f} MiB float32, transport {args.transport}, bucket "
          f"{args.bucket_mib} MiB, staging {args.staging_mib} MiB, {args.reps} reps "
          f"(median of the slowest process)")
    print(f"{'variant':<22}{'median s':>10}{'min s':>9}{'trainer sent':>14}"
          f"{'forwarded':>11}{'rounds':>8}{'exact':>7}")
    for v, row in rows.items():
        print(f"{v:<22}{row['median_s']:>10.3f}{row['min_s']:>9.3f}"
              f"{row['trainer_sent'] / model:>12.2f}x{row['forwarded'] / model:>10.2f}x"
              f"{row['rounds']:>8}{'yes' if row['exact'] else 'NO':>7}")
    b2b, ovl = rows["relay back to back"]["median_s"], rows["relay overlapped"]["median_s"]
    print(f"overlapped / back to back: {ovl / b2b:.2f}; overlapped / direct: "
          f"{ovl / rows['direct']['median_s']:.2f}")
    print(f"\nMachine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; {time.perf_counter() - t0:.0f} s in all")
    if args.json:
        import json
        print(json.dumps({"model_bytes": model, **cfg, "rows": rows}))


if __name__ == "__main__":
    main()
