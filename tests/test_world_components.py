"""``World`` is composed of components with their own state (issue 32 item 5):
``world.membership`` (who is in the world: ranks, members, epochs) and
``world.transports`` (the transports, their routes and links); not mixins over one shared
state. One process, a real store and real transports; no fakes."""

from __future__ import annotations

import time

import pytest

from xreshard.config import Tuning, env_token
from xreshard.errors import RefitError
from xreshard.runtime.world import World, serve
from xreshard.runtime.world_membership import Membership
from xreshard.runtime.world_transports import WorldTransports


@pytest.fixture
def server():
    s = serve(timeout=30)
    yield s
    s.close()


def _join(server, **kwargs) -> World:
    return World.join(server.address, "g", 2, num_processes=1, index=0, timeout=30, **kwargs)


def _fields(component) -> dict:
    """The component's own fields, but its reference back to the world."""
    return {k: v for k, v in vars(component).items() if k != "_world"}


def test_world_is_composed_not_mixed_in():
    assert World.__mro__ == (World, object)
    assert WorldTransports.__mro__ == (WorldTransports, object)
    assert Membership.__mro__ == (Membership, object)


def test_components_hold_disjoint_state(server):
    with _join(server) as world:
        assert isinstance(world.membership, Membership)
        assert isinstance(world.transports, WorldTransports)
        members, transports = _fields(world.membership), _fields(world.transports)
        assert not set(members) & set(transports)
        assert {"infos", "rank_ids", "epoch"} <= set(members)
        assert {"made", "counted", "caps", "links"} <= set(transports)
        # the world itself keeps neither (no rank table, no transport cache of its own)
        assert not {"_infos", "_rank_ids", "_transports", "_counted"} & set(vars(world))


def test_transports_renew_without_touching_membership(server):
    with _join(server) as world:
        local = world.transport("local")
        world.transport("auto")
        assert set(world.transports.made) == {"local", "auto"}
        before = _fields(world.membership)
        snapshot = {k: repr(v) for k, v in before.items()}
        world.renew_transports()
        assert world.transports.made == {} and world.transports.counted == {}
        after = _fields(world.membership)
        assert after.keys() == before.keys()
        assert all(after[k] is before[k] for k in before)       # the very same objects
        assert {k: repr(v) for k, v in after.items()} == snapshot  # and unchanged
        again = world.transport("local")
        assert again is not local and world.rank_ids == (0, 1)


def test_a_new_epoch_renumbers_members_and_parks_transports(server):
    """The other direction: a membership change (a renewal of an elastic world: the same
    member, epoch 1) moves the membership and has the transports made anew, through the
    components' interfaces."""
    with _join(server, elastic=True) as world:
        world.transport("local")
        links = world.transports.links
        assert world.advance([], [], time.monotonic() + 30, renew=True)
        assert world.epoch == world.membership.epoch == 1
        assert world.members == ("g[0]",) and world.rank_ids == (0, 1)
        assert world.transports.made == {} and world.transports.links is links
        world.barrier()                     # the collectives run in the new epoch
        assert world.transport("local") is not None


def test_shm_switches_are_tuning_fields(server, monkeypatch):
    assert Tuning().shm and Tuning().shm_pull
    assert not Tuning.from_env({"XRESHARD_SHM": "0"}).shm
    assert not Tuning.from_env({"XRESHARD_SHM_PULL": "off"}).shm_pull
    assert Tuning.from_env({"XRESHARD_SHM": "1"}).shm
    with pytest.raises(RefitError, match="Tuning.shm must be a bool"):
        Tuning(shm="no")
    with _join(server, tuning=Tuning(shm=False)) as world:
        assert world.transports.tuning.shm is False
    monkeypatch.setenv("XRESHARD_SHM_PULL", "0")         # the default reads from_env
    with _join(server, world_id="env") as world:
        assert world.transports.tuning.shm_pull is False
    with pytest.raises(RefitError, match="tuning must be a Tuning"):
        _join(server, world_id="bad", tuning="shm")


def test_token_is_read_from_the_environment_in_config():
    assert env_token({"XRESHARD_TOKEN": "secret-123"}) == "secret-123"
    assert env_token({"XRESHARD_TOKEN": ""}) is None and env_token({}) is None
