"""Asynchronous refit: ``refit.start()`` returns at once, ``wait()`` gives the report or the
error every rank raises; a torch sender written before ``wait()`` is caught."""

from __future__ import annotations

import time

import numpy as np
import pytest

import xreshard as xr
from xreshard.tools.launch import Context, Role, launch

pytestmark = pytest.mark.slow


def overlapped(ctx: Context) -> dict:
    import torch

    out: dict = {}
    config = xr.RefitConfig(timeout=30, check_writes=True)
    with ctx.join(1, timeout=30) as world:
        trainer = ctx.role.group == "trainer"
        w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
        state = {"w": w} if trainer else {"w": torch.zeros(64, 32)}
        refit = xr.Refit(world, **({"send": state} if trainer else {"receive": state}),
                         config=config)
        if trainer:
            handle = refit.start()
            out["returned_at_once"] = not handle.done()      # the receiver is 1 s late
            with pytest.raises(xr.RefitError, match="already running"):
                refit.start()
            with pytest.raises(xr.RefitError, match="another thread"):
                world.barrier()
            busy = sum(float(np.sum(np.ones(1000))) for _ in range(100))   # the caller computes
            out["busy"] = busy
            out["version"] = handle.wait().version
        else:
            time.sleep(1.0)
            out["version"] = refit().version
            out["exact"] = bool(torch.equal(state["w"], w))
        # 2: the trainer writes its tensor while the started refit may read it
        if trainer:
            handle = refit.start()
            w.add_(1)                          # an optimizer step before wait(): refused
            try:
                handle.wait()
            except xr.RefitError as e:
                out["written"] = str(e)
        else:
            time.sleep(1.0)
            try:
                refit()
            except xr.RefitError as e:
                out["written"] = str(e)
        out["version_after"] = refit.version
        out["broken"] = world.broken
        # 3: the world still works
        out["third"] = (refit.start().wait() if trainer else refit()).version
    return out


def test_started_refit_overlaps_the_caller_and_catches_writes():
    roles = [Role("torch", "trainer", 0), Role("torch", "rollout", 0)]
    trainer, rollout = [r.value for r in launch(overlapped, roles, timeout=180)]
    assert trainer["returned_at_once"]
    assert trainer["version"] == rollout["version"] == 1 and rollout["exact"]
    assert trainer["written"] == rollout["written"]
    assert "'w' (bytes changed, version 0 -> 1)" in trainer["written"]
    assert "handle.wait()" in trainer["written"]
    assert trainer["version_after"] == rollout["version_after"] == 1
    assert trainer["broken"] is None and rollout["broken"] is None
    assert trainer["third"] == rollout["third"] == 2
