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
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .cluster import Cluster, ClusterError, Placement, default_placement, load_cluster, \
    load_placement
from .wire import WIRES, Wire
from ..dtypes import itemsize
from ..errors import XreshardError

__all__ = ["SimulationError", "simulate", "simulate_plan", "lower_bound", "add_arguments",
           "run", "byte_size", "check_arguments"]

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
    bytes_received_max: int


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


def _bytes_per_element(plan: Any, wire: Wire) -> dict[str, float]:
    """The fewest wire bytes per element each tensor can travel in under ``wire`` (FP8:
    every block whole; delta: a large bucket's encoding)."""
    from .wire import delta_ratio, fp8_bytes, quantized
    out = {}
    for name in plan.names:
        isz = itemsize(plan.wire_dtypes[name])
        shape = plan.dst_layouts[name].shape
        n = math.prod(shape)
        if wire.fmt == "fp8" and quantized(name, shape) and n:
            out[name] = fp8_bytes((0,) * len(shape), shape, shape, isz, wire.block) / n
        elif wire.delta is not None:
            out[name] = isz * delta_ratio(wire.delta, isz)
        else:
            out[name] = float(isz)
    return out


def _crossings(pairs: Any, group: np.ndarray, cache: dict[int, list]
               ) -> tuple[dict[int, float], dict[int, float]]:
    """Per group of ranks (a domain, a site): the bytes its ranks need that none of them
    holds, and the bytes held only in it that a rank elsewhere needs."""
    need_in: dict[int, float] = {}
    export: dict[int, float] = {}
    for s, d, bpe, count in pairs:
        src_groups = _groups(s, cache)
        dst_groups = _groups(d, cache)
        src_by_group: dict[int, list[tuple]] = {}
        for regs, ranks in src_groups:
            for g in {int(group[r]) for r in ranks}:
                src_by_group.setdefault(g, []).append(regs)
        for regs, ranks in dst_groups:
            size = sum(r.size for r in regs)
            for g in {int(group[r]) for r in ranks}:
                held = max((_overlap(regs, h) for h in src_by_group.get(g, ())), default=0)
                need_in[g] = need_in.get(g, 0.0) + (size - held) * bpe * count
        for regs, ranks in src_groups:
            gs = {int(group[r]) for r in ranks}
            if len(gs) == 1 and any(_overlap(regs, dr) for dr, dranks in dst_groups
                                    if any(int(group[x]) not in gs for x in dranks)):
                g = next(iter(gs))
                export[g] = export.get(g, 0.0) + sum(r.size for r in regs) * bpe * count
    return need_in, export


def lower_bound(plan: Any, net: Any, wire: Wire | None = None) -> dict[str, Any]:
    """The least time any schedule could take for ``plan``'s layouts on ``net``.

    The largest of: (a) per destination domain, the bytes its ranks need that no rank of
    the domain holds, over the NICs (and site links) of its nodes (each byte enters a
    domain at least once; NVLink fan-out inside is free here); (b) per source domain, the
    bytes held only there that a rank elsewhere needs, over the same links (each leaves at
    least once); (c) and (d) the same per site, over its nodes' site links; (e) per
    receiver, what it lacks over its NVLink, NIC and site link ingress; (f) per rank holding
    a region alone, that region over the same egress. Identical regions are counted once
    per domain; regions overlapping only partly are not merged (exact for partition
    layouts, which every recipe produces). Bytes are the fewest ``wire`` can carry them in
    (:func:`_bytes_per_element`).

    Returns:
        ``{"seconds", "by": which term, "where": domain, site or rank}``.
    """
    wire = wire if wire is not None else Wire()
    cluster: Cluster = net.cluster
    dom, site, node_of = net.rank_domain, net.rank_site, net.rank_node
    bpe = _bytes_per_element(plan, wire)
    cache: dict[int, list] = {}
    pairs: dict[tuple[int, int, float], list] = {}
    for name in plan.names:
        s, d = plan.src_layouts[name], plan.dst_layouts[name]
        key = (id(s), id(d), bpe[name])
        got = pairs.get(key)
        if got is None:
            pairs[key] = [s, d, key[2], 1]
        else:
            got[3] += 1
    terms: list[tuple[float, str, Any]] = [(0.0, "none", None)]
    for label, group in (("domain", dom), ("site", site)):
        if label == "site" and len(set(site.tolist())) < 2:
            continue
        nodes = {g: len(set(node_of[group == g].tolist())) for g in set(group.tolist())}
        links = {g: n * cluster.site_bw + (n * cluster.nics_per_node * cluster.nic_bw
                                           if label == "domain" else 0.0)
                 for g, n in nodes.items()}
        need_in, export = _crossings(pairs.values(), group, cache)
        what = "network" if label == "domain" else "link"
        terms += [(b / links[g], f"{label} {what} ingress", g) for g, b in need_in.items()]
        terms += [(b / links[g], f"{label} {what} egress", g) for g, b in export.items()]
    per_gpu = cluster.nic_bw + cluster.nvlink_bw + cluster.site_bw
    scale = min((bpe[n] / itemsize(plan.wire_dtypes[n]) for n in plan.names), default=1.0)
    for r, b in plan.stats.bytes_received.items():
        terms.append((b * scale / per_gpu, "receiver ingress", r))
    alone: dict[int, float] = {}
    for s, d, b, count in pairs.values():
        dst_groups = _groups(d, cache)
        for regs, ranks in _groups(s, cache):
            if len(ranks) == 1 and any(_overlap(regs, dr) for dr, dranks in dst_groups
                                       if any(x != ranks[0] for x in dranks)):
                alone[ranks[0]] = alone.get(ranks[0], 0.0) + sum(r.size for r in regs) * b * count
    for r, b in alone.items():
        terms.append((b / per_gpu, "sender egress", r))
    sec, by, where = max(terms, key=lambda t: t[0])
    return {"seconds": sec, "by": by, "where": where}


# ---------------------------------------------------------------------------- simulate

def _predict(name: str, traffic: Any, net: Any, progress: Callable[[int, int], None] | None,
             busy: bool = False) -> Prediction:
    from .engine import KIND_NAMES, NETWORK, NVLINK, SITE, replay
    rep = replay(net, traffic, progress, busy=busy)
    seconds = rep.seconds + net.cluster.call_latency
    # bytes per link class, from the bytes per (src, dst) pair
    src, dst, b = traffic.pair_totals()
    links, kind = net.paths(src, dst)
    hop = (kind == NETWORK) & (links[:, 0] != net.num_links)
    by_link = {"nvlink": int(round(b[kind == NVLINK].sum() + b[hop].sum())),
               "network": int(round(b[kind == NETWORK].sum()))}
    if (kind == SITE).any():
        by_link["site"] = int(round(b[kind == SITE].sum()))
    received = np.bincount(dst, weights=b, minlength=net.placement.num_ranks)
    if rep.critical_link >= 0:
        cls, what, ranks = net.describe_link(rep.critical_link)
    else:
        cls, what, ranks = "none", "", []
    critical = {"link": cls, "where": what, "ranks": ranks,
                "last_message": KIND_NAMES.get(rep.critical_kind, "local")}
    return Prediction(name, seconds, traffic.num_rounds, len(traffic), rep.distinct_rounds,
                      by_link, critical, traffic, rep, int(received.max(initial=0)))


def _check_sizes(bucket_bytes: Any, staging_bytes: Any) -> None:
    """Refuse what ``RefitConfig`` refuses, naming the option."""
    from ..config import RefitConfig
    from ..errors import RefitError
    for option, value in (("bucket_bytes", bucket_bytes), ("staging_bytes", staging_bytes)):
        try:
            RefitConfig(**{option: value})
        except RefitError as e:
            raise SimulationError(f"{option} must be a positive int of bytes (as "
                                  f"RefitConfig.{option}), got {value!r}") from e


def simulate_plan(plan: Any, cluster: Cluster, placement: Placement, *,
                  schedule: str = "direct", bucket_bytes: int = 64 << 20,
                  staging_bytes: int = 256 << 20, peer_cap: bool = True,
                  wire: Wire | None = None, progress: bool | None = None,
                  busy: bool = False) -> dict[str, Any]:
    """Replay ``plan``'s schedule(s) on ``cluster`` under ``placement``.

    Args:
        plan: a ``Plan`` over world ranks ``0..placement.num_ranks - 1``.
        schedule: ``"direct"`` (``RefitConfig(relay="off")``), ``"relay"`` (``relay="on"``
            with each NVLink domain declared as a host, ``sim/relay.py``) or ``"auto"``
            (both; the faster is reported).
        bucket_bytes / staging_bytes: as ``RefitConfig``.
        peer_cap: hold network messages under NCCL's per-peer channel cap.
        wire: what each transfer costs on the wire (``sim/wire.py``: the plan's dtypes by
            default, block FP8, a delta encoding).
        progress: print progress on stderr (default: when stderr is a terminal).
        busy: keep when each rank is busy in every round (for pictures).

    Returns:
        A JSON-able dict; see :func:`simulate`.
    """
    from .engine import Network
    from .relay import relay_traffic
    from .traffic import Progress, direct_traffic, pair_sequences
    if schedule not in SCHEDULES:
        raise SimulationError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    _check_sizes(bucket_bytes, staging_bytes)
    wire = wire if wire is not None else Wire()
    t0 = time.process_time()
    num_ranks = placement.num_ranks
    layouts = (*plan.src_layouts.values(), *plan.dst_layouts.values())
    top = max((r for lay in {id(v): v for v in layouts}.values() for r in lay.ranks),
              default=-1)
    if top >= num_ranks:
        raise ClusterError(f"the plan uses rank {top} but the placement places only "
                           f"{num_ranks} ranks")
    placement.check(cluster, num_ranks)
    net = Network(cluster, placement, peer_cap=peer_cap)
    predictions = {}
    if schedule in ("direct", "auto"):
        # the direct schedule needs only each pair's sequence of shapes: no Transfer objects
        seqs = pair_sequences(plan, Progress("transfers", progress), wire=wire)
        tr = direct_traffic(plan, seqs, bucket_bytes=bucket_bytes, staging_bytes=staging_bytes,
                            progress=Progress("direct", progress), wire=wire)
        del seqs
        predictions["direct"] = _predict("direct", tr, net, Progress("replay direct", progress),
                                         busy)
    if schedule in ("relay", "auto"):
        tr = relay_traffic(plan, placement.domain, bucket_bytes=bucket_bytes,
                           staging_bytes=staging_bytes, wire=wire,
                           progress=Progress("relay", progress)).traffic
        predictions["relay"] = _predict("relay", tr, net, Progress("replay relay", progress),
                                        busy)
    best = min(predictions.values(), key=lambda p: p.seconds)
    bound = lower_bound(plan, net, wire)
    out: dict[str, Any] = {
        "schedule": best.schedule, "seconds": best.seconds,
        "lower_bound_seconds": bound["seconds"], "lower_bound": bound,
        "over_lower_bound": best.seconds / bound["seconds"] if bound["seconds"] else None,
        "bytes_by_link": best.bytes_by_link, "critical": best.critical,
        "num_rounds": best.num_rounds, "num_messages": best.num_messages,
        "distinct_rounds": best.distinct_rounds,
        "bytes_moved": int(plan.stats.bytes_moved),
        "bytes_received_max": best.bytes_received_max,
        "wire": {"format": wire.fmt, "delta": wire.delta, "block": wire.block,
                 "describe": wire.describe()},
        "cluster": cluster.name, "num_ranks": num_ranks,
        "num_domains": len(set(placement.domain)),
        "peer_cap_bytes_per_s": None if net.flow_cap == np.inf else net.flow_cap,
        "schedules": {k: {"seconds": p.seconds, "num_rounds": p.num_rounds,
                          "num_messages": p.num_messages, "bytes_by_link": p.bytes_by_link,
                          "bytes_received_max": p.bytes_received_max,
                          "critical": p.critical} for k, p in predictions.items()},
    }
    out["sim_seconds"] = time.process_time() - t0
    out["_predictions"] = predictions
    out["_network"] = net
    return out


def simulate(model: str, src: str, dst: str, cluster: str | Cluster, *,
             gpus: int | None = None, schedule: str = "direct",
             placement: str | Placement | None = None, layout: str = "per_expert",
             wire_dtype: str | None = None, bucket_bytes: int = 64 << 20,
             staging_bytes: int = 256 << 20, peer_cap: bool = True, wire: str = "dtype",
             delta: float | None = None, progress: bool | None = None,
             busy: bool = False, notes: list[str] | None = None) -> dict[str, Any]:
    """Predict a refit of ``model`` from recipe ``src`` to recipe ``dst`` on ``cluster``.

    Ranks are numbered as ``xreshard plan`` numbers them (source first); the default
    placement puts each job in fresh NVLink domains (``cluster.default_placement``).
    ``wire`` ("dtype" or "fp8") and ``delta`` (changed fraction) say what the wire
    carries (``sim/wire.py``); ``notes`` collects what the recipes changed (dims that do
    not divide, replicated instead).

    Returns:
        A JSON-able dict: ``seconds`` (predicted refit time of the chosen schedule),
        ``lower_bound_seconds``, ``bytes_by_link`` (``{"nvlink", "network"}``, and
        ``"site"`` across datacenters), ``bytes_received_max`` (the most wire bytes one
        rank receives), ``critical`` (link class, which link, the ranks on it),
        ``sim_seconds`` (CPU seconds of the whole simulation, planning included),
        per-schedule results under ``schedules``, and the plan's ``bytes_moved``.

    Raises:
        XreshardError: bad model, recipe, cluster, placement or option.
    """
    from ..catalog.models import load_model
    from ..planner.plan import plan as make_plan
    from ..catalog.recipes import parse_recipe, recipe_layouts
    from .traffic import Progress
    t0 = time.process_time()
    _check_sizes(bucket_bytes, staging_bytes)
    w = Wire(wire, delta=delta)
    c = load_cluster(cluster)
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
    step = Progress("plan", progress)
    step(0, 3, "model")
    m = load_model(model, layout)
    step(1, 3, "layouts")
    src_l = recipe_layouts(m, src_recipe, 0, notes=notes)
    dst_l = recipe_layouts(m, dst_recipe, src_recipe.world_size, notes=notes)
    step(2, 3, "plan")
    p = make_plan(src_l, dst_l, wire_dtype=wire_dtype)
    step(3, 3, "done")
    out = simulate_plan(p, c, pl, schedule=schedule, bucket_bytes=bucket_bytes,
                        staging_bytes=staging_bytes, peer_cap=peer_cap, wire=w,
                        progress=progress, busy=busy)
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

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20,
          "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}

#: file types ``--plot`` writes (matplotlib's Agg backend)
PLOT_TYPES = (".png", ".pdf", ".svg")


def byte_size(text: str) -> int:
    """``"67108864"``, ``"64MiB"``, ``"64M"`` (binary), ``"64MB"`` (decimal) -> bytes.

    Raises:
        ValueError: not a whole number of bytes with a known unit.
    """
    m = re.fullmatch(r"\s*(-?\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a number of bytes (e.g. 67108864, 64MiB, 1GiB)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xreshard simulate``."""
    from .cluster import PRESETS
    parser.add_argument("--model", required=True, help="packaged model name or JSON inventory")
    parser.add_argument("--src", required=True, help="source recipe, e.g. "
                                                     "megatron:pp=4,ep=16,dp=2")
    parser.add_argument("--dst", required=True, help="destination recipe, e.g. vllm:tp=8,dp=16")
    parser.add_argument("--cluster", required=True,
                        help=f"preset ({', '.join(PRESETS)}), localhost (this machine, "
                             "measured by benchmarks/calibrate_localhost.py) or a cluster "
                             "JSON file")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs in the refit (source + destination); checked against "
                             "the recipes")
    parser.add_argument("--schedule", choices=SCHEDULES, default="direct",
                        help="direct (relay='off'), relay (relay='on': each byte enters a "
                             "destination NVLink domain once, its ranks forward it) or auto "
                             "(both; the faster is reported)")
    parser.add_argument("--placement", default=None,
                        help="JSON file: {\"ranks\": [[domain, node, gpu(, site)], ...]} by "
                             "world rank")
    parser.add_argument("--layout", choices=("per_expert", "stacked"), default="per_expert")
    parser.add_argument("--wire-dtype", default=None,
                        help="cast on the sender to this dtype (e.g. bfloat16)")
    parser.add_argument("--wire", choices=WIRES, default="dtype",
                        help="dtype: every tensor in its (wire) dtype; fp8: block FP8 "
                             "(e4m3 + a float32 scale per 128x128 block) for linear weights, "
                             "as block-FP8 engines hold them")
    parser.add_argument("--delta", type=float, default=None, metavar="FRACTION",
                        help="price a delta refit where FRACTION of the elements changed "
                             "(e.g. 0.01): each bucket in the smallest of dense, bitmask + "
                             "values, index runs + values")
    parser.add_argument("--bucket-bytes", default=str(64 << 20), metavar="BYTES",
                        help="most bytes in one message (as RefitConfig; 67108864, 64MiB)")
    parser.add_argument("--staging-bytes", default=str(256 << 20), metavar="BYTES",
                        help="most bytes a rank has in flight in one round (as RefitConfig)")
    parser.add_argument("--no-peer-cap", action="store_true",
                        help="ignore NCCL's per-peer network channel cap (e.g. for "
                             "device-initiated RDMA transports)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw when each rank is busy and the bytes between ranks "
                             f"({', '.join(PLOT_TYPES)}; needs matplotlib: pip install "
                             "'xreshard[plot]')")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` as one line (checked before any work), or None;
    parses ``--bucket-bytes`` / ``--staging-bytes`` in place."""
    for flag in ("bucket_bytes", "staging_bytes"):
        text = getattr(args, flag)
        try:
            value = byte_size(text) if isinstance(text, str) else text
        except ValueError as e:
            return f"--{flag.replace('_', '-')}: {e}"
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return (f"--{flag.replace('_', '-')} must be a positive number of bytes, as "
                    f"RefitConfig.{flag} (e.g. {64 << 20} or 64MiB); got {text}")
        setattr(args, flag, value)
    if args.gpus is not None and args.gpus <= 0:
        return f"--gpus must be a positive number of GPUs, got {args.gpus}"
    if args.wire_dtype is not None:
        from ..dtypes import dtype_name
        try:
            dtype_name(args.wire_dtype)
        except XreshardError as e:
            return f"--wire-dtype: {str(e).split('; ')[0]}"
    if args.delta is not None and not 0.0 <= args.delta <= 1.0:
        return f"--delta is the changed fraction of elements, in [0, 1]; got {args.delta}"
    if args.delta is not None and args.wire == "fp8":
        return ("--delta with --wire fp8 is not priced (a changed element requantizes its "
                "whole block); drop one of them")
    if args.plot:
        return _check_plot_path(args.plot)
    return None


def _check_plot_path(path: str) -> str | None:
    import os
    from pathlib import Path
    target = Path(path).expanduser()
    if target.suffix.lower() not in PLOT_TYPES:
        return (f"--plot {path}: the file type must be one of {', '.join(PLOT_TYPES)} "
                f"(got {target.suffix or 'none'})")
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        return f"--plot {path} is a folder; give a file name, e.g. {target / 'refit.png'}"
    if not folder.is_dir():
        return f"--plot {path}: folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"--plot {path}: cannot write there (permission denied)"
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem is not None:
        print(f"xreshard simulate: error: {problem}", file=sys.stderr)
        return 2
    if args.plot:
        from .plot import require_matplotlib
        require_matplotlib()
    notes: list[str] = []
    result = simulate(args.model, args.src, args.dst, args.cluster, gpus=args.gpus,
                      schedule=args.schedule, placement=args.placement, layout=args.layout,
                      wire_dtype=args.wire_dtype, bucket_bytes=args.bucket_bytes,
                      staging_bytes=args.staging_bytes, peer_cap=not args.no_peer_cap,
                      wire=args.wire, delta=args.delta, busy=bool(args.plot), notes=notes)
    for note in notes:
        print(f"xreshard simulate: note: {note}", file=sys.stderr)
    if args.plot:
        from .plot import plot
        plot(args.plot, result)
        print(f"xreshard simulate: wrote {args.plot}", file=sys.stderr)
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


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def format_result(r: Mapping[str, Any]) -> str:
    """A two-column table of a simulation result."""
    crit = r["critical"]
    rows = [("model", f"{r['model']}: {r['src']} -> {r['dst']}"),
            ("cluster", f"{r['cluster']}, {r['num_ranks']} GPUs in {r['num_domains']} "
                        "NVLink domains"),
            ("wire", r["wire"]["describe"])]
    for name, s in r["schedules"].items():
        rows.append((f"{name} schedule", f"{s['seconds']:.3f} s ({s['num_rounds']:,} rounds, "
                                         f"{s['num_messages']:,} messages)"))
    rows += [("predicted refit", f"{r['seconds']:.3f} s ({r['schedule']})"),
             ("lower bound", f"{r['lower_bound_seconds']:.3f} s ({r['lower_bound']['by']} "
                             f"{r['lower_bound']['where']})")]
    rows += [(f"{k} bytes", _gb(v)) for k, v in r["bytes_by_link"].items()]
    rows += [("most received by a rank", _gb(r["bytes_received_max"])),
             ("critical link", f"{crit['link']}: {crit['where']} (ranks "
                               f"{', '.join(map(str, crit['ranks'][:8]))})"),
             ("simulation", f"{r['sim_seconds']:.1f} s CPU")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
