"""Staging memory of a refit stays within ``staging_bytes``: peak RSS growth per process.

A JAX process (4 CPU devices, TP=4) sends a float32 model (default 512 MiB) to two torch
processes holding DTensors (TP=2) with every region non-contiguous on one side:

- half the tensors are ``P("tp", None)`` in JAX and ``Shard(1)`` in torch: the trainer
  reads ``[rows of its shard, half the columns]``, a strided view, so it *packs*;
- the other half are ``P(None, "tp")`` in JAX and ``Shard(0)`` in torch: the receiver
  writes a quarter of the columns of each row, so it *unpacks*.

The same refit runs under a small budget (``staging_bytes=8 MiB, bucket_bytes=4 MiB``) and
a large one (1 GiB / 1 GiB), each in fresh processes. In each process, the growth of the
resident set during the refit is the kernel's peak (``VmHWM``, reset through
``/proc/self/clear_refs`` right before the call) minus ``VmRSS`` right before it. The
destination tensors are filled before (their pages are already resident), and a tiny refit
first loads the adapters and creates the gloo group, so the growth is staging plus
whatever else the call allocates. The budget is per rank: a process hosting ``n`` ranks
may stage up to ``n x staging_bytes`` (the trainer hosts 4).

    python benchmarks/bench_staging.py [--mib 512] [--small 8,4] [--large 1024,1024]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import (MiB, ROOT, TIMEOUT, bits, pattern, torch_group)  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TRAINER_TP = 4
ROLLOUT_TP = 2
NUM_TENSORS = 8


def model_specs(mib: float) -> list[tuple[str, tuple[int, int], int, int]]:
    """``(name, shape, JAX split dim, torch split dim)``: square float32 matrices."""
    side = int(math.sqrt(mib * MiB / 4 / NUM_TENSORS)) // 64 * 64
    out = []
    for i in range(NUM_TENSORS):
        if i % 2 == 0:
            out.append((f"layers.{i}.rows_to_cols.weight", (side, side), 0, 1))
        else:
            out.append((f"layers.{i}.cols_to_rows.weight", (side, side), 1, 0))
    return out


def box(shape, dim: int, parts: int, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    starts, stops = [0] * len(shape), list(shape)
    step = shape[dim] // parts
    starts[dim], stops[dim] = i * step, (i + 1) * step
    return tuple(starts), tuple(stops)


def jax_params(specs, dtype: str) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((TRAINER_TP,), ("tp",), devices=jax.local_devices())
    params = {}
    for k, (name, shape, jdim, _) in enumerate(specs):
        spec = [None] * len(shape)
        spec[jdim] = "tp"
        sharding = NamedSharding(mesh, P(*spec))
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            starts = tuple(s.start or 0 for s in index)
            stops = tuple(n if s.stop is None else s.stop for s, n in zip(index, shape))
            arrays.append(jax.device_put(pattern(k, starts, stops, dtype), device))
        params[name] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return params


def dtensors(specs, dtype: str, fill: float) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ROLLOUT_TP,))
    me = torch.distributed.get_rank()
    out = {}
    for name, shape, _, tdim in specs:
        starts, stops = box(shape, tdim, ROLLOUT_TP, me)
        local = torch.full(tuple(b - a for a, b in zip(starts, stops)), fill,
                           dtype=getattr(torch, dtype))
        out[name] = DTensor.from_local(local, mesh, [Shard(tdim)], shape=torch.Size(shape),
                                       stride=(shape[1], 1), run_check=False)
    return out


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measured_call(world: Any, refit: Any) -> tuple[Any, int, float]:
    """One refit call: (report, peak RSS growth in bytes, seconds)."""
    world.barrier(timeout=TIMEOUT)
    before = proc_status()["VmRSS"]
    if not reset_peak():
        raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs on this system")
    t0 = time.perf_counter()
    report = refit()
    seconds = time.perf_counter() - t0
    peak = proc_status()["VmHWM"]
    return report, peak - before, seconds


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    is_trainer = ctx.role.group == "trainer"
    dtype = "float32"
    specs = model_specs(cfg["mib"])
    tiny = [("warmup.weight", (64, 64), 0, 1)]
    if not is_trainer:
        import torch
        torch.set_num_threads(1)
        torch_group(ctx, ROLLOUT_TP, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=TIMEOUT)
    config = xr.RefitConfig(staging_bytes=cfg["staging_mib"] * MiB,
                            bucket_bytes=cfg["bucket_mib"] * MiB, timeout=TIMEOUT)
    # a tiny refit first: imports the adapters, creates the gloo group
    if is_trainer:
        xr.Refit(world, send=jax_params(tiny, dtype), config=config)()
        params = jax_params(specs, dtype)
        refit = xr.Refit(world, send=params, config=config)
    else:
        xr.Refit(world, receive=dtensors(tiny, dtype, 1.0), config=config)()
        state = dtensors(specs, dtype, 1.0)
        refit = xr.Refit(world, receive=state, config=config)
    first, grow1, sec1 = measured_call(world, refit)
    if not is_trainer:
        from xreshard.adapters.torch import tensor_view
        me = ctx.role.index
        for k, (name, shape, _, tdim) in enumerate(specs):
            want = pattern(k, *box(shape, tdim, ROLLOUT_TP, me), dtype)
            if not np.array_equal(bits(tensor_view(state[name].to_local())), bits(want)):
                raise AssertionError(f"{name} on rollout[{me}] holds wrong bytes")
    second, grow2, sec2 = measured_call(world, refit)
    mine = {
        "label": world.describe_process(world.process_index).split(" (")[0],
        "num_ranks": len(world.rank_ids),
        "first_growth": grow1, "second_growth": grow2,
        "first_s": sec1, "second_s": sec2, "exec_staging": second.staging_bytes,
        "rounds": second.num_rounds, "messages": second.num_messages,
        "zero_copy": second.num_zero_copy,
        "sent": second.bytes_sent, "received": second.bytes_received,
        "max_round_bytes": refit.prepared.schedule.max_round_bytes,
    }
    everyone = world.allgather_json(mine, timeout=TIMEOUT)
    world.close()
    if not is_trainer:
        import torch.distributed as dist
        dist.destroy_process_group()
    return {"processes": everyone}


def run(cfg: dict, timeout: float) -> list[dict]:
    from xreshard.tools.launch import Role, launch
    roles = [Role("jax", "trainer", 0, num_devices=TRAINER_TP)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT_TP)]
    results = launch("bench_staging:child", roles, args=(cfg,), timeout=timeout)
    return results[0].value["processes"]


def pair(text: str) -> tuple[int, int]:
    a, b = text.split(",")
    return int(a), int(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=512, help="model size in MiB (float32)")
    ap.add_argument("--small", type=pair, default=(8, 4), help="staging,bucket MiB")
    ap.add_argument("--large", type=pair, default=(1024, 1024), help="staging,bucket MiB")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    specs = model_specs(args.mib)
    model = sum(math.prod(s) for _, s, _, _ in specs) * 4
    command = "python " + " ".join(sys.argv)
    t0 = time.perf_counter()
    rows = []
    for label, (staging, bucket) in (("small", args.small), ("large", args.large)):
        cfg = {"mib": args.mib, "staging_mib": staging, "bucket_mib": bucket}
        for p in run(cfg, args.timeout):
            rows.append((label, staging, bucket, p))
    print(f"Model: {NUM_TENSORS} float32 [{specs[0][1][0]}, {specs[0][1][1]}] tensors, "
          f"{model / MiB:.0f} MiB; half P('tp', None) -> Shard(1) (trainer packs), half "
          f"P(None, 'tp') -> Shard(0) (receivers unpack); JAX TP={TRAINER_TP} (1 process) -> "
          f"torch TP={ROLLOUT_TP} (2 processes). Growth = peak RSS (VmHWM) - RSS before the "
          f"call; destination tensors already resident.")
    print()
    print("| budget (staging / bucket) | process | ranks | budget x ranks MiB | executor "
          "staging_bytes MiB | peak RSS growth, 1st call MiB | growth - staging MiB "
          "| peak RSS growth, 2nd call MiB | rounds | sends (zero-copy posts) | 2nd call s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, staging, bucket, p in rows:
        budget = staging * p["num_ranks"]
        print(f"| {label}: {staging} / {bucket} MiB | {p['label']} | {p['num_ranks']} "
              f"| {budget} | {p['exec_staging'] / MiB:.1f} | {p['first_growth'] / MiB:.1f} "
              f"| {(p['first_growth'] - p['exec_staging']) / MiB:+.1f} "
              f"| {p['second_growth'] / MiB:.1f} | {p['rounds']} | {p['messages']} "
              f"({p['zero_copy']}) | {p['second_s']:.3f} |")
    print()
    over = [(label, p["label"]) for label, staging, _, p in rows
            if p["exec_staging"] > staging * MiB * p["num_ranks"]
            or p["first_growth"] > staging * MiB * p["num_ranks"] + 16 * MiB]
    print("Within budget (executor staging <= budget x ranks, RSS growth <= that + 16 MiB): "
          + ("yes, every process" if not over else f"NO: {over}"))
    print()
    print(f"Command: `{command}`")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; whole run "
          f"{time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
