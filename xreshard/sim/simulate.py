"""Predict how long a refit takes on a cluster: ``xreshard simulate``.

    xreshard simulate --model deepseek_v3 --src megatron:tp=1,ep=16,dp=2,pp=4 \\
        --dst vllm:tp=8,dp=16 --cluster gb200-nvl72 --gpus 256 --schedule relay --json

The pipeline is the refit's own up to the schedule: recipes -> layouts -> ``plan`` ->
the messages the executor would send (``sim/traffic.py``: the direct schedule exactly as
``schedule.schedule`` cuts it; ``sim/relay.py``: the relay schedule) -> replayed on a
cluster model (``cluster.py``) round by round, links shared max-min fairly
(``sim/engine.py``). The result also carries the physical lower bound for the layouts on
that cluster, so a prediction can be read as "x times the limit".
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .cluster import Cluster, ClusterError, Placement, default_placement, load_cluster, \
    load_placement
from ..errors import XreshardError

__all__ = ["SimulationError", "simulate", "simulate_plan", "lower_bound", "add_arguments",
           "run"]

SCHEDULES = ("direct", "relay", "auto")


class SimulationError(XreshardError):
    """A simulation cannot run as asked (bad option, missing optional dependency)."""


@dataclass(frozen=True)
class Prediction:
    """One schedule replayed: seconds, bytes per link class, what set the time."""

    schedule: str
    seconds: float
    num_rounds: int
    num_messages: int
    distinct_rounds: int
    bytes_by_link: dict[str, int]
    critical: dict[str, Any]
    traffic: Any
    replay: Any


# ---------------------------------------------------------------------------- bound

def _groups(layout: Any, cache: dict[int, list]) -> list[tuple[tuple, tuple[int, ...]]]:
    """``[(regions, ranks)]``: the layout's ranks grouped by the regions they hold."""
    got = cache.get(id(layout))
    if got is None:
        groups: dict[tuple, list[int]] = {}
        for rank in layout.ranks:
            regs = tuple(r for r in layout.regions(rank) if not r.is_empty)
            if regs:
                groups.setdefault(regs, []).append(rank)
        got = cache[id(layout)] = [(k, tuple(v)) for k, v in groups.items()]
    return got


def _overlap(a: tuple, b: tuple) -> int:
    return sum(x.size for ra in a for rb in b if (x := ra.intersect(rb)) is not None)


def lower_bound(plan: Any, net: Any) -> dict[str, Any]:
    """The least time any schedule could take for ``plan``'s layouts on ``net``.

    The largest of: (a) per destination domain, the bytes its ranks need that no rank of
    the domain holds, over the NICs of its nodes (each byte enters a domain at least once;
    NVLink fan-out inside is free here); (b) per source domain, the bytes held only there
    that a rank elsewhere needs, over its nodes' NICs (each leaves at least once); (c) per
    receiver, what it lacks over its NVLink plus NIC ingress; (d) per rank holding a region
    alone, that region over its NVLink plus NIC egress. Identical regions are counted once
    per domain; regions overlapping only partly are not merged (exact for partition
    layouts, which every recipe produces).

    Returns:
        ``{"seconds", "by": which term, "where": domain or rank}``.
    """
    cluster: Cluster = net.cluster
    dom = net.rank_domain
    node_of = net.rank_node
    domain_nics: dict[int, int] = {}
    for d in set(dom.tolist()):
        domain_nics[d] = len(set(node_of[dom == d].tolist())) * cluster.nics_per_node
    cache: dict[int, list] = {}
    pairs: dict[tuple[int, int, int], list] = {}
    from ..dtypes import itemsize
    for name in plan.names:
        s, d = plan.src[name], plan.dst[name]
        key = (id(s), id(d), itemsize(plan.wire_dtypes[name]))
        got = pairs.get(key)
        if got is None:
            pairs[key] = [s, d, key[2], 1]
        else:
            got[3] += 1
    need_in: dict[int, float] = {}
    export: dict[int, float] = {}
    alone: dict[int, float] = {}
    for s, d, isz, count in pairs.values():
        src_groups = _groups(s, cache)
        dst_groups = _groups(d, cache)
        src_by_domain: dict[int, list[tuple]] = {}
        for regs, ranks in src_groups:
            for dm in {int(dom[r]) for r in ranks}:
                src_by_domain.setdefault(dm, []).append(regs)
        for regs, ranks in dst_groups:
            size = sum(r.size for r in regs)
            for dm in {int(dom[r]) for r in ranks}:
                held = max((_overlap(regs, h) for h in src_by_domain.get(dm, ())), default=0)
                need_in[dm] = need_in.get(dm, 0.0) + (size - held) * isz * count
        for regs, ranks in src_groups:
            doms = {int(dom[r]) for r in ranks}
            size = sum(r.size for r in regs)
            wanted_outside = any(_overlap(regs, dr) for dr, dranks in dst_groups
                                 if any(int(dom[x]) not in doms for x in dranks))
            if len(doms) == 1 and wanted_outside:
                dm = next(iter(doms))
                export[dm] = export.get(dm, 0.0) + size * isz * count
            if len(ranks) == 1 and any(_overlap(regs, dr) for dr, dranks in dst_groups
                                       if any(x != ranks[0] for x in dranks)):
                alone[ranks[0]] = alone.get(ranks[0], 0.0) + size * isz * count
    terms: list[tuple[float, str, Any]] = [(0.0, "none", None)]
    for dm, b in need_in.items():
        terms.append((b / (domain_nics[dm] * cluster.nic_bw), "domain network ingress", dm))
    for dm, b in export.items():
        terms.append((b / (domain_nics[dm] * cluster.nic_bw), "domain network egress", dm))
    per_gpu = cluster.nic_bw + cluster.nvlink_bw
    for r, b in plan.stats.bytes_received.items():
        terms.append((b / per_gpu, "receiver ingress", r))
    for r, b in alone.items():
        terms.append((b / per_gpu, "sender egress", r))
    sec, by, where = max(terms, key=lambda t: t[0])
    return {"seconds": sec, "by": by, "where": where}


# ---------------------------------------------------------------------------- simulate

def _predict(name: str, traffic: Any, net: Any,
             progress: Callable[[int, int], None] | None) -> Prediction:
    from .engine import NETWORK, NVLINK, replay
    rep = replay(net, traffic, progress)
    # bytes per link class, from the bytes per (src, dst) pair
    src, dst, b = traffic.pair_totals()
    links, kind = net.paths(src, dst)
    net_bytes = int(round(b[kind == NETWORK].sum()))
    hop = (kind == NETWORK) & (links[:, 0] != net.num_links)
    nv_bytes = int(round(b[kind == NVLINK].sum() + b[hop].sum()))
    if rep.critical_link >= 0:
        cls, what, ranks = net.describe_link(rep.critical_link)
    else:
        cls, what, ranks = "none", "", []
    critical = {"link": cls, "where": what, "ranks": ranks,
                "last_message": {NETWORK: "network", NVLINK: "nvlink"}.get(rep.critical_kind,
                                                                          "local")}
    return Prediction(name, rep.seconds, traffic.num_rounds, len(traffic), rep.distinct_rounds,
                      {"nvlink": nv_bytes, "network": net_bytes}, critical, traffic, rep)


def simulate_plan(plan: Any, cluster: Cluster, placement: Placement, *,
                  schedule: str = "direct", bucket_bytes: int = 64 << 20,
                  staging_bytes: int = 256 << 20, peer_cap: bool = True,
                  progress: bool | None = None) -> dict[str, Any]:
    """Replay ``plan``'s schedule(s) on ``cluster`` under ``placement``.

    Args:
        plan: a ``Plan`` over world ranks ``0..placement.num_ranks - 1``.
        schedule: ``"direct"`` (the executor's schedule today), ``"relay"``
            (``sim/relay.py``) or ``"auto"`` (both; the faster is reported).
        bucket_bytes / staging_bytes: as ``RefitConfig``.
        peer_cap: hold network messages under NCCL's per-peer channel cap.
        progress: print progress on stderr (default: when stderr is a terminal).

    Returns:
        A JSON-able dict; see :func:`simulate`.
    """
    from .engine import Network
    from .relay import relay_traffic
    from .traffic import Progress, direct_traffic, pair_sequences
    if schedule not in SCHEDULES:
        raise SimulationError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    t0 = time.process_time()
    num_ranks = placement.num_ranks
    top = max((r for lay in {id(v): v for v in (*plan.src.values(), *plan.dst.values())}
               .values() for r in lay.ranks), default=-1)
    if top >= num_ranks:
        raise ClusterError(f"the plan uses rank {top} but the placement places only "
                           f"{num_ranks} ranks")
    placement.check(cluster, num_ranks)
    net = Network(cluster, placement, peer_cap=peer_cap)
    predictions = {}
    if schedule in ("direct", "auto"):
        # the direct schedule needs only each pair's sequence of shapes: no Transfer objects
        seqs = pair_sequences(plan, Progress("transfers", progress))
        tr = direct_traffic(plan, seqs, bucket_bytes=bucket_bytes,
                            staging_bytes=staging_bytes, progress=Progress("direct", progress))
        del seqs
        predictions["direct"] = _predict("direct", tr, net, Progress("replay direct", progress))
    if schedule in ("relay", "auto"):
        tr = relay_traffic(plan, placement.domain, bucket_bytes=bucket_bytes,
                           staging_bytes=staging_bytes,
                           progress=Progress("relay", progress)).traffic
        predictions["relay"] = _predict("relay", tr, net, Progress("replay relay", progress))
    best = min(predictions.values(), key=lambda p: p.seconds)
    bound = lower_bound(plan, net)
    out: dict[str, Any] = {
        "schedule": best.schedule, "seconds": best.seconds,
        "lower_bound_seconds": bound["seconds"], "lower_bound": bound,
        "over_lower_bound": best.seconds / bound["seconds"] if bound["seconds"] else None,
        "bytes_by_link": best.bytes_by_link, "critical": best.critical,
        "num_rounds": best.num_rounds, "num_messages": best.num_messages,
        "distinct_rounds": best.distinct_rounds,
        "bytes_moved": int(plan.stats.bytes_moved),
        "cluster": cluster.name, "num_ranks": num_ranks,
        "num_domains": len(set(placement.domain)),
        "peer_cap_bytes_per_s": None if net.flow_cap == np.inf else net.flow_cap,
        "schedules": {k: {"seconds": p.seconds, "num_rounds": p.num_rounds,
                          "num_messages": p.num_messages, "bytes_by_link": p.bytes_by_link,
                          "critical": p.critical} for k, p in predictions.items()},
    }
    out["sim_seconds"] = time.process_time() - t0
    out["_predictions"] = predictions
    return out


def simulate(model: str, src: str, dst: str, cluster: str | Cluster, *,
             gpus: int | None = None, schedule: str = "direct",
             placement: str | Placement | None = None, layout: str = "per_expert",
             wire_dtype: str | None = None, bucket_bytes: int = 64 << 20,
             staging_bytes: int = 256 << 20, peer_cap: bool = True,
             progress: bool | None = None) -> dict[str, Any]:
    """Predict a refit of ``model`` from recipe ``src`` to recipe ``dst`` on ``cluster``.

    Ranks are numbered as ``xreshard plan`` numbers them (source first); the default
    placement puts each job in fresh NVLink domains (``cluster.default_placement``).

    Returns:
        A JSON-able dict: ``seconds`` (predicted refit time of the chosen schedule),
        ``lower_bound_seconds``, ``bytes_by_link`` (``{"nvlink", "network"}``),
        ``critical`` (link class, which link, the ranks on it), ``sim_seconds`` (CPU
        seconds of the whole simulation, planning included), per-schedule results under
        ``schedules``, and the plan's ``bytes_moved``.

    Raises:
        XreshardError: bad model, recipe, cluster, placement or option.
    """
    from ..catalog.models import load_model
    from ..planner.plan import plan as make_plan
    from ..catalog.recipes import parse_recipe, recipe_layouts
    t0 = time.process_time()
    c = load_cluster(cluster)
    m = load_model(model, layout)
    src_recipe, dst_recipe = parse_recipe(src), parse_recipe(dst)
    world = src_recipe.world_size + dst_recipe.world_size
    if gpus is not None and gpus != world:
        raise SimulationError(
            f"--gpus {gpus} but the recipes need {world} GPUs ({src_recipe.world_size} "
            f"source + {dst_recipe.world_size} destination, on separate GPUs); pass --gpus "
            f"{world} or omit it")
    if placement is None:
        pl = default_placement(c, [src_recipe.world_size, dst_recipe.world_size])
    elif isinstance(placement, Placement):
        pl = placement
    else:
        pl = load_placement(placement)
    p = make_plan(recipe_layouts(m, src_recipe, 0),
                  recipe_layouts(m, dst_recipe, src_recipe.world_size), wire_dtype=wire_dtype)
    out = simulate_plan(p, c, pl, schedule=schedule, bucket_bytes=bucket_bytes,
                        staging_bytes=staging_bytes, peer_cap=peer_cap, progress=progress)
    out.update(model=m.name, src=str(src_recipe), dst=str(dst_recipe),
               src_world_size=src_recipe.world_size, dst_world_size=dst_recipe.world_size,
               model_bytes=m.total_bytes, sim_seconds=time.process_time() - t0)
    out["_plan"] = p
    out["_placement"] = pl
    return out


def public(result: Mapping[str, Any]) -> dict[str, Any]:
    """``result`` without its in-memory objects (keys starting with ``_``)."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xreshard simulate``."""
    from .cluster import PRESETS
    parser.add_argument("--model", required=True, help="packaged model name or JSON inventory")
    parser.add_argument("--src", required=True, help="source recipe, e.g. "
                                                     "megatron:pp=4,ep=16,dp=2")
    parser.add_argument("--dst", required=True, help="destination recipe, e.g. vllm:tp=8,dp=16")
    parser.add_argument("--cluster", required=True,
                        help=f"preset ({', '.join(PRESETS)}) or a cluster JSON file")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs in the refit (source + destination); checked against "
                             "the recipes")
    parser.add_argument("--schedule", choices=SCHEDULES, default="direct",
                        help="direct (today's executor), relay (one network copy per "
                             "destination domain, NVLink fan-out) or auto (the faster)")
    parser.add_argument("--placement", default=None,
                        help="JSON file: {\"ranks\": [[domain, node, gpu], ...]} by world rank")
    parser.add_argument("--layout", choices=("per_expert", "stacked"), default="per_expert")
    parser.add_argument("--wire-dtype", default=None, help="cast on the sender to this dtype")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    parser.add_argument("--staging-bytes", type=int, default=256 << 20)
    parser.add_argument("--no-peer-cap", action="store_true",
                        help="ignore NCCL's per-peer network channel cap (e.g. for "
                             "device-initiated RDMA transports)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw a per-rank timeline and the rank x rank transfer heatmap "
                             "(needs matplotlib: pip install 'xreshard[plot]')")


def run(args: argparse.Namespace) -> int:
    if args.plot:
        from .plot import require_matplotlib
        require_matplotlib()
    result = simulate(args.model, args.src, args.dst, args.cluster, gpus=args.gpus,
                      schedule=args.schedule, placement=args.placement, layout=args.layout,
                      wire_dtype=args.wire_dtype, bucket_bytes=args.bucket_bytes,
                      staging_bytes=args.staging_bytes, peer_cap=not args.no_peer_cap)
    if args.plot:
        from .plot import plot
        pred = result["_predictions"][result["schedule"]]
        traffic, rep = pred.traffic, pred.replay
        if rep.finish is None:      # the direct schedule kept no per-message times
            from .engine import Network, replay
            traffic = traffic.to_traffic()
            rep = replay(Network(load_cluster(args.cluster), result["_placement"],
                                 peer_cap=not args.no_peer_cap), traffic)
        plot(args.plot, traffic, rep, result["num_ranks"],
             title=f"{result['model']} {result['src']} -> {result['dst']} on "
                   f"{result['cluster']}, {result['schedule']}: {result['seconds']:.3f} s")
    out = public(result)
    if args.json:
        print(json.dumps(out, sort_keys=True, default=_jsonable))
    else:
        print(format_result(out))
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON-able: {type(x).__name__}")


def format_result(r: Mapping[str, Any]) -> str:
    """A two-column table of a simulation result."""
    gb = 1e9
    crit = r["critical"]
    rows = [("model", f"{r['model']}: {r['src']} -> {r['dst']}"),
            ("cluster", f"{r['cluster']}, {r['num_ranks']} GPUs in {r['num_domains']} "
                        "NVLink domains")]
    for name, s in r["schedules"].items():
        rows.append((f"{name} schedule", f"{s['seconds']:.3f} s ({s['num_rounds']:,} rounds, "
                                         f"{s['num_messages']:,} messages)"))
    rows += [("predicted refit", f"{r['seconds']:.3f} s ({r['schedule']})"),
             ("lower bound", f"{r['lower_bound_seconds']:.3f} s ({r['lower_bound']['by']} "
                             f"{r['lower_bound']['where']})"),
             ("network bytes", f"{r['bytes_by_link']['network'] / gb:,.1f} GB"),
             ("nvlink bytes", f"{r['bytes_by_link']['nvlink'] / gb:,.1f} GB"),
             ("critical link", f"{crit['link']}: {crit['where']} (ranks "
                               f"{', '.join(map(str, crit['ranks'][:8]))})"),
             ("simulation", f"{r['sim_seconds']:.1f} s CPU")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
