"""A JAX training loop whose refit of step k runs while step k+1 computes.

One JAX process (4 CPU devices, TP=4) trains an MLP of ``--gib`` GiB of float32 weights
(``--layers`` square layers, canonical ``[out, in]``, alternating ``P("tp", None)`` and
``P(None, "tp")``) with plain SGD; two torch processes hold the weights as DTensors (TP=2,
``Shard(0)`` / ``Shard(1)``). Three phases in the same processes:

a. **step alone**: ``params = step(params)`` (blocked until ready);
b. **refit alone**: ``refit(send=params)``;
c. **overlapped**: ``handle = refit.start(send=params_k)``; ``params_k1 = step(params_k)``
   (blocked); ``handle.wait()``: the wall time of step + refit together;

a, b, c in turn, ``--reps`` times (interleaved, so a change of load hits all three).

It prints the medians and ``overlapped / max(step, refit)`` (1.0 is perfect overlap, 2.0 is
none when both take as long). After the last refit every receiver compares a SHA-1 of each
of its local shards with the trainer's digest of that region of the sent weights.

    python benchmarks/bench_overlap.py [--gib 1.0] [--layers 4] [--batch 16] [--reps 3]
                                       [--step-threads N] [--json]

``--step-threads 1`` runs XLA's CPU step on one thread (``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``), so the step leaves the machine's other core to the refit,
as a GPU step leaves the host's cores to it. With the default (XLA uses every core) the step
and the refit compete for the same two cores and the same memory bus here, and the figure
measures that contention, not the refit's ability to run beside a step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
GiB = 2 ** 30
TIMEOUT = 600.0
ROLLOUT = 2


def hidden_of(gib: float, layers: int) -> int:
    return max(256, int((gib * GiB / 4 / layers) ** 0.5) // 256 * 256)


def box(h: int, layer: int, rank: int) -> tuple[slice, slice]:
    """The rollout rank's region of layer ``layer`` (Shard(0) even layers, Shard(1) odd)."""
    part = slice(rank * h // ROLLOUT, (rank + 1) * h // ROLLOUT)
    return (part, slice(None)) if layer % 2 == 0 else (slice(None), part)


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    h, layers, reps = cfg["hidden"], cfg["layers"], cfg["reps"]
    is_trainer = ctx.role.group == "trainer"
    config = xr.RefitConfig(timeout=TIMEOUT, transport=cfg["transport"])
    if not is_trainer:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        torch.set_num_threads(1)
        torch_group(ctx, ROLLOUT, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=TIMEOUT)
    try:
        if not is_trainer:
            mesh = init_device_mesh("cpu", (ROLLOUT,))
            me = ctx.role.index
            locals_ = {}
            state = {}
            for i in range(layers):
                rows, cols = box(h, i, me)
                local = torch.zeros(torch.empty(h, h)[rows, cols].shape)
                locals_[f"w{i}"] = local
                state[f"w{i}"] = DTensor.from_local(local, mesh, [Shard(i % 2)],
                                                    shape=torch.Size((h, h)),
                                                    stride=(h, 1), run_check=False)
            refit = xr.Refit(world, receive=state, config=config)
            for _ in range(1 + 2 * reps):       # warm-up, then refit alone + overlapped per rep
                refit()
            digests = {n: hashlib.sha1(t.numpy().tobytes()).hexdigest()
                       for n, t in locals_.items()}
            want = world.allgather_json({"digests": digests}, timeout=TIMEOUT)[0]["want"]
            return {"bit_exact": want[str(me)] == digests}

        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("tp",))
        shard = [NamedSharding(mesh, P("tp", None) if i % 2 == 0 else P(None, "tp"))
                 for i in range(layers)]
        key = jax.random.PRNGKey(0)
        params = {f"w{i}": jax.device_put(
            jax.random.normal(jax.random.fold_in(key, i), (h, h), jnp.float32) / h ** 0.5,
            shard[i]) for i in range(layers)}
        x = jax.device_put(jax.random.normal(key, (cfg["batch"], h), jnp.float32),
                           NamedSharding(mesh, P()))

        def loss(p, x):
            for i in range(layers):
                x = jnp.tanh(x @ p[f"w{i}"].T)
            return jnp.mean(x ** 2)

        @jax.jit
        def step(p, x):
            g = jax.grad(loss)(p, x)
            return jax.tree_util.tree_map(lambda w, d: w - 0.01 * d, p, g)

        refit = xr.Refit(world, send=params, config=config)
        params = jax.block_until_ready(step(params, x))
        refit(send=params)                                   # plans (warm-up)
        times: dict[str, list[float]] = {"step": [], "refit": [], "overlapped": []}
        sent = params
        for _ in range(reps):           # the three phases interleaved: a load change on
            t0 = time.perf_counter()    # the shared machine hits all three alike
            params = jax.block_until_ready(step(params, x))
            times["step"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            refit(send=params)
            times["refit"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handle = refit.start(send=params)            # step k's weights go out ...
            sent = params
            params = jax.block_until_ready(step(params, x))  # ... while step k+1 runs
            handle.wait()
            times["overlapped"].append(time.perf_counter() - t0)
        want = {}
        for r in range(ROLLOUT):
            want[str(r)] = {}
            for i in range(layers):
                rows, cols = box(h, i, r)
                full = np.asarray(sent[f"w{i}"])
                want[str(r)][f"w{i}"] = hashlib.sha1(
                    np.ascontiguousarray(full[rows, cols]).tobytes()).hexdigest()
        got = world.allgather_json({"want": want}, timeout=TIMEOUT)
        # processes: the trainer, then rollout[0], rollout[1] (group order, then index)
        ok = all(got[1 + r].get("digests") == want[str(r)] for r in range(ROLLOUT))
        return {"times": times, "bit_exact": ok}
    finally:
        world.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transport", default="auto", choices=("auto", "gloo"))
    ap.add_argument("--step-threads", type=int, default=0,
                    help="XLA CPU threads for the step (0: XLA's default, every core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h = hidden_of(args.gib, args.layers)
    cfg = {"hidden": h, "layers": args.layers, "batch": args.batch, "reps": args.reps,
           "transport": args.transport}
    from xreshard.tools.launch import Role, launch
    env = {}
    if args.step_threads:
        env["XLA_FLAGS"] = (f"--xla_cpu_multi_thread_eigen={str(args.step_threads > 1).lower()} "
                            f"intra_op_parallelism_threads={args.step_threads}")
    roles = [Role("jax", "trainer", 0, num_devices=4, env=env)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT)]
    results = launch("bench_overlap:child", roles, args=(cfg,), timeout=1800)
    r = results[0].value
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    ratio = med["overlapped"] / max(med["step"], med["refit"])
    gib = args.layers * h * h * 4 / GiB
    print(f"MLP {args.layers} x [{h}, {h}] float32 = {gib:.2f} GiB, batch {args.batch}; JAX "
          f"TP=4 (1 process, 4 CPU devices) -> torch DTensor TP=2 (2 processes) over "
          f"`{args.transport}`; XLA step threads: {args.step_threads or 'default (every core)'}; "
          f"{args.reps} repetitions, medians (trainer wall time):\n")
    print("| step alone | refit alone | step + refit overlapped | overlapped / max "
          "| overlapped / sum | bit-exact |")
    print("|---|---|---|---|---|---|")
    print(f"| {med['step']:.3f} | {med['refit']:.3f} | {med['overlapped']:.3f} | "
          f"**{ratio:.2f}** | {med['overlapped'] / (med['step'] + med['refit']):.2f} "
          f"| {r['bit_exact']} |")
    print(f"\nCommand: `python benchmarks/bench_overlap.py {' '.join(sys.argv[1:])}`")
    if args.json:
        print(json.dumps({"seconds": med, "overlapped_over_max": ratio,
                          "bit_exact": r["bit_exact"], "gib": gib,
                          "step_threads": args.step_threads}))


if __name__ == "__main__":
    main()
