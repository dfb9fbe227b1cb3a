"""What a multi-process refit spends around its bytes (issue 35 item 4): both receivers fed
from the trainer's first sends, and the store requests of a warm call's two collectives.

Real processes: a JAX trainer (4 CPU devices) and two torch receivers (DTensors over gloo),
over shm where the host allows; every destination byte is compared after every call.
"""

from __future__ import annotations

from typing import Any

import pytest

from xreshard.planner.schedule import Bucket
from xreshard.runtime.codecs.framing import interleaved
from xreshard.tools.launch import Context, Role, launch

from . import refit_cases as cases

pytest.importorskip("torch")

#: column-parallel tensors: the trainer splits their rows over its 4 ranks, each receiver
#: holds a half (trainer ranks 0-1 feed rollout[0], 2-3 rollout[1])
ROWS = {f"w{i}": ((64, 256), ("a",), ["S0"], "") for i in range(6)}
STEPS = 2


def _bucket(dst: int, nbytes: int, tag: int) -> Bucket:
    return Bucket(0, dst, 0, tag, (), nbytes, 0)


def test_interleaved_takes_destinations_in_turn_by_bytes_keeping_each_order():
    sends = [_bucket(4, 100, 0), _bucket(4, 100, 1), _bucket(4, 100, 2),
             _bucket(5, 250, 3), _bucket(5, 10, 4), _bucket(6, 50, 5)]
    got = interleaved(sends)
    assert sorted(got, key=lambda b: b.tag) == sends           # every send, once
    for d in (4, 5, 6):
        assert [b.tag for b in got if b.dst == d] == [b.tag for b in sends if b.dst == d]
    # the next send goes to the destination with the fewest bytes posted so far
    assert [b.tag for b in got] == [0, 3, 5, 1, 2, 4]
    assert interleaved(sends[:3]) == sends[:3]                  # one destination: as is


def sender(ctx: Context, steps: int) -> dict:
    """The trainer: refits ``ROWS`` ``steps`` times; per call, the destination and size of
    each send its transport was handed, in order, and the store requests of the call."""
    import threading

    import xreshard as xr
    from xreshard.transport import base, shm

    posted: list[list[int]] = []
    started: list[str] = []
    real, start = shm.ShmTransport.send, threading.Thread.start

    def spy_start(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)
    threading.Thread.start = spy_start      # type: ignore[method-assign]

    def send(self: Any, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        posted.append([dst_rank, base.nbytes_of(buf)])
        real(self, buf, src_rank, dst_rank, tag)
    shm.ShmTransport.send = send        # type: ignore[method-assign]
    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=60, bucket_bytes=1 << 12))
    calls = []
    for step in range(steps):
        params = cases._jax_params(ROWS, "bfloat16", step, mesh_shape=(4, 1))
        posted.clear()
        started.clear()
        with xr.count_comm() as counts:
            refit(send=params)
        calls.append({"posted": list(posted), "counts": counts.as_json(),
                      "threads": list(started)})
    out = {"calls": calls, "name": world.transport("auto").name,
           "rollout": list(world.group_ranks("rollout"))}
    world.close()
    return out


def receiver(ctx: Context, steps: int) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    cases._torch_group(ctx, 2, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    state = cases._dtensors(ROWS, "bfloat16", 2, None)
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60,
                                                                 bucket_bytes=1 << 12))
    calls = []
    for step in range(steps):
        with xr.count_comm() as counts:
            refit()
        cases._check_dtensors(state, ROWS, "bfloat16", step, "bfloat16")   # bit-exact
        calls.append({"counts": counts.as_json()})
    world.close()
    dist.destroy_process_group()
    return {"calls": calls, "version": refit.version}


@pytest.fixture(scope="module")
def refits() -> list[dict]:
    roles = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
             Role("torch", "rollout", 1)]
    results = launch([sender, receiver, receiver], roles, args=(STEPS,), timeout=150)
    return [r.value for r in results]


def test_the_trainer_feeds_both_receivers_from_its_first_sends(refits):
    """Before: the sends went out by (source rank, destination rank) pair, so rollout[0]
    got all of its messages before rollout[1] got one; now, at every point of a call,
    the bytes handed to the two receivers differ by at most one message."""
    trainer = refits[0]
    assert trainer["name"] == "auto(local+shm)", trainer["name"]
    assert all(r["version"] == STEPS for r in refits[1:])
    a, b = trainer["rollout"]
    for call in trainer["calls"]:
        posted = call["posted"]
        assert {d for d, _ in posted} == {a, b}
        assert len(posted) >= 8, posted            # several messages to each receiver
        largest = max(n for _, n in posted)
        to = {a: 0, b: 0}
        for d, n in posted:
            to[d] += n
            assert abs(to[a] - to[b]) <= largest, posted


def collective_keys(ctx: Context) -> dict:
    """Two all-gathers and a close; after each, every process past it (a counter of the
    launch store, not a collective), which of the first's and the second's payload keys
    are left in the store."""
    import time

    from xreshard.runtime.store import connect

    world = ctx.join(timeout=30)
    store = connect(world.address, 30)
    n = world.num_processes

    def everyone_past(tag: str) -> None:
        store.add(f"fixed-test/{tag}", 1)
        deadline = time.monotonic() + 30
        while int(store.add(f"fixed-test/{tag}", 0)) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    def left(op: int) -> list[bool]:
        return [bool(store.check([f"{world._root}/op{op}/{p}"])) for p in range(n)]

    assert world.allgather_json(ctx.role.index, kind="first") == list(range(n))
    first = world._num_ops
    everyone_past("first")
    out = {"after first": left(first)}
    everyone_past("looked at first")
    assert world.allgather_json(-ctx.role.index, kind="second") == [-p for p in range(n)]
    second = world._num_ops
    everyone_past("second")
    out.update({"first after second": left(first), "second after second": left(second)})
    everyone_past("looked at second")
    world.close()
    everyone_past("closed")
    out["second after close"] = left(second)
    return out


def test_a_collectives_keys_go_at_the_next_one_not_on_its_own_path():
    """Before: the last process to read a collective's payloads deleted them (n + 1 store
    round trips) before it returned, on the path of the step after it (a refit's move, its
    outcome). Now it deletes them in its next collective, after posting its own payload
    (while the others arrive), or when it closes the world: the store still does not
    grow."""
    roles = [Role("plain", "g", i) for i in range(3)]
    got = [r.value for r in launch(collective_keys, roles, timeout=90)]
    for v in got:
        assert v["after first"] == [True] * 3, v            # kept past the collective
        assert v["first after second"] == [False] * 3, v    # gone during the next one
        assert v["second after second"] == [True] * 3, v
        assert v["second after close"] == [False] * 3, v    # and the last at close


def test_a_warm_call_starts_no_thread(refits):
    """Before: every call started two threads, the executor's wire and one to free the
    source views during the outcome exchange (made for 12,000 views); starting one waits
    for it to run, 0.1-0.3 ms on a quiet 2-core host and 2-6 ms on a loaded one, on the
    path into the move and into the outcome. Now the wire runs on the world's thread kept
    across calls, and a call of a few hundred views frees them inline."""
    calls = refits[0]["calls"]
    assert "xreshard-wire" in calls[0]["threads"], calls[0]["threads"]     # made once
    for call in calls[1:]:
        assert call["threads"] == [], call["threads"]
    warm = calls[-1]["counts"]["collectives"]
    assert warm == {"refit/check": 1, "refit/outcome": 1}, warm
