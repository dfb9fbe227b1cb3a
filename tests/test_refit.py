"""End-to-end refits between real processes on CPU: JAX, torch DTensors, gloo."""

from __future__ import annotations

import pytest

from xreshard.runtime.commcount import CommCounts
from xreshard.tools.launch import Role, launch

from . import refit_cases as cases

pytestmark = pytest.mark.slow


def _roles(num_torch: int, torch_kind: str = "torch") -> list[Role]:
    return [Role("jax", "trainer", 0, num_devices=4)] + [
        Role(torch_kind, "rollout", i) for i in range(num_torch)]


#: the cases run by one JAX trainer (4 devices) and two torch processes, one world each in
#: one launch (``cases.series``): name -> (trainer function, rollout function, args). One
#: launch instead of six: each paid three processes' start (JAX and torch imports) for a
#: few seconds of refits.
SHARED = {
    "jax_to_torch": ("jax_sender", "torch_receiver", ("float32", "float32", 2)),
    "cast_on_sender": ("jax_sender", "torch_receiver", ("float32", "bfloat16", 1, "bfloat16")),
    "small_buckets": ("jax_sender", "torch_receiver",
                      ("float32", "float32", 1, None,
                       {"bucket_bytes": 1 << 16, "staging_bytes": 1 << 16})),
    "rules": ("jax_rules_sender", "torch_rules_receiver", (2,)),
    "torch_to_jax": ("jax_receiver", "torch_sender", (2,)),
    "bad_inputs": ("bad_inputs", "bad_inputs", ()),
}


@pytest.fixture(scope="module")
def shared():
    """name -> every process's value of that case (``_roles(2)``: trainer first)."""
    programs = [[name, t, r, list(args)] for name, (t, r, args) in SHARED.items()]
    results = launch(cases.series, _roles(2), args=(programs,), timeout=150 * 3)
    runs = [r.value for r in results]

    def get(name: str) -> list:
        for res, run in zip(results, runs):
            if "error" in run[name]:
                pytest.fail(f"{name} on {res.role.label}:\n{run[name]['error']}")
        return [run[name]["value"] for run in runs]
    return get


def _check_jax_to_torch(sender: dict, receivers: list) -> None:
    assert sender["bytes_moved"] == sender["bytes_min"]
    assert [r["replanned"] for r in sender["reports"]] == [True, False]
    assert all(r["version"] == 2 for r in receivers)
    # bytes through the wire == the plan's bytes (receivers count what they received)
    assert sum(r["received"] for r in receivers) == sender["bytes_moved"]
    # ... and what the transports counted, pair by pair, on both ends (the last call)
    sent = CommCounts.pairs_from_json(sender["reports"][-1]["counted"]["bytes_sent"])
    received = {}
    for r in receivers:
        assert r["counted"]["bytes_sent"] == {}
        received.update(CommCounts.pairs_from_json(r["counted"]["bytes_received"]))
    assert sent == received and sum(sent.values()) == sender["reports"][-1]["sent"]
    assert sum(sent.values()) == sender["bytes_moved"]


def test_jax_to_torch_bit_exact(shared):
    sender, *receivers = shared("jax_to_torch")
    _check_jax_to_torch(sender, receivers)


def test_jax_to_three_torch_processes_bit_exact():
    roles = _roles(3)
    fns = [cases.jax_sender] + [cases.torch_receiver] * 3
    results = launch(fns, roles, args=("float32", "float32", 2), timeout=150)
    _check_jax_to_torch(results[0].value, [r.value for r in results[1:]])


def test_jax_fp32_to_torch_bf16_cast_on_sender(shared):
    sender, *receivers = shared("cast_on_sender")
    # the wire carries bf16: half the fp32 bytes
    assert sender["bytes_moved"] == sum(r["received"] for r in receivers)


def test_small_buckets_and_staging_still_exact(shared):
    sender, *receivers = shared("small_buckets")     # every receiver checked its bytes
    assert all(r["version"] == 1 and r["checked"] for r in receivers)


def test_jax_tree_named_by_rules_to_torch(shared):
    """``Refit(rules=...)``: trainer paths mapped onto HF tensors (a [D, H, hd] kernel reshaped
    and transposed, an [in, out] kernel transposed) as views of the JAX shards, bit-exact."""
    sender, *receivers = shared("rules")
    assert sender["names"] == sorted(cases.RULES_HF)
    assert sender["replanned"] == [True, False]
    assert all(r["version"] == 2 for r in receivers)


def test_torch_to_jax(shared):
    assert shared("torch_to_jax")[0] == {"version": 2, "devices": 4}


def test_jax_to_jax_across_processes():
    roles = [Role("jax", "trainer", 0, num_devices=2), Role("jax", "rollout", 0, num_devices=2)]
    results = launch(cases.jax_to_jax, roles, timeout=120)
    assert [r.value["version"] for r in results] == [1, 1]


def test_torch_to_torch_across_meshes():
    roles = [Role("torch", "trainer", i) for i in range(2)] + [
        Role("torch", "rollout", i) for i in range(3)]
    results = launch(cases.torch_to_torch, roles, timeout=120)
    assert all(r.value["version"] == 1 for r in results)


def test_bad_input_raises_same_error_on_every_rank_before_moving(shared):
    outs = shared("bad_inputs")
    for case in ("names", "shape", "dtype", "uncovered"):
        # the same message on every process
        assert len({o[case] for o in outs}) == 1, (case, [o[case] for o in outs])
    msg = outs[0]
    assert "1 tensor(s) only on the source side: 'b'" in msg["names"]
    assert "1 tensor(s) only on the destination side: 'c'" in msg["names"]
    assert "shape mismatch in 1 tensor(s): 'a' source (4, 4) vs destination (5, 4)" in msg["shape"]
    assert "dtype mismatch in 1 tensor(s) and no cast requested: 'c' source float32 vs " \
           "destination bfloat16" in msg["dtype"]
    assert "tensor 'a': destination rank" in msg["uncovered"]
    assert "no source rank holds it" in msg["uncovered"]
    assert all(o["good"] == "no error" for o in outs)


def test_peer_killed_mid_refit_others_raise_within_timeout():
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [Role("torch", "rollout", i) for i in range(2)]
    timeout = 5.0
    results = launch(cases.dies_mid_refit, roles, args=(timeout,), timeout=120, check=False,
                     fail_fast=False)
    assert results[2].returncode == 3            # the one that died
    for live in (results[0], results[1]):
        assert live.ok, live.describe()
        v = live.value
        assert v["error"] != "no error"
        assert v["seconds"] < timeout + 5, v      # bounded: one timeout plus the grace
        assert v["version"] == 0 and v["stale"] is True
