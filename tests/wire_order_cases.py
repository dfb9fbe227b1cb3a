"""Functions ``test_wire_order.py`` launches: a JAX trainer holding ``[in, out]`` kernels
(real ``NamedSharding`` s on 4 CPU devices) refits two torch processes' DTensors, one
world per case (``series``), every destination byte compared on its receiver."""

from __future__ import annotations

from typing import Any

from .refit_cases import _check_dtensors, _dtensors, _jax_params, _torch_group

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
    import dataclasses
    import traceback

    out: dict = {}
    for name, trainer_fn, rollout_fn, args in programs:
        fn = globals()[trainer_fn if ctx.role.group == "trainer" else rollout_fn]
        try:
            out[name] = {"value": fn(dataclasses.replace(ctx, world_id=name), *args)}
        except Exception:   # noqa: BLE001 - the test reports it under the case's name
            out[name] = {"error": traceback.format_exc()}
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return out


def jax_sender(ctx: Any, config: dict, wire: str | None, dst_dtype: str) -> dict:
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, send=_jax_params(TENSORS, "float32", 0), transpose=set(KERNELS),
                     config=xr.RefitConfig(wire_dtype=wire, timeout=60, **config))
    for step in range(STEPS):
        refit(send=_jax_params(TENSORS, "float32", step))
    transposed = sorted(n for n, _ in refit._prepared.formats.transposed)
    world.close()
    return {"transposed": transposed}


def torch_receiver(ctx: Any, config: dict, wire: str | None, dst_dtype: str) -> dict:
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
