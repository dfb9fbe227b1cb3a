"""Functions ``test_wire_order.py`` launches: a JAX trainer holding ``[in, out]`` kernels
(real ``NamedSharding`` s on 4 CPU devices) refits two torch processes' DTensors, one
world per case (``series``), every destination byte compared on its receiver."""

from __future__ import annotations

from typing import Any

from .refit_cases import _check_dtensors, _dtensors, _jax_params, _torch_group, run_series

#: name -> (canonical [out, in] shape, JAX spec of the canonical dims on mesh ("a", "b"),
#: torch placements on the 2 receivers, "T": the JAX side holds the [in, out] kernel)
TENSORS = {
    # whole JAX shards of out rows: each posted as it is, one receiver each
    "k_col": ((1024, 384), (("a", "b"),), ["S0"], "T"),
    # JAX shards of out rows, torch columns: kernel row ranges, still one run each
    "k_in": ((600, 256), ("a",), ["S1"], "T"),
    # JAX shards of in columns, torch rows: kernel column ranges, packed
    "k_part": ((600, 256), (None, "a"), ["S0"], "T"),
    "small": ((48, 40), ("b",), ["S0"], "T"),
    "bias": ((600,), ("b",), ["R"], ""),
    "norm": ((40, 7), (), ["S0"], ""),
}
KERNELS = sorted(n for n, t in TENSORS.items() if "T" in t[3])
STEPS = 3


def series(ctx: Any, programs: list) -> dict:
    """Each ``[name, trainer function, rollout function, args]`` in its own world (id: the
    name); name -> ``{"value": ...}`` or ``{"error": traceback}``."""
    return run_series(ctx, programs, globals())


def jax_sender(ctx: Any, config: dict, wire: str | None, dst_dtype: str,
               stored: bool = True) -> dict:
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, send=_jax_params(TENSORS, "float32", 0), transpose=set(KERNELS),
                     config=xr.RefitConfig(wire_dtype=wire, timeout=60, **config),
                     tuning=xr.Tuning(send_stored=stored))
    for step in range(STEPS):
        refit(send=_jax_params(TENSORS, "float32", step))
    transposed = sorted(n for n, _ in refit._prepared.formats.transposed)
    world.close()
    return {"transposed": transposed}


def torch_receiver(ctx: Any, config: dict, wire: str | None, dst_dtype: str,
                   stored: bool = True) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    _torch_group(ctx, 2, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    state = _dtensors(TENSORS, dst_dtype, 2, None)
    refit = xr.Refit(world, receive=state,
                     config=xr.RefitConfig(wire_dtype=wire, timeout=60, **config))
    checked = 0
    for step in range(STEPS):
        refit()
        checked += _check_dtensors(state, TENSORS, dst_dtype, step, "float32")
    world.close()
    dist.destroy_process_group()
    return {"checked": checked, "version": refit.version}


# ---------------------------------------------------------------------------- FP8

#: q8: a bf16 [in, out] kernel the receivers store block-FP8 (quantized on the way, in
#: canonical order); k8: a bf16 kernel they store bf16 (sent in the trainer's order)
FP8_SHAPE = (512, 256)


def _fp8_values(step: int) -> dict:
    import ml_dtypes
    import numpy as np
    rng = np.random.default_rng(50 + step)
    return {n: (rng.standard_normal(FP8_SHAPE) * 0.02).astype(ml_dtypes.bfloat16)
            for n in ("q8", "k8")}


def jax_fp8_sender(ctx: Any) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(step: int) -> dict:       # [in, out] kernels, out over the grid
        return {n: jax.device_put(np.ascontiguousarray(v.T), NamedSharding(
            mesh, P(None, ("a", "b")))) for n, v in _fp8_values(step).items()}
    refit = xr.Refit(world, send=params(0), transpose={"q8", "k8"},
                     config=xr.RefitConfig(timeout=60), tuning=xr.Tuning(send_stored=True))
    for step in range(2):
        refit(send=params(step))
    transposed = sorted(n for n, _ in refit._prepared.formats.transposed)
    world.close()
    return {"transposed": transposed}


def torch_fp8_receiver(ctx: Any) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xreshard as xr
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8
    from xreshard.quant.host import quantize_block_fp8

    _torch_group(ctx, 2, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    mesh = init_device_mesh("cpu", (2,))
    me, fmt = ctx.role.index, BlockFP8()

    def sharded(full: tuple, dtype: Any) -> Any:
        local = torch.zeros((full[0] // 2,) + tuple(full[1:]), dtype=dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(full),
                                  stride=torch.empty(full).stride(), run_check=False)
    state = {"q8": Quantized(sharded(FP8_SHAPE, torch.float8_e4m3fn),
                             sharded(fmt.scale_shape(FP8_SHAPE), torch.float32), fmt),
             "k8": sharded(FP8_SHAPE, torch.bfloat16)}
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60))
    checked = 0
    for step in range(2):
        refit()
        values = _fp8_values(step)
        codes, scales = quantize_block_fp8(values["q8"], fmt, name="q8")
        half = slice(me * FP8_SHAPE[0] // 2, (me + 1) * FP8_SHAPE[0] // 2)
        shalf = slice(me * scales.shape[0] // 2, (me + 1) * scales.shape[0] // 2)
        q = state["q8"]
        for got, want in ((q.codes.to_local(), codes[half]), (q.scales.to_local(), scales[shalf]),
                          (state["k8"].to_local(), values["k8"][half])):
            if got.contiguous().view(torch.uint8).numpy().tobytes() != \
                    np.ascontiguousarray(want).tobytes():
                raise AssertionError(f"rank {me} holds wrong bytes at step {step}")
            checked += 1
    world.close()
    dist.destroy_process_group()
    return {"checked": checked, "version": refit.version}
