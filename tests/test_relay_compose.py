"""Relay composed with delta refit (issue 22 item 2) and with FP8 quantized destinations
(issue 20 item 3): the forward timing of a delta call, the delta executor running a
relayed call in one process, and real processes (tests/relay_compose_cases.py)."""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.ir.topology import Topology
from xreshard.planner.prepare import CallOptions, prepare

from . import relay_compose_cases as cases

HOSTS5 = {0: "t", 1: "a", 2: "a", 3: "b", 4: "b"}


def _case(num_tensors: int = 4):
    """One trainer rank, four receivers (two per host) holding every tensor whole; big
    tensors (received in place) and small ones (packed together, unpacked from staging)."""
    topo = Topology.of({r: (r, h) for r, h in HOSTS5.items()})
    shapes = {f"w{i}": (64, 16) for i in range(num_tensors)} | {f"s{i}": (3, 5) for i in range(6)}
    src = {n: xr.Layout.replicated(sh, "bfloat16", xr.Mesh((1,), (0,)))
           for n, sh in shapes.items()}
    dst = {n: xr.Layout.replicated(sh, "bfloat16", xr.Mesh((4,), (1, 2, 3, 4)))
           for n, sh in shapes.items()}
    return topo, src, dst


def _landed(prepared) -> dict[int, list]:
    """rank -> [(tensor, region, round)] of its stage-1 receives."""
    out: dict[int, list] = {}
    for k, rnd in enumerate(prepared.schedule.rounds):
        for b in rnd:
            if b.stage == 0:
                out.setdefault(b.dst, []).extend((it.name, it.region, k) for it in b.items)
    return out


def test_delta_call_runs_forwards_two_rounds_after_their_bytes_arrive():
    """The delta executor lands round k at the end of group k + 1 and sends a bucket's
    header (its encoding) in the group of its round, so a delta call's forward runs at
    least two rounds after its last arrival; every process still derives the same rounds."""
    topo, src, dst = _case()
    kw = dict(bucket_bytes=1024, staging_bytes=1 << 13, relay="on")
    plain = prepare(src, dst, topo, CallOptions(**kw), ranks=range(5))
    delta = prepare(src, dst, topo, CallOptions(delta=True, **kw), ranks=range(5))
    gaps = {}
    for name, prepared in (("plain", plain), ("delta", delta)):
        landed = _landed(prepared)
        gap = None
        for k, rnd in enumerate(prepared.schedule.rounds):
            for b in (b for b in rnd if b.stage == 1):
                for it in b.items:
                    last = max(j for n, reg, j in landed[b.src]
                               if n == it.name and reg.intersect(it.region) is not None)
                    gap = k - last if gap is None else min(gap, k - last)
        gaps[name] = gap
    assert gaps == {"plain": 1, "delta": 2}
    whole = {(b.src, b.dst, b.tag): (b.round, b.items) for rnd in delta.schedule.rounds
             for b in rnd}
    for r in range(5):
        mine = prepare(src, dst, topo, CallOptions(delta=True, **kw), ranks=[r])
        for rnd in mine.schedule.rounds:
            for b in rnd:
                assert whole[(b.src, b.dst, b.tag)] == (b.round, b.items)
    assert len(delta.schedule.rounds) <= len(plain.schedule.rounds) + 1


def _values(src: dict, step: int) -> dict[str, np.ndarray]:
    """Tensor values at ``step``: a pattern with a few elements' lowest bit flipped per step."""
    out = {}
    for i, (n, lay) in enumerate(sorted(src.items())):
        bits = (np.arange(int(np.prod(lay.shape)), dtype=np.uint16) * 7 + i).reshape(lay.shape)
        flat = bits.reshape(-1)
        for j in range(1, step + 1):
            rng = np.random.default_rng(1000 * i + j)
            flat[rng.choice(flat.size, max(1, flat.size // 50), replace=False)] ^= 1
        out[n] = bits
    return out


def _relayed_delta_calls(tuning=None):
    """Every rank in one process (local transport), one DeltaState: call 1 seeds (dense),
    call 2 sends every pair, forwards included, as deltas; call 3 with receiver 2's claim
    wrong. Every destination is checked bit-exact after each call. Returns the prepared
    call, the state and ``[(DeltaCall, ExecStats)]`` per call."""
    from xreshard.runtime.delta_wire import DeltaState
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.base import RecordingTransport
    from xreshard.transport.local import LocalTransport

    topo, src, dst = _case()
    options = CallOptions(bucket_bytes=1024, staging_bytes=1 << 13, relay="on", delta=True)
    prepared = prepare(src, dst, topo, options, ranks=range(5))
    assert prepared.forwarded
    state = DeltaState()
    real = {(r, n): np.zeros(l.shape, np.uint16) for n, l in dst.items() for r in l.ranks}
    transport = RecordingTransport(LocalTransport())
    programs: dict = {}
    rows = []
    for step in (1, 2, 3):
        values = _values(src, step)
        claims, errors = state.claims(None, None)
        assert not errors
        if step == 3:       # rank 2 claims a base it does not hold
            claims["recv"] = [[r, "not-a-call" if r == 2 else c, d] for r, c, d in claims["recv"]]
        call = state.begin([claims], prepared)
        bindings = stage_bindings(prepared, {(0, n): v for n, v in values.items()}, real)
        stats, _ = run(prepared, bindings, transport, timeout=20, programs=programs,
                       delta=call, **({} if tuning is None else {"tuning": tuning}))
        state.commit(call, None, None)
        for (r, n), arr in real.items():
            assert arr.tobytes() == values[n].tobytes(), (step, r, n)
        rows.append((call, stats))
    return prepared, state, rows


def test_relayed_delta_in_one_process_bit_exact_forwards_as_deltas():
    """Call 2 sends every pair, forwards included, as deltas; call 3 (receiver 2's claim
    wrong): every pair into rank 2 (from the trainer and from its forwarder) goes dense,
    rank 2's own forwards still go as deltas. Bit-exact each call (_relayed_delta_calls)."""
    _, state, rows = _relayed_delta_calls()
    total = sum(v.nbytes for v in _values(_case()[1], 0).values())
    (c1, s1), (c2, s2), (c3, s3) = rows
    forwards = {p for p in c2.pairs if p[0] != 0}
    assert not c1.pairs and c1.bytes_wire == c1.bytes_dense
    assert s1.bytes_sent == 2 * total and s1.bytes_forwarded == 2 * total
    assert forwards == {(1, 2), (2, 1), (3, 4), (4, 3)}
    assert len(c2.pairs) == 8 and c2.num_delta > 0
    assert s2.bytes_sent + s2.bytes_forwarded == c2.bytes_wire < 0.25 * c2.bytes_dense
    assert 0 < s2.bytes_forwarded < 0.25 * total * 2
    assert c3.pairs == c2.pairs - {(0, 2), (1, 2)}      # into rank 2: dense
    # the forwarders' baselines are the bytes they forward
    assert state.baseline_bytes == 4 * total


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_relayed_delta_device_path_forwards_as_the_host_path(monkeypatch, kind):
    """The same calls through the device path (``XRESHARD_TEST_DEVICE_OPS``: the code a GPU
    runs, its arrays on the host): every destination bit-exact each call, every pair's
    delta, forwards included, encoded by the device ops (a forwarder diffs on its device
    what landed there), and each call moved exactly the bytes the host path moves."""
    from xreshard.runtime import device_ops

    pytest.importorskip(kind)
    _, _, host = _relayed_delta_calls()
    from xreshard.config import Tuning
    before = device_ops.COUNTS[f"encode/{kind}"]
    prepared, _, rows = _relayed_delta_calls(Tuning(host_device_ops=kind))
    encoded = device_ops.COUNTS[f"encode/{kind}"] - before
    moved = [(c.pairs, c.bytes_wire, c.num_delta, s.bytes_sent, s.bytes_forwarded)
             for c, s in rows]
    assert moved == [(c.pairs, c.bytes_wire, c.num_delta, s.bytes_sent, s.bytes_forwarded)
                     for c, s in host]
    buckets = [b for rnd in prepared.schedule.rounds for b in rnd]
    forwards = {b for b in buckets if b.src != 0}
    c2, c3 = rows[1][0], rows[2][0]
    assert c2.num_delta > 0 and forwards and {(b.src, b.dst) for b in forwards} <= c2.pairs
    # calls 2 and 3: each bucket of a delta pair was diffed by the device ops once
    want = sum(1 for c in (c2, c3) for b in buckets if (b.src, b.dst) in c.pairs)
    assert encoded == want, (encoded, want)


# ---------------------------------------------------------------------------- processes

from xreshard.tools.launch import Role, launch      # noqa: E402

ROLES = [Role("jax", "trainer", 0, num_devices=4)] + [Role("torch", "rollout", i)
                                                       for i in range(4)]


@pytest.mark.slow
def test_relayed_delta_jax_to_dtensor_replicas_fences_and_failure():
    """Two DTensor replicas (TP=2) whose TP ranks share hosts; ``relay="on"`` and
    ``delta=True``, verify=True (see tests/relay_compose_cases.py for the calls)."""
    results = launch([cases.delta_trainer] + [cases.delta_rollout] * 4, ROLES,
                     timeout=400, env={"XRESHARD_SHM": "0"})
    trainer = results[0].value["rows"]
    rollouts = [r.value["rows"] for r in results[1:]]
    errors = [[("error" in row) for row in rows] for rows in [trainer] + rollouts]
    assert all(e == [False, False, False, True, False, False] for e in errors), \
        [trainer] + rollouts
    assert len({rows[3]["error"] for rows in [trainer] + rollouts}) == 1
    assert "injected failure" in trainer[3]["error"]
    for rows in rollouts:
        assert all("wrong" not in row for row in rows), rows
    assert all(r.value["checked"] > 0 for r in results[1:])
    for k in (0, 1, 2, 4, 5):
        assert all(rows[k]["verified"] > 0 for rows in [trainer] + rollouts)
        # the receivers send nothing of their own: everything they post is a forward
        for rows in rollouts:
            assert rows[k]["sent"] == 0 and rows[k]["forwarded"] > 0
            assert rows[k]["posted"] == rows[k]["forwarded"] == rows[k]["delta"]["bytes_wire"]
    dense = [rows[0]["forwarded"] for rows in rollouts]
    for k in (0, 4):            # the first call and the one after the failure: dense
        assert trainer[k]["delta"]["pairs"] == 0
        assert all(rows[k]["delta"]["pairs"] == 0 for rows in rollouts)
        assert [rows[k]["forwarded"] for rows in rollouts] == dense
    for k in (1, 5):            # every pair a delta, forwards included
        assert trainer[k]["delta"]["pairs"] > 0
        assert trainer[k]["sent"] < 0.25 * trainer[0]["sent"]
        for rows, full in zip(rollouts, dense):
            assert rows[k]["delta"]["pairs"] > 0
            assert rows[k]["forwarded"] < 0.25 * full
            assert rows[k]["delta"]["bytes_wire"] < 0.25 * rows[k]["delta"]["bytes_dense"]
    # call 3: rollout[2]'s claim is wrong: its trainer pairs and rollout[0]'s forwards to it
    # (rollout[0] forwards only to it) go dense; rollout[2]'s own forwards stay deltas
    assert 0 < trainer[2]["delta"]["pairs"] < trainer[1]["delta"]["pairs"]
    assert rollouts[0][2]["delta"]["pairs"] == 0 and rollouts[0][2]["forwarded"] == dense[0]
    assert rollouts[2][2]["delta"]["pairs"] == rollouts[2][1]["delta"]["pairs"]
    assert rollouts[2][2]["forwarded"] < 0.25 * dense[2]
    # each forwarder keeps a baseline of what it forwards per call
    for r, full in zip(results[1:], dense):
        assert r.value["baseline_bytes"] == full
    assert results[0].value["baseline_bytes"] == trainer[0]["sent"]


# ---------------------------------------------------------------------------- FP8, one process

#: two trainer ranks on host "t" (0, 5); receivers 1, 2 on "a" hold TP shard 0 of two
#: replicas, 3, 4 on "b" TP shard 1. name -> (shape, format, trainer's split)
FP8_HOSTS = {0: "t", 5: "t", 1: "a", 2: "a", 3: "b", 4: "b"}
FP8_TENSORS = {
    "o": ((512, 256), "block", "rows"),       # trainer rows on the grid: relayed as FP8
    "e": ((4, 256, 256), "block", "rows"),    # experts: relayed as FP8
    "m": ((256, 256), "mx", "rows"),          # MXFP8: relayed
    "w": ((512, 300), "block", "cols"),       # trainer columns cut at 150: split blocks
}


def _fp8_case():
    from xreshard.ir.formats import BlockFP8, MXFP8, QuantizedTensor

    topo = Topology.of({r: (r, h) for r, h in FP8_HOSTS.items()})
    src, dst, quantized = {}, {}, {}
    for name, (shape, kind, split) in FP8_TENSORS.items():
        fmt = BlockFP8() if kind == "block" else MXFP8()
        d = len(shape) - 2 if split == "rows" else len(shape) - 1
        half = shape[d] // 2
        src[name] = xr.Layout.explicit_form(shape, "bfloat16", {
            r: [[(0, n) if i != d else (k * half, (k + 1) * half)
                 for i, n in enumerate(shape)]] for k, r in enumerate((0, 5))})
        qt = QuantizedTensor(name, name + ".scale", fmt, shape)
        quantized[name] = qt
        tp = len(shape) - 2                 # the receivers' TP dim: rows of each matrix
        for key, full, dtype in ((name, shape, fmt.dtype),
                                 (qt.scale, qt.scale_shape, fmt.scale_dtype)):
            rows = full[tp] // 2
            dst[key] = xr.Layout.explicit_form(full, dtype, {
                r: [[(0, n) if i != tp else (t * rows, (t + 1) * rows)
                     for i, n in enumerate(full)]]
                for t, ranks in enumerate(((1, 2), (3, 4))) for r in ranks})
    return topo, src, dst, quantized


def _fp8_values(step: int) -> dict[str, np.ndarray]:
    return cases.fp8_values(step, FP8_TENSORS)


@pytest.mark.parametrize("pipeline", [False, True])
def test_relayed_fp8_in_one_process_forwards_codes_and_scales_bit_exact(pipeline):
    """Whole blocks relay as the forwarder's codes and scales (half the bytes in both
    stages); ``w``, whose blocks the forwarder would receive split across the two trainer
    ranks, is not relayed (its receivers get it directly, quantizing split blocks
    themselves). Every receiver's codes and scales equal the reference quantizer's on the
    whole bf16 tensor, sliced to its TP shard."""
    from xreshard.config import Tuning
    from xreshard.dtypes import numpy_dtype
    from xreshard.quant.host import quantize_block_fp8, quantize_mxfp8
    from xreshard.ir.formats import MXFP8
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.base import RecordingTransport
    from xreshard.transport.local import LocalTransport
    from xreshard.tools.testing import local_arrays_from_global

    topo, src, dst, quantized = _fp8_case()
    options = CallOptions(bucket_bytes=1 << 14, staging_bytes=1 << 17, relay="on",
                          halved=pipeline)
    prepared = prepare(src, dst, topo, options, ranks=sorted(FP8_HOSTS), quantized=quantized)
    assert prepared.forwarded == {(n, 1) for n in ("o", "e", "m")} | {
        (n + ".scale", 1) for n in ("o", "e", "m")}
    real = {}          # one region per rank, filled with a pattern no quantizer writes
    for n, lay in dst.items():
        dtype = numpy_dtype(lay.dtype)
        for r in lay.ranks:
            shape = lay.regions(r)[0].shape
            real[(r, n)] = [np.full(int(np.prod(shape)) * dtype.itemsize, 0x55, np.uint8)
                            .view(dtype).reshape(shape)]
    transport = RecordingTransport(LocalTransport())
    programs: dict = {}
    for step in (1, 2):
        values = _fp8_values(step)
        src_b = {(r, n): [local_arrays_from_global(lay, r, values[n])[0]]
                 for n, lay in src.items() for r in lay.ranks}
        stats, _ = run(prepared, stage_bindings(prepared, src_b, real), transport,
                       timeout=30, programs=programs,
                       tuning=Tuning(executor="pipelined" if pipeline else "rounds"))
        assert stats.pipelined == pipeline
        for name, qt in quantized.items():
            quantize = quantize_mxfp8 if isinstance(qt.format, MXFP8) else quantize_block_fp8
            codes, scales = quantize(values[name], qt.format, name=name)
            for r in (1, 2, 3, 4):
                for key, want in ((name, codes), (qt.scale, scales)):
                    got = real[(r, key)][0]
                    region = dst[key].regions(r)[0]
                    part = want[tuple(slice(a, b) for a, b in zip(region.starts, region.stops))]
                    assert got.tobytes() == np.ascontiguousarray(part).tobytes(), (step, r, key)
    wire = {n: qt.format.wire_bytes(qt.shape) for n, qt in quantized.items()}
    relayed = wire["o"] + wire["e"] + wire["m"]
    assert stats.bytes_forwarded == relayed         # each host forwards half its need twice
    assert prepared.formats.quant.totals["fp8_forwarded_world"] == relayed
    # the trainer sends each relayed tensor once (half to each host) as codes + scales
    items = [it for rnd in prepared.schedule.rounds for b in rnd if b.stage == 0
             for it in b.items if it.name != "w"]
    assert all(it.quantized for it in items)
    assert sum(it.nbytes for it in items) == relayed
    assert stats.quantized["fp8_sent"] > relayed and stats.quantized["bf16_sent"] > 0  # w


@pytest.mark.parametrize("kind", [None, "torch"])
def test_relayed_fp8_deltas_forward_changed_codes_and_scales_only(monkeypatch, kind):
    """``delta=True`` through the relay of FP8 destinations (one process, one DeltaState):
    a forwarder diffs the codes and scales it forwards against what it last forwarded, so
    a step that changed 1% of the bf16 elements forwards a few percent of the FP8 bytes
    (before: every forward went raw); the bf16 pieces of ``w``'s split blocks are diffed
    against what their receivers kept of the last call (before: raw every call). Call 4:
    receiver 1 claims a wrong base (dense to it). Every receiver holds the quantizer's
    bytes after every call. ``kind``: through the device path (``XRESHARD_TEST_DEVICE_OPS``,
    the code a GPU runs: quantized, diffed, applied and forwarded by the device ops)."""
    from xreshard.runtime import device_ops
    from xreshard.ir.formats import MXFP8

    if kind:
        pytest.importorskip(kind)
    from xreshard.quant.host import quantize_block_fp8, quantize_mxfp8
    from xreshard.runtime.delta_wire import DeltaState
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.tools.testing import local_arrays_from_global
    from xreshard.transport.local import LocalTransport

    topo, src, dst, quantized = _fp8_case()
    options = CallOptions(bucket_bytes=1 << 14, staging_bytes=1 << 17, relay="on",
                          delta=True)
    prepared = prepare(src, dst, topo, options, ranks=sorted(FP8_HOSTS), quantized=quantized)
    real = {(r, n): [np.zeros(lay.regions(r)[0].shape, lay.dtype if lay.dtype == "float32"
                              else np.uint8)] for n, lay in dst.items() for r in lay.ranks}
    state, programs, forwarded, wire = DeltaState(), {}, [], []
    from xreshard.config import Tuning
    tuning = Tuning(host_device_ops=kind or None)
    counts, pairs = dict(device_ops.COUNTS), []
    for k, step in enumerate((1, 2, 2, 1)):
        values = _fp8_values(1)
        if step == 2:
            for i, v in enumerate(values.values()):
                bits = v.reshape(-1).view(np.uint16)
                pos = np.random.default_rng(i).choice(bits.size, bits.size // 100, replace=False)
                bits[pos] ^= 1
        claims = state.claims(None, None)[0]
        if k == 3:          # receiver 1 claims a base it does not hold
            claims["recv"] = [[r, "not-a-call" if r == 1 else c, d] for r, c, d in claims["recv"]]
        call = state.begin([claims], prepared)
        src_b = {(r, n): [local_arrays_from_global(lay, r, values[n])[0]]
                 for n, lay in src.items() for r in lay.ranks}
        stats, _ = run(prepared, stage_bindings(prepared, src_b, real), LocalTransport(),
                       timeout=30, programs=programs, delta=call, tuning=tuning)
        state.commit(call, None, None)
        pairs.append(call.pairs)
        forwarded.append(stats.bytes_forwarded)
        wire.append(call.bytes_wire)
        for name, qt in quantized.items():
            quantize = quantize_mxfp8 if isinstance(qt.format, MXFP8) else quantize_block_fp8
            for key, want in zip((name, qt.scale), quantize(values[name], qt.format, name=name)):
                for r in (1, 2, 3, 4):
                    region = dst[key].regions(r)[0]
                    part = want[tuple(slice(a, b) for a, b in zip(region.starts, region.stops))]
                    assert real[(r, key)][0].tobytes() == np.ascontiguousarray(part).tobytes()
    assert {p for p in call.pairs if p[0] not in (0, 5)} == {(1, 2), (3, 4), (4, 3)}
    assert {p for p in call.pairs if p[0] in (0, 5)} == {(s, r) for s in (0, 5)
                                                         for r in (2, 3, 4)}
    assert 0 < forwarded[1] < 0.05 * forwarded[0]       # the changed codes and scales
    assert 0 < forwarded[2] < 0.01 * forwarded[0]       # nothing changed: headers only
    assert 0 < wire[1] < 0.05 * wire[0]                 # w's pieces too
    assert state.baseline_bytes == wire[0]               # pieces in the baselines too
    ran = {k: n - counts.get(k, 0) for k, n in device_ops.COUNTS.items() if n > counts.get(k, 0)}
    if kind:            # each bucket of a delta pair, forwards included, diffed on the device
        buckets = [b for rnd in prepared.schedule.rounds for b in rnd]
        want = sum(1 for p in pairs for b in buckets if (b.src, b.dst) in p)
        assert ran.get(f"encode/{kind}", 0) == want and ran.get(f"apply/{kind}", 0) > 0, ran
        assert ran.get(f"quantize/{kind}", 0) > 0, ran
    else:
        assert not ran, ran


@pytest.mark.slow
def test_relayed_fp8_jax_to_dtensor_replicas_equals_vllms_quantizer():
    """Two DTensor replicas (TP=2) storing every tensor quantized; ``relay="on"``,
    verify=True: every replica's codes and scales equal vLLM's quantizer's on the whole
    bf16 tensor, sliced to its TP shard; the relayed tensors cross to each host once, as
    FP8, and are forwarded as the forwarders' codes and scales."""
    pytest.importorskip("vllm")
    results = launch([cases.fp8_trainer] + [cases.fp8_rollout] * 4, ROLES, timeout=400,
                     env={"XRESHARD_SHM": "0"})
    trainer = results[0].value["reports"]
    wire = {}
    for name, (shape, kind, _) in cases.FP8_TENSORS.items():
        from xreshard.ir.formats import BlockFP8, MXFP8
        wire[name] = (BlockFP8() if kind == "block" else MXFP8()).wire_bytes(shape)
    relayed = sum(wire[n] for n in cases.FP8_RELAYED)
    for v in (1, 2):
        want = cases.vllm_fp8_bytes(v)
        for res in results[1:]:
            tp = res.role.index % 2
            got = res.value["got"][v - 1]
            for name, (shape, _, _) in cases.FP8_TENSORS.items():
                codes, scales = want[name]
                dim = len(shape) - 2
                sl = (slice(None),) * dim
                rows = slice(tp * shape[dim] // 2, (tp + 1) * shape[dim] // 2)
                srows = slice(tp * scales.shape[dim] // 2, (tp + 1) * scales.shape[dim] // 2)
                assert got[name][0] == codes[sl + (rows,)].tobytes().hex(), (v, name, res.role)
                assert got[name][1] == scales[sl + (srows,)].tobytes().hex(), (v, name, res.role)
        rollouts = [res.value["reports"][v - 1] for res in results[1:]]
        t = trainer[v - 1]
        assert t["verified"] > 0 and all(r["verified"] > 0 for r in rollouts)
        assert t["fp8_forwarded_world"] == relayed
        assert sum(r["forwarded"] for r in rollouts) == relayed
        assert all(r["posted"] == r["forwarded"] > 0 and r["sent"] == 0 for r in rollouts)
        assert t["posted"] == t["sent"] == t["fp8_sent"] + t["bf16_sent"]
        # the relayed tensors once (not once per replica), w to each of the four ranks
        assert t["fp8_sent"] > relayed and t["bf16_sent"] > 0
        assert sum(r["fp8_received"] + r["bf16_received"] for r in rollouts) == t["sent"]
