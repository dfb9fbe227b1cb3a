"""Bytes each vLLM rank receives per refit: xreshard's shard-to-shard plan vs the full-tensor
path of vLLM's NCCL backend, for Qwen2.5-0.5B's shapes (or a Qwen3 MoE's, with or without
expert parallelism).

    python benchmarks/bench_vllm_bytes.py [--model qwen2_5_0_5b] [--tp 2] [--trainer jax:fsdp=4]
    python benchmarks/bench_vllm_bytes.py --model qwen3_30b_a3b --tp 4 --ep

No engine and no weights: the destination layouts are recorded from vLLM's own loaders on a
meta-device model built from a Qwen2Config (Qwen3MoeConfig for a model with experts) of
the model's sizes, one TP rank at a time
(``fake_tp``), exactly as the ``"xreshard"`` backend records them inside a worker. The
source is a trainer recipe (``xreshard.recipes``). Per vLLM rank it prints:

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
    ap.add_argument("--trainer", default="jax:fsdp=4", help="source recipe (xreshard.recipes)")
    ap.add_argument("--ep", action="store_true",
                    help="vLLM's enable_expert_parallel: experts whole, split over the ranks")
    args = ap.parse_args()

    import transformers

    import xreshard
    from xreshard.adapters import vllm as xv
    from xreshard.dtypes import itemsize
    from xreshard.models import load_model
    from xreshard.recipes import parse_recipe, recipe_layouts

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
    dst = xv.layouts_from_pieces({offset + r: rec for r, rec in recs.items()},
                                 {n: s for n, (s, _) in specs.items()},
                                 {n: d for n, (_, d) in specs.items()},
                                 order=[offset + r for r in range(args.tp)])
    t0 = time.perf_counter()
    stats = xreshard.plan(src, dst).stats
    plan_s = time.perf_counter() - t0

    full = model.total_bytes
    # vLLM's loaders write each rank's shards; padding rows are no tensor's bytes
    shard = {r: sum(reg.size * itemsize(lay.dtype) for lay in dst.values()
                    for reg in lay.regions(offset + r)) for r in range(args.tp)}
    product = sum(lay.is_product for lay in dst.values())
    mib = 2 ** 20
    print(f"{model.name}: {model.num_tensors} tensors, {full / mib:.1f} MiB ({dtype}); trainer "
          f"`{args.trainer}` -> vLLM TP={args.tp}{' EP' if args.ep else ''}; recorded in {record_s:.1f} s, planned in "
          f"{plan_s * 1e3:.0f} ms; {product}/{len(dst)} destination layouts in product form\n",
          file=sys.stderr)
    print("| vLLM rank | xreshard: received (= shard bytes) | nccl backend: received (full "
          "tensors) | xreshard / nccl |")
    print("|---|---|---|---|")
    for r in range(args.tp):
        got = stats.bytes_received.get(offset + r, 0)
        assert got == shard[r], (r, got, shard[r])
        print(f"| {r} | {got / mib:.1f} MiB ({got:,} B) | {full / mib:.1f} MiB ({full:,} B) "
              f"| {got / full:.4f} |")
    total = sum(stats.bytes_received.get(offset + r, 0) for r in range(args.tp))
    print(f"| all | {total / mib:.1f} MiB ({total:,} B) | {args.tp * full / mib:.1f} MiB "
          f"({args.tp * full:,} B) | {total / (args.tp * full):.4f} |")


if __name__ == "__main__":
    main()
