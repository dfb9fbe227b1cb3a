"""A multi-process shm refit into row-parallel torch destinations: the bytes land in the
destination's rows (``ShmTransport.takes_views``), bit-exact, with the exclusions (delta)
still staged and a sender that dies mid-pull reported on every live rank, bounded."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from xreshard.tools.launch import Context, Role, launch
from xreshard.transport.shm import shm_names

from . import refit_cases as cases

pytest.importorskip("torch")
pytest.importorskip("jax")

#: a row-parallel weight (torch ``Shard(1)`` over 2 receivers) whose JAX source is split in
#: 4 along its rows' length: each receiver gets two messages, each the left or right half
#: of its shard's 2,304 rows (more rows than the 1,024 iovecs of one ``process_vm_readv``);
#: and small tensors, packed into shared messages (staged, as before)
ROWS = {
    "down": ((2304, 512), (None, ("a", "b")), ["S1"], ""),
    "up": ((96, 64), (None, ("a", "b")), ["S1"], ""),
    "norm": ((64,), (), ["R"], ""),
}
#: bytes each receiver gets into strided rows per refit: its shard of "down"
DOWN_BYTES = 2304 * 256 * 2
#: "down" is one message per (source device, receiver): 576 KiB, one bucket
CONFIG = {"timeout": 60, "bucket_bytes": 1 << 20, "staging_bytes": 1 << 24}


def _config(mode: str) -> Any:
    import xreshard as xr
    extra = {"plain": {}, "segments": {}, "delta": {"delta": True}, "atomic": {"atomic": True},
             "checked": {"verify": True, "check_writes": True}}[mode]
    return xr.RefitConfig(**CONFIG, **extra)


def _join(ctx: Context, mode: str) -> Any:
    """This process's world; "segments": no cross-process reads (the sender copies into
    its pair segment, the receiver copies out of it into the rows)."""
    import xreshard as xr
    return ctx.join(groups=["trainer", "rollout"], tuning=xr.Tuning(shm_pull=mode != "segments"))


def rows_sender(ctx: Context, steps: int, mode: str) -> dict:
    import xreshard as xr
    world = _join(ctx, mode)
    prefix = world.transport("auto").parts["shm"].prefix      # a collective: all, first
    refit = xr.Refit(world, config=_config(mode))
    for step in range(steps):
        refit(send=cases._jax_params(ROWS, "bfloat16", step))
    world.close()
    return {"prefix": prefix}


def rows_receiver(ctx: Context, steps: int, mode: str) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    members = sum(r.group == "rollout" for r in ctx.roles)
    cases._torch_group(ctx, members, ctx.role.index, "rollout")
    world = _join(ctx, mode)
    shm = world.transport("auto").parts["shm"]
    state = cases._dtensors(ROWS, "bfloat16", members, None)
    refit = xr.Refit(world, receive=state, config=_config(mode))
    into_rows, staging, verified, pulled = [], [], [], shm.bytes_pulled
    for step in range(steps):
        before = getattr(shm, "bytes_into_rows", None)
        report = refit()
        cases._check_dtensors(state, ROWS, "bfloat16", step, "bfloat16")
        after = getattr(shm, "bytes_into_rows", None)
        into_rows.append(None if before is None else after - before)
        staging.append(report.staging_bytes)
        verified.append(report.verified)
    world.close()
    dist.destroy_process_group()
    return {"version": refit.version, "into_rows": into_rows, "staging": staging,
            "verified": verified, "pulled": shm.bytes_pulled - pulled}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "segments", "checked", "atomic", "delta"])
def test_row_parallel_destination_lands_in_its_rows_bit_exact(mode):
    """plain, verify + check_writes (which check the destinations and the sources, not
    the staging) and atomic (whose destinations are its own copies, committed after the
    outcome): every refit puts each receiver's 1.1 MiB of "down" straight into its rows,
    bit-exact (the old executor staged them and unpacked); pulled, or with no
    cross-process reads ("segments") copied out of the sender's segment into the rows.
    delta: its messages are framed by its codec, so they keep staging, and stay exact."""
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(2)]
    steps = 3
    results = launch([rows_sender, rows_receiver, rows_receiver], roles, args=(steps, mode),
                     timeout=240)
    for r in results[1:]:
        v = r.value
        assert v["version"] == steps
        if mode == "delta":
            assert v["into_rows"] == [0] * steps, v
            assert all(s >= DOWN_BYTES for s in v["staging"][:1]), v
        else:
            assert v["into_rows"] == [DOWN_BYTES] * steps, v
            assert all(s < DOWN_BYTES for s in v["staging"]), v   # only the small ones
        if mode == "checked":
            assert all(n > 0 for n in v["verified"]), v
        assert (v["pulled"] == 0) == (mode == "segments"), v
    assert shm_names(results[0].value["prefix"]) == []


def rows_sender_killed(ctx: Context, timeout: float) -> dict:
    """A receiver that is about to pull into rows kills the trainer (SIGKILL) first: its
    pull finds the sender gone mid-round; every live rank must raise, within the timeout."""
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(timeout=timeout, bucket_bytes=1 << 20, staging_bytes=1 << 24)
    shm = world.transport("auto").parts["shm"]
    if ctx.role.group == "trainer":
        refit = xr.Refit(world, send=cases._jax_params(ROWS, "bfloat16", 0), config=config)
    else:
        import torch.distributed as dist
        import xreshard.transport.shm as shm_mod
        cases._torch_group(ctx, 2, ctx.role.index, "rollout")
        refit = xr.Refit(world, receive=cases._dtensors(ROWS, "bfloat16",
                                                        dist.get_world_size(), None),
                         config=config)
        if ctx.role.index == 0:
            real = shm_mod.pull_rows

            def kill_then_pull(pid: int, *args: Any) -> None:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and _running(pid):
                    time.sleep(0.01)
                real(pid, *args)
            shm_mod.pull_rows = kill_then_pull
    t0 = time.monotonic()
    error = cases._attempt(refit)
    return {"error": error, "seconds": time.monotonic() - t0, "version": refit.version,
            "prefix": shm.prefix, "into_rows": shm.bytes_into_rows}


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_sender_killed_mid_pull_into_rows_is_reported_everywhere_bounded():
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(2)]
    timeout = 5.0
    results = launch(rows_sender_killed, roles, args=(timeout,), timeout=120, check=False,
                     fail_fast=False)
    assert results[0].returncode == -signal.SIGKILL
    for live in results[1:]:
        assert live.ok, live.describe()
        v = live.value
        assert v["error"] != "no error" and v["version"] == 0, v
        assert v["seconds"] < 3 * timeout + 5, v
    puller = results[1].value
    # the receiver's pull into rows found the sender gone and said so; every rank got it
    assert "trainer[0]" in puller["error"] and "did the sender die?" in puller["error"], puller
    assert results[2].value["error"] == puller["error"]
    assert puller["into_rows"] == 0
    assert shm_names(puller["prefix"]) == []
