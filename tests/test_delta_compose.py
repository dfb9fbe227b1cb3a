"""Delta refit composed with transactional destinations (``RefitConfig(delta=True,
atomic=True)``) and with FP8 destinations quantized on the way, between real processes, in
the cases the combination matrix (tests/test_compose_matrix.py: delta x atomic x FP8 x
relay x verify x device kernels x executor, a failed call in each) does not reach: a
sender killed mid-move and restarted, a receiver claiming a base it does not hold, the
bytes a relayed delta forwards:
a JAX trainer with NamedSharding arrays on a (2, 2) CPU mesh, torch DTensor receivers in
two processes over gloo; every receiver bit-compares every byte it holds after every call
(inside the children: tests/delta_compose_cases.py)."""

from __future__ import annotations

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from . import delta_compose_cases as cases

ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
         Role("torch", "rollout", 1)]

pytestmark = pytest.mark.slow


def test_killed_sender_under_atomic_deltas_leaves_previous_version():
    """The trainer SIGKILLs itself after its first delta payload of call 3: both receivers
    raise, their destinations hold step 2 bit for bit (not stale); restarted, the trainer
    (no baselines) sends call 3 dense, then call 4 as deltas, exact."""
    roles = ROLES + [Role("jax", "spare", 0, num_devices=4)]
    results = launch([cases.kill_trainer, cases.kill_rollout, cases.kill_rollout,
                      cases.kill_trainer], roles, timeout=400, check=False, fail_fast=False)
    assert results[0].returncode == -9, results[0].output           # killed itself
    for res in results[1:3]:
        assert res.ok, res.traceback
        out = res.value["rows"]
        assert [("error" in x) for x in out] == [False, False, True, False, False], out
        assert all("wrong" not in x for x in out), out
        assert out[2]["version"] == 2 and out[2]["stale"] is False
    spare = results[3]
    assert spare.ok, spare.traceback
    again, later = spare.value["rows"]
    assert again["delta"]["pairs"] == 0 and later["delta"]["pairs"] == 6, spare.value
    assert later["delta"]["bytes_wire"] < 0.2 * later["delta"]["bytes_dense"]


def test_fp8_destinations_take_deltas_of_codes_and_scales():
    """A -> B -> A -> B with 1% of the bf16 elements changed: the FP8 items' codes and
    scales move as deltas of what was last sent (a changed block requantizes whole on the
    sender), split blocks' bf16 pieces travel raw; each receiver's codes and scales equal
    the quantizer's on the new whole tensors, and verify=True passes. Call 4: rollout[1]
    claims a base it does not hold, so it gets dense, still exact."""
    results = launch([cases.fp8_trainer, cases.fp8_rollout, cases.fp8_rollout], ROLES,
                     timeout=400)
    rows = results[0].value["rows"]
    assert all("error" not in r for r in rows), rows
    dense = rows[0]
    assert dense["delta"]["pairs"] == 0 and dense["quantized"]["fp8_sent"] > 0
    full = rows[1]["delta"]["pairs"]
    assert full > 0 and rows[2]["delta"]["pairs"] == full
    for r in rows[1:3]:
        assert r["delta"]["num_delta"] > 0 and r["verified"] > 0
        # the delta encoder quantizes every FP8 item of its pairs: none is quantized ahead
        assert r["ahead"] == {} or r["ahead"]["items"] == 0, r["ahead"]
        assert r["sent"] < 0.5 * dense["sent"], (r["sent"], dense["sent"])
    assert 0 < rows[3]["delta"]["pairs"] < full             # dense to rollout[1] only
    assert rows[3]["sent"] > rows[1]["sent"]
    for res in results[1:]:
        assert all("wrong" not in x for x in res.value["rows"]), res.value["rows"]
        assert res.value["checked"] > 0


def _vllm_sha(step: str) -> dict[str, list[str]]:
    """sha256 of vLLM's quantizer's codes and scales of each whole tensor of ``step`` (the
    bf16 bytes for a tensor not quantized)."""
    import hashlib

    from . import relay_compose_cases as relay_cases

    out = {}
    for name, a in cases.fp8_values(step, cases.RELAY_TENSORS).items():
        kind = cases.RELAY_TENSORS[name][1]
        arrays = [a] if kind is None else list(relay_cases.vllm_quantize(a, kind))
        out[name] = [hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
                     for x in arrays]
    return out


def test_relayed_fp8_deltas_atomic_failure_and_wrong_base():
    """Delta through a relay with atomic=True and FP8 destinations, verify=True: two
    replicas on one host, the trainer sends each relayed tensor to the host once and the
    replicas forward halves (FP8 codes and scales, bf16) to each other as deltas of what
    they last forwarded (tests/delta_compose_cases.py, "relay"). After every call both
    replicas hold vLLM's quantizer's bytes of the whole tensor; a failed call leaves the
    previous version and keeps every base valid (the next call is deltas); a replica with
    a wrong base gets dense from the trainer and from its forwarder, its own forwards
    stay deltas."""
    pytest.importorskip("vllm")

    results = launch([cases.relay_trainer, cases.relay_rollout, cases.relay_rollout], ROLES,
                     timeout=400, env={"XRESHARD_SHM": "0"})
    rows = results[0].value["rows"]
    fails = [k == cases.RELAY_FAILS - 1 for k in range(len(cases.RELAY_STEPS))]
    assert ["error" in r for r in rows] == fails, rows
    assert "injected failure" in rows[cases.RELAY_FAILS - 1]["error"]
    assert rows[0]["delta"]["pairs"] == 0
    full = rows[1]["delta"]["pairs"]
    assert full > 0 and rows[3]["delta"]["pairs"] == full, rows
    assert 0 < rows[4]["delta"]["pairs"] < full                         # dense to rollout[1]
    for k in (1, 3):
        assert rows[k]["sent"] < 0.5 * rows[0]["sent"] and rows[k]["verified"] > 0
    want = {step: _vllm_sha(step) for step in set(cases.RELAY_STEPS)}
    dense = [res.value["rows"][0]["forwarded"] for res in results[1:]]
    for me, res in enumerate(results[1:]):
        out = res.value["rows"]
        assert ["error" in x for x in out] == fails, out
        assert out[cases.RELAY_FAILS - 1]["error"] == rows[cases.RELAY_FAILS - 1]["error"]
        held = None
        for call, (step, x) in enumerate(zip(cases.RELAY_STEPS, out), 1):
            held = held if "error" in x else step
            assert x["held"] == want[held], (me, call, step)     # vLLM's bytes, bit for bit
        assert [x["version"] for x in out] == [1, 2, 2, 3, 4]
        assert out[2]["stale"] is False
        for k in (1, 3):    # every forward a delta: a few changed codes and scales
            assert out[k]["delta"]["pairs"] == 1 and out[k]["verified"] > 0
            assert 0 < out[k]["forwarded"] < 0.2 * dense[me], (out[k], dense[me])
            assert out[k]["posted"] == out[k]["forwarded"]
        assert out[4]["delta"]["pairs"] == (1 if me == 1 else 0)    # 0's forward into 1
        assert res.value["baseline_bytes"] == dense[me]       # what it forwards per call
    # the trainer's: all it sends, w's split blocks' bf16 pieces too (they are diffed)
    assert results[0].value["baseline_bytes"] == rows[0]["sent"]
