"""Delta refit (``RefitConfig(delta=True)``, issue 22 phase 2) between real processes: a JAX
trainer with NamedSharding arrays on a (2, 2) CPU mesh, torch DTensor receivers in two
processes; every receiver bit-compares every byte it holds after every call (a check
inside the children: tests/delta_cases.py). The fences: a receiver that claims a base it
does not hold, one whose memory was written outside xreshard, one that failed, one that
restarted (between calls, and killed during a delta call) always gets exact bytes."""

from __future__ import annotations

import pytest

import xreshard as xr
from xreshard.errors import RefitError
from xreshard.tools.launch import Role, launch

from . import delta_cases as cases

ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
         Role("torch", "rollout", 1)]


def _pairs(row: dict) -> int:
    return row["delta"]["pairs"]


def test_decision_needs_both_claims_of_one_call_and_the_current_digest():
    """Every process derives the same pairs from the same claims: a pair goes as a delta
    only when its sender and its receiver claim the same call and the current digest."""
    from types import SimpleNamespace
    from xreshard.ir.layout import Region
    from xreshard.planner.schedule import Bucket, Item, Schedule
    from xreshard.runtime.delta_wire import DeltaState

    lay = SimpleNamespace(dtype="bfloat16")
    item = Item("w", Region((0,), (8,)), 16)
    buckets = tuple(Bucket(0, r, 0, 0, (item,), 16) for r in (1, 2, 3))
    stage = SimpleNamespace(wire_dtypes={"w": "bfloat16"}, dst_layouts={"w": lay})
    prepared = SimpleNamespace(stages=(stage,), schedule=Schedule((buckets,), (), 16))
    state = DeltaState()
    digests = state.pair_digests(prepared)
    d = digests[(0, 1)]
    claims = [{"nonce": "a", "send": [[0, 1, "c1", d], [0, 2, "c1", d], [0, 3, "c1", d]]},
              {"nonce": "b", "recv": [[1, "c1", [[0, d]]], [2, "c0", [[0, d]]],
                                      [3, "c1", [[0, "other"]]]]}]
    call = state.begin(claims, prepared)
    assert call.pairs == {(0, 1)}                   # 2: another call; 3: another schedule
    assert call.call_id == state.begin(claims, prepared).call_id


def test_fence_checks_only_what_a_delta_may_write_and_a_local_failure_is_an_error(
        monkeypatch):
    """``refit/fence``: a tensor written outside xreshard since the last commit is refused;
    one that only buckets said dense write is not read; a failure while checking (here the
    checksum raising) is returned as an error entry (every process reaches the exchange),
    never raised on one process alone. Each refusal drops the claims."""
    from types import SimpleNamespace
    import numpy as np
    from xreshard.ir.layout import Region
    from xreshard.planner.schedule import Bucket, Item, Schedule
    from xreshard.runtime import delta_wire
    from xreshard.runtime.delta_fence import sums_of, where_of

    lay = SimpleNamespace(dtype="bfloat16")
    a, b = Item("a", Region((0,), (8,)), 16), Item("b", Region((0,), (8,)), 16)
    buckets = (Bucket(0, 1, 0, 0, (a,), 16), Bucket(0, 1, 0, 1, (b,), 16))
    stage = SimpleNamespace(wire_dtypes={"a": "bfloat16", "b": "bfloat16"},
                            dst_layouts={"a": lay, "b": lay})
    prepared = SimpleNamespace(stages=(stage,), schedule=Schedule((buckets,), (), 16),
                               quant=None)
    dst = SimpleNamespace(bindings={(1, "a"): np.zeros(8, np.uint16),
                                    (1, "b"): np.zeros(8, np.uint16)})

    committed = (where_of(dst), sums_of(dst))      # what the last call left

    def fenced(dense: list) -> tuple:
        state = delta_wire.DeltaState()
        d = state.pair_digests(prepared)[(0, 1)]
        state.base = {1: ("c1", {0: d})}
        state.memory = committed
        claims = [{"nonce": "x", "send": [[0, 1, "c1", d]], "dense": dense},
                  {"nonce": "y", "recv": [[1, "c1", [[0, d]]]]}]
        return state, state.fence(claims, prepared, dst)

    assert fenced([])[1] == []
    dst.bindings[(1, "b")][3] = 1                   # written outside xreshard
    state, found = fenced([])
    assert len(found) == 1 and "written outside xreshard" in found[0][1] and not state.base
    assert fenced([[0, 1, 1]])[1] == []             # b's only bucket said dense: not read
    monkeypatch.setattr(delta_wire, "sums_of", lambda *a: 1 / 0)
    state, found = fenced([])
    assert found[0][0] == "RefitError" and "ZeroDivisionError" in found[0][1]
    assert not state.base and state.memory is None


def test_amostly_changed_bucket_skips_the_diff():
    import numpy as np
    from xreshard.runtime.delta_encode import mostly_changed

    old = np.zeros(1 << 20, np.uint16)
    assert mostly_changed(old, [old + 1])
    assert mostly_changed(old, [old[:1000] + 1, old[1000:] + 1])    # in parts, as items
    new = old.copy()
    new[::100] = 1
    assert not mostly_changed(old, [new])
    assert not mostly_changed(old, [new[:(1 << 19) + 7], new[(1 << 19) + 7:]])


def test_config_takes_relay_refuses_non_bool():
    # a relayed delta refit: tests/test_relay_compose.py
    assert xr.RefitConfig(delta=True, relay="auto").relay == "auto"
    with pytest.raises(RefitError, match="delta must be a bool"):
        xr.RefitConfig(delta=1)


@pytest.mark.slow
@pytest.mark.parametrize("cast", [False, True])
def test_deltas_call_after_call_bit_exact(cast):
    """The first call seeds the baselines (dense); each later one sends only the changes.
    With an fp32 -> bf16 ``wire_dtype`` the baseline is the cast bytes: fp32 changes that do
    not move the bf16 value are not sent (only the 32-byte headers go)."""
    results = launch([cases.trainer, cases.rollout, cases.rollout], ROLES,
                     args=("steady", cast), timeout=200)
    rows = results[0].value["rows"]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    first, later = rows[0]["delta"], [r["delta"] for r in rows[1:]]
    assert first["pairs"] == 0 and first["bytes_wire"] == first["bytes_dense"]
    for d in later:
        assert d["pairs"] == 6 and d["num_delta"] > 0
        assert d["bytes_wire"] < 0.2 * d["bytes_dense"]
        if cast:
            assert d["bytes_wire"] == 32 * d["num_delta"]       # headers only
    assert results[0].value["baseline_bytes"] == first["bytes_dense"]
    assert all(r["verified"] > 0 for r in rows)        # verify=True compared full regions
    for r in results[1:]:
        assert all("wrong" not in row and "error" not in row for row in r.value["rows"])
        assert r.value["checked"] > 0
        # what the receivers took off the wire is what the trainer put on it
    assert sum(r.value["rows"][1]["received"] for r in results[1:]) == rows[1]["sent"]


@pytest.mark.slow
def test_fences_wrong_base_outside_write_failed_call():
    results = launch([cases.trainer, cases.rollout, cases.rollout], ROLES,
                     args=("fences",), timeout=250)
    rows = results[0].value["rows"]
    assert _pairs(rows[1]) == 6
    assert _pairs(rows[2]) == 3                 # rollout[1]'s claim is wrong: dense to it
    assert "written outside xreshard" in rows[3]["error"]
    assert _pairs(rows[4]) == 3                 # rollout[0] dense after its outside write
    assert "injected failure" in rows[5]["error"]
    # the failed call (no atomic) left the trainer's baselines and claims as they were
    baselines = results[0].value["baselines"]
    assert baselines[5] == baselines[4] and all(c is not None for _, c, _ in baselines[5])
    assert _pairs(rows[6]) == 0                 # the receivers' in-place bases: dense
    assert _pairs(rows[7]) == 6
    for r in results[1:]:
        out = r.value["rows"]
        assert [("error" in x) for x in out] == [False, False, False, True, False, True,
                                                 False, False]
        assert out[3]["error"] == rows[3]["error"]          # the same error everywhere
        assert all("wrong" not in x for x in out), out
        assert r.value["checked"] > 0


@pytest.mark.slow
def test_restarted_receivers_get_dense_survivors_deltas():
    roles = ROLES + [Role("torch", "spare", 0), Role("torch", "spare", 1)]
    results = launch([cases.restart_trainer] + [cases.restart_rollout] * 4, roles,
                     timeout=420, check=False, fail_fast=False)
    assert results[2].returncode == 3 and results[3].returncode == 3    # the two that died
    rows = results[0].value["rows"]
    assert [_pairs(r) if "error" not in r else None for r in rows] == [0, 6, 3, 6, None, 0, 6]
    survivor, last = results[1].value, results[4].value
    assert sum("error" in x for x in survivor["rows"]) == 1
    assert survivor["checked"] > 0
    assert not any("error" in x for x in last["rows"]) and last["checked"] > 0
