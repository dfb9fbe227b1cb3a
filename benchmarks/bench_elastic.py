"""Catch-up from a replica vs a refit from the trainer, for the same engine, side by side,
in one elastic world; and the other engine's refits while the catch-up runs.

One elastic world of six processes: the trainer (trainer[0..1], rows of four float32
tensors), engine A (rollout[0..1]) and engine B (rollout[2..3]), each engine process its
tensor-parallel half of the columns (so each engine is a whole replica).

1. ``trainer_refit_seconds``: the trainer refits both engines, ``--calls`` warm calls;
   the figure is the median over calls of B's call time (the slower of its two processes).
2. B's processes leave the world (``world.leave()``); the trainer refits A alone,
   ``--calls`` calls: ``other_refit_seconds_baseline`` (A's median call time).
3. The trainer and A go on refitting in a loop, ``--step`` seconds apart (an optimizer
   step; a catch-up that starts during one of A's calls waits for its end: the snapshot
   is of a completed version). Meanwhile B's processes join again with
   ``World.join(elastic=True, wait=False)`` and run ``refit.catch_up()`` ``--calls``
   times, each after a random 0-``--step`` s (an engine comes up at any moment of the
   trainer's cycle; the i-th of both processes about at once): ``catchup_seconds`` is
   the median over them of the slower process's ``catch_up()`` wall time (its whole
   cost: the catch-up world with A's processes where not formed yet, their snapshots,
   the move), with ``catchup_move_seconds`` the move alone, and
   ``catchup_first_seconds`` the first one (the slower process's): B's Refit, made
   before the random wait, forms its catch-up world meanwhile (``catchup.ahead``), and
   the later catch-ups reuse it. The catch-ups come from A's replicas: B's
   bytes received are checked to equal its regions, and each catch-up bit-exact at the
   version it reports. A's calls that overlap a catch-up give
   ``other_refit_seconds_during_catchup`` (median) and ``other_refits_during_catchup``
   (count): A is not paused if they keep completing at about the baseline time.
4. B's processes call ``refit()``: the members' next call admits them, and one more call
   with all six is checked bit-exact on B. ``trainer_first_refit_seconds``: B's first
   call in the world (the slower process; what an engine that does not catch up waits
   for, once the trainer's next refit comes: a new epoch, plans and transports made again).

Prints one JSON object; ``ratio`` is catchup_seconds / trainer_refit_seconds,
``first_ratio`` catchup_first_seconds / trainer_refit_seconds.

    python benchmarks/bench_elastic.py [--mib 64] [--calls 5] [--step 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NAMES = ("a", "b", "c", "d")
GROUPS = ["trainer", "rollout"]
TP = 2


class Side:
    """One process's side, rebuilt per epoch from the world (ranks renumber); receivers
    keep their arrays while their region stays."""

    def __init__(self, trainer: bool, shape: tuple[int, int]):
        self.trainer, self.shape = trainer, shape
        self.version = 0
        self.arrays: dict[str, Any] = {}
        self.region: Any = None

    def build(self, world: Any) -> Any:
        import numpy as np
        import xreshard as xr
        rows, half = self.shape[0] // 2, self.shape[1] // TP
        src, dst = {}, {}
        for info in world.processes:
            k, rank = info["index"], info["ranks"][0]
            if info["group"] == "trainer":
                src[rank] = [xr.Region((k * rows, 0), ((k + 1) * rows, self.shape[1]))]
            else:
                dst[rank] = [xr.Region((0, (k % TP) * half), (self.shape[0], (k % TP + 1) * half))]
        lay = xr.Layout.explicit_form(self.shape, "float32", src if self.trainer else dst)
        (rank,) = world.rank_ids
        (region,) = lay.regions(rank)
        if self.trainer or self.region != region:
            fill = float(self.version) if self.trainer else 0.0
            self.arrays = {n: np.full(region.shape, fill, np.float32) for n in NAMES}
        self.region = region
        return xr.Bound({n: lay for n in NAMES}, {(rank, n): [a] for n, a in self.arrays.items()})

    def exact(self, version: int) -> bool:
        import numpy as np
        want = np.full(self.region.shape, float(version), np.float32).tobytes()
        return all(a.tobytes() == want for a in self.arrays.values())


def _call(refit: Any, side: Side) -> tuple[float, float]:
    side.version = refit.version + 1
    t0 = time.time()
    refit()
    return t0, time.time()


def _wait_file(path: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def member(ctx: Any, spec: dict) -> dict:
    """One process: trainer[k], rollout[0..1] (engine A) or rollout[2..3] (engine B)."""
    import xreshard as xr

    group, index = ctx.role.group, ctx.role.index
    trainer, engine_b = group == "trainer", group == "rollout" and index >= TP
    config = xr.RefitConfig(timeout=120)
    side = Side(trainer, (spec["rows"], 1024))
    who = "send" if trainer else "receive"
    world = ctx.join(elastic=True, groups=GROUPS, timeout=120)
    refit = xr.Refit(world, config=config, **{who: xr.Rebuilt(side.build)})
    out: dict[str, Any] = {"role": f"{group}[{index}]"}
    _call(refit, side)                                      # warm-up: plans, transports
    out["trainer_refit"] = [b - a for a, b in (_call(refit, side)
                                               for _ in range(spec["calls"]))]
    if engine_b:
        world.leave()
        _wait_file(spec["baseline_done"])
        world = ctx.join(elastic=True, groups=GROUPS, timeout=120, wait=False)
        refit = xr.Refit(world, config=config, receive=xr.Rebuilt(side.build))
        catchups = []
        rng = random.Random(index)
        for _ in range(spec["calls"]):     # an engine starts at any moment of a step
            time.sleep(rng.uniform(0, spec["step"]))
            t0 = time.time()
            report = refit.catch_up()
            catchups.append({"start": t0, "end": time.time(), "move": report.seconds,
                             "version": report.version, "exact": side.exact(report.version),
                             "bytes": report.bytes_received,
                             "expected": 4 * side.region.size * len(NAMES)})
        out["catchup"] = catchups
    else:
        _call(refit, side)                  # loses B (left): a new epoch
        out["baseline"] = [b - a for a, b in (_call(refit, side)
                                              for _ in range(spec["calls"]))]
        if out["role"] == "trainer[0]":
            with open(spec["baseline_done"], "w"):
                pass
        out["during"] = []
        while len(world.members) < 6:       # B's processes ask in after their catch-ups
            out["during"].append(_call(refit, side))
            time.sleep(spec["step"])        # the trainer's optimizer step
    while len(world.members) < 6:           # B: admitted at the members' next call
        side.version = refit.version + 1
        first = refit()
        out.setdefault("first_refit", first.seconds)    # B's first call from the trainer
    _call(refit, side)                      # all six
    out["final_exact"] = side.exact(refit.version) if not trainer else True
    out["final_version"] = refit.version
    world.close()
    return out


def summarize(values: list[dict], calls: int) -> dict:
    """The figures, from every process's value."""
    b = [v for v in values if v["role"] in ("rollout[2]", "rollout[3]")]
    a = [v for v in values if v["role"] in ("rollout[0]", "rollout[1]")]
    trainer = statistics.median(max(x) for x in zip(*(v["trainer_refit"] for v in b)))
    pairs = list(zip(*(v["catchup"] for v in b)))
    catchup = statistics.median(max(c["end"] - c["start"] for c in p) for p in pairs)
    move = statistics.median(max(c["move"] for c in p) for p in pairs)
    first = max(c["end"] - c["start"] for c in pairs[0])
    windows = [(min(c["start"] for c in p), max(c["end"] for c in p)) for p in pairs]
    during = [e - s for v in a for s, e in v["during"]
              if any(s < we and e > ws for ws, we in windows)]
    baseline = statistics.median(x for v in a for x in v["baseline"])
    caught = [c for v in b for c in v["catchup"]]
    return {
        "mib": None, "calls": calls,
        "trainer_refit_seconds": round(trainer, 4), "catchup_seconds": round(catchup, 4),
        "ratio": round(catchup / trainer, 3), "catchup_move_seconds": round(move, 4),
        "catchup_first_seconds": round(first, 4), "first_ratio": round(first / trainer, 3),
        "trainer_first_refit_seconds": round(max(v["first_refit"] for v in b), 4),
        "catchups_exact": sum(c["exact"] and c["bytes"] == c["expected"] for c in caught),
        "catchups": len(caught),
        "other_refit_seconds_baseline": round(baseline, 4),
        "other_refit_seconds_during_catchup": round(statistics.median(during), 4)
        if during else None,
        "other_refits_during_catchup": len(during) // max(len(a), 1),
        "final_exact": all(v["final_exact"] for v in values),
    }


def main(argv: list[str] | None = None) -> int:
    from xreshard.tools.launch import Role, launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes of one engine's replica, MiB")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--step", type=float, default=0.5,
                    help="seconds between the trainer's refits of engine A during the "
                         "catch-ups (an optimizer step; 0: back to back)")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args(argv)
    rows = max(args.mib * (1 << 20) // (len(NAMES) * 1024 * 4), 2)
    roles = [Role("plain", "trainer", i) for i in range(2)] + \
        [Role("plain", "rollout", i) for i in range(2 * TP)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_elastic            # children import it by name (this file is __main__ here)
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        spec = {"rows": rows - rows % 2, "calls": args.calls, "step": args.step,
                "baseline_done": os.path.join(tmp, "baseline")}
        results = launch(bench_elastic.member, roles, args=(spec,), timeout=900)
    out = summarize([r.value for r in results], args.calls)
    out["mib"], out["step"] = args.mib, args.step
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if out["final_exact"] and out["catchups_exact"] == out["catchups"] else 1


if __name__ == "__main__":
    sys.exit(main())
