"""The GPU checks issue 18 added to scripts/gpu_check.sh, each runnable on CPU as a dry run
of its logic (``--device cpu``: JAX and torch on CPU, the local / shm transports).

- ``cases`` (one process, JAX rank 0 and torch rank 1 on GPU 0, the local transport):
  ``verify=True`` on strided bf16 and fp8 device regions (the digests of device arrays
  against the host's, and a refit checking them); the aliasing refusal on device memory;
  donation of the sent JAX arrays right after a refit and right after ``Refit.start``.
- ``ipc-torch`` (two torch processes on GPU 0: "auto" routes them to cuda_ipc): a torch
  sender whose memory comes from ``expandable_segments`` (no IPC handle: staged), staging
  on both ends (a strided source and a strided destination), ``verify=True``; then
  ``Refit.start`` with the sender's weights written on a side stream, and its control
  (the stream capture switched off must show the race, or the check proves nothing).
- ``relay`` (three torch processes on GPU 0, declaring two hosts): ``relay="on"`` over a
  GPU transport; the trainer sends one copy per host and the receivers forward.
  ``relay-delta``: the same with ``delta=True`` and a second call after 1% changed (the
  sends and the forwards diffed on the device).

Every check writes JSON with ``ok``, ``figure`` (one line) and ``bar`` (what ``ok``
compares), which scripts/gpu_check.sh gathers into summary.json::

    python -m tests.test_gpu_check cases --json OUT.json [--device cpu]
    python -m tests.test_gpu_check ipc-torch --json OUT.json [--device cpu]
    python -m tests.test_gpu_check relay --json OUT.json [--device cpu]
    python -m tests.test_gpu_check relay-delta --json OUT.json [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


def _bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _values(shape, dtype: str, seed: int) -> np.ndarray:
    from xreshard.dtypes import numpy_dtype
    v = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 3
    return v.astype(numpy_dtype(dtype))


def _torch_bits(t: Any) -> np.ndarray:
    """A torch tensor's bits on the host (a sync of that tensor only)."""
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(ints).cpu().numpy().view(
        {1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()])


# ---------------------------------------------------------------------------- cases

@contextlib.contextmanager
def _world(env: Any):
    """One process: world rank 0 is JAX's device, rank 1 torch's (the same GPU)."""
    import xreshard as xr
    with xr.serve() as server:
        world = xr.World.join(server.address, "local",
                              [env.jax_dev, "cuda:0" if env.cuda else "cpu"],
                              num_processes=1, index=0, timeout=60)
        try:
            yield world
        finally:
            world.close()


def _torch_dst(env: Any, shape, dtype: str, pad: int = 32) -> tuple[Any, Any]:
    """A zeroed torch buffer ``pad`` columns wider on each side, and its strided middle."""
    import torch
    buf = torch.zeros((shape[0], shape[1] + 2 * pad), dtype=getattr(torch, dtype),
                      device=env.torch_dev)
    return buf, buf[:, pad:pad + shape[1]]


def _receive(views: dict[str, Any], rank: int = 1) -> Any:
    import xreshard as xr
    from xreshard.adapters.torch import tensor_view
    from xreshard.dtypes import dtype_name
    return xr.Bound({n: xr.Layout.replicated(tuple(v.shape), dtype_name(v.dtype),
                                             xr.Mesh((1,), (rank,))) for n, v in views.items()},
                    {(rank, n): tensor_view(v) for n, v in views.items()})


def verify_case(env: Any) -> dict:
    """Digests of strided bf16 / fp8 device regions equal the host's for the same bytes
    (CuPy has no fp8 kernel: hashed as raw bits), and a refit with ``verify=True`` from
    JAX bf16 + fp8 into strided torch destinations checks every transfer."""
    import jax.numpy as jnp
    import xreshard as xr
    from xreshard.runtime.verify import checksum
    out: dict[str, Any] = {}
    if env.cuda:
        from xreshard.dtypes import as_dtype, bits
        cupy = env.cupy
        same = True
        for dtype in ("bfloat16", "float8_e4m3fn"):
            host = _values((512, 384), dtype, 21)
            dev = as_dtype(cupy.asarray(host.view(_bits(host).dtype)), dtype)
            for region in (dev[:, 40:300], dev[3:500:2, ::3], dev.T):
                flat = cupy.ascontiguousarray(bits(region)).get().view(host.dtype)
                same &= checksum(region) == checksum(flat)
        out["device_digests_equal_host"] = bool(same)
    shapes = {"w16": ((256, 384), "bfloat16"), "w8": ((256, 384), "float8_e4m3fn")}
    values = {n: _values(s, d, 3 + i) for i, (n, (s, d)) in enumerate(shapes.items())}
    params = {n: env.jax.device_put(jnp.asarray(v), env.jax_dev) for n, v in values.items()}
    dsts = {n: _torch_dst(env, s, d) for n, (s, d) in shapes.items()}
    with _world(env) as world:
        refit = xr.Refit(world, send=params, receive=_receive({n: v for n, (_, v) in dsts.items()}),
                         config=xr.RefitConfig(verify=True, timeout=60))
        report = refit()
    out["verified_transfers"] = report.verified
    out["bit_exact"] = all(np.array_equal(_torch_bits(dsts[n][1]), _bits(values[n]))
                           for n in shapes)
    out["verified"] = report.verified >= len(shapes)
    return out


def aliasing_case(env: Any) -> dict:
    """Destinations sharing device memory (rows 16..31 of one torch buffer bound twice), or
    a destination over a source's memory, are refused on every rank before any byte
    moves; the same refit with disjoint rows goes through."""
    import torch
    import xreshard as xr
    from xreshard.adapters.torch import tensor_view
    value = _values((32, 128), "bfloat16", 9)
    params = {"q": env.jax.device_put(value, env.jax_dev),
              "k": env.jax.device_put(value, env.jax_dev)}
    buf = torch.zeros((64, 128), dtype=torch.bfloat16, device=env.torch_dev)
    out: dict[str, Any] = {}
    with _world(env) as world:
        try:
            xr.Refit(world, send=params, receive=_receive({"q": buf[0:32], "k": buf[16:48]}))()
            out["overlapping_destinations_refused"] = False
        except xr.BindingError as e:
            out["overlapping_destinations_refused"] = "share memory" in str(e)
        src = xr.Bound({"w": xr.Layout.replicated((32, 128), "bfloat16", xr.Mesh((1,), (0,)))},
                       {(0, "w"): tensor_view(buf[0:32])})
        try:
            xr.Refit(world, send=src, receive=_receive({"w": buf[16:48]}))()
            out["destination_over_source_refused"] = False
        except xr.BindingError as e:
            out["destination_over_source_refused"] = "alias send bindings" in str(e)
        out["nothing_written"] = not bool(buf.view(torch.int16).any())
        xr.Refit(world, send=params, receive=_receive({"q": buf[0:32], "k": buf[32:64]}))()
    got = _torch_bits(buf)
    out["disjoint_bit_exact"] = bool(np.array_equal(got[:32], _bits(value))
                                     and np.array_equal(got[32:], _bits(value)))
    return out


def donation_case(env: Any) -> dict:
    """The trainer's next step donates the sent arrays. Right after a refit it really
    donates (the refit kept no reference); right after ``Refit.start`` the refit still
    reads them, so JAX must copy instead (the bindings hold external references: the
    DLPack import for bf16, the kept capsule for fp8), or the refit fails with a typed
    error on every rank; never a silent wrong weight."""
    import jax
    import jax.numpy as jnp
    import xreshard as xr
    shapes = {"w16": ((512, 256), "bfloat16"), "w8": ((512, 256), "float8_e4m3fn")}
    values = {n: _values(s, d, 31 + i) for i, (n, (s, d)) in enumerate(shapes.items())}
    step = jax.jit(lambda p: jax.tree_util.tree_map(
        lambda a: (a.astype(jnp.float32) + 1).astype(a.dtype), p), donate_argnums=0)
    params = {n: jax.device_put(jnp.asarray(v), env.jax_dev) for n, v in values.items()}
    dsts = {n: _torch_dst(env, s, d) for n, (s, d) in shapes.items()}
    out: dict[str, Any] = {}
    with _world(env) as world:
        refit = xr.Refit(world, send=params, receive=_receive({n: v for n, (_, v) in dsts.items()}))
        refit()
        v2 = step(params)
        out["donated_after_refit"] = all(x.is_deleted() for x in params.values())
        want = {n: np.asarray(x) for n, x in v2.items()}
        handle = refit.start(send=v2)
        v3 = step(v2)                   # donates while the started refit reads
        try:
            handle.wait(120)
            out["start_outcome"] = "bit-exact" if all(
                np.array_equal(_torch_bits(dsts[n][1]), _bits(want[n])) for n in shapes) \
                else "WRONG BYTES"
        except Exception as e:          # noqa: BLE001 - judged below
            out["start_outcome"] = _donation_outcome(e)
        out["copied_not_donated_during_start"] = not any(x.is_deleted() for x in v2.values())
        # the bf16 binding is a DLPack import: JAX must copy, not donate, under it
        out["bf16_copied_not_donated_during_start"] = not v2["w16"].is_deleted()
        jax.block_until_ready(v3)
    out["no_silent_wrong_weight"] = out["start_outcome"] != "WRONG BYTES"
    # only two outcomes are right: bit-exact, or the typed refusal of an array donated
    # before the started refit bound it; any other error is a first-contact bug, not safety
    out["expected_outcome"] = out["start_outcome"] == "bit-exact" or \
        out["start_outcome"].startswith("refused (donated): ")
    return out


def _donation_outcome(e: BaseException) -> str:
    """How a started refit whose sources a step donated ended: ``"refused (donated): ..."``
    for an ``XreshardError`` that says the array was deleted or donated, else
    ``"unexpected: ..."``."""
    import xreshard as xr
    text = f"{type(e).__name__}: {str(e)[:200]}"
    said = any(w in str(e).lower() for w in ("deleted", "donat"))
    if isinstance(e, xr.XreshardError) and said:
        return f"refused (donated): {text}"
    return f"unexpected: {text}"


CASES: dict[str, Callable[[Any], dict]] = {
    "verify_bf16_fp8_strided": verify_case,
    "aliasing_refused_on_device": aliasing_case,
    "donation_after_refit_and_start": donation_case,
}

#: per case: the fields whose truth is its bar (others are reported)
BARS = {"verify_bf16_fp8_strided": ("bit_exact", "verified", "device_digests_equal_host"),
        "aliasing_refused_on_device": ("overlapping_destinations_refused",
                                       "destination_over_source_refused", "nothing_written",
                                       "disjoint_bit_exact"),
        "donation_after_refit_and_start": ("donated_after_refit", "no_silent_wrong_weight",
                                           "expected_outcome",
                                           "bf16_copied_not_donated_during_start")}


def run_cases(device: str, on_update: Callable[[dict], None] = lambda r: None) -> dict:
    from .test_gpu_refit import Env
    report: dict[str, Any] = {"device": device, "cases": {}}
    try:
        env = Env(device)
    except Exception as e:      # noqa: BLE001 - reported
        report.update(ok=False, error=f"{type(e).__name__}: {e}")
        return report
    for name, case in CASES.items():
        t0 = time.perf_counter()
        try:
            got = case(env)
            got["ok"] = all(bool(got[k]) for k in BARS[name] if k in got)
        except Exception as e:  # noqa: BLE001 - reported, the next case runs
            got = {"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-3000:]}
        got["seconds"] = round(time.perf_counter() - t0, 2)
        report["cases"][name] = got
        on_update(report)
    report["ok"] = all(c["ok"] for c in report["cases"].values())
    passed = sum(c["ok"] for c in report["cases"].values())
    report["figure"] = f"{passed}/{len(CASES)} cases pass"
    report["bar"] = ("every case: " + "; ".join(f"{n}: {' and '.join(b)}"
                                                 for n, b in BARS.items()))
    return report


# ---------------------------------------------------------------------------- ipc-torch

def ipc_torch(ctx: Any, device: str) -> dict:
    """Two torch processes on GPU 0 (see the module): staging, expandable segments, then
    ``Refit.start`` on a side stream and its control."""
    import torch
    import xreshard as xr
    from xreshard.runtime import handle as handle_mod
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    world = ctx.join(devices=["cuda:0"] if cuda else 1, groups=["trainer", "rollout"],
                     timeout=90)
    rows, cols = 2048, 2048
    config = xr.RefitConfig(timeout=60, verify=True)
    out: dict[str, Any] = {}
    versions = [_values((rows, cols), "bfloat16", 40 + k) for k in range(4)]

    def on_dev(v: np.ndarray) -> Any:
        return torch.from_numpy(v.view(np.int16)).to(dev).view(torch.bfloat16)
    if ctx.role.group == "trainer":
        a = on_dev(versions[0])
        wide = torch.zeros((rows, cols + 512), dtype=torch.bfloat16, device=dev)
        wide[:, 256:256 + cols] = on_dev(versions[0])
        state = {"a": a, "b": wide[:, 256:256 + cols]}        # b: a strided source
        refit = xr.Refit(world, send=state, config=config)
        refit()
        ipc = getattr(world.transport("auto"), "parts", {}).get("cuda_ipc")
        out["staged_sends"] = getattr(ipc, "num_staged", None)
        # the control may read half-written weights: checksums would fail it, so it runs
        # in a second Refit without verify
        plain = xr.Refit(world, send=state, config=xr.RefitConfig(timeout=60))
        for k, capture in ((1, True), (2, False)):
            side = torch.cuda.Stream() if cuda else None
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                if cuda:
                    torch.cuda._sleep(200_000_000)            # ~100 ms of GPU time first
                a.copy_(on_dev(versions[k]))
                state["b"].copy_(on_dev(versions[k]))
                real = handle_mod.caller_streams
                if not capture:
                    handle_mod.caller_streams = lambda: (lambda: contextlib.nullcontext())
                try:
                    h = (refit if capture else plain).start(send=state)
                finally:
                    handle_mod.caller_streams = real
            h.wait(120)
            if cuda:
                torch.cuda.synchronize()
    else:
        bufs = {"a": torch.zeros((rows, cols + 64), dtype=torch.bfloat16, device=dev),
                "b": torch.zeros((rows, cols), dtype=torch.bfloat16, device=dev)}
        dst = {"a": bufs["a"][:, 32:32 + cols], "b": bufs["b"]}   # a: a strided destination
        refit = xr.Refit(world, receive=dst, config=config)
        report = refit()
        plain = xr.Refit(world, receive=dst, config=xr.RefitConfig(timeout=60))
        out["verified"] = report.verified
        out["exact_first"] = all(np.array_equal(_torch_bits(dst[n]), _bits(versions[0]))
                                 for n in dst)
        for k, key in ((1, "exact_started_on_side_stream"), (2, "control_exact_without_capture")):
            (refit if k == 1 else plain)()
            out[key] = all(np.array_equal(_torch_bits(dst[n]), _bits(versions[k]))
                           for n in dst)
    out["route"] = world.transport("auto").name
    world.close()
    return out


def run_ipc_torch(device: str, timeout: float) -> dict:
    from xreshard.tools.launch import Role, launch
    gpus = (0,) if device == "cuda" else None
    sender_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    roles = [Role("torch", "trainer", 0, gpus=gpus, env=sender_env),
             Role("torch", "rollout", 0, gpus=gpus)]
    results = launch("tests.test_gpu_check:ipc_torch", roles, args=(device,), timeout=timeout,
                     check=False, env={"XRESHARD_SHM": "1"})
    report: dict[str, Any] = {"device": device}
    for r in results:
        report[r.role.group] = r.value if r.ok else {"error": (r.traceback or r.output)[-3000:]}
    t, e = report.get("trainer", {}), report.get("rollout", {})
    report["ok"] = bool(e.get("exact_first") and e.get("verified") and
                        e.get("exact_started_on_side_stream") and
                        (device != "cuda" or ("cuda_ipc" in e.get("route", "") and
                                              (t.get("staged_sends") or 0) > 0 and
                                              not e.get("control_exact_without_capture"))))
    report["figure"] = (f"route {e.get('route')}, staged sends {t.get('staged_sends')}, "
                        f"verified {e.get('verified')}, side-stream start exact "
                        f"{e.get('exact_started_on_side_stream')}, control exact "
                        f"{e.get('control_exact_without_capture')}")
    report["bar"] = ("bit-exact and verified through staging on both ends; sends from "
                     "expandable segments staged (> 0); a Refit.start on a side stream "
                     "bit-exact, while its control (stream capture off) reads stale bytes")
    return report


# ---------------------------------------------------------------------------- relay

RELAY_TENSORS = {"w": (1024, 1024), "b": (4096,), "e": (8, 256, 512)}


def relay_gpu(ctx: Any, device: str, delta: bool = False) -> dict:
    """A torch trainer on host "t", two torch receivers on host "a", all on GPU 0:
    ``relay="on"`` sends one copy to host "a", forwarded there over the GPU transport.
    ``delta``: ``RefitConfig(delta=True)`` and a second call after 1% of every tensor's
    elements changed: the trainer's sends and the forwards go as deltas, diffed on the
    device (the forwarder from the bytes that landed there)."""
    import torch
    import xreshard as xr
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    host = "t" if ctx.role.group == "trainer" else "a"
    world = ctx.join(devices=["cuda:0"] if cuda else 1, host=host,
                     groups=["trainer", "rollout"], timeout=90)
    steps = [{n: _values(s, "bfloat16", 60 + i) for i, (n, s) in enumerate(RELAY_TENSORS.items())}]
    if delta:
        steps.append({n: _changed(v, 0.01, 70 + i) for i, (n, v) in enumerate(steps[0].items())})
    config = xr.RefitConfig(timeout=60, relay="on", verify=True, delta=delta)
    trainer = ctx.role.group == "trainer"
    state = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in RELAY_TENSORS.items()}
    refit = xr.Refit(world, **({"send": state} if trainer else {"receive": state}), config=config)
    calls = []
    for values in steps:
        if trainer:
            for n, v in values.items():
                state[n].copy_(torch.from_numpy(v.view(np.int16)).view(torch.bfloat16))
        r = refit()
        out = {"sent": r.bytes_sent, "forwarded": r.bytes_forwarded,
               "by_transport": r.bytes_by_transport,
               "delta_pairs": (r.delta or {}).get("pairs", 0)}
        if not trainer:
            out.update(received=r.bytes_received, verified=r.verified,
                       exact=all(np.array_equal(_torch_bits(state[n]), _bits(v))
                                 for n, v in values.items()))
        calls.append(out)
    world.close()
    from xreshard.runtime.device_ops import COUNTS
    return {"calls": calls, "device_ops": dict(COUNTS)}


def _changed(v: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """``v`` with ``fraction`` of its elements' lowest bit flipped."""
    out = v.copy()
    bits = _bits(out).reshape(-1)
    bits[np.random.default_rng(seed).choice(bits.size, int(bits.size * fraction),
                                            replace=False)] ^= 1
    return out


def run_relay(device: str, timeout: float, delta: bool = False,
              env: dict | None = None) -> dict:
    """``env``: for the CPU dry run of ``delta``, ``XRESHARD_TEST_DEVICE_OPS`` runs the
    device path's code on host memory."""
    from xreshard.tools.launch import Role, launch
    gpus = (0,) if device == "cuda" else None
    roles = [Role("torch", "trainer", 0, gpus=gpus)] + [
        Role("torch", "rollout", i, gpus=gpus) for i in range(2)]
    results = launch("tests.test_gpu_check:relay_gpu", roles, args=(device, delta),
                     timeout=timeout, check=False, env=env)
    vals = [r.value if r.ok else {"error": (r.traceback or r.output)[-3000:]} for r in results]
    model = sum(int(np.prod(s)) * 2 for s in RELAY_TENSORS.values())
    calls = [v.get("calls") or [{}] * (1 + delta) for v in vals]
    trainer, receivers = calls[0], calls[1:]
    forwarded = [sum(c[k].get("forwarded", 0) for c in receivers) for k in range(1 + delta)]
    kinds = sorted({k for c in calls for call in c for k in (call.get("by_transport") or {})})
    report = {"device": device, "processes": vals, "model_bytes": model, "kinds": kinds}
    ok = bool(trainer[0].get("sent") == model and forwarded[0] == model
              and all(c[k].get("exact") and c[k].get("verified") for c in receivers
                      for k in range(1 + delta))
              and (device != "cuda" or kinds == ["cuda_ipc"]))
    report["figure"] = (f"trainer sent {trainer[0].get('sent')} B, receivers forwarded "
                        f"{forwarded[0]} B of a {model} B model, over {kinds}")
    report["bar"] = ("the trainer sends the model once to host 'a' (sent == model bytes), "
                     "its receivers forward one copy (forwarded == model bytes) over "
                     "cuda_ipc only, bit-exact and verified")
    if delta:
        ok = ok and bool(trainer[1].get("delta_pairs") and 0 < trainer[1].get("sent", 0)
                         < 0.1 * model and 0 < forwarded[1] < 0.1 * model
                         and all(c[1].get("delta_pairs") for c in receivers))
        # the forwarders' second call diffs on the device (the CPU dry run: the device
        # path's code, XRESHARD_TEST_DEVICE_OPS)
        ok = ok and all((v.get("device_ops") or {}).get("encode/torch", 0) > 0 for v in vals)
        report["figure"] += (f"; 1% changed, delta=True: sent {trainer[1].get('sent')} B, "
                             f"forwarded {forwarded[1]} B")
        report["bar"] += ("; then with delta=True after 1% of the elements changed, the "
                          "trainer's sends and the forwards go as deltas (< 0.1x the model "
                          "bytes each), bit-exact and verified")
    report["ok"] = ok
    return report


# ---------------------------------------------------------------------------- pytest

@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_issue_18_cases_on_one_gpu():
    report = run_cases("cuda")
    assert report["ok"], json.dumps(report, indent=1, default=str)[-6000:]


def test_issue_18_cases_dry_run_on_cpu():
    """The in-process cases' logic on CPU (JAX donation honours external references on
    CPU too, so the donation case is real here)."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    report = run_cases("cpu")
    assert report["ok"], json.dumps(report, indent=1, default=str)[-6000:]
    assert report["cases"]["donation_after_refit_and_start"]["donated_after_refit"]


@pytest.mark.slow
def test_the_donation_bar_takes_only_the_expected_refusal():
    """Issue 33: the started refit whose sources were donated passes bit-exact or with the
    typed refusal naming the donation; an unrelated error (a first-contact bug) fails."""
    import xreshard as xr
    assert _donation_outcome(xr.RefitError("'w16' was deleted (donated) before the refit "
                                           "bound it")).startswith("refused (donated): ")
    for e in (xr.CommunicationError("peer went away"), RuntimeError("Array has been deleted"),
              xr.RefitError("cannot run the copy kernels")):
        assert _donation_outcome(e).startswith("unexpected: "), e


def test_ipc_torch_and_relay_dry_run_on_cpu():
    """The multi-process checks' logic on CPU (shared memory instead of cuda_ipc)."""
    pytest.importorskip("torch")
    for report in (run_ipc_torch("cpu", 240), run_relay("cpu", 240)):
        assert report["ok"], json.dumps(report, indent=1, default=str)[-6000:]


@pytest.mark.slow
def test_relay_delta_through_the_device_path_between_processes():
    """``relay-delta``'s logic on CPU through the device path's code
    (``XRESHARD_TEST_DEVICE_OPS=torch``): three torch processes, the second call's sends
    and forwards diffed by the device ops, every receiver bit-exact and verified."""
    pytest.importorskip("torch")
    report = run_relay("cpu", 240, delta=True, env={"XRESHARD_TEST_DEVICE_OPS": "torch"})
    assert report["ok"], json.dumps(report, indent=1, default=str)[-6000:]


# ---------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="issue 18's parts of scripts/gpu_check.sh")
    ap.add_argument("what", choices=["cases", "ipc-torch", "relay", "relay-delta"])
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args(argv)

    def save(report: dict) -> None:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    try:
        if args.what == "cases":
            report = run_cases(args.device, on_update=save)
        elif args.what == "ipc-torch":
            report = run_ipc_torch(args.device, args.timeout)
        else:
            report = run_relay(args.device, args.timeout, delta=args.what == "relay-delta")
    except Exception as e:      # noqa: BLE001 - reported in the JSON
        report = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    save(report)
    print(json.dumps({k: report.get(k) for k in ("ok", "figure", "error")}))
    for name, case in report.get("cases", {}).items():
        print(f"  {name}: {'ok' if case['ok'] else 'FAILED'} "
              f"{ {k: v for k, v in case.items() if k != 'traceback'} }")
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    if "--device" in sys.argv and "cpu" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
