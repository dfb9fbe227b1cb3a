"""Waits that say who is missing, and that end as soon as some process knows they cannot
end well (issues "Trust, third pass" item 9, "A newcomer's second hour" item 1). Real
processes through xreshard.tools.launch; every world waits 120 s for the others, and each
launch's own bound is well below it: a process that waited for its timeout fails the test.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest

import xreshard as xr
from xreshard.runtime import waiting
from xreshard.runtime.store import connect
from xreshard.tools.launch import Context, Role, launch

from .test_membership import _attempt

PATIENT = 120       # every wait of these worlds; the launches end long before


def _flag(ctx: Context, name: str, wait: bool = False) -> None:
    store = connect(ctx.address, 30)
    if wait:
        store.wait([f"test/{name}"], datetime.timedelta(seconds=PATIENT))
    else:
        store.set(f"test/{name}", "1")


def test_waiting_lines_name_what_a_join_implies():
    assert waiting.missing_labels([("trainer", 0), ("rollout", 1)], 2) == [
        "rollout[0]", "1 more not joined yet"]
    assert waiting.missing_labels([("trainer", 0)], 2) == ["2 not joined yet"]
    assert waiting.missing_labels([("rollout", 3)], 1) == ["rollout[0]"]
    assert waiting.waiting_line(1, 3, ["a", "b"], ["c"]) == \
        "waiting for 1 of 3 processes (joined: a, b; missing: c)"


def test_a_process_refused_by_its_own_arguments_ends_the_others_join():
    """In one process, two threads: one joins and waits for a second process; the second
    passes num_processes=0. Both raise one WorldMismatch, the waiting one well before its
    60 s timeout (the thread is joined for 30)."""
    from xreshard.runtime.world import serve

    with serve() as server:
        got: dict = {}

        def waiter() -> None:
            got["waiter"] = _attempt(lambda: xr.World.join(
                server.address, "rollout", 1, num_processes=2, index=0, timeout=60))

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        got["zero"] = _attempt(lambda: xr.World.join(server.address, "trainer", 1,
                                                     num_processes=0, index=0, timeout=60))
        thread.join(30)
        assert not thread.is_alive(), "the waiting join never heard of the refusal"
    assert got["zero"]["error"] == got["waiter"]["error"] == "WorldMismatch", got
    assert got["zero"]["message"] == got["waiter"]["message"], got
    assert "num_processes must be >= 1" in got["zero"]["message"], got


def test_the_first_posted_end_holds_and_only_a_members_counts():
    from xreshard.runtime.store import Seal
    from xreshard.runtime.world import serve

    with serve() as server:
        store = connect(server.address, 10)
        seal, key = Seal(b"a-token-of-16-chars", "w", "n1"), waiting.ended_key("xreshard/w", "n1")
        assert waiting.read_end(store, seal, key) is None
        first = waiting.post_end(store, seal, key, 0, "CollectiveMismatch", "first")
        second = waiting.post_end(store, seal, key, 1, "TransportTimeout", "second")
        assert type(first) is type(second) is xr.CollectiveMismatch
        assert str(second) == "first" == str(waiting.read_end(store, seal, key))
        other = Seal(b"another-token-16-c", "w", "n1")     # not this world's token
        assert waiting.read_end(store, other, key) is None


# ---------------------------------------------------------------------------- waiting lines

def _free_port() -> int:
    with socket.socket() as s:      # nothing listens there once it is closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_at_join(ctx: Context, wrong: str) -> dict:
    """rollout[0] crashes before joining; rollout[2] was given a wrong store address;
    trainer[0] and rollout[1] join (4 processes) and wait 30 s."""
    if ctx.role.index == 0 and ctx.role.group == "rollout":
        os._exit(3)
    import torch.distributed  # noqa: F401 - its import (seconds under load) is not waited
    address = wrong if ctx.role.index == 2 else ctx.address
    if address == ctx.address:      # both start their join together: the first line names both
        _flag(ctx, f"ready/{ctx.role.group}")
        _flag(ctx, "ready/trainer", wait=True)
        _flag(ctx, "ready/rollout", wait=True)
    return _attempt(lambda: xr.World.join(address, ctx.role.group, 1, num_processes=4,
                                          index=ctx.role.index, timeout=30))


@pytest.mark.slow
def test_a_missing_peer_and_a_wrong_store_address_print_who_is_missing():
    """The processes that joined name who they wait for (rollout[0], implied by rollout[1],
    and one more), and the one with a wrong address names the store it cannot reach, on
    stderr piped to a file, while they wait (lines every 15 s; their timeout is 30 s)."""
    wrong = f"tcp://127.0.0.1:{_free_port()}"
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 1),
             Role("plain", "rollout", 0), Role("plain", "rollout", 2)]
    results = launch(missing_at_join, roles, args=(wrong,), timeout=90, check=False,
                     fail_fast=False)
    for r in results[:2]:
        assert r.value["error"] == "TransportTimeout", r.describe()
        line = next((x for x in r.output.splitlines() if "waiting for 2 of 4" in x), None)
        assert line is not None, r.output
        assert "processes (joined: " in line and "trainer[0]" in line, line
        assert "rollout[1]" in line.partition("missing")[0], line
        assert "missing: rollout[0], 1 more not joined yet" in line, line
    assert results[2].returncode == 3
    far = results[3]
    assert far.value["error"] == "TransportTimeout", far.describe()
    assert f"waiting for the rendezvous store at {wrong}" in far.output, far.output


# ---------------------------------------------------------------------------- peers gone

def peer_leaves(ctx: Context, how: str) -> dict:
    """Three processes join; rollout[0] then closes its world (``how`` = "close": it stays
    alive until the others are done), leaves its ``with`` block on a bad ``wire_dtype``
    ("refuse": the same, closing on the way out) or exits without closing ("exit"); the
    others call their first collective and report what it raised."""
    world = ctx.join(1, num_processes=3, timeout=PATIENT)
    if ctx.role.group == "rollout" and ctx.role.index == 0:
        if how == "exit":
            os._exit(0)
        if how == "refuse":
            with pytest.raises(xr.XreshardError, match="float13"), world:
                xr.RefitConfig(wire_dtype="float13")
        world.close()
        store = connect(ctx.address, 30)
        store.wait(["test/done/0", "test/done/1"], datetime.timedelta(seconds=PATIENT))
        return {}
    got = _attempt(lambda: world.allgather_json("first", kind="refit/identity"))
    connect(ctx.address, 30).set(f"test/done/{ctx.role.index}", "1")
    return got


ROLES3 = [Role("plain", "rollout", 0), Role("plain", "rollout", 1), Role("plain", "trainer", 0)]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "refuse"])
def test_a_peer_that_closed_its_world_ends_the_first_call_with_its_reason(how):
    """The others raise the closer's reason within the launch's 60 s (they would wait 120),
    though it still runs: the store told them, not its pid."""
    values = [r.value for r in launch(peer_leaves, ROLES3, args=(how,), timeout=60)]
    for v in values[1:]:
        assert v["error"] == "RefitError", v
        assert "rollout[0] (process 0" in v["message"], v
        assert "closed its world" in v["message"], v
        assert ("float13" in v["message"]) == (how == "refuse"), v
    assert values[1]["message"] == values[2]["message"]


@pytest.mark.slow
def test_a_peer_that_exited_without_closing_is_not_waited_for():
    """A member on this node whose process ended is found by its pid in any collective,
    not only in a refit's outcome exchange: the same error on every survivor."""
    results = launch(peer_leaves, ROLES3, args=("exit",), timeout=60, check=False,
                     fail_fast=False)
    values = [r.value for r in results[1:]]
    for v in values:
        assert v["error"] == "TransportError", v
        assert "rollout[0] (process 0" in v["message"] and "no longer runs" in v["message"], v
    assert values[0]["message"] == values[1]["message"]


def dies_while_joining(ctx: Context) -> dict:
    """rollout[0] appends its join record, then its process ends; the other two wait for a
    fourth process that never comes."""
    if ctx.role.group == "rollout" and ctx.role.index == 0:
        threading.Thread(target=lambda: ctx.join(1, num_processes=4, timeout=PATIENT),
                         daemon=True).start()
        store, mine = connect(ctx.address, 30), f'\\"pid\\": {os.getpid()},'.encode()
        while mine not in (store.get("xreshard/default/join")
                           if store.check(["xreshard/default/join"]) else b""):
            time.sleep(0.05)
        os._exit(0)
    return _attempt(lambda: ctx.join(1, num_processes=4, timeout=PATIENT))


@pytest.mark.slow
def test_a_joiner_that_died_before_the_world_formed_ends_the_join():
    results = launch(dies_while_joining, ROLES3, timeout=60, check=False, fail_fast=False)
    values = [r.value for r in results[1:]]
    for v in values:
        assert v["error"] == "TransportError", v
        assert "rollout[0]" in v["message"] and "joined and then exited" in v["message"], v
    assert values[0]["message"] == values[1]["message"]


# ------------------------------------------------------------------ join-time disagreements

def disagreements(ctx: Context, cases: list) -> dict:
    """One world per case of ``cases``, one after another; case -> what this process
    raised. Cases with two processes leave rollout[1] out."""
    me = f"{ctx.role.group}[{ctx.role.index}]"
    trainer = me == "trainer[0]"
    n = 0 if trainer else 2             # "zero": the trainer passes num_processes=0
    group = "trainr" if trainer else "rollout"      # "group": a typo in a group name
    steps = {
        "zero": lambda: ctx.join(1, num_processes=n, world_id="zero", timeout=PATIENT),
        "group": lambda: xr.World.join(ctx.address, group, 1, num_processes=2, index=0,
                                       groups=("trainer", "rollout"), world_id="group",
                                       timeout=PATIENT),
        "closed": lambda: _closed(ctx, trainer),
        "order": lambda: _out_of_order(ctx, trainer),
        "count": lambda: _count(ctx, me)}
    return {case: _attempt(steps[case]) for case in cases
            if case == "count" or me != "rollout[1]"}


def _closed(ctx: Context, trainer: bool) -> None:
    """The trainer closes its world, then both call a collective."""
    world = ctx.join(1, num_processes=2, world_id="closed", timeout=PATIENT)
    if trainer:
        world.close()
    world.barrier()


def _out_of_order(ctx: Context, trainer: bool) -> None:
    """The trainer (process 1) all-gathers while rollout[0] (process 0) waits for the
    trainer's broadcast: rollout[0] reads the other collective, the trainer waits on."""
    world = ctx.join(1, num_processes=2, world_id="order", timeout=PATIENT)
    if trainer:
        world.allgather_json(1)
    else:
        world.broadcast_json(None, root_process=1)


def _count(ctx: Context, me: str) -> None:
    """trainer[0] and rollout[0] pass num_processes=2 and form; rollout[1] passes 3 after
    that. rollout[0] then waits in a collective for the trainer, which is busy until
    rollout[0] is done (it learns the refusal while it waits, not when the trainer comes)."""
    if me == "rollout[1]":
        _flag(ctx, "count/formed", wait=True)
        ctx.join(1, num_processes=3, world_id="count", timeout=PATIENT)
        return
    if me == "trainer[0]":
        world = ctx.join(1, num_processes=2, world_id="count", timeout=PATIENT)
        _flag(ctx, "count/formed")
        _flag(ctx, "count/waited", wait=True)
        world.barrier()
        return
    try:    # (its join may see rollout[1]'s record already: it raises there)
        ctx.join(1, num_processes=2, world_id="count", timeout=PATIENT).barrier()
    finally:
        _flag(ctx, "count/waited")


CASES = ["zero", "group", "closed", "order", "count"]


@pytest.fixture(scope="module")
def disagreeing() -> dict:
    """case -> every process's result: all cases in one launch (a world each), well within
    the 120 s that any process waiting for its timeout would need for one case."""
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    values = [r.value for r in launch(disagreements, roles, args=(CASES,), timeout=100)]
    return {case: [v[case] for v in values if case in v] for case in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case, error, same_words", [
    ("zero", "WorldMismatch", True), ("group", "WorldMismatch", True),
    ("closed", "RefitError", False), ("order", "CollectiveMismatch", True),
    ("count", "WorldMismatch", True)])
def test_join_time_disagreements_fail_every_process_with_one_error(case, error, same_words,
                                                                   disagreeing):
    values = disagreeing[case]
    assert [v.get("error") for v in values] == [error] * len(values), values
    if same_words:
        assert len({v["message"] for v in values}) == 1, values
    text = values[0]["message"]
    expected = {"zero": "trainer[0] (pid", "group": "trainr[0]", "closed": "closed",
                "order": "out of step", "count": "rollout[1] passed num_processes=3"}[case]
    assert expected in text, text
