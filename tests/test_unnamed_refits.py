"""Two unnamed Refits of one world whose first calls cross between processes (the trainer
calls the policy's then the reference model's, the rollout the reference's then the
policy's): both first calls proposed ``#1``, so each side received the other model's
weights and reported success. Now a process holding two unnamed Refits that never ran
refuses, on every process, before any byte moves; named, the same program is exact.

Real processes: a JAX trainer (one CPU device) and a torch receiver, over gloo."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from .delta_cases import attempt

SHAPE = (64, 32)
MODELS = {"policy": 1.0, "reference": -2.0}


def child(ctx: Any, named: bool) -> list:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    order = ["policy", "reference"] if trainer else ["reference", "policy"]
    config = xr.RefitConfig(transport="gloo", timeout=60)
    rows: list = []
    with ctx.join(groups=["trainer", "rollout"]) as world:
        if trainer:
            import jax
            refits = {m: xr.Refit(world, send={"w": jax.device_put(
                np.full(SHAPE, MODELS[m], np.float32))}, config=config,
                name=m if named else None) for m in order}
        else:
            import torch
            dst = {m: {"w": torch.zeros(SHAPE)} for m in order}
            refits = {m: xr.Refit(world, receive=dst[m], config=config,
                                  name=m if named else None) for m in order}
        for m in order:
            got = attempt(refits[m])
            rows.append(got if isinstance(got, str) else got.version)
        if not trainer:
            rows.append({m: float(dst[m]["w"][0, 0]) for m in order})
    return rows


@pytest.mark.slow
def test_unnamed_refits_crossed_at_their_first_call_are_refused_everywhere():
    roles = [Role("jax", "trainer", 0, num_devices=1), Role("torch", "rollout", 0)]
    sent, got = [r.value for r in launch(child, roles, args=(False,), timeout=200)]
    assert isinstance(sent[0], str) and sent[0].startswith("RefitError"), sent
    assert "name every Refit" in sent[0] and got[0] == sent[0]
    assert got[2] == {"reference": 0.0, "policy": 0.0}        # no byte moved


@pytest.mark.slow
def test_named_refits_called_in_another_order_are_told_apart():
    roles = [Role("jax", "trainer", 0, num_devices=1), Role("torch", "rollout", 0)]
    sent, got = [r.value for r in launch(child, roles, args=(True,), timeout=200)]
    # crossed named calls are refused as a mismatch (as before), never swapped
    assert all(isinstance(x, str) for x in sent[:2]), sent
    assert got[2] == {"reference": 0.0, "policy": 0.0}
