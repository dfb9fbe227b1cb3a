"""Processes of the elastic-world tests (launched by tests/test_elastic.py and
scripts/kill_peers.py --victim engine): plain numpy bindings built per epoch
(``xr.Rebuilt``), every destination byte checked against the version that wrote it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

SHAPE = (64, 48)
NAMES = ("a", "b")


def layouts(world: Any, receivers: str = "rollout") -> tuple[Any, Any]:
    """Source: rows split over the trainer's ranks; destination: columns split over the
    ranks of ``receivers`` (a group), as the world numbers them now."""
    import xreshard as xr
    t = world.group_ranks("trainer")
    r = world.group_ranks(receivers)
    return (xr.Layout.from_placements(SHAPE, "float32", xr.Mesh((len(t),), t), ["S0"]),
            xr.Layout.from_placements(SHAPE, "float32", xr.Mesh((len(r),), r), ["S1"]))


def value(version: int) -> Any:
    import numpy as np
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 0.5 + version)


class Sender:
    """The trainer's side: the full tensors of version ``version``, sliced per rank."""

    def __init__(self) -> None:
        self.version = 1

    def build(self, world: Any) -> Any:
        import xreshard as xr
        src, _ = layouts(world)
        full = value(self.version)
        arrays = {}
        for rank in world.rank_ids:
            (region,) = src.regions(rank)
            arrays.update({(rank, n): full[region.slices()].copy() for n in NAMES})
        return xr.Bound({n: src for n in NAMES}, arrays)


class Receiver:
    """A destination rank's side: arrays kept across calls while its ranks stay, checked
    against a version after a call."""

    def __init__(self, receivers: str = "rollout") -> None:
        self.receivers = receivers
        self.arrays: dict = {}
        self.layout: Any = None

    def build(self, world: Any) -> Any:
        import numpy as np
        import xreshard as xr
        _, dst = layouts(world, self.receivers)
        if dst != self.layout:
            self.layout = dst
            self.arrays = {(r, n): np.zeros(dst.local_shape(r), np.float32)
                           for r in world.rank_ids for n in NAMES}
        return xr.Bound({n: dst for n in NAMES}, self.arrays)

    def exact(self, version: int) -> bool:
        full = value(version)
        for (rank, _), a in self.arrays.items():
            (region,) = self.layout.regions(rank)
            if a.tobytes() != full[region.slices()].tobytes():
                return False
        return True


def fleet_member(ctx: Any, flag: str, how: str) -> dict:
    """trainer[0] (2 ranks), rollout[0], rollout[1] form an elastic world; after the first
    refit rollout[1] leaves (``how="leave"``) or SIGKILLs itself (``"kill"``) and
    rollout[2], a process new to the world, joins; the others refit twice more."""
    import xreshard as xr

    label = f"{ctx.role.group}[{ctx.role.index}]"
    config = xr.RefitConfig(timeout=20)
    if label == "rollout[2]":
        deadline = time.monotonic() + 90
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "the trainer never said go"
            time.sleep(0.05)
        world = ctx.join(elastic=True, groups=["trainer", "rollout"], timeout=60)
        side = Receiver()
        refit = xr.Refit(world, receive=xr.Rebuilt(side.build), config=config)
        reports = []
        while refit.version < 3:
            reports.append(refit())
            assert side.exact(refit.version), "wrong bytes"
        out = {"versions": [r.version for r in reports], "epoch": world.epoch,
               "members": list(world.members)}
        world.close()
        return out
    world = ctx.join(elastic=True, num_processes=3, groups=["trainer", "rollout"], timeout=60)
    trainer = ctx.role.group == "trainer"
    side = Sender() if trainer else Receiver()
    refit = xr.Refit(world, config=config, **{
        ("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    reports = [refit()]
    if label == "rollout[1]":
        assert side.exact(1)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        world.leave()
        return {"left": True}
    if trainer:
        with open(flag, "w") as f:
            f.write("go")
    for version in (2, 3):
        if version == 3:        # rollout[2] asked to join (it is admitted at this call)
            deadline = time.monotonic() + 90
            # (or it was admitted already, at call 2: its join request met that call)
            while not any(r["kind"] == "join" for r in world.pending()) \
                    and "rollout[2]" not in world.members:
                assert time.monotonic() < deadline, "rollout[2] never asked to join"
                time.sleep(0.05)
        if trainer:
            side.version = version
        reports.append(refit())
        assert trainer or side.exact(version), f"wrong bytes at v{version}"
    out = {"versions": [r.version for r in reports], "lost": [list(r.lost) for r in reports],
           "epochs": [r.epoch for r in reports], "members": list(world.members)}
    world.close()
    return out
