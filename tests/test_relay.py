"""Relay through destination replicas (issue 12 part 4): the pure stage layouts, and real
processes on declared hosts moving each byte across hosts once per host."""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.errors import RefitError
from xreshard.ir.geometry import Region
from xreshard.tools.launch import Context, Role, launch
from xreshard.planner.plan import plan
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.planner.relay import overlapped_schedule, relay_layouts
from xreshard.planner.schedule import peer_counts, schedule
from xreshard.ir.topology import Topology

# ---------------------------------------------------------------------------- pure


def _topology(hosts: dict[int, str]) -> Topology:
    return Topology.of({r: (r, h) for r, h in hosts.items()})


def _cover(layout: xr.Layout) -> dict[int, np.ndarray]:
    """rank -> how many times each element is held by that rank."""
    out = {}
    for r in layout.ranks:
        count = np.zeros(layout.shape, np.int64)
        for reg in layout.regions(r):
            count[tuple(slice(a, b) for a, b in zip(reg.starts, reg.stops))] += 1
        out[r] = count
    return out


def _check_exactly_once(src: dict, dst: dict, topo: Topology) -> None:
    """Stage 1 + stage 2 give every destination rank each of its elements exactly once, a
    stage-2 piece is held by one rank of the receiver's host, and stage 1 holds within
    what each rank needs."""
    stages = relay_layouts(src, dst, topo)
    for name, lay in dst.items():
        need = _cover(lay)
        one = _cover(stages.stage1_dst[name])
        two = _cover(stages.stage2_dst[name]) if name in stages.stage2_dst else {}
        for r, n in need.items():
            got = one.get(r, np.zeros_like(n)) + two.get(r, np.zeros_like(n))
            assert np.array_equal(got, n), (name, r)
        if name in stages.stage2_src:
            fwd = stages.stage2_src[name]
            for r in stages.stage2_dst[name].ranks:
                for reg in stages.stage2_dst[name].regions(r):
                    holders = [h for h in fwd.ranks if topo.host_of(h) == topo.host_of(r)
                               and any(x.contains(reg) for x in fwd.regions(h))]
                    assert len(holders) == 1, (name, r, reg)
                    assert any(x.contains(reg) for x in stages.stage1_dst[name].regions(holders[0]))


def test_replicated_pieces_balanced_and_once_per_host():
    topo = _topology({0: "t", 1: "a", 2: "a", 3: "b", 4: "b"})
    src = {"w": xr.Layout.replicated((8, 4), "float32", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated((8, 4), "float32", xr.Mesh((4,), (1, 2, 3, 4)))}
    stages = relay_layouts(src, dst, topo)
    assert stages.stage1_dst["w"].regions(1) == (Region((0, 0), (4, 4)),)
    assert stages.stage1_dst["w"].regions(2) == (Region((4, 0), (8, 4)),)
    assert stages.stage2_dst["w"].regions(1) == (Region((4, 0), (8, 4)),)
    assert stages.bytes_relayed == 2 * 8 * 4 * 4
    _check_exactly_once(src, dst, topo)
    p1 = plan(src, stages.stage1_dst, topology=topo)
    p2 = plan(stages.stage2_src, stages.stage2_dst, topology=topo)
    assert p1.stats.bytes_moved == 2 * 128            # one copy per host, not four
    assert p2.stats.bytes_moved == 2 * 128
    assert all(topo.host_of(t.src) == topo.host_of(t.dst) for t in p2.iter_transfers())
    direct = plan(src, dst, topology=topo)
    assert direct.stats.bytes_moved == 4 * 128


def test_tp_replicas_mixed_layouts_and_many_tensors_balanced():
    """Two TP=2 replicas per host, one of them split on dim 1: pieces come from the grid."""
    hosts = {0: "t", 1: "t"} | {r: "a" for r in range(2, 6)} | {r: "b" for r in range(6, 10)}
    topo = _topology(hosts)
    src, dst = {}, {}
    for i in range(12):
        name = f"layer{i:02d}"
        src[name] = xr.Layout.from_placements((16, 12), "bfloat16", xr.Mesh((2,), (0, 1)),
                                              ["S0"])
        tp = xr.Mesh((2, 2, 2), (2, 3, 4, 5, 6, 7, 8, 9))   # (host, replica, tp)
        dst[name] = xr.Layout.from_placements((16, 12), "bfloat16", tp, ["R", "R", "S0"]) \
            if i % 2 else xr.Layout.explicit_form((16, 12), "bfloat16", {
                2: [[(0, 8), (0, 12)]], 3: [[(8, 16), (0, 12)]],
                4: [[(0, 16), (0, 6)]], 5: [[(0, 16), (6, 12)]],
                6: [[(0, 8), (0, 12)]], 7: [[(8, 16), (0, 12)]],
                8: [[(0, 16), (0, 6)]], 9: [[(0, 16), (6, 12)]]})
    _check_exactly_once(src, dst, topo)
    stages = relay_layouts(src, dst, topo)
    p1 = plan(src, stages.stage1_dst, topology=topo)
    whole = 16 * 12 * 2 * 12
    assert p1.stats.bytes_moved == 2 * whole                # once per host
    got = p1.stats.bytes_received
    assert max(got.values()) <= 1.25 * min(got[r] for r in range(2, 10))   # balanced


def test_no_relay_where_sources_share_the_host_or_one_rank_needs_it():
    topo = _topology({0: "a", 1: "a", 2: "a", 3: "b"})
    src = {"w": xr.Layout.replicated((6, 2), "float32", xr.Mesh((1,), (0,)))}
    dst = {"w": xr.Layout.replicated((6, 2), "float32", xr.Mesh((3,), (1, 2, 3)))}
    stages = relay_layouts(src, dst, topo)
    assert not stages.forwards and stages.bytes_relayed == 0
    assert stages.stage1_dst["w"].regions(3) == (Region((0, 0), (6, 2)),)
    _check_exactly_once(src, dst, topo)
    assert not relay_layouts(src, dst, None).forwards      # no topology: no domains


def test_scalar_and_empty_tensors():
    topo = _topology({0: "t", 1: "a", 2: "a"})
    src = {n: xr.Layout.replicated(s, "float32", xr.Mesh((1,), (0,)))
           for n, s in (("s", ()), ("e", (0, 3)), ("r", (1, 5)))}
    dst = {n: xr.Layout.replicated(lay.shape, "float32", xr.Mesh((2,), (1, 2)))
           for n, lay in src.items()}
    _check_exactly_once(src, dst, topo)


def test_config_relay_is_validated():
    assert xr.RefitConfig().relay == "off"
    with pytest.raises(RefitError, match=r"relay must be 'off', 'on' or 'auto', got 'yes'"):
        xr.RefitConfig(relay="yes")


# ---------------------------------------------------------------------------- processes

TENSORS = {"w": ((64, 32), "float32"), "b": ((7,), "float32"), "i": ((5, 3), "int32")}
COPY_BYTES = sum(int(np.prod(s)) * 4 for s, _ in TENSORS.values())


def _values(version: int) -> dict[str, np.ndarray]:
    return {n: (np.arange(int(np.prod(s))).reshape(s) * 3 + 1000 * version).astype(d)
            for n, (s, d) in TENSORS.items()}


def _host(role: Role) -> str:
    return "t" if role.group == "trainer" else "ab"[role.index // 2]


def relay_world(ctx: Context, modes: list, kill: bool) -> dict:
    """Two refits in a world per relay mode in ``modes``, one world after another (world
    id = the mode): mode -> what this process saw."""
    return {mode: _relay_run(ctx, mode, kill) for mode in modes}


def _relay_run(ctx: Context, mode: str, kill: bool) -> dict:
    import time
    config = xr.RefitConfig(timeout=10 if kill else 60, relay=mode, bucket_bytes=2048,
                            verify=mode == "on")
    out: dict = {}
    with ctx.join(1, timeout=60, host=_host(ctx.role), world_id=mode) as world:
        rank = world.rank_ids[0]
        trainer = ctx.role.group == "trainer"
        dest = {n: np.full(s, -1, d) for n, (s, d) in TENSORS.items()}
        if trainer:
            def bound(v):
                vals = _values(v)
                return xr.Bound({n: xr.Layout.replicated(a.shape, a.dtype, xr.Mesh((1,), (rank,)))
                                 for n, a in vals.items()},
                                {(rank, n): a for n, a in vals.items()})
            refit = xr.Refit(world, send=bound(1), config=config)
        else:
            layouts = {n: xr.Layout.explicit_form(a.shape, a.dtype, {rank: [[(0, k) for k in a.shape]]})
                       for n, a in dest.items()}
            refit = xr.Refit(world, receive=xr.Bound(layouts, {(rank, n): [a] for n, a in dest.items()},
                                                     local_only=set(dest)),
                              config=config)
        if kill and ctx.role.group == "rollout" and ctx.role.index == 1:
            # a relay rank dies mid-refit: some of its stage 1 in, some forwards out
            from .refit_cases import die_after_first_unpack
            die_after_first_unpack()
        out["reports"] = []
        for v in (1, 2):
            t0 = time.monotonic()
            try:
                r = refit(send=bound(v)) if trainer else refit()
            except Exception as e:      # noqa: BLE001 - the test compares what was raised
                out["error"] = type(e).__name__
                out["message"] = str(e)
                out["seconds"] = time.monotonic() - t0
                return out
            out["reports"].append({"sent": r.bytes_sent, "forwarded": r.bytes_forwarded,
                                   "received": r.bytes_received, "replanned": r.replanned,
                                   "moved_world": r.bytes_moved_world,
                                   "verified": r.verified,
                                   "by_transport": r.bytes_by_transport})
            if not trainer:
                out[f"exact{v}"] = all(np.array_equal(dest[n], a) for n, a in _values(v).items())
    return out


def _roles() -> list[Role]:
    return [Role("plain", "trainer", 0)] + [Role("plain", "rollout", i) for i in range(4)]


MODES = ["on", "auto", "off"]


@pytest.fixture(scope="module")
def relay_modes() -> dict:
    """mode -> every process's values: the three modes in one launch, a world each (one
    launch of five processes instead of three)."""
    values = [r.value for r in launch(relay_world, _roles(), args=(MODES, False),
                                      timeout=240 + 120 * (len(MODES) - 1),
                                      env={"XRESHARD_SHM": "0"})]
    return {mode: [v[mode] for v in values] for mode in MODES}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_relay_sends_one_copy_per_host_bit_exact(mode, relay_modes):
    values = relay_modes[mode]
    assert all("error" not in v for v in values), values
    trainer, receivers = values[0], values[1:]
    copies = 4 if mode == "off" else 2
    for k in range(2):
        assert trainer["reports"][k]["sent"] == copies * COPY_BYTES
        assert trainer["reports"][k]["forwarded"] == 0
        forwarded = sum(v["reports"][k]["forwarded"] for v in receivers)
        assert forwarded == (4 - copies) * COPY_BYTES
        assert all(v["reports"][k]["sent"] == 0 for v in receivers)
        assert all(v["reports"][k]["received"] == COPY_BYTES for v in receivers)
        assert trainer["reports"][k]["moved_world"] == 4 * COPY_BYTES
    assert all(v["exact1"] and v["exact2"] for v in receivers)
    if mode == "on":        # verify=True checks both stages' transfers
        assert all(v["reports"][1]["verified"] > 0 for v in values)
    assert [r["replanned"] for r in trainer["reports"]] == [True, False]


@pytest.mark.slow
def test_dead_relay_rank_fails_everyone_within_timeout():
    results = launch(relay_world, _roles(), args=(["on"], True), timeout=240, check=False,
                     env={"XRESHARD_SHM": "0"}, fail_fast=False)
    assert results[2].returncode == 3
    for i, res in enumerate(results):
        if i == 2:
            continue
        assert res.ok, res.output
        got = res.value["on"]
        assert got["error"] in ("TransportTimeout", "TransportError",
                                "CollectiveMismatch"), got
        assert got["seconds"] < 10 + 5        # the timeout + 5 s
    messages = {res.value["on"]["message"] for i, res in enumerate(results) if i != 2}
    assert len(messages) == 1 and "rollout[1]" in next(iter(messages)), messages


def relay_frameworks(ctx: Context) -> dict:
    """A JAX trainer (one CPU device) and torch receivers holding plain tensors whole."""
    config = xr.RefitConfig(timeout=60, relay="on")
    out: dict = {}
    with ctx.join(timeout=60, host=_host(ctx.role)) as world:
        if ctx.role.kind == "jax":
            import jax
            device = jax.local_devices()[0]
            for v in (1, 2):
                params = {n: jax.device_put(a, device) for n, a in _values(v).items()}
                r = (refit(send=params) if v == 2 else
                     (refit := xr.Refit(world, send=params, config=config))())
                out[f"sent{v}"] = r.bytes_sent
        else:
            import torch
            dest = {n: torch.full(s, -1, dtype=getattr(torch, d)) for n, (s, d) in TENSORS.items()}
            refit = xr.Refit(world, receive=dest, config=config)
            for v in (1, 2):
                r = refit()
                out[f"forwarded{v}"] = r.bytes_forwarded
                out[f"exact{v}"] = all(np.array_equal(dest[n].numpy(), a)
                                       for n, a in _values(v).items())
    return out


@pytest.mark.slow
def test_relay_jax_trainer_to_torch_receivers():
    roles = [Role("jax", "trainer", 0, num_devices=1)] + [Role("torch", "rollout", i)
                                                            for i in range(4)]
    values = [r.value for r in launch(relay_frameworks, roles, timeout=300,
                                      env={"XRESHARD_SHM": "0"})]
    assert values[0]["sent1"] == values[0]["sent2"] == 2 * COPY_BYTES
    for v in (1, 2):
        assert sum(x[f"forwarded{v}"] for x in values[1:]) == 2 * COPY_BYTES
        assert all(x[f"exact{v}"] for x in values[1:])


def test_stage2_tags_continue_after_stage1_for_pairs_in_both_stages():
    """Rank 1 sources ``a`` (host "a" relays nothing of it) and relays ``b`` to rank 2: the
    pair (1, 2) talks in both stages of one overlapped schedule, so its stage-2 tags
    must not reuse stage 1's."""
    topo = _topology({0: "t", 1: "a", 2: "a"})
    src = {"a": xr.Layout.replicated((8, 4), "float32", xr.Mesh((1,), (1,))),
           "b": xr.Layout.replicated((8, 4), "float32", xr.Mesh((1,), (0,)))}
    dst = {n: xr.Layout.replicated((8, 4), "float32", xr.Mesh((2,), (1, 2))) for n in src}
    stages = relay_layouts(src, dst, topo)
    assert set(stages.stage2_dst) == {"b"}
    p1 = plan(src, stages.stage1_dst, topology=topo)
    p2 = plan(stages.stage2_src, stages.stage2_dst, topology=topo)
    for ranks in ([1], [2], [1, 2]):
        s = overlapped_schedule(p1, p2, ranks, bucket_bytes=64, staging_bytes=1 << 20)
        pair = [b for rnd in s.rounds for b in rnd if (b.src, b.dst) == (1, 2)]
        tags1 = {b.tag for b in pair if b.stage == 0}
        tags2 = {b.tag for b in pair if b.stage == 1}
        assert tags1 and tags2 and min(tags2) > max(tags1), (ranks, tags1, tags2)
        assert sorted(tags2) == list(range(max(tags1) + 1, max(tags1) + 1 + len(tags2)))


# ---------------------------------------------------------------------------- overlap

HOSTS5 = {0: "t", 1: "a", 2: "a", 3: "b", 4: "b"}


def _overlap_case(num_tensors: int = 6):
    """One trainer rank, four receivers (two per host) holding every tensor whole: big
    tensors (messages of their own, received in place) and small ones (packed together,
    so received into staging and unpacked)."""
    topo = _topology(HOSTS5)
    shapes = {f"w{i}": (32, 16) for i in range(num_tensors)} | {f"s{i}": (3, 5) for i in range(8)}
    src = {n: xr.Layout.replicated(sh, "float32", xr.Mesh((1,), (0,))) for n, sh in shapes.items()}
    dst = {n: xr.Layout.replicated(sh, "float32", xr.Mesh((4,), (1, 2, 3, 4)))
           for n, sh in shapes.items()}
    stages = relay_layouts(src, dst, topo)
    p1 = plan(src, stages.stage1_dst, topology=topo)
    p2 = plan(stages.stage2_src, stages.stage2_dst, topology=topo)
    return topo, src, dst, stages, p1, p2


def _stage(b) -> int:
    return b.stage + 1


def test_overlapped_schedule_forwards_chunk_c_beside_chunk_c_plus_1():
    """Structure of the overlap: stage-2 buckets share rounds with stage-1 buckets of later
    chunks, no forward reads a region before the round that lands it at its sender has
    completed, both ends of every pair agree, and the whole takes fewer rounds than the
    stages back to back, within the staging budget per rank and round."""
    _, _, _, stages, p1, p2 = _overlap_case()
    kw = dict(bucket_bytes=1024, staging_bytes=1 << 14)
    whole = overlapped_schedule(p1, p2, range(5), **kw)
    mixed = [k for k, rnd in enumerate(whole.rounds) if {_stage(b) for b in rnd} == {1, 2}]
    assert len(mixed) >= 2, [[(_stage(b), b.src, b.dst) for b in rnd] for rnd in whole.rounds]
    landed: dict[int, list] = {}        # rank -> [(tensor, region, round)] of stage 1
    for k, rnd in enumerate(whole.rounds):
        for b in rnd:
            assert b.round == k
            if _stage(b) == 1:
                landed.setdefault(b.dst, []).extend((it.name, it.region, k) for it in b.items)
    for k, rnd in enumerate(whole.rounds):
        for b in (b for b in rnd if _stage(b) == 2):
            for it in b.items:
                name = it.name
                cover = np.zeros(it.region.shape, np.int64)
                for n, reg, j in landed[b.src]:
                    if n == name and j < k and reg.intersect(it.region) is not None:
                        inter = reg.intersect(it.region)
                        cover[tuple(slice(a - o, z - o) for a, z, o in
                                    zip(inter.starts, inter.stops, it.region.starts))] += 1
                assert (cover == 1).all(), (k, b.src, b.dst, it)
    # each process derives the rounds of its pairs alone: the same as the whole world's
    per_rank = {r: overlapped_schedule(p1, p2, [r], **kw) for r in range(5)}
    everyone = {(b.src, b.dst, b.tag): (b.round, b.items) for rnd in whole.rounds for b in rnd}
    for r, sched in per_rank.items():
        for rnd in sched.rounds:
            for b in rnd:
                assert everyone[(b.src, b.dst, b.tag)] == (b.round, b.items), (r, b)
    tags = [(b.src, b.dst, b.tag) for rnd in whole.rounds for b in rnd]
    assert len(tags) == len(set(tags))
    one = schedule(p1, list(range(5)), peer_counts(p1, range(5)), **kw)
    two = schedule(p2, list(range(5)), peer_counts(p2, range(5)), **kw)
    assert len(whole.rounds) < len(one.rounds) + len(two.rounds)
    # without overlap (the benchmark's comparison) no round mixes the stages
    apart = overlapped_schedule(p1, p2, range(5), overlap=False, **kw)
    assert all(len({_stage(b) for b in rnd}) == 1 for rnd in apart.rounds)
    assert len(apart.rounds) > len(whole.rounds)
    for r in range(1, 5):
        for rnd in per_rank[r].rounds:
            assert sum(b.nbytes for b in rnd if r in (b.src, b.dst)) <= kw["staging_bytes"]
    assert per_rank[1].max_round_bytes <= kw["staging_bytes"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_overlapped_run_in_one_process_bit_exact(pipeline):
    """Both executors run the overlapped schedule of a prepared call (all ranks in one
    process, so every pair goes through the local transport): bit-exact, stage 2 counted
    as forwarded. The small tensors are received into staging, so a pipelined executor
    that packed a forward before unpacking the round that brought it would send stale
    bytes."""
    from xreshard.config import Tuning
    from xreshard.dtypes import numpy_dtype
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.tools.testing import local_arrays_from_global
    from xreshard.transport.base import RecordingTransport
    from xreshard.transport.local import LocalTransport

    topo, src, dst, stages, p1, p2 = _overlap_case()
    values = {n: (np.arange(int(np.prod(l.shape))) * 7 + 3).astype(numpy_dtype(l.dtype))
              .reshape(l.shape) for n, l in src.items()}
    src_b = {(0, n): local_arrays_from_global(l, 0, values[n]) for n, l in src.items()}
    real = {(r, n): np.full(l.shape, -1, np.float32) for n, l in dst.items() for r in l.ranks}
    options = CallOptions(bucket_bytes=1024, staging_bytes=1 << 14, relay="on",
                          halved=pipeline)
    prepared = prepare(src, dst, topo, options, ranks=range(5))
    assert [s.index for s in prepared.stages] == [0, 1]
    assert prepared.forwarded == {(n, 1) for n in stages.stage2_src}
    bindings = stage_bindings(prepared, src_b, real)
    transport = RecordingTransport(LocalTransport())
    tuning = Tuning(executor="pipelined" if pipeline else "rounds")
    programs: dict = {}
    stats, arena = run(prepared, bindings, transport, timeout=10, programs=programs,
                       tuning=tuning)
    assert stats.pipelined == pipeline
    for (r, n), arr in real.items():
        assert arr.tobytes() == values[n].tobytes(), (r, n)
    total = sum(v.nbytes for v in values.values())
    assert stats.bytes_sent == 2 * total and stats.bytes_forwarded == 2 * total
    assert transport.bytes_sent == 4 * total
    assert stats.num_rounds == len(prepared.schedule.rounds)
    assert set(bindings.src[1]) == {(r, n) for r in range(1, 5) for n in stages.stage2_src}
    # a second run reuses the programs (and the staging) kept for this prepared call
    kept = dict(programs)
    assert kept
    for arr in real.values():
        arr[...] = -1
    run(prepared, stage_bindings(prepared, src_b, real), transport, timeout=10,
        arena=arena, programs=programs, tuning=tuning)
    assert all(programs[k] is v for k, v in kept.items())
    for (r, n), arr in real.items():
        assert arr.tobytes() == values[n].tobytes(), (r, n)


def test_prepared_relay_call_is_the_stages_schedule():
    """``prepare`` (relay on) holds exactly the relay's plans and overlapped schedule; the
    direct plan and its schedule when relay is off or "auto" finds nothing to forward."""
    topo, src, dst, stages, p1, p2 = _overlap_case()
    kw = dict(bucket_bytes=1024, staging_bytes=1 << 14)
    on = prepare(src, dst, topo, CallOptions(relay="on", **kw), ranks=[1, 2])
    want = overlapped_schedule(p1, p2, [1, 2], **kw)
    assert on.schedule == want and on.relay == stages
    assert on.bytes_moved == p1.stats.bytes_moved + p2.stats.bytes_moved
    halved = prepare(src, dst, topo, CallOptions(relay="on", halved=True, **kw), ranks=[1, 2])
    assert halved.schedule == overlapped_schedule(p1, p2, [1, 2], bucket_bytes=1024,
                                                  staging_bytes=1 << 13)
    near = _topology({r: "t" for r in range(5)})        # sources on the receivers' host
    auto = prepare(src, dst, near, CallOptions(relay="auto", **kw), ranks=[1])
    off = prepare(src, dst, near, CallOptions(**kw), ranks=[1])
    assert auto.relay is None and len(auto.stages) == 1 and auto.schedule == off.schedule
    assert auto.forwarded == frozenset() and auto.plan is auto.direct


def relay_two_ranks(ctx: Context) -> dict:
    """Receiver processes of two ranks each (one per host): stage 2 stays in-process."""
    config = xr.RefitConfig(timeout=60, relay="on")
    trainer = ctx.role.group == "trainer"
    with ctx.join(1 if trainer else 2, timeout=60, host="t" if trainer else "ab"[ctx.role.index]) as world:
        ranks = list(world.rank_ids)
        vals = _values(1)
        if trainer:
            bound = xr.Bound({n: xr.Layout.replicated(a.shape, a.dtype, xr.Mesh((1,), (ranks[0],)))
                              for n, a in vals.items()}, {(ranks[0], n): a for n, a in vals.items()})
            r = xr.Refit(world, send=bound, config=config)()
            return {"sent": r.bytes_sent}
        dest = {(rank, n): np.full(a.shape, -1, a.dtype) for rank in ranks for n, a in vals.items()}
        layouts = {n: xr.Layout.explicit_form(a.shape, a.dtype, {rank: [[(0, k) for k in a.shape]]
                                                                  for rank in ranks})
                   for n, a in vals.items()}
        r = xr.Refit(world, receive=xr.Bound(layouts, {k: [a] for k, a in dest.items()},
                                             local_only=set(vals)), config=config)()
        return {"forwarded": r.bytes_forwarded, "by_transport": r.bytes_by_transport,
                "exact": all(np.array_equal(a, vals[n]) for (_, n), a in dest.items())}


@pytest.mark.slow
def test_relay_inside_a_process_goes_through_the_local_transport():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0, num_devices=2),
             Role("plain", "rollout", 1, num_devices=2)]
    values = [r.value for r in launch(relay_two_ranks, roles, timeout=240)]
    assert values[0]["sent"] == 2 * COPY_BYTES
    for v in values[1:]:
        assert v["exact"] and v["forwarded"] == COPY_BYTES
        assert "local" in v["by_transport"], v


def relay_jax_receivers(ctx: Context) -> dict:
    """Plain trainer; four JAX receiver processes (one CPU device each, each its own JAX
    job): every one holds every tensor whole, so the refit unions their layouts."""
    config = xr.RefitConfig(timeout=60, relay="on")
    out: dict = {}
    with ctx.join(timeout=60, host=_host(ctx.role)) as world:
        if ctx.role.group == "trainer":
            rank = world.rank_ids[0]
            refit = None
            for v in (1, 2):
                layouts = {n: xr.Layout.replicated(s, d, xr.Mesh((1,), (rank,)))
                           for n, (s, d) in TENSORS.items()}
                bound = xr.Bound(layouts, {(rank, n): a for n, a in _values(v).items()})
                refit = refit or xr.Refit(world, config=config)
                out[f"sent{v}"] = refit(send=bound).bytes_sent
        else:
            import jax
            from jax.sharding import SingleDeviceSharding
            device = jax.local_devices()[0]
            like = {n: jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device))
                    for n, (s, d) in TENSORS.items()}
            refit = xr.Refit(world, receive=like, config=config)
            for v in (1, 2):
                r = refit()
                out[f"forwarded{v}"] = r.bytes_forwarded
                out[f"exact{v}"] = all(np.array_equal(np.asarray(refit.received[n]), a)
                                       for n, a in _values(v).items())
    return out


@pytest.mark.slow
def test_relay_to_jax_receivers_each_a_job_of_its_own():
    roles = [Role("plain", "trainer", 0)] + [Role("jax", "rollout", i, num_devices=1)
                                             for i in range(4)]
    values = [r.value for r in launch(relay_jax_receivers, roles, timeout=300,
                                      env={"XRESHARD_SHM": "0"})]
    assert values[0]["sent1"] == values[0]["sent2"] == 2 * COPY_BYTES
    for v in (1, 2):
        assert sum(x[f"forwarded{v}"] for x in values[1:]) == 2 * COPY_BYTES
        assert all(x[f"exact{v}"] for x in values[1:])
