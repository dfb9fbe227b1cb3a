"""verify: end-to-end checksums agree exactly when the bytes arrived, and name the transfer
when they did not. Every rank is simulated in one process (testing.run_local moves the
bytes the way the executor does); "processes" are groups of ranks hashing separately."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xreshard as xr
from xreshard.runtime import verify
from xreshard.dtypes import ITEMSIZE, numpy_dtype
from xreshard.runtime.copies import view_of
from xreshard.planner.plan import plan
from xreshard.tools.testing import local_arrays_from_global, run_local
from xreshard.ir.topology import Topology

TRAINER = (0, 1, 2, 3)            # process 0: 4 ranks
ROLLOUT = ((4,), (5,))            # processes 1 and 2: one rank each
PROCS = [TRAINER, *ROLLOUT]


def _topology(procs=PROCS) -> Topology:
    return Topology.of({r: (p, "host") for p, ranks in enumerate(procs) for r in ranks})


def _values(shape, dtype, seed=0, special=True):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    v = (rng.standard_normal(shape) * 3).astype(np.float32)
    if special and v.size >= 4:
        flat = v.reshape(-1)
        flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return v.astype(dt)


def _refit(src, dst, values, *, wire=None, procs=PROCS, src_view=None):
    """Plan and move ``values`` from ``src`` to ``dst`` layouts; returns the plan and the
    bindings of both sides (``src_view(name, array)`` may re-view a source binding)."""
    p = plan(src, dst, _topology(procs), wire_dtype=wire)
    sources = {}
    for name, lay in src.items():
        for r in lay.ranks:
            local = local_arrays_from_global(lay, r, values[name])
            if src_view is not None:
                local = src_view(name, local)
            sources.setdefault(r, {})[name] = local
    out = run_local(p, sources)
    src_b = {(r, n): a for r, d in sources.items() for n, a in d.items()}
    dst_b = {(r, n): a for r, d in out.items() for n, a in d.items()}
    return p, src_b, dst_b


def _digests(p, src_b, dst_b, procs=PROCS, **kw):
    return [verify.digest_bindings(p, ranks, {k: v for k, v in src_b.items() if k[0] in ranks},
                           {k: v for k, v in dst_b.items() if k[0] in ranks}, **kw)
            for ranks in procs]


def _compare(ds):
    summaries = json.loads(json.dumps([d.summary for d in ds]))     # they travel as JSON
    return verify.mismatches(summaries)


def _flip(dst_b, p, rank, name, index=0):
    """Flip the lowest bit of one element of the ``index``-th region ``rank`` receives of
    ``name``; returns that transfer."""
    t = [t for t in p.transfers_for(rank) if t.dst == rank and t.name == name][index]
    _flip_first(view_of(dst_b[(rank, name)], p.dst_layouts[name], rank, t.region))
    return t


def _flip_first(v):
    """Flip the lowest bit of ``v``'s first element, whatever its dtype and strides."""
    first = v.reshape(1) if v.ndim == 0 else v[tuple(slice(0, 1) for _ in range(v.ndim))]
    first.view(np.uint8).reshape(-1)[0] ^= 1


def _tp(shape, dtype, ranks, placement):
    return xr.Layout.from_placements(shape, dtype, xr.Mesh((len(ranks),), ranks), [placement])


def _model(dtype="float32", dst_dtype=None):
    dst_dtype = dst_dtype or dtype
    shapes = {"w": ((16, 12), "S0", "S1"), "u": ((12, 10), "S1", "S0"),
              "norm": ((12,), "R", "R"), "emb": ((20, 6), "S0", "S0")}
    src = {n: _tp(s, dtype, TRAINER, a) for n, (s, a, _) in shapes.items()}
    dst = {n: _tp(s, dst_dtype, (4, 5), b) for n, (s, _, b) in shapes.items()}
    values = {n: _values(s, dtype, i) for i, (n, (s, _, _)) in enumerate(shapes.items())}
    return src, dst, values


def test_equal_when_exact_and_summary_is_json():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    ds = _digests(p, src_b, dst_b)
    assert _compare(ds) == []
    # every transfer hashed once on each side, with the same keys
    assert set(ds[0].send) == set(ds[1].recv) | set(ds[2].recv)
    assert ds[0].recv == {} and ds[1].send == {} and ds[2].send == {}
    assert len(ds[0].send) == sum(1 for _ in p.iter_transfers())
    assert ds[1].nbytes + ds[2].nbytes == p.stats.bytes_moved     # receivers hash all they get
    # the sender's digest is the checksum of the bytes the receiver must hold
    t = next(iter(p.iter_transfers()))
    want = values[t.name][t.region.slices()]
    assert ds[0].send[verify.key_of(t.name, t.region, t.src, t.dst)] == verify.checksum(want)


def test_a_flipped_byte_is_caught_and_named():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    t = _flip(dst_b, p, 5, "u", index=1)
    bad = _compare(_digests(p, src_b, dst_b))
    assert len(bad) == 1
    m = bad[0]
    assert (m.name, m.region, m.src, m.dst) == ("u", str(t.region), t.src, 5)
    assert (m.src_process, m.dst_process) == (0, 2) and m.located
    names = {0: "trainer[0] (process 0)", 1: "rollout[0] (process 1)", 2: "rollout[1] (process 2)"}
    text = verify.message(bad, names.__getitem__)
    assert f"tensor 'u' region {t.region}" in text
    assert f"sender rank {t.src} (trainer[0] (process 0))" in text
    assert "receiver rank 5 (rollout[1] (process 2))" in text
    assert "1 transfer(s)" in text


def test_flip_in_every_dtype_is_caught():
    for dtype in sorted(ITEMSIZE):
        src = {"x": _tp((8, 6), dtype, TRAINER, "S0")}
        dst = {"x": _tp((8, 6), dtype, (4, 5), "S1")}
        p, src_b, dst_b = _refit(src, dst, {"x": _values((8, 6), dtype, 3)})
        assert _compare(_digests(p, src_b, dst_b)) == [], dtype
        _flip(dst_b, p, 4, "x")
        bad = _compare(_digests(p, src_b, dst_b))
        assert [(m.name, m.dst) for m in bad] == [("x", 4)], dtype


@pytest.mark.parametrize("src_dtype,wire,dst_dtype", [
    ("float32", "bfloat16", "bfloat16"),      # the common one: the wire carries bf16
    ("float32", "bfloat16", "float32"),       # values rounded through bf16 on the way
    ("bfloat16", "bfloat16", "float32"),      # the receiver widens
    ("float32", "float8_e4m3fn", "float8_e4m3fn"),
    ("float32", "float16", "bfloat16"),
])
def test_casts_hash_what_the_receiver_holds(src_dtype, wire, dst_dtype):
    src, dst, values = _model(src_dtype, dst_dtype)
    p, src_b, dst_b = _refit(src, dst, values, wire=wire)
    ds = _digests(p, src_b, dst_b)
    assert _compare(ds) == []
    # the sender did cast: its digest is not the checksum of its own bits
    t = next(t for t in p.iter_transfers() if t.name == "w")
    raw = verify.checksum(values["w"][t.region.slices()])
    assert ds[0].send[verify.key_of(t.name, t.region, t.src, t.dst)] != raw
    _flip(dst_b, p, 4, "w")
    assert [(m.name, m.dst) for m in _compare(_digests(p, src_b, dst_b))] == [("w", 4)]


def test_transposed_source_and_destination_views():
    """A Flax [in, out] kernel binds its [out, in] tensor as a transposed view; so can a
    receiver. The digests are of canonical row-major bytes on both sides."""
    shape = (96, 80)
    src = {"k": _tp(shape, "bfloat16", TRAINER, "S1")}
    dst = {"k": _tp(shape, "bfloat16", (4, 5), "S0")}
    values = {"k": _values(shape, "bfloat16", 5)}
    p, src_b, dst_b = _refit(src, dst, values,
                             src_view=lambda n, a: np.ascontiguousarray(a.T).T)
    assert not src_b[(0, "k")].flags.c_contiguous
    # the receiver's memory is transposed too
    dst_t = {k: np.ascontiguousarray(v.T).T for k, v in dst_b.items()}
    assert _compare(_digests(p, src_b, dst_t)) == []
    _flip(dst_t, p, 5, "k")
    assert [(m.name, m.dst) for m in _compare(_digests(p, src_b, dst_t))] == [("k", 5)]


def test_element_order_matters():
    """Moving the right bytes to the wrong places is caught (a transpose bug)."""
    src = {"s": _tp((8, 8), "float32", TRAINER, "R")}
    dst = {"s": _tp((8, 8), "float32", (4, 5), "R")}
    values = {"s": _values((8, 8), "float32", 9, special=False)}
    p, src_b, dst_b = _refit(src, dst, values)
    dst_b[(4, "s")][...] = dst_b[(4, "s")].T.copy()
    bad = _compare(_digests(p, src_b, dst_b))
    assert bad and {(m.name, m.dst) for m in bad} == {("s", 4)}


def test_explicit_layouts_and_local_copies():
    """Explicit layouts bind a list of arrays; colocated ranks copy locally and are checked."""
    shape = (10, 7)
    src = {"e": xr.Layout.explicit_form(shape, "float32", {
        0: [[(0, 4), (0, 7)], [(4, 10), (0, 3)]], 1: [[(4, 10), (3, 7)]]})}
    dst = {"e": xr.Layout.explicit_form(shape, "float32", {
        1: [[(0, 10), (0, 7)]], 2: [[(2, 9), (1, 6)], [(9, 10), (0, 7)]]})}
    procs = [(0, 1), (2,)]
    values = {"e": _values(shape, "float32", 11)}
    p, src_b, dst_b = _refit(src, dst, values, procs=procs)
    assert p.local_copies_for(1)
    ds = _digests(p, src_b, dst_b, procs=procs)
    assert _compare(ds) == []
    local_keys = [k for k in ds[0].recv if k.endswith("|1->1")]
    assert local_keys and all(k in ds[0].send for k in local_keys)
    # a wrong byte in a local copy's destination is caught too
    t = p.local_copies_for(1)[0]
    _flip_first(view_of(dst_b[(1, "e")], p.dst_layouts["e"], 1, t.region))
    bad = _compare(_digests(p, src_b, dst_b, procs=procs))
    assert [(m.src, m.dst, m.src_process, m.dst_process) for m in bad] == [(1, 1, 0, 0)]


def test_zero_d_and_zero_size_tensors():
    src = {"scalar": _tp((), "float32", TRAINER, "R"),
           "empty": _tp((0, 4), "float32", TRAINER, "S0"),
           "short": _tp((3, 2), "float32", TRAINER, "S0"),      # rank 3 holds nothing
           "empty_rep": _tp((5, 0), "bfloat16", TRAINER, "R")}
    dst = {"scalar": _tp((), "float32", (4, 5), "R"),
           "empty": _tp((0, 4), "float32", (4, 5), "S1"),
           "short": _tp((3, 2), "float32", (4, 5), "S0"),
           "empty_rep": _tp((5, 0), "bfloat16", (4, 5), "S0")}
    values = {"scalar": np.array(np.nan, np.float32), "empty": np.zeros((0, 4), np.float32),
              "short": _values((3, 2), "float32", 2),
              "empty_rep": np.zeros((5, 0), numpy_dtype("bfloat16"))}
    p, src_b, dst_b = _refit(src, dst, values)
    ds = _digests(p, src_b, dst_b)
    assert _compare(ds) == []
    assert any(k.startswith("scalar|[]|") for k in ds[1].recv)
    dst_b[(5, "scalar")][...] = np.float32(1.0)
    bad = _compare(_digests(p, src_b, dst_b))
    assert [(m.name, m.region, m.dst) for m in bad] == [("scalar", "[]", 5)]


def test_replicated_destination_hashes_each_source_region_once():
    src = {"r": _tp((64, 64), "float32", TRAINER, "S0")}
    dst = {"r": _tp((64, 64), "float32", (4, 5), "R")}
    p, src_b, dst_b = _refit(src, dst, {"r": _values((64, 64), "float32", 4)})
    ds = _digests(p, src_b, dst_b)
    assert _compare(ds) == []
    assert len(ds[0].send) == 8                    # 4 regions x 2 receivers
    assert ds[0].nbytes == 64 * 64 * 4             # but each region hashed once


def test_sample_mode_covers_everything_over_a_period(monkeypatch):
    monkeypatch.setattr(verify, "SAMPLE_SMALL_BYTES", 0)
    shapes = {f"t{i}": (32, 16) for i in range(12)}
    src = {n: _tp(s, "float32", TRAINER, "S0") for n, s in shapes.items()}
    dst = {n: _tp(s, "float32", (4, 5), "S1") for n, s in shapes.items()}
    values = {n: _values(s, "float32", i) for i, (n, s) in enumerate(shapes.items())}
    p, src_b, dst_b = _refit(src, dst, values)
    everything = set(_digests(p, src_b, dst_b)[0].send)
    covered = set()
    for version in range(verify.SAMPLE_PERIOD):
        ds = _digests(p, src_b, dst_b, mode="sample", version=version)
        assert set(ds[0].send) == set(ds[1].recv) | set(ds[2].recv)
        assert len(ds[0].send) < len(everything)
        assert _compare(ds) == []
        covered |= set(ds[0].send)
    assert covered == everything
    # a flip is caught in the call whose slot holds its transfer
    t = _flip(dst_b, p, 4, "t3")
    key = verify.key_of(t.name, t.region, t.src, t.dst)
    caught = [v for v in range(verify.SAMPLE_PERIOD)
              if _compare(_digests(p, src_b, dst_b, mode="sample", version=v))]
    assert caught == [v for v in range(verify.SAMPLE_PERIOD)
                      if key in _digests(p, src_b, dst_b, mode="sample", version=v)[0].send]
    assert len(caught) == 1


def test_send_and_recv_halves_merge_into_the_whole():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    whole = verify.digest_bindings(p, range(6), src_b, dst_b)
    half = verify.digest_bindings(p, range(6), src_b, dst_b, sides="send").merge(
        verify.digest_bindings(p, range(6), src_b, dst_b, sides="recv"))
    assert (half.send, half.recv, half.nbytes) == (whole.send, whole.recv, whole.nbytes)
    assert verify.mismatches([half.summary]) == []


def test_what_refit_calls_digests_from_an_executor_and_compare_with_names():
    """``Refit`` passes its executor and gathers the JSON; compare returns messages."""
    from types import SimpleNamespace

    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    outcomes = []
    for ranks in PROCS:
        ex = SimpleNamespace(src_bindings={k: v for k, v in src_b.items() if k[0] in ranks},
                             dst_bindings={k: v for k, v in dst_b.items() if k[0] in ranks})
        outcomes.append(verify.digests(p, ex, ranks, version=2))
    outcomes = json.loads(json.dumps(outcomes))
    world = SimpleNamespace(describe_process=lambda i: f"proc#{i}")
    messages, compared = verify.compare(outcomes, world)
    assert messages == [] and compared == sum(1 for _ in p.iter_transfers())
    t = _flip(dst_b, p, 4, "w")
    outcomes[1] = verify.digests(p, SimpleNamespace(src_bindings={}, dst_bindings={
        k: v for k, v in dst_b.items() if k[0] == 4}), (4,), version=2)
    messages, _ = verify.compare(outcomes, world)
    assert messages == [verify.mismatches(outcomes)[0].describe(world.describe_process)]
    assert f"tensor 'w' region {t.region}" in messages[0]
    assert f"sender rank {t.src} (proc#0) -> receiver rank 4 (proc#1)" in messages[0]
    sampled = verify.digests(p, SimpleNamespace(src_bindings=src_b, dst_bindings={}), TRAINER,
                             sample=True, version=2)
    assert sampled["mode"] == "sample"


def test_sample_mode_always_hashes_small_transfers():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    full = _digests(p, src_b, dst_b)
    sample = _digests(p, src_b, dst_b, mode="sample", version=3)
    assert set(sample[0].send) == set(full[0].send)      # every transfer here is < 64 KiB


def test_off_hashes_nothing_and_bad_mode_is_refused():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    ds = _digests(p, src_b, dst_b, mode=False)
    assert all(not d.send and not d.recv for d in ds) and _compare(ds) == []
    with pytest.raises(xr.RefitError, match="verify must be False, True or 'sample'"):
        verify.digest_bindings(p, TRAINER, src_b, {}, mode="all")


def test_big_plans_summarize_per_rank_pair_then_locate(monkeypatch):
    monkeypatch.setattr(verify, "INLINE_TRANSFERS", 0)
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    t = _flip(dst_b, p, 4, "emb")
    ds = _digests(p, src_b, dst_b)
    summaries = json.loads(json.dumps([d.summary for d in ds]))
    assert all("detail" not in s for s in summaries)
    bad = verify.mismatches(summaries)
    assert [(m.pair, m.located) for m in bad] == [(f"{t.src}->4", False)]
    assert "transfer(s) differ" in str(bad[0])
    # the second exchange carries only that pair's digests
    more = json.loads(json.dumps([d.details(bad) for d in ds]))
    assert all(k.endswith(f"|{t.src}->4") for d in more for side in d.values() for k in side)
    located = verify.mismatches(summaries, details=more)
    assert [(m.name, m.region, m.src, m.dst, m.located) for m in located] == [
        ("emb", str(t.region), t.src, 4, True)]


def test_missing_receiver_digest_is_a_mismatch():
    src, dst, values = _model()
    p, src_b, dst_b = _refit(src, dst, values)
    ds = _digests(p, src_b, dst_b)
    key = next(iter(ds[1].recv))
    del ds[1].recv[key]
    bad = _compare(ds)
    assert len(bad) == 1 and bad[0].received is None and "no receiver digest" in str(bad[0])


# ---------------------------------------------------------------------------- the checksum


@given(st.binary(min_size=1, max_size=9000), st.data())
@settings(max_examples=150, deadline=None)
def test_checksum_catches_any_single_byte_change(data, draw):
    a = np.frombuffer(data, np.uint8).copy()
    i = draw.draw(st.integers(0, a.size - 1))
    delta = draw.draw(st.integers(1, 255))
    b = a.copy()
    b[i] = (int(b[i]) + delta) % 256
    assert verify.checksum(a) != verify.checksum(b)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=2000, unique=True), st.data())
@settings(max_examples=150, deadline=None)
def test_checksum_catches_two_words_exchanged(words, draw):
    a = np.array(words, np.uint64)
    i = draw.draw(st.integers(0, a.size - 1))
    j = draw.draw(st.integers(0, a.size - 1).filter(lambda j: j != i))
    b = a.copy()
    b[[i, j]] = b[[j, i]]
    assert verify.checksum(a) != verify.checksum(b)


def test_checksum_depends_on_bytes_not_strides_and_streams_in_pieces(monkeypatch):
    x = _values((300, 700), "float32", 1)
    t = np.ascontiguousarray(x.T)
    assert verify.checksum(x.T) == verify.checksum(t) != verify.checksum(x)
    assert verify.checksum(np.asfortranarray(x)) == verify.checksum(x)
    # a strided region copied through small scratch slabs (rows split across pieces)
    monkeypatch.setattr(verify, "_SCRATCH_BYTES", 1000)
    assert verify.checksum(x.T) == verify.checksum(t)
    assert verify.checksum(x[:, ::3]) == verify.checksum(np.ascontiguousarray(x[:, ::3]))
    # the length counts: zero bytes add nothing to the sums
    zeros = {verify.checksum(np.zeros(n, np.uint8)) for n in (0, 1, 8, 4096, 4097)}
    assert len(zeros) == 5


def test_import_is_light():
    import subprocess
    import sys
    code = ("import sys, xreshard.runtime.verify; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- real processes


def verify_child(ctx, mode):
    """trainer[0] (2 ranks) -> rollout[0], rollout[1]; rollout[1] corrupts one received
    byte in the first call (after the executor ran), then behaves."""
    import xreshard as xr
    from xreshard.runtime import execute

    world = ctx.join(groups=["trainer", "rollout"], timeout=60)
    t_ranks, r_ranks = world.group_ranks("trainer"), world.group_ranks("rollout")
    names = {"w": ((16, 12), "S0", "S1"), "u": ((12, 10), "S1", "S0")}
    values = {n: _values(s, "float32", i, special=False) for i, (n, (s, _, _)) in
              enumerate(names.items())}
    if ctx.role.group == "trainer":
        lays = {n: _tp(s, "float32", t_ranks, a) for n, (s, a, _) in names.items()}
        arrays = {(r, n): local_arrays_from_global(lays[n], r, values[n])
                  for r in world.rank_ids for n in names}
        side = {"send": xr.Bound(lays, arrays)}
    else:
        lays = {n: _tp(s, "float32", r_ranks, b) for n, (s, _, b) in names.items()}
        arrays = {(r, n): np.zeros(lays[n].local_shape(r), np.float32)
                  for r in world.rank_ids for n in names}
        side = {"receive": xr.Bound(lays, arrays)}
        if ctx.role.index == 1:
            run = execute.Executor.run
            calls = []

            def corrupting_run(self):
                stats = run(self)
                calls.append(1)
                if len(calls) == 1:
                    _flip_first(next(iter(sorted(self.dst_bindings.items())))[1])
                return stats

            execute.Executor.run = corrupting_run
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=20, verify=mode), **side)
    out = {}
    try:
        refit()
        out["first"] = "no error"
    except Exception as e:     # noqa: BLE001
        out["first"] = f"{type(e).__name__}: {e}"
    out.update(version=refit.version, stale=refit.stale)
    report = refit()
    out.update(second_version=refit.version, verified=getattr(report, "verified", None))
    if ctx.role.group == "rollout":
        for (r, n), a in arrays.items():
            want = local_arrays_from_global(lays[n], r, values[n])
            assert a.tobytes() == np.ascontiguousarray(want).tobytes(), n
    world.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", [True, "sample"])
def test_refit_verify_catches_a_corrupted_byte_on_every_rank(mode):
    import dataclasses

    from xreshard.tools.launch import Role, launch

    if "verify" not in {f.name for f in dataclasses.fields(xr.RefitConfig)}:
        pytest.skip("RefitConfig has no verify= yet")
    roles = [Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1)]
    results = launch(f"{__name__}:verify_child", roles, args=(mode,), timeout=120)
    outs = [r.value for r in results]
    firsts = {o["first"] for o in outs}
    assert len(firsts) == 1, firsts                       # the same error everywhere
    first = firsts.pop()
    assert first.startswith("VerificationError: "), first
    assert "'u'" in first or "'w'" in first
    assert "rollout[1]" in first and "trainer[0]" in first and "receiver rank 3" in first
    assert all(o["version"] == 0 and o["stale"] for o in outs)
    assert all(o["second_version"] == 1 for o in outs)   # the next refit works
    assert all(o["verified"] for o in outs)
