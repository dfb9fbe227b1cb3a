"""Trust: bad input refused identically everywhere, one error on every rank, bounded
failure, and a world only its members can join (issue "Trust").

Worlds of plain processes with numpy ``Bound`` sides keep these fast; the fuzz suite
(test_fuzz_refit.py) drives framework objects.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

import xreshard as xr
from xreshard.errors import (AuthenticationError, BindingError, CollectiveMismatch,
                             CommunicationError, RefitError, TransportTimeout, WorldBroken,
                             XreshardError)
from xreshard.tools.launch import Context, Role, launch

pytestmark = pytest.mark.slow

SHAPE = (8, 4)


def _values(version: int) -> np.ndarray:
    return (np.arange(32, dtype=np.float32).reshape(SHAPE) + 100 * version)


def _trainer_bound(version: int, rank: int) -> xr.Bound:
    layout = xr.Layout.replicated(SHAPE, "float32", xr.Mesh((1,), (rank,)))
    return xr.Bound({"w": layout}, {(rank, "w"): _values(version)})


def _plain_receiver(rank: int, arr: np.ndarray, dtype: str | None = None) -> xr.Bound:
    """A process holding ``w`` whole (explicit layout over its own rank, unioned)."""
    shape = tuple(arr.shape)
    layout = xr.Layout.explicit_form(shape, dtype or str(arr.dtype),
                                     {rank: [[(0, n) for n in shape]]})
    return xr.Bound({"w": layout}, {(rank, "w"): [arr]}, local_only={"w"})


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:      # noqa: BLE001 - the test compares what every rank raised
        return {"error": type(e).__name__, "message": str(e),
                "seconds": time.monotonic() - t0,
                "value_error": isinstance(e, ValueError)}
    return {"ok": getattr(value, "version", None)}


def bad_inputs(ctx: Context) -> dict:
    """One world, many cases; after each bad one a good refit still works."""
    out: dict = {}
    config = xr.RefitConfig(timeout=20)
    with ctx.join(1, timeout=30) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        mine = ctx.role.group == "rollout" and ctx.role.index == 1
        dest = np.full(SHAPE, -1.0, np.float32)
        good = (lambda v: _trainer_bound(v, rank)) if trainer else \
            (lambda v: _plain_receiver(rank, dest))
        version = [0]

        def run(name: str, bad_send=None, bad_receive=None) -> None:
            if trainer:
                refit = xr.Refit(world, send=bad_send or good(version[0] + 1), config=config)
            else:
                receive = bad_receive if (mine and bad_receive is not None) else good(0)
                refit = xr.Refit(world, receive=receive, config=config)
            before = dest.copy()
            out[name] = _attempt(refit)
            out[name]["unchanged"] = bool(np.array_equal(before, dest))
            refit = xr.Refit(world, send=good(version[0] + 1), config=config) if trainer else \
                xr.Refit(world, receive=good(0), config=config)
            report = refit()
            version[0] += 1
            out[name]["then_ok"] = bool(np.array_equal(dest, _values(version[0]))) \
                if not trainer else report.version == 1

        run("plain_shape", bad_receive=_plain_receiver(rank, np.zeros((7, 4), np.float32)))
        run("plain_dtype", bad_receive=_plain_receiver(rank, np.zeros(SHAPE, np.int32)))
        run("int32_memory", bad_receive=_plain_receiver(rank, np.zeros(SHAPE, np.int32),
                                                        "float32"))
        aliased = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), SHAPE, (0, 4),
                                                  writeable=True)
        run("aliased", bad_receive=_plain_receiver(rank, aliased))
        frozen = np.zeros(SHAPE, np.float32)
        frozen.flags.writeable = False
        run("read_only", bad_receive=_plain_receiver(rank, frozen))
        run("unknown_object", bad_receive=object())
        unbound = xr.Bound({"w": xr.Layout.replicated(SHAPE, "float32", xr.Mesh((1,), (rank,)))},
                           {})
        run("declared_unbound", bad_receive=unbound)
        full = [[(0, n) for n in SHAPE]]
        run("rank_outside", bad_receive=xr.Bound(
            {"w": xr.Layout.explicit_form(SHAPE, "float32", {rank: full, 99: full})},
            {(rank, "w"): [dest]}, local_only={"w"}))
        out["version_after"] = version[0]

        # two threads on one Refit: the second call is refused, the first completes
        refit = xr.Refit(world, send=good(version[0] + 1), config=config) if trainer else \
            xr.Refit(world, receive=good(0), config=config)
        if trainer:
            results: list = []
            first = threading.Thread(target=lambda: results.append(_attempt(refit)))
            first.start()
            while not refit._busy.locked():
                time.sleep(0.001)
            out["concurrent"] = _attempt(refit)
            first.join()
            out["concurrent_first"] = results[0]
        else:
            time.sleep(1.0)
            out["concurrent_first"] = _attempt(refit)

        # a barrier against a refit: every process names the mismatch, the world breaks
        if trainer:
            out["mismatch"] = _attempt(lambda: world.barrier(timeout=10))
        else:
            out["mismatch"] = _attempt(xr.Refit(world, receive=good(0), config=config))
        out["broken"] = world.broken
        out["after_broken"] = _attempt(lambda: world.allgather_json(1))
    return out


def test_bad_input_same_error_everywhere_nothing_written_world_still_works():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    values = [r.value for r in launch(bad_inputs, roles, timeout=240)]
    cases = {"plain_shape": (RefitError, r"holds it with shape \[8, 4\].*rollout\[1\].*with \[7, 4\]"),
             "plain_dtype": (RefitError, r"holds it with dtype float32.*with int32"),
             "int32_memory": (BindingError, r"local dtype int32, layout says float32"),
             "aliased": (BindingError, r"stride 0"),
             "read_only": (BindingError, r"read-only"),
             "unknown_object": (RefitError, r"cannot tell which framework receive=object"),
             "declared_unbound": (BindingError, r"nothing is bound there"),
             "rank_outside": (RefitError, r"rollout\[1\].*over ranks \[99\]")}
    import re
    for name, (cls, pattern) in cases.items():
        seen = [v[name] for v in values]
        assert {s.get("error") for s in seen} == {cls.__name__}, (name, seen)
        assert len({s["message"] for s in seen}) == 1, (name, seen)        # word for word
        assert re.search(pattern, seen[0]["message"]), (name, seen[0]["message"])
        assert "rollout[1]" in seen[0]["message"] and "before moving anything" in seen[0]["message"]
        assert all(s["value_error"] for s in seen)
        assert all(s["unchanged"] for s in seen[1:]), name      # receivers' bytes untouched
        assert all(s["then_ok"] for s in seen), name
    assert all(v["version_after"] == len(cases) for v in values)
    trainer = values[0]
    assert trainer["concurrent"]["error"] == "RefitError"
    assert "already running a call" in trainer["concurrent"]["message"]
    assert all(v["concurrent_first"].get("ok") == 1 for v in values)
    for v in values:
        assert v["mismatch"]["error"] == "CollectiveMismatch", v["mismatch"]
        assert not v["mismatch"]["value_error"]
        # the world's framework ids were gathered at its first refit: a new Refit's first
        # call starts at refit/check
        assert "'barrier'" in v["mismatch"]["message"] and "'refit/check'" in v["mismatch"]["message"]
        assert v["broken"].startswith("CollectiveMismatch")
        assert v["after_broken"]["error"] == "WorldBroken"


def counted(ctx: Context) -> dict:
    """Which metadata collectives each call of a refit runs (world.allgather_json wrapped)."""
    config = xr.RefitConfig(timeout=20)
    with ctx.join(1, timeout=30) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        dest = np.zeros(SHAPE, np.float32)
        kinds: list[str] = []
        real = world.allgather_json

        def counting(obj, **kw):
            kinds.append(kw.get("kind", "allgather"))
            return real(obj, **kw)
        world.allgather_json = counting
        refit = xr.Refit(world, config=config)
        per_call = []
        for version in (1, 2, 3):
            side = {"send": _trainer_bound(version, rank)} if trainer else \
                {"receive": _plain_receiver(rank, dest)}
            start = len(kinds)
            report = refit(**side)
            per_call.append([kinds[start:], report.replanned])
        exact = trainer or bool(np.array_equal(dest, _values(3)))
    return {"per_call": per_call, "exact": exact}


def test_a_call_that_changes_nothing_runs_two_metadata_exchanges():
    """Identity, layouts and schedule travel once; afterwards a call runs refit/check (every
    process's errors and layout generation, before any byte moves) and refit/outcome."""
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    values = [r.value for r in launch(counted, roles, timeout=120)]
    for v in values:
        assert v["exact"]
        first, *later = v["per_call"]
        assert first[0][0] == "refit/identity" and first[1] is True
        assert {"refit/check", "refit/layouts", "refit/schedule", "refit/outcome"} <= set(first[0])
        assert later == [[["refit/check", "refit/outcome"], False]] * 2, v["per_call"]


# ---------------------------------------------------------------------------- tokens

def token_world(ctx: Context, token: str | None, forge: bool) -> dict:
    out: dict = {}
    if ctx.role.group == "intruder":
        from xreshard.runtime.store import connect
        connect(ctx.address, 30).wait([f"xreshard/{ctx.world_id}/joined"])
        # same group and index as a member: a process that knows only the address
        out["join"] = _attempt(lambda: xr.World.join(ctx.address, "rollout", 1,
                                                     num_processes=2, index=0, timeout=4,
                                                     token=None if token is None else "x" * 16))
        if forge:
            from xreshard.runtime.store import connect
            store = connect(ctx.address, 10)
            # the members' first collective: process 0 (rollout[0]) writes its payload late
            store.set(f"xreshard/{ctx.world_id}/op1/0", json.dumps(
                {"kind": "allgather", "op": 1, "process": 0, "body": json.dumps("forged"),
                 "mac": "00" * 32}))
            store.set(f"xreshard/{ctx.world_id}/forged", "1")
        return out
    with xr.World.join(ctx.address, ctx.role.group, 1, num_processes=2, index=0, timeout=30,
                       token=token) as world:
        out["ranks"] = list(world.rank_ids)
        if ctx.role.group == "trainer":
            from xreshard.runtime.store import connect
            connect(ctx.address, 10).set(f"xreshard/{ctx.world_id}/joined", "1")
        if forge:
            from xreshard.runtime.store import connect
            store = connect(ctx.address, 10)
            store.wait([f"xreshard/{ctx.world_id}/forged"])
            if ctx.role.group == "rollout":
                time.sleep(1.0)
            out["gather"] = _attempt(lambda: world.allgather_json("real", timeout=5))
    return out


def test_a_process_without_the_token_cannot_join_or_inject():
    """The intruder's join (the same group and index as a member, without the token) is
    refused; then it forges a member's first payload, which is refused by name. (One run
    does both: the join attempt comes first in it and is checked on its own.)"""
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "intruder", 0)]
    values = [r.value for r in launch(token_world, roles, args=("s3cret-token-1", True),
                                      timeout=120)]
    trainer, rollout, intruder = values
    assert trainer["ranks"] == [1] and rollout["ranks"] == [0]     # the intruder took nothing
    assert intruder["join"]["error"] == "AuthenticationError"
    assert "signed with another token" in intruder["join"]["message"]
    # the trainer reads rollout[0]'s slot before rollout[0] wrote it: the forgery is
    # refused by name, never accepted
    assert trainer["gather"]["error"] == "AuthenticationError"
    assert "op1/0" in trainer["gather"]["message"]
    assert "not signed with this world's token" in trainer["gather"]["message"]


def test_garbage_payload_is_a_typed_error_without_a_token():
    with xr.serve() as server:
        with xr.World.join(server.address, "solo", 1, num_processes=1, index=0,
                           timeout=5) as world:
            from xreshard.runtime.store import connect
            connect(server.address, 5).set("xreshard/default/op1/0", b"\x80not json")
            # the process's own write replaces the garbage; a payload from another step
            # (a replay) is named as such
            seal = world._seal
            with pytest.raises(CollectiveMismatch, match="expected step 2 by process 0"):
                seal.open(seal.seal("allgather", 1, 0, "1"), key="k", kind="allgather", op=2,
                          process=0)
            with pytest.raises(CollectiveMismatch, match="does not hold an xreshard payload"):
                seal.open(b"\x80not json", key="k", kind="allgather", op=2, process=0)
            assert world.allgather_json(5) == [5]


# ---------------------------------------------------------------------------- listening

def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            addr, state = parts[1], parts[3]
            host, hport = addr.split(":")
            if state == "0A" and int(hport, 16) == port:
                found.append(host)
    return found


def test_serve_listens_only_where_it_is_told():
    with xr.serve("127.0.0.1") as server:
        assert _listeners(server.port) == ["0100007F"]      # 127.0.0.1, nothing else
    with pytest.raises(RefitError, match="cannot listen"):
        xr.serve("no-such-host.invalid")


def test_join_to_a_closed_port_obeys_its_timeout():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="could not reach the rendezvous store"):
        xr.World.join(f"tcp://127.0.0.1:{port}", "solo", 1, num_processes=1, index=0,
                      timeout=2)
    assert time.monotonic() - t0 < 2 + 5
    assert issubclass(TransportTimeout, CommunicationError)
    assert not issubclass(TransportTimeout, ValueError)


def test_config_is_validated():
    for bad in ({"timeout": 0}, {"timeout": -1}, {"timeout": float("inf")},
                {"bucket_bytes": 0}, {"staging_bytes": -5}, {"verify": "all"},
                {"wire_dtype": "float7"}, {"check_writes": "yes"}, {"atomic": 1},
                {"delta": "no"}):
        with pytest.raises(XreshardError):
            xr.RefitConfig(**bad)


def test_error_kinds_are_apart():
    assert issubclass(BindingError, ValueError) and issubclass(RefitError, ValueError)
    for cls in (CommunicationError, TransportTimeout, CollectiveMismatch, WorldBroken,
                AuthenticationError):
        assert not issubclass(cls, ValueError)
    assert issubclass(AuthenticationError, PermissionError)


# ---------------------------------------------------------------------------- verify

class _FlipOneByte:
    """Wraps a transport; flips one bit of the first buffer received (in transit)."""

    def __init__(self, inner):
        self.inner, self.name, self.flipped, self._recvs = inner, inner.name, False, []

    def group(self, timeout):
        import contextlib

        @contextlib.contextmanager
        def cm():
            with self.inner.group(timeout):
                yield
            if self._recvs and not self.flipped:
                buf = self._recvs[0]
                buf[len(buf) // 2] ^= 1
                self.flipped = True
            self._recvs.clear()
        return cm()

    def send(self, buf, src, dst, tag):
        self.inner.send(buf, src, dst, tag)

    def recv(self, buf, src, dst, tag):
        self._recvs.append(buf)
        self.inner.recv(buf, src, dst, tag)

    def close(self):
        self.inner.close()


def verified(ctx: Context, mode) -> dict:
    out: dict = {}
    config = xr.RefitConfig(timeout=20, verify=mode, bucket_bytes=1 << 20)
    with ctx.join(1, timeout=30) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        dest = np.zeros(SHAPE, np.float32)
        side = {"send": _trainer_bound(1, rank)} if trainer else \
            {"receive": _plain_receiver(rank, dest)}
        refit = xr.Refit(world, config=config, **side)
        out["clean"] = _attempt(refit)
        real = world.transport
        flips = {}

        def corrupting(kind="auto"):
            if kind not in flips:
                flips[kind] = _FlipOneByte(real(kind))
            return flips[kind]

        world.transport = corrupting
        out["corrupt"] = _attempt(refit)
        out["version"] = refit.version
        out["broken"] = world.broken
    return out


def test_verify_catches_a_flipped_byte_on_every_rank():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    values = [r.value for r in launch(verified, roles, args=(True,), timeout=120)]
    assert all(v["clean"] == {"ok": 1} for v in values)
    seen = [v["corrupt"] for v in values]
    assert {s["error"] for s in seen} == {"VerificationError"}, seen
    assert len({s["message"] for s in seen}) == 1
    assert "'w'" in seen[0]["message"] and "trainer[0]" in seen[0]["message"]
    assert all(v["version"] == 1 and v["broken"] is None for v in values)


def test_garbage_in_the_join_records_does_not_block_joining():
    from xreshard.runtime.store import connect
    with xr.serve() as server:
        store = connect(server.address, 5)
        store.add("xreshard/default/join/n", 5)             # the old slot counter: ignored
        store.append("xreshard/default/join", "garbage\n{\"kind\": 1}\n")
        with xr.World.join(server.address, "solo", 1, num_processes=1, index=0,
                           timeout=5) as world:
            assert world.allgather_json("x") == ["x"]


@pytest.mark.parametrize("executor", ["pipelined", "rounds"])
def test_a_destination_sharing_memory_with_a_source_is_refused(executor):
    """One process both sends and receives, and a receive buffer is a view of a send buffer
    (an in-place S1 -> S0 reshard): a write would overwrite bytes a send has not read yet.
    Refused before any byte moves; bound to copies instead, the same refit is exact."""
    grid = np.arange(16, dtype=np.float32).reshape(4, 4)
    mesh = xr.Mesh((2,), (0, 1))
    src = xr.Layout.from_placements((4, 4), "float32", mesh, ["S1"])   # rank r: columns
    dst = xr.Layout.from_placements((4, 4), "float32", mesh, ["S0"])   # rank r: rows
    bufs = [np.ascontiguousarray(grid[:, :2]), np.ascontiguousarray(grid[:, 2:])]
    views = [b.reshape(2, 4) for b in bufs]                  # the same memory
    before = [v.copy() for v in views]
    with xr.serve() as server, xr.World.join(server.address, "solo", 2, num_processes=1,
                                             index=0, timeout=20) as world:
        send = xr.Bound({"w": src}, {(0, "w"): bufs[0], (1, "w"): bufs[1]})
        refit = xr.Refit(world, send=send,
                         receive=xr.Bound({"w": dst}, {(0, "w"): views[0], (1, "w"): views[1]}),
                         tuning=xr.Tuning(executor=executor))
        with pytest.raises(BindingError, match=r"receive 'w' on rank [01] shares memory with "
                                               r"send 'w' on rank [01]"):
            refit()
        assert all(v.tobytes() == b.tobytes() for v, b in zip(views, before))
        out = [np.zeros((2, 4), np.float32) for _ in range(2)]
        refit(send=send, receive=xr.Bound({"w": dst}, {(0, "w"): out[0], (1, "w"): out[1]}))
        assert out[0].tobytes() == grid[:2].tobytes() and out[1].tobytes() == grid[2:].tobytes()
