"""One test for the product (issue 32 item 4): every combination of a call's features —
{delta} x {block FP8, MXFP8, bf16 destinations} x {relay} x {atomic} x {verify} x {host,
device kernels run on the CPU} x {pipelined, rounds executor} — in ONE long-lived world of
real processes: a JAX trainer with NamedSharding arrays on a (2, 2) CPU mesh, two torch
rollout processes with DTensor destinations over gloo (tests/compose_matrix_cases.py).

Each case is one ``Refit`` of that world and five calls: three with the weights changing
(a few low bits; then signs of whole rows flipped), a fourth that fails mid-move (the
trainer's transport raises once, between two rounds), and a fifth that must be exact
again (a delta of the third call's weights). After every call that succeeded, each
rollout's ``full_tensor()`` of every destination equals, byte for byte, vLLM's own
quantizer on the whole new tensor (codes and scales; the bf16 values for bf16
destinations); after the failed call an atomic case still holds the third call's bytes.
A combination the API refuses must be refused at the first call with the same typed error
on every process, before any byte moved (none is today: ``REFUSED``).

The world runs once per session (a module fixture), for the cases selected only: ``-k
"combination and delta and relay"`` runs those 48 cases.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from . import compose_matrix_cases as cases

pytestmark = pytest.mark.slow

ROLES = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
         Role("torch", "rollout", 1)]
KEYS = [cases.case_key(c) for c in cases.CASES]
BY_KEY = dict(zip(KEYS, cases.CASES))
#: combinations the API refuses, key -> words of the error every process raises
REFUSED: dict[str, str] = {}


def test_the_matrix_has_every_combination():
    assert len(KEYS) == len(set(KEYS)) == int(np.prod([len(v) for v in cases.AXES.values()]))
    assert len(KEYS) - len(REFUSED) >= 64


def _quantize(a: np.ndarray, fmt: str) -> list[bytes]:
    """The bytes a destination in ``fmt`` must hold for the whole bf16 tensor ``a``: vLLM's
    own quantizer's codes and scales (xreshard's host quantizer, checked against vLLM's in
    tests/test_quant.py, where vLLM is not installed), or the bf16 bytes."""
    if fmt == "bf16":
        return [a.tobytes()]
    try:
        import torch
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
            _mxfp8_e4m3_quantize_torch)
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except ImportError:
        from xreshard.quant import BlockFP8, MXFP8, host
        q, s = (host.quantize_block_fp8(a, BlockFP8()) if fmt == "block"
                else host.quantize_mxfp8(a, MXFP8()))
        return [np.ascontiguousarray(q).tobytes(), np.ascontiguousarray(s).tobytes()]
    x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    q, s = (_mxfp8_e4m3_quantize_torch(x) if fmt == "mx"
            else per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False))
    return [q.contiguous().view(torch.uint8).numpy().tobytes(),
            s.contiguous().view(torch.uint8).numpy().tobytes()]


@pytest.fixture(scope="module")
def oracle() -> dict:
    """(format, step) -> tensor name -> sha256 of each piece it must hold."""
    out = {}
    for step in set(cases.STEPS):
        vals = cases.values(step)
        for fmt in cases.AXES["format"]:
            out[fmt, step] = {
                name: [hashlib.sha256(b).hexdigest() for b in
                       _quantize(a, fmt if cases.TENSORS[name][1] else "bf16")]
                for name, a in vals.items()}
    return out


def test_every_call_changes_what_the_destinations_must_hold(oracle):
    """So a call that moved nothing cannot pass: every step changes every tensor's codes
    (bf16 values) from the step before, and the failed call's step (new values) changes
    the scales too, so call 5 must rewrite whatever call 4 left."""
    for fmt in cases.AXES["format"]:
        for name in cases.TENSORS:
            held = [oracle[fmt, step][name] for step in cases.STEPS]
            assert all(a[0] != b[0] for a, b in zip(held, held[1:])), (fmt, name)
            assert all(a[-1] != held[cases.FAILS - 1][-1] for k, a in enumerate(held)
                       if k != cases.FAILS - 1), (fmt, name)


def _twin(key: str, axis: str) -> str:
    """The case like ``key`` with ``axis`` at its first value (the host path, the
    pipelined executor)."""
    return cases.case_key({**BY_KEY[key], axis: cases.AXES[axis][0]})


@pytest.fixture(scope="module")
def world(request) -> dict:
    """Every selected case, in one launch: key -> [trainer's, rollout[0]'s, rollout[1]'s]
    ``{"rows": [...], "device": ...}``."""
    keys = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module or "key" not in params:
            continue
        keys.add(params["key"])
        if "axis" in params:
            keys.add(_twin(params["key"], params["axis"]))
    keys = sorted(keys)
    timeout = 120 + 12 * len(keys)
    results = launch([cases.trainer, cases.rollout, cases.rollout], ROLES, args=(keys,),
                     timeout=timeout)
    return {k: [r.value[k] for r in results] for k in keys}


def _untouched(pieces: list[str], name: str, fmt: str) -> list[str]:
    shape, quantized, _, _ = cases.TENSORS[name]
    sizes = [int(np.prod(shape)) * 2]
    if quantized and fmt != "bf16":
        from xreshard.ir.formats import BlockFP8, MXFP8
        f = BlockFP8() if fmt == "block" else MXFP8()
        scale = 4 if fmt == "block" else 1
        sizes = [int(np.prod(shape)), int(np.prod(f.scale_shape(shape))) * scale]
    return [hashlib.sha256(bytes([cases.FILL]) * s).hexdigest() for s in sizes]


@pytest.mark.parametrize("key", KEYS)
def test_combination(key, world, oracle):
    case = BY_KEY[key]
    trainer, *rollouts = world[key]
    procs = [trainer] + rollouts
    first = [p["rows"][0] for p in procs]
    if key in REFUSED:
        errors = {r.get("error") for r in first}
        assert len(errors) == 1 and None not in errors, first    # the same on every process
        assert REFUSED[key] in errors.pop()
        for r in rollouts:                                       # before any byte moved
            row = r["rows"][0]
            assert row["held"] == {name: _untouched(h, name, case["format"])
                                   for name, h in row["held"].items()}
        return
    for p in procs:
        rows = p["rows"]
        assert len(rows) == cases.CALLS, rows[0]
        assert [("error" in r) for r in rows] == [k == cases.FAILS for k in
                                                  range(1, cases.CALLS + 1)], rows
        assert [r["version"] for r in rows] == [1, 2, 3, 3, 4]
        # a failed call: the previous version stays; stale unless atomic kept it whole
        assert rows[cases.FAILS - 1]["stale"] is (not case["atomic"]), rows[cases.FAILS - 1]
        assert rows[-1]["stale"] is False
    failed = {p["rows"][cases.FAILS - 1]["error"] for p in procs}
    assert len(failed) == 1, failed                      # one error, word for word, everywhere
    error = failed.pop()
    assert error.startswith("RemoteError: ") and cases.INJECTED in error, error

    # the bytes: vLLM's on the whole tensors, after every call that succeeded; after the
    # failed one, an atomic case still holds call 3's
    for me, r in enumerate(rollouts):
        for call, (step, row) in enumerate(zip(cases.STEPS, r["rows"]), 1):
            if call == cases.FAILS:
                if case["atomic"]:
                    assert row["held"] == oracle[case["format"], cases.STEPS[call - 2]], \
                        (me, call)
                continue
            assert row["held"] == oracle[case["format"], step], (me, call, step)

    # each feature did its work (a matrix whose features silently stayed off proves nothing)
    good = [r for k, r in enumerate(trainer["rows"], 1) if k != cases.FAILS]
    assert trainer["rows"][0]["delta"].get("pairs", 0) == 0      # call 1: nothing to diff
    for k, row in enumerate(trainer["rows"][1:3], 2):     # calls 2 and 3: deltas
        d = row["delta"]
        assert (d.get("pairs", 0) > 0 and d.get("num_delta", 0) > 0) == case["delta"], (k, d)
    if case["delta"]:
        assert all(r["delta"]["bytes_wire"] < r["delta"]["bytes_dense"]
                   for r in trainer["rows"][1:3]), trainer["rows"]
    if case["delta"] and case["atomic"]:        # the failed call moved no base: deltas
        d = trainer["rows"][-1]["delta"]
        assert d["pairs"] > 0 and d["num_delta"] > 0, d
    for p in procs:
        for k, row in enumerate(p["rows"], 1):
            if k != cases.FAILS:
                assert (row["verified"] > 0) == bool(case["verify"]), (k, row)
    forwarded = [row["forwarded"] for r in rollouts for k, row in enumerate(r["rows"], 1)
                 if k != cases.FAILS]
    assert all(f > 0 for f in forwarded) if case["relay"] else not any(forwarded), forwarded
    quantized = case["format"] != "bf16"
    assert (good[0]["quantized"].get("fp8_sent", 0) > 0) == quantized, good[0]
    # the device kernels: the trainer's diffs or quantizing, the rollouts' applies or
    # the quantizing of split blocks; none on the host path (bf16 without delta: no work)
    ran_device = [p["device"] for p in procs]
    if case["device"] and (case["delta"] or quantized):
        assert all(d > 0 for d in ran_device), ran_device
    else:
        assert ran_device == [0, 0, 0], ran_device


TWINS = [(k, axis) for k in KEYS for axis in ("device", "executor")
         if BY_KEY[k][axis] != cases.AXES[axis][0]]


@pytest.mark.parametrize("key,axis", TWINS)
def test_twins_move_the_same_bytes(key, axis, world):
    """The device kernels change how bytes are computed, never which: a case and its twin
    on the host path send the same bytes and deltas, call for call. The rounds executor
    likewise, except that with a relay it schedules the forwards in other buckets (so
    a delta's headers and runs are cut elsewhere): there the dense bytes are the same."""
    twin = _twin(key, axis)
    if key in REFUSED or twin in REFUSED:
        pytest.skip("refused")
    schedule_differs = axis == "executor" and BY_KEY[key]["relay"] and BY_KEY[key]["delta"]

    def moved(k: str) -> list:
        rows = [r for n, r in enumerate(world[k][0]["rows"], 1) if n != cases.FAILS]
        if schedule_differs:
            return [r["delta"]["bytes_dense"] for r in rows]
        return [(r["sent"], r["delta"].get("bytes_wire"), r["delta"].get("num_delta"))
                for r in rows]
    assert moved(key) == moved(twin)


def test_device_switch_is_one_function():
    """The "device" axis is set in one place (``device_kernels``): ``Tuning`` fields only,
    never the environment (``Tuning.host_device_ops`` replaced XRESHARD_TEST_DEVICE_OPS)."""
    assert cases.device_kernels(True)["host_device_ops"] == "torch"
    assert cases.device_kernels(False) == {}
    assert "XRESHARD_TEST_DEVICE_OPS" not in os.environ
