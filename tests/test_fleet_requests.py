"""Join and leave requests of an elastic world as an attacker or a careless user writes
them (issue "Fleets that change", items 1-2, and the "Trust" rules): a join whose process
gave up or died before it was admitted never becomes a member (nobody waits on it), a
leave from anyone but a current member never moves the epoch, a second process with a
member's label and a process with the wrong token are refused at once, and a process that
calls ``leave()`` during a call finishes the call first. In every case the members' calls
stay exact, and a real joiner is still admitted afterwards. Real processes, real store."""

from __future__ import annotations

import os
import threading
import time

import pytest

import xreshard as xr
from xreshard.runtime import epochs
from xreshard.runtime.store import Seal, connect
from xreshard.tools.launch import Context, Role, launch

from . import elastic_cases as cases

pytestmark = pytest.mark.slow

TOKEN = "fleet-requests-token"
GROUPS = ["trainer", "rollout"]
CONFIG_TIMEOUT = 20


def _flag(ctx: Context, name: str, wait: bool = False) -> None:
    store = connect(ctx.address, 60)
    if wait:
        store.wait([f"test/{name}"])
    else:
        store.set(f"test/{name}", "1")


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:      # noqa: BLE001 - the test compares what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"ok": value, "seconds": time.monotonic() - t0}


def _fake(label: str, pid: int, host: str = "elsewhere") -> dict:
    group, index = label[:-1].split("[")
    return {"group": group, "index": int(index), "host": host, "pid": pid, "num_ranks": 1,
            "device_kinds": ["cpu"], "devices": ["cpu"], "start": "123"}


def _join(ctx: Context, **kw):
    kw.setdefault("token", TOKEN)
    kw.setdefault("timeout", 60)
    return xr.World.join(ctx.address, "rollout", 1, index=1, num_processes=2,
                         world_id="w", groups=GROUPS, elastic=True, **kw)


def _scenario(ctx: Context, store, base: Seal, scenario: str, step: int) -> dict | None:
    """What the third process does as ``scenario`` (between the members' calls ``step``
    and ``step + 1``); the result of its own attempt to join, if it made one."""
    out: dict = {}
    if scenario == "gave-up":       # asked in, no member refit came in time, still alive
        out["first"] = _attempt(lambda: _join(ctx, timeout=2))
    elif scenario == "died-elsewhere":      # asked in from another host, then died
        epochs.request(store, base, "join", _fake("rollout[1]", 999_999))
    elif scenario == "stray-leaves":
        epochs.request(store, base, "leave", _fake("rollout[7]", 999_998))       # no member
        epochs.request(store, base, "leave", _fake("rollout[0]", 999_997,        # an old one
                                                   os.uname().nodename))
        raw = store.get("xreshard/w/requests").decode().splitlines()[-1]
        store.append("xreshard/w/requests", raw + "\n")                         # replayed
        store.append("xreshard/w/requests", "garbage\n")
        epochs.request(store, Seal(b"another-token", "w"), "leave", _fake("trainer[0]", 1))
    elif scenario == "twice":       # a second process as rollout[0], a member's label
        old = {r["id"] for r in epochs.read_requests(store, base)}
        thread = threading.Thread(target=lambda: out.update(first=_attempt(
            lambda: xr.World.join(ctx.address, "rollout", 1, index=0, num_processes=2,
                                  world_id="w", groups=GROUPS, elastic=True, token=TOKEN,
                                  timeout=30))))
        thread.start()
        while not any(r["info"]["pid"] == os.getpid() and r["id"] not in old
                      for r in epochs.read_requests(store, base)):
            time.sleep(0.05)
        _flag(ctx, f"done{step}")      # the members' next call sees it
        thread.join()
    elif scenario == "wrong-token":
        out["first"] = _attempt(lambda: _join(ctx, token="not-the-token", timeout=30))
    return out.get("first")


def outsider(ctx: Context, scenarios: list) -> dict:
    """What the third process does between the members' calls: scenario ``k`` between
    call ``k + 1`` and ``k + 2``, each in a world the earlier ones already tried; then it
    joins for real (as rollout[1]) and takes part in the last call."""
    store = connect(ctx.address, 30)
    base = Seal(TOKEN.encode(), "w")
    out: dict = {"first": {}}
    for step, scenario in enumerate(scenarios, 1):
        _flag(ctx, f"v{step}", wait=True)
        out["first"][scenario] = _scenario(ctx, store, base, scenario, step)
        _flag(ctx, f"done{step}")
    _flag(ctx, "last", wait=True)
    world = _join(ctx)
    side = cases.Receiver()
    refit = xr.Refit(world, receive=xr.Rebuilt(side.build),
                     config=xr.RefitConfig(timeout=CONFIG_TIMEOUT))
    report = refit()
    out.update(version=report.version, exact=side.exact(report.version),
               epoch=world.epoch, members=list(world.members))
    world.close()
    return out


def member(ctx: Context, scenarios: list) -> dict:
    """trainer[0] or rollout[0]: one call, then one more after each of the outsider's
    ``scenarios``, then the last call once the outsider asked to join for real."""
    world = ctx.join(num_processes=2, world_id="w", groups=GROUPS, elastic=True, token=TOKEN,
                     timeout=60)
    trainer = ctx.role.group == "trainer"
    side = cases.Sender() if trainer else cases.Receiver()
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=CONFIG_TIMEOUT), **{
        ("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    calls = []
    last = len(scenarios) + 2
    for version in range(1, last + 1):
        if 1 < version < last:
            _flag(ctx, f"v{version - 1}")
            _flag(ctx, f"done{version - 1}", wait=True)
        if version == last:
            # the calls before acted on every earlier join request (consumed: not
            # pending), so a pending join is the outsider's real one. (Reading "the ids
            # before the flag" raced: the other member could flag first, and this one then
            # counted the outsider's new request as old and waited for another.)
            _flag(ctx, "last")
            deadline = time.monotonic() + 60
            while not any(r["kind"] == "join" for r in world.pending()):
                assert time.monotonic() < deadline, "rollout[1] never asked to join"
                time.sleep(0.05)
        side.version = version
        got = _attempt(refit)
        if "ok" in got:
            got["ok"] = list(got["ok"].lost)
        calls.append({**got, "epoch": world.epoch,
                      "exact": trainer or side.exact(version)})
    out = {"calls": calls, "members": list(world.members)}
    world.close()
    return out


#: the scenarios whose outsider never becomes a member, run one after another in one
#: world (one launch: each would otherwise pay three processes' start and a world's join)
NON_MEMBERS = ["gave-up", "died-elsewhere", "stray-leaves", "twice", "wrong-token"]


def test_requests_of_non_members_never_move_the_epoch():
    scenarios = NON_MEMBERS
    roles = [Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 0),
             Role("plain", "outsider", 0)]
    results = launch([member, member, outsider], roles, args=(scenarios,),
                     timeout=120 + 60 * len(scenarios), check=False, fail_fast=False)
    for res in results:
        assert res.ok, res.describe()
    trainer, rollout, new = (r.value for r in results)
    last = len(scenarios) + 2
    for v in (trainer, rollout):
        for call in v["calls"]:
            assert call.get("ok") == [] and call["exact"], v
        # every call before the last in epoch 0 (nothing to act on), the last admits
        # rollout[1]
        assert [c["epoch"] for c in v["calls"]] == [0] * (last - 1) + [1], v
        assert v["members"] == ["trainer[0]", "rollout[0]", "rollout[1]"], v
    assert new["version"] == last and new["exact"] and new["epoch"] == 1, new
    first = new["first"]
    assert sorted(first) == sorted(scenarios), first
    if "gave-up" in first:
        assert first["gave-up"]["error"] == "TransportTimeout", first
    if "twice" in first:
        got = first["twice"]
        assert got["error"] == "RefitError" and "rollout[0]" in got["message"], got
        assert got["seconds"] < 30, got      # refused at the members' call, not timed out
    if "wrong-token" in first:
        got = first["wrong-token"]
        assert got["error"] == "AuthenticationError", got
        assert got["seconds"] < 30, got
    assert first.get("died-elsewhere") is None and first.get("stray-leaves") is None, first


def _three(fn) -> list:
    """The values of ``fn`` run as trainer[0] (2 ranks), rollout[0] and rollout[1]."""
    roles = [Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    results = launch(fn, roles, timeout=240, check=False, fail_fast=False)
    for res in results:
        assert res.ok, res.describe()
    return [r.value for r in results]


class SlowReceiver(cases.Receiver):
    """A receiver whose binding, at version 2, says so and then takes a while: its
    process's main thread calls ``leave()`` meanwhile, with the call in flight."""

    def __init__(self, in_call: threading.Event):
        super().__init__()
        self.in_call, self.calls = in_call, 0

    def build(self, world):
        self.calls += 1
        if self.calls == 2:
            self.in_call.set()
            time.sleep(1.5)
        return super().build(world)


def leaving_member(ctx: Context) -> dict:
    """trainer[0], rollout[0] and rollout[1] refit; rollout[0] calls ``leave()`` (twice)
    while its call 2 runs in another thread: the call finishes exact first, then it
    leaves, and the others' call 3 goes on without it."""
    world = ctx.join(num_processes=3, world_id="w", groups=GROUPS, elastic=True, token=TOKEN,
                     timeout=60)
    label = f"{ctx.role.group}[{ctx.role.index}]"
    trainer = ctx.role.group == "trainer"
    in_call = threading.Event()
    side = cases.Sender() if trainer else (SlowReceiver(in_call) if label == "rollout[0]"
                                            else cases.Receiver())
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=CONFIG_TIMEOUT), **{
        ("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    refit()
    if label == "rollout[0]":
        got: dict = {}
        thread = threading.Thread(target=lambda: got.update(_attempt(refit)))
        thread.start()
        in_call.wait(60)
        world.leave()
        world.leave()       # a second leave does nothing
        thread.join(60)
        ok = got.get("ok")
        return {"call": {"version": ok.version, "lost": list(ok.lost)} if ok else got,
                "exact": side.exact(2), "closed": world.closed}
    calls = []
    for version in (2, 3):
        side.version = version
        report = refit()
        calls.append({"version": report.version, "lost": list(report.lost),
                      "exact": trainer or side.exact(version)})
    out = {"calls": calls, "members": list(world.members)}
    world.close()
    return out


def test_leave_during_a_call_finishes_the_call_first():
    trainer, r0, r1 = _three(leaving_member)
    assert r0 == {"call": {"version": 2, "lost": []}, "exact": True, "closed": True}, r0
    for v in (trainer, r1):
        assert v["calls"] == [{"version": 2, "lost": [], "exact": True},
                              {"version": 3, "lost": ["rollout[0]"], "exact": True}], v
        assert v["members"] == ["trainer[0]", "rollout[1]"], v


class LateReceiver(cases.Receiver):
    """A receiver that reaches the collectives of its second call late (its binding
    takes a while)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def build(self, world):
        self.calls += 1
        if self.calls == 2:
            time.sleep(1.5)
        return super().build(world)


def rejoining_member(ctx: Context) -> dict:
    """rollout[1] leaves after call 1 and joins again from the same process (vLLM's
    ``remove_engine`` then ``add_engine`` of one engine); it is admitted at call 2, and
    at call 3 it is late to every collective: its own earlier leave request must not make
    the others take it for gone."""
    label = f"{ctx.role.group}[{ctx.role.index}]"
    trainer = ctx.role.group == "trainer"
    world = ctx.join(num_processes=3, world_id="w", groups=GROUPS, elastic=True, token=TOKEN,
                     timeout=60)
    config = xr.RefitConfig(timeout=CONFIG_TIMEOUT)
    side = cases.Sender() if trainer else cases.Receiver()
    refit = xr.Refit(world, config=config, **{
        ("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    reports = [refit()]
    if label == "rollout[1]":
        world.leave()
        _flag(ctx, "left")
        world = _join(ctx)
        reports = []
        side = LateReceiver()
        refit = xr.Refit(world, receive=xr.Rebuilt(side.build), config=config)
        for version in (2, 3):
            reports.append(refit())
            assert side.exact(version)
    else:
        _flag(ctx, "left", wait=True)
        deadline = time.monotonic() + 60
        while not any(r["kind"] == "join" for r in world.pending()):
            assert time.monotonic() < deadline, "rollout[1] never asked to join again"
            time.sleep(0.05)
        for version in (2, 3):
            side.version = version
            reports.append(refit())
            assert trainer or side.exact(version)
    out = {"lost": [list(r.lost) for r in reports], "epoch": world.epoch,
           "members": list(world.members)}
    world.close()
    return out


def test_a_process_that_left_and_joined_again_is_not_taken_for_gone():
    trainer, r0, r1 = _three(rejoining_member)
    for v in (trainer, r0):
        assert v["lost"] == [[], ["rollout[1]"], []], v
    for v in (trainer, r0, r1):
        assert v["epoch"] == 1 and v["members"] == ["trainer[0]", "rollout[0]", "rollout[1]"], v
