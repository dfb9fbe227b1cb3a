"""Processes of tests/test_device_path.py: the delta and FP8 refits of
tests/delta_cases.py and tests/test_fp8_refit_procs.py run through the device path on host
bindings (``XRESHARD_TEST_DEVICE_OPS``: the same code a GPU runs, the arrays numpy and the
ops on the framework's CPU device), each child reporting what it ran on "device memory"
(``xreshard.runtime.device_ops.COUNTS``)."""

from __future__ import annotations

from typing import Any

from . import delta_cases, delta_compose_cases as compose, test_fp8_refit_procs as fp8_cases

#: refit timeout of these children: JAX compiles its kernels per shape on first use, which
#: a loaded 2-core machine can stretch past delta_cases' 60 s
TIMEOUT = 240.0


def _counts() -> dict[str, int]:
    from xreshard.runtime.device_ops import COUNTS
    return dict(COUNTS)


def _patient_config() -> None:
    base = delta_cases._config
    delta_cases._config = lambda xr, cast, **kw: base(xr, cast, **{"timeout": TIMEOUT, **kw})


def delta_trainer(ctx: Any, scenario: str, cast: bool = False) -> dict:
    _patient_config()
    return {**delta_cases.trainer(ctx, scenario, cast), "counts": _counts()}


def delta_rollout(ctx: Any, scenario: str, cast: bool = False) -> dict:
    _patient_config()
    return {**delta_cases.rollout(ctx, scenario, cast), "counts": _counts()}


def fp8_trainer(ctx: Any, bad: str | None) -> dict:
    return {**fp8_cases.trainer(ctx, bad), "counts": _counts()}


def fp8_rollout(ctx: Any, bad: str | None) -> dict:
    return {**fp8_cases.rollout(ctx, bad), "counts": _counts()}


# ---------------------------------------------------------------------------- delta + FP8
# tests/delta_compose_cases.py's FP8 destinations (a JAX trainer's bf16 values, torch
# receivers storing block FP8 / MXFP8; ``w`` and ``mx`` have blocks split across the
# trainer's devices) as deltas through the device path: A (seeds, dense), B (1% of the
# elements changed), B (nothing: headers only), A (1%), C (every element changed), D and
# C (1% again). After every call
# each receiver holds the host quantizer's codes and scales of the whole new tensors.
# ``atomic``: RefitConfig(atomic=True) too (deltas land in the receivers' staging).

FP8_DELTA_STEPS = ("A", "B", "B", "A", "C", "D", "C")
FP8_DELTA_FULL = 4      # the call (0-based) that changed every element


def fp8_delta_trainer(ctx: Any, atomic: bool) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(step: str) -> dict:
        return {name: jax.device_put(a, NamedSharding(mesh, P(*compose.FP8_TENSORS[name][2])))
                for name, a in compose.fp8_values(step).items()}

    refit = xr.Refit(world, send=params("A"), config=_fp8_delta_config(xr, atomic))
    rows = []
    for step in FP8_DELTA_STEPS:
        report = delta_cases.attempt(lambda: refit(send=params(step)))
        row = delta_cases._row(report)
        if not isinstance(report, str):
            row["quantized"] = dict(report.quantized or {})
        rows.append(row)
    world.close()
    return {"rows": rows, "counts": _counts()}


def _fp8_delta_config(xr: Any, atomic: bool) -> Any:
    return xr.RefitConfig(timeout=TIMEOUT, bucket_bytes=1 << 15, delta=True, verify=True,
                          atomic=atomic)


def fp8_delta_rollout(ctx: Any, atomic: bool) -> dict:
    import hashlib
    import torch
    import torch.distributed as dist
    import xreshard as xr

    n, me = 2, ctx.role.index
    delta_cases._torch_group(ctx, n, me, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    state, local = compose._fp8_state(me, n)
    refit = xr.Refit(world, receive=state, config=_fp8_delta_config(xr, atomic))
    rows, checked = [], 0
    for step in FP8_DELTA_STEPS:
        row = delta_cases._row(delta_cases.attempt(refit))
        want = compose._fp8_wanted(step, me, n)
        held = {}
        for name, tensors in local.items():
            got = [t.view(torch.uint8).numpy().tobytes() for t in tensors]
            held[name] = [hashlib.sha256(g).hexdigest() for g in got]
            for i, g in enumerate(got):
                if g != want[name][i]:
                    row.setdefault("wrong", []).append(f"{name}[{i}]")
                checked += len(g)
        row["held"] = held
        rows.append(row)
    staging = refit._staging.nbytes if refit._staging is not None else 0
    world.close()
    dist.destroy_process_group()
    return {"rows": rows, "checked": checked, "counts": _counts(), "staging_bytes": staging}
