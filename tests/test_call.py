"""One refit call as the processes see it: which Refit they are in, which error class and
kind reaches every process from each phase of the call, when ``version`` moves, and what a
dropped handle leaves. Worlds of plain processes with numpy ``Bound`` sides (and a test
adapter registered by module path: this module)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import pytest

import xreshard as xr
from xreshard.tools.launch import Context, Role, launch

SHAPE = (8, 4)


def _values(version: int) -> np.ndarray:
    return np.arange(32, dtype=np.float32).reshape(SHAPE) + 100 * version


def _send(version: int, rank: int, name: str = "w") -> xr.Bound:
    layout = xr.Layout.replicated(SHAPE, "float32", xr.Mesh((1,), (rank,)))
    return xr.Bound({name: layout}, {(rank, name): _values(version)})


def _receive(rank: int, arr: np.ndarray, name: str = "w") -> xr.Bound:
    layout = xr.Layout.explicit_form(SHAPE, "float32", {rank: [[(0, n) for n in SHAPE]]})
    return xr.Bound({name: layout}, {(rank, name): [arr]}, local_only={name})


def _attempt(fn) -> dict:
    try:
        value = fn()
    except Exception as e:      # noqa: BLE001 - the test compares what every process raised
        return {"error": type(e).__name__, "message": str(e),
                "communication": isinstance(e, xr.CommunicationError)}
    return {"ok": getattr(value, "version", None)}


# ---------------------------------------------------------------------------- a test adapter
# registered by module path in the children ("tests.test_call"): it binds an Exploding

class Exploding:
    """An object whose adapter raises ``error`` while binding."""

    def __init__(self, error: Exception):
        self.error = error


def accepts(obj) -> bool:
    return isinstance(obj, Exploding)


def refit_bind(obj: Exploding, side: str, context) -> xr.Bound:
    raise obj.error


# ---------------------------------------------------------------------------- the processes

def phases(ctx: Context) -> dict:
    """trainer[0] sends, rollout[0] and rollout[1] receive ``w`` whole. Each case is
    refused (or fails) on every process; a good refit follows while the world is usable."""
    from xreshard.adapters.naming_rules import NamingError  # noqa: F401 - rollout[1] raises it
    from xreshard.runtime import registry

    registry.register_adapter("exploding", "tests.test_call")
    out: dict = {}
    config = xr.RefitConfig(timeout=20)
    with ctx.join(1, groups=("trainer", "rollout"), timeout=120) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        odd = ctx.role.group == "rollout" and ctx.role.index == 1
        dest = np.full(SHAPE, -1, np.float32)

        def refit_with(bad=None, **kw):
            side = ({"send": _send(1, rank)} if trainer else
                    {"receive": bad if (odd and bad is not None) else _receive(rank, dest)})
            return xr.Refit(world, config=xr.RefitConfig(timeout=20, **kw), **side)

        # check phase: an adapter's own XreshardError subclass, and a foreign exception
        from xreshard.adapters.naming_rules import NamingError as Naming
        out["naming"] = _attempt(refit_with(Exploding(Naming("no rule maps 'x' (test)"))))
        out["foreign"] = _attempt(refit_with(Exploding(RuntimeError("adapter bug (test)"))))
        # a local transport between processes: refused before any byte moves
        out["local"] = _attempt(refit_with(transport="local"))
        out["unchanged"] = bool((dest == -1).all())
        out["good"] = _attempt(refit_with())
        out["exact"] = trainer or bool(np.array_equal(dest, _values(1)))
        out["broken_before_move"] = world.broken
        # move phase: a bug in rollout[1]'s executor mid-move breaks the world everywhere
        refit = xr.Refit(world, config=config, **({"send": _send(2, rank)} if trainer else
                                                 {"receive": _receive(rank, dest)}))
        if odd:
            from xreshard.runtime import execute
            execute.Executor._unpack = _index_error
            execute.Executor._zero_copy_recv = lambda self, b: None
        out["move"] = _attempt(refit)
        out["broken"] = world.broken
    return out


def _index_error(self, b, buf):
    raise IndexError("list index out of range (an executor bug, test)")


def crossing(ctx: Context) -> dict:
    """Two Refits of one world with the same tensor names (a policy and a reference
    model): in step, then called in a different order on the two sides."""
    out: dict = {}
    config = xr.RefitConfig(timeout=20)
    with ctx.join(1, groups=("trainer", "rollout"), timeout=120) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        policy, reference = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)

        def make(version: int, dest: np.ndarray, **kw) -> xr.Refit:
            side = {"send": _send(version, rank)} if trainer else \
                {"receive": _receive(rank, dest)}
            return xr.Refit(world, config=config, **side, **kw)

        # unnamed: each agrees on its identity (#1, #2) before the next exists (two unrun
        # unnamed Refits are refused: tests/test_unnamed_refits.py)
        r1 = make(1, policy)
        out["in_step"] = [_attempt(r1)]
        r2 = make(2, reference)
        out["in_step"].append(_attempt(r2))
        order = (r1, r2) if trainer else (r2, r1)
        out["crossed"] = [_attempt(r) for r in order]
        out["policy_ok"] = trainer or bool(np.array_equal(policy, _values(1)))
        out["reference_ok"] = trainer or bool(np.array_equal(reference, _values(2)))
        out["in_step_again"] = [_attempt(r1), _attempt(r2)]
        # named Refits: even their very first calls are told apart
        n1 = make(1, policy, name="policy")
        n2 = make(2, reference, name="reference")
        out["named_crossed"] = _attempt(n1 if trainer else n2)
        out["named_in_step"] = [_attempt(n1), _attempt(n2)]
        out["broken"] = world.broken
    return out


ROLES = [Role("plain", "trainer", 0), Role("plain", "rollout", 0), Role("plain", "rollout", 1)]


@pytest.mark.slow
def test_every_phase_sends_its_error_class_to_every_process():
    """Issue 19 item 4: an adapter's own error class (NamingError) arrives as itself on
    every process, the raising one included; a foreign exception while binding is bad
    input (RefitError, the world stays usable); a local transport between processes is
    refused before any byte moves (issue 17.11); a foreign exception while moving is a
    RemoteError that breaks the world on every process."""
    values = [r.value for r in launch(phases, ROLES, timeout=240)]
    for case, cls in (("naming", "NamingError"), ("foreign", "RefitError"),
                      ("local", "RefitError")):
        seen = [v[case] for v in values]
        assert {s.get("error") for s in seen} == {cls}, (case, seen)
        assert len({s["message"] for s in seen}) == 1, (case, seen)
        assert not any(s["communication"] for s in seen)
    assert "no rule maps 'x' (test)" in values[0]["naming"]["message"]
    assert "RuntimeError: adapter bug (test)" in values[0]["foreign"]["message"]
    assert "transport='local'" in values[0]["local"]["message"]
    assert all(v["unchanged"] and v["exact"] and v["good"] == {"ok": 1} for v in values)
    assert all(v["broken_before_move"] is None for v in values)
    moved = [v["move"] for v in values]
    assert {m.get("error") for m in moved} == {"RemoteError"}, moved
    assert all(m["communication"] for m in moved)
    assert len({m["message"] for m in moved}) == 1
    assert "IndexError: list index out of range" in moved[0]["message"]
    assert all(v["broken"] and "IndexError" in v["broken"] for v in values)


@pytest.mark.slow
def test_crossed_refits_are_refused_on_every_process_before_moving():
    """Issue 17.1: the trainer calls r1 then r2, the rollout r2 then r1 (same tensor
    names): a CollectiveMismatch on every process, nothing written, the world usable."""
    values = [r.value for r in launch(crossing, ROLES, timeout=240)]
    for v in values:
        assert v["in_step"] == [{"ok": 1}, {"ok": 1}], v
        assert [c.get("error") for c in v["crossed"]] == ["CollectiveMismatch"] * 2, v
        assert v["policy_ok"] and v["reference_ok"]
        assert v["in_step_again"] == [{"ok": 2}, {"ok": 2}], v
        assert v["named_crossed"].get("error") == "CollectiveMismatch", v
        assert v["named_in_step"] == [{"ok": 1}, {"ok": 1}], v
        assert v["broken"] is None
    first = {v["crossed"][0]["message"] for v in values}
    assert len(first) == 1, first
    assert "Refit #1" in next(iter(first)) and "Refit #2" in next(iter(first))
    named = {v["named_crossed"]["message"] for v in values}
    assert len(named) == 1
    message = named.pop()
    assert "(policy)" in message and "(reference)" in message and "name them" in message


# ---------------------------------------------------------------------------- one process

@contextlib.contextmanager
def _solo(num_ranks: int = 2):
    with xr.serve() as server, xr.World.join(server.address, "solo", num_ranks,
                                             num_processes=1, index=0, timeout=20) as world:
        yield world


def _whole(world: xr.World):
    """rank 0 sends ``w``, rank 1 receives it whole."""
    dest = np.zeros(SHAPE, np.float32)
    return _send(1, 0), xr.Bound({"w": xr.Layout.replicated(SHAPE, "float32",
                                                            xr.Mesh((1,), (1,)))},
                                 {(1, "w"): dest}), dest


def test_version_moves_after_the_world_is_released():
    """Issue 17.8: a thread that sees ``version`` move may run a collective at once."""
    with _solo() as world:
        send, receive, dest = _whole(world)
        refit = xr.Refit(world, send=send, receive=receive)
        seen = []
        exclusive = world.exclusive

        @contextlib.contextmanager
        def watched(what="a collective"):
            with exclusive(what):
                yield
            if what == "refit":
                seen.append(refit.version)      # the world was just released
        world.exclusive = watched
        assert refit().version == 1 and np.array_equal(dest, _values(1))
        assert seen == [0] and refit.version == 1
        assert world.allgather_json("right after") == ["right after"]


def test_a_dropped_handle_whose_refit_fails_warns_and_marks_stale(caplog):
    """Issue 17.7: nobody waits for the handle, so the failure is logged and ``stale``
    set (the receiving side does not hold the version it asked for)."""
    with _solo() as world:
        send, receive, dest = _whole(world)
        wrong = xr.Bound({"w": xr.Layout.replicated((4, 4), "float32", xr.Mesh((1,), (1,)))},
                         {(1, "w"): np.zeros((4, 4), np.float32)})
        refit = xr.Refit(world, send=send, receive=wrong)
        with caplog.at_level(logging.WARNING, logger="xreshard"):
            refit.start()           # dropped at once
            gc.collect()
            deadline = time.monotonic() + 60
            while not any("handle was dropped" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no warning for a dropped failed refit"
                time.sleep(0.05)
                gc.collect()
        message = next(r.getMessage() for r in caplog.records
                       if "handle was dropped" in r.getMessage())
        assert "PlanError" in message and "shape" in message
        assert refit.stale and refit.version == 0
        # a handle that is waited for raises, and logs nothing
        caplog.clear()
        handle = refit.start()
        with pytest.raises(xr.PlanError):
            handle.wait()
        del handle
        gc.collect()
        assert not any("handle was dropped" in r.getMessage() for r in caplog.records)


def test_an_adapters_own_error_keeps_its_class_in_the_raising_process():
    from xreshard.adapters.naming_rules import NamingError
    from xreshard.runtime import registry

    registry.register_adapter("exploding", "tests.test_call")
    try:
        with _solo(1) as world:
            refit = xr.Refit(world, receive=Exploding(NamingError("no rule maps 'x'")))
            with pytest.raises(NamingError, match="no rule maps 'x'"):
                refit()
            refit = xr.Refit(world, receive=Exploding(KeyError("k")))
            with pytest.raises(xr.RefitError, match="KeyError: 'k'"):
                refit()
            assert world.broken is None
    finally:
        registry.unregister_adapter("exploding")


def test_device_bindings_run_full_rounds(monkeypatch):
    """Issue 18: the halved schedule is only for the pipelined host executor. A process
    with device bindings (any non-numpy binding) runs full rounds, and every process of
    the call prepares the same schedule from what refit/check gathered."""
    from xreshard.runtime import refit as refit_module
    from xreshard.runtime.sides import on_device

    class FakeDeviceArray:
        pass

    assert on_device(xr.Bound({}, {(0, "w"): [FakeDeviceArray()]}))
    assert not on_device(xr.Bound({}, {(0, "w"): [np.zeros(1)]}), None)
    with _solo() as world:
        send, receive, dest = _whole(world)
        plain = xr.Refit(world, send=send, receive=receive)
        assert plain().version == 1
        assert plain.prepared.options.halved
        rounds = xr.Refit(world, send=send, receive=receive,
                          tuning=xr.Tuning(executor="rounds"))
        rounds()
        assert not rounds.prepared.options.halved
        # bindings on a device (seen through refit/check): full rounds, prepared again
        monkeypatch.setattr(refit_module, "on_device", lambda *sides: True)
        report = plain()
        assert report.replanned and not plain.prepared.options.halved
        assert np.array_equal(dest, _values(1))
