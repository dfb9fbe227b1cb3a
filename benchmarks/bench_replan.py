"""Replanning after one engine leaves an elastic world: a full replan against the
incremental one (templates carried through the ranks' renumbering), side by side.

A trainer (``--trainer`` recipe, ranks first) feeds ``--engines`` inference engines
(``--engine`` recipe each, ranks after the trainer's, engine by engine). Engine 0 leaves:
every later engine's ranks shift down, as an elastic world renumbers them (group order,
then index). Two ways a fleet refits its engines:

- ``per_engine``: one ``Refit`` per engine (each engine updated on its own schedule): after
  the change every surviving engine's tensors have the same layouts once renumbered, so
  the incremental replan reuses every template;
- ``one_refit``: one ``Refit`` over every engine (each tensor's destination spans every
  engine's replica): every tensor's destination layout changed, nothing is reused, and
  the incremental replan costs what the full one does.

For each: CPU seconds of ``prepare`` (for trainer rank 0's process, as its ``Refit``
prepares) in the new epoch with a fresh cache (``full``) and
with the old epoch's cache renumbered (``incremental``, ``PlanCache.renumber``), the
tensors planned and reused, and ``ratio`` = incremental / full (the least of 3 alternated
runs each); plans of both are checked
equal (bytes moved per rank). CPU time of this single-threaded process (wall time is
inflated on a shared machine). Prints one JSON object.

    python benchmarks/bench_replan.py [--model qwen3_30b_a3b] [--engines 4] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from xreshard.catalog.models import load_model             # noqa: E402
from xreshard.catalog.recipes import parse_recipe, recipe_layouts  # noqa: E402
from xreshard.planner.plan import PlanCache                # noqa: E402
from xreshard.planner.prepare import CallOptions, prepare  # noqa: E402


#: the ranks whose schedule ``prepare`` builds: one process's (trainer rank 0, which sends
#: to every engine), as a ``Refit`` prepares for its own process's ranks
RANKS = (0,)
REPEAT = 3


def _prepared(src: dict, dst: dict, cache: PlanCache) -> tuple[Any, float, tuple[int, int]]:
    before = (cache.tensors_planned, cache.tensors_reused)
    ranks = RANKS
    gc.collect()
    gc.disable()        # a collection triggered by the previous run's garbage is noise here
    try:
        t0 = time.process_time()
        prepared = prepare(src, dst, None, CallOptions(), ranks=ranks, cache=cache)
        seconds = time.process_time() - t0
    finally:
        gc.enable()
    return prepared, seconds, (cache.tensors_planned - before[0],
                               cache.tensors_reused - before[1])


def _case(old_pairs: list[tuple[dict, dict]], new_pairs: list[tuple[dict, dict]],
          ranks: dict[int, int]) -> dict[str, Any]:
    """Prepare each (src, dst) pair of the old epoch, then of the new one both ways."""
    caches = []
    for src, dst in old_pairs:
        cache = PlanCache()
        _prepared(src, dst, cache)
        cache.renumber(ranks)
        caches.append(cache)
    full = incremental = 0.0
    planned = reused = 0
    for (src, dst), cache in zip(new_pairs, caches):
        times: dict[str, list[float]] = {"full": [], "incremental": []}
        for _ in range(REPEAT):         # alternated, the least of each: less noise
            fresh, seconds, _ = _prepared(src, dst, PlanCache())
            times["full"].append(seconds)
            carried = PlanCache()
            carried.templates = dict(cache.templates)
            again, seconds, (p, r) = _prepared(src, dst, carried)
            times["incremental"].append(seconds)
        full += min(times["full"])
        incremental += min(times["incremental"])
        planned, reused = planned + p, reused + r
        assert again.plan.stats.bytes_sent == fresh.plan.stats.bytes_sent
        assert again.plan.stats.bytes_received == fresh.plan.stats.bytes_received
    return {"full_seconds": round(full, 3), "incremental_seconds": round(incremental, 3),
            "ratio": round(incremental / max(full, 1e-9), 3),
            "tensors_planned": planned, "tensors_reused": reused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--trainer", default="fsdp:dp=8")
    ap.add_argument("--engine", default="vllm:tp=2")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="one JSON line only")
    args = ap.parse_args()
    model = load_model(args.model)
    trainer, engine = parse_recipe(args.trainer), parse_recipe(args.engine)
    t, e, n = trainer.world_size, engine.world_size, args.engines
    if not args.json:
        print(f"{args.model}: trainer {args.trainer} ({t} ranks), {n} engines {args.engine} "
              f"({e} ranks each); engine 0 leaves", file=sys.stderr)
    src = recipe_layouts(model, trainer, 0)
    old_src, new_src = src, src          # the trainer's ranks come first: they stay
    per_old = [(old_src, recipe_layouts(model, engine, t + e * k)) for k in range(n)]
    per_new = [(new_src, recipe_layouts(model, engine, t + e * k)) for k in range(n - 1)]
    ranks = {r: r for r in range(t)}
    ranks.update({r: r - e for r in range(t + e, t + e * n)})
    out: dict[str, Any] = {"model": args.model, "trainer": args.trainer,
                           "engine": args.engine, "engines": n,
                           "tensors": len(src)}
    # engine 0 left: engines 1..n-1 are the new epoch's engines 0..n-2
    out["per_engine"] = _case(per_old[1:], per_new, ranks)
    both = parse_recipe(f"{args.engine},dp={n}"), parse_recipe(f"{args.engine},dp={n - 1}")
    out["one_refit"] = _case([(old_src, recipe_layouts(model, both[0], t))],
                             [(new_src, recipe_layouts(model, both[1], t))], ranks)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
