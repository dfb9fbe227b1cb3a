"""Kernels held ``[in, out]`` by every sender travel in that order (issue 35, item 4):
the plan picks the order once, the same on every process, and falls back to canonical
row-major bytes wherever a sender disagrees or a feature reads the wire; the executor
posts whole shards as they are and the receivers transpose while unpacking, bit-exact.

The multi-process test sends from a JAX trainer (real ``NamedSharding`` s, ``[in, out]``
kernels, ``transpose=``) to two torch processes (DTensors over gloo) with each feature
switched on in turn, and compares every destination byte."""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.dtypes import numpy_dtype
from xreshard.ir.topology import Topology
from xreshard.planner import formats as F
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.tools.launch import Role, launch
from xreshard.tools.testing import local_arrays_from_global

from . import wire_order_cases as cases


def _lay(shape, dtype, ranks, placements):
    return xr.Layout.from_placements(shape, dtype, xr.Mesh((len(ranks),), tuple(ranks)),
                                     placements)


#: two sender processes (ranks 0-1 and 2-3), two receiver processes (ranks 4 and 5)
PROCESSES = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 3}


def _call(stored, options=None, ranks=range(6), processes=PROCESSES, **kw):
    """Two sender processes (four shards), two receivers (``processes``: rank -> process)."""
    src = {"k": _lay((1024, 384), "float32", (0, 1, 2, 3), ["S0"]),     # whole shards
           "p": _lay((600, 256), "float32", (0, 1, 2, 3), ["S1"]),      # partial regions
           "mixed": _lay((64, 48), "float32", (0, 1, 2, 3), ["S0"]),
           "b": _lay((600,), "float32", (0, 1, 2, 3), ["R"])}
    dst = {n: _lay(lay.shape, lay.dtype, (4, 5), ["S0"] if lay.ndim == 2 else ["R"])
           for n, lay in src.items()}
    topo = Topology.of({r: (p, "h") for r, p in processes.items()})
    return src, dst, prepare(src, dst, topo, options or CallOptions(), ranks=ranks,
                             stored_transposed=stored,
                             **kw)


# every sending rank of k and p says it holds them transposed; of "mixed", only the first
# process (ranks 0-1) does; "b" (1-D) is claimed but has no order to choose
CLAIMS = {"k": [0, 1, 2, 3], "p": [2, 3, 0, 1], "mixed": [0, 1], "b": [0, 1, 2, 3]}


def test_the_plan_sends_a_tensor_in_storage_order_only_where_every_sender_agrees():
    per_process = [_call(CLAIMS, ranks=ranks)[2] for ranks in ((0, 1), (2, 3), (4,), (5,))]
    assert {p.formats.transposed for p in per_process} == {frozenset({("k", 0), ("p", 0)})}
    plan, topo = per_process[0].direct, Topology.of({r: (p, "h") for r, p in PROCESSES.items()})
    assert F.wire_orders(CLAIMS, plan, topo) == {"k", "p"}
    assert F.wire_orders({"k": [0, 1, 2]}, plan, topo) == set()        # rank 3 did not say
    assert F.wire_orders(CLAIMS, plan, topo, canonical=True) == set()
    assert _call({})[2].formats.transposed == frozenset()


def test_the_receivers_take_the_transposing_only_where_it_spreads():
    """Two sender processes into ONE receiving process would gather on it what the two
    senders split: every process keeps canonical order; one sender process into two
    receiving ones (the bench's trainer and rollouts) moves it."""
    fan_in = {**PROCESSES, 5: 2}
    for ranks in ((0, 1), (2, 3), (4, 5)):
        assert _call(CLAIMS, ranks=ranks, processes=fan_in)[2].formats.transposed == set()
    fan_out = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 2}
    for ranks in ((0, 1, 2, 3), (4,), (5,)):
        assert _call(CLAIMS, ranks=ranks, processes=fan_out)[2].formats.transposed == {
            ("k", 0), ("p", 0)}


@pytest.mark.parametrize("options", [CallOptions(canonical_wire=True), CallOptions(delta=True),
                                     CallOptions(relay="on")])
def test_a_feature_that_reads_the_wire_keeps_canonical_order_on_every_process(options):
    """verify and check_writes (``canonical_wire``), delta (``SIZED`` framing) and a relay
    (stages through forwarders): every process prepares the call with no transposed item."""
    topo = {r: (p, "h" if r < 4 else "g") for r, p in PROCESSES.items()}
    for ranks in ((0, 1), (2, 3), (4,), (5,)):
        src, dst, _ = _call(CLAIMS)
        prepared = prepare(src, dst, Topology.of(topo), options, ranks=ranks,
                           stored_transposed=CLAIMS)
        assert prepared.formats.transposed == frozenset(), (options, ranks)


def test_the_extensions_that_check_bytes_ask_for_canonical_wire_order():
    from xreshard.runtime.extensions import for_config
    for cfg in (xr.RefitConfig(verify=True), xr.RefitConfig(verify="sample"),
                xr.RefitConfig(check_writes=True)):
        opts = {k: v for e in for_config(cfg, xr.Tuning()) for k, v in e.options.items()}
        assert opts.get("canonical_wire") is True, cfg
    opts = {k: v for e in for_config(xr.RefitConfig(), xr.Tuning()) for k, v in e.options.items()}
    assert "canonical_wire" not in opts


def test_an_fp8_destination_keeps_canonical_order():
    from xreshard.ir.formats import BlockFP8, QuantizedTensor
    shape, fmt = (256, 256), BlockFP8()
    src = {"w": _lay(shape, "bfloat16", (0, 1), ["S1"]), "v": _lay(shape, "bfloat16", (0, 1),
                                                                   ["S1"])}
    qt = QuantizedTensor("w", "w.scale", fmt, shape)
    dst = {"w": _lay(shape, fmt.dtype, (2, 3), ["S0"]),
           "w.scale": _lay(qt.scale_shape, fmt.scale_dtype, (2, 3), ["S0"]),
           "v": _lay(shape, "bfloat16", (2, 3), ["S0"])}
    prepared = prepare(src, dst, None, CallOptions(), ranks=range(4), quantized={"w": qt},
                       stored_transposed={"w": [0, 1], "v": [0, 1]})
    assert isinstance(prepared.formats.item("w"), F.Fp8)
    assert prepared.formats.transposed == frozenset({("v", 0)})


@pytest.mark.parametrize("wire", [None, "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [64 << 20, 1 << 16])
@pytest.mark.parametrize("held", ["kernels", "row_major"])
def test_transposed_messages_land_bit_exact_in_one_process(wire, bucket_bytes, held):
    """The executor over a local transport: senders hold ``[in, out]`` kernel shards, a
    receiver of "p" holds it transposed too (it receives in place), with and without a
    bf16 wire, whole regions (posted as they are) and regions cut to small buckets
    (packed). ``row_major``: the same prepared call run with row-major source arrays (the
    order is only a speed hint: a call prepared for kernels stays exact, packing them)."""
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.local import LocalTransport

    opts = CallOptions(bucket_bytes=bucket_bytes, wire_dtype=wire)
    src, dst, prepared = _call(CLAIMS, opts)
    assert prepared.formats.transposed == frozenset({("k", 0), ("p", 0)})
    rng = np.random.default_rng(7)
    values = {n: rng.standard_normal(lay.shape).astype(np.float32) for n, lay in src.items()}
    src_b = {}
    for (n, lay) in src.items():
        for r in lay.ranks:
            a = local_arrays_from_global(lay, r, values[n])
            # k, p and mixed on ranks 0-1 are kernels: row-major [in, out], bound as .T
            kernel = held == "kernels" and (n in ("k", "p") or (n == "mixed" and r < 2))
            src_b[(r, n)] = np.ascontiguousarray(a.T).T if kernel else a
    dst_b = {}
    for n, lay in dst.items():
        for r in lay.ranks:
            shape = lay.local_shape(r)
            dst_b[(r, n)] = np.zeros(shape[::-1], np.float32).T if n == "p" and r == 5 \
                else np.zeros(shape, np.float32)
    stats, _ = run(prepared, stage_bindings(prepared, src_b, dst_b), LocalTransport(),
                   timeout=60, programs={})
    for n, lay in dst.items():
        want = values[n].astype(numpy_dtype(wire)).astype(np.float32) if wire else values[n]
        for r in lay.ranks:
            part = local_arrays_from_global(lay, r, want)
            assert dst_b[(r, n)].tobytes() == np.ascontiguousarray(part).tobytes(), (n, r)
    if wire is None and bucket_bytes > 1 << 20 and held == "kernels":
        # the same call in canonical order: the kernels' shards are packed (transposing)
        # by the senders instead of posted as they are. Both over a transport that stages
        # every receive (the local one lands a receive in the strided destination itself,
        # which counts as zero-copy in either order)
        class Staged(LocalTransport):
            def takes_views(self, src_rank: int, dst_rank: int) -> bool:
                return False

        _, _, canonical = _call({}, opts)
        posted, base = (run(p, stage_bindings(p, src_b, dst_b), Staged(), timeout=60,
                            programs={})[0] for p in (prepared, canonical))
        assert posted.num_zero_copy > base.num_zero_copy, (posted, base)


# ---------------------------------------------------------------------------- processes

FEATURES = {
    "default_tuning": ({}, None, "float32", False),      # Tuning.send_stored off: canonical
    "plain": ({}, None, "float32", True),
    "bf16_wire": ({}, "bfloat16", "bfloat16", True),
    "small_buckets": ({"bucket_bytes": 1 << 15, "staging_bytes": 1 << 17}, None, "float32",
                      True),
    "verify": ({"verify": True}, None, "float32", False),
    "check_writes": ({"check_writes": True}, None, "float32", False),
    "delta": ({"delta": True}, None, "float32", False),
}


@pytest.mark.slow
def test_jax_in_out_kernels_to_torch_bit_exact_with_each_feature():
    """One JAX trainer (4 CPU devices, ``[in, out]`` kernels bound with ``transpose=``,
    ``Tuning(send_stored=True)`` but in the first case) and two torch receivers: each case
    its own world and Refit, 3 calls (FP8: 2), every destination
    byte compared on its receiver; the trainer reports which tensors its prepared call
    sends in storage order (all the kernels, or none where a feature needs canonical
    bytes, or the default tuning). Last, FP8: a kernel the receivers store block-FP8 (codes and scales compared
    with the host quantizer's, vLLM's bytes) beside one they store bf16."""
    programs = [[name, "jax_sender", "torch_receiver",
                 [cfg, wire, dst, name != "default_tuning"]]
                for name, (cfg, wire, dst, _) in FEATURES.items()]
    programs.append(["fp8", "jax_fp8_sender", "torch_fp8_receiver", []])
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(2)]
    results = launch(cases.series, roles, args=(programs,), timeout=600)
    runs = [r.value for r in results]
    for name in [*FEATURES, "fp8"]:
        for res, run in zip(results, runs):
            if "error" in run[name]:
                pytest.fail(f"{name} on {res.role.label}:\n{run[name]['error']}")
    for name, (_, _, _, flips) in FEATURES.items():
        sender, *receivers = [run[name]["value"] for run in runs]
        assert all(r["checked"] > 0 and r["version"] == cases.STEPS for r in receivers), name
        assert sender["transposed"] == (sorted(cases.KERNELS) if flips else []), name
    # an FP8 destination's kernel is quantized in canonical order, its bf16 neighbour not
    sender, *receivers = [run["fp8"]["value"] for run in runs]
    assert sender["transposed"] == ["k8"]
    assert all(r["checked"] == 6 and r["version"] == 2 for r in receivers)
