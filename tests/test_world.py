"""The refit world: joining over a stand-alone TCPStore, rank numbering, JSON collectives,
timeouts naming the processes that never arrived. Real processes through xreshard.tools.launch."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time

import pytest

if importlib.util.find_spec("torch") is None:     # the rendezvous store is torch's TCPStore
    pytest.skip("the world needs torch (its rendezvous store)", allow_module_level=True)

from xreshard.errors import RefitError, WorldBroken
from xreshard.tools.launch import Context, Role, launch
from xreshard.ir.topology import Topology
from xreshard.transport.base import TransportTimeout
from xreshard.runtime.world import World, parse_address, serve

ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("plain", "rollout", 1),
         Role("torch", "rollout", 0)]


def _describe(w: World) -> dict:
    return {"rank_ids": list(w.rank_ids), "num_ranks": w.num_ranks,
            "num_processes": w.num_processes, "process_index": w.process_index,
            "processes": [{k: p[k] for k in ("group", "index", "num_ranks", "ranks",
                                            "device_kinds")} for p in w.processes],
            "trainer": list(w.group_ranks("trainer")), "rollout": list(w.group_ranks("rollout")),
            "topology": sorted(w.topology.process.items()), "groups": list(w.groups),
            "kinds": [w.device_kind(r) for r in range(w.num_ranks)],
            "local": [r for r in range(w.num_ranks) if w.is_local(r)]}


def join_and_talk(ctx: Context) -> dict:
    import torch.distributed as dist

    out = {}
    devices = None if ctx.role.kind != "torch" else ["cpu"]
    with ctx.join(devices, timeout=20) as w:
        out["sorted"] = _describe(w)
        me = w.process_index
        out["gathered"] = w.allgather_json({"me": me, "label": f"{ctx.role.group}[{ctx.role.index}]"})
        out["bcast"] = w.broadcast_json({"from": me, "x": [1.5, None, "s"]}, root_process=2)
        w.barrier()
        with pytest.raises(TypeError):         # refused before posting: nobody is left waiting
            w.allgather_json({"bad": object()})
        out["after_bad"] = w.allgather_json(me * 10)
        out["local_device"] = str(w.local_device(w.rank_ids[-1]))
        with pytest.raises(RefitError, match="no group 'x'"):
            w.group_ranks("x")
    with ctx.join(devices, groups=("trainer", "rollout"), world_id="ordered", timeout=20) as w:
        out["ordered"] = _describe(w)
        out["ordered_bcast"] = w.broadcast_json(ctx.role.group, root_process=1)
    out["default_group_initialized"] = dist.is_initialized()
    return out


def test_three_processes_agree_on_rank_numbering():
    results = launch(join_and_talk, ROLES, timeout=60)
    values = [r.value for r in results]
    for key in ("sorted", "ordered"):
        common = [{k: v for k, v in val[key].items()
                   if k not in ("rank_ids", "process_index", "local")} for val in values]
        assert common[0] == common[1] == common[2]

    # sorted group names: rollout[0], rollout[1], trainer[0]
    s = values[0]["sorted"]
    assert s["num_ranks"] == 6 and s["num_processes"] == 3
    assert [(p["group"], p["index"], p["ranks"]) for p in s["processes"]] == [
        ("rollout", 0, [0]), ("rollout", 1, [1]), ("trainer", 0, [2, 3, 4, 5])]
    assert s["trainer"] == [2, 3, 4, 5] and s["rollout"] == [0, 1]
    assert s["topology"] == [[0, 0], [1, 1], [2, 2], [3, 2], [4, 2], [5, 2]]
    assert s["kinds"] == ["cpu"] * 6 and s["groups"] == ["rollout", "trainer"]
    assert [v["sorted"]["rank_ids"] for v in values] == [[2, 3, 4, 5], [1], [0]]
    assert [v["sorted"]["process_index"] for v in values] == [2, 1, 0]
    assert [v["sorted"]["local"] for v in values] == [[2, 3, 4, 5], [1], [0]]

    # groups=("trainer", "rollout"): trainer[0], rollout[0], rollout[1]
    o = values[0]["ordered"]
    assert [(p["group"], p["index"], p["ranks"]) for p in o["processes"]] == [
        ("trainer", 0, [0, 1, 2, 3]), ("rollout", 0, [4]), ("rollout", 1, [5])]
    assert [v["ordered"]["rank_ids"] for v in values] == [[0, 1, 2, 3], [5], [4]]

    for v in values:
        assert v["gathered"] == [{"me": 0, "label": "rollout[0]"}, {"me": 1, "label": "rollout[1]"},
                                 {"me": 2, "label": "trainer[0]"}]
        assert v["bcast"] == {"from": 2, "x": [1.5, None, "s"]}
        assert v["after_bad"] == [0, 10, 20]
        assert v["ordered_bcast"] == "rollout"
        assert v["default_group_initialized"] is False
    assert values[0]["local_device"] == "cpu:3"      # str(jax.local_devices()[3])


def never_arrives(ctx: Context) -> dict:
    if ctx.launch_index == 2:
        time.sleep(1)          # joins nothing
        return {}
    import torch.distributed  # noqa: F401 - not counted in the timed wait

    out = {}
    t0 = time.monotonic()
    try:
        ctx.join(1, timeout=3)
    except TransportTimeout as e:
        out["join"] = [str(e), time.monotonic() - t0]
    with ctx.join(1, num_processes=2, world_id="two", timeout=10) as w:
        if ctx.launch_index == 0:
            t0 = time.monotonic()
            try:
                w.allgather_json("hello", timeout=2)
            except TransportTimeout as e:
                out["allgather"] = [str(e), time.monotonic() - t0]
            try:
                w.barrier(timeout=1)
            except WorldBroken as e:     # the step counters are apart now: refused at once
                out["barrier"] = str(e)
            out["broken"] = w.broken
        else:
            time.sleep(6)      # never calls the collectives (closing would end them at once)
    return out


@pytest.mark.slow
def test_missing_processes_time_out_and_are_named():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0), Role("plain", "rollout", 1)]
    v0, v1, _ = [r.value for r in launch(never_arrives, roles, timeout=60)]
    for v in (v0, v1):
        msg, elapsed = v["join"]
        assert 2.9 <= elapsed < 3 + 5
        assert "2 of 3 processes joined in time" in msg and "1 never did" in msg
        assert "trainer[0]" in msg and "rollout[0]" in msg
    msg, elapsed = v0["allgather"]
    assert 1.9 <= elapsed < 2 + 5
    # world "two": rollout[0] is process 0 and never calls; trainer[0] (process 1) waits
    assert "allgather" in msg and "never arrived: rollout[0] (process 0" in msg
    assert "timed out after 2 s: " in msg           # rounded, not 2.0 or 1.99873
    assert "trainer[0]" not in msg.partition(" (raised first by")[0]    # only the missing
    assert "is broken" in v0["barrier"] and "rollout[0] (process 0" in v0["barrier"]
    assert v0["broken"].startswith("TransportTimeout: allgather")
    assert "allgather" not in v1


def partial_outcomes(ctx: Context, dead: bool = False) -> dict:
    """Three processes; after a barrier, process 2 never posts its outcome: it is stuck
    for 8 s (alive: waited for up to the timeout, 1 s) or, ``dead``, its process exits
    (not waited for, though the others would wait 600 s). Process 0 posts at once;
    process 1 3 s later unless ``dead`` (a survivor still stuck in its transport)."""
    with ctx.join(1, groups=("trainer", "rollout"), timeout=20) as w:
        w.barrier(timeout=20)
        me = w.process_index
        if me == 2:
            if dead:
                os._exit(0)
            time.sleep(8)
            return {"me": me}
        if me == 1 and not dead:
            time.sleep(3)
        got = w.allgather_json({"me": me}, timeout=600 if dead else 1, kind="refit/outcome",
                               partial=True)
        return {"me": me, "got": got}


PARTIAL_ROLES = [Role("plain", "trainer", 0), Role("plain", "rollout", 0),
                 Role("plain", "rollout", 1)]


@pytest.mark.slow
def test_a_partial_collective_gives_every_survivor_the_same_arrivals():
    """Issue 17.9: the survivors of a dead process build their failure message from the
    outcomes that arrived; a survivor whose wait ended before a slow one posted must not
    see other outcomes than that slow one (one message everywhere)."""
    results = launch(partial_outcomes, PARTIAL_ROLES, timeout=90)
    values = {v["me"]: v for v in (r.value for r in results)}
    assert values[0]["got"] == values[1]["got"], values
    assert values[0]["got"][2] is None


@pytest.mark.slow
def test_a_partial_collective_stops_waiting_for_a_process_gone_from_this_host():
    """A member on this host whose process no longer runs (pid and start time) is not
    waited for until the timeout: the survivors' outcome exchange settles without it
    (well inside the launch's 120 s, against the exchange's 600)."""
    results = launch(partial_outcomes, PARTIAL_ROLES, args=(True,), timeout=120, check=False,
                     fail_fast=False)
    values = [r.value for r in results[:2]]
    assert [v["got"] for v in values] == [[{"me": 0}, {"me": 1}, None]] * 2, values


def test_gone_only_where_pids_mean_what_they_say():
    """``epochs.gone``: a member on this node (machine, boot, pid namespace) whose process
    ended is gone; the same pid and start time published from another node (a pod sharing
    the host's name but not its pid namespace), or with no node, are never declared gone;
    a live one is not."""
    import subprocess
    import sys
    from xreshard.runtime import epochs
    from xreshard.transport import peers

    node = epochs.own_node()
    assert node is not None and node.startswith(socket.gethostname())
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    start = peers.process_start_time(proc.pid)
    info = {"group": "rollout", "index": 0, "host": "a", "node": node, "pid": proc.pid,
            "start": start}
    assert start is not None and not epochs.gone(info, ())      # alive
    proc.communicate(b"")
    assert epochs.gone(info, ())                                 # ended, on this node
    host, boot, _ = node.split("|")
    assert not epochs.gone({**info, "node": f"{host}|{boot}|pid:[1]"}, ())
    assert not epochs.gone({k: v for k, v in info.items() if k != "node"}, ())
    me = {**info, "pid": os.getpid(), "start": peers.own_start_time()}
    assert not epochs.gone(me, ())


def test_in_process_world_and_errors():
    with serve() as server:
        host, port = parse_address(server.address)
        assert host == "127.0.0.1" and port > 0
        with World.join(server.address, "solo", ["cpu", "cpu"], num_processes=1, index=0,
                        timeout=5) as w:
            assert w.rank_ids == (0, 1) and w.num_processes == 1 and w.process_index == 0
            assert w.allgather_json({"a": 1}) == [{"a": 1}]
            assert w.broadcast_json([1, 2]) == [1, 2]
            w.barrier()
            assert isinstance(w.topology, Topology)
            assert w.route(0, 1) == "local"
            t = w.transport()
            assert t is w.transport("auto") and "local" in t.name
            assert json.loads(json.dumps(w.processes))[0]["ranks"] == [0, 1]
        with pytest.raises(RefitError, match="closed"):
            w.barrier()
        with pytest.raises(RefitError, match="index="):
            World.join(server.address, "solo", 1, num_processes=1, world_id="noindex")
        with pytest.raises(RefitError, match="not in groups"):
            World.join(server.address, "x", 1, num_processes=1, index=0, groups=["y"])
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_address("localhost")


def test_first_process_can_host_the_store():
    with World.join("tcp://127.0.0.1:0", "solo", 1, num_processes=1, index=0, timeout=5,
                    is_server=True) as w:
        host, port = parse_address(w.address)
        assert port > 0 and w.broadcast_json("x") == "x"


def close_under_a_refit(ctx: Context) -> dict:
    """rollout[0] starts a refit and closes the world while the refit waits for a trainer
    that comes two seconds late: close waits for it (bounded by the timeout)."""
    import numpy as np
    import xreshard as xr
    shape = (16, 8)
    values = np.arange(128, dtype=np.float32).reshape(shape)
    world = ctx.join(1, timeout=20)
    rank = world.rank_ids[0]
    config = xr.RefitConfig(timeout=20)
    if ctx.role.group == "trainer":
        time.sleep(2.0)
        lay = xr.Layout.replicated(shape, "float32", xr.Mesh((1,), (rank,)))
        report = xr.Refit(world, send=xr.Bound({"w": lay}, {(rank, "w"): values}),
                          config=config)()
        world.close()
        return {"version": report.version}
    dest = np.zeros(shape, np.float32)
    lay = xr.Layout.explicit_form(shape, "float32", {rank: [[(0, 16), (0, 8)]]})
    handle = xr.Refit(world, receive=xr.Bound({"w": lay}, {(rank, "w"): [dest]},
                                              local_only={"w"}), config=config).start()
    time.sleep(0.5)         # the refit waits in its first collective for the late trainer
    world.close()
    out = {"version": handle.wait().version, "exact": dest.tobytes() == values.tobytes()}
    try:
        world.barrier()
    except RefitError as e:
        out["after"] = str(e)
    return out


@pytest.mark.slow
def test_closing_a_world_waits_for_a_refit_running_in_another_thread():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    trainer, rollout = (r.value for r in launch(close_under_a_refit, roles, timeout=120))
    assert trainer == {"version": 1}
    assert rollout["version"] == 1 and rollout["exact"]
    assert "is closed" in rollout["after"]


def _os_threads() -> int:
    import os
    return len(os.listdir("/proc/self/task"))


def threads_after_worlds(ctx: Context) -> dict:
    """A torch receiver joins and closes three worlds in turn (shm, gloo, and two worlds
    open at once), refitting in each; what threads it has after each close."""
    import threading

    import numpy as np
    import torch
    import xreshard as xr
    shape = (512, 256)
    dests = [torch.zeros(shape) for _ in range(4)]    # starts torch's own intra-op pool
    baseline = (_os_threads(), sorted(t.name for t in threading.enumerate()))
    seen = []

    def refit(world, i, transport):
        rank = world.rank_ids[0]
        config = xr.RefitConfig(timeout=30, transport=transport, verify=True)
        if ctx.role.group == "trainer":
            lay = xr.Layout.replicated(shape, "float32", xr.Mesh((1,), (rank,)))
            values = np.full(shape, i, np.float32)
            r = xr.Refit(world, send=xr.Bound({"w": lay}, {(rank, "w"): values}),
                         config=config)
        else:
            r = xr.Refit(world, receive={"w": dests[i]}, config=config)
        r()
        r.start().wait()

    for i, transport in enumerate(["auto", "gloo"]):
        with ctx.join(1, world_id=f"t{i}", timeout=30) as world:
            refit(world, i, transport)
        seen.append((_os_threads(), sorted(t.name for t in threading.enumerate())))
    a = ctx.join(1, world_id="t2", timeout=30)
    b = ctx.join(1, world_id="t3", timeout=30)
    refit(a, 2, "auto")
    refit(b, 3, "gloo")
    a.close()
    b.close()
    seen.append((_os_threads(), sorted(t.name for t in threading.enumerate())))
    exact = ctx.role.group == "trainer" or all(
        bool((d == i).all()) for i, d in enumerate(dests))
    return {"baseline": baseline, "seen": seen, "exact": exact}


@pytest.mark.slow
def test_a_receiver_keeps_no_thread_after_its_worlds_close():
    """The thread the issue saw remain on a torch receiver is torch's intra-op pool (the
    first parallel torch op starts it, process-wide); with it started before, a process
    has exactly the threads it had before joining, after every world closed."""
    roles = [Role("plain", "trainer", 0), Role("torch", "rollout", 0)]
    for v in (r.value for r in launch(threads_after_worlds, roles, timeout=240)):
        assert v["exact"]
        for after in v["seen"]:
            assert after == v["baseline"], (after, v["baseline"])


def test_a_store_xreshard_did_not_start_hosts_worlds_too():
    """A TCPStore another launcher started has no store nonce: the first joiner's instance
    binds to none, and the world forms, closes and forms again under the same id."""
    import datetime

    from torch.distributed import TCPStore
    from xreshard.runtime.store import STORE_NONCE_KEY
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                     wait_for_workers=False)
    address = f"tcp://127.0.0.1:{store.port}"
    for _ in range(2):
        with World.join(address, "solo", 1, num_processes=1, index=0, timeout=5,
                        token="a-token-of-16-chars") as w:
            assert w.allgather_json("x") == ["x"]
    assert not store.check([STORE_NONCE_KEY])


def test_timeouts_print_rounded():
    from xreshard.transport.base import format_seconds
    assert [format_seconds(x) for x in (5, 5.0, 0.25, 2.98741, 12.4, 300.0, 0.004)] == [
        "5 s", "5 s", "0.25 s", "2.99 s", "12 s", "300 s", "0.004 s"]
