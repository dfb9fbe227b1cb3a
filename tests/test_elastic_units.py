"""Units of an elastic world fall together (``World.join(unit=...)``, issue 21 item 2): two
engines of two processes each (one tensor-parallel half each, so each engine holds a whole
replica), every process of engine e joined with ``unit="e<e>"``. One process of engine 1
SIGKILLs itself inside a refit call (after the call's check, as its receives are posted):
the survivors finish the call without the whole of engine 1 - its other process, alive and
done with its part, is excluded with it and raises ``WorldBroken`` naming its unit -, every
surviving destination exact, the report naming both of engine 1's processes; the next call
runs among the survivors alone, exact. Plain processes (numpy ``Bound`` sides rebuilt per
epoch, ``xr.Rebuilt``)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from xreshard.tools.launch import Role, launch

SHAPE = (64, 48)
NAMES = ("a", "b")
TP = 2


def _value(version: int) -> Any:
    import numpy as np
    return np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) + version


class _Side:
    """trainer[0] holds the whole tensors; each rollout process its engine's TP half of
    the columns, kept across calls."""

    def __init__(self, trainer: bool):
        self.trainer, self.version, self.arrays, self.region = trainer, 1, {}, None

    def build(self, world: Any) -> Any:
        import numpy as np
        import xreshard as xr
        src, dst = {}, {}
        half = SHAPE[1] // TP
        for info in world.processes:
            (rank,) = info["ranks"]
            if info["group"] == "trainer":
                src[rank] = [xr.Region((0, 0), SHAPE)]
            else:
                tp = info["index"] % TP
                dst[rank] = [xr.Region((0, tp * half), (SHAPE[0], (tp + 1) * half))]
        lay = xr.Layout.explicit_form(SHAPE, "float32", src if self.trainer else dst)
        (rank,) = world.rank_ids
        (region,) = lay.regions(rank)
        if self.trainer:
            arrays = {(rank, n): [_value(self.version)] for n in NAMES}
        else:
            if region != self.region:
                self.arrays = {n: np.zeros(region.shape, np.float32) for n in NAMES}
                self.region = region
            arrays = {(rank, n): [a] for n, a in self.arrays.items()}
        return xr.Bound({n: lay for n in NAMES}, arrays)

    def exact(self, version: int) -> bool:
        want = _value(version)[self.region.slices()].tobytes()
        return all(a.tobytes() == want for a in self.arrays.values())


def unit_member(ctx: Any) -> dict:
    import xreshard as xr
    from xreshard.runtime import execute

    trainer = ctx.role.group == "trainer"
    unit = None if trainer else f"e{ctx.role.index // TP}"
    world = ctx.join(elastic=True, groups=["trainer", "rollout"], timeout=30, unit=unit)
    side = _Side(trainer)
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=30),
                     **{("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    calls = []
    for version in (1, 2, 3):
        side.version = version
        if version == 2 and ctx.role.group == "rollout" and ctx.role.index == 3:
            post = execute.Executor._recv_buffers

            def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
                post(self, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            execute.Executor._recv_buffers = dying
        try:
            report = refit()
        except Exception as e:  # noqa: BLE001 - the test checks it
            calls.append({"error": f"{type(e).__name__}: {e}"})
            break
        calls.append({"version": report.version, "lost": list(report.lost),
                      "epoch": report.epoch, "members": list(world.members),
                      "exact": None if trainer else side.exact(version)})
    world.close()
    return {"calls": calls}


@pytest.mark.slow
def test_a_lost_process_takes_its_whole_unit_out():
    roles = [Role("plain", "trainer", 0)] + [Role("plain", "rollout", i) for i in range(4)]
    results = launch(unit_member, roles, timeout=240, check=False, fail_fast=False)
    trainer, r0, r1, r2, r3 = results
    assert r3.returncode == -signal.SIGKILL, r3.describe()
    for res in (trainer, r0, r1, r2):
        assert res.ok, res.describe()
    for res in (trainer, r0, r1):
        calls = res.value["calls"]
        assert [c.get("version") for c in calls] == [1, 2, 3], calls
        assert [c["lost"] for c in calls] == [[], ["rollout[2]", "rollout[3]"], []], calls
        assert calls[1]["members"] == ["trainer[0]", "rollout[0]", "rollout[1]"], calls
        assert calls[2]["epoch"] == calls[1]["epoch"] == calls[0]["epoch"] + 1
        if res is not trainer:
            assert all(c["exact"] for c in calls), calls
    # engine 1's live process did its part, then learned its unit was lost
    calls = r2.value["calls"]
    assert calls[0]["exact"] and len(calls) == 2, calls
    assert calls[1]["error"].startswith("WorldBroken") and "unit 'e1'" in calls[1]["error"] \
        and "rollout[3]" in calls[1]["error"], calls
