"""Probes of issue 33's findings (shared/reference/gpu_review.md) for scripts/gpu_check.sh,
each the smallest real run of the rule the fix relies on:

* ``shrink`` (A1): three processes on GPU 0 form one NCCL communicator (a distinct
  ``NCCL_HOSTID`` each before NCCL 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1`` from it); the third
  leaves, the other two shrink it away with ``NCCL_SHRINK_ABORT`` (inside CuPy's group: the
  new communicator exists only after the outer ``groupEnd``), then rank 0 sends 1 MiB to
  rank 1 over the shrunk communicator, bit-exact.
* ``stage`` (A3): ``atomic`` staging of float8 (codes, e8m0 scales) and bf16 CUDA bindings:
  allocated and copied as unsigned-int bits, bit-exact after the commit.
* ``split-blocks`` (B2): FP8 destinations on the GPU whose blocks straddle the senders
  (several block groups per scratch), quantized after the rounds from scratch the
  executor's own stream wrote; codes and scales equal the host quantizer's.

The B1 probe (a slow producer) is ``python -m tests.test_gpu_device_path slow-producer``.
``--device cpu`` runs ``stage`` and ``split-blocks`` on host memory (the CPU tests below),
so the scripts are exercised everywhere::

    python -m tests.test_gpu_probes shrink --json OUT.json [--timeout 20]
    python -m tests.test_gpu_probes stage --json OUT.json [--device cpu]
    python -m tests.test_gpu_probes split-blocks --json OUT.json [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHRINK_BYTES = 1 << 20


# ---------------------------------------------------------------------------- A1

def shrink_child(rank: int, port: int, timeout: float) -> dict:
    """One of the three processes of ``shrink``: joins the communicator; rank 2 then
    leaves; ranks 0 and 1 shrink it away (abort) and move bytes over the shrunk one."""
    import datetime

    import cupy
    import torch.distributed as dist

    from xreshard.runtime.comm_epochs import decide
    from xreshard.transport import nccl_epochs
    from xreshard.transport.nccl import NcclTransport
    out: dict[str, Any] = {"rank": rank, "NCCL_HOSTID": os.environ.get("NCCL_HOSTID")}
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    t = NcclTransport(store, 3, {rank: 0}, key="probe/0", timeout=timeout)
    library = nccl_epochs.loaded_library()      # the NCCL CuPy loaded (torch's)
    out["abilities"] = str(library.abilities()) if library is not None else None
    store.set(f"probe/joined/{rank}", "1")
    if rank == 2:       # leaves once all three joined (a member that died)
        store.wait([f"probe/joined/{r}" for r in range(3)])
        out["ok"] = True
        out["left"] = True
        return out
    store.wait([f"probe/joined/{r}" for r in range(3)])
    abilities = library.abilities() if library is not None else None
    step = decide("nccl", ("a", "b", "c"), ("a", "b"), ("a", "b"), abilities)
    out["step"] = [step.action, list(step.excluded), step.abort]
    t0 = time.perf_counter()
    shrunk = t.shrunk(step.excluded, step.abort, "probe/1", timeout=timeout)
    out["shrink_seconds"] = round(time.perf_counter() - t0, 3)
    with cupy.cuda.Device(0):
        sent = (cupy.arange(SHRINK_BYTES, dtype=cupy.uint32) * 2654435761 >> 11).astype(
            cupy.uint8)
        got = cupy.zeros(SHRINK_BYTES, dtype=cupy.uint8)
        with shrunk.group(timeout=timeout):
            if rank == 0:
                shrunk.send(sent, 0, 1, tag=0)
            else:
                shrunk.recv(got, 0, 1, tag=0)
        out["exact"] = rank == 0 or bytes(got.get()) == bytes(sent.get())
    out["world_size"] = shrunk.world_size
    out["ok"] = bool(out["exact"]) and shrunk.world_size == 2 and step.action == "shrink"
    shrunk.close()
    return out


def shrink(timeout: float, logs: Path) -> dict:
    """Run the three ``shrink`` children; the report (``ok``, ``figure``, ``bar``)."""
    import datetime

    import torch.distributed as dist

    from .test_gpu_refit import _collect, _nccl_version, children_env
    version = _nccl_version()
    attempt = "multirank" if version >= 23000 else "hostid"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout + 30))
    env_common = children_env("cuda", attempt)
    procs, paths = {}, {}
    t0 = time.perf_counter()
    for rank in range(3):
        env = dict(env_common)
        if attempt == "hostid":
            env["NCCL_HOSTID"] = f"xreshard-probe-shrink-{rank}"
        paths[rank] = (logs / f"shrink_{rank}.stdout.log", logs / f"shrink_{rank}.log")
        with paths[rank][0].open("w") as o, paths[rank][1].open("w") as e:
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "tests.test_gpu_probes", "shrink-child", "--rank",
                 str(rank), "--port", str(store.port), "--timeout", str(timeout)],
                cwd=REPO, env=env, stdout=o, stderr=e, text=True)
    results = _collect(procs, paths, deadline=time.monotonic() + timeout + 20)
    ok = all(r.get("ok") and r["returncode"] == 0 for r in results.values())
    kept = [results.get(r, {}) for r in (0, 1)]
    errors = sorted({e for r in results.values() for e in r.get("nccl_errors", [])
                     + ([r["error"]] if r.get("error") else [])})
    return {"ok": ok, "attempt": attempt, "nccl_version": version,
            "seconds": round(time.perf_counter() - t0, 1), "processes": results,
            "errors": errors[:20],
            "figure": (f"{attempt}, NCCL {version}: step {kept[0].get('step')}, shrink "
                       f"{kept[0].get('shrink_seconds')} s, 1 MiB 0 -> 1 over the shrunk "
                       f"communicator bit-exact {bool(kept[1].get('exact'))}, "
                       f"{len(errors)} error line(s)"),
            "bar": "3 processes on GPU 0; rank 2 leaves, ranks 0 and 1 ncclCommShrink it away "
                   "(abort) and move 1 MiB bit-exact over the shrunk communicator"}


# ---------------------------------------------------------------------------- A3

def stage(device: str) -> dict:
    """``Staging`` of float8 codes, e8m0 scales and bf16 bindings on ``device``: the
    shadows hold the destinations' bytes, the commit copies the new ones, bit-exact."""
    import ml_dtypes

    from xreshard.runtime.atomic import Staging
    from xreshard.runtime.binding import Bound
    rng = np.random.default_rng(11)
    kinds = {"codes": ml_dtypes.float8_e4m3fn, "scales": ml_dtypes.float8_e8m0fnu,
             "bf16": ml_dtypes.bfloat16}
    sizes = {"codes": (256, 384), "scales": (2, 3), "bf16": (64, 96)}
    old = {k: rng.integers(0, 1 << 16, sizes[k], dtype=np.uint64).astype(
        np.dtype(f"u{np.dtype(dt).itemsize}")) for k, dt in kinds.items()}
    new = {k: rng.integers(0, 1 << 16, sizes[k], dtype=np.uint64).astype(v.dtype)
           for k, v in old.items()}

    def put(bits: np.ndarray, dt: Any) -> Any:
        if device == "cpu":
            return bits.copy().view(dt)
        import cupy
        with cupy.cuda.Device(0):
            return cupy.asarray(bits).view(dt)

    def host(a: Any, like: np.ndarray) -> bytes:
        a = a if isinstance(a, np.ndarray) else a.view(like.dtype).get()
        return np.ascontiguousarray(a).view(like.dtype).tobytes()
    real = {k: put(old[k], dt) for k, dt in kinds.items()}
    bound = Bound({}, {(0, k): v for k, v in real.items()})
    staging = Staging()
    staged = staging.stage(bound)
    refreshed = all(host(staged.bindings[(0, k)], old[k]) == old[k].tobytes() for k in kinds)
    for k, dt in kinds.items():
        s = staged.bindings[(0, k)]
        s.view(old[k].dtype)[...] = put(new[k], old[k].dtype)
    untouched = all(host(real[k], old[k]) == old[k].tobytes() for k in kinds)
    staging.commit()
    committed = all(host(real[k], new[k]) == new[k].tobytes() for k in kinds)
    ok = refreshed and untouched and committed
    return {"ok": ok, "refreshed": refreshed, "untouched_before_commit": untouched,
            "committed": committed, "staging_bytes": staging.nbytes,
            "figure": (f"float8 codes, e8m0 scales, bf16 staged on {device}: shadows hold "
                       f"the old bytes {refreshed}, destinations untouched before the "
                       f"commit {untouched}, new bytes after it {committed}"),
            "bar": "atomic staging of float8 and bf16 device bindings is bit-exact"}


# ---------------------------------------------------------------------------- B2

def split_blocks(device: str) -> dict:
    """tests/test_fp8_refit.py's case (blocks whole in one sender, split across senders,
    experts whose every block is split, MXFP8 groups cut) into destinations on
    ``device``: codes and scales equal the host quantizer's."""
    from .test_fp8_refit import _case, _expected, _garbage, _values
    from xreshard.config import Tuning
    from xreshard.tools.testing import local_arrays_from_global
    from xreshard.planner.prepare import CallOptions, prepare
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.local import LocalTransport
    src, dst, quantized = _case()
    values = {n: _values(lay.shape, i) for i, (n, lay) in enumerate(src.items())}
    src_b = {(r, n): local_arrays_from_global(lay, r, values[n]) for n, lay in src.items()
             for r in lay.ranks}

    def on(a: np.ndarray) -> Any:
        if device == "cpu":
            return a
        import cupy
        bits = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        with cupy.cuda.Device(0):
            return cupy.asarray(bits).view(a.dtype)
    dst_b = {(r, n): on(_garbage(lay.local_shape(r), lay.dtype))
             for n, lay in dst.items() for r in lay.ranks}
    options = CallOptions(bucket_bytes=4096, staging_bytes=1 << 16, halved=False)
    prepared = prepare(src, dst, None, options, ranks=range(5), quantized=quantized)
    t0 = time.perf_counter()
    run(prepared, stage_bindings(prepared, src_b, dst_b), LocalTransport(), timeout=60,
        programs={}, tuning=Tuning(executor="rounds"))
    seconds = time.perf_counter() - t0
    want = _expected(values, quantized)
    wrong = []
    for (r, name), arr in dst_b.items():
        region = dst[name].regions(r)[0]
        got = arr if isinstance(arr, np.ndarray) else \
            arr.view(np.dtype(f"u{arr.dtype.itemsize}")).get()
        if np.ascontiguousarray(got).view(np.uint8).tobytes() != \
                want[name][region.slices()].view(np.uint8).tobytes():
            wrong.append(f"{name}@{r}")
    groups = {f"{r}/{n}": len(s) for (r, n), s in prepared.formats.quant.scratch.items()}
    return {"ok": not wrong, "wrong": wrong, "scratch_groups": groups,
            "seconds": round(seconds, 3),
            "figure": (f"split-block FP8 on {device}: {len(dst_b)} destinations, scratch "
                       f"groups {groups}, wrong {wrong or 'none'}"),
            "bar": "codes and scales of split blocks (several block groups per scratch) "
                   "equal the host quantizer's"}


# ---------------------------------------------------------------------------- CPU tests

def test_stage_probe_on_host_memory():
    assert stage("cpu")["ok"]


def test_split_blocks_probe_on_host_memory():
    report = split_blocks("cpu")
    assert report["ok"], report
    assert max(report["scratch_groups"].values()) >= 2      # several block groups at once


def test_probe_commands_write_their_reports(tmp_path):
    out = tmp_path / "stage.json"
    assert main(["stage", "--device", "cpu", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ok"] is True


# ---------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="issue 33's probes of scripts/gpu_check.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("shrink", "stage", "split-blocks"):
        p = sub.add_parser(name)
        p.add_argument("--json", required=True)
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        p.add_argument("--timeout", type=float, default=20.0)
        p.add_argument("--logs")
    c = sub.add_parser("shrink-child")
    c.add_argument("--rank", type=int, required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args(argv)
    if args.cmd == "shrink-child":
        try:
            out = shrink_child(args.rank, args.port, args.timeout)
        except BaseException as e:      # report, then exit without waiting for NCCL threads
            out = {"rank": args.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(out, default=str), flush=True)
        sys.stderr.flush()
        os._exit(0 if out.get("ok") else 1)
    try:
        if args.cmd == "shrink":
            logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="probe-"))
            logs.mkdir(parents=True, exist_ok=True)
            report = shrink(args.timeout, logs)
        elif args.cmd == "stage":
            report = stage(args.device)
        else:
            report = split_blocks(args.device)
    except Exception as e:      # noqa: BLE001 - the report says what failed
        report = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report.get(k) for k in ("ok", "figure", "error")}, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
