"""Delta refit composed with transactional destinations (``RefitConfig(delta=True,
atomic=True)``) and with FP8 destinations quantized on the way, between real processes:
a JAX trainer with NamedSharding arrays on a (2, 2) CPU mesh, torch DTensor receivers in
two processes over gloo; every receiver bit-compares every byte it holds after every call
(inside the children: tests/delta_compose_cases.py)."""

from __future__ import annotations

import pytest

from xreshard.tools.launch import Role, launch

from . import delta_compose_cases as cases

ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
         Role("torch", "rollout", 1)]

pytestmark = pytest.mark.slow


def test_atomic_deltas_and_a_failed_call_keeps_bases_valid():
    """Deltas land in the staging (refreshed from the live destinations) and commit once
    every process agreed. A call that fails (one receiver raises at its last apply)
    leaves every destination at the previous version bit for bit, and, since nothing was
    written and no baseline moved, the next call still goes as deltas to every receiver."""
    results = launch([cases.atomic_trainer, cases.atomic_rollout, cases.atomic_rollout],
                     ROLES, timeout=300)
    rows = results[0].value["rows"]
    assert ["error" in r for r in rows] == [False, False, True, False, False], rows
    assert "injected failure" in rows[2]["error"]
    first = rows[0]["delta"]
    assert first["pairs"] == 0 and first["bytes_wire"] == first["bytes_dense"]
    for r in (rows[1], rows[3], rows[4]):
        d = r["delta"]
        assert d["pairs"] == 6 and d["num_delta"] > 0, d
        assert d["bytes_wire"] < 0.2 * d["bytes_dense"], d      # the deltas were sent
        assert r["verified"] > 0                                 # full regions compared
    for res in results[1:]:
        out = res.value["rows"]
        assert [("error" in x) for x in out] == [False, False, True, False, False]
        assert out[2]["error"] == rows[2]["error"]               # the same everywhere
        assert all("wrong" not in x for x in out), out          # bit-exact, call 3 too
        assert out[2]["version"] == 2 and out[2]["stale"] is False
        assert [x["version"] for x in out] == [1, 2, 2, 3, 4]
        assert res.value["staging_bytes"] > 0 and res.value["checked"] > 0


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
        assert r["sent"] < 0.5 * dense["sent"], (r["sent"], dense["sent"])
    assert 0 < rows[3]["delta"]["pairs"] < full             # dense to rollout[1] only
    assert rows[3]["sent"] > rows[1]["sent"]
    for res in results[1:]:
        assert all("wrong" not in x for x in res.value["rows"]), res.value["rows"]
        assert res.value["checked"] > 0
