"""Processes of the relay composition tests (tests/test_relay_compose.py): a JAX trainer on
a (2, 2) CPU mesh (host "t") sends NamedSharding arrays to torch DTensors on a (dp=2,
tp=2) mesh of four rollout processes, two replicas whose TP rank 0 lives on host "a" and
TP rank 1 on host "b"::

    # rollout | host | mesh coord (dp, tp) | holds
    #       0 | a    | (0, 0)              | tp shard 0 of replica 0
    #       1 | b    | (0, 1)              | tp shard 1 of replica 0
    #       2 | a    | (1, 0)              | tp shard 0 of replica 1
    #       3 | b    | (1, 1)              | tp shard 1 of replica 1

So every host needs each of its bytes twice: with ``relay="on"`` the trainer sends one
copy per host and the two ranks of a host forward halves to each other. Every receiver
bit-compares every byte it holds after every call that succeeded.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from xreshard.tools.testing import local_arrays_from_global, numpy_dtype

#: name -> (shape, jax spec on mesh ("a", "b"), torch placements on (dp, tp), flags)
TENSORS = {
    "rows": ((64, 32), ("a",), ["R", "S0"], ""),            # contiguous on both sides
    "cols": ((32, 48), (None, "b"), ["R", "S1"], ""),        # strided destination: staging
    "kernel": ((32, 16), ("a", "b"), ["R", "S0"], "T"),      # [in, out] JAX kernel
    "frozen": ((16, 16), (), ["R", "R"], ""),
    "bias": ((48,), ("b",), ["R", "R"], ""),
}
STEP_FRACTION = 0.02
HOSTS = "ab"


def value(name: str, shape: tuple[int, ...], step: int) -> np.ndarray:
    """Tensor ``name`` at ``step``: a pattern with, per step, a few elements' lowest bit
    flipped (what an RL step does to BF16 weights); ``frozen`` never changes."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    arr = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    arr = arr.astype(numpy_dtype("bfloat16"))
    if name == "frozen":
        return arr
    bits = arr.reshape(-1).view(np.uint16)
    for j in range(1, step + 1):
        rng = np.random.default_rng(seed + j)
        bits[rng.choice(bits.size, max(1, int(bits.size * STEP_FRACTION)), replace=False)] ^= 1
    return arr


def _jax_params(step: int) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())
    params = {}
    for name, (shape, spec, _, flags) in TENSORS.items():
        arr = value(name, shape, step)
        if "T" in flags:
            arr = np.ascontiguousarray(arr.T)
            spec = tuple(reversed(spec + (None,) * (2 - len(spec))))
        params[name] = jax.device_put(arr, NamedSharding(mesh, P(*spec)))
    return params


def _layout(name: str) -> Any:
    from xreshard.ir.layout import Layout, Mesh
    shape, _, placements, _ = TENSORS[name]
    return Layout.from_placements(shape, "bfloat16", Mesh((2, 2)), placements)


def _dtensors(ctx: Any) -> dict:
    """Zeroed DTensors of every tensor on the rollouts' (dp, tp) mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from xreshard.adapters.torch import placements_of
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store),
                            rank=ctx.role.index, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, (shape, _, _, _) in TENSORS.items():
        layout = _layout(name)
        local = torch.zeros(layout.local_shape(ctx.role.index), dtype=torch.bfloat16)
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        out[name] = DTensor.from_local(local, mesh, placements_of(layout),
                                       shape=torch.Size(shape), stride=stride, run_check=False)
    return out


def check(state: dict, step: int, me: int) -> int:
    """Bit-compare every local shard with ``step``'s value; returns elements checked."""
    from xreshard.adapters.torch import tensor_view

    checked = 0
    for name, (shape, _, _, _) in TENSORS.items():
        want = np.ascontiguousarray(local_arrays_from_global(_layout(name), me,
                                                             value(name, shape, step)))
        got = tensor_view(state[name].to_local())
        if got.tobytes() != want.tobytes():
            raise AssertionError(f"step {step}: {name} on rollout rank {me} holds wrong bytes")
        checked += got.size
    return checked


def _config(xr: Any) -> Any:
    return xr.RefitConfig(delta=True, relay="on", verify=True, timeout=60, bucket_bytes=1024)


def _row(report: Any, counts: Any = None) -> dict:
    if isinstance(report, str):
        return {"error": report}
    return {"version": report.version, "sent": report.bytes_sent,
            "forwarded": report.bytes_forwarded, "received": report.bytes_received,
            "delta": dict(report.delta or {}), "verified": report.verified,
            "posted": counts.total_sent if counts is not None else None}


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:      # noqa: BLE001 - the test compares what every process raised
        return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- delta
# call 1: seeds (dense everywhere); call 2: deltas, forwards included; call 3: rollout[2]
# claims a base it does not hold (every pair into it dense: the trainer's and its
# forwarder rollout[0]'s; its own forwards still deltas); call 4: rollout[1] fails before
# applying the last bucket it lands (its destination holds a mix; every process raises);
# call 5: dense everywhere, bit-exact; call 6: deltas again. verify=True throughout.

DELTA_CALLS = 6


def delta_trainer(ctx: Any) -> dict:
    import xreshard as xr

    rows = []
    with ctx.join(timeout=120, groups=["trainer", "rollout"], host="t") as world:
        refit = xr.Refit(world, send=_jax_params(0),
                         transpose={n for n, t in TENSORS.items() if "T" in t[3]},
                         config=_config(xr))
        for call in range(1, DELTA_CALLS + 1):
            rows.append(_row(_attempt(lambda: refit(send=_jax_params(call)))))
        baseline = refit.delta_state.baseline_bytes
    return {"rows": rows, "baseline_bytes": baseline}


def delta_rollout(ctx: Any) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    me = ctx.role.index
    state = _dtensors(ctx)
    rows, checked, held = [], 0, 0
    with ctx.join(timeout=120, groups=["trainer", "rollout"], host=HOSTS[me % 2]) as world:
        refit = xr.Refit(world, receive=state, config=_config(xr))
        for call in range(1, DELTA_CALLS + 1):
            if call == 3 and me == 2:           # a base it does not hold
                refit.delta_state.base = {r: ("not-a-call", d) for r, (_, d)
                                          in refit.delta_state.base.items()}
            undo = _fail_before_last_landing() if call == 4 and me == 1 else None
            with xr.count_comm() as counts:
                row = _row(_attempt(refit), counts)
            if undo is not None:
                undo()
            if "error" not in row:
                held = call
                try:
                    checked += check(state, held, me)
                except AssertionError as e:
                    row["wrong"] = str(e)
            rows.append(row)
        baseline = refit.delta_state.baseline_bytes
    dist.destroy_process_group()
    return {"rows": rows, "checked": checked, "baseline_bytes": baseline}


def _fail_before_last_landing() -> Any:
    """This process's delta executor raises instead of landing the last bucket it receives
    in the call (after its last group: the others finish, then learn it at the outcome);
    returns the undo."""
    from xreshard.errors import RefitError
    from xreshard.runtime.codecs.delta import DeltaCodec

    land = DeltaCodec._land

    def failing(self, b, buf, how):
        ex = self.ex
        last = [x for rnd in ex.schedule.rounds for x in rnd if x.dst in ex._local_dst]
        if b is last[-1]:
            raise RefitError(f"injected failure before landing bucket {b.tag} "
                             f"(stage {b.stage}, {how}; pid {os.getpid()})")
        land(self, b, buf, how)

    DeltaCodec._land = failing

    def undo() -> None:
        DeltaCodec._land = land
    return undo


# ---------------------------------------------------------------------------- FP8
# The same hosts and (dp, tp) mesh; the rollouts store every tensor quantized (codes and
# scales DTensors sharded like vLLM's TP shards, on the rows of each matrix). "o", "e" and
# "m" reach every host once as FP8 and are forwarded as the forwarders' codes and scales;
# "w" (trainer columns cut at 150) has blocks a forwarder would receive split across
# senders, so it is not relayed. Two calls (v1, v2), verify=True.

#: name -> (shape, format, the trainer's PartitionSpec over mesh ("a", "b"))
FP8_TENSORS = {
    "o": ((1024, 512), "block", (("a", "b"), None)),
    "e": ((4, 256, 256), "block", (None, "a", "b")),
    "m": ((256, 256), "mx", (("a", "b"), None)),
    "w": ((512, 300), "block", ("a", "b")),
}
FP8_RELAYED = ("o", "e", "m")


def fp8_values(version: int, tensors: dict | None = None) -> dict[str, np.ndarray]:
    """bf16 values of ``tensors`` (default :data:`FP8_TENSORS`) at ``version``: normal
    values at scales two to the -6..6 per row (blocks of very different amax)."""
    import ml_dtypes
    out = {}
    for i, (name, (shape, _, _)) in enumerate(sorted((tensors or FP8_TENSORS).items())):
        rng = np.random.default_rng(100 * version + i)
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        x *= np.exp2(rng.integers(-6, 7, shape[:-1] + (1,))).astype(np.float32)
        out[name] = x.astype(ml_dtypes.bfloat16)
    return out


def _fp8_config(xr: Any) -> Any:
    return xr.RefitConfig(relay="on", verify=True, timeout=60, bucket_bytes=1 << 15)


def fp8_trainer(ctx: Any) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(v: int) -> dict:
        return {n: jax.device_put(a, NamedSharding(mesh, P(*FP8_TENSORS[n][2])))
                for n, a in fp8_values(v).items()}

    out: dict = {"reports": []}
    with ctx.join(timeout=120, groups=["trainer", "rollout"], host="t") as world:
        refit = xr.Refit(world, send=params(1), config=_fp8_config(xr))
        for v in (1, 2):
            with xr.count_comm() as counts:
                r = refit(send=params(v))
            out["reports"].append(dict(r.quantized, sent=r.bytes_sent, verified=r.verified,
                                       forwarded=r.bytes_forwarded, posted=counts.total_sent))
    return out


def fp8_rollout(ctx: Any) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import xreshard as xr
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8, MXFP8
    from xreshard.runtime.world import parse_address

    me = ctx.role.index
    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store), rank=me,
                            world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state, locals_ = {}, {}
    for name, (shape, kind, _) in FP8_TENSORS.items():
        fmt = BlockFP8() if kind == "block" else MXFP8()
        dim = len(shape) - 2                       # rows of each matrix, TP-style
        pieces = []
        for full, dtype in ((shape, torch.float8_e4m3fn),
                            (fmt.scale_shape(shape), getattr(torch, fmt.scale_dtype))):
            local_shape = list(full)
            local_shape[dim] //= 2
            nbytes = int(np.prod(local_shape)) * torch.empty(0, dtype=dtype).element_size()
            local = torch.full((nbytes,), 0x55, dtype=torch.uint8).view(dtype).view(local_shape)
            pieces.append(DTensor.from_local(local, mesh, [Replicate(), Shard(dim)],
                                             shape=torch.Size(full),
                                             stride=torch.empty(full).stride(),
                                             run_check=False))
            locals_.setdefault(name, []).append(local)
        state[name] = Quantized(*pieces, fmt)
    out: dict = {"got": [], "reports": []}
    with ctx.join(timeout=120, groups=["trainer", "rollout"], host=HOSTS[me % 2]) as world:
        refit = xr.Refit(world, receive=state, config=_fp8_config(xr))
        for _ in (1, 2):
            with xr.count_comm() as counts:
                r = refit()
            out["got"].append({n: [t.view(torch.uint8).numpy().tobytes().hex() for t in ts]
                               for n, ts in locals_.items()})
            out["reports"].append(dict(r.quantized, sent=r.bytes_sent, verified=r.verified,
                                       forwarded=r.bytes_forwarded,
                                       posted=counts.total_sent))
    dist.destroy_process_group()
    return out


def vllm_quantize(a: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's own quantizer on a whole bf16 tensor (``kind``: "block" or "mx"): its
    (codes bytes, scales bytes); 3-D block tensors per expert, as vLLM's MoE methods."""
    import torch
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        _mxfp8_e4m3_quantize_torch)
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if kind == "mx":
        q, s = _mxfp8_e4m3_quantize_torch(x)
    elif x.ndim == 3:
        q, s = (torch.stack(t) for t in zip(*(per_block_cast_to_fp8(
            x[e], [128, 128], use_ue8m0=False) for e in range(x.shape[0]))))
    else:
        q, s = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
    return (q.view(torch.uint8).numpy(),
            s.contiguous().view(torch.uint8).numpy().reshape(s.shape + (-1,)))


def vllm_fp8_bytes(version: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """:func:`vllm_quantize` of each whole bf16 tensor of ``version``."""
    return {name: vllm_quantize(a, FP8_TENSORS[name][1])
            for name, a in fp8_values(version).items()}
