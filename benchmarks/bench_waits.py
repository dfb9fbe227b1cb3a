"""What watching a wait costs: metadata all-gathers with the watched wait vs TCPStore's own.

A collective's wait (``xreshard.runtime.waiting.wait_for``) blocks in the store's own
``wait`` for its first second, then polls (``check``, every 50 ms) so that it can look for
processes that will not come and name the missing ones (issues 30.9, 34.1). The store's
own ``wait`` alone returns the moment the last key lands but cannot look around. (An
earlier draft polled from the start, with pauses of a tenth of the time waited: 1.6x per
all-gather at skew 0 on the loaded 2-core machine.) Three plain processes run ``--calls``
all-gathers per round, alternating rounds between the two waits in the same processes,
with process 0 arriving ``--skew`` ms late (0: everyone at once, the common case of a
refit's ``refit/check``; a few ms: the others really wait; 1500: past the first second,
the polled part). Prints the median per all-gather of each and their ratio.

    python benchmarks/bench_waits.py [--calls 200] [--rounds 6] [--skew 0 5]
    python benchmarks/bench_waits.py --calls 5 --rounds 4 --skew 1500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import ROOT  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child(ctx, calls: int, rounds: int, skews: list) -> dict:
    from xreshard.runtime import waiting
    from xreshard.runtime.store import wait_keys

    watched = waiting.wait_for

    def native(store, keys, readers, deadline, reporter, describe, stop):
        return wait_keys(store, keys, deadline)

    out: dict = {}
    with ctx.join(1, timeout=300) as world:
        for skew in skews:
            for r in range(rounds):
                mode = ("native", "watched")[r % 2]
                waiting.wait_for = native if mode == "native" else watched
                world.barrier()
                times = []
                for _ in range(calls):
                    if world.process_index == 0 and skew:
                        time.sleep(skew / 1000)
                    t0 = time.perf_counter()
                    world.allgather_json({"errors": []}, kind="bench/wait")
                    times.append(time.perf_counter() - t0)
                out.setdefault(f"{skew}/{mode}", []).append(statistics.median(times))
        waiting.wait_for = watched
        out["late"] = world.process_index == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skew", type=float, nargs="+", default=[0.0, 5.0])
    args = ap.parse_args()
    from xreshard.tools.launch import Role, launch
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    results = launch(f"{Path(__file__).stem}:child", roles,
                     args=(args.calls, args.rounds, args.skew), timeout=600,
                     env={"PYTHONPATH": str(Path(__file__).resolve().parent)})
    print(f"{len(roles)} processes, {args.calls} all-gathers per round, {args.rounds} "
          f"rounds alternating; median per all-gather (ms) of the two processes that "
          f"wait (process 0 is the late one)")
    print(f"{'skew ms':>8} {'native':>9} {'watched':>9} {'watched/native':>14}")
    for skew in args.skew:
        row = {}
        for mode in ("native", "watched"):
            row[mode] = statistics.median(
                x for r in results if not r.value["late"]
                for x in r.value[f"{skew}/{mode}"]) * 1000
        print(f"{skew:>8g} {row['native']:>9.3f} {row['watched']:>9.3f} "
              f"{row['watched'] / row['native']:>14.2f}")


if __name__ == "__main__":
    main()
