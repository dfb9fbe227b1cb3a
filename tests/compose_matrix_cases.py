"""Processes of tests/test_compose_matrix.py: every combination of a call's features in one
long-lived world of real processes.

A JAX trainer (NamedSharding arrays on a (2, 2) CPU mesh, host "t") sends bf16 values to
two torch rollout processes (host "a", a gloo group of their own) that hold DTensors:
bf16, or block-FP8 / MXFP8 codes + scales (``Quantized``, quantized on the way). For each
case of :data:`CASES`, every process builds one ``Refit`` (named after the case) and makes
:data:`CALLS` calls; the trainer sends :func:`values` of the call's step. Call
:data:`FAILS` fails mid-move: the trainer's gloo transport raises once after its first
round of posts completed (:func:`fault_mid_move`). Each rollout returns, per call, what the call
raised or reported and the sha256 of every destination's ``full_tensor()`` bytes (codes
and scales viewed as bytes); the test compares them with vLLM's quantizer on the whole
tensors (or the bf16 values), computed in the test process.

Two switches are kept in one function each, so they can be changed in one place:
:func:`device_kernels` (host bindings through the device kernels, run on the CPU) and
:func:`fault_mid_move`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import os
import time
from typing import Any, Iterator

import numpy as np

from .delta_cases import attempt

#: the axes of the matrix, in the order of a case's key
AXES = {
    "delta": (False, True),
    "format": ("block", "mx", "bf16"),
    "relay": (False, True),
    "atomic": (False, True),
    "verify": (False, True),
    "device": (False, True),
    "executor": ("pipelined", "rounds"),
}
CASES = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def case_key(case: dict) -> str:
    """A case's name: ``delta-block-relay-atomic-verify-device-rounds`` with the features
    that are off left out (``bf16-pipelined``: no feature)."""
    words = [k for k in ("delta",) if case[k]] + [case["format"]]
    words += [k for k in ("relay", "atomic", "verify", "device") if case[k]]
    return "-".join(words + [case["executor"]])


#: name -> (global shape, quantized in FP8 cases, the trainer's PartitionSpec over mesh
#: ("a", "b"), the rollouts' placement on their 1-d mesh: "S0" rows sharded, "R" replicas)
TENSORS = {
    # columns cut at 80 on the trainer: block FP8's 128-wide blocks and MXFP8's 32-wide
    # groups are split (finished by the receiver); rows sharded on the rollouts
    "w": ((256, 320), True, (None, ("a", "b")), "S0"),
    # a block row per trainer device, whole on both rollouts: relayed
    "o": ((512, 128), True, (("a", "b"), None), "R"),
    # bf16 in every case, relayed
    "n": ((64, 64), False, ("a",), "R"),
}
#: the step each call sends: "A" random; "B" = A with 1% of the lowest bits flipped;
#: "C" = B with the sign of its first half of rows flipped and of 1% of the rest
#: (structured: block FP8 keeps its scales, every code changes its sign bit);
#: "D" = new random values (the failed call); "E" = C with 1% of the lowest bits flipped
#: (a delta of the last good call: the bases must have survived the failed one)
STEPS = ("A", "B", "C", "D", "E")
CALLS = len(STEPS)
FAILS = 4           # the call that fails mid-move (1-based)
FILL = 0x55         # every destination byte before a case's first call
TIMEOUT = 30


def values(step: str) -> dict[str, np.ndarray]:
    """The bf16 value of every tensor at ``step`` (see :data:`STEPS`); row magnitudes
    spread over 2^-6..2^6, so block scales differ."""
    import ml_dtypes

    if step == "E":
        out = values("C")
        for i, a in enumerate(out[k] for k in sorted(out)):
            bits = a.reshape(-1).view(np.uint16)
            rng = np.random.default_rng(500 + i)
            bits[rng.choice(bits.size, bits.size // 100, replace=False)] ^= 1
        return out
    out = {}
    for i, (name, (shape, _, _, _)) in enumerate(sorted(TENSORS.items())):
        rng = np.random.default_rng(100 * (i + 1) + (2 if step == "D" else 1))
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        x *= np.exp2(rng.integers(-6, 7, shape[:-1] + (1,))).astype(np.float32)
        a = x.astype(ml_dtypes.bfloat16)
        bits = a.reshape(-1).view(np.uint16)
        if step in "BC":
            bits[rng.choice(bits.size, bits.size // 100, replace=False)] ^= 1
        if step == "C":
            a[: shape[0] // 2] = -a[: shape[0] // 2]
            bits[rng.choice(bits.size, bits.size // 100, replace=False)] ^= 0x8000
        out[name] = a
    return out


# ---------------------------------------------------------------------------- switches

def device_kernels(on: bool) -> dict[str, Any]:
    """THE switch of the matrix's "device" axis: this process runs host bindings through
    the device kernels (delta diff and apply, FP8 quantizers) in torch ops on the CPU, with
    the sender's delta baselines "on the device". Returns the ``Tuning`` fields it needs
    (``Tuning.host_device_ops``, the switch tests set)."""
    if on:
        return {"host_device_ops": "torch", "delta_baseline": "device"}
    return {}


def device_counts() -> dict[str, int]:
    """What this process ran through the device kernels so far, by "<work>/<framework>"."""
    from xreshard.runtime import device_ops
    return dict(getattr(device_ops, "COUNTS", {}))


INJECTED = "injected fault mid-move"


@contextlib.contextmanager
def fault_mid_move() -> Iterator[None]:
    """This process's gloo transport raises once, as tests/test_faults.py injects (a
    ``RuntimeError``, not xreshard's), at its first send after a group of posts
    completed: the first round's bytes landed, the later rounds' are not sent."""
    from xreshard.transport.gloo import GlooTransport

    group, send = GlooTransport.group, GlooTransport.send
    done: list[int] = []
    raised: list[int] = []

    @contextlib.contextmanager
    def counted(self: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        with group(self, *args, **kwargs):
            yield
        done.append(1)

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if done and not raised:
            raised.append(1)
            raise RuntimeError(f"{INJECTED} (pid {os.getpid()})")
        return send(self, *args, **kwargs)

    GlooTransport.group, GlooTransport.send = counted, failing
    try:
        yield
    finally:
        GlooTransport.group, GlooTransport.send = group, send


# ---------------------------------------------------------------------------- processes

def _config(xr: Any, case: dict) -> Any:
    # small buckets and staging: several rounds, so the fault comes between two of them
    return xr.RefitConfig(timeout=TIMEOUT, bucket_bytes=1 << 13, staging_bytes=1 << 16,
                          delta=case["delta"],
                          relay="on" if case["relay"] else "off", atomic=case["atomic"],
                          verify=case["verify"])


def _tuning(xr: Any, case: dict) -> Any:
    return xr.Tuning(executor=case["executor"], **device_kernels(case["device"]))


def _row(report: Any) -> dict:
    if isinstance(report, str):
        return {"error": report}
    return {"sent": report.bytes_sent, "forwarded": report.bytes_forwarded,
            "delta": dict(report.delta or {}), "verified": report.verified,
            "quantized": dict(report.quantized or {})}


class _Worlds:
    """This process's world, joined again (a new world id, the same processes) after a
    case that left it unusable for any process: after each case the processes tell each
    other over the launch's store whether theirs still works, so one case that breaks the
    world fails alone, not every case after it."""

    def __init__(self, ctx: Any, host: str):
        from torch.distributed import TCPStore
        from xreshard.runtime.world import parse_address

        self.ctx, self.host, self.joined = ctx, host, 0
        address, port = parse_address(ctx.address)
        self.store = TCPStore(address, port, is_master=False)
        self.label = f"{ctx.role.group}[{ctx.role.index}]"
        self.world = self._join()

    def _join(self) -> Any:
        self.joined += 1
        return self.ctx.join(groups=["trainer", "rollout"], timeout=120, host=self.host,
                             elastic=True, world_id=f"{self.ctx.world_id}-{self.joined}")

    def after(self, key: str, rows: list[dict]) -> bool:
        """Whether every process's world still works after case ``key`` (else each
        closes its world and joins a new one)."""
        unexpected = any("error" in r for k, r in enumerate(rows, 1)
                         if k != FAILS and not (k == 1 and len(rows) == 1))
        ok = self.world.broken is None and not unexpected
        self.store.set(f"matrix/{key}/{self.label}", "1" if ok else "0")
        labels = ["trainer[0]", "rollout[0]", "rollout[1]"]
        self.store.wait([f"matrix/{key}/{x}" for x in labels])
        if all(self.store.get(f"matrix/{key}/{x}") == b"1" for x in labels):
            return True
        with contextlib.suppress(Exception):
            self.world.close()
        self.world = self._join()
        return False

    def close(self) -> None:
        self.world.close()


def trainer(ctx: Any, keys: list[str] | None = None) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(step: str) -> dict:
        return {name: jax.device_put(a, NamedSharding(mesh, P(*TENSORS[name][2])))
                for name, a in values(step).items()}

    out: dict[str, Any] = {}
    worlds = _Worlds(ctx, "t")
    # everything alive now (jax, torch, the world) lives as long as the process: frozen,
    # the full collection after each case walks only what the cases made (~0.2 s to ~0.03 s
    # per case and process on 2 loaded cores)
    gc.freeze()
    for case in _cases(keys):
        key = case_key(case)
        tuning = _tuning(xr, case)
        before, t0 = device_counts(), time.monotonic()
        refit = xr.Refit(worlds.world, send=params("A"), config=_config(xr, case),
                         tuning=tuning, name=key)
        rows: list[dict] = []
        for call, step in enumerate(STEPS, 1):
            with fault_mid_move() if call == FAILS else contextlib.nullcontext():
                rows.append(_row(attempt(lambda r=refit, s=step: r(send=params(s)))))
            rows[-1].update(version=refit.version, stale=refit.stale)
            if call == 1 and "error" in rows[0]:
                break                   # refused: every process goes to the next case
        out[key] = {"rows": rows, "device": _grew(before, device_counts()),
                    "seconds": round(time.monotonic() - t0, 2)}
        del refit
        out[key]["world_ok"] = worlds.after(key, rows)
        gc.collect()
    worlds.close()
    return out


def _grew(before: dict, after: dict) -> int:
    return sum(after.values()) - sum(before.values())


def _cases(keys: list[str] | None) -> list[dict]:
    return [c for c in CASES if keys is None or case_key(c) in keys]


def _destinations(fmt: str, n: int) -> tuple[dict, dict]:
    """Each tensor's destination in this rollout for format ``fmt``: ``Quantized`` codes
    and scales, or a bf16 DTensor, every byte :data:`FILL`; and, per tensor, its pieces'
    DTensors (codes, scales; or the one bf16 tensor)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8, MXFP8

    mesh = init_device_mesh("cpu", (n,))
    state, pieces = {}, {}
    for name, (shape, quantized, _, place) in TENSORS.items():
        f = BlockFP8() if quantized and fmt == "block" else MXFP8() \
            if quantized and fmt == "mx" else None
        wanted = [(shape, torch.bfloat16)] if f is None else [
            (shape, torch.float8_e4m3fn), (f.scale_shape(shape), getattr(torch, f.scale_dtype))]
        dts = []
        for full, dtype in wanted:
            local = list(full)
            local[0] //= n if place == "S0" else 1
            size = int(np.prod(local)) * torch.empty(0, dtype=dtype).element_size()
            t = torch.full((size,), FILL, dtype=torch.uint8).view(dtype).view(local)
            dts.append(DTensor.from_local(
                t, mesh, [Shard(0) if place == "S0" else Replicate()],
                shape=torch.Size(full), stride=torch.empty(full).stride(), run_check=False))
        state[name] = dts[0] if f is None else Quantized(*dts, f)
        pieces[name] = dts
    return state, pieces


def held(pieces: dict) -> dict[str, list[str]]:
    """sha256 of each destination's whole tensor as the framework assembles it
    (``DTensor.full_tensor()`` over the rollouts' gloo group, of the bytes: gloo gathers no
    float8), per tensor in the order codes, scales."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, dts in sorted(pieces.items()):
        out[name] = []
        for d in dts:
            local = d.to_local()
            as_bytes = DTensor.from_local(local.view(torch.uint8), d.device_mesh,
                                          d.placements, run_check=False)
            full = as_bytes.full_tensor().contiguous().numpy()
            out[name].append(hashlib.sha256(full.tobytes()).hexdigest())
    return out


def rollout(ctx: Any, keys: list[str] | None = None) -> dict:
    import torch.distributed as dist
    import xreshard as xr
    from xreshard.runtime.world import parse_address

    n, me = 2, ctx.role.index
    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store), rank=me,
                            world_size=n)
    out: dict[str, Any] = {}
    worlds = _Worlds(ctx, "a")
    # everything alive now (jax, torch, the world) lives as long as the process: frozen,
    # the full collection after each case walks only what the cases made (~0.2 s to ~0.03 s
    # per case and process on 2 loaded cores)
    gc.freeze()
    for case in _cases(keys):
        key = case_key(case)
        tuning = _tuning(xr, case)
        before, t0 = device_counts(), time.monotonic()
        state, pieces = _destinations(case["format"], n)
        refit = xr.Refit(worlds.world, receive=state, config=_config(xr, case),
                         tuning=tuning, name=key)
        rows = []
        for call in range(1, CALLS + 1):
            row = _row(attempt(refit))
            row.update(version=refit.version, stale=refit.stale, held=held(pieces))
            rows.append(row)
            if call == 1 and "error" in row:
                break
        out[key] = {"rows": rows, "device": _grew(before, device_counts()),
                    "seconds": round(time.monotonic() - t0, 2)}
        del refit, state, pieces
        out[key]["world_ok"] = worlds.after(key, rows)
        gc.collect()
    worlds.close()
    dist.destroy_process_group()
    return out
