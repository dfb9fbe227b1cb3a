"""Planner benchmark: speed and memory at real scale, against a naive planner, and the
bytes every packaged model moves under a few recipe pairs.

    python benchmarks/bench_plan.py [--naive-budget SECONDS] [--skip-models]

1. Headline cases (per-expert checkpoints, ranks: source first, then destination):
   DeepSeek-V3 megatron:pp=4,ep=16,dp=2 -> vllm:tp=8,dp=16   (128 -> 128 ranks)
   Kimi-K2     megatron:pp=16,ep=64,dp=1 -> vllm:tp=16,dp=64 (1,024 -> 1,024 ranks)
   For each: recipe layouts, ``xreshard.plan`` over the whole world,
   ``plan.transfers_for`` of one source and one destination rank, peak Python memory
   (tracemalloc, in a separate run so it does not slow the timed one) and the process's
   max RSS; then a NAIVE planner that intersects every source rank's regions with every
   destination rank's regions, per tensor, picking the least-loaded holder. The naive
   planner runs on a fixed pseudo-random sample of tensors within a time budget and is
   extrapolated linearly to the whole model (stated in the output); on that sample its
   bytes, per-rank received bytes and moved bytes are checked against ``plan``'s.
2. Every model in ``xreshard/models`` under three recipe pairs (per-expert layout for MoE
   models): bytes moved / minimum, sender balance, gather-and-broadcast bytes.

Times are CPU seconds of this (single-threaded) process (wall time is inflated on a
shared machine), except where marked wall. Prints markdown tables for
benchmarks/RESULTS.md; progress goes to stderr. Runs in about two to three minutes.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import random
import resource
import sys
import time
import tracemalloc

import xreshard
from xreshard.dtypes import itemsize
from xreshard.catalog.models import list_models, load_model
from xreshard.catalog.recipes import parse_recipe, recipe_layouts

GiB = 2 ** 30

HEADLINE = [
    ("deepseek_v3", "megatron:pp=4,ep=16,dp=2,tp=1", "vllm:tp=8,dp=16"),
    ("kimi_k2", "megatron:pp=16,ep=64,dp=1", "vllm:tp=16,dp=64"),
]

#: model -> (source recipe, destination recipe, colocated?) ; colocated pairs share ranks
PAIRS = {
    "deepseek_v3": [("megatron:pp=4,ep=16,dp=2", "vllm:tp=8,dp=16", False),
                    ("fsdp:dp=64,tp=2", "vllm:tp=16,dp=8", False),
                    ("jax:fsdp=32,tp=4", "vllm:tp=8,dp=16", False)],
    "kimi_k2": [("megatron:pp=16,ep=64", "vllm:tp=16,dp=64", False),
                ("fsdp:dp=128,tp=8", "vllm:tp=16,dp=8", False),
                ("jax:fsdp=64,tp=4", "vllm:tp=8,dp=32", False)],
    "qwen3_235b_a22b": [("megatron:pp=4,ep=8,dp=2,tp=2", "vllm:tp=8,dp=4", False),
                        ("fsdp:dp=32,tp=4", "vllm:tp=4,dp=8", False),
                        ("jax:fsdp=16,tp=4", "vllm:tp=8,dp=8", False)],
    "qwen3_30b_a3b": [("megatron:pp=2,ep=8,tp=2", "vllm:tp=4,dp=4", False),
                      ("fsdp:dp=16", "vllm:tp=2,dp=8", False),
                      ("jax:fsdp=8,tp=2", "vllm:tp=8,dp=2", True)],
    "llama3_1_70b": [("megatron:pp=4,dp=4,tp=8", "vllm:tp=8,dp=4", False),
                     ("fsdp:dp=32,tp=4", "vllm:tp=4,dp=8", False),
                     ("fsdp:dp=8", "vllm:tp=8", True)],
    "llama3_1_8b": [("megatron:pp=2,dp=4,tp=2", "vllm:tp=2,dp=8", False),
                    ("fsdp:dp=16", "vllm:dp=8", False),
                    ("jax:fsdp=4,tp=2", "vllm:tp=4,dp=2", True)],
    "qwen2_5_0_5b": [("megatron:dp=4,tp=2", "vllm:tp=2,dp=4", False),
                     ("fsdp:dp=8", "vllm:dp=8", False),
                     ("jax:fsdp=4,tp=2", "vllm:tp=2,dp=4", True)],
}


# ---------------------------------------------------------------------------- naive planner

def naive_plan(src: dict, dst: dict, names: list[str], load: dict[int, int],
               received: dict[int, int]) -> int:
    """Bytes moved for ``names``: for every destination rank and region, intersect it with
    every source rank's regions; each distinct overlap goes from its least-loaded holder
    (nothing if the destination rank holds it itself). Updates ``load`` / ``received``."""
    moved = 0
    for name in names:
        s, d = src[name], dst[name]
        size = itemsize(d.dtype)
        src_regions = [(r, reg) for r in s.ranks for reg in s.regions(r)]
        for rank in d.ranks:
            for dreg in d.regions(rank):
                pieces: dict[tuple, list[int]] = {}
                for r, sreg in src_regions:
                    x = dreg.intersect(sreg)
                    if x is not None:
                        pieces.setdefault((x.starts, x.stops), []).append(r)
                for (starts, stops), holders in pieces.items():
                    if rank in holders:
                        continue
                    nbytes = math.prod(b - a for a, b in zip(starts, stops)) * size
                    sender = min(holders, key=lambda h: (load.get(h, 0), h))
                    load[sender] = load.get(sender, 0) + nbytes
                    received[rank] = received.get(rank, 0) + nbytes
                    moved += nbytes
    return moved


def peak_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


# ---------------------------------------------------------------------------- headline

def headline(model_name: str, src_text: str, dst_text: str, naive_budget: float) -> dict:
    model = load_model(model_name)
    src_r, dst_r = parse_recipe(src_text), parse_recipe(dst_text)
    c0 = time.process_time()
    src = recipe_layouts(model, src_r, 0)
    dst = recipe_layouts(model, dst_r, src_r.world_size)
    t_layouts = time.process_time() - c0

    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    plan = xreshard.plan(src, dst)
    t_plan, c_plan = time.perf_counter() - t0, time.process_time() - c0
    stats = plan.stats

    timings = {}
    for label, rank in (("src rank 0", 0), (f"dst rank {src_r.world_size}", src_r.world_size)):
        c0 = time.process_time()
        transfers = plan.transfers_for(rank)
        timings[label] = (time.process_time() - c0, len(transfers))
    del plan
    gc.collect()

    tracemalloc.start()
    xreshard.plan(src, dst)
    _, peak_plan = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    # naive baseline on a pseudo-random sample of tensors, within the time budget
    names = [p.name for p in model.params]
    order = _sample_order(len(names))
    load: dict[int, int] = {}
    received: dict[int, int] = {}
    done: list[str] = []
    naive_moved = 0
    c0 = time.process_time()
    for i in order:
        naive_moved += naive_plan(src, dst, [names[i]], load, received)
        done.append(names[i])
        if time.process_time() - c0 > naive_budget and len(done) >= 4:
            break
    t_naive_subset = time.process_time() - c0
    t_naive = t_naive_subset * len(names) / len(done)
    sub = xreshard.plan({n: src[n] for n in done}, {n: dst[n] for n in done})
    same_bytes = sub.stats.bytes_moved == naive_moved == sub.stats.bytes_min
    same_received = ({r: b for r, b in sub.stats.bytes_received.items() if b}
                     == {r: b for r, b in received.items() if b})
    naive_top = max(load.values(), default=0)
    return dict(
        model=model.name, src=str(src_r), dst=str(dst_r), tensors=len(names),
        ranks=f"{src_r.world_size} -> {dst_r.world_size}",
        layouts_s=t_layouts, plan_s=c_plan, plan_wall_s=t_plan,
        rank_timings=timings, peak_plan_mib=peak_plan / 2**20, max_rss_mib=peak_rss_mib(),
        transfers=stats.num_transfers, moved_gib=stats.bytes_moved / GiB,
        balance=stats.sender_balance,
        naive_tensors=len(done), naive_subset_s=t_naive_subset, naive_s=t_naive,
        naive_ok=same_bytes and same_received,
        naive_balance=naive_top / max(sub.stats.sender_lower_bound, 1),
        sub_balance=sub.stats.sender_balance,
    )


def _sample_order(n: int) -> list[int]:
    """A fixed pseudo-random order of the tensors: any prefix is a uniform sample."""
    order = list(range(n))
    random.Random(0).shuffle(order)
    return order


# ---------------------------------------------------------------------------- all models

def model_rows() -> list[dict]:
    rows = []
    for name in list_models():
        model = load_model(name)
        for src_text, dst_text, colocated in PAIRS.get(name, ()):
            src_r, dst_r = parse_recipe(src_text), parse_recipe(dst_text)
            src = recipe_layouts(model, src_r, 0)
            dst = recipe_layouts(model, dst_r, 0 if colocated else src_r.world_size)
            c0 = time.process_time()
            s = xreshard.plan(src, dst).stats
            cpu = time.process_time() - c0
            rows.append(dict(
                model=model.name, layout=model.layout, src=str(src_r), dst=str(dst_r),
                ranks=(f"{max(src_r.world_size, dst_r.world_size)} shared" if colocated
                       else f"{src_r.world_size} -> {dst_r.world_size}"),
                model_gib=model.total_bytes / GiB, moved_gib=s.bytes_moved / GiB,
                moved_over_min=s.bytes_moved / s.bytes_min if s.bytes_min else 1.0,
                local_gib=s.bytes_local / GiB, gb_gib=s.bytes_gather_broadcast / GiB,
                gb_over_moved=s.bytes_gather_broadcast / max(s.bytes_moved, 1),
                balance=s.sender_balance, balance_mean=s.sender_balance_mean,
                max_sent_gib=max(s.bytes_sent.values(), default=0) / GiB,
                transfers=s.num_transfers, plan_s=cpu))
            print(f"  {name:16} {str(src_r):34} -> {str(dst_r):18} {cpu:6.2f} s CPU",
                  file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------- output

def _short(recipe: str) -> str:
    """Drop size-1 axes for the tables."""
    fw, _, body = recipe.partition(":")
    kept = [e for e in body.split(",") if not e.endswith("=1")]
    return f"{fw}:{','.join(kept)}" if kept else fw


def print_headline(results: list[dict]) -> None:
    print("### Planner at scale (per-expert checkpoints)\n")
    print("| model | source -> destination | ranks | tensors | layouts, both sides (s) | "
          "plan, whole world: CPU (wall) s | transfers_for(src rank), CPU | "
          "transfers_for(dst rank), CPU | peak Python memory in plan (MiB) | max RSS (MiB) | "
          "transfers | sender balance |")
    print("|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for r in results:
        (ls, (ts, ns)), (ld, (td, nd)) = r["rank_timings"].items()
        print(f"| {r['model']} | {_short(r['src'])} -> {_short(r['dst'])} | {r['ranks']} | "
              f"{r['tensors']:,} | {r['layouts_s']:.2f} | {r['plan_s']:.2f} "
              f"({r['plan_wall_s']:.2f}) | "
              f"{ts:.3f} s, {ns:,} transfers | {td:.3f} s, {nd:,} transfers | "
              f"{r['peak_plan_mib']:,.0f} | {r['max_rss_mib']:,.0f} | {r['transfers']:,} | "
              f"{r['balance']:.4f} |")
    print("\n### Against a naive planner (every source rank's regions x every destination "
          "rank's regions, per tensor; least-loaded holder)\n")
    print("| model | naive: tensors run | naive: CPU s on them | naive: whole model, "
          "extrapolated linearly (CPU s) | xreshard.plan (CPU s) | speed-up | same bytes and "
          "per-rank bytes on the sample | naive greedy balance on sample | plan balance "
          "on sample |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['naive_tensors']:,} of {r['tensors']:,} | "
              f"{r['naive_subset_s']:.1f} | {r['naive_s']:,.0f} | {r['plan_s']:.2f} | "
              f"{r['naive_s'] / r['plan_s']:,.0f}x | {'yes' if r['naive_ok'] else 'NO'} | "
              f"{r['naive_balance']:.3f} | {r['sub_balance']:.3f} |")
    print()


def print_models(rows: list[dict]) -> None:
    print("### Bytes per refit, every packaged model (MoE models per-expert)\n")
    print("| model | source | destination | ranks | model (GiB) | moved (GiB) | moved / "
          "min | local (GiB) | gather+broadcast (GiB) | g+b / moved | max sent by a rank "
          "(GiB) | sender balance (/ lower bound) | balance (/ mean) | transfers | plan "
          "(CPU s) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {_short(r['src'])} | {_short(r['dst'])} | {r['ranks']} | "
              f"{r['model_gib']:,.1f} | {r['moved_gib']:,.1f} | {r['moved_over_min']:.4f} | "
              f"{r['local_gib']:,.1f} | {r['gb_gib']:,.0f} | {r['gb_over_moved']:.1f} | "
              f"{r['max_sent_gib']:,.2f} | {r['balance']:.4f} | {r['balance_mean']:.3f} | "
              f"{r['transfers']:,} | {r['plan_s']:.2f} |")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--naive-budget", type=float, default=15.0,
                        help="seconds of naive planning per headline case (default 15)")
    parser.add_argument("--skip-models", action="store_true",
                        help="only the headline cases")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print(f"<!-- bench_plan.py: python {platform.python_version()}, {platform.machine()}, "
          f"{platform.processor() or platform.platform()} -->\n")
    results = []
    for case in HEADLINE:
        print(f"headline {case[0]} ...", file=sys.stderr, flush=True)
        results.append(headline(*case, naive_budget=args.naive_budget))
    print_headline(results)
    if not args.skip_models:
        print("all models ...", file=sys.stderr, flush=True)
        print_models(model_rows())
    print(f"<!-- total {time.perf_counter() - t0:.0f} s -->")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
