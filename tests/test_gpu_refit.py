"""Refits on GPUs, and the checks scripts/gpu_check.sh runs on one GPU.

Two checks, each a function that returns a JSON-able report and runs on CUDA or, as a dry
run of its logic, on CPU (``device="cpu"``: numpy bindings, the local / gloo transports):

(a) ``executor_cases``: the real executor, one process, world rank 0 (JAX) and rank 1
    (torch) on one GPU, over a 1-rank NCCL communicator: both world ranks are folded onto
    NCCL rank 0, so every message is a send to self inside one NCCL group. Cases: bf16 JAX
    -> bf16 torch in place (pointer identity), a strided destination, fused qkv row ranges,
    a transposed Flax kernel, an fp32 -> bf16 wire cast, many staging rounds, and a
    consumer on a torch side stream reading right after ``run()`` returns, without a
    device synchronize, while the unpack is slowed down on purpose.
(b) ``two_processes``: a JAX process and a torch process on the same GPU refit 96 tensors
    (~160 MiB of bf16) over NCCL. NCCL refuses two ranks of one GPU unless, from 2.30 on,
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set, or before it each process has its own
    ``NCCL_HOSTID`` (two "hosts" talking over loopback sockets). It passes bit-exact only;
    any error fails it, reported with NCCL's lines.

    python -m tests.test_gpu_refit executor --json OUT.json [--device cpu]
    python -m tests.test_gpu_refit two-processes --json OUT.json --logs DIR [--device cpu]

Under pytest they are ``gpu`` tests (skipped without a GPU); tests/test_gpu_path.py dry-runs
them on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _why_no_gpu() -> str | None:
    from .test_gpu import _WHY
    return _WHY


# ---------------------------------------------------------------------------- environment

class Env:
    """What a check runs on: CUDA (JAX GPU, torch cuda:0, CuPy) or CPU (dry run)."""

    def __init__(self, device: str):
        import jax
        import torch
        self.device = device
        self.cuda = device == "cuda"
        self.jax, self.torch = jax, torch
        if self.cuda:
            import cupy
            self.cupy = cupy
            self.jax_dev = jax.devices("gpu")[0]
            self.torch_dev = torch.device("cuda", 0)
        else:
            self.cupy = None
            self.jax_dev = jax.devices("cpu")[0]
            self.torch_dev = torch.device("cpu")

    def ptr(self, arr: Any) -> int:
        """Data pointer of a binding / posted buffer (CuPy, numpy, torch)."""
        if hasattr(arr, "data_ptr"):
            return int(arr.data_ptr())
        if isinstance(arr, np.ndarray):
            return int(arr.__array_interface__["data"][0])
        return int(arr.data.ptr)

    def jax_ptr(self, x: Any) -> int:
        if self.cuda:
            return int(x.unsafe_buffer_pointer())
        return int(np.asarray(x).__array_interface__["data"][0])

    def jax_put(self, value: np.ndarray) -> Any:
        import jax.numpy as jnp
        return self.jax.device_put(jnp.asarray(value), self.jax_dev)

    def torch_full(self, shape, dtype: str, fill_bits: int) -> Any:
        """A torch tensor whose every element has the bit pattern ``fill_bits``."""
        torch = self.torch
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.torch_dev)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        signed = fill_bits - (1 << (8 * t.element_size())) \
            if ints is not torch.uint8 and fill_bits >= 1 << (8 * t.element_size() - 1) \
            else fill_bits
        t.view(ints).fill_(signed)
        return t

    def host_bits(self, t: Any) -> np.ndarray:
        """The bits of a torch tensor, on the host (a device sync for this tensor only)."""
        torch = self.torch
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        return t.contiguous().view(ints).cpu().numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.int16, 4: np.int32}[a.dtype.itemsize])


class PostLog:
    """Wraps a transport; records every post's pointer and size (zero-copy checks)."""

    def __init__(self, inner: Any, env: Env):
        self.inner, self.env = inner, env
        self.name = f"log({inner.name})"
        self.posts: list[dict] = []

    def group(self, timeout: float) -> Any:
        return self.inner.group(timeout)

    def send(self, buf, src_rank, dst_rank, tag):
        self.posts.append({"kind": "send", "ptr": self.env.ptr(buf), "nbytes": int(buf.nbytes)})
        self.inner.send(buf, src_rank, dst_rank, tag)

    def recv(self, buf, src_rank, dst_rank, tag):
        self.posts.append({"kind": "recv", "ptr": self.env.ptr(buf), "nbytes": int(buf.nbytes)})
        self.inner.recv(buf, src_rank, dst_rank, tag)

    def close(self):
        self.inner.close()


class FoldedToSelf:
    """World ranks 0 and 1 of this process on one NCCL rank: every message becomes a send
    to self. NCCL pairs a rank's sends to itself with its receives in issue order, which
    the transport sorts by tag, so (src, dst, tag) folds into one unique tag."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = f"folded({inner.name})"

    @staticmethod
    def _tag(src: int, dst: int, tag: int) -> int:
        return (tag * 2 + src) * 2 + dst

    def group(self, timeout: float) -> Any:
        return self.inner.group(timeout)

    def send(self, buf, src_rank, dst_rank, tag):
        self.inner.send(buf, 0, 0, self._tag(src_rank, dst_rank, tag))

    def recv(self, buf, src_rank, dst_rank, tag):
        self.inner.recv(buf, 0, 0, self._tag(src_rank, dst_rank, tag))

    def close(self):
        self.inner.close()


class DictStore:
    """The rendezvous store of a 1-rank communicator: everything is local."""

    def __init__(self):
        self._d: dict[str, bytes] = {}

    def set(self, key, value):
        self._d[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self._d[key]

    def check(self, keys):
        return all(k in self._d for k in keys)


def _transport(env: Env) -> Any:
    if env.cuda:
        from xreshard.transport.nccl import NcclTransport
        inner = FoldedToSelf(NcclTransport(DictStore(), 1, {0: 0}, key="gpu-check/a",
                                           timeout=60))
    else:
        from xreshard.transport.local import LocalTransport
        inner = LocalTransport([0, 1])
    return PostLog(inner, env)


# ---------------------------------------------------------------------------- (a) executor

def _move(env: Env, transport: PostLog, src_layouts, dst_layouts, src_b, dst_b, *,
          wire=None, bucket=64 << 20, staging=256 << 20) -> Any:
    import xreshard as xr
    from xreshard.runtime.execute import Executor
    from xreshard.planner.schedule import peer_counts, schedule

    plan = xr.plan(src_layouts, dst_layouts, wire_dtype=wire)
    sched = schedule(plan, [0, 1], peer_counts(plan, [0, 1]), bucket_bytes=bucket,
                     staging_bytes=staging)
    transport.posts.clear()
    ex = Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes, src_b, dst_b, transport,
                  timeout=60)
    return ex, ex.run()


def _rng_values(shape, dtype: str, seed: int) -> np.ndarray:
    from xreshard.dtypes import numpy_dtype
    v = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 3
    return v.astype(numpy_dtype(dtype))


def _bf16_in_place(env: Env, tr: PostLog) -> dict:
    """bf16 JAX -> a row range of a bigger bf16 torch buffer: both sides in place."""
    import xreshard as xr
    from xreshard.adapters.jax import host_view
    from xreshard.adapters.torch import tensor_view
    value = _rng_values((512, 256), "bfloat16", 1)
    x = env.jax_put(value)
    buf = env.torch_full((544, 256), "bfloat16", 0x7FC1)      # 16 sentinel rows each side
    rows = buf[16:528]
    src = {"w": xr.Layout.replicated(value.shape, "bfloat16", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated(value.shape, "bfloat16", xr.Mesh((1,), (1,)))}
    _, stats = _move(env, tr, src, dst, {(0, "w"): host_view(x)},
                     {(1, "w"): tensor_view(rows)})
    got = env.host_bits(buf)
    sends = [p["ptr"] for p in tr.posts if p["kind"] == "send"]
    recvs = [p["ptr"] for p in tr.posts if p["kind"] == "recv"]
    return {"bit_exact": bool(np.array_equal(got[16:528], _bits(value))
                              and (got[:16] == _bits(np.array(0x7FC1, np.uint16))).all()
                              and (got[528:] == _bits(np.array(0x7FC1, np.uint16))).all()),
            "zero_copy": stats.num_zero_copy == 2 and stats.staging_bytes == 0,
            "pointer_identity": sends == [env.jax_ptr(x)] and recvs == [rows.data_ptr()],
            "num_zero_copy": stats.num_zero_copy}


def _strided_dst(env: Env, tr: PostLog, *, bucket=64 << 20, staging=256 << 20,
                 shape=(512, 256), slow_unpack: Callable[[], None] | None = None) -> tuple:
    """bf16 JAX -> a column range of a wider torch buffer (not contiguous: staged)."""
    import xreshard as xr
    from xreshard.adapters.jax import host_view
    from xreshard.adapters.torch import tensor_view
    from xreshard.runtime.execute import Executor
    rows, cols = shape
    value = _rng_values(shape, "bfloat16", 2)
    x = env.jax_put(value)
    buf = env.torch_full((rows, cols + 64), "bfloat16", 0)
    view = buf[:, 32:32 + cols]
    src = {"w": xr.Layout.replicated(shape, "bfloat16", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated(shape, "bfloat16", xr.Mesh((1,), (1,)))}
    unpack = Executor._unpack
    if slow_unpack is not None:
        def delayed(self, b, buf_):
            slow_unpack()
            unpack(self, b, buf_)
        Executor._unpack = delayed
    try:
        _, stats = _move(env, tr, src, dst, {(0, "w"): host_view(x)},
                         {(1, "w"): tensor_view(view)}, bucket=bucket, staging=staging)
    finally:
        Executor._unpack = unpack
    return value, buf, stats


def _strided(env: Env, tr: PostLog) -> dict:
    value, buf, stats = _strided_dst(env, tr)
    got = env.host_bits(buf)
    return {"bit_exact": bool(np.array_equal(got[:, 32:-32], _bits(value))
                              and not got[:, :32].any() and not got[:, -32:].any()),
            "staged": stats.staging_bytes > 0, "num_zero_copy": stats.num_zero_copy}


def _staging_rounds(env: Env, tr: PostLog) -> dict:
    value, buf, stats = _strided_dst(env, tr, shape=(2048, 512), bucket=256 << 10,
                                     staging=512 << 10)
    got = env.host_bits(buf)
    return {"bit_exact": bool(np.array_equal(got[:, 32:-32], _bits(value))),
            "num_rounds": stats.num_rounds, "several_rounds": stats.num_rounds >= 4,
            "staging_bytes": stats.staging_bytes}


def _fused_qkv(env: Env, tr: PostLog) -> dict:
    """q, k, v (three JAX tensors) -> three row ranges of one torch qkv buffer."""
    import xreshard as xr
    from xreshard.adapters.jax import host_view
    from xreshard.adapters.torch import tensor_view
    hidden, sizes = 128, {"q": 256, "k": 64, "v": 64}
    values = {n: _rng_values((r, hidden), "bfloat16", 3 + i) for i, (n, r) in
              enumerate(sizes.items())}
    xs = {n: env.jax_put(v) for n, v in values.items()}
    qkv = env.torch_full((sum(sizes.values()) + 16, hidden), "bfloat16", 0x1234)  # +padding
    src, dst, src_b, dst_b, start = {}, {}, {}, {}, 0
    for n, r in sizes.items():
        src[n] = xr.Layout.replicated((r, hidden), "bfloat16", xr.Mesh((1,), (0,)))
        dst[n] = xr.Layout.replicated((r, hidden), "bfloat16", xr.Mesh((1,), (1,)))
        src_b[(0, n)] = host_view(xs[n])
        dst_b[(1, n)] = tensor_view(qkv[start:start + r])
        start += r
    _, stats = _move(env, tr, src, dst, src_b, dst_b)
    got = env.host_bits(qkv)
    want = np.concatenate([_bits(values[n]) for n in sizes])
    return {"bit_exact": bool(np.array_equal(got[:start], want)
                              and (got[start:] == 0x1234).all()),
            "num_zero_copy": stats.num_zero_copy}


def _transposed_kernel(env: Env, tr: PostLog) -> dict:
    """A Flax Dense kernel [in, out] on JAX -> the canonical [out, in] torch weight."""
    import xreshard as xr
    from xreshard.adapters.jax import host_view
    from xreshard.adapters.torch import tensor_view
    kernel = _rng_values((192, 320), "bfloat16", 7)                       # [in, out]
    x = env.jax_put(kernel)
    out = env.torch_full((320, 192), "bfloat16", 0)
    canon = xr.Layout.replicated((192, 320), "bfloat16", xr.Mesh((1,), (0,))).permuted((1, 0))
    dst = {"w": xr.Layout.replicated((320, 192), "bfloat16", xr.Mesh((1,), (1,)))}
    _move(env, tr, {"w": canon}, dst, {(0, "w"): host_view(x).T}, {(1, "w"): tensor_view(out)})
    return {"bit_exact": bool(np.array_equal(env.host_bits(out), _bits(kernel).T))}


def _fp32_to_bf16(env: Env, tr: PostLog) -> dict:
    """fp32 JAX -> bf16 torch, cast on the sender (CuPy's bf16 kernel on GPU)."""
    import xreshard as xr
    from xreshard.adapters.jax import host_view
    from xreshard.adapters.torch import tensor_view
    from xreshard.dtypes import numpy_dtype
    value = _rng_values((256, 384), "float32", 11)
    value[0, :6] = [6.84, -0.0, 1e-40, 3.0e38, 1.00390625, 1.01171875]  # ties, subnormal, big
    x = env.jax_put(value)
    out = env.torch_full((256, 384), "bfloat16", 0)
    src = {"w": xr.Layout.replicated(value.shape, "float32", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated(value.shape, "bfloat16", xr.Mesh((1,), (1,)))}
    _, stats = _move(env, tr, src, dst, {(0, "w"): host_view(x)}, {(1, "w"): tensor_view(out)},
                     wire="bfloat16")
    got = env.host_bits(out)
    ml = _bits(value.astype(numpy_dtype("bfloat16")))
    torch_rne = env.host_bits(env.torch.from_numpy(value).to(env.torch.bfloat16))
    wire_bytes = sum(p["nbytes"] for p in tr.posts if p["kind"] == "send")
    return {"bit_exact": bool(np.array_equal(got, ml)),
            "matches_torch_cast": bool(np.array_equal(got, torch_rne)),
            "wire_is_bf16": wire_bytes == value.size * 2,
            "mismatches": int((got != ml).sum())}


def _side_stream_consumer(env: Env, tr: PostLog) -> dict:
    """A torch consumer on a side stream reads the destination right after run() returns,
    with no device synchronize. The unpack is delayed on purpose (a GPU sleep queued on the
    executor's stream before it), so a run() that did not wait for its copies would hand
    over a destination still being written. The control run turns the executor's final
    wait off and tells whether this check can see that race at all."""
    from xreshard.runtime import execute
    if not env.cuda:
        value, buf, _ = _strided_dst(env, tr)
        return {"bit_exact": bool(np.array_equal(env.host_bits(buf)[:, 32:-32], _bits(value)))}
    torch, cupy = env.torch, env.cupy

    def sleep_on_executor_stream():
        ptr = cupy.cuda.get_current_stream().ptr
        stream = (torch.cuda.default_stream() if ptr == 0 else
                  torch.cuda.ExternalStream(ptr))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)          # ~50 ms of GPU time

    def consume(wait: bool) -> bool:
        real_wait = execute._wait_devices
        if not wait:
            execute._wait_devices = lambda *a: None
        try:
            value, buf, _ = _strided_dst(env, tr, shape=(1024, 1024),
                                         slow_unpack=sleep_on_executor_stream)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                snap = buf[:, 32:-32].clone()       # read right away, on the side stream
            side.synchronize()
        finally:
            execute._wait_devices = real_wait
        torch.cuda.synchronize()
        return bool(np.array_equal(env.host_bits(snap), _bits(value)))

    ok = consume(wait=True)
    control = consume(wait=False)
    # a bar: a control that reads the right bytes without the wait could not see the race
    return {"bit_exact": ok, "control_without_wait_saw_stale_data": not control}


def _refit_side_stream_consumer(env: Env, tr: PostLog) -> dict:
    """The same contract through ``Refit`` itself: a one-process world (JAX rank 0, torch
    rank 1 on the same GPU, the local transport), a strided torch destination, the unpack
    slowed down, and a side-stream read right after ``refit()`` returns."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xreshard as xr
    from xreshard.adapters.torch import tensor_view
    from xreshard.runtime.execute import Executor
    torch, jax = env.torch, env.jax
    shape = (1024, 1024)
    value = _rng_values(shape, "bfloat16", 13)
    mesh = jax.sharding.Mesh(np.array([env.jax_dev]), ("x",))
    params = {"w": jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("x")))}
    buf = env.torch_full((shape[0], shape[1] + 64), "bfloat16", 0)
    layout = xr.Layout.replicated(shape, "bfloat16", xr.Mesh((1,), (1,)))
    unpack = Executor._unpack
    if env.cuda:
        cupy = env.cupy

        def delayed(self, b, staged):
            ptr = cupy.cuda.get_current_stream().ptr
            with torch.cuda.stream(torch.cuda.default_stream() if ptr == 0 else
                                   torch.cuda.ExternalStream(ptr)):
                torch.cuda._sleep(100_000_000)
            unpack(self, b, staged)
        Executor._unpack = delayed
    try:
        with xr.serve() as server:
            world = xr.World.join(server.address, "local",
                                  [env.jax_dev, "cuda:0" if env.cuda else "cpu"],
                                  num_processes=1, index=0, timeout=60)
            try:
                refit = xr.Refit(world, send=params, receive=xr.Bound(
                    {"w": layout}, {(1, "w"): tensor_view(buf[:, 32:-32])}))
                report = refit()
                if env.cuda:
                    side = torch.cuda.Stream()
                    with torch.cuda.stream(side):
                        snap = buf[:, 32:-32].clone()
                    side.synchronize()
                else:
                    snap = buf[:, 32:-32].clone()
            finally:
                world.close()
    finally:
        Executor._unpack = unpack
    # a CUDA destination is staged (its delayed unpack is the race under test); a host one
    # lands in place (the local transport takes the strided region itself: takes_views)
    return {"bit_exact": bool(np.array_equal(env.host_bits(snap), _bits(value))),
            "staged" if env.cuda else "landed_in_place":
                (report.staging_bytes > 0) == bool(env.cuda)}


CASES: dict[str, Callable[[Env, PostLog], dict]] = {
    "bf16_in_place_row_range": _bf16_in_place,
    "bf16_strided_destination": _strided,
    "fused_qkv_row_ranges": _fused_qkv,
    "transposed_flax_kernel": _transposed_kernel,
    "fp32_to_bf16_wire_cast": _fp32_to_bf16,
    "several_staging_rounds": _staging_rounds,
    "side_stream_consumer_without_sync": _side_stream_consumer,
    "refit_side_stream_consumer_without_sync": _refit_side_stream_consumer,
}


def executor_cases(device: str = "cuda", only: list[str] | None = None,
                   on_update: Callable[[dict], None] = lambda report: None) -> dict:
    """Run every case of (a); a failing case is reported and the others still run.
    ``on_update(report)`` after each case, so a hang still leaves what ran."""
    report: dict[str, Any] = {"device": device, "cases": {}}
    t0 = time.perf_counter()
    try:
        env = Env(device)
        if env.cuda:
            from xreshard.runtime.execute import cuda_preflight
            tp = time.perf_counter()
            cuda_preflight(0)
            report["preflight_seconds"] = round(time.perf_counter() - tp, 3)
        transport = _transport(env)
    except Exception as e:
        report.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        on_update(report)
        return report
    try:
        for name, case in CASES.items():
            if only and name not in only:
                continue
            tc = time.perf_counter()
            try:
                out = case(env, transport)
                # a control must see the race it controls (else the case proves nothing)
                out["ok"] = all(v for k, v in out.items() if isinstance(v, bool))
            except Exception as e:
                out = {"ok": False, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
            out["seconds"] = round(time.perf_counter() - tc, 3)
            report["cases"][name] = out
            on_update(report)
    finally:
        with contextlib.suppress(Exception):
            transport.close()
    report["ok"] = bool(report["cases"]) and all(c["ok"] for c in report["cases"].values())
    report["seconds"] = round(time.perf_counter() - t0, 3)
    passed = sum(c["ok"] for c in report["cases"].values())
    report["figure"] = f"{passed}/{len(report['cases'])} cases pass"
    report["bar"] = ("every case bit-exact (zero-copy where contiguous, pointer identity), "
                     "and the side-stream control without the executor's final wait reads "
                     "stale bytes (so the check can see that race)")
    return report


# ---------------------------------------------------------------------------- (b) processes

#: (b) moves many tensors of assorted shapes (~160 MiB of bf16), not one buffer
_TENSORS = {f"layers.{i}.{k}": shape for i in range(24)
            for k, shape in (("qkv", (768, 1024)), ("o", (1024, 512)), ("up", (2048, 512)),
                             ("norm", (1024,)))}


def _many_values(seed: int) -> dict[str, np.ndarray]:
    from xreshard.dtypes import numpy_dtype
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s, dtype=np.float32) * 3).astype(numpy_dtype("bfloat16"))
            for n, s in _TENSORS.items()}


def two_process_child(role: str, address: str, device: str, timeout: float) -> dict:
    """One side of (b): "jax" sends every tensor of ``_TENSORS`` (bf16), "torch" receives
    them into its own tensors and checks every bit."""
    import xreshard as xr
    out: dict[str, Any] = {"role": role, "pid": os.getpid(),
                           "NCCL_HOSTID": os.environ.get("NCCL_HOSTID"),
                           "NCCL_MULTI_RANK_GPU_ENABLE":
                               os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")}
    values = _many_values(5)
    transport = "nccl" if device == "cuda" else "gloo"
    config = xr.RefitConfig(transport=transport, timeout=timeout)
    t0 = time.perf_counter()
    if role == "jax":
        import jax
        import jax.numpy as jnp
        dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        world = xr.World.join(address, "trainer", [dev], num_processes=2, index=0,
                              groups=["trainer", "rollout"], timeout=timeout)
        params = {n: jax.device_put(jnp.asarray(v), dev) for n, v in values.items()}
        report = xr.Refit(world, send=params, config=config)()
        out["ok"] = report.version == 1
    else:
        import torch
        world = xr.World.join(address, "rollout", ["cuda:0" if device == "cuda" else "cpu"],
                              num_processes=2, index=0, groups=["trainer", "rollout"],
                              timeout=timeout)
        dev = "cuda:0" if device == "cuda" else "cpu"
        bufs = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in _TENSORS.items()}
        report = xr.Refit(world, receive=bufs, config=config)()
        # no synchronize: refit's contract
        out["ok"] = all(np.array_equal(bufs[n].view(torch.int16).cpu().numpy(), _bits(v))
                        for n, v in values.items())
        out["bytes"] = report.bytes_received
        out["tensors"] = len(bufs)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["report"] = str(report)
    world.close()
    return out


def _nccl_errors(text: str) -> list[str]:
    keys = ("NCCL WARN", "Duplicate GPU", "ncclInvalidUsage", "ncclSystemError",
            "ncclInternalError", "ncclRemoteError", "NCCL_ERROR", "TransportError",
            "TransportTimeout", "RefitError")
    return [ln.strip()[:400] for ln in text.splitlines()
            if not ln.startswith("{") and any(k in ln for k in keys)][:20]


def _nccl_version() -> int:
    try:
        from cupy.cuda import nccl
        return int(nccl.get_version()) if nccl.available else 0
    except Exception:       # noqa: BLE001 - no CuPy: the CPU dry run
        return 0


def children_env(device: str, attempt: str) -> dict[str, str]:
    """The environment of two child processes sharing one GPU (``attempt``: "multirank",
    NCCL >= 2.30, or "hostid"; the caller sets ``NCCL_HOSTID`` per child for the latter),
    or the CPU (``device="cpu"``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    if device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    if attempt == "multirank":
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        env.update({"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"})
    return env


def two_processes(device: str = "cuda", *, timeout: float = 30.0, logs: Path | None = None,
                  on_update: Callable[[dict], None] = lambda report: None) -> dict:
    """(b): a JAX process and a torch process refit many tensors over NCCL on one GPU.

    NCCL refuses two ranks of one GPU unless told: from NCCL 2.30 on, with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` ("multirank"); before it, a distinct ``NCCL_HOSTID``
    per process makes them look like two hosts talking over loopback sockets ("hostid").
    One attempt, the one this NCCL supports; it passes only bit-exact, and any error fails
    it (printed with NCCL's own lines).
    """
    import tempfile
    import xreshard as xr
    # children write to files, never to pipes: NCCL_DEBUG=INFO fills a pipe nobody reads
    logs = Path(logs) if logs is not None else Path(tempfile.mkdtemp(prefix="gpu-check-b-"))
    logs.mkdir(parents=True, exist_ok=True)
    version = _nccl_version() if device == "cuda" else 0
    attempt = "multirank" if version >= 23000 else "hostid"
    report: dict[str, Any] = {"device": device, "attempts": {}, "logs": str(logs),
                              "nccl_version": version}
    t0 = time.perf_counter()
    env_common = children_env(device, attempt)
    procs, paths = {}, {}
    with xr.serve(timeout=timeout + 30) as server:
        for role in ("jax", "torch"):
            env = dict(env_common)
            if attempt == "hostid":
                env["NCCL_HOSTID"] = f"xreshard-gpu-check-{role}"
            paths[role] = (logs / f"b_{attempt}_{role}.stdout.log", logs / f"b_{attempt}_{role}.log")
            with paths[role][0].open("w") as out, paths[role][1].open("w") as err:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "tests.test_gpu_refit", "two-processes-child",
                     "--role", role, "--address", server.address, "--device", device,
                     "--timeout", str(timeout)],
                    cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        results = _collect(procs, paths, deadline=time.monotonic() + timeout + 40)
    ok = all(r.get("ok") and r["returncode"] == 0 for r in results.values())
    report["attempts"][attempt] = {"ok": ok, "seconds": round(time.perf_counter() - t0, 1),
                                   "processes": results}
    report["ok"] = ok
    torch_side = results.get("torch", {})
    errors = sorted({e for r in results.values() for e in r.get("nccl_errors", [])
                     + ([r["error"]] if r.get("error") else [])})
    report["errors"] = errors[:20]
    report["figure"] = (f"{attempt}: {torch_side.get('tensors')} tensors, "
                        f"{torch_side.get('bytes')} B, bit-exact {bool(torch_side.get('ok'))}, "
                        f"{len(errors)} error line(s)")
    report["bar"] = ("a JAX and a torch process on one GPU refit every tensor over NCCL "
                     "bit-exact; any error fails it")
    on_update(report)
    return report


def _collect(procs: dict, paths: dict, deadline: float) -> dict:
    """Wait for the children (a failed one gives the other 15 s to say why), then read what
    each reported."""
    killed: set[str] = set()
    failed_at: float | None = None
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs.values()):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at > 15):
            for role, p in procs.items():
                if p.poll() is None:
                    p.kill()
                    killed.add(role)
            break
        time.sleep(0.2)
    results: dict[str, Any] = {}
    for role, p in procs.items():
        p.wait()
        stdout = paths[role][0].read_text(errors="replace")
        stderr = paths[role][1].read_text(errors="replace")
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {"ok": False}
        res.update(returncode=p.returncode, killed=role in killed)
        res["stderr_tail"] = stderr[-3000:]
        res["nccl_errors"] = _nccl_errors(stdout + "\n" + stderr)
        results[role] = res
    return results


# ---------------------------------------------------------------------------- pytest

def _num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_executor_cases_on_one_gpu():
    pytest.importorskip("jax")
    report = executor_cases("cuda")
    assert report["ok"], json.dumps(report, indent=1)[-6000:]


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_jax_to_torch_on_one_gpu_in_one_process():
    """JAX shards on the GPU -> a torch CUDA tensor, both frameworks in this process: the
    world has 2 ranks in 1 process, so every pair goes through the local transport."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xreshard as xr
    from xreshard.adapters.torch import tensor_view

    gpu = jax.devices("gpu")[0]
    with xr.serve() as server:
        world = xr.World.join(server.address, "local", [gpu, "cuda:0"], num_processes=1,
                              index=0, timeout=60)
        mesh = jax.sharding.Mesh(np.array([gpu]), ("x",))
        value = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
        params = {"w": jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("x")))}
        out = torch.zeros((64, 48), dtype=torch.float32, device="cuda:0")
        layout = xr.Layout.replicated((64, 48), "float32", xr.Mesh((1,), (1,)))
        receive = xr.Bound({"w": layout}, {(1, "w"): tensor_view(out)})
        refit = xr.Refit(world, send=params, receive=receive)
        report = refit()
        assert report.version == 1
        assert np.array_equal(out.cpu().numpy(), value)        # no synchronize needed
        # the region is one contiguous run on both sides: sent and received in place
        assert report.num_zero_copy == 2 and report.staging_bytes == 0
        world.close()


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None or _num_gpus() < 2, reason="needs 2 GPUs")
def test_jax_to_torch_one_process_per_gpu():
    from xreshard.tools.launch import Role, launch
    from . import refit_cases as cases

    roles = [Role("jax", "trainer", 0, gpus=(0,)), Role("torch", "rollout", 0, gpus=(1,))]
    results = launch(cases.gpu_jax_to_torch, roles, timeout=300)
    assert all(r.value["ok"] for r in results)


# ---------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU checks (a) and (b) of scripts/gpu_check.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("executor")
    a.add_argument("--json", required=True)
    a.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a.add_argument("--only", nargs="*")
    b = sub.add_parser("two-processes")
    b.add_argument("--json", required=True)
    b.add_argument("--logs")
    b.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    b.add_argument("--timeout", type=float, default=30.0)
    c = sub.add_parser("two-processes-child")
    c.add_argument("--role", required=True, choices=["jax", "torch"])
    c.add_argument("--address", required=True)
    c.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    c.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.cmd == "two-processes-child":
        try:
            out = two_process_child(args.role, args.address, args.device, args.timeout)
        except BaseException as e:      # report, then exit without waiting for NCCL threads
            out = {"role": args.role, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(out), flush=True)
        sys.stderr.flush()
        os._exit(0 if out.get("ok") else 1)
    def save(report: dict) -> None:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))

    if args.cmd == "executor":
        report = executor_cases(args.device, args.only, on_update=save)
    else:
        report = two_processes(args.device, timeout=args.timeout, logs=args.logs,
                               on_update=save)
    save(report)
    print(json.dumps({k: v for k, v in report.items()
                      if k in ("ok", "figure", "device", "seconds", "preflight_seconds",
                               "error")}))
    for name, case in report.get("cases", {}).items():
        print(f"  {name}: {'ok' if case['ok'] else 'FAILED'} "
              f"{ {k: v for k, v in case.items() if k not in ('traceback',)} }")
    for name, att in report.get("attempts", {}).items():
        print(f"  attempt {name}: {'ok' if att['ok'] else 'FAILED'} ({att['seconds']} s)")
        for role, r in att["processes"].items():
            print(f"    {role}: ok={r.get('ok')} rc={r['returncode']} "
                  f"killed={r['killed']} error={r.get('error')} "
                  f"nccl={r['nccl_errors'][:3]}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    if "JAX_PLATFORMS" not in os.environ and "--device" in sys.argv and "cpu" in sys.argv:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
