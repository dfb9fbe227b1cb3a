"""Fixed cost of a refit call with many small tensors: layouts remembered vs rebuilt.

A JAX process (4 CPU devices) sends ``--tensors`` tiny float32 tensors (16 x 8,
``P("tp")``) to two torch processes holding DTensors (``Shard(0)``, TP=2). The bytes are
negligible (~1.5 MiB), so a call's time is its fixed cost: binding (a layout per tensor),
the checks, two metadata all-gathers, the executor's bookkeeping. Calls alternate between

* warm: the refit's layout memo (``Refit.layout_memo``) hands back the layouts of the last
  call, as every refit after the first finds it; the warm call timed follows an untimed
  warm one, so it finds what a refit's every call from its third on finds (the send side's
  record of its last bind, ``adapters/jax_replay.py``, made by a call that knew every
  geometry);
* cold: the refit is given a memo that remembers nothing (``tools.testing.ColdMemo``) for
  the call, and its adapters' bind caches are emptied, so every layout is built and every
  tensor bound anew, as before the memo existed,

in the same processes, and the script prints the median of each and their ratio.
``--fresh`` sends new arrays every call (``params + 0``, made outside the timed region),
as a training loop does: each call's arrays and sharding objects are new, only equal.

``--naming`` measures instead, in this process, binding a JAX MoE tree through the vLLM
naming rules (``adapters.jax.bind_named``, what the ``"xreshard"`` trainer engine does every round):
8 layers of 64 stacked experts split over a (ep=4, tp=2) mesh of 8 CPU devices, 1,544 HF
tensors; warm keeps the rule check, layout memo and geometry caches, cold clears them.

    python benchmarks/bench_overhead.py [--tensors 3000] [--reps 5] [--fresh]
    python benchmarks/bench_overhead.py --profile 30 --sort tottime
    python benchmarks/bench_overhead.py --naming      # needs vLLM (the backend module)
    python benchmarks/bench_overhead.py --bind [--fresh]

``--bind`` splits the trainer's share of a warm call, in this process (4 CPU devices, the
same ``--tensors`` arrays): the JAX adapter's bind as the refit runs it (``refit_bind``),
of which the per-shard ``np.asarray`` views alone; the refit's own check of the bound side
(``side_problems``); and freeing the bound side (thousands of views of JAX buffers). CPU
seconds (``time.process_time``), the least of ``--reps`` x 5 calls: on a shared machine
CPU time and minima move least.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import ROOT, torch_group  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPE = (16, 8)


def _calls(refit: Any, side: dict, reps: int, profile: int = 0, sort: str = "cumulative",
           fresh: Any = None, barrier: Any = None) -> dict[str, Any]:
    """Warm and cold calls in turn; ``fresh()`` (when given) makes this call's side anew
    before each call, outside the timed region, and ``barrier()`` then lines the processes
    up so no process times another's preparation."""
    from xreshard.tools.testing import ColdMemo

    out: dict[str, Any] = {"warm": [], "cold": [], "warm_cpu": [], "cold_cpu": []}
    warm_memo, cold_memo = refit.layout_memo, ColdMemo()

    def prepared() -> dict:
        now = side if fresh is None else fresh()
        if barrier is not None:
            barrier()
        return now

    refit(**prepared())                             # plans; the memo fills
    if os.environ.get("BENCH_GC_FREEZE"):
        import gc
        gc.collect()
        gc.freeze()
    if profile:
        import cProfile
        import io
        import pstats
        refit(**prepared())
        now = prepared()
        prof = cProfile.Profile()
        prof.enable()
        refit(**now)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats(sort)
        if sort == "cumulative":
            stats.print_stats("xreshard", profile)
        else:       # own time: other libraries' functions count too
            stats.print_stats(profile)
        out["profile"] = buf.getvalue()
    for _ in range(reps):
        for kind in ("warm", "cold"):
            refit.layout_memo = warm_memo if kind == "warm" else cold_memo
            if kind == "cold":      # and the adapters' bind caches (those this version has)
                for state in getattr(getattr(refit, "_sides", None), "__iter__", list)():
                    for key in ("geometry", "known", "context"):
                        state.cache.pop(key, None)
            else:                   # the warm call timed is one after a warm call, as in
                refit(**prepared())     # a refit's every call from its third on
            now = prepared()
            t0, c0 = time.perf_counter(), time.process_time()
            refit(**now)
            out[kind].append(time.perf_counter() - t0)
            # CPU seconds of this process (all its threads): what a call costs it, less
            # sensitive than wall time to other jobs on a shared machine
            out[kind + "_cpu"].append(time.process_time() - c0)
    return out


#: the steps of a call ``--phases`` times (methods of ``Refit``), in call order
PHASES = ("_bind_sides", "_prepare", "_move", "_commit")


def _time_phases(refit: Any) -> dict[str, list]:
    """Wrap the refit's steps so each call appends (wall, CPU) seconds per step; the rest
    of a call (freeing its objects, the world's entry and exit) is its total minus them."""
    out: dict[str, list] = {p: [] for p in PHASES}
    for phase in PHASES:
        inner = getattr(refit, phase)

        def timed(*args: Any, _inner: Any = inner, _phase: str = phase) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return _inner(*args)
            finally:
                out[_phase].append((time.perf_counter() - t0, time.process_time() - c0))
        setattr(refit, phase, timed)
    return out


def child(ctx: Any, n: int, reps: int, profile: int = 0, sort: str = "cumulative",
          fresh: bool = False, phases: bool = False) -> dict[str, Any]:
    import numpy as np
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    if ctx.role.group == "trainer":
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((4,), ("tp",), devices=jax.local_devices())
        value = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
        side = {"send": {f"t{i}": jax.device_put(value, NamedSharding(mesh, P("tp")))
                         for i in range(n)}}
    else:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        torch_group(ctx, 2, ctx.role.index, "rollout")
        mesh = init_device_mesh("cpu", (2,))
        local = torch.zeros((SHAPE[0] // 2, SHAPE[1]))
        side = {"receive": {f"t{i}": DTensor.from_local(local.clone(), mesh, [Shard(0)],
                                                         run_check=False) for i in range(n)}}
    make = None
    if fresh and ctx.role.group == "trainer":
        # a training step's output: new arrays (and new, equal sharding objects) each call
        params = side["send"]

        def make() -> dict:
            return {"send": jax.block_until_ready(jax.tree.map(lambda a: a + 0, params))}
    elif fresh:
        def make() -> dict:
            return side
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=300), **side)
    try:
        steps = _time_phases(refit) if phases else None
        out = _calls(refit, side, reps, profile, sort, fresh=make,
                     barrier=(lambda: world.barrier(timeout=300)) if fresh else None)
        if steps is not None:       # the timed warm calls': after the first (and
            first = 3 if profile else 1     # --profile's two), calls go in threes: warm
            out["phases"] = {p: v[first + 1::3] for p, v in steps.items()}  # (untimed),
            # warm, cold
        # one metadata round trip (what refit/check and refit/outcome each cost)
        world.barrier(timeout=300)
        out["round_trip"] = []
        for _ in range(20):
            t0 = time.perf_counter()
            world.allgather_json({"errors": []}, timeout=300, kind="bench/rtt")
            out["round_trip"].append(time.perf_counter() - t0)
        return out
    finally:
        world.close()


def naming(reps: int) -> None:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters import naming as vb  # vb: where the naming rules keep their caches
    from xreshard.adapters.jax import bind_named
    from xreshard.adapters.naming import NameMap, jax_llama_rules, jax_moe_rules
    from xreshard.ir.layout import LayoutMemo
    from xreshard.tools.testing import ColdMemo

    E, D, I, L = 64, 64, 32, 8
    mesh = jax.make_mesh((4, 2), ("ep", "tp"))

    def put(shape: tuple, spec: tuple) -> Any:
        return {"kernel": jax.device_put(np.zeros(shape, np.float32),
                                         NamedSharding(mesh, P(*spec)))}
    tree = {"layers": [{"moe": {"gate": put((E, D, I), ("ep", None, "tp")),
                                "up": put((E, D, I), ("ep", None, "tp")),
                                "down": put((E, I, D), ("ep", "tp", None)),
                                "router": put((D, E), (None, None))}} for _ in range(L)]}
    names = NameMap(jax_llama_rules() + jax_moe_rules())
    ranks = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    warm_memo, cold_memo = LayoutMemo(), ColdMemo()
    bind = bind_named
    bind(tree, names, ranks, memo=warm_memo)
    for _ in range(reps):
        for kind in ("warm", "cold"):
            if kind == "cold":      # whichever of the backend's caches this version has
                getattr(vb, "_CHECKED", {}).clear()
                for f in ("_select", "_slice", "_permuted", "_reshape"):
                    getattr(getattr(vb, f, None), "cache_clear", lambda: None)()
            t0 = time.perf_counter()
            bound = bind(tree, names, ranks, memo=warm_memo if kind == "warm" else cold_memo)
            times[kind].append(time.perf_counter() - t0)
    warm, cold = statistics.median(times["warm"]), statistics.median(times["cold"])
    print(f"bind_named, {len(bound.layouts)} HF tensors from {L} layers x {E} experts on "
          f"(ep=4, tp=2), {reps} calls of each kind (median seconds per call)\n")
    print("| warm (caches on) | cold (rebuilt) | cold / warm |")
    print("|---|---|---|")
    print(f"| {warm:.3f} | {cold:.3f} | {cold / warm:.1f}x |")


def bind_split(n: int, reps: int, fresh: bool) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters import jax as xjax
    from xreshard.ir.layout import LayoutMemo
    from xreshard.runtime.binding import side_problems
    from xreshard.runtime.registry import BindContext

    mesh = jax.make_mesh((4,), ("tp",), devices=jax.local_devices())
    value = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    tree = {f"t{i}": jax.device_put(value, NamedSharding(mesh, P("tp"))) for i in range(n)}
    ranks = {d.id: i for i, d in enumerate(jax.local_devices())}
    context = BindContext(ranks=ranks, local_ranks=(0, 1, 2, 3), memo=LayoutMemo(), cache={})
    times: dict[str, list[float]] = {"bind": [], "views": [], "check": [], "free": []}
    xjax.refit_bind(tree, "send", context)
    for _ in range(reps * 5):
        now = jax.block_until_ready(jax.tree.map(lambda a: a + 0, tree)) if fresh else tree
        c0 = time.process_time()
        bound = xjax.refit_bind(now, "send", context)
        c1 = time.process_time()
        problems = side_problems({"send": bound, "receive": None}, [0, 1, 2, 3],
                                 lambda r: r < 4, None)
        c2 = time.process_time()
        del bound
        c3 = time.process_time()
        views = [np.asarray(x) for a in now.values() for x in a._arrays]
        c4 = time.process_time()
        assert not problems, problems
        del views
        for k, t in zip(times, (c1 - c0, c4 - c3, c2 - c1, c3 - c2)):
            times[k].append(t)
    print(f"{n} tensors of {SHAPE} float32 on 4 CPU devices, "
          f"{'new arrays every call' if fresh else 'the same arrays'}: least CPU ms of "
          f"{reps * 5} calls\n")
    print("| bind (refit_bind) | of it: np.asarray views | check (side_problems) | free |")
    print("|---|---|---|---|")
    print("| " + " | ".join(f"{min(times[k]) * 1e3:.1f}" for k in times) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--naming", action="store_true",
                    help="bind a JAX MoE tree through the vLLM naming rules, in this process")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the top N functions of one warm call (cProfile in each "
                         "process)")
    ap.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime"),
                    help="--profile order: cumulative (xreshard's functions) or own time "
                         "(every function)")
    ap.add_argument("--fresh", action="store_true",
                    help="send new JAX arrays every call (params + 0, made outside the timed "
                         "region, then a barrier), as a training loop does")
    ap.add_argument("--phases", action="store_true",
                    help="also print each process's warm call step by step (bind, prepare "
                         "with its check all-gather, move, commit with its outcome "
                         "all-gather), wall and CPU ms, medians")
    ap.add_argument("--bind", action="store_true",
                    help="split the trainer's binding and check, in this process")
    args = ap.parse_args()
    if args.bind:
        return bind_split(args.tensors, args.reps, args.fresh)
    if args.naming:
        return naming(args.reps)
    from xreshard.tools.launch import Role, launch

    roles = [Role("jax", "trainer", 0, num_devices=4),
             Role("torch", "rollout", 0), Role("torch", "rollout", 1)]
    results = launch("bench_overhead:child", roles,
                     args=(args.tensors, args.reps, args.profile, args.sort, args.fresh,
                           args.phases),
                     timeout=900)
    print(f"{args.tensors} tensors of {SHAPE} float32, JAX TP=4 -> torch TP=2, "
          f"{'new JAX arrays every call, ' if args.fresh else ''}"
          f"{args.reps} calls of each kind (median seconds per call)\n")
    print("| process | warm (memo on) | cold (memo off: layouts rebuilt) | cold / warm "
          "| warm, CPU s | cold, CPU s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        warm, cold = statistics.median(r.value["warm"]), statistics.median(r.value["cold"])
        print(f"| {r.role.group}[{r.role.index}] | {warm:.3f} | {cold:.3f} | "
              f"{cold / warm:.2f}x | {statistics.median(r.value['warm_cpu']):.3f} "
              f"| {statistics.median(r.value['cold_cpu']):.3f} |")
    rtt = max(statistics.median(r.value["round_trip"]) for r in results)
    print(f"\nOne metadata all-gather (a store round trip, what refit/check and refit/outcome "
          f"each cost): {rtt * 1e3:.2f} ms (median of 20, slowest process)")
    if args.phases:
        print("\nThe warm call step by step, wall / CPU ms (medians; 'rest' is the call's "
              "total minus the steps: freeing the call, entering and leaving the world)\n")
        print("| process | " + " | ".join(PHASES) + " | rest |")
        print("|---|" + "---|" * (len(PHASES) + 1))
        for r in results:
            ph, cells = r.value["phases"], []
            for p in PHASES:
                cells.append(f"{statistics.median(w for w, _ in ph[p]) * 1e3:.1f} / "
                             f"{statistics.median(c for _, c in ph[p]) * 1e3:.1f}")
            # the first warm call (index 1 of the sequence) is after the plan call
            walls = [sum(ph[p][i][0] for p in PHASES) for i in range(len(ph[PHASES[0]]))]
            cpus = [sum(ph[p][i][1] for p in PHASES) for i in range(len(ph[PHASES[0]]))]
            rest_w = statistics.median(r.value["warm"]) - statistics.median(walls)
            rest_c = statistics.median(r.value["warm_cpu"]) - statistics.median(cpus)
            cells.append(f"{rest_w * 1e3:.1f} / {rest_c * 1e3:.1f}")
            print(f"| {r.role.group}[{r.role.index}] | " + " | ".join(cells) + " |")
    for r in results:
        if r.value.get("profile"):
            print(f"\n{r.role.group}[{r.role.index}]:\n{r.value['profile']}")


if __name__ == "__main__":
    main()
