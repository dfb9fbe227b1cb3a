"""``xr.count_comm()`` sees exactly what a refit puts on the wire, per peer and per round.

A JAX process (4 CPU devices, ``P("tp", None)`` rows over tp=4) sends a float32 ``[R, C]``
weight to two torch processes holding it as ``Shard(1)`` (column halves). Each torch rank
lacks, from each JAX rank, the rows that rank holds of its column half: ``R/4 x C/2``
elements, no more and no less. The counts are compared with that figure computed here
from the shapes, not from the plan, and with what the other side saw.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.runtime.commcount import CommCounts, CountedTransport, count_comm
from xreshard.tools.launch import Role, launch
from xreshard.transport.local import LocalTransport

R, C = 64, 48
TP, ROLLOUT = 4, 2


def _expected_pairs(trainer_ranks: list[int], rollout_ranks: list[int]) -> dict:
    per_pair = (R // TP) * (C // ROLLOUT) * 4
    return {(s, d): per_pair for s in trainer_ranks for d in rollout_ranks}


def trainer(ctx: Any) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.local_devices())
    w = jax.device_put(jnp.arange(R * C, dtype=jnp.float32).reshape(R, C),
                       NamedSharding(mesh, P("tp", None)))
    refit = xr.Refit(world, send={"w": w}, config=xr.RefitConfig(timeout=60))
    calls = []
    for step in range(3):       # the third: new arrays of the same sharding (a step's output)
        sent = w if step < 2 else jax.block_until_ready(w + 0)
        with count_comm() as counts:
            refit(send={"w": sent})
        calls.append(counts.as_json())
    out = {"calls": calls, "trainer_ranks": list(world.group_ranks("trainer")),
           "rollout_ranks": list(world.group_ranks("rollout"))}
    world.close()
    return out


def rollout(ctx: Any) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xreshard as xr
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store),
                            rank=ctx.role.index, world_size=ROLLOUT)
    world = ctx.join(groups=["trainer", "rollout"])
    mesh = init_device_mesh("cpu", (ROLLOUT,))
    local = torch.zeros(R, C // ROLLOUT)
    state = {"w": DTensor.from_local(local, mesh, [Shard(1)], shape=torch.Size((R, C)),
                                     stride=(C, 1), run_check=False)}
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60))
    calls = []
    for _ in range(3):
        with count_comm() as counts:
            refit()
        calls.append(counts.as_json())
    cols = slice(ctx.role.index * C // ROLLOUT, (ctx.role.index + 1) * C // ROLLOUT)
    want = np.arange(R * C, dtype=np.float32).reshape(R, C)[:, cols]
    exact = local.numpy().tobytes() == want.tobytes()
    world.close()
    dist.destroy_process_group()
    return {"calls": calls, "exact": exact}


@pytest.mark.slow
def test_counts_are_the_bytes_each_destination_lacks_per_peer():
    roles = [Role("jax", "trainer", 0, num_devices=TP)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT)]
    results = launch([trainer, rollout, rollout], roles, timeout=150)
    t = results[0].value
    want = _expected_pairs(t["trainer_ranks"], t["rollout_ranks"])
    received: dict = {}
    for res in results[1:]:
        assert res.value["exact"]
    for call in range(3):                           # later calls move it all again
        sent = CommCounts.pairs_from_json(t["calls"][call]["bytes_sent"])
        assert sent == want
        assert CommCounts.pairs_from_json(t["calls"][call]["messages_sent"]).keys() == want.keys()
        received = {}
        for res in results[1:]:
            got = res.value["calls"][call]
            assert got["bytes_sent"] == {}           # receivers send nothing
            assert got["rounds"] >= 1
            received.update(CommCounts.pairs_from_json(got["bytes_received"]))
        assert received == want
    # a warm plain call (no delta, atomic, verify, check_writes, FP8 or relay) enters two
    # metadata collectives, its check and its outcome, and one transport round, on every
    # process: no feature that is off costs a collective
    for res in results:
        for call in (1, 2):
            got = res.value["calls"][call]
            assert got["collectives"] == {"refit/check": 1, "refit/outcome": 1}, (res.role, got)
            assert got["rounds"] == res.value["calls"][1]["rounds"] == 1, (res.role, got)


def test_counter_sees_posts_only_while_active_and_nests():
    t = CountedTransport(LocalTransport([0, 1]))
    a = np.arange(8, dtype=np.float32)
    b = np.zeros(8, np.float32)

    def move() -> None:
        with t.group(5.0):
            t.recv(b, 0, 1, 7)
            t.send(a, 0, 1, 7)

    move()                                          # nobody counting
    with count_comm() as outer:
        move()
        with count_comm() as inner:
            move()
    move()
    assert b.tobytes() == a.tobytes()
    assert outer.bytes_sent == {(0, 1): 64} and outer.rounds == 2
    assert outer.messages_received == {(0, 1): 2} and outer.received_from(0) == 64
    assert inner.bytes_sent == {(0, 1): 32} and inner.sent_to(1) == 32 and inner.rounds == 1
    assert CommCounts.pairs_from_json(outer.as_json()["bytes_received"]) == {(0, 1): 64}
