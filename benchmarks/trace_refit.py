"""A timeline of ``bench_refit.py``'s shm refit on every process: where its milliseconds go.

Runs ``bench_refit``'s processes (one JAX trainer, TP=4 on 4 CPU devices; two torch
receivers, TP=2) with ``--transport shm --executor pipelined`` and wraps the refit's steps
(binding, the ``refit/check`` and ``refit/outcome`` all-gathers, the executor's run, pack and
unpack) and the shm transport's (send, record batches, store waits, each
``process_vm_readv`` pull, acks) with timers while a timed refit runs. Prints, per refit,
the times (ms from the first process entering the call) that make its structure: when the
check all-gather ends, when each receiver starts and ends pulling, how long its receiving
thread sat idle between pulls (waiting for records, or for a core), what follows the last
pull (ack, unpack), and the whole call. The wrappers cost a few microseconds per call;
the structure holds at any load, the wall times do not.

    python benchmarks/trace_refit.py [--gib 0.125] [--reps 5] [--kernels out_in] [--json DIR]
                                     [--store]

(``--json DIR`` keeps every process's raw events, ``[start, end, step, thread]``;
``--store`` also times every request of the store's clients, named by their caller, and
every thread started: per process and refit, how many and how long.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_refit  # noqa: E402

EVENTS: list[tuple[float, float, str, str]] = []
ON = [False]


def _wrap(obj: Any, attr: str, label: str, argi: int | None = None,
          keyarg: str | None = None) -> None:
    fn = getattr(obj, attr, None)
    if fn is None:          # a step this tree does not have
        return

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        if not ON[0]:
            return fn(*a, **k)
        name = label
        if argi is not None and len(a) > argi:
            name = f"{label}[{a[argi]}]"
        elif keyarg is not None and keyarg in k:
            name = f"{label}[{k[keyarg]}]"
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((t0, time.monotonic(), name, threading.current_thread().name))
    setattr(obj, attr, timed)


def _patch() -> None:
    import xreshard.runtime.execute as ex
    import xreshard.runtime.refit as rf
    import xreshard.runtime.world as wd
    import xreshard.transport.shm as shm
    t = shm.ShmTransport
    _wrap(t, "send", "shm.send")
    _wrap(t, "_batch_record", "shm.batch", argi=2)
    for a in ("_complete", "_receive_batches", "_await_acks", "_ack", "_wait", "_land"):
        _wrap(t, a, f"shm.{a}")
    _wrap(shm, "pull", "shm.pull")
    _wrap(shm, "pull_rows", "shm.pull")     # a pull into a destination's rows (takes_views)
    for a in ("_run", "_pipelined", "_message", "_pack", "_unpack"):
        _wrap(ex.Executor, a, f"ex.{a}")
    for a in ("_call", "_bind_sides", "_prepare", "_move", "_commit"):
        _wrap(rf.Refit, a, f"refit.{a}")
    _wrap(wd.World, "allgather_json", "allgather", keyarg="kind")


def _patch_store() -> None:
    """Time every request of the store's clients (``--store``): ``store.<op>`` events,
    each named by the function that made it (``@caller``)."""
    import xreshard.runtime.store as st
    base = st._tcp_store_class()

    class Timed(base):  # type: ignore[misc, valid-type]
        pass

    def timed_op(op: str) -> Any:
        orig = getattr(base, op)

        def fn(self: Any, *a: Any, **k: Any) -> Any:
            if not ON[0]:
                return orig(self, *a, **k)
            caller = sys._getframe(1).f_code.co_name
            t0 = time.monotonic()
            try:
                return orig(self, *a, **k)
            finally:
                EVENTS.append((t0, time.monotonic(), f"store.{op}@{caller}",
                               threading.current_thread().name))
        return fn
    for op in ("set", "get", "wait", "multi_get", "multi_set", "add", "check", "delete_key",
               "compare_set"):
        setattr(Timed, op, timed_op(op))
    st._tcp_store_class = lambda: Timed     # every client made from now on (the world's)


def _patch_threads() -> None:
    """Time every ``Thread.start`` (``--store``): it waits until the new thread runs."""
    start = threading.Thread.start

    def timed(self: threading.Thread) -> None:
        if not ON[0]:
            return start(self)
        t0 = time.monotonic()
        try:
            return start(self)
        finally:
            EVENTS.append((t0, time.monotonic(), f"thread.start@{self.name}",
                           threading.current_thread().name))
    threading.Thread.start = timed     # type: ignore[method-assign]


def child(ctx: Any, cfg: dict) -> dict:
    _patch()
    if cfg.get("store"):
        _patch_store()
        _patch_threads()

    def timed(world: Any, fn: Any) -> float:
        world.barrier(timeout=bench_refit.TIMEOUT)
        EVENTS.append((time.monotonic(), 0.0, "== phase", ""))
        ON[0] = True
        t0 = time.perf_counter()
        fn()
        ON[0] = False
        return time.perf_counter() - t0
    bench_refit.timed = timed
    out = bench_refit.child(ctx, cfg)
    out["events"] = EVENTS
    out["who"] = f"{ctx.role.group}{ctx.role.index}"
    return out


def _refits(events: list) -> list[list]:
    """The events of each timed phase that ran a refit, in order."""
    phases: list[list] = []
    for e in sorted(events):
        if e[2] == "== phase":
            phases.append([])
        elif phases:
            phases[-1].append(e)
    return [p for p in phases if any(e[2] == "refit._call" for e in p)]


def structure(by_who: dict[str, list]) -> dict[str, list[float]]:
    """Per refit, the figures of its timeline (ms from the first process's first step)."""
    per = {w: _refits(ev) for w, ev in by_who.items()}
    rows: dict[str, list[float]] = {}
    receivers = sorted(w for w in per if w.startswith("rollout"))
    for i in range(min(len(v) for v in per.values())):
        t0 = min(per[w][i][0][0] for w in per if per[w][i])

        def at(w: str, name: str, how: str = "first") -> float:
            xs = [(s - t0, e - t0) for s, e, n, _ in per[w][i] if n == name]
            if not xs:
                return float("nan")
            if how == "sum":
                return sum(e - s for s, e in xs) * 1e3
            return (xs[0][0] if how == "first" else xs[-1][1]) * 1e3

        def add(name: str, value: float) -> None:
            rows.setdefault(name, []).append(value)
        add("whole call (last process out)", max(at(w, "refit._call", "last") for w in per))
        add("trainer: check all-gather ends", at("trainer0", "allgather[refit/check]", "last"))
        add("trainer: first send posted", at("trainer0", "shm.send"))
        add("trainer: last send posted", at("trainer0", "shm.send", "last"))
        for w in receivers:
            first, last = at(w, "shm.pull"), at(w, "shm.pull", "last")
            pulling = at(w, "shm.pull", "sum")
            add(f"{w}: first pull starts", first)
            add(f"{w}: pulling (sum)", pulling)
            add(f"{w}: idle between pulls", last - first - pulling)
            add(f"{w}: last pull ends", last)
            add(f"{w}: unpack (sum)", at(w, "ex._unpack", "sum"))
            add(f"{w}: moved (last pull -> end of move)", at(w, "refit._move", "last") - last)
        add("trainer: acks in", at("trainer0", "shm._await_acks", "last"))
        add("outcome all-gather, trainer", at("trainer0", "allgather[refit/outcome]", "sum"))
        if len(receivers) == 2:
            firsts = [at(w, "shm.pull") for w in receivers]
            lasts = [at(w, "shm.pull", "last") for w in receivers]
            add("receivers: first pulls apart", abs(firsts[0] - firsts[1]))
            add("receivers: last pulls apart", abs(lasts[0] - lasts[1]))
            add("last pull -> last process out", rows["whole call (last process out)"][-1]
                - max(lasts))
        for w in sorted(per):
            ev = per[w][i]
            store = [e for e in ev if e[2].startswith("store.")]
            starts = [e for e in ev if e[2].startswith("thread.start@")]
            if store or starts:
                add(f"{w}: store requests (count)", len(store))
                add(f"{w}: store requests (ms)", sum(e - s for s, e, _, _ in store) * 1e3)
                add(f"{w}: thread starts (count)", len(starts))
                add(f"{w}: thread starts (ms)", sum(e - s for s, e, _, _ in starts) * 1e3)
    return rows


def main(argv: list[str] | None = None) -> None:
    from xreshard.tools.launch import Role, launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=0.125)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", choices=["out_in", "in_out"], default="out_in")
    ap.add_argument("--json", default=None, help="a folder for every process's raw events")
    ap.add_argument("--store", action="store_true",
                    help="also time every store request and thread start, per process")
    args = ap.parse_args(argv)
    cfg = {"gib": args.gib, "reps": args.reps, "kernels": args.kernels, "bucket_mib": 64,
           "staging_mib": 256, "p2p_mib": 64, "profile_top": 0, "transport": "shm",
           "executor": "pipelined", "store": args.store}
    roles = ([Role("jax", "trainer", 0, num_devices=bench_refit.TRAINER_TP)]
             + [Role("torch", "rollout", i) for i in range(bench_refit.ROLLOUT_TP)])
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    res = launch("trace_refit:child", roles, args=(cfg,), timeout=bench_refit.TIMEOUT)
    by_who = {r.value["who"]: r.value["events"] for r in res}
    if args.json:
        os.makedirs(args.json, exist_ok=True)
        for who, ev in by_who.items():
            with open(os.path.join(args.json, f"trace_{who}.json"), "w") as f:
                json.dump(ev, f)
    rows = structure(by_who)
    print(f"shm refit timeline, ms from the first process entering the call; {args.reps} "
          f"refits, median [each]; load before {' '.join(load)}")
    for name, v in rows.items():
        print(f"| {name} | {statistics.median(v):.1f} | "
              + " ".join(f"{x:.1f}" for x in v) + " |")


if __name__ == "__main__":
    main()
