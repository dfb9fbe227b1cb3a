"""Who is in a world: join records bound to one instance of the world (a replayed record
never takes a member's slot), a wrong token refused at once, and processes that disagree
on ``num_processes`` all told the same ``WorldMismatch`` (issues "Trust, second pass"
items 3 and 13, "A newcomer's first hour" item 3). Real processes, real stores."""

from __future__ import annotations

import json
import time

import pytest

import xreshard as xr
from xreshard.runtime.store import connect
from xreshard.tools.launch import Context, Role, launch

pytestmark = pytest.mark.slow

TOKEN = "membership-token-1"


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:      # noqa: BLE001 - the test compares what each process raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"ok": value, "seconds": time.monotonic() - t0}


def _flag(ctx: Context, name: str, wait: bool = False) -> None:
    store = connect(ctx.address, 30)
    key = f"test/{name}"
    if wait:
        store.wait([key])
    else:
        store.set(key, "1")


# ---------------------------------------------------------------------------- replays

def members_once(ctx: Context) -> dict:
    """Two members join world "w" with the token; trainer[0] returns the raw join key."""
    with ctx.join(1, world_id="w", timeout=30, token=TOKEN) as world:
        world.barrier()
        raw = connect(ctx.address, 10).get("xreshard/w/join").decode()
        records = "".join(line + "\n" for line in raw.splitlines()
                          if line.startswith('{"kind"'))
        return {"raw": records, "ranks": list(world.rank_ids)}


def replayed(ctx: Context, old: str) -> dict:
    """An attacker who saw a world's join records once appends them to a new store's world
    with the same token and world_id before the members join; then the members join."""
    if ctx.role.group == "attacker":
        connect(ctx.address, 30).append("xreshard/w/join", old)
        _flag(ctx, "planted")
        return {}
    _flag(ctx, "planted", wait=True)
    out = {}
    out["join"] = _attempt(lambda: _join_and_gather(ctx, "w"))
    return out


def _join_and_gather(ctx: Context, world_id: str, token: str = TOKEN) -> list:
    with ctx.join(1, num_processes=2, world_id=world_id, timeout=60, token=token) as world:
        return world.allgather_json(f"{ctx.role.group}[{ctx.role.index}]")


def test_a_join_record_replayed_from_an_old_store_takes_no_slot():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    first = [r.value for r in launch(members_once, roles, timeout=120)]
    old = first[0]["raw"]
    assert old.count("\n") == 2
    values = [r.value for r in launch(replayed, roles + [Role("plain", "attacker", 0)],
                                      args=(old,), timeout=120)]
    for v in values[:2]:
        assert v["join"].get("ok") == ["rollout[0]", "trainer[0]"], v


def same_id_twice(ctx: Context) -> dict:
    """A world closes; the same processes join a world with the same id and token on the
    same store again (its old records are still there), then with another token."""
    out = {"first": _attempt(lambda: _join_and_gather(ctx, "again"))}
    out["second"] = _attempt(lambda: _join_and_gather(ctx, "again"))
    out["rotated"] = _attempt(lambda: _join_and_gather(ctx, "again", "a-new-token-3"))
    return out


def test_the_same_world_id_joins_again_after_its_world_closed():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    for v in (r.value for r in launch(same_id_twice, roles, timeout=120)):
        assert v["first"].get("ok") == ["rollout[0]", "trainer[0]"], v
        assert v["second"].get("ok") == ["rollout[0]", "trainer[0]"], v
        assert v["rotated"].get("ok") == ["rollout[0]", "trainer[0]"], v


def forged_instance(ctx: Context) -> dict:
    if ctx.role.group == "attacker":
        store = connect(ctx.address, 30)
        from xreshard.runtime.store import Seal
        key = f"xreshard/f/instance/{Seal(TOKEN.encode(), 'f').key_id()}"
        store.set(key, json.dumps({"kind": "instance", "op": 0, "process": -1,
                                   "body": json.dumps({"nonce": "ab" * 16, "store": ""}),
                                   "mac": "00" * 32}))
        _flag(ctx, "planted")
        return {}
    _flag(ctx, "planted", wait=True)
    return {"join": _attempt(lambda: _join_and_gather(ctx, "f"))}


def test_a_forged_instance_record_is_refused_by_name_not_waited_on():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "attacker", 0)]
    values = [r.value for r in launch(forged_instance, roles, timeout=120)]
    for v in values[:2]:
        assert v["join"]["error"] == "AuthenticationError", v
        assert "xreshard/f/instance/" in v["join"]["message"]
        assert v["join"]["seconds"] < 20        # refused, not timed out


# ---------------------------------------------------------------------------- tokens

def wrong_token(ctx: Context, intruder_tokens: list) -> dict:
    """The members form one world per token in ``intruder_tokens`` (world ids "w0",
    "w1", ...); the intruder tries to join world ``k`` with token ``k`` (another token,
    none), each world in use meanwhile."""
    ids = [f"w{k}" for k in range(len(intruder_tokens))]
    if ctx.role.group == "intruder":
        _flag(ctx, "formed", wait=True)
        out = {"joins": [_attempt(lambda: xr.World.join(
            ctx.address, "rollout", 1, num_processes=2, index=1, world_id=world_id,
            timeout=60, token=token)) for world_id, token in zip(ids, intruder_tokens)]}
        _flag(ctx, "intruder-done")
        return out
    worlds = [ctx.join(1, num_processes=2, world_id=world_id, timeout=30, token=TOKEN)
              for world_id in ids]
    if ctx.role.group == "trainer":
        _flag(ctx, "formed")
    _flag(ctx, "intruder-done", wait=True)      # the worlds are in use meanwhile
    out = {"ranks": [list(world.rank_ids) for world in worlds]}
    for world in worlds:
        world.close()
    return out


def test_a_wrong_token_is_refused_at_once_not_at_its_timeout():
    """Another token and no token, each against its own formed world: one launch for both
    (each attempt paid three processes' start)."""
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "intruder", 0)]
    tokens = ["another-token-2", None]
    values = [r.value for r in launch(wrong_token, roles, args=(tokens,), timeout=150)]
    assert values[0]["ranks"] == [[1]] * 2 and values[1]["ranks"] == [[0]] * 2
    joins = values[2]["joins"]
    assert len(joins) == len(tokens)
    for token, got in zip(tokens, joins):
        assert got["error"] == "AuthenticationError", (token, got)
        assert "refused at once" in got["message"], (token, got["message"])
        assert "2 record(s) are signed with another token" in got["message"], (token, got)
        assert got["seconds"] < 60, (token, got)        # its timeout: told before it


# ---------------------------------------------------------------------------- num_processes

def disagree(ctx: Context, orders: list) -> dict:
    """Each order in ``orders`` in its own world (world id = the order), one after another:
    order -> what this process saw."""
    return {order: _disagree(ctx, order == "late", order) for order in orders}


def _disagree(ctx: Context, ordered: bool, world_id: str) -> dict:
    """trainer[0] and rollout[0] pass num_processes=2, rollout[1] passes 3; then every
    process that joined runs collectives until something raises."""
    n = 3 if ctx.role.index == 1 else 2
    if ordered and n == 3:
        _flag(ctx, f"{world_id}/formed", wait=True)     # joins after the other two formed
    t0 = time.monotonic()
    out: dict = {}
    try:
        world = ctx.join(1, num_processes=n, timeout=20, world_id=world_id)
        if n == 2 and ctx.role.group == "trainer":
            _flag(ctx, f"{world_id}/formed")
        while time.monotonic() - t0 < 40:
            world.barrier(timeout=20)
        out["error"] = None
    except Exception as e:      # noqa: BLE001
        out.update(error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - t0
    return out


ORDERS = ["together", "late"]


@pytest.fixture(scope="module")
def disagreeing() -> dict:
    """order -> every process's values: both orders in one launch (a world each)."""
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    values = [r.value for r in launch(disagree, roles, args=(ORDERS,), timeout=150 * 2)]
    return {order: [v[order] for v in values] for order in ORDERS}


@pytest.mark.parametrize("order", ORDERS)
def test_processes_that_disagree_on_num_processes_all_raise_world_mismatch(order, disagreeing):
    values = disagreeing[order]
    assert {v["error"] for v in values} == {"WorldMismatch"}, values
    messages = {v["message"] for v in values}
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert "rollout[1] passed num_processes=3" in msg, msg
    assert "passed num_processes=2" in msg and "pass the same num_processes" in msg, msg
    assert all(v["seconds"] < 20 + 5 for v in values), values     # within the join timeout
    assert issubclass(xr.WorldMismatch, xr.RefitError)
