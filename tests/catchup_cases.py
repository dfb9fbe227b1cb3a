"""Processes of tests/test_catchup.py: a trainer and two engines (one process each, every
engine process a whole replica) in an elastic world with a token; engine B joins with
``wait=False`` and catches up from engine A while the trainer refits A (or not)."""

from __future__ import annotations

import os
import time
from typing import Any

SHAPE = (64, 48)
NAMES = ("a", "b")
GROUPS = ["trainer", "rollout"]
TOKEN = "catch-up-test-token"


def value(version: int) -> Any:
    import numpy as np
    return np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) * 0.25 + version


class Side:
    """Whole tensors on one rank: the trainer's of ``version``, or a receiver's (kept)."""

    def __init__(self, trainer: bool):
        import numpy as np
        self.trainer = trainer
        self.version = 0
        self.arrays = {n: np.zeros(SHAPE, np.float32) for n in NAMES}

    def build(self, world: Any) -> Any:
        import xreshard as xr
        (rank,) = world.rank_ids
        lay = xr.Layout.explicit_form(SHAPE, "float32",
                                      {rank: [xr.Region((0, 0), SHAPE)]})
        if self.trainer:
            for a in self.arrays.values():
                a[...] = value(self.version)
        return xr.Bound({n: lay for n in NAMES}, {(rank, n): [a] for n, a in self.arrays.items()},
                        local_only=set(NAMES))

    def exact(self, version: int) -> bool:
        want = value(version).tobytes()
        return all(a.tobytes() == want for a in self.arrays.values())


def _call(refit: Any, side: Side) -> Any:
    side.version = refit.version + 1
    return refit()


def _wait(what: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def member(ctx: Any, flag: str, racing: bool) -> dict:
    import xreshard as xr

    group, index = ctx.role.group, ctx.role.index
    trainer, joiner = group == "trainer", (group, index) == ("rollout", 1)
    side = Side(trainer)
    config = xr.RefitConfig(timeout=60)
    who = "send" if trainer else "receive"
    out: dict[str, Any] = {}
    if joiner:
        _wait(lambda: os.path.exists(flag))
        world = ctx.join(elastic=True, groups=GROUPS, timeout=120, wait=False, token=TOKEN,
                         num_processes=2)
        refit = xr.Refit(world, config=config, receive=xr.Rebuilt(side.build))
        assert not world.admitted
        report = refit.catch_up()
        out["caught"] = {"version": report.version, "refit_version": refit.version,
                         "exact": side.exact(report.version),
                         "bytes_received": report.bytes_received,
                         "expected": 4 * SHAPE[0] * SHAPE[1] * len(NAMES)}
        # again: the catch-up world formed ahead is kept (transports, plan) until admitted
        again = refit.catch_up()
        out["again"] = {"version": again.version, "exact": side.exact(again.version),
                        "replanned": again.replanned, "bytes_received": again.bytes_received}
    else:
        world = ctx.join(elastic=True, groups=GROUPS, timeout=120, token=TOKEN,
                         num_processes=2)
        refit = xr.Refit(world, config=config, **{who: xr.Rebuilt(side.build)})
        out["sent"] = [_call(refit, side).bytes_sent for _ in range(2)]
        if trainer:
            with open(flag, "w"):
                pass
        if racing:      # the trainer refits A while B catches up, until B is admitted
            while len(world.members) < 3:
                _call(refit, side)
        else:
            _wait(lambda: any(r["kind"] == "join" for r in world.pending()))
    while len(world.members) < 3:
        _call(refit, side)      # B: its first call admits it
    report = _call(refit, side)
    out.update(version=refit.version, members=list(world.members), epoch=world.epoch,
               exact=side.exact(refit.version), last_sent=report.bytes_sent)
    world.close()
    return out
