"""``kill_peers.py --victim engine``: SIGKILL a receiver process of one of two engines at a
random moment of a refit of an elastic world; the survivors must finish that refit exact,
the next refit must run without the dead, and the restarted process must join and hold
the current version.

Each trial launches eight processes: trainer[0] and trainer[1] (one rank each: rows of
four float32 tensors, 2 MiB each), two engines of two processes each (rollout[0..1] is
engine 0, rollout[2..3] engine 1; each process holds its tensor-parallel half of the
columns, so each engine holds a whole replica), and a spare that plays the victim
restarted. All join one elastic world (``World.join(elastic=True)``) and refit in a loop
with ``RefitConfig(timeout=T, on_member_loss="continue")``; the victim SIGKILLs itself at a
uniformly random moment of its second refit (within its first refit's duration). The
survivors go on until a call reports the loss (``RefitReport.lost``), run one more refit
(the next refit, without the dead), then wait for the restarted process to ask to join
and run one more (the rejoin), which it takes part in.

Per trial: ``survivors_completed`` (every survivor returned from the call that lost the
victim, its destination exact, version advanced), ``max_seconds`` (that call's start to
return or raise, over the survivors), ``next_refit_ok``, ``rejoin_ok`` (the restarted
process joined with ``wait=False``, caught up the survivors' version from the other
engine's replica, exact, every byte of its regions received in the catch-up world, which
the trainer is not part of; then the rejoin refit admitted it and it holds that version
exact), ``hang``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from typing import Any

SHAPE = (512, 1024)          # float32, 2 MiB a tensor
NAMES = ("a", "b", "c", "d")
ENGINES, TP = 2, 2


def _value(version: int) -> Any:
    import numpy as np
    rows = np.arange(SHAPE[0], dtype=np.float32)[:, None]
    return np.broadcast_to(rows * 1e-3 + version, SHAPE)


def _layouts(world: Any) -> tuple[Any, Any]:
    """trainer[k] holds rows half k; each rollout process its engine's TP half of the
    columns (explicit forms: a member keeps its part whoever else is lost, as real
    shards do; losing trainer[k] leaves rows half k with no source)."""
    import xreshard as xr
    rows, half = SHAPE[0] // 2, SHAPE[1] // TP
    src, dst = {}, {}
    for info in world.processes:      # a process keeps its part whoever else is lost
        k, rank = info["index"], info["ranks"][0]
        if info["group"] == "trainer":
            src[rank] = [xr.Region((k * rows, 0), ((k + 1) * rows, SHAPE[1]))]
        else:
            tp = k % TP
            dst[rank] = [xr.Region((0, tp * half), (SHAPE[0], (tp + 1) * half))]
    return (xr.Layout.explicit_form(SHAPE, "float32", src),
            xr.Layout.explicit_form(SHAPE, "float32", dst))


class _Side:
    def __init__(self, trainer: bool):
        self.trainer = trainer
        self.version = 1
        self.arrays: dict = {}
        self.key: Any = None

    def build(self, world: Any) -> Any:
        import numpy as np
        import xreshard as xr
        src, dst = _layouts(world)
        lay = src if self.trainer else dst
        (rank,) = world.rank_ids
        (region,) = lay.regions(rank)
        if self.trainer:
            full = _value(self.version)
            arrays = {(rank, n): [np.ascontiguousarray(full[region.slices()])] for n in NAMES}
        else:
            if self.key is None or self.key[1] != region:     # a rank renumbered keeps them
                self.arrays = {n: np.zeros(region.shape, np.float32) for n in NAMES}
            self.key = (rank, region)
            arrays = {(rank, n): [a] for n, a in self.arrays.items()}
        return xr.Bound({n: lay for n in NAMES}, arrays)

    def exact(self, version: int) -> bool:
        region = self.key[1]
        want = _value(version)[region.slices()].tobytes()
        return all(a.tobytes() == want for a in self.arrays.values())


def _call(refit: Any, side: _Side, version: int) -> dict:
    side.version = version
    t0 = time.time()
    try:
        report = refit()
    except BaseException as e:      # noqa: BLE001 - recorded
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}", "start": t0,
                "end": time.time(), "version": refit.version}
    out = {"ok": True, "start": t0, "end": time.time(), "version": refit.version,
           "lost": list(report.lost), "epoch": report.epoch, "seconds": report.seconds}
    if not side.trainer:
        out["exact"] = side.exact(refit.version)
    return out


def _wait(what: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def engine_trial(ctx: Any, spec: dict) -> dict:
    """One process of a trial (launched)."""
    import xreshard as xr

    label = f"{ctx.role.group}[{ctx.role.index}]"
    spare = ctx.launch_index == len(ctx.roles) - 1
    config = xr.RefitConfig(timeout=spec["timeout"], transport=spec["transport"],
                            bucket_bytes=1 << 20, staging_bytes=4 << 20)
    groups = ["trainer", "rollout"]
    if spare:       # the victim, restarted: waits until the survivors ran the next refit
        import torch.distributed    # noqa: F401 - as a restarted engine has (the store's client)
        if not _wait(lambda: os.path.exists(spec["next_file"]), 120):
            return {"role": "spare", "joined": False, "why": "no next refit"}
        seen = time.time()
        with open(spec["next_file"]) as f:
            version = int(f.read())         # the version the survivors call next
        trainer = ctx.role.group == "trainer"
        # an engine catches up from the other engine before it asks in; a trainer cannot
        world = ctx.join(elastic=True, groups=groups, timeout=60, wait=trainer)
        joined = time.time()
        side = _Side(trainer)
        refit = xr.Refit(world, config=config,
                         **{("send" if trainer else "receive"): xr.Rebuilt(side.build)})
        caught = None
        if not trainer:
            try:
                report = refit.catch_up()
                caught = {"ok": True, "version": report.version,
                          "exact": side.exact(report.version),
                          "bytes_received": report.bytes_received,
                          "expected_bytes": 4 * side.key[1].size * len(NAMES),
                          "seconds": report.seconds}
            except Exception as e:      # noqa: BLE001 - recorded
                caught = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out = _call(refit, side, version)
        out.update(role="spare", joined=True, epoch_after=world.epoch, flag_seen=seen,
                   joined_at=joined, catch_up=caught)
        world.close()
        return out
    world = ctx.join(elastic=True, num_processes=len(ctx.roles) - 1, groups=groups,
                     timeout=60)
    trainer = ctx.role.group == "trainer"
    side = _Side(trainer)
    refit = xr.Refit(world, config=config,
                     **{("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    calls = [_call(refit, side, 1)]
    if label == spec["victim"]:
        delay = random.Random(spec["seed"]).uniform(0, max(calls[0]["end"] - calls[0]["start"],
                                                           0.05))

        def die() -> None:
            time.sleep(delay)
            with open(spec["kill_file"], "w") as f:
                json.dump({"t": time.time(), "delay": delay}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    version = 1
    loss_call = None
    while loss_call is None and version < 8:
        version += 1
        calls.append(_call(refit, side, version))
        if not calls[-1]["ok"] or calls[-1].get("lost"):
            loss_call = len(calls) - 1
    out: dict[str, Any] = {"role": label, "calls": calls, "loss_call": loss_call}
    source = spec["victim"].startswith("trainer")
    if loss_call is None or calls[-1]["ok"] == source:
        world.close()
        return out
    if source:              # the call failed: the next version is the same one again
        version -= 1
    else:
        version += 1
        out["next"] = _call(refit, side, version)
        out["next"]["members"] = list(world.members)
    writer = "trainer[1]" if spec["victim"] == "trainer[0]" else "trainer[0]"
    if label == writer:
        with open(spec["next_file"] + ".tmp", "w") as f:
            f.write(str(version + 1))
        os.replace(spec["next_file"] + ".tmp", spec["next_file"])
    if _wait(lambda: any(r["kind"] == "join" for r in world.pending()), 90):
        version += 1
        out["rejoin"] = _call(refit, side, version)
        out["rejoin"]["members"] = list(world.members)
    world.close()
    return out


def run_trial(i: int, args: Any) -> dict:
    """Launch one trial; returns its row."""
    import tempfile
    from xreshard.tools.launch import LaunchTimeout, Role, launch

    rng = random.Random(args.seed * 1000 + i)
    v = rng.randrange(2 if args.victim == "trainer" else ENGINES * TP)
    group = "trainer" if args.victim == "trainer" else "rollout"
    victim = f"{group}[{v}]"
    with tempfile.TemporaryDirectory(prefix="kill-engines-") as tmp:
        spec = {"victim": victim, "seed": args.seed * 1000 + i, "timeout": args.timeout,
                "transport": args.transport, "kill_file": os.path.join(tmp, "killed.json"),
                "next_file": os.path.join(tmp, "next")}
        roles = ([Role("plain", "trainer", k) for k in range(2)]
                 + [Role("plain", "rollout", k) for k in range(ENGINES * TP)]
                 + [Role("plain", group, v)])
        limit = 60 + 8 * (args.timeout + 5) + 120
        t0 = time.time()
        try:
            results = launch(engine_trial, roles, args=(spec,), timeout=limit, check=False,
                             fail_fast=False)
        except LaunchTimeout as e:
            results = e.results
        killed = None
        if os.path.exists(spec["kill_file"]):
            with open(spec["kill_file"]) as f:
                killed = json.load(f)
    return {"trial": i, "victim": victim, "killed": killed, "wall": round(time.time() - t0, 1),
            "results": [{"role": f"{r.role.group}[{r.role.index}]", "ok": r.ok,
                         "timed_out": r.timed_out, "returncode": r.returncode,
                         "value": r.value, "detail": None if r.ok else
                         (r.traceback or r.output or "")[-500:]} for r in results]}


def _caught_up(caught: dict | None, version: int) -> bool:
    """The restarted engine process caught up from the other engine: the members' version
    (``version``), bit-exact, every byte of its regions received in the catch-up world
    (which holds the replicas and the joiner: the trainer sends none of it)."""
    return bool(caught and caught["ok"] and caught["exact"] and caught["version"] == version
                and caught["bytes_received"] == caught["expected_bytes"])


def summarize(rows: list[dict], timeout: float) -> dict:
    """The issue's figures over the trials."""
    completed = hangs = next_ok = rejoin_ok = 0
    worst = 0.0
    for row in rows:
        survivors = [r for r in row["results"][:-1] if r["role"] != row["victim"]]
        spare = row["results"][-1]
        hangs += sum(1 for r in row["results"] if r["timed_out"])
        values = [r["value"] for r in survivors if r["ok"] and r["value"]]
        if len(values) != len(survivors) or any(v["loss_call"] is None for v in values):
            continue
        lost = [v["calls"][v["loss_call"]] for v in values]
        worst = max([worst] + [c["end"] - c["start"] for c in lost])
        target = {c["version"] for c in lost}
        if all(c["ok"] and c.get("exact", True) for c in lost) and len(target) == 1:
            completed += 1
        nexts = [v.get("next") for v in values]
        if all(n and n["ok"] and n.get("exact", True) and row["victim"] not in n["members"]
               for n in nexts):
            next_ok += 1
        rejoins = [v.get("rejoin") for v in values]
        sv = spare["value"] or {}
        if all(r and r["ok"] and r.get("exact", True) for r in rejoins) and sv.get("ok") \
                and sv.get("exact") and sv.get("version") == rejoins[0]["version"] \
                and _caught_up(sv.get("catch_up"), rejoins[0]["version"] - 1):
            rejoin_ok += 1
    if rows and rows[0]["victim"].startswith("trainer"):
        return _summarize_source(rows, timeout)
    return {"trials": len(rows), "survivors_completed": completed, "hangs": hangs,
            "max_seconds": round(worst, 2), "next_refit_ok": next_ok, "rejoin_ok": rejoin_ok,
            "timeout": timeout}


def _summarize_source(rows: list[dict], timeout: float) -> dict:
    """A trainer (the only holder of its rows) killed: every survivor must raise one
    typed error within timeout + 5 s, and the restarted trainer's refit must be exact."""
    typed = hangs = restarted = 0
    worst = 0.0
    errors: dict[str, int] = {}
    for row in rows:
        survivors = [r for r in row["results"][:-1] if r["role"] != row["victim"]]
        hangs += sum(1 for r in row["results"] if r["timed_out"])
        values = [r["value"] for r in survivors if r["ok"] and r["value"]]
        if len(values) != len(survivors) or any(v["loss_call"] is None for v in values):
            continue
        lost = [v["calls"][v["loss_call"]] for v in values]
        seconds = [c["end"] - c["start"] for c in lost]
        worst = max([worst] + seconds)
        messages = {c.get("error") for c in lost}
        if len(messages) == 1 and not any(c["ok"] for c in lost) \
                and max(seconds) <= timeout + 5:
            typed += 1
            cls = next(iter(messages)).split(":")[0]
            errors[cls] = errors.get(cls, 0) + 1
        rejoins = [v.get("rejoin") for v in values]
        spare = row["results"][-1]["value"] or {}
        if all(r and r["ok"] and r.get("exact", True) for r in rejoins) and spare.get("ok"):
            restarted += 1
    return {"trials": len(rows), "victim": "trainer", "one_typed_error": typed,
            "errors": errors, "hangs": hangs, "max_seconds": round(worst, 2),
            "restarted_trainer_ok": restarted, "timeout": timeout}
