"""xreshard against what the frameworks do themselves, same machine, same run.

a. **JAX -> JAX in one process**: 4 CPU devices, a ``--mib`` MiB bf16 array sharded
   ``P("x", "y")`` on a 2x2 mesh, resharded to ``P("z")`` on a 4-device mesh, once with the
   same device order and once reversed. ``jax.device_put(x, new_sharding)`` (blocked until
   ready) against ``Refit(world, send={"w": x}, receive={"w": template})()`` in a
   one-process world whose 4 ranks are the 4 devices (same-rank bytes are local copies,
   the rest goes through the ``local`` transport). Every received byte is checked once.
b. **torch DTensor in 4 processes**: a ``--mib`` MiB bf16 tensor ``Shard(0)`` -> ``Shard(1)``
   on a 4-rank CPU mesh: ``DTensor.redistribute`` (the default gloo group) against a refit
   of the same processes (``send=`` the Shard(0) DTensor, ``receive=`` a Shard(1) one) over
   ``--transport`` (``auto``: shm on one host; or ``gloo``), checked once.

Timings alternate in the same processes, ``--reps`` times, each xreshard rep right after a
framework rep. Reported: medians (min-max) of each, and the ratio xreshard / framework as
the median of the reps' paired ratios with its quartiles (lower is better): on a loaded
machine a slow rep slows both of its pair, so the paired ratio reads where the medians of
two separate columns do not. ``slow`` counts the xreshard reps over 3x their fastest (a
bimodal figure shows there, not in a median).

    python benchmarks/bench_peers.py [--mib 128] [--reps 5] [--transport auto|gloo]
                                     [--only jax|torch] [--json] [--tensors N]

``--tensors N`` (JAX only): N bf16 arrays of (16, 32) instead of one ``--mib`` array, and
``jax.device_put`` of the whole tree: what each tensor costs, not the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import ROOT, torch_group  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
#: the shape of each array with --tensors N > 1 (bf16, 1 KiB: the per-tensor cost)
SMALL = (16, 32)


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "slow": sum(x > 3 * min(xs) for x in xs), "all": [round(x, 5) for x in xs]}


def _paired(xs: list[float], base: list[float]) -> dict[str, float]:
    """Median and quartiles of ``xs[i] / base[i]`` (each rep against its neighbour)."""
    ratios = sorted(x / b for x, b in zip(xs, base))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q[0], "q3": q[-1]}


def _cell(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


# ---------------------------------------------------------------------------- JAX -> JAX

#: with --tensors, jax.device_put takes the tree this many arrays at a time, each batch
#: finished before the next: thousands of resharding programs in flight at once deadlock
#: XLA's CPU collectives with 4 devices on 2 cores (a rendezvous that 2 of 4 device
#: threads reach, aborted after 40 s; 3 of 5 runs of the whole tree, either tree)
PUT_BATCH = 64


def _device_put(jax: Any, x: dict, dst: Any) -> Any:
    if len(x) == 1:
        return jax.block_until_ready(jax.device_put(x, dst))
    names, out = list(x), {}
    for i in range(0, len(names), PUT_BATCH):
        part = {n: x[n] for n in names[i:i + PUT_BATCH]}
        out.update(jax.block_until_ready(jax.device_put(part, dst)))
    return out



def jax_child(ctx: Any, cfg: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xreshard as xr

    devs = jax.local_devices()
    assert len(devs) == 4, devs
    side = int(np.sqrt(cfg["mib"] * MiB // 2))
    shape = (side, cfg["mib"] * MiB // 2 // side)
    shape = (shape[0] // 4 * 4, shape[1] // 4 * 4)
    count = cfg.get("tensors", 1)
    if count > 1:       # many small arrays: the per-tensor cost, not the bytes
        shape = SMALL
    src_mesh = jax.sharding.Mesh(np.array(devs).reshape(2, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    values = {f"w{i:05d}": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
              for i in range(count)}
    x = {n: jax.device_put(jnp.asarray(v).view(jnp.bfloat16), NamedSharding(src_mesh, P("x", "y")))
         for n, v in values.items()}
    jax.block_until_ready(x)
    out: dict[str, Any] = {"shape": list(shape), "tensors": count, "orders": {}}
    world = ctx.join(timeout=300)
    try:
        for order in ("same", "reversed"):
            ds = devs if order == "same" else devs[::-1]
            dst = NamedSharding(jax.sharding.Mesh(np.array(ds), ("z",)), P("z"))
            template = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=dst)
            refit = xr.Refit(world, receive={n: template for n in values},
                             config=xr.RefitConfig(timeout=300))
            for _ in range(2):      # the first call plans; a geometry stacks from its second
                refit(send=x)
            got = refit.received
            ok = all(np.asarray(got[n]).view(np.uint16).tobytes() == v.tobytes()
                     and got[n].sharding.is_equivalent_to(dst, 2) for n, v in values.items())
            y = _device_put(jax, x, dst)
            times: dict[str, list[float]] = {"xreshard": [], "device_put": []}
            # CPU seconds of the whole process (every thread: XLA's pool, the wire)
            cpu: dict[str, list[float]] = {"xreshard": [], "device_put": []}
            for _ in range(cfg["reps"]):
                t0, c0 = time.perf_counter(), time.process_time()
                y = _device_put(jax, x, dst)
                times["device_put"].append(time.perf_counter() - t0)
                cpu["device_put"].append(time.process_time() - c0)
                del y
                t0, c0 = time.perf_counter(), time.process_time()
                refit(send=x)
                jax.block_until_ready(refit.received)
                times["xreshard"].append(time.perf_counter() - t0)
                cpu["xreshard"].append(time.process_time() - c0)
            out["orders"][order] = {"bit_exact": bool(ok),
                                    **{k: _summary(v) for k, v in times.items()},
                                    "cpu": {k: _summary(v) for k, v in cpu.items()}}
    finally:
        world.close()
    return out


# ---------------------------------------------------------------------------- torch


def torch_child(ctx: Any, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import xreshard as xr

    torch.set_num_threads(1)
    me = ctx.role.index
    torch_group(ctx, 4, me, "peers")
    mesh = init_device_mesh("cpu", (4,))
    n = cfg["mib"] * MiB // 2
    side = int(np.sqrt(n)) // 4 * 4
    shape = (side, n // side // 4 * 4)
    g = torch.Generator().manual_seed(1)
    full = torch.randint(0, 1 << 15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
    rows = shape[0] // 4
    src = DTensor.from_local(full[me * rows:(me + 1) * rows].clone(), mesh, [Shard(0)],
                             run_check=False)
    cols = shape[1] // 4
    dst_local = torch.zeros((shape[0], cols), dtype=torch.bfloat16)
    dst = DTensor.from_local(dst_local, mesh, [Shard(1)], run_check=False)
    world = ctx.join(timeout=300)
    try:
        refit = xr.Refit(world, send={"w": src}, receive={"w": dst},
                         config=xr.RefitConfig(timeout=300, transport=cfg["transport"]))
        refit()
        want = full[:, me * cols:(me + 1) * cols]
        ok = bool(torch.equal(dst_local.view(torch.int16), want.contiguous().view(torch.int16)))
        r = src.redistribute(mesh, [Shard(1)])
        ok = ok and bool(torch.equal(r.to_local().view(torch.int16),
                                     want.contiguous().view(torch.int16)))
        times: dict[str, list[float]] = {"xreshard": [], "redistribute": []}
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            r = src.redistribute(mesh, [Shard(1)])
            r.to_local()
            dist.barrier()
            times["redistribute"].append(time.perf_counter() - t0)
            del r
            dist.barrier()
            t0 = time.perf_counter()
            refit()
            dist.barrier()
            times["xreshard"].append(time.perf_counter() - t0)
        return {"shape": list(shape), "bit_exact": ok,
                **{k: _summary(v) for k, v in times.items()}}
    finally:
        world.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", choices=("auto", "gloo"), default="auto")
    ap.add_argument("--only", choices=("jax", "torch"), default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tensors", type=int, default=1,
                    help="JAX -> JAX only: this many bf16 arrays of shape SMALL (16, 32) "
                         "instead of one --mib array (the per-tensor cost)")
    args = ap.parse_args()
    cfg = {"mib": args.mib, "reps": args.reps, "transport": args.transport,
           "tensors": args.tensors}
    from xreshard.tools.launch import Role, launch

    res: dict[str, Any] = {"mib": args.mib, "reps": args.reps}
    lines = []
    if args.only in (None, "jax"):
        r = launch("bench_peers:jax_child", [Role("jax", "jax", 0, num_devices=4)],
                   args=(cfg,), timeout=900)[0].value
        res["jax"] = r
        what = (f"{args.tensors} arrays of bf16 {tuple(r['shape'])}" if args.tensors > 1
                else f"bf16 {tuple(r['shape'])} ({args.mib} MiB)")
        lines += [f"JAX -> JAX, one process, 4 CPU devices, {what}, "
                  f"P('x','y') on 2x2 -> P('z') on 4; median (min-max) s:",
                  "", "| device order | jax.device_put | xreshard refit | xreshard / device_put "
                  "| bit-exact |", "|---|---|---|---|---|"]
        # xreshard / device_put: median of paired reps (quartiles); slow: reps over 3x min
        for order, o in r["orders"].items():
            d, x = o["device_put"], o["xreshard"]
            o["ratio"] = _paired(x["all"], d["all"])
            lines.append(f"| {order} | {_cell(d)} | {_cell(x)}, slow {x['slow']}/{args.reps} "
                         f"| **{o['ratio']['median']:.2f}x** ({o['ratio']['q1']:.2f}-"
                         f"{o['ratio']['q3']:.2f}) | {o['bit_exact']} |")
        lines += ["", "CPU s of the process per rep, median (min-max): " + "; ".join(
            f"{order}: device_put {_cell(o['cpu']['device_put'])}, xreshard "
            f"{_cell(o['cpu']['xreshard'])}" for order, o in r["orders"].items()), ""]
    if args.only in (None, "torch"):
        rs = launch("bench_peers:torch_child", [Role("torch", "torch", i) for i in range(4)],
                    args=(cfg,), timeout=900)
        per = [x.value for x in rs]
        # each process timed between barriers: the slowest process is the phase's time
        red = max(p["redistribute"]["median"] for p in per)
        xre = max(p["xreshard"]["median"] for p in per)
        slowest = [[max(p[k]["all"][i] for p in per) for i in range(args.reps)]
                   for k in ("xreshard", "redistribute")]
        ratio = _paired(*slowest)
        res["torch"] = {"processes": per, "redistribute_s": red, "xreshard_s": xre,
                        "ratio": ratio, "bit_exact": all(p["bit_exact"] for p in per)}
        lines += [f"torch DTensor, 4 processes, bf16 {tuple(per[0]['shape'])} ({args.mib} MiB), "
                  f"Shard(0) -> Shard(1); xreshard over `{args.transport}`; median s "
                  "(slowest process):", "",
                  "| DTensor.redistribute (gloo) | xreshard refit | xreshard / redistribute "
                  "| bit-exact |", "|---|---|---|---|",
                  f"| {red:.3f} | {xre:.3f} | **{ratio['median']:.2f}x** ({ratio['q1']:.2f}-"
                  f"{ratio['q3']:.2f}) | {res['torch']['bit_exact']} |"]
    print("\n".join(lines))
    print(f"\nCommand: `python benchmarks/bench_peers.py {' '.join(sys.argv[1:])}`; "
          f"{os.cpu_count()} CPUs")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
