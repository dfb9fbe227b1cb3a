"""Processes of tests/test_comm_epochs.py: an elastic world over gloo links where one
engine process leaves and another joins, checking which links are kept, which made, and
which tensors are planned again (plain numpy bindings, every byte checked)."""

from __future__ import annotations

import os
import time
from typing import Any

SHAPE = {"a": (32, 24), "b": (32, 16)}     # two shapes: two templates on any ranks
GROUPS = ["rollout", "trainer"]     # rollout first: a leaving rollout[0] shifts every rank


def layouts(world: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (source, destination) as the world numbers ranks now: "a" goes whole to
    rollout[1] alone (untouched when another engine process comes or goes), "b" is split
    by columns over every rollout rank (touched by any change of them)."""
    import xreshard as xr
    t = world.group_ranks("trainer")
    r = world.group_ranks("rollout")
    src = {n: xr.Layout.from_placements(SHAPE[n], "float32", xr.Mesh((len(t),), t), ["S0"])
           for n in SHAPE}
    r1 = _rank_of(world, "rollout", 1)
    return {"a": (src["a"], xr.Layout.replicated(SHAPE["a"], "float32", xr.Mesh((1,), (r1,)))),
            "b": (src["b"], xr.Layout.from_placements(SHAPE["b"], "float32",
                                                      xr.Mesh((len(r),), r), ["S1"]))}


def _rank_of(world: Any, group: str, index: int) -> int:
    (info,) = [p for p in world.processes if p["group"] == group and p["index"] == index]
    return info["ranks"][0]


def value(name: str, version: int) -> Any:
    import numpy as np
    base = np.arange(SHAPE[name][0] * SHAPE[name][1], dtype=np.float32).reshape(SHAPE[name])
    return base * (2.0 if name == "a" else 0.5) + version


class Side:
    """Either side, rebuilt per epoch (``xr.Rebuilt``); receivers keep their arrays to be
    checked after each call."""

    def __init__(self, sending: bool):
        self.sending, self.version, self.arrays, self.lays = sending, 1, {}, {}

    def build(self, world: Any) -> Any:
        import numpy as np
        import xreshard as xr
        pick = 0 if self.sending else 1
        self.lays = {n: pair[pick] for n, pair in layouts(world).items()}
        self.arrays = {}
        for n, lay in self.lays.items():
            for rank in world.rank_ids:
                if rank not in lay.rank_set:
                    continue
                (region,) = lay.regions(rank)
                self.arrays[(rank, n)] = (value(n, self.version)[region.slices()].copy()
                                          if self.sending else np.zeros(region.shape, np.float32))
        return xr.Bound(self.lays, self.arrays)

    def exact(self, version: int) -> bool:
        for (rank, n), a in self.arrays.items():
            (region,) = self.lays[n].regions(rank)
            if a.tobytes() != value(n, version)[region.slices()].tobytes():
                return False
        return True


def _link_ids(world: Any) -> dict[str, int]:
    """This process's links: key -> id of the link's gloo transport."""
    linked = world.transport("gloo").inner
    return {link.key: id(link.inner) for link in linked.links.values()}


def member(ctx: Any, flag: str) -> dict:
    """rollout[0], rollout[1], trainer[0] (2 ranks) refit once; rollout[0] leaves; the
    others refit; rollout[2] (new) asks to join and the three refit again."""
    import xreshard as xr
    from xreshard.transport import gloo as gloo_module

    made = []
    create = gloo_module.create_gloo_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1] if len(args) > 1 else kwargs.get("prefix"))
        return create(*args, **kwargs)

    gloo_module.create_gloo_group = counted
    label = f"{ctx.role.group}[{ctx.role.index}]"
    config = xr.RefitConfig(timeout=30, transport="gloo")
    if label == "rollout[2]":
        deadline = time.monotonic() + 120
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "the trainer never said go"
            time.sleep(0.05)
        world = ctx.join(elastic=True, groups=GROUPS, timeout=60)
        side = Side(False)
        refit = xr.Refit(world, receive=xr.Rebuilt(side.build), config=config)
        report = refit()
        out = {"version": report.version, "exact": side.exact(report.version),
               "steps": world.comm_steps, "made": len(made)}
        world.close()
        return out
    world = ctx.join(elastic=True, num_processes=3, groups=GROUPS, timeout=60)
    trainer = ctx.role.group == "trainer"
    side = Side(trainer)
    refit = xr.Refit(world, config=config,
                     **{("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    out: dict[str, Any] = {"calls": []}

    def call(version: int) -> None:
        side.version = version
        report = refit()
        out["calls"].append({
            "version": report.version, "epoch": world.epoch, "exact": side.exact(version),
            "planned": report.tensors_planned, "reused": report.tensors_reused,
            "steps": world.comm_steps, "counts": world.comm_counts, "made": len(made),
            "links": _link_ids(world)})

    call(1)
    if label == "rollout[0]":
        world.leave()
        return out
    call(2)
    if trainer:
        with open(flag, "w") as f:
            f.write("go")
    deadline = time.monotonic() + 120
    while not any(r["kind"] == "join" for r in world.pending()):
        assert time.monotonic() < deadline, "rollout[2] never asked to join"
        time.sleep(0.05)
    call(3)
    world.close()
    return out
