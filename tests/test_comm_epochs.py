"""Communicators and plans across epochs: the pure state machine
(``xreshard.runtime.comm_epochs``), templates carried through a renumbering
(``xreshard.planner.renumber``), and real gloo links kept, made and dropped by it in real
processes when an engine process leaves and another joins."""

from __future__ import annotations

import pytest

import xreshard as xr
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.planner.renumber import renumbered_layout, renumbered_template
from xreshard.planner.templates import PlanCache, build_template
from xreshard.runtime.comm_epochs import (GLOO, Abilities, decide, member_id, plan_epoch,
                                          renumbering)
from xreshard.tools.launch import Role, launch

from . import comm_epoch_cases as cases

NCCL = Abilities(shrink=True, grow=True, split=True, name="nccl")
SPLIT_ONLY = Abilities(split=True, name="nccl")


# ---------------------------------------------------------------------------- state machine

@pytest.mark.parametrize("abilities, old, new, alive, action", [
    (GLOO, ("a", "b"), ("a", "b"), "ab", "keep"),
    (GLOO, ("a", "b"), ("b", "a"), "ab", "keep"),          # same members: the old order
    (GLOO, None, ("a", "b"), "ab", "create"),
    (GLOO, ("a", "b"), ("a",), "a", "drop"),
    (GLOO, ("a", "b", "c"), ("a", "c"), "ac", "recreate"),
    (NCCL, ("a", "b", "c"), ("a", "c"), "ac", "shrink"),
    (NCCL, ("a", "b"), ("a", "b", "c"), "abc", "grow"),
    (NCCL, ("a", "b", "c"), ("a", "c", "d"), "acd", "shrink+grow"),
    (SPLIT_ONLY, ("a", "b", "c"), ("a", "c"), "abc", "split"),      # b alive: takes part
    (SPLIT_ONLY, ("a", "b", "c"), ("a", "c"), "ac", "recreate"),    # b died: cannot split
    (SPLIT_ONLY, ("a", "b"), ("a", "b", "c"), "abc", "recreate"),
    (NCCL, ("a", "b"), ("b", "c"), "bc", "recreate"),               # one stays: nothing kept
])
def test_decide(abilities, old, new, alive, action):
    step = decide("k", old, new, alive, abilities)
    assert step.action == action
    assert step.touched == (action != "keep")


def test_shrink_and_grow_say_the_ranks_the_library_gives():
    step = decide("k", ("a", "b", "c", "d"), ("a", "c", "d"), "acd", NCCL)
    # ncclCommShrink closes the gaps in the old order; b died: abort its pending work
    assert (step.members, step.excluded, step.abort) == (("a", "c", "d"), (1,), True)
    assert step.rank_map == {0: 0, 2: 1, 3: 2}
    left = decide("k", ("a", "b", "c"), ("a", "c"), "abc", NCCL)
    assert left.abort is False      # b left cleanly (still reachable): no abort
    grown = decide("k", ("a", "b"), ("x", "a", "b"), "xab", NCCL)
    # ncclCommGrow: existing ranks keep their numbers, the new one is appended
    assert (grown.members, grown.added, grown.rank_map) == (("a", "b", "x"), ("x",),
                                                           {0: 0, 1: 1})
    both = decide("k", ("a", "b", "c"), ("a", "c", "d"), "acd", NCCL)
    assert (both.members, both.excluded, both.added) == (("a", "c", "d"), (1,), ("d",))


def test_plan_epoch_covers_old_and_new_communicators():
    steps = plan_epoch({"ab": ("a", "b"), "ac": ("a", "c")}, {"ab": ("a", "b"), "ad": ("a", "d")},
                       "abd")
    assert {k: s.action for k, s in steps.items()} == {"ab": "keep", "ac": "drop",
                                                       "ad": "create"}


def _info(group, index, pid, ranks):
    return {"group": group, "index": index, "pid": pid, "ranks": list(ranks)}


def test_renumbering_follows_process_instances():
    old = [_info("rollout", 0, 10, [0]), _info("rollout", 1, 11, [1]),
           _info("trainer", 0, 12, [2, 3])]
    new = [_info("rollout", 1, 11, [0]), _info("trainer", 0, 12, [1, 2])]
    assert renumbering(old, new) == {1: 0, 2: 1, 3: 2}
    restarted = [_info("rollout", 1, 99, [0]), _info("trainer", 0, 12, [1, 2])]
    assert renumbering(old, restarted) == {2: 1, 3: 2}       # a new pid: a new member
    assert member_id(old[0]) == "rollout[0]#10"


# ---------------------------------------------------------------------------- plans

def _lay(ranks, placement, shape=(12, 8)):
    return xr.Layout.from_placements(shape, "float32", xr.Mesh((len(ranks),), ranks),
                                     [placement])


def test_a_renumbered_template_is_the_template_of_the_renumbered_layouts():
    ranks = {2: 0, 3: 1, 5: 2, 6: 3}
    for src, dst in [(_lay((2, 3), "S0"), _lay((5, 6), "S1")),
                     (_lay((2, 3), "S0"), _lay((3, 5, 6), "S0")),        # colocated rank 3
                     (_lay((2, 3, 5), "S1"), _lay((6,), "R"))]:
        old = build_template(src, dst, "t", [])
        new_src, new_dst = renumbered_layout(src, ranks), renumbered_layout(dst, ranks)
        assert renumbered_template(old, ranks) == build_template(new_src, new_dst, "t", [])
    assert renumbered_layout(_lay((2, 4), "S0"), ranks) is None       # rank 4 left


def test_after_an_epoch_change_only_touched_tensors_are_planned_again():
    # epoch 0: rollout[0] = rank 0, rollout[1] = rank 1, trainer = ranks 2, 3
    # "b" has another shape than "a": on one rank its split is no split, and the two
    # would share a template
    src, src_b = _lay((2, 3), "S0"), _lay((2, 3), "S0", (12, 6))
    old = {"a": (src, _lay((1,), "R")), "b": (src_b, _lay((0, 1), "S1", (12, 6)))}
    cache = PlanCache()
    options = CallOptions()

    def plan(pairs):
        before = (cache.tensors_planned, cache.tensors_reused)
        prepared = prepare({n: p[0] for n, p in pairs.items()},
                           {n: p[1] for n, p in pairs.items()}, None, options,
                           ranks=range(4), cache=cache)
        return prepared, (cache.tensors_planned - before[0], cache.tensors_reused - before[1])

    plan(old)
    # rollout[0] left: rollout[1] -> rank 0, trainer -> ranks 1, 2
    cache.renumber({1: 0, 2: 1, 3: 2})
    src, src_b = _lay((1, 2), "S0"), _lay((1, 2), "S0", (12, 6))
    new = {"a": (src, _lay((0,), "R")), "b": (src_b, _lay((0,), "S1", (12, 6)))}
    incremental, counts = plan(new)
    assert counts == (1, 1) and cache.carried == 1      # "a" reused, "b" planned again
    fresh = prepare({n: p[0] for n, p in new.items()}, {n: p[1] for n, p in new.items()},
                    None, options, ranks=range(3), cache=PlanCache())
    assert incremental.plan.transfers_for(0) == fresh.plan.transfers_for(0)
    assert incremental.plan.stats.bytes_moved == fresh.plan.stats.bytes_moved


# ---------------------------------------------------------------------------- real processes

@pytest.mark.slow
def test_gloo_links_untouched_by_a_change_are_kept(tmp_path):
    """rollout[0] leaves, then rollout[2] joins: trainer[0] and rollout[1] keep their link
    (the same gloo group object, no new group made), the links to rollout[0] are dropped,
    those to rollout[2] made; tensor "a" (trainer -> rollout[1]) is not planned again;
    every call is exact."""
    pytest.importorskip("torch")
    roles = [Role("plain", "rollout", 0), Role("plain", "rollout", 1),
             Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 2)]
    results = launch(cases.member, roles, args=(str(tmp_path / "flag"),), timeout=300,
                     check=False, fail_fast=False)
    for res in results:
        assert res.ok, res.describe()
    r0, r1, trainer, r2 = (res.value for res in results)
    assert [c["exact"] for c in r0["calls"]] == [True]
    for v in (r1, trainer):
        c1, c2, c3 = v["calls"]
        assert [c["version"] for c in v["calls"]] == [1, 2, 3]
        assert all(c["exact"] for c in v["calls"])
        assert c1["counts"] == {"create": 2} and c1["made"] == 2
        ab = next(k for k in c1["links"] if "rollout[1]" in k and "trainer[0]" in k)
        # rollout[0] left: the trainer-rollout[1] link is kept, the same object
        assert c2["steps"][ab] == "keep" and c2["links"][ab] == c1["links"][ab]
        assert sorted(c2["steps"].values()) == ["drop", "keep"]
        assert c2["made"] == 2                      # no gloo group made for the change
        assert (c2["planned"], c2["reused"]) == (1, 1)     # "b" planned again, "a" reused
        # rollout[2] joined: the link kept again, one new link made
        assert c3["steps"][ab] == "keep" and c3["links"][ab] == c1["links"][ab]
        assert sorted(c3["steps"].values()) == ["create", "keep"] and c3["made"] == 3
        assert (c3["planned"], c3["reused"]) == (1, 1)
        assert c3["epoch"] == 2
    assert r2["exact"] and r2["version"] == 3
    assert sorted(r2["steps"].values()) == ["create", "create"] and r2["made"] == 2
