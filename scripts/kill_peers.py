"""Kill one process of a refit world with SIGKILL at a random moment; the survivors must
raise, the same way, within ``RefitConfig.timeout`` + 5 s, and never hang.

Each trial launches a fresh world of three processes (``plain`` roles: numpy bindings
through ``xreshard.Bound``, no framework to import): trainer[0] sends 16 MiB of float32
from 2 ranks to rollout[0] and rollout[1] (1 rank each), over ``--transport`` (gloo by
default: its process group is created on the first call). Every process calls the refit
in a loop; the victim (the sender, or a receiver) SIGKILLs itself:

- ``transport``: in the first refit's transport creation: right before it enters the
  gloo group rendezvous, or 0-50 ms into it (``xreshard.transport.gloo.create_gloo_group``
  wrapped; other transports: 0-50 ms after the first ``World.transport`` call);
- ``random``: a random 0-2 s after the world's first barrier, wherever the loop is.

For every survivor the script records: whether its call raised or hung (not returned
within T + 5 s: then the launcher kills it at the trial's deadline), the error class and
message, seconds from the later of (call start, kill) to the raise, whether the version
stayed, whether ``stale`` is set when bytes had moved (receivers know: each call sends
new values), and what one more call raises (the world should say ``WorldBroken`` at once).

With ``--atomic`` (``RefitConfig(atomic=True)``), only the sender is killed, and the
receivers bind torch tensors (``xreshard.adapters.torch.Sharded``, written in place): half
the trials kill it in the middle of moving (after a random number of its sends in its
second or third call), half at a random moment; every survivor's torch destination must
then equal its previous version bit for bit, with ``stale`` unset.

Prints a table and a JSON summary; exits 1 if any survivor hung, crashed or took more
than T + 5 s; 2 if none did but the contract was missed elsewhere (the version moved,
bytes moved without ``stale``, survivors of one trial raised different errors, or the next
call did not raise ``WorldBroken`` within 1 s).

    python scripts/kill_peers.py [--trials 20] [--timeout 5] [--parallel 2]
                                 [--transport gloo|auto] [--atomic] [--json out.json]
    python scripts/kill_peers.py --victim engine [--trials 20] [--timeout 5] [--json]

``--victim engine`` runs scripts/kill_engines.py's trials (an elastic world that loses an
engine process mid-refit; the restarted process catches up from the other engine with
``Refit.catch_up()`` before its first refit, see there) and prints one JSON object of its
figures (``--json`` without a file: only that object, on stdout; with one: the rows too,
into the file).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SHAPE = (1024, 1024)          # float32, 4 MiB a tensor
NAMES = ("a", "b", "c", "d")
SLACK = 5.0                   # the contract: raise within timeout + this


# ---------------------------------------------------------------------------- child side


def _die(kill_file: str, why: str) -> None:
    with open(kill_file, "w") as f:
        json.dump({"t": time.time(), "why": why}, f)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _timer(delay: float, kill_file: str, why: str) -> None:
    t = threading.Thread(target=lambda: (time.sleep(delay), _die(kill_file, why)), daemon=True)
    t.start()


#: calls each process makes at most (the victim dies in its 2nd or 3rd call, or within
#: 2 s of the first: always well before)
MAX_CALLS = 2000


def _die_in_move(rng: random.Random, kill_file: str) -> None:
    """SIGKILL this process after a random number of its sends in its second or third
    call: some bytes of that call moved, the rest never will."""
    from xreshard.runtime import execute

    count = execute.Executor._count_send
    runs = execute.Executor.run
    when = {"call": rng.choice([2, 3]), "send": rng.randint(1, 12), "calls": 0, "sends": 0}

    def run(self, *args, **kwargs):
        when["calls"] += 1
        when["sends"] = 0
        return runs(self, *args, **kwargs)

    def count_send(self, b, stats):
        count(self, b, stats)
        if when["calls"] == when["call"]:
            when["sends"] += 1
            if when["sends"] == when["send"]:
                _die(kill_file, f"after {when['send']} sends of call {when['call']}")

    execute.Executor.run = run
    execute.Executor._count_send = count_send


def _receiver(world: Any, dst_lay: Any, atomic: bool) -> tuple[dict, dict, Any]:
    """The receiving side: numpy arrays through ``Bound``, or (atomic) torch tensors
    through the torch adapter. Returns (side, arrays as numpy views, the torch tensors)."""
    import numpy as np
    import xreshard as xr
    if not atomic:
        arrays = {(r, n): np.zeros(dst_lay.local_shape(r), np.float32)
                  for r in world.rank_ids for n in NAMES}
        return {"receive": xr.Bound({n: dst_lay for n in NAMES}, arrays)}, arrays, None
    import torch
    from xreshard.adapters.torch import Sharded
    (rank,) = world.rank_ids
    tensors = {n: torch.zeros(dst_lay.local_shape(rank), dtype=torch.float32) for n in NAMES}
    state = {n: Sharded(t, dst_lay.mesh, ["S1"], SHAPE) for n, t in tensors.items()}
    return {"receive": state}, {(rank, n): t.numpy() for n, t in tensors.items()}, tensors


def trial(ctx: Any, spec: dict) -> dict:
    """One process of a trial (launched); the victim never returns."""
    import numpy as np
    import xreshard as xr
    from xreshard.runtime.world import World

    me = ctx.role.group + f"[{ctx.role.index}]"
    victim = me == spec["victim"]
    rng = random.Random(spec["seed"])
    if victim and spec["mode"] == "transport":
        import xreshard.transport.gloo as gloo_module    # world.py imports it per call
        create = getattr(gloo_module, "create_gloo_group", None)
        if create is not None and spec["transport"] == "gloo":
            # die right before this process enters the gloo rendezvous, or inside it
            def create_and_die(*args, **kwargs):
                delay = rng.choice([0.0, rng.uniform(0, 0.05)])
                if delay == 0.0:
                    _die(spec["kill_file"], "before its gloo group creation")
                _timer(delay, spec["kill_file"], f"{delay * 1e3:.0f} ms into its gloo group "
                                                 f"creation")
                return create(*args, **kwargs)

            gloo_module.create_gloo_group = create_and_die
        else:
            original = World.transport
            fired = []

            def transport(self, *args, **kwargs):
                if not fired:
                    fired.append(1)
                    _timer(rng.uniform(0, 0.05), spec["kill_file"],
                           "in its first transport creation")
                return original(self, *args, **kwargs)

            World.transport = transport
    if victim and spec["mode"] == "move":
        _die_in_move(rng, spec["kill_file"])
    world = ctx.join(groups=["trainer", "rollout"], timeout=60)
    trainer = ctx.role.group == "trainer"
    t_ranks = world.group_ranks("trainer")
    r_ranks = world.group_ranks("rollout")
    src_lay = xr.Layout.from_placements(SHAPE, "float32", xr.Mesh((2,), t_ranks), ["S0"])
    dst_lay = xr.Layout.from_placements(SHAPE, "float32", xr.Mesh((2,), r_ranks), ["S1"])
    if trainer:
        arrays = {(r, n): np.zeros(src_lay.local_shape(r), np.float32)
                  for r in world.rank_ids for n in NAMES}
        bound = xr.Bound({n: src_lay for n in NAMES}, arrays)
        side = {"send": bound}
    else:
        side, arrays, _tensors = _receiver(world, dst_lay, spec.get("atomic", False))
    config = xr.RefitConfig(timeout=spec["timeout"], transport=spec["transport"],
                            bucket_bytes=1 << 20, staging_bytes=4 << 20,
                            atomic=spec.get("atomic", False))
    refit = xr.Refit(world, config=config, **side)
    world.barrier(timeout=60)
    if victim and spec["mode"] == "random":
        _timer(rng.uniform(0, 2.0), spec["kill_file"], "at a random moment")
    out: dict[str, Any] = {"process": me, "calls": 0, "outcome": "no error"}
    # every process makes the same calls until the victim dies: a per-process wall-clock
    # end let a slow victim stop early (exit 0, never killed) while the others began one
    # more call and timed out; the wall clock only bounds a harness that never kills
    deadline = time.monotonic() + 120
    call = 0
    while call < MAX_CALLS and time.monotonic() < deadline:
        call += 1
        value = float(call)
        if trainer:
            for a in arrays.values():
                a[...] = value
        before = refit.version
        t0 = time.time()
        try:
            refit()
        except BaseException as e:     # noqa: BLE001 - record everything
            t1 = time.time()
            moved = None
            if not trainer:
                moved = any(bool((a == value).any()) for a in arrays.values())
                # bit for bit: the previous call's value (call 1's previous is zeros)
                previous = np.float32(value - 1).tobytes() * (arrays[next(iter(arrays))].size)
                out["previous_exact"] = all(a.tobytes() == previous for a in arrays.values())
            out.update(outcome="raised", error=type(e).__name__, message=str(e)[:400],
                       call_start=t0, raised_at=t1, call_seconds=t1 - t0,
                       version_before=before, version_after=refit.version,
                       stale=bool(getattr(refit, "stale", None)), bytes_moved=moved,
                       broken=getattr(world, "broken", "(no attribute)"))
            break
        out["calls"] = call
        if not trainer and not all(bool((a == value).all()) for a in arrays.values()):
            out.update(outcome="wrong bytes", call=call)
            break
    if out["outcome"] == "raised":
        t0 = time.time()
        try:
            refit()
            out.update(next_error="no error")
        except BaseException as e:     # noqa: BLE001
            out.update(next_error=type(e).__name__, next_message=str(e)[:200])
        out["next_seconds"] = time.time() - t0
    try:
        world.close()
    except BaseException as e:         # noqa: BLE001
        out["close_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


# ---------------------------------------------------------------------------- harness


def run_trial(i: int, victim_side: str, mode: str, args: argparse.Namespace) -> dict:
    from xreshard.tools.launch import LaunchTimeout, Role, launch

    victim = "trainer[0]" if victim_side == "sender" else f"rollout[{i % 2}]"
    with tempfile.TemporaryDirectory(prefix="kill-peers-") as tmp:
        kill_file = os.path.join(tmp, "killed.json")
        spec = {"victim": victim, "mode": mode, "seed": args.seed * 1000 + i,
                "timeout": args.timeout, "transport": args.transport, "kill_file": kill_file,
                "atomic": args.atomic}
        roles = [Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 0),
                 Role("plain", "rollout", 1)]
        # startup (imports, join) + the loop until the kill (< 30 s) + timeout + slack,
        # + the follow-up call: anything beyond is a hang
        limit = 60 + 30 + 2 * (args.timeout + SLACK) + 70     # + a 60 s join timeout
        t0 = time.time()
        try:
            results = launch("kill_peers:trial", roles, args=(spec,), timeout=limit,
                             check=False, fail_fast=False)
        except LaunchTimeout as e:
            results = e.results
        wall = time.time() - t0
        killed = None
        if os.path.exists(kill_file):
            with open(kill_file) as f:
                killed = json.load(f)
    row = {"trial": i, "victim": victim, "side": victim_side, "mode": mode,
           "wall": round(wall, 1), "kill": killed and killed["why"], "survivors": []}
    for res in results:
        label = f"{res.role.group}[{res.role.index}]"
        if label == victim:
            row["victim_returncode"] = res.returncode
            continue
        s: dict[str, Any] = {"process": label}
        if res.timed_out:
            s.update(outcome="hung")
        elif not res.ok:
            s.update(outcome="crashed", detail=(res.traceback or res.output or "")[-600:])
        else:
            s.update(res.value)
            if s.get("outcome") == "raised":
                start = s["call_start"]
                if killed is not None:
                    start = max(start, killed["t"])
                s["seconds"] = round(s["raised_at"] - start, 2)
        row["survivors"].append(s)
    return row


def check(rows: list[dict], timeout: float, atomic: bool = False
          ) -> tuple[list[str], list[str], dict]:
    """Hard failures (a hang, a raise later than timeout + slack, a crash), other
    deviations from the contract (version, stale, different errors, no WorldBroken after
    a failure), and a summary."""
    bad = []
    contract = []
    classes = collections.Counter()
    next_classes = collections.Counter()
    worst = 0.0
    for row in rows:
        tag = f"trial {row['trial']} ({row['side']} {row['victim']} killed {row['mode']})"
        if row["kill"] is None:
            bad.append(f"{tag}: the victim was never killed (it finished first?)")
        if row.get("victim_returncode") not in (-signal.SIGKILL, None):
            bad.append(f"{tag}: the victim exited with {row.get('victim_returncode')}")
        errors = set()
        for s in row["survivors"]:
            who = f"{tag}: survivor {s['process']}"
            out = s.get("outcome")
            if out == "hung":
                bad.append(f"{who} hung (not returned by the trial's deadline)")
                continue
            if out != "raised":
                bad.append(f"{who}: {out} {s.get('detail', '')[:300]}")
                continue
            classes[s["error"]] += 1
            next_classes[s.get("next_error", "?")] += 1
            errors.add((s["error"], s["message"]))
            worst = max(worst, s["seconds"])
            if s["seconds"] > timeout + SLACK:
                bad.append(f"{who} raised after {s['seconds']} s > timeout {timeout} + {SLACK}")
            if s.get("next_seconds", 0) > timeout + SLACK:
                bad.append(f"{who}: the call after the failure took {s['next_seconds']:.1f} s")
            if s["version_after"] != s["version_before"]:
                contract.append(f"{who}: version moved {s['version_before']} -> "
                                f"{s['version_after']}")
            if atomic and "previous_exact" in s:
                if not s["previous_exact"]:
                    contract.append(f"{who}: atomic, but its destination is not its previous "
                                    f"version bit for bit")
                if s["stale"]:
                    contract.append(f"{who}: atomic, but stale is set")
            elif s.get("bytes_moved") and not s["stale"]:
                contract.append(f"{who}: bytes had moved but stale is False")
            if s.get("next_error") != "WorldBroken" or s.get("next_seconds", 0) > 1.0:
                contract.append(f"{who}: the call after the failure raised "
                                f"{s.get('next_error')} after {s.get('next_seconds', 0):.2f} s, "
                                f"not WorldBroken at once")
        if len(errors) > 1:
            contract.append(f"{tag}: survivors raised different errors: {sorted(errors)}")
    exact = [s["previous_exact"] for r in rows for s in r["survivors"] if "previous_exact" in s]
    summary = {"trials": len(rows), "timeout": timeout, "slack": SLACK,
               "errors": dict(classes), "next_call_errors": dict(next_classes),
               "worst_seconds": worst, "hard_failures": len(bad),
               "contract_deviations": len(contract)}
    if atomic:
        summary.update(atomic=True, receivers_previous_exact=sum(exact),
                       receivers_checked=len(exact))
    return bad, contract, summary


def table(rows: list[dict]) -> str:
    lines = ["| trial | killed | when | survivor | outcome | error | s to raise | version kept "
             "| stale (bytes moved) | next call | next s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for s in row["survivors"]:
            if s.get("outcome") == "raised":
                kept = "yes" if s["version_after"] == s["version_before"] else "NO"
                moved = {None: "?", True: "moved", False: "none"}[s.get("bytes_moved")]
                lines.append(
                    f"| {row['trial']} | {row['side']} {row['victim']} | {row['mode']} | "
                    f"{s['process']} | raised | {s['error']} | {s['seconds']:.2f} | {kept} | "
                    f"{s['stale']} ({moved}) | {s.get('next_error')} | "
                    f"{s.get('next_seconds', 0):.2f} |")
            else:
                lines.append(f"| {row['trial']} | {row['side']} {row['victim']} | {row['mode']} "
                             f"| {s['process']} | **{s.get('outcome')}** | | | | | | |")
    return "\n".join(lines)


def _engines(args: argparse.Namespace) -> int:
    import kill_engines
    if args.transport == "gloo" and "--transport" not in sys.argv:
        args.transport = "auto"         # shm between the processes of this host, as deployed
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda i: kill_engines.run_trial(i, args), range(args.trials)))
    summary = kill_engines.summarize(rows, args.timeout)
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    print(json.dumps(summary))
    if args.victim == "trainer":
        return 0 if summary["one_typed_error"] == summary["restarted_trainer_ok"] \
            == args.trials and summary["hangs"] == 0 else 2
    ok = (summary["hangs"] == 0 and summary["survivors_completed"] >= args.trials - 1
          and summary["max_seconds"] <= args.timeout + SLACK
          and summary["next_refit_ok"] == args.trials
          and summary["rejoin_ok"] >= args.trials - 1)
    return 0 if ok else 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="per victim side")
    ap.add_argument("--timeout", type=float, default=5.0, help="RefitConfig.timeout")
    ap.add_argument("--transport", default="gloo")
    ap.add_argument("--parallel", type=int, default=2, help="trials at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atomic", action="store_true",
                    help="RefitConfig(atomic=True), torch receivers, kill the sender only")
    ap.add_argument("--victim", choices=("any", "engine", "trainer"), default="any",
                    help="engine: kill an engine's receiver in an elastic world "
                         "(scripts/kill_engines.py)")
    ap.add_argument("--json", nargs="?", const="-",
                    help="write the rows and the summary here (no file: print the summary "
                         "alone, as one JSON object)")
    args = ap.parse_args(argv)
    if args.victim in ("engine", "trainer"):
        return _engines(args)
    plan = []
    for side in (("sender",) if args.atomic else ("sender", "receiver")):
        for k in range(args.trials):
            mode = ("move" if k % 2 == 0 else "random") if args.atomic else \
                ("transport" if k % 4 == 0 else "random")
            plan.append((len(plan), side, mode))
    t0 = time.time()
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda p: run_trial(*p, args), plan))
    bad, contract, summary = check(rows, args.timeout, args.atomic)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    summary["transport"] = args.transport
    print(table(rows))
    print()
    for title, items in (("HARD FAILURES (hang, late, crash)", bad),
                         ("CONTRACT DEVIATIONS", contract)):
        if items:
            print(f"{title}:")
            for b in items[:60]:
                print("  " + b)
            if len(items) > 60:
                print(f"  ... and {len(items) - 60} more")
            print()
    messages = collections.Counter(
        f"{s['error']}: {s['message'][:160]}" for r in rows for s in r["survivors"]
        if s.get("outcome") == "raised")
    summary["messages"] = dict(messages.most_common(8))
    print(json.dumps(summary, indent=2))
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "hard_failures": bad,
                       "contract_deviations": contract}, f, indent=1)
    return 1 if bad else (2 if contract else 0)


if __name__ == "__main__":
    sys.exit(main())
