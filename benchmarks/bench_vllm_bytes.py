"""Bytes each vLLM rank receives per refit: xreshard's shard-to-shard plan vs the full-tensor
path of vLLM's NCCL backend, for Qwen2.5-0.5B's shapes (or a Qwen3 MoE's, with or without
expert parallelism).

    python benchmarks/bench_vllm_bytes.py [--model qwen2_5_0_5b] [--tp 2] [--trainer jax:fsdp=4]
    python benchmarks/bench_vllm_bytes.py --model qwen3_30b_a3b --tp 4 --ep
    python benchmarks/bench_vllm_bytes.py --engines 8    # one trainer refits 8 engines at once

No engine and no weights: the destination layouts are recorded from vLLM's own loaders on a
meta-device model built from a Qwen2Config (Qwen3MoeConfig for a model with experts) of
the model's sizes, one TP rank at a time
(``fake_tp``), exactly as the ``"xreshard"`` backend records them inside a worker. The
source is a trainer recipe (``xreshard.catalog.recipes``). Per vLLM rank it prints:

* xreshard: bytes the plan delivers to the rank (its shard bytes: fused qkv / gate_up
  pieces, its vocab rows, the replicated norms; the padded vocab tail is never sent);
* nccl (full tensors): vLLM's ``nccl`` backend broadcasts every full tensor from trainer
  rank 0 and every worker narrows its slice in ``load_weights``: each rank receives the
  whole model.

Prints a markdown table for benchmarks/RESULTS.md. Runs in under a minute on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--trainer", default="jax:fsdp=4", help="source recipe (xreshard.catalog.recipes)")
    ap.add_argument("--engines", type=int, default=1,
                    help="identical engines refit together (the backend's num_engines)")
    ap.add_argument("--ep", action="store_true",
                    help="vLLM's enable_expert_parallel: experts whole, split over the ranks")
    ap.add_argument("--stream-mib", type=int, default=256,
                    help="a worker's streaming budget (the backend's stream_bytes): the "
                         "summary says how many groups of layers a refit then takes")
    args = ap.parse_args()

    import transformers

    import xreshard
    from xreshard.adapters import vllm as xv
    from xreshard.dtypes import itemsize
    from xreshard.catalog.models import load_model
    from xreshard.catalog.recipes import parse_recipe, recipe_layouts

    model = load_model(args.model)
    c = dict(model.config)
    if "num_experts" in c:
        cfg, arch = transformers.Qwen3MoeConfig(**c), "Qwen3MoeForCausalLM"
    else:
        cfg, arch = transformers.Qwen2Config(**{k: c[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "tie_word_embeddings") if k in c}), \
            "Qwen2ForCausalLM"
    cfg.architectures = [arch]
    specs = {p.name: (p.shape, p.dtype) for p in model.params}
    dtype = model.params[0].dtype
    t0 = time.perf_counter()
    vllm_config = xv.make_vllm_config(cfg, dtype=dtype, tp_size=args.tp,
                                      enable_expert_parallel=args.ep)
    recs = {r: xv.record_from_config(vllm_config, r, args.tp, specs) for r in range(args.tp)}
    record_s = time.perf_counter() - t0

    src_recipe = parse_recipe(args.trainer)
    offset = src_recipe.world_size
    src = recipe_layouts(model, src_recipe, 0)
    one = xv.layouts_from_pieces(recs, {n: s for n, (s, _) in specs.items()},
                                 {n: d for n, (_, d) in specs.items()})
    engines = [[offset + e * args.tp + r for r in range(args.tp)] for e in range(args.engines)]
    dst = {n: xv.replicate_layout(lay, engines) for n, lay in one.items()}
    t0 = time.perf_counter()
    stats = xreshard.planner.plan(src, dst).stats
    plan_s = time.perf_counter() - t0

    full = model.total_bytes
    workers = [w for ranks in engines for w in ranks]
    # vLLM's loaders write each rank's shards; padding rows are no tensor's bytes
    shard = {w: sum(reg.size * itemsize(lay.dtype) for lay in dst.values()
                    for reg in lay.regions(w)) for w in workers}
    product = sum(lay.is_product for lay in dst.values())
    mib = 2 ** 20
    dest = xv.EngineRecording([recs[r] for r in range(args.tp)], 0, specs)
    groups = dest.groups(args.stream_mib * mib)
    print(f"{model.name}: {model.num_tensors} tensors, {full / mib:.1f} MiB ({dtype}); trainer "
          f"`{args.trainer}` -> {args.engines} x vLLM TP={args.tp}{' EP' if args.ep else ''}; "
          f"trainer ranks send {stats.bytes_moved / mib:.1f} MiB in all, the busiest "
          f"{max(stats.bytes_sent.values()) / mib:.1f} MiB (sender balance "
          f"{stats.sender_balance:.4f} x lower bound); recorded in {record_s:.1f} s, planned in "
          f"{plan_s * 1e3:.0f} ms; {product}/{len(dst)} destination layouts in product form; "
          f"streamed in {len(groups)} group(s) of layers within {args.stream_mib} MiB per "
          "worker\n",
          file=sys.stderr)
    print("| vLLM rank | xreshard: received (= shard bytes) | nccl backend: received (full "
          "tensors) | xreshard / nccl |")
    print("|---|---|---|---|")
    for w in workers:
        got = stats.bytes_received.get(w, 0)
        assert got == shard[w], (w, got, shard[w])
    for r, w in enumerate(engines[0]):     # every engine receives the same
        got = stats.bytes_received.get(w, 0)
        print(f"| {r} | {got / mib:.1f} MiB ({got:,} B) | {full / mib:.1f} MiB ({full:,} B) "
              f"| {got / full:.4f} |")
    total = sum(stats.bytes_received.get(w, 0) for w in workers)
    nccl = len(workers) * full
    print(f"| all {len(workers)} | {total / mib:.1f} MiB ({total:,} B) | {nccl / mib:.1f} MiB "
          f"({nccl:,} B) | {total / nccl:.4f} |")

if __name__ == "__main__":
    main()
