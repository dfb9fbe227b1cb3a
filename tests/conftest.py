"""Shared pytest setup.

JAX reads its platform and CPU device count once, when its backend starts, so they must
be set before any test imports jax: tests see 8 CPU devices (docs/layouts.md §2.3).
Environment variables, not ``jax.config.update``, so nothing imports jax here; an
explicit setting in the caller's environment wins.
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

# Property tests draw the same examples on every run, so CI is reproducible and a red run
# is a bug to fix, not a roll of the dice. XRESHARD_HYPOTHESIS=explore draws fresh random
# examples on every run to hunt for new bugs; pin what it finds with a regression test.
try:
    from hypothesis import settings as _settings
except ImportError:  # pragma: no cover - hypothesis comes with the dev extra
    pass
else:
    _settings.register_profile("ci", derandomize=True, database=None)
    _settings.register_profile("explore", derandomize=False)
    _settings.load_profile("explore" if os.environ.get("XRESHARD_HYPOTHESIS") == "explore"
                           else "ci")


@pytest.fixture
def gloo1(tmp_path):
    """A one-process gloo default group and a 1-rank CPU DeviceMesh."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():  # pragma: no cover - someone else owns the default group
        pytest.skip("a default process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.arange(1))
    finally:
        dist.destroy_process_group()
