"""Catch-up from a replica vs a refit from the trainer, for the same engine, side by side.

Engine B (two processes, each its tensor-parallel half of the columns) receives the same
bytes twice, in two worlds on one store:

- ``trainer_refit_seconds``: from the trainer (two processes, rows split), world
  ``trainer+B``;
- ``catchup_seconds``: from engine A (two processes holding the same halves B needs, as a
  replica that is already up to date), world ``A+B``: the trainer is not involved.

Each figure is the median over ``--calls`` warm calls of the call's wall time on B's
processes (the slower of the two), after one warm-up call. Prints one JSON object;
``ratio`` is catch-up / trainer refit.

    python benchmarks/bench_elastic.py [--mib 64] [--calls 5] [--json]

What it does not show: that the other engines' refits go on during a catch-up (in this
version a catch-up is its own world of the two engines; the trainer's world does not wait
for it, but no refit of it runs concurrently here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NAMES = ("a", "b", "c", "d")


def _layout(world: Any, group: str, kind: str, shape: tuple[int, int]) -> Any:
    import xreshard as xr
    ranks = world.group_ranks(group)
    return xr.Layout.from_placements(shape, "float32", xr.Mesh((len(ranks),), ranks),
                                     ["S0" if kind == "rows" else "S1"])


def _timed(refit: Any, calls: int) -> list[float]:
    refit()                         # warm-up: plans, transports
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        refit()
        out.append(time.perf_counter() - t0)
    return out


def member(ctx: Any, spec: dict) -> dict:
    """One process: trainer[i], a[i] (engine A) or b[i] (engine B)."""
    import numpy as np
    import xreshard as xr
    from xreshard.runtime.world import World

    shape = (spec["rows"], 1024)
    group, index = ctx.role.group, ctx.role.index
    config = xr.RefitConfig(timeout=120)
    out: dict[str, Any] = {"role": f"{group}[{index}]"}
    full = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)

    def side(world: Any, send_group: str, recv_group: str, kind: str) -> dict:
        if group == send_group:
            lay = _layout(world, group, kind, shape)
            (rank,) = world.rank_ids
            (region,) = lay.regions(rank)
            arrays = {(rank, n): np.ascontiguousarray(full[region.slices()]) for n in NAMES}
            return {"send": xr.Bound({n: lay for n in NAMES}, arrays)}
        lay = _layout(world, group, "cols", shape)
        (rank,) = world.rank_ids
        arrays = {(rank, n): np.zeros(lay.local_shape(rank), np.float32) for n in NAMES}
        return {"receive": xr.Bound({n: lay for n in NAMES}, arrays)}

    # phase 1: the trainer refits engine B; phase 2: engine A (already up to date: the
    # same halves B holds) fills engine B, without the trainer
    for key, sender, kind, world_id in (("trainer_refit", "trainer", "rows", "trainer+B"),
                                        ("catchup", "a", "cols", "A+B")):
        if group not in (sender, "b"):
            continue
        world = World.join(ctx.address, group, 1, num_processes=4, index=index,
                           groups=[sender, "b"], world_id=world_id, timeout=120)
        refit = xr.Refit(world, config=config, **side(world, sender, "b", kind))
        out[key] = _timed(refit, spec["calls"])
        world.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from xreshard.tools.launch import Role, launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes of engine B's replica, MiB")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args(argv)
    rows = max(args.mib * (1 << 20) // (len(NAMES) * 1024 * 4), 2)
    roles = [Role("plain", g, i) for g in ("trainer", "a", "b") for i in range(2)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_elastic            # children import it by name (this file is __main__ here)
    results = launch(bench_elastic.member, roles, args=({"rows": rows - rows % 2, "calls": args.calls},),
                     timeout=900)
    b = [r.value for r in results if r.value["role"].startswith("b")]
    trainer = statistics.median(max(x) for x in zip(*(v["trainer_refit"] for v in b)))
    catchup = statistics.median(max(x) for x in zip(*(v["catchup"] for v in b)))
    out = {"mib": args.mib, "calls": args.calls, "trainer_refit_seconds": round(trainer, 4),
           "catchup_seconds": round(catchup, 4), "ratio": round(catchup / trainer, 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
