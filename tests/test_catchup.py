"""Catch-up from a replica (xreshard.runtime.catchup): a process joining a running elastic
world fills its destinations from another engine's replica, without the trainer, then
takes part in the next refit (real processes, a signed world)."""

from __future__ import annotations

import pytest

import xreshard as xr
from xreshard.tools.launch import Role, launch

from . import catchup_cases as cases


def test_catch_up_is_refused_in_a_fixed_world():
    pytest.importorskip("torch")
    with xr.serve() as server, xr.World.join(server.address, "solo", 1, num_processes=1,
                                             index=0, timeout=20) as world:
        assert world.admitted
        refit = xr.Refit(world, receive=xr.Rebuilt(lambda w: None))
        with pytest.raises(xr.RefitError, match="wait=False"):
            refit.catch_up()


@pytest.mark.slow
@pytest.mark.parametrize("racing", [False, True], ids=["idle", "racing"])
def test_a_joining_engine_catches_up_from_the_other_engine(tmp_path, racing):
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    trainer, a, b = (r.value for r in launch(cases.member, roles,
                                             args=(str(tmp_path / "flag"), racing),
                                             timeout=240))
    caught = b["caught"]
    # one version, bit-exact, known; every byte of it came in the catch-up world, which
    # holds engine A's replica and B only (the trainer is not in it)
    assert caught["exact"] and caught["bytes_received"] == caught["expected"], caught
    assert caught["version"] == caught["refit_version"] >= 2
    if not racing:      # the members were idle: their current version
        assert caught["version"] == 2
    # a second catch-up before admission reuses the catch-up world and its plan
    again = b["again"]
    assert again["exact"] and again["bytes_received"] == caught["expected"], again
    assert not again["replanned"] and again["version"] >= caught["version"]
    # then admitted at the members' next refit: every process at one version, exact
    assert trainer["version"] == a["version"] == b["version"] > caught["version"]
    assert trainer["members"] == a["members"] == b["members"] == \
        ["trainer[0]", "rollout[0]", "rollout[1]"]
    assert a["exact"] and b["exact"]


def test_catch_up_messages_are_signed():
    """Announcements and requests are signed with the world's token: one written with
    another token (or none) reads as nothing, and a forged request never names a server."""
    pytest.importorskip("torch")
    from xreshard.runtime.epochs import read_entry
    from xreshard.runtime.store import Seal, connect

    token = "a-token-of-this-world"
    with xr.serve() as server, xr.World.join(server.address, "rollout", 1, num_processes=1,
                                             index=0, timeout=20, elastic=True,
                                             world_id="signed", token=token) as world:
        world.publish("replica/rollout[0]", "member/replica", {"refit": "#1", "version": 3})
        assert world.published("replica/rollout[0]", "member/replica") == \
            {"refit": "#1", "version": 3}
        store = connect(server.address, 20)
        key = "xreshard/signed/replica/rollout[0]"
        for other in (b"another-token-here", None):
            store.set(key, Seal(other, "signed").seal("member/replica", 0, -1, '{"x": 1}'))
            assert world.published("replica/rollout[0]", "member/replica") is None
            assert read_entry(store, Seal(token.encode(), "signed"), key,
                              "member/replica") is None
        world.publish("catchups", "member/catchup", {"id": "1"}, numbered=True)
        assert read_entry(store, Seal(token.encode(), "signed"), "xreshard/signed/catchups/1",
                          "member/catchup") == {"id": "1"}
