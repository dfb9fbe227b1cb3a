"""The cluster model and the refit simulator: hand-computable cases, and the schedules it
replays are the executor's: message for message the schedule of the call
``planner.prepare.prepare`` builds, direct (``relay="off"``) and relayed (``"on"``)."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter

import numpy as np
import pytest

from xreshard.cli import main
from xreshard.sim.cluster import Cluster, ClusterError, Placement, default_placement, \
    load_cluster, placement_of_world
from xreshard.ir.layout import Layout, Mesh
from xreshard.catalog.models import load_model
from xreshard.planner.plan import plan
from xreshard.catalog.recipes import parse_recipe, recipe_layouts
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.sim.engine import Network, maxmin_rates, replay
from xreshard.sim.relay import executor_messages, relay_replays_executor, relay_traffic
from xreshard.sim.stages import relay_stages, stage2_layouts
from xreshard.sim.traffic import Traffic, cut_messages, direct_traffic, fill_rounds, split_sizes
from xreshard.sim.simulate import SimulationError, lower_bound, simulate, simulate_plan

GB = 1e9


def toy(gpus_per_node: int = 1, domain_size: int = 1, **kw) -> Cluster:
    """NIC 10 GB/s, NVLink 100 GB/s, no latency, no channel cap unless asked."""
    args = dict(name="toy", gpus_per_node=gpus_per_node, domain_size=domain_size,
                nvlink_bw=100 * GB, nic_bw=10 * GB, nics_per_node=gpus_per_node,
                nvlink_latency=0.0, network_latency=0.0, net_channel_bw=0.0)
    args.update(kw)
    return Cluster(**args)


def run_traffic(cluster: Cluster, placement: Placement, rows, **kw) -> float:
    return replay(Network(cluster, placement, **kw), Traffic.of(rows)).seconds


# ---------------------------------------------------------------------------- links

def test_one_link():
    c = toy(network_latency=2e-6)
    pl = Placement((0, 1), (0, 1), (0, 0))
    assert run_traffic(c, pl, [(0, 0, 1, 10**9)]) == pytest.approx(0.1 + 2e-6)


def test_two_flows_share_a_nic_max_min():
    # ranks 0 and 1 (one node) send to rank 2: both through rank 2's NIC in
    c = toy(gpus_per_node=2, domain_size=2)
    pl = Placement((0, 0, 1), (0, 0, 1), (0, 1, 0))
    assert run_traffic(c, pl, [(0, 0, 2, 10**9), (0, 1, 2, 10**9)]) == pytest.approx(0.2)
    # unequal: both at 5 GB/s until the small one lands at 0.1 s, then 10 GB/s alone
    assert run_traffic(c, pl, [(0, 0, 2, 10**9), (0, 1, 2, 5 * 10**8)]) == pytest.approx(0.15)


def test_rounds_add_up():
    c = toy()
    pl = Placement((0, 1), (0, 1), (0, 0))
    assert run_traffic(c, pl, [(0, 0, 1, 10**9), (1, 0, 1, 10**9)]) == pytest.approx(0.2)


def test_pxn_routes_through_the_destination_rail():
    # node A = ranks 0 (GPU 0), 1 (GPU 1); rank 2 = node B GPU 1; rank 3 = node C GPU 1
    c = toy(gpus_per_node=2, domain_size=2)
    pl = Placement((0, 0, 1, 2), (0, 0, 1, 2), (0, 1, 1, 1))
    net = Network(c, pl)
    links, _ = net.paths(np.array([0]), np.array([2]))
    assert [net.describe_link(int(x))[1] for x in links[0]] == [
        "nvlink out of node 0 GPU 0", "nvlink in of node 0 GPU 1",
        "nic out of node 0 rail 1", "nic in of node 1 rail 1"]
    # both senders leave node A through its rail-1 NIC: they share it
    assert run_traffic(c, pl, [(0, 0, 2, 10**9), (0, 1, 3, 10**9)]) == pytest.approx(0.2)
    # to rail-0 and rail-1 destinations they use two NICs
    pl2 = Placement((0, 0, 1, 2), (0, 0, 1, 2), (0, 1, 0, 1))
    assert run_traffic(c, pl2, [(0, 1, 2, 10**9), (0, 0, 3, 10**9)]) == pytest.approx(0.1)


def test_nvlink_inside_a_domain_and_local_copies_are_free():
    c = toy(gpus_per_node=2, domain_size=2)
    pl = Placement((0, 0, 0), (0, 0, 0), (0, 1, 1))     # ranks 1, 2 share a GPU
    assert run_traffic(c, pl, [(0, 0, 1, 10**9)]) == pytest.approx(0.01)
    assert run_traffic(c, pl, [(0, 1, 2, 10**9)]) == 0.0


def test_peer_channel_cap():
    c = toy(net_channel_bw=3 * GB, net_channels_min=2, p2p_channels=32)
    pl = Placement((0, 1), (0, 1), (0, 0))
    assert c.peer_cap(2, 2) == 6 * GB
    assert run_traffic(c, pl, [(0, 0, 1, 6 * 10**8)]) == pytest.approx(0.1)
    assert run_traffic(c, pl, [(0, 0, 1, 6 * 10**8)], peer_cap=False) == pytest.approx(0.06)
    # NCCL halves channels per peer in big communicators: 4 -> 1 at 256 ranks
    assert load_cluster("gb200-nvl72").channels_per_peer(256, 64) == 1
    assert load_cluster("gb200-nvl72").channels_per_peer(8, 2) == 4


def test_maxmin_is_progressive_filling():
    # links 0 (cap 1), 1 (cap 3); sentinel 2. f0 on 0; f1 on 0 and 1; f2, f3 on 1
    links = np.array([[0, 2], [0, 1], [1, 2], [1, 2]])
    rates = maxmin_rates(links, np.array([1.0, 3.0, np.inf]), np.inf)
    assert rates == pytest.approx([0.5, 0.5, 1.25, 1.25])


def test_maxmin_per_flow_cap_is_a_private_link():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, num_links = 30, 6
        links = rng.integers(0, num_links + 1, (n, 3))      # num_links: the sentinel
        links[:, 0] = rng.integers(0, num_links, n)          # every flow crosses a link
        capacity = np.append(rng.uniform(1, 10, num_links), np.inf)
        caps = np.where(rng.random(n) < 0.5, rng.uniform(0.05, 1, n), np.inf)
        got = maxmin_rates(links, capacity, caps)
        # the same caps as one private link per capped flow
        capped = np.flatnonzero(np.isfinite(caps))
        cap2 = np.concatenate([capacity[:-1], caps[capped], [np.inf]])
        lk = np.where(links == num_links, len(cap2) - 1, links)
        private = np.full(n, len(cap2) - 1)
        private[capped] = num_links + np.arange(len(capped))
        want = maxmin_rates(np.column_stack([lk, private]), cap2, np.inf)
        assert np.array_equal(got, want)


def four_gpu_nodes(nvlink_gbps: float) -> tuple[Cluster, Placement, list]:
    """Two nodes of 4 GPUs and 4 NICs; every GPU of node 0 sends 1 GB to every GPU of
    node 1: 16 flows in 4 classes (one per rail), 12 of them hop over NVLink (PXN)."""
    c = toy(gpus_per_node=4, domain_size=4, nvlink_bw=nvlink_gbps * GB)
    pl = Placement((0,) * 4 + (1,) * 4, (0,) * 4 + (1,) * 4, tuple(range(4)) * 2)
    return c, pl, [(0, s, d, 10**9) for s in range(4) for d in range(4, 8)]


@pytest.mark.parametrize("nvlink_gbps,want,class_solves", [
    # 4 flows per NIC at 2.5 GB/s; the hops (3 per NVLink port, <= 7.5 GB/s) never bind
    (100, 0.4, 1),
    # 1 GB/s NVLink: 3 hops per port at 1/3 GB/s bind, so the round is solved per flow
    (1, 3.0, 0),
])
def test_classes_of_identical_flows(monkeypatch, nvlink_gbps, want, class_solves):
    import xreshard.sim.engine as engine
    c, pl, rows = four_gpu_nodes(nvlink_gbps)
    fits = []
    hops_fit = engine._Classes.hops_fit
    monkeypatch.setattr(engine._Classes, "hops_fit",
                        lambda self, *a: fits.append(hops_fit(self, *a)) or fits[-1])
    net = Network(c, pl)
    got = replay(net, Traffic.of(rows))
    assert got.seconds == pytest.approx(want) and sum(fits) == class_solves
    reference = replay(net, Traffic.of(rows), grouped=False)
    assert np.array_equal(got.finish, reference.finish)


def test_factorize_is_unique_with_inverse():
    from xreshard.sim.engine import _factorize
    rng = np.random.default_rng(1)
    # values first seen after the first 1,024 (the lookup's seed) are added on a miss
    for values in (np.repeat([7, 3], 1024), rng.integers(0, 50, 5000) * 1024,
                   np.concatenate([np.full(2000, 5), rng.integers(0, 9, 3000)])):
        uniq, inverse = _factorize(values)
        want_uniq, want_inverse = np.unique(values, return_inverse=True)
        assert np.array_equal(uniq, want_uniq) and np.array_equal(inverse, want_inverse)


def random_traffic(rng, num_ranks: int, num_rounds: int) -> list:
    rows = []
    sizes = [1 << 20, 3 << 20, 5 << 19]
    for r in range(num_rounds):
        for _ in range(int(rng.integers(1, 60))):
            s, d = (int(x) for x in rng.integers(0, num_ranks, 2))
            rows.append((r, s, d, sizes[int(rng.integers(0, 3))]))
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_class_solver_is_the_per_flow_solver(seed):
    # random clusters, placements and traffic (repeated pairs and sizes form classes;
    # NVLink flows, hops, local copies, peer caps): solving classes of identical flows
    # gives every message the time the straightforward per-flow solve gives it
    rng = np.random.default_rng(seed)
    g = int(rng.choice([2, 4, 8]))
    c = toy(gpus_per_node=g, domain_size=g * int(rng.choice([1, 2])),
            nics_per_node=int(rng.choice([n for n in (1, 2, 4, 8) if n <= g])),
            nvlink_bw=float(rng.choice([3, 40, 400, 400])) * GB, network_latency=1e-5,
            nvlink_latency=1e-6, net_channel_bw=float(rng.choice([0, 2])) * GB)
    num_ranks = int(rng.integers(4, 4 * g))
    node = tuple(int(x) for x in rng.integers(0, 4, num_ranks))
    pl = Placement(tuple(n // (c.domain_size // g) for n in node), node,
                   tuple(int(x) for x in rng.integers(0, g, num_ranks)))
    tr = Traffic.of(random_traffic(rng, num_ranks, 5))
    net = Network(c, pl)
    fast, slow = replay(net, tr), replay(net, tr, grouped=False)
    assert fast.finish == pytest.approx(slow.finish, rel=1e-12, abs=0)
    assert fast.seconds == pytest.approx(slow.seconds, rel=1e-12)
    assert (fast.critical_link, fast.critical_kind) == (slow.critical_link, slow.critical_kind)


# ---------------------------------------------------------------------------- cluster

def test_default_placement_gb200_m2n():
    c = load_cluster("gb200-nvl72")
    pl = default_placement(c, [128, 128])
    assert Counter(pl.domain) == {0: 64, 1: 64, 2: 64, 3: 64}
    assert pl.domain[127] == 1 and pl.domain[128] == 2
    assert pl.node[:5] == (0, 0, 0, 0, 1) and pl.gpu[:5] == (0, 1, 2, 3, 0)
    assert len(set(pl.node)) == 64
    pl.check(c, 256)
    # uneven: 100 ranks on 72-GPU domains -> 50 + 50
    assert Counter(default_placement(c, [100]).domain) == {0: 50, 1: 50}


def test_placement_json_and_errors(tmp_path):
    pl = default_placement(load_cluster("dgx-h100"), [16, 8])
    assert Placement.from_dict(json.loads(json.dumps(pl.to_dict()))) == pl
    assert Placement.from_dict({"0": {"domain": 0, "node": 0, "gpu": 0},
                                "1": [1, 1, 0]}) == Placement((0, 1), (0, 1), (0, 0))
    with pytest.raises(ClusterError, match="node 0 is in domain 0 and in domain 1"):
        Placement((0, 1), (0, 0), (0, 1))
    with pytest.raises(ClusterError, match="GPU 9 but dgx-h100 nodes have GPUs 0..7"):
        Placement((0,), (0,), (9,)).check(load_cluster("dgx-h100"), 1)
    with pytest.raises(ClusterError, match="unknown cluster 'h300'; presets are"):
        load_cluster("h300")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "dgx-h100", "nic_gbps": 90}))
    assert load_cluster(str(path)).nic_bw == 90 * GB
    path.write_text(json.dumps({"gpus_per_node": 8}))
    with pytest.raises(ClusterError, match="missing keys"):
        load_cluster(str(path))


def test_placement_of_world():
    class FakeWorld:
        processes = [
            {"host": "a", "ranks": [0, 1], "devices": ["cuda:0", "cuda:1"]},
            {"host": "b", "ranks": [2], "devices": ["cpu"]},
            {"host": "c", "ranks": [3], "devices": ["cuda:2"], "nvlink_clique": "rack1"},
            {"host": "d", "ranks": [4], "devices": ["cuda:0"], "nvlink_clique": "rack1"},
        ]
    pl = placement_of_world(FakeWorld())
    assert pl.gpu == (0, 1, 0, 2, 0)
    assert pl.node == (0, 0, 1, 2, 3)
    assert pl.domain == (0, 0, 1, 2, 2)


# ---------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("model,src,dst,bucket,staging", [
    ("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:dp=2,tp=2", 1 << 20, 4 << 20),
    ("qwen2_5_0_5b", "fsdp:dp=4", "vllm:tp=2", 64 << 20, 256 << 20),
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2", "vllm:tp=2", 8 << 20, 16 << 20),
    # two holders per region: quota cuts split pieces between them
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2,dp=2", "vllm:tp=2,dp=3", 1 << 20, 8 << 20),
])
def test_direct_traffic_is_the_prepared_calls(model, src, dst, bucket, staging):
    m = load_model(model)
    s, d = parse_recipe(src), parse_recipe(dst)
    p = plan(recipe_layouts(m, s, 0), recipe_layouts(m, d, s.world_size))
    ranks = list(range(s.world_size + d.world_size))
    # the prepared call a Refit runs (relay="off"), every rank's buckets
    call = prepare(p.src_layouts, p.dst_layouts, None,
                   CallOptions(bucket_bytes=bucket, staging_bytes=staging), ranks=ranks)
    want = sorted((b.round, b.src, b.dst, b.nbytes) for bs in call.schedule.rounds for b in bs)
    by_pair = direct_traffic(p, bucket_bytes=bucket, staging_bytes=staging)
    tr = by_pair.to_traffic()
    got = sorted(zip(tr.round.tolist(), tr.src.tolist(), tr.dst.tolist(), tr.nbytes.tolist()))
    assert got == want
    # rounds generated from the pairs' patterns are the rows' rounds, in the same order
    assert by_pair.num_rounds == tr.num_rounds and len(by_pair) == len(tr)
    assert by_pair.total_bytes == tr.total_bytes
    for (_, *a), (_, *b) in zip(by_pair.rounds(), tr.rounds(), strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # a round's key (from its patterns) tells it apart exactly when its messages differ
    keys = list(by_pair.round_keys())
    msgs = [b"|".join(a.tobytes() for a in r[1:]) for r in by_pair.rounds()]
    assert len(keys) == len(msgs)
    assert len(set(zip(keys, msgs))) == len(set(keys)) == len(set(msgs))


def test_split_sizes_matches_split_region():
    from xreshard.ir.layout import Region
    from xreshard.planner.schedule import split_region
    for shape in [(7, 5), (3, 1000, 4), (1, 1, 9000), (64,), (5, 3, 2)]:
        for limit in (1 << 10, 3000, 1 << 20):
            region = Region((0,) * len(shape), shape)
            assert split_sizes(shape, 2, limit) == tuple(
                r.size * 2 for r in split_region(region, 2, limit))


def replicated_plan(num_dst: int, rows: int = 1024, cols: int = 4096):
    """One bf16 tensor (8 MiB by default) on rank 0, wanted whole by ranks 1..num_dst."""
    src = {"w": Layout.replicated((rows, cols), "bfloat16", Mesh((1,), ranks=(0,)))}
    dst = {"w": Layout.replicated((rows, cols), "bfloat16",
                                  Mesh((num_dst,), ranks=tuple(range(1, num_dst + 1))))}
    return plan(src, dst)


def test_fill_rounds_is_the_scheduler_rule():
    # the rule of schedule.schedule (no readiness) and of overlapped_schedule (readiness)
    def rule(nbytes, size, ready):
        order = np.arange(len(nbytes)) if ready is None else np.argsort(ready, kind="stable")
        out, rnd, used = [], 0, 0
        for j in order.tolist():
            if ready is not None and ready[j] > rnd:
                rnd, used = int(ready[j]), 0
            elif used and used + nbytes[j] > size:
                rnd, used = rnd + 1, 0
            used += int(nbytes[j])
            out.append(rnd)
        return order, out
    rng = np.random.default_rng(0)
    for trial in range(2000):
        n, size = int(rng.integers(0, 60)), int(rng.integers(1, 50))
        nbytes = rng.integers(1, size + 1, n)
        ready = None if trial % 2 else rng.integers(1, 30, n)
        order, rounds = fill_rounds(nbytes, size, ready)
        want_order, want = rule(nbytes, size, ready)
        assert np.array_equal(order, want_order) and rounds.tolist() == want


def test_cut_messages_is_the_scheduler_packing():
    from xreshard.ir.layout import Region
    from xreshard.planner.schedule import _pair_buckets   # noqa: the rule under test

    def pair_messages(sizes, size):
        # one 1-d item per part (its bytes in bf16 elements); the scheduler's own packing
        from xreshard.planner.plan import Transfer
        ts = [Transfer(f"t{i:03d}", Region((0,), (nb // 2,)), 0, 1, nb)
              for i, nb in enumerate(sizes)]
        names = {t.name: i for i, t in enumerate(ts)}
        buckets = _pair_buckets(0, 1, ts, names, size, {n: 2 for n in names}, {})
        out, rnd, used = [], 0, 0
        for items in buckets:
            nb = sum(it.nbytes for it in items)
            if used and used + nb > size:
                rnd, used = rnd + 1, 0
            used += nb
            out.append((rnd, nb))
        return out
    rng = np.random.default_rng(1)
    for _ in range(500):
        size = int(rng.choice([1 << 12, 1 << 16, 1 << 20]))
        parts = rng.choice([100, 3000, 1 << 15, 1 << 16, size], int(rng.integers(1, 40)))
        parts = np.minimum(parts, size)
        msg, nbytes = cut_messages(parts, size)
        _, rounds = fill_rounds(nbytes, size)
        assert list(zip(rounds.tolist(), nbytes.tolist())) == pair_messages(parts.tolist(), size)
        assert np.array_equal(np.bincount(msg, weights=parts), nbytes)


def few_layers(model: str, src: str, dst: str, layers: int = 2, experts: int = 4,
               vocab: bool = True):
    """The source and destination layouts of a recipe pair, keeping the embedding, the
    head, the last norm and the first ``layers`` layers (with ``experts`` experts each):
    every kind of layout, a few tensors of each (the executor's own schedule, which the
    relay tests build as a reference, is slow for whole models); ``vocab=False`` drops
    the embedding and the head too."""
    import re
    m = load_model(model)
    s, d = parse_recipe(src), parse_recipe(dst)
    src_l, dst_l = recipe_layouts(m, s, 0), recipe_layouts(m, d, s.world_size)

    def keep(name: str) -> bool:
        layer = re.search(r"layers\.(\d+)\.", name)
        expert = re.search(r"experts\.(\d+)\.", name)
        return (layer is None or int(layer.group(1)) < layers) and \
            (expert is None or int(expert.group(1)) < experts) and \
            (vocab or not re.search(r"embed|lm_head", name))
    names = [n for n in src_l if keep(n)]
    return ({n: src_l[n] for n in names}, {n: dst_l[n] for n in names},
            s.world_size + d.world_size)


@pytest.mark.parametrize("model,src,dst,domain_size", [
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2,dp=2", "vllm:tp=2,dp=3", 6),   # uneven domains
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2", "vllm:tp=2,dp=2", 2),
    ("qwen2_5_0_5b", "fsdp:dp=4", "vllm:tp=2,dp=4", 4),
])
def test_relay_stages_are_relay_layouts(model, src, dst, domain_size):
    from xreshard.planner.relay import relay_layouts
    from xreshard.sim.relay import domain_topology
    src_l, dst_l, n = few_layers(model, src, dst, layers=4, experts=16)
    domain = [r // domain_size for r in range(n)]
    want = relay_layouts(src_l, dst_l, domain_topology(domain))
    got = relay_stages(src_l, dst_l, domain)
    assert got.bytes_relayed == want.bytes_relayed > 0
    assert got.stage1_dst == want.stage1_dst
    assert stage2_layouts(got, dst_l) == (want.stage2_src, want.stage2_dst)


# the relay the executor runs, replayed message for message: relay_layouts' stages, the
# stage plans and overlapped_schedule's rounds (readiness of every forward, pieces cut
# where domains' parts overlap, staging shared by both stages)
@pytest.mark.parametrize("model,src,dst,domain_size,bucket,staging,vocab", [
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2,dp=2", "vllm:tp=2,dp=3", 6, 1 << 20, 2 << 20, False),
    ("qwen3_30b_a3b", "megatron:pp=2,ep=2", "vllm:tp=2,dp=2", 2, 1 << 20, 8 << 20, True),
    # small buckets: parts land over several rounds, forwards timed piece by piece (the
    # executor's schedule costs minutes for the embedding's thousands of pieces)
    ("qwen2_5_0_5b", "fsdp:dp=4", "vllm:tp=2,dp=4", 4, 64 << 10, 256 << 10, False),
    ("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:dp=4,tp=2", 4, 1 << 20, 4 << 20, True),
])
def test_relay_traffic_is_the_executors(model, src, dst, domain_size, bucket, staging, vocab):
    src_l, dst_l, n = few_layers(model, src, dst, vocab=vocab)
    p = plan(src_l, dst_l)
    domain = [r // domain_size for r in range(n)]
    kw = dict(bucket_bytes=bucket, staging_bytes=staging)
    relay = relay_traffic(p, domain, **kw).traffic
    tr = relay.to_traffic()
    assert tr.forward.any() and (tr.round[tr.forward] > tr.round[~tr.forward].min()).all()
    assert relay_replays_executor(p, domain, simulated=relay, **kw)
    # the comparison sees what it claims to: one byte more in one message fails it
    assert tr.total_bytes == executor_messages(p, domain, **kw).total_bytes
    sizes = [a.copy() for a in relay.sizes_of]
    sizes[-1][0] += 1
    off = type(relay)(relay.src, relay.dst, relay.pattern, relay.rounds_of, sizes,
                      relay.forward)
    assert not relay_replays_executor(p, domain, simulated=off, **kw)


def test_relay_replays_executor_for_some_ranks():
    p = replicated_plan(4, rows=256, cols=512)
    domain = [0, 1, 1, 2, 2]
    kw = dict(bucket_bytes=16 << 10, staging_bytes=64 << 10)
    assert relay_replays_executor(p, domain, ranks=[1], **kw)
    assert relay_replays_executor(p, domain, **kw)


def test_relay_chain():
    # rank 0 in domain 0; ranks 1, 2 in domain 1 both need the 8 MiB tensor: each takes
    # half over the network (stage 1) and forwards it to the other over NVLink (stage 2)
    p = replicated_plan(2)
    mib = 1 << 20
    rt = relay_traffic(p, [0, 1, 1], bucket_bytes=mib, staging_bytes=1 << 30)
    assert rt.stages.bytes_relayed == 8 * mib
    tr = rt.traffic.to_traffic()
    assert int(tr.nbytes[~tr.forward].sum()) == 8 * mib == int(tr.nbytes[tr.forward].sum())
    # 4 rounds of two 1 MiB network chunks, each forwarded the round after it lands
    assert tr.num_rounds == 5 and sorted(tr.round[tr.forward].tolist()) == [1, 1, 2, 2, 3, 3,
                                                                           4, 4]
    c = toy(gpus_per_node=2, domain_size=2, nics_per_node=1, network_latency=1e-5,
            nvlink_latency=1e-6)
    pl = Placement((0, 1, 1), (0, 1, 1), (0, 0, 1))
    # round 0: 2 MiB through one NIC; rounds 1-3: the same plus 1 MiB each way over
    # NVLink (the NIC binds); round 4: the last forwards alone
    net_round = 2 * mib / (10 * GB) + 1e-5
    want = 4 * net_round + mib / (100 * GB) + 1e-6
    assert replay(Network(c, pl), tr).seconds == pytest.approx(want)
    # direct: two 8 MiB copies through one NIC out and one NIC in
    direct = direct_traffic(p, bucket_bytes=mib, staging_bytes=1 << 30)
    assert replay(Network(c, pl), direct).seconds == pytest.approx(
        8 * (2 * mib / (10 * GB) + 1e-5))


def test_relay_inside_one_domain_is_direct():
    p = replicated_plan(2)
    rt = relay_traffic(p, [0, 0, 0], bucket_bytes=1 << 20, staging_bytes=1 << 30)
    tr = rt.traffic.to_traffic()
    assert rt.stages.bytes_relayed == 0 and not tr.forward.any()
    assert set(zip(tr.src.tolist(), tr.dst.tolist())) == {(0, 1), (0, 2)}
    assert tr.total_bytes == 2 * (8 << 20)


def test_lower_bound_one_domain_ingress():
    p = replicated_plan(2)
    c = toy(gpus_per_node=2, domain_size=2, nics_per_node=1)
    pl = Placement((0, 1, 1), (0, 1, 1), (0, 0, 1))
    lb = lower_bound(p, Network(c, pl))
    # 8 MiB must leave domain 0 and enter domain 1 once, each through one NIC
    assert lb["seconds"] == pytest.approx(8 * (1 << 20) / (10 * GB))
    out = simulate_plan(p, c, pl, schedule="auto", bucket_bytes=1 << 20, progress=False)
    assert out["schedule"] == "relay"
    assert out["bytes_by_link"]["network"] == 8 << 20
    assert out["seconds"] >= out["lower_bound_seconds"]


# ---------------------------------------------------------------------------- API, CLI

def test_simulate_small_model_and_errors():
    out = simulate("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:dp=4,tp=2", "dgx-h100",
                   gpus=12, schedule="auto", progress=False)
    assert set(out["schedules"]) == {"direct", "relay"}
    assert out["seconds"] >= out["lower_bound_seconds"] > 0
    assert out["bytes_by_link"]["network"] <= out["bytes_moved"]
    with pytest.raises(SimulationError, match="--gpus 10 but the recipes need 12 GPUs"):
        simulate("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:dp=4,tp=2", "dgx-h100", gpus=10)


def test_cli_json(capsys):
    rc = main(["simulate", "--model", "qwen2_5_0_5b", "--src", "fsdp:dp=4", "--dst",
               "vllm:dp=2,tp=2", "--cluster", "dgx-h100", "--gpus", "8", "--schedule",
               "relay", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("seconds", "lower_bound_seconds", "bytes_by_link", "critical", "sim_seconds"):
        assert key in out
    assert set(out["bytes_by_link"]) == {"nvlink", "network"}
    assert out["critical"]["link"] in ("nvlink", "network")


def test_cli_plot_needs_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = main(["simulate", "--model", "qwen2_5_0_5b", "--src", "fsdp:dp=2", "--dst",
               "vllm:tp=2", "--cluster", "dgx-h100", "--plot", str(tmp_path / "x.png")])
    assert rc == 1
    assert "pip install 'xreshard[plot]'" in capsys.readouterr().err


def test_import_stays_light():
    import subprocess
    code = ("import sys, xreshard, xreshard.sim.simulate, xreshard.sim.cluster; "
            "print(any(m in sys.modules for m in ('torch', 'jax', 'matplotlib')))")
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


# ---------------------------------------------------------------------------- wire formats

def test_fp8_bytes_by_hand():
    from xreshard.sim.wire import fp8_bytes, quantized
    # 256 x 384 bf16, blocks of 128: the whole tensor is 6 blocks, 1 B per element + 4 B
    assert fp8_bytes((0, 0), (256, 384), (256, 384), 2) == 256 * 384 + 6 * 4
    # rows 0..112 of it (an fsdp=64-like shard of 7168 rows cuts blocks): no block whole
    assert fp8_bytes((0, 0), (112, 384), (256, 384), 2) == 112 * 384 * 2
    # rows 100..256: block row 1 whole (3 blocks), rows 100..128 in bf16
    assert fp8_bytes((100, 0), (256, 384), (256, 384), 2) == 128 * 384 + 3 * 4 + 28 * 384 * 2
    # a ragged tail block (200 rows) is whole when the transfer reaches the edge
    assert fp8_bytes((128, 0), (200, 128), (200, 128), 2) == 72 * 128 + 4
    # stacked experts [E, rows, cols]: blocks per expert
    assert fp8_bytes((0, 0, 0), (3, 128, 128), (8, 128, 128), 2) == 3 * (128 * 128 + 4)
    assert quantized("model.layers.3.mlp.experts.7.down_proj.weight", (7168, 2048))
    assert quantized("model.layers.3.mlp.experts.gate_up_proj", (256, 4096, 7168))
    assert quantized("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.3.mlp.gate."
                 "e_score_correction_bias"):
        assert not quantized(name, (129280, 7168) if "weight" in name else (256,)), name


def test_delta_bytes_by_hand():
    from xreshard.sim.wire import DELTA_HEADER, delta_bytes
    n = 1 << 20                                      # a 2 MiB bf16 bucket
    dense = np.array([2 * n])
    # 1%: index runs (8 B per run, ~f(1-f)n runs) + values beat a bitmask (n / 8 B)
    runs = 8 * math.ceil(0.01 * 0.99 * n) + 0.01 * 2 * n
    assert delta_bytes(dense, [n], 0.01)[0] == math.ceil(runs) + DELTA_HEADER
    # 30%: the bitmask wins; everything changed: dense
    assert delta_bytes(dense, [n], 0.3)[0] == math.ceil(n / 8 + 0.3 * 2 * n) + DELTA_HEADER
    assert delta_bytes(dense, [n], 1.0)[0] == 2 * n + DELTA_HEADER
    assert delta_bytes(np.array([0]), [0], 0.01)[0] == 0


def test_wire_fp8_halves_what_whole_blocks_cost():
    kw = dict(gpus=10, schedule="direct", progress=False)
    base = simulate("qwen3_30b_a3b", "megatron:pp=2,ep=4", "vllm:tp=2", "dgx-h100", **kw)
    fp8 = simulate("qwen3_30b_a3b", "megatron:pp=2,ep=4", "vllm:tp=2", "dgx-h100",
                   wire="fp8", **kw)
    # tp=1 sources hold every block whole, and tp=2 shards (384 expert rows) cut none: the
    # linear weights cross in ~half the bytes
    ratio = fp8["bytes_by_link"]["network"] / base["bytes_by_link"]["network"]
    assert 0.5 < ratio < 0.55 and fp8["seconds"] < 0.6 * base["seconds"]
    assert fp8["lower_bound_seconds"] < base["lower_bound_seconds"]
    assert fp8["wire"]["format"] == "fp8" and "FP8" in fp8["wire"]["describe"]
    # fsdp over 48 ranks cuts the 2048-row weights into 42/43-row shards: no whole block,
    # so every byte of them travels in bf16 (to be quantized by the receiver)
    kw["gpus"] = 50
    base = simulate("qwen3_30b_a3b", "fsdp:dp=48", "vllm:tp=2", "dgx-h100", **kw)
    fp8 = simulate("qwen3_30b_a3b", "fsdp:dp=48", "vllm:tp=2", "dgx-h100", wire="fp8", **kw)
    assert fp8["bytes_by_link"]["network"] > 0.9 * base["bytes_by_link"]["network"]


def test_wire_delta_shrinks_messages_not_rounds():
    kw = dict(gpus=8, schedule="auto", progress=False)
    base = simulate("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:tp=2,dp=2", "dgx-h100", **kw)
    delta = simulate("qwen2_5_0_5b", "megatron:dp=2,tp=2", "vllm:tp=2,dp=2", "dgx-h100",
                     delta=0.01, **kw)
    for k in ("direct", "relay"):
        b, d = base["schedules"][k], delta["schedules"][k]
        assert d["num_rounds"] == b["num_rounds"] and d["num_messages"] == b["num_messages"]
        moved = sum(d["bytes_by_link"].values()) / sum(b["bytes_by_link"].values())
        assert 0.04 < moved < 0.06 and d["seconds"] < 0.2 * b["seconds"]
    with pytest.raises(SimulationError, match="not priced"):
        simulate("qwen2_5_0_5b", "fsdp:dp=2", "vllm:tp=2", "dgx-h100", wire="fp8",
                 delta=0.01)


# ---------------------------------------------------------------------------- sites

def test_sites_cross_through_each_nodes_site_link():
    # ranks 0, 1 on node 0 (site 0); rank 2 on node 1 (site 1): both messages cross into
    # site 1 through node 1's one site link (1 GB/s), not the NICs (10 GB/s)
    c = toy(gpus_per_node=2, domain_size=2, site_bw=1 * GB, site_latency=1e-3)
    pl = Placement((0, 0, 1), (0, 0, 1), (0, 1, 0), (0, 0, 1))
    net = Network(c, pl)
    links, kind = net.paths(np.array([0, 1]), np.array([2, 2]))
    assert [net.describe_link(int(x))[1] for x in links[0, 2:]] == [
        "site link out of node 0", "site link in of node 1"]
    assert run_traffic(c, pl, [(0, 0, 2, 10**9), (0, 1, 2, 10**9)]) == pytest.approx(2 + 1e-3)
    p = replicated_plan(1, rows=1024, cols=512)              # 1 MiB from rank 0 to rank 1
    pl2 = Placement((0, 1), (0, 1), (0, 0), (0, 1))
    lb = lower_bound(p, Network(c, pl2))
    assert lb["by"] == "site link ingress" and lb["seconds"] == pytest.approx(
        (1 << 20) / (1 * GB + 0), rel=0.02)
    with pytest.raises(ClusterError, match="has no site links"):
        Network(toy(), Placement((0, 1), (0, 1), (0, 0), (0, 1)))


def test_xdc_preset_puts_each_job_in_its_own_site():
    c = load_cluster("xdc-h100")
    pl = default_placement(c, [16, 8])
    assert pl.sites == (0,) * 16 + (1,) * 8
    assert Placement.from_dict(json.loads(json.dumps(pl.to_dict()))) == pl
    out = simulate("qwen2_5_0_5b", "fsdp:dp=16", "vllm:tp=2,dp=4", "xdc-h100", gpus=24,
                   progress=False)
    assert set(out["bytes_by_link"]) == {"nvlink", "network", "site"}
    assert out["bytes_by_link"]["site"] == out["bytes_moved"]
    assert out["critical"]["link"] == "site"



# ---------------------------------------------------------------------------- localhost

def test_host_link_and_message_cost_by_hand():
    # one node of 3 processes (the localhost shape): rank 0 sends 1 GB to each of 1 and 2;
    # each pulls at 10 GB/s but the host copies 15 GB/s in all: 2 GB at 15 GB/s
    c = toy(gpus_per_node=3, domain_size=3, nvlink_bw=10 * GB, nvlink_out_bw=1e15,
            host_bw=15 * GB)
    pl = Placement((0, 0, 0), (0, 0, 0), (0, 1, 2))
    net = Network(c, pl)
    links, _ = net.paths(np.array([0]), np.array([1]))
    assert net.describe_link(int(links[0, 3]))[1] == "host copies of node 0"
    rows = [(0, 0, 1, 10**9), (0, 0, 2, 10**9)]
    assert run_traffic(c, pl, rows) == pytest.approx(2 / 15)
    # without the host limit each pulls at its own rate; senders are not limited
    assert run_traffic(toy(gpus_per_node=3, domain_size=3, nvlink_bw=10 * GB,
                           nvlink_out_bw=1e15), pl, rows) == pytest.approx(0.1)
    # message_cost: each message costs the receiver 0.01 s of its link's time, and a round
    # lasts at least its busiest sender's messages (here 3 x 0.01 s > the bytes' time)
    cm = toy(gpus_per_node=3, domain_size=3, nvlink_bw=10 * GB, message_cost=0.01)
    assert run_traffic(cm, pl, [(0, 0, 1, 10**8)]) == pytest.approx(0.01 + 0.01)
    assert run_traffic(cm, pl, [(0, 0, 1, 1), (0, 0, 2, 1), (0, 0, 1, 1)]) == \
        pytest.approx(0.03, rel=1e-6)


def test_call_latency_is_added_once():
    p = replicated_plan(1, rows=1024, cols=512)
    pl = Placement((0, 0), (0, 0), (0, 1))
    base = simulate_plan(p, toy(gpus_per_node=2, domain_size=2), pl, progress=False)
    slow = simulate_plan(p, toy(gpus_per_node=2, domain_size=2, call_latency=0.5), pl,
                         progress=False)
    assert slow["seconds"] == pytest.approx(base["seconds"] + 0.5)


def test_localhost_is_measured_not_typed(tmp_path, monkeypatch):
    from xreshard.sim.cluster import localhost_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert localhost_path() == tmp_path / "xreshard" / "localhost.json"
    with pytest.raises(ClusterError, match="calibrate_localhost.py"):
        load_cluster("localhost")
    c = toy(gpus_per_node=8, domain_size=8, host_bw=3 * GB, message_cost=1e-4,
            call_latency=2e-3, nvlink_out_bw=1e15)
    localhost_path().parent.mkdir(parents=True)
    localhost_path().write_text(json.dumps(c.to_dict()))
    assert load_cluster("localhost") == c


# ---------------------------------------------------------------------------- pictures

def test_busy_raster_by_hand():
    from xreshard.sim.engine import Replay
    from xreshard.sim.plot import busy_raster
    # two rounds of 1 s; rank 0 busy 0.5 s (network) in round 0, rank 1 1 s (forward) in
    # round 1: 4 pixels of 0.5 s
    busy = [np.array([[0.5, 0, 0], [0, 0, 0]]), np.array([[0, 0, 0], [0, 0, 1.0]])]
    rep = Replay(2.0, np.array([0.0, 1.0]), np.array([1.0, 1.0]), None, -1, 0, 2, busy)
    r = busy_raster(rep, 2, 2.0, width=4)
    assert r[0, :, 0].tolist() == [1, 0, 0, 0] and r[1, :, 2].tolist() == [0, 0, 1, 1]
    assert r.sum() == 3


def test_image_mixes_classes_busy_at_once():
    from xreshard.sim.plot import COLORS, _image
    img = _image(np.array([[[0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 0, 1], [0.25, 0, 0]]]),
                 np.arange(1))[0]
    assert img[0].tolist() == [1, 1, 1]                                  # idle: white
    assert np.allclose(img[1], COLORS[0]) and np.allclose(img[2], COLORS[2])
    assert np.allclose(img[3], (COLORS[0] + COLORS[2]) / 2)              # both: a mix
    assert np.allclose(img[4], 0.5 + 0.5 * COLORS[0])                    # sqrt(1/4)


@pytest.mark.parametrize("schedule_name", ["auto", "direct"])
def test_cli_plot(tmp_path, capsys, schedule_name):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sim.png"
    assert main(["simulate", "--model", "qwen2_5_0_5b", "--src", "fsdp:dp=2", "--dst",
                 "vllm:dp=2,tp=2", "--cluster", "dgx-h100", "--schedule", schedule_name,
                 "--plot", str(path)]) == 0
    assert f"xreshard simulate: wrote {path}" in capsys.readouterr().err
    import matplotlib.image
    img = matplotlib.image.imread(str(path))
    rows = 2 if schedule_name == "auto" else 1                 # one row per schedule
    assert img.shape[1] == 1440 and img.shape[0] == int(90 * (1.2 + 3.6 * rows))
