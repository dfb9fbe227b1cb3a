"""Processes of the delta refit tests (tests/test_delta_refit.py): a JAX trainer on a
(2, 2) CPU mesh sends NamedSharding arrays to torch DTensors in two rollout processes,
``RefitConfig(delta=True)``, call after call; every receiver checks every byte it holds
after every call.

Tensor ``name`` at step ``k`` is a pattern of its name with, at each step ``j <= k``, a few
elements' lowest bit flipped (what an RL optimizer step does to the few BF16 weights it
changes); ``frozen`` never changes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from xreshard.tools.testing import local_arrays_from_global, numpy_dtype

#: name -> (shape, jax spec on mesh ("a", "b"), torch placements on a 1-d mesh, flags)
TENSORS = {
    "rows": ((64, 32), ("a",), ["S0"], ""),             # contiguous on both sides
    "cols": ((32, 48), (None, "b"), ["S1"], ""),         # strided destination: staging
    "kernel": ((32, 16), ("a", "b"), ["S0"], "T"),       # [in, out] JAX kernel
    "frozen": ((16, 16), (), ["R"], ""),
    "bias": ((48,), ("b",), ["R"], ""),
}
#: fraction of elements changed per step
STEP_FRACTION = 0.02


def value(name: str, shape: tuple[int, ...], dtype: str, step: int) -> np.ndarray:
    """Tensor ``name`` at ``step`` (see the module docstring)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    arr = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    arr = arr.astype(numpy_dtype(dtype))
    if name == "frozen":
        return arr
    bits = arr.reshape(-1).view(f"u{arr.dtype.itemsize}")
    for j in range(1, step + 1):
        rng = np.random.default_rng(seed + j)
        k = max(1, int(bits.size * STEP_FRACTION))
        bits[rng.choice(bits.size, k, replace=False)] ^= 1
    return arr


def _jax_params(dtype: str, step: int) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())
    params = {}
    for name, (shape, spec, _, flags) in TENSORS.items():
        arr = value(name, shape, dtype, step)
        if "T" in flags:
            arr = np.ascontiguousarray(arr.T)
            spec = tuple(reversed(spec + (None,) * (2 - len(spec))))
        params[name] = jax.device_put(arr, NamedSharding(mesh, P(*spec)))
    return params


def _torch_group(ctx: Any, members: int, rank: int, prefix: str) -> None:
    import torch.distributed as dist
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/", store),
                            rank=rank, world_size=members)


def _layout(name: str, dtype: str, n: int) -> Any:
    from xreshard.ir.layout import Layout, Mesh
    shape, _, placements, _ = TENSORS[name]
    return Layout.from_placements(shape, dtype, Mesh((n,)), placements)


def _dtensors(dtype: str, me: int, n: int) -> dict:
    """Zeroed DTensors of every tensor on a 1-d mesh of ``n`` processes."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from xreshard.adapters.torch import placements_of

    mesh = init_device_mesh("cpu", (n,))
    out = {}
    for name, (shape, _, _, _) in TENSORS.items():
        layout = _layout(name, dtype, n)
        local = torch.zeros(layout.local_shape(me), dtype=getattr(torch, dtype))
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        out[name] = DTensor.from_local(local, mesh, placements_of(layout),
                                       shape=torch.Size(shape), stride=stride, run_check=False)
    return out


def check(state: dict, src_dtype: str, dst_dtype: str, step: int, me: int, n: int) -> int:
    """Bit-compare every local shard with ``step``'s value; returns elements checked."""
    from xreshard.adapters.torch import tensor_view

    checked = 0
    for name, (shape, _, _, _) in TENSORS.items():
        want = value(name, shape, src_dtype, step).astype(numpy_dtype(dst_dtype))
        want = np.ascontiguousarray(local_arrays_from_global(_layout(name, dst_dtype, n), me,
                                                             want))
        got = tensor_view(state[name].to_local())
        if got.tobytes() != want.tobytes():
            raise AssertionError(f"step {step}: {name} on rollout rank {me} holds wrong bytes")
        checked += got.size
    return checked


def _config(xr: Any, cast: bool, **kw: Any) -> Any:
    kw = {"timeout": 60, "bucket_bytes": 4096, **kw}
    return xr.RefitConfig(delta=True, wire_dtype="bfloat16" if cast else None, **kw)


def attempt(fn: Any) -> Any:
    """``fn()``, or what it raised as ``"Type: message"`` (the tests compare every
    process's)."""
    try:
        return fn()
    except Exception as e:      # noqa: BLE001 - the test compares what every process raised
        return f"{type(e).__name__}: {e}"


def _row(report: Any) -> dict:
    if isinstance(report, str):
        return {"error": report}
    return {"version": report.version, "sent": report.bytes_sent,
            "received": report.bytes_received, "delta": dict(report.delta or {}),
            "verified": report.verified}


# ---------------------------------------------------------------------------- scenarios
# Each step of a scenario is one call of every process; the trainer sends value(step).
# "steady":  four calls; the first seeds, the next three are deltas (verify=True: the full
#            regions are checksummed on both ends after applying).
# "fences":  call 3: rollout[1] claims a base it does not hold (its pairs go dense);
#            call 4: rollout[0] writes its destination outside xreshard (refused on every
#            process before moving); call 5: rollout[0] dense, rollout[1] delta;
#            call 6: rollout[1] fails at its last apply (every process raises; every pair
#            dense next); call 7: dense everywhere, bit-exact; call 8: deltas again.


def trainer(ctx: Any, scenario: str, cast: bool = False) -> dict:
    import xreshard as xr

    src = "float32" if cast else "bfloat16"
    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, send=_jax_params(src, 0),
                     transpose={n for n, t in TENSORS.items() if "T" in t[3]},
                     config=_config(xr, cast, verify=scenario == "steady"))
    rows, step, baselines = [], 0, []
    for call in range(1, _calls(scenario) + 1):
        row = _row(attempt(lambda: refit(send=_jax_params(src, call))))
        if "error" not in row:
            step = call
        rows.append(row)
        baselines.append(_baselines(refit.delta_state))
    world.close()
    return {"rows": rows, "baseline_bytes": refit.delta_state.baseline_bytes, "step": step,
            "baselines": baselines}


def _baselines(state: Any) -> list:
    """What the senders' baselines hold after a call: per pair its claimed call and a
    digest of its bytes."""
    return [[f"{s}->{r}", b.call, hashlib.sha256(b"".join(
        bytes(np.asarray(b.buffers[t]).view(np.uint8)) for t in sorted(b.buffers))).hexdigest()]
            for (s, r), b in sorted(state.sent.items())]


def _calls(scenario: str) -> int:
    return {"steady": 4, "fences": 8}[scenario]


def rollout(ctx: Any, scenario: str, cast: bool = False) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    src, dst = ("float32", "bfloat16") if cast else ("bfloat16", "bfloat16")
    n = sum(r.group == "rollout" for r in ctx.roles)
    me = ctx.role.index
    _torch_group(ctx, n, me, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    state = _dtensors(dst, me, n)
    refit = xr.Refit(world, receive=state,
                     config=_config(xr, cast, verify=scenario == "steady"))
    rows, checked, held = [], 0, 0
    for call in range(1, _calls(scenario) + 1):
        _before(scenario, call, me, refit, state)
        row = _row(attempt(refit))
        _after(scenario, call, me)
        if "error" not in row:
            held = call
        # written by the test itself; a call that failed while moving leaves a mix
        written = scenario == "fences" and ((call == 4 and me == 0) or call == 6)
        try:
            checked += check(state, src, dst, held, me, n) if held and not written else 0
        except AssertionError as e:
            row["wrong"] = str(e)
        rows.append(row)
    world.close()
    dist.destroy_process_group()
    return {"rows": rows, "checked": checked}


def _before(scenario: str, call: int, me: int, refit: Any, state: dict) -> None:
    if scenario != "fences":
        return
    if call == 3 and me == 1:           # a base it does not hold
        refit.delta_state.base = {r: ("not-a-call", d) for r, (_, d)
                                  in refit.delta_state.base.items()}
    if call == 4 and me == 0:           # written outside xreshard
        import torch
        with torch.no_grad():
            state["rows"].to_local().add_(1)
    if call == 6 and me == 1:
        _fail_last_apply()


def _after(scenario: str, call: int, me: int) -> None:
    if scenario == "fences" and call == 6 and me == 1:
        from xreshard.runtime.codecs.delta import DeltaCodec
        DeltaCodec._land = _LAND[0]


_LAND: list = []


def _fail_last_apply() -> None:
    """This process's delta executor raises at its last landing bucket of the call (after
    every group of the call: the others finish, then learn it at the outcome)."""
    from xreshard.errors import RefitError
    from xreshard.runtime.codecs.delta import DeltaCodec

    land = DeltaCodec._land
    _LAND[:] = [land]

    def failing(self, b, buf, how):
        land(self, b, buf, how)
        last = self.ex.schedule.rounds[-1]
        if b is [x for x in last if x.dst in self.ex._local_dst][-1]:
            raise RefitError(f"injected failure after bucket {b.tag} (pid {os.getpid()})")

    DeltaCodec._land = failing


# ---------------------------------------------------------------------------- restarts
# world 1 (trainer, rollout[0], rollout[1]): calls 1 (seeds) and 2 (deltas); then rollout[1]
# exits. World 2 (spare[0] restarts it as rollout 1): the trainer and rollout[0] hand their
# delta_state over; call 3 sends rollout[0] deltas, the restarted one dense; call 4 deltas;
# call 5: the restarted one is killed while applying its first delta. World 3 (spare[1]
# restarts it again): call 6 goes dense everywhere (call 5 failed), call 7 deltas again.

RESTART_WORLDS = {1: (1, 2), 2: (3, 4, 5), 3: (6, 7)}


def restart_trainer(ctx: Any) -> dict:
    import xreshard as xr

    rows, handed = [], None
    for w, calls in RESTART_WORLDS.items():
        world = ctx.join(groups=["trainer", "rollout"], num_processes=3, index=0,
                         world_id=f"{ctx.world_id}-{w}", timeout=120)
        refit = xr.Refit(world, send=_jax_params("bfloat16", calls[0]),
                         transpose={n for n, t in TENSORS.items() if "T" in t[3]},
                         config=_config(xr, False, timeout=40))
        if handed is not None:
            refit.delta_state = handed
        for call in calls:
            rows.append(_row(attempt(lambda: refit(send=_jax_params("bfloat16", call)))))
        handed = refit.delta_state
        world.close()
    return {"rows": rows}


def restart_rollout(ctx: Any) -> dict:
    """rollout[0] lives through all three worlds; rollout[1] is rollout 1 of world 1,
    spare[0] of world 2 (killed in call 5), spare[1] of world 3."""
    import torch.distributed as dist
    import xreshard as xr
    from xreshard.runtime.world import World

    if ctx.role.group == "rollout":
        worlds = list(RESTART_WORLDS) if ctx.role.index == 0 else [1]
    else:
        worlds = [2 + ctx.role.index]
    me = 0 if ctx.role.group == "rollout" and ctx.role.index == 0 else 1
    rows, checked, handed, local = [], 0, None, None
    for w in worlds:
        _torch_group(ctx, 2, me, f"rollout{w}")
        world = World.join(ctx.address, "rollout", ctx.devices(), num_processes=3, index=me,
                           groups=["trainer", "rollout"], world_id=f"{ctx.world_id}-{w}",
                           timeout=120)
        state = _redistributed(local, me)
        local = {k: v.to_local() for k, v in state.items()}
        refit = xr.Refit(world, receive=state, config=_config(xr, False, timeout=40))
        if handed is not None:
            refit.delta_state = handed
        for call in RESTART_WORLDS[w]:
            if call == 5 and me == 1:
                _die_at_first_apply()
            row = _row(attempt(refit))
            if "error" not in row:
                checked += check(state, "bfloat16", "bfloat16", call, me, 2)
            rows.append(row)
        handed = refit.delta_state
        if w == 1 and me == 1:
            os._exit(3)                 # dies between calls: spare[0] restarts it
        world.close()
        dist.destroy_process_group()
    return {"rows": rows, "checked": checked}


def _redistributed(local: dict | None, me: int) -> dict:
    """This torch group's DTensors: zeros (a fresh process), or the same local tensors as
    before (the same memory, on the new group's mesh)."""
    if local is None:
        return _dtensors("bfloat16", me, 2)
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from xreshard.adapters.torch import placements_of

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, (shape, _, _, _) in TENSORS.items():
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        out[name] = DTensor.from_local(local[name], mesh,
                                       placements_of(_layout(name, "bfloat16", 2)),
                                       shape=torch.Size(shape), stride=stride, run_check=False)
    return out


def _die_at_first_apply() -> None:
    from xreshard.runtime.codecs.delta import DeltaCodec

    land = DeltaCodec._land

    def dying(self, b, buf, how):
        if how == "apply":
            os._exit(3)
        return land(self, b, buf, how)

    DeltaCodec._land = dying
