"""Processes of tests/test_delta_compose.py: ``RefitConfig(delta=True)`` composed with
``atomic=True`` (transactional destinations) and with FP8 destinations quantized on the
way. A JAX trainer (NamedSharding on a (2, 2) CPU mesh) sends to torch DTensors in two
rollout processes; every receiver checks every byte it holds after every call, inside
the process (the tensors and their steps: tests/delta_cases.py).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

from . import delta_cases as dc


def _config(xr: Any, **kw: Any) -> Any:
    return xr.RefitConfig(**{"timeout": 60, "bucket_bytes": 4096, "delta": True,
                             "atomic": True, **kw})


def _transposed() -> set[str]:
    return {n for n, t in dc.TENSORS.items() if "T" in t[3]}


# ---------------------------------------------------------------------------- a killed sender
# World 1 (trainer, rollout[0], rollout[1]): calls 1 (seeds) and 2 (deltas); call 3: the
# trainer SIGKILLs itself after its first payload (some deltas landed in the receivers'
# staging). The survivors raise; their destinations hold step 2 bit for bit. World 2
# (spare[0] restarts the trainer, with no baselines): the receivers hand their delta_state
# over; call 3 again goes dense (the sender has no baseline), call 4 as deltas.

KILL_WORLDS = {1: (1, 2, 3), 2: (3, 4)}
KILLED_CALL = 3


def _die_after_first_payload() -> None:
    from xreshard.runtime.codecs.delta import DeltaCodec

    send = DeltaCodec._send_payload

    def dying(self, b, enc, *args):
        out = send(self, b, enc, *args)
        if enc is not None and enc.message is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    DeltaCodec._send_payload = dying


def kill_trainer(ctx: Any) -> dict:
    import xreshard as xr
    from xreshard.runtime.world import World

    w = 1 if ctx.role.group == "trainer" else 2       # spare[0]: the restarted trainer
    world = World.join(ctx.address, "trainer", ctx.devices(), num_processes=3, index=0,
                       groups=["trainer", "rollout"], world_id=f"{ctx.world_id}-{w}",
                       timeout=120)
    calls = KILL_WORLDS[w]
    refit = xr.Refit(world, send=dc._jax_params("bfloat16", calls[0]),
                     transpose=_transposed(), config=_config(xr, timeout=40))
    rows = []
    for call in calls:
        if w == 1 and call == KILLED_CALL:
            _die_after_first_payload()
        rows.append(dc._row(dc.attempt(lambda: refit(send=dc._jax_params("bfloat16", call)))))
    world.close()
    return {"rows": rows}


def kill_rollout(ctx: Any) -> dict:
    import torch.distributed as dist
    import xreshard as xr
    from xreshard.runtime.world import World

    me = ctx.role.index
    rows, checked, handed, local, held = [], 0, None, None, 0
    for w, calls in KILL_WORLDS.items():
        dc._torch_group(ctx, 2, me, f"rollout{w}")
        world = World.join(ctx.address, "rollout", ctx.devices(), num_processes=3, index=me,
                           groups=["trainer", "rollout"], world_id=f"{ctx.world_id}-{w}",
                           timeout=120)
        state = dc._redistributed(local, me)
        local = {k: v.to_local() for k, v in state.items()}
        refit = xr.Refit(world, receive=state, config=_config(xr, timeout=40))
        if handed is not None:
            refit.delta_state = handed
        for call in calls:
            row = dc._row(dc.attempt(refit))
            if "error" not in row:
                held = call
            row.update(version=refit.version, stale=refit.stale)
            try:
                checked += dc.check(state, "bfloat16", "bfloat16", held, me, 2)
            except AssertionError as e:
                row["wrong"] = str(e)
            rows.append(row)
        handed = refit.delta_state
        world.close()
        dist.destroy_process_group()
    return {"rows": rows, "checked": checked}


# ---------------------------------------------------------------------------- FP8
# "fp8": a JAX trainer sends bf16 values; the torch receivers store block-FP8 / MXFP8
# codes + scales (quantized on the way). Calls 1 (A: seeds, dense FP8), 2 (B: A with a
# few elements changed), 3 (A again), 4 (B; rollout[1] claims a base it does not hold:
# dense to it). After every call each receiver's codes and scales equal the quantizer's
# on the whole new tensor, byte for byte.

#: name -> (shape, format, the trainer's PartitionSpec over mesh ("a", "b"))
FP8_TENSORS = {
    "w": ((512, 300), "block", ("a", "b")),             # columns cut at 150: split blocks
    "o": ((1024, 512), "block", (("a", "b"), None)),    # rows on the grid: all FP8
    "mx": ((256, 320), "mx", (None, ("a", "b"))),       # groups of 32 cut at 80
    "e": ((4, 256, 256), "block", (None, "a", "b")),    # experts
    "n": ((256, 64), None, ("a",)),                     # not quantized (bf16)
}
FP8_STEPS = ("A", "B", "A", "B")
FP8_CHANGED = 0.01


def fp8_values(step: str, tensors: dict | None = None) -> dict[str, np.ndarray]:
    """``A``: random bf16 tensors of ``tensors`` (default :data:`FP8_TENSORS`; row
    magnitudes spread over 2^-6..2^6); ``B``: ``A`` with the lowest bit of 1% of each
    tensor's elements flipped. ``C`` and ``D``: the same of other random tensors (every
    element, code and scale changed from ``A`` or ``B``)."""
    import ml_dtypes
    out = {}
    for i, (name, (shape, _, _)) in enumerate(sorted((tensors or FP8_TENSORS).items())):
        rng = np.random.default_rng((200 if step in "CD" else 100) + i)
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        x *= np.exp2(rng.integers(-6, 7, shape[:-1] + (1,))).astype(np.float32)
        a = x.astype(ml_dtypes.bfloat16)
        if step in "BD":
            bits = a.reshape(-1).view(np.uint16)
            bits[rng.choice(bits.size, int(bits.size * FP8_CHANGED), replace=False)] ^= 1
        out[name] = a
    return out


def fp8_trainer(ctx: Any) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(step: str) -> dict:
        return {name: jax.device_put(a, NamedSharding(mesh, P(*FP8_TENSORS[name][2])))
                for name, a in fp8_values(step).items()}

    refit = xr.Refit(world, send=params("A"), config=_fp8_config(xr))
    rows = []
    for step in FP8_STEPS:
        report = dc.attempt(lambda: refit(send=params(step)))
        row = dc._row(report)
        if not isinstance(report, str):
            row["quantized"] = dict(report.quantized or {})
        row["ahead"] = dict(refit.quant_ahead.last)     # FP8 items quantized ahead
        rows.append(row)
    world.close()
    return {"rows": rows}


def _fp8_config(xr: Any) -> Any:
    return xr.RefitConfig(timeout=60, bucket_bytes=1 << 15, delta=True, verify=True)


def _fp8_state(me: int, n: int, tensors: dict | None = None, replicated: bool = False
               ) -> tuple[dict, dict]:
    """Each tensor of ``tensors`` (default :data:`FP8_TENSORS`)'s destination on a 1-d mesh
    of ``n`` rollout processes, rows sharded (or ``replicated``): ``Quantized`` codes +
    scales (0x55 bytes before the first call), or a bf16 DTensor; and the local torch
    tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8, MXFP8

    mesh = init_device_mesh("cpu", (n,))
    state, local = {}, {}
    for name, (shape, kind, _) in (tensors or FP8_TENSORS).items():
        dim = len(shape) - 2
        fmt = None if kind is None else BlockFP8() if kind == "block" else MXFP8()
        pieces = []
        wanted = [(shape, torch.bfloat16)] if fmt is None else [
            (shape, torch.float8_e4m3fn),
            (fmt.scale_shape(shape), getattr(torch, fmt.scale_dtype))]
        for full, dtype in wanted:
            local_shape = list(full)
            local_shape[dim] //= 1 if replicated else n
            nbytes = int(np.prod(local_shape)) * torch.empty(0, dtype=dtype).element_size()
            t = torch.full((nbytes,), 0x55, dtype=torch.uint8).view(dtype).view(local_shape)
            pieces.append(DTensor.from_local(t, mesh, [Replicate() if replicated else Shard(dim)],
                                             shape=torch.Size(full),
                                             stride=torch.empty(full).stride(),
                                             run_check=False))
            local.setdefault(name, []).append(t)
        state[name] = pieces[0] if fmt is None else Quantized(*pieces, fmt)
    return state, local


def _fp8_wanted(step: str, me: int, n: int) -> dict[str, list[bytes]]:
    """What rollout ``me`` must hold after a call of ``step``: its rows of the quantizer's
    codes and scales of each whole tensor (xreshard.quant.host: vLLM's bytes, see
    tests/test_quant.py), or of the bf16 values."""
    from xreshard.ir.formats import BlockFP8, MXFP8
    from xreshard.quant import host

    out = {}
    for name, a in fp8_values(step).items():
        shape, kind, _ = FP8_TENSORS[name]
        dim = len(shape) - 2
        arrays = [a] if kind is None else list(       # codes, scales: the state's order
            host.quantize_block_fp8(a, BlockFP8(), name=name) if kind == "block"
            else host.quantize_mxfp8(a, MXFP8(), name=name))
        got = []
        for arr in arrays:
            rows = arr.shape[dim] // n
            sl = (slice(None),) * dim + (slice(me * rows, (me + 1) * rows),)
            got.append(np.ascontiguousarray(arr[sl]).tobytes())
        out[name] = got
    return out


def fp8_rollout(ctx: Any) -> dict:
    import torch
    import torch.distributed as dist
    import xreshard as xr

    n, me = 2, ctx.role.index
    dc._torch_group(ctx, n, me, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    state, local = _fp8_state(me, n)
    refit = xr.Refit(world, receive=state, config=_fp8_config(xr))
    rows, checked = [], 0
    for call, step in enumerate(FP8_STEPS, 1):
        if call == 4 and me == 1:           # a base it does not hold
            refit.delta_state.base = {r: ("not-a-call", d) for r, (_, d)
                                      in refit.delta_state.base.items()}
        row = dc._row(dc.attempt(refit))
        want = _fp8_wanted(step, me, n)
        for name, tensors in local.items():
            for i, t in enumerate(tensors):
                if t.view(torch.uint8).numpy().tobytes() != want[name][i]:
                    row.setdefault("wrong", []).append(f"{name}[{i}]")
                checked += t.numel()
        rows.append(row)
    world.close()
    dist.destroy_process_group()
    return {"rows": rows, "checked": checked}


# ---------------------------------------------------------------------------- relay
# "relay": delta through a relay with atomic=True and FP8 destinations at once. The two
# rollouts (host "a") hold every tensor whole (replicas); the trainer (host "t") sends each
# relayed tensor to the host once, half to each rollout, and they forward the halves to
# each other (their finished FP8 codes and scales, or bf16). ``w`` has blocks split across
# trainer devices: not relayed (each rollout receives it directly, its split pieces raw).
# Calls: 1 A (seeds: dense), 2 B (deltas, forwards included), 3 A: rollout[1] fails after
# its last landing (every process raises; atomic: nothing written, no baseline moved),
# 4 A (deltas again everywhere: the bases stayed valid), 5 B: rollout[1] claims a base it
# does not hold (the pairs into it go dense, the trainer's and its forwarder's; its own
# forwards stay deltas). verify=True throughout. Each rollout returns the sha256 of every
# local tensor after every call; the test compares them with vLLM's quantizer.

RELAY_TENSORS = {
    "o": ((512, 256), "block", (("a", "b"), None)),     # a block row per device: relayed
    "mx": ((128, 256), "mx", (("a", "b"), None)),       # relayed
    "w": ((256, 300), "block", ("a", "b")),             # columns cut at 150: split blocks
    "n": ((256, 64), None, ("a",)),                     # bf16, relayed
}
RELAY_STEPS = ("A", "B", "A", "A", "B")
RELAY_FAILS, RELAY_WRONG_BASE = 3, 5


def _relay_config(xr: Any) -> Any:
    return xr.RefitConfig(timeout=60, bucket_bytes=1 << 14, delta=True, relay="on",
                          atomic=True, verify=True)


def relay_trainer(ctx: Any) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(step: str) -> dict:
        return {name: jax.device_put(a, NamedSharding(mesh, P(*RELAY_TENSORS[name][2])))
                for name, a in fp8_values(step, RELAY_TENSORS).items()}

    rows = []
    with ctx.join(groups=["trainer", "rollout"], timeout=120, host="t") as world:
        refit = xr.Refit(world, send=params("A"), config=_relay_config(xr))
        for step in RELAY_STEPS:
            rows.append(dc._row(dc.attempt(lambda: refit(send=params(step)))))
        baseline = refit.delta_state.baseline_bytes
    return {"rows": rows, "baseline_bytes": baseline}


def relay_rollout(ctx: Any) -> dict:
    import hashlib
    import torch
    import torch.distributed as dist
    import xreshard as xr

    n, me = 2, ctx.role.index
    dc._torch_group(ctx, n, me, "rollout")
    state, local = _fp8_state(me, n, RELAY_TENSORS, replicated=True)
    rows = []
    with ctx.join(groups=["trainer", "rollout"], timeout=120, host="a") as world:
        refit = xr.Refit(world, receive=state, config=_relay_config(xr))
        for call, _ in enumerate(RELAY_STEPS, 1):
            if call == RELAY_FAILS and me == 1:
                dc._fail_last_apply()
            if call == RELAY_WRONG_BASE and me == 1:       # a base it does not hold
                refit.delta_state.base = {r: ("not-a-call", d) for r, (_, d)
                                          in refit.delta_state.base.items()}
            with xr.count_comm() as counts:
                report = dc.attempt(refit)
            if call == RELAY_FAILS and me == 1:
                from xreshard.runtime.codecs.delta import DeltaCodec
                DeltaCodec._land = dc._LAND[0]
            row = dc._row(report)
            if not isinstance(report, str):
                row.update(forwarded=report.bytes_forwarded, posted=counts.total_sent)
            row.update(version=refit.version, stale=refit.stale)
            row["held"] = {name: [hashlib.sha256(t.view(torch.uint8).numpy().tobytes())
                                  .hexdigest() for t in ts] for name, ts in local.items()}
            rows.append(row)
        baseline = refit.delta_state.baseline_bytes
    dist.destroy_process_group()
    return {"rows": rows, "baseline_bytes": baseline}
