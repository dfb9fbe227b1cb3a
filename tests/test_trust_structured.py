"""Structured changes the old checksum could not see (two sign bits, a negated tensor),
between real processes: a delta refit onto destinations negated outside xreshard is
refused everywhere, and ``verify=True`` catches two sign bits flipped on the way.

With xr64x2 (weighted sums mod 2**64) both passed: flipping bit 63 of two 64-bit words
adds ``2**63 * even`` to every sum. Real processes: a JAX trainer (one CPU device) and a
torch receiver (plain CPU tensors), over gloo; float32, so an odd element's sign is bit 63
of its 64-bit word."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from .delta_cases import attempt

SHAPE = (128, 256)


def versions(n: int) -> list[np.ndarray]:
    """``n`` float32 versions of one tensor, each a few elements away from the last."""
    rng = np.random.default_rng(3)
    now = rng.standard_normal(SHAPE).astype(np.float32)
    out = [now]
    for _ in range(n - 1):
        now = now.copy()
        flat = now.reshape(-1)
        flat[rng.choice(flat.size, 40, replace=False)] += 1.0
        out.append(now)
    return out


def delta_child(ctx: Any) -> list:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    made = versions(4)
    rows: list = []
    with ctx.join(groups=["trainer", "rollout"]) as world:
        config = xr.RefitConfig(delta=True, transport="gloo", timeout=60)
        if trainer:
            import jax
            refit = xr.Refit(world, send=None, config=config)
            for v in made:
                got = attempt(lambda: refit(send={"w": jax.device_put(v)}))
                rows.append(got if isinstance(got, str) else dict(got.delta))
        else:
            import torch
            dst = {"w": torch.zeros(SHAPE, dtype=torch.float32)}
            refit = xr.Refit(world, receive=dst, config=config)
            for k, v in enumerate(made):
                if k == 2:      # outside xreshard: every odd column negated through numpy
                    dst["w"].numpy()[:, 1::2] *= -1
                got = attempt(refit)
                rows.append(got if isinstance(got, str)
                            else {"exact": bool(np.array_equal(dst["w"].numpy(), v))})
    return rows


@pytest.mark.slow
def test_delta_refuses_destinations_negated_outside_xreshard():
    results = launch(delta_child, [Role("jax", "trainer", 0, num_devices=1),
                                   Role("torch", "rollout", 0)], timeout=200)
    sent, got = results[0].value, results[1].value
    assert got[:2] == [{"exact": True}] * 2
    assert sent[1]["num_delta"] >= 1            # the second call sent deltas
    # the third would apply a delta onto the negated base: refused on both processes
    assert isinstance(sent[2], str) and "written outside xreshard" in sent[2], sent[2]
    assert got[2] == sent[2]
    assert got[3] == {"exact": True}


def verify_child(ctx: Any) -> list:
    import xreshard as xr
    import xreshard.runtime.execute as execute

    trainer = ctx.role.group == "trainer"
    value = versions(1)[0]
    rows: list = []
    with ctx.join(groups=["trainer", "rollout"]) as world:
        config = xr.RefitConfig(verify=True, transport="gloo", timeout=60)
        if trainer:
            import jax
            refit = xr.Refit(world, send=None, config=config)
            for _ in range(2):
                rows.append(attempt(lambda: refit(send={"w": jax.device_put(value)})))
        else:
            import torch
            dst = {"w": torch.zeros(SHAPE, dtype=torch.float32)}
            refit = xr.Refit(world, receive=dst, config=config)
            run = execute.run

            def flipping(*args: Any, **kwargs: Any) -> Any:
                out = run(*args, **kwargs)
                raw = dst["w"].numpy().view(np.uint64).reshape(-1)
                raw[[0, 1]] ^= np.uint64(1 << 63)    # the signs of elements 1 and 3
                return out

            execute.run = flipping
            rows.append(attempt(refit))
            execute.run = run
            rows.append(attempt(refit))
            rows.append(bool(np.array_equal(dst["w"].numpy(), value)))
    return [r if isinstance(r, (str, bool)) else r.version for r in rows]


@pytest.mark.slow
def test_verify_catches_two_sign_bits_flipped_on_the_way():
    results = launch(verify_child, [Role("jax", "trainer", 0, num_devices=1),
                                    Role("torch", "rollout", 0)], timeout=200)
    sent, got = results[0].value, results[1].value
    assert isinstance(sent[0], str) and sent[0].startswith("VerificationError"), sent[0]
    assert got[0] == sent[0] and "'w'" in sent[0]
    assert sent[1] == got[1] == 1 and got[2] is True      # the next call: exact, verified
