"""Bad input, said clearly: what was wrong, where, and how to fix it (one process)."""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr


def to_hf(path: str) -> str:
    table = {"w": "model.w"}
    return table[path]                                  # KeyError for any other path


def test_an_exception_in_names_keeps_its_type_and_where_it_was_raised():
    jax = pytest.importorskip("jax")
    pytest.importorskip("torch")        # the world's store is torch's TCPStore
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    params = {"v": jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))}
    with xr.serve() as server, xr.World.join(server.address, "trainer", jax.devices()[:2],
                                             num_processes=1, index=0, timeout=30) as world:
        refit = xr.Refit(world, send=params, names=to_hf)
        with pytest.raises(xr.XreshardError) as raised:
            refit(send=params)
    msg = str(raised.value)
    assert "names= raised KeyError('v')" in msg, msg
    assert f"test_bad_input.py:{to_hf.__code__.co_firstlineno + 2} in to_hf" in msg, msg
    assert "'v'" in msg


def test_names_returning_a_non_string_is_refused_with_what_it_returned():
    from xreshard.runtime.binding import canonical_name

    with pytest.raises(xr.BindingError, match=r"names= returned b'w' \(bytes\) for 'w'"):
        canonical_name("w", lambda key: key.encode())
    assert canonical_name("w", {"w": "model.w"}) == "model.w"
    assert canonical_name("z", {"w": "model.w"}) == "z"


def torch_half_joined(ctx) -> str:
    """Two torch processes share a DTensor mesh; only torch rank 0 joins the refit's world."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from .refit_cases import _torch_group

    _torch_group(ctx, 2, ctx.role.index, "pg")
    mesh = init_device_mesh("cpu", (2,))
    weight = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    message = "did not join"
    if ctx.role.index == 0:
        with xr.World.join(ctx.address, "rollout", 1, num_processes=1, index=0,
                           world_id="half", timeout=30) as world:
            try:
                xr.Refit(world, receive={"model.w": weight})()
            except xr.XreshardError as e:
                message = f"{type(e).__name__}: {e}"
    dist.barrier()
    return message


@pytest.mark.slow
def test_a_dtensor_mesh_rank_whose_process_never_joined_is_named_with_the_fix():
    from xreshard.tools.launch import Role, launch

    results = launch(torch_half_joined, [Role("torch", "rollout", 0), Role("torch", "rollout", 1)],
                     timeout=120)
    msg = results[0].value
    assert msg.startswith("RefitError: refit v1 refused before moving anything"), msg
    assert "DTensor 'model.w' lives on a DeviceMesh over torch ranks [0, 1]" in msg, msg
    assert "the process of torch rank 1 is not in this refit's world group" in msg, msg
    assert "joined: 0 -> world rank 0" in msg and "must call World.join" in msg, msg
