"""Processes that end without ``world.close()``: a JAX trainer and two torch processes
(torchrun, a gloo process group, DTensors: the README's Use example) refit across
processes, then end (returning, raising, calling ``sys.exit``, or with a refit error every
rank raises) with their worlds open. Each exits
with its own status and, where it raised, a Python traceback; none aborts (-6,
"terminate called without an active exception": the store and gloo clients torn down by
C++ destructors under their threads; 1 of 3 such exits on 2 loaded cores before worlds
were closed at interpreter exit). Real processes, started as a user's launcher would."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("jax") is None:
    pytest.skip("needs jax and torch", allow_module_level=True)

pytestmark = pytest.mark.slow       # real processes, several rounds

ROOT = pathlib.Path(__file__).resolve().parent.parent

TRAINER = """
import os, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import xreshard as xr

mode = sys.argv[1]
mesh = jax.make_mesh((2, 2), ("fsdp", "tp"))
params = {"w": jax.device_put(jnp.arange(64 * 256.0).reshape(64, 256),
                              NamedSharding(mesh, P("fsdp", "tp")))}
world = xr.World.join(os.environ["XRESHARD_ADDRESS"], "trainer", jax.local_devices(),
                      num_processes=3, index=0, timeout=120)
refit = xr.Refit(world, send=params)
refit(send=params)                  # a refit error propagates from here in "refit_error"
if mode == "raise":
    raise RuntimeError("the trainer's own error")
if mode == "exit3":
    sys.exit(3)
"""

ROLLOUT = """
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, zeros
import xreshard as xr

mode = sys.argv[1]
dist.init_process_group("gloo")                 # started by torchrun, as the README's
mesh = init_device_mesh("cpu", (2,))
rows = 63 if mode == "refit_error" else 64      # a shape the trainer does not send
state = {"w": zeros(rows, 256, device_mesh=mesh, placements=[Shard(0)])}
world = xr.World.join(os.environ["XRESHARD_ADDRESS"], "rollout", 1, num_processes=3,
                      timeout=120)
refit = xr.Refit(world, receive=state)
refit()
assert torch.equal(state["w"].full_tensor(), torch.arange(64 * 256.0).reshape(64, 256))
dist.destroy_process_group()
"""

# mode -> (the trainer's status, the rollouts' status, what the trainer's stderr shows)
EXPECTED = {"return": (0, 0, None), "raise": (1, 0, "RuntimeError: the trainer's own error"),
            "exit3": (3, 0, None), "refit_error": (1, 1, "Traceback")}


def _round(mode: str, folder: pathlib.Path) -> list[tuple[int, str]]:
    import xreshard as xr

    (folder / "trainer.py").write_text(TRAINER)
    (folder / "rollout.py").write_text(ROLLOUT)
    with xr.serve() as store:
        env = {**os.environ, "XRESHARD_ADDRESS": store.address, "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        env.pop("JAX_NUM_CPU_DEVICES", None)
        jobs = [subprocess.Popen([sys.executable, "trainer.py", mode], cwd=folder, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
        jobs += [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node=2", "rollout.py", mode], cwd=folder,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)]
        try:
            errs = [job.communicate(timeout=300)[1] for job in jobs]
            return [(job.returncode, err) for job, err in zip(jobs, errs)]
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()


def test_processes_that_leave_their_worlds_open_exit_with_their_own_status(tmp_path):
    results = []
    for mode in ["return", "raise", "exit3", "refit_error"] * 2:
        (trainer, terr), *rollouts = _round(mode, tmp_path)
        results.append((mode, trainer, [code for code, _ in rollouts]))
        want_trainer, want_rollout, shows = EXPECTED[mode]
        for sign in ("terminate called", "SIGABRT", "exitcode: -6"):
            assert sign not in terr and all(sign not in e for _, e in rollouts), (results, sign)
        assert trainer == want_trainer, (results, terr[-3000:])
        assert [code for code, _ in rollouts] == [want_rollout], (
            results, [e[-3000:] for _, e in rollouts])
        if shows is not None:
            assert "Traceback" in terr and shows in terr, terr[-3000:]
        if mode == "refit_error":       # the same typed error, with its traceback, everywhere
            mismatch = "shape mismatch in 1 tensor(s): 'w' source (64, 256) vs destination"
            assert all(mismatch in e and "Traceback" in e for _, e in rollouts + [(0, terr)])
