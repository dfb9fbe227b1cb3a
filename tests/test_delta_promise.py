"""A delta call whose buckets mostly changed: their sender says so at ``refit/check``, so
they go dense without a header, their receivers do not fence them (a tensor overwritten
whole needs no base), the sender drops their baselines (keeping a sample) and the receiver
does not checksum what only they wrote. The first sparse call after that goes dense too
(no baseline to diff) and keeps the baselines; the next sends deltas, and a tensor a delta
may apply to is fenced: one written outside xreshard is refused on every process before
any byte moves (``delta_wire.DeltaState.fence``).

Real processes: a JAX trainer (one CPU device) and a torch receiver (plain CPU tensors),
over gloo; the receiver compares every byte after every call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from .delta_cases import attempt

#: two bf16 tensors, one bucket each; 64 Ki elements: large enough to be sampled
SHAPE, NAMES = (256, 256), ("a", "b")
#: call -> (fraction of elements changed since the last call, the receiver writes "a"
#: outside xreshard first)
#: a bucket's sample (delta_encode.sample: 16 blocks of 2,048 bf16 elements)
SAMPLE_BYTES = 16 * 2048 * 2
CALLS = [(1.0, False), (1.0, False), (1.0, True), (0.01, False), (0.01, False), (0.01, True),
         (0.01, False), (0.01, False)]


def versions() -> list[dict[str, np.ndarray]]:
    """Each call's bf16 bits of every tensor (uint16)."""
    rng = np.random.default_rng(7)
    now = {n: rng.integers(0, 0x3F00, SHAPE, dtype=np.uint16) for n in NAMES}
    out = []
    for fraction, _ in CALLS:
        now = {n: v.copy() for n, v in now.items()}
        for v in now.values():
            flat = v.reshape(-1)
            idx = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
            flat[idx] ^= 1
        out.append(now)
    return out


def child(ctx: Any) -> list:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(delta=True, transport="gloo", timeout=60,
                            bucket_bytes=SHAPE[0] * SHAPE[1] * 2)
    rows: list = []
    made = versions()
    if trainer:
        import jax
        import jax.numpy as jnp

        refit = xr.Refit(world, send=None, config=config)
        for v in made:
            send = {n: jax.device_put(jnp.asarray(a).view(jnp.bfloat16)) for n, a in v.items()}
            got = attempt(lambda: refit(send=send))
            rows.append(got if isinstance(got, str) else dict(got.delta))
    else:
        import torch

        dst = {n: torch.zeros(SHAPE, dtype=torch.bfloat16) for n in NAMES}
        refit = xr.Refit(world, receive=dst, config=config)
        for (_, outside), v in zip(CALLS, made):
            if outside:
                with torch.no_grad():
                    dst["a"][0, 0] += 1
            got = attempt(refit)
            exact = all(np.array_equal(dst[n].view(torch.uint16).numpy(), v[n]) for n in NAMES)
            rows.append(got if isinstance(got, str) else {"exact": exact})
    world.close()
    return rows


@pytest.mark.slow
def test_mostly_changed_buckets_go_dense_unfenced_sparse_ones_stay_fenced():
    results = launch(child, [Role("jax", "trainer", 0, num_devices=1),
                             Role("torch", "rollout", 0)], timeout=200)
    sent, got = results[0].value, results[1].value
    bucket = SHAPE[0] * SHAPE[1] * 2
    # 1: seeds (dense); 2, 3: every element changed: said dense at refit/check, no headers
    # (the wire carries exactly the dense bytes), and the outside write before 3 is no error:
    # "a" goes whole; the baselines are dropped (a sample of each bucket kept)
    assert sent[0]["pairs"] == 0 and sent[0]["baseline_bytes"] == 2 * bucket
    for d in sent[1:3]:
        assert d["pairs"] == 1 and d["num_delta"] == 0
        assert d["bytes_wire"] == d["bytes_dense"] == 2 * bucket
        assert d["baseline_bytes"] == 2 * SAMPLE_BYTES        # the samples only
    # 4: sparse, but no baseline to diff: dense, said so (no headers), baselines kept again
    assert sent[3]["num_delta"] == 0 and sent[3]["bytes_wire"] == 2 * bucket
    assert sent[3]["baseline_bytes"] == 2 * bucket
    assert got[:4] == [{"exact": True}] * 4
    # 5: deltas, each after its 32-byte header
    assert sent[4]["num_delta"] == 2 and sent[4]["bytes_wire"] < 0.1 * bucket
    # 6: "a" written outside xreshard before a sparse call: refused on both processes
    assert isinstance(sent[5], str) and "written outside xreshard" in sent[5]
    assert got[5] == sent[5]
    # 7: dense again (the claims went with the refusal), exact; 8: deltas again
    assert sent[6]["num_delta"] == 0 and got[6] == {"exact": True}
    assert sent[7]["num_delta"] == 2 and got[7] == {"exact": True}
