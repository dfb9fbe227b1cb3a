"""The device paths of delta and FP8 refits (xreshard/runtime/delta_device.py,
quantize_device.py, device_ops.py) without a GPU: the same code a GPU runs, on host
bindings (``XRESHARD_TEST_DEVICE_OPS``: numpy arrays stand in for CuPy ones, the ops run on
the framework's CPU device), checked bit for bit against the host path: the kernels' bytes
here, and real processes (a JAX trainer on a (2, 2) CPU mesh, torch DTensor receivers over
gloo) in the slow tests. The CUDA runs are tests/test_gpu_device_path.py."""

from __future__ import annotations

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from . import device_path_cases as cases
from . import test_fp8_refit_procs as fp8


def _changed(rng, old: np.ndarray, fraction: float) -> np.ndarray:
    new = old.copy()
    k = int(fraction * old.size)
    new[rng.choice(old.size, k, replace=False)] ^= 1
    return new


def _kernels_match_host(kind: str) -> None:
    import ml_dtypes
    from xreshard.delta.host import encode_numpy
    from xreshard.quant import BlockFP8, MXFP8, host
    from xreshard.runtime.device_ops import DeviceOps

    rng = np.random.default_rng(0)
    ops = DeviceOps(kind)
    seen = set()
    for unit, dt in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        for fraction in (0.0, 0.001, 0.01, 0.3, 1.0):
            old = rng.integers(0, 1 << 31, 4000, dtype=np.uint64).astype(dt)
            new = _changed(rng, old, fraction)
            header, message = ops.encode(old.view(np.uint8), new.view(np.uint8), unit)
            want = encode_numpy(old, new)
            assert header == want.header, (unit, fraction)
            seen.add(want.kind)
            if want.kind == "dense":
                assert message is None
                continue
            assert message.tobytes() == want.to_bytes().tobytes(), (unit, fraction)
            target = old.copy()
            ops.apply(message, target.view(np.uint8), unit)
            assert target.tobytes() == new.tobytes(), (unit, fraction)
    assert seen == {"dense", "bitmask", "runs"}       # every encoding was compared
    x = (rng.standard_normal((256, 288)).astype(np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    x[0, :5] = [0, np.inf, -np.inf, np.nan, 1e-40]
    for fmt, fn in ((BlockFP8(), host.quantize_block_fp8), (MXFP8(), host.quantize_mxfp8)):
        codes, scales = ops.quantize(x, "bfloat16", fmt, "w")
        want_codes, want_scales = fn(x, fmt, name="w")
        assert codes.shape == want_codes.shape and scales.shape == want_scales.shape
        assert codes.tobytes() == want_codes.tobytes(), fmt
        assert scales.tobytes() == want_scales.tobytes(), fmt


def test_torch_device_ops_give_the_host_kernels_bytes():
    """Encode, apply and both FP8 quantizers in torch ops over the executor's arrays:
    the numpy kernels' messages and vLLM-matched codes and scales, byte for byte."""
    pytest.importorskip("torch")
    _kernels_match_host("torch")


@pytest.mark.slow
def test_jax_device_ops_give_the_host_kernels_bytes():
    """The same with jitted JAX (compiles per shape: slow on a loaded CPU)."""
    _kernels_match_host("jax")


def test_switch_and_refusals(monkeypatch):
    from xreshard.config import Tuning
    from xreshard.errors import RefitError
    from xreshard.runtime import device_ops
    from xreshard.runtime.delta_device import device_path
    from xreshard.runtime.delta_wire import delta_problems
    import xreshard as xr

    host = {(0, "w"): np.zeros(4)}
    assert not device_path(host)
    assert device_path(host, tuning=Tuning(host_device_ops="torch"))
    with pytest.raises(RefitError, match="XRESHARD_TEST_DEVICE_OPS='cupy'"):
        Tuning.from_env({device_ops.ENV: "cupy"})
    with pytest.raises(RefitError, match="delta_baseline must be 'host' or 'device'"):
        Tuning(delta_baseline="gpu")
    assert Tuning.from_env({"XRESHARD_DELTA_BASELINE": "device"}).delta_baseline == "device"
    # device bindings are no longer refused when a framework can run the ops
    config = xr.RefitConfig(delta=True)
    assert delta_problems(config, True, tuning=Tuning()) == []
    # FP8 destinations and a relay compose with them now (tests/test_relay_compose.py)
    relay = xr.RefitConfig(delta=True, relay="on", atomic=True)
    assert delta_problems(relay, True, tuning=Tuning()) == []
    assert delta_problems(relay, False, tuning=Tuning()) == []      # host bindings
    # ... and are, naming it, when none can
    monkeypatch.setattr(device_ops, "_available", lambda kind: False)
    found = delta_problems(config, True, tuning=Tuning(), sides=(True, False))
    assert len(found) == 1 and "neither is installed" in found[0][1]
    assert "diff or quantize what it sends" in found[0][1]
    # FP8 on the way: the same refusal, naming the tensors
    from types import SimpleNamespace
    from xreshard.runtime import quantized
    quant = SimpleNamespace(tensors={"layers.0.w": None})
    with pytest.raises(RefitError, match=r"quantized on the way \(layers.0.w\).*neither is "
                       r"installed.*nothing was moved"):
        quantized.refuse_devices(quant, sends=False, receives=True)
    monkeypatch.undo()
    quantized.refuse_devices(quant)         # torch and JAX are here: nothing to refuse


ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
         Role("torch", "rollout", 1)]


@pytest.fixture(scope="module")
def host_steady() -> list:
    """The host path's run of the "steady" scenario, which both device path runs compare
    with (one launch for both)."""
    return launch([cases.delta_trainer, cases.delta_rollout, cases.delta_rollout], ROLES,
                  args=("steady", False), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kind,baseline", [("torch", "host"), ("jax", "device")])
def test_delta_device_path_between_processes(kind, baseline, host_steady):
    """JAX trainer -> two torch receivers, four calls (the first dense, then deltas with
    verify=True): every receiver bit-exact after every call, the trainer's diffs and the
    receivers' applies ran by the device path's ops, and the bytes on the wire are what the
    host path sends for the same steps (the messages are the host kernels' bytes)."""
    env = {"XRESHARD_TEST_DEVICE_OPS": kind, "XRESHARD_DELTA_BASELINE": baseline}
    results = launch([cases.delta_trainer, cases.delta_rollout, cases.delta_rollout], ROLES,
                     args=("steady", False), timeout=600, env=env)
    host = host_steady
    rows, host_rows = results[0].value["rows"], host[0].value["rows"]
    assert [r.get("version") for r in rows] == [1, 2, 3, 4], rows
    for row, want in zip(rows, host_rows):
        assert row["sent"] == want["sent"] and row["delta"]["bytes_wire"] == \
            want["delta"]["bytes_wire"]
        assert row["verified"] > 0
    for d in (r["delta"] for r in rows[1:]):
        assert d["pairs"] == 6 and d["num_delta"] > 0 and d["encode_threads"] == 1
        assert d["baseline_device_bytes"] == 0     # "device memory" is host memory here
    counts = results[0].value["counts"]
    assert counts.get(f"encode/{kind}", 0) >= 18      # 6 pairs x 3 delta calls
    # baselines on the "device" advance by the device apply, host ones by numpy's
    assert (counts.get(f"apply/{kind}", 0) > 0) == (baseline == "device")
    assert host[0].value["counts"] == {}               # the host path ran no device ops
    for r in results[1:]:
        assert all("wrong" not in row and "error" not in row for row in r.value["rows"])
        assert r.value["checked"] > 0
        assert r.value["counts"].get(f"apply/{kind}", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_fp8_device_path_between_processes(kind):
    """JAX trainer -> torch receivers storing block FP8 and MXFP8, through the device
    path's quantizers (the trainer's whole blocks, the receivers' split blocks): every
    receiver's codes and scales are vLLM's own quantizer's bytes, as on the host path."""
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(fp8.ROLLOUT)]
    results = launch([cases.fp8_trainer, cases.fp8_rollout, cases.fp8_rollout], roles,
                     args=(None,), timeout=600, env={"XRESHARD_TEST_DEVICE_OPS": kind})
    t = results[0].value
    assert "error" not in t, t
    assert t["counts"].get(f"quantize/{kind}", 0) > 0
    assert all(r["fp8_sent"] > 0 for r in t["reports"])
    for v in (1, 2):
        want = fp8._vllm_bytes(v)
        for res in results[1:]:
            me = res.value
            assert "error" not in me, me
            assert me["counts"].get(f"quantize/{kind}", 0) > 0     # split blocks
            index = roles.index(res.role) - 1
            for name, (shape, _, _) in fp8.TENSORS.items():
                codes, scales = want[name]
                dim = len(shape) - 2
                rows = slice(index * shape[dim] // fp8.ROLLOUT,
                             (index + 1) * shape[dim] // fp8.ROLLOUT)
                srows = slice(index * scales.shape[dim] // fp8.ROLLOUT,
                              (index + 1) * scales.shape[dim] // fp8.ROLLOUT)
                sl = (slice(None),) * dim
                got = me["got"][v - 1][name]
                assert got[0] == codes[sl + (rows,)].tobytes().hex(), (v, name, index)
                assert got[1] == scales[sl + (srows,)].tobytes().hex(), (v, name, index)


@pytest.mark.slow
@pytest.mark.parametrize("atomic", [False, True])
def test_fp8_delta_device_path_between_processes(atomic):
    """Delta refit to FP8 destinations through the device path (torch ops; the trainer's
    baselines "on the device"): A, B (1% changed), B (unchanged), A (1%), C (all
    changed), D, C (1%), verify=True. The trainer quantizes its whole blocks with the
    device quantizer and diffs scales and codes as bytes; the receivers apply the deltas
    to their codes and scales and to the split blocks' bf16 pieces, then quantize those.
    With RefitConfig(atomic=True) too (``atomic``: deltas into the receivers' staging).
    After every call each receiver holds the host quantizer's codes and scales of the new
    tensors (checked in the child), and every call moved the bytes the host path moves for
    the same steps."""
    kind = "torch"
    env = {"XRESHARD_TEST_DEVICE_OPS": kind, "XRESHARD_DELTA_BASELINE": "device"}
    procs = [cases.fp8_delta_trainer, cases.fp8_delta_rollout, cases.fp8_delta_rollout]
    results = launch(procs, ROLES, args=(atomic,), timeout=600, env=env)
    host = launch(procs, ROLES, args=(atomic,), timeout=600)
    # the host path round by round too (the groups the device path runs): the unchanged
    # call's round moves nothing but still lands (its split pieces are kept)
    rounds = launch(procs, ROLES, args=(atomic,), timeout=600,
                    env={"XRESHARD_EXECUTOR": "rounds"})
    rows, host_rows = results[0].value["rows"], host[0].value["rows"]
    assert all("error" not in r for r in rows), rows
    moved = [(r["sent"], r["delta"]["bytes_wire"], r["delta"]["num_delta"])
             for r in rounds[0].value["rows"]]
    assert moved == [(r["sent"], r["delta"]["bytes_wire"], r["delta"]["num_delta"])
                     for r in host_rows], moved
    assert [r["version"] for r in rows] == list(range(1, len(cases.FP8_DELTA_STEPS) + 1))
    assert rows[0]["delta"]["pairs"] == 0 and rows[0]["quantized"]["fp8_sent"] > 0
    for k, r in enumerate(rows):
        want = host_rows[k]
        assert r["sent"] == want["sent"], (k, r, want)
        assert r["delta"]["bytes_wire"] == want["delta"]["bytes_wire"], (k, r, want)
        assert r["delta"]["num_delta"] == want["delta"]["num_delta"], (k, r, want)
        assert r["verified"] > 0
        if k == 0:
            continue
        d = r["delta"]
        assert d["pairs"] > 0, d
        if k == cases.FP8_DELTA_FULL:   # every element changed: dense, headers besides
            assert d["num_delta"] == 0 and d["bytes_wire"] > d["bytes_dense"], d
        else:                   # 1%: the changed codes and scales only
            assert d["num_delta"] > 0 and d["bytes_wire"] < 0.5 * d["bytes_dense"], d
    counts = results[0].value["counts"]
    assert counts.get(f"encode/{kind}", 0) > 0 and counts.get(f"quantize/{kind}", 0) > 0
    assert counts.get(f"apply/{kind}", 0) > 0           # baselines advanced on the device
    assert host[0].value["counts"] == {}
    for res, res_host, res_rounds in zip(results[1:], host[1:], rounds[1:]):
        out = res.value["rows"]
        assert all("wrong" not in x and "error" not in x for x in out), out
        assert all("wrong" not in x and "error" not in x for x in res_rounds.value["rows"])
        assert res.value["checked"] > 0
        assert (res.value["staging_bytes"] > 0) == atomic
        assert res.value["counts"].get(f"apply/{kind}", 0) > 0          # deltas applied
        assert res.value["counts"].get(f"quantize/{kind}", 0) > 0       # split blocks
        assert [x["held"] for x in out] == [x["held"] for x in res_host.value["rows"]]
