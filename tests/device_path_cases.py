"""Processes of tests/test_device_path.py: the delta and FP8 refits of
tests/delta_cases.py and tests/test_fp8_refit_procs.py run through the device path on host
bindings (``XRESHARD_TEST_DEVICE_OPS``: the same code a GPU runs, the arrays numpy and the
ops on the framework's CPU device), each child reporting what it ran on "device memory"
(``xreshard.runtime.device_ops.COUNTS``)."""

from __future__ import annotations

from typing import Any

from . import delta_cases, test_fp8_refit_procs as fp8_cases

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
