"""Refits on GPUs (skipped without them): one GPU with JAX and torch in one process, and
one process per GPU through the launcher when several GPUs exist."""

from __future__ import annotations

import numpy as np
import pytest

from .test_gpu import _WHY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


def _num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


def test_jax_to_torch_on_one_gpu_in_one_process():
    """JAX shards on the GPU -> a torch CUDA tensor, both frameworks in this process: the
    world has 2 ranks in 1 process, so every pair goes through the local transport."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xreshard as xr
    from xreshard.adapters.torch import tensor_view

    gpu = jax.devices("gpu")[0]
    with xr.serve() as server:
        world = xr.World.join(server.address, "local", [gpu, "cuda:0"], num_processes=1,
                              index=0, timeout=60)
        mesh = jax.sharding.Mesh(np.array([gpu]), ("x",))
        value = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
        params = {"w": jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("x")))}
        out = torch.zeros((64, 48), dtype=torch.float32, device="cuda:0")
        layout = xr.Layout.replicated((64, 48), "float32", xr.Mesh((1,), (1,)))
        receive = xr.Bound({"w": layout}, {(1, "w"): tensor_view(out)})
        refit = xr.Refit(world, send=params, receive=receive)
        report = refit()
        torch.cuda.synchronize()
        assert report.version == 1
        assert np.array_equal(out.cpu().numpy(), value)
        # the region is one contiguous run on both sides: sent and received in place
        assert report.num_zero_copy == 2 and report.staging_bytes == 0
        world.close()


@pytest.mark.skipif(_num_gpus() < 2, reason="needs 2 GPUs")
def test_jax_to_torch_one_process_per_gpu():
    from xreshard.launch import Role, launch
    from . import refit_cases as cases

    roles = [Role("jax", "trainer", 0, gpus=(0,)), Role("torch", "rollout", 0, gpus=(1,))]
    results = launch(cases.gpu_jax_to_torch, roles, timeout=300)
    assert all(r.value["ok"] for r in results)
