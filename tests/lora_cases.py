"""Processes of the in-memory LoRA test (module level, so launched children import them).

Three children: a JAX trainer (4 CPU devices, mesh fsdp=2 x tp=2, factors held as Flax
kernels ``[in, r]`` / ``[r, out]`` and sharded), a torch trainer (plain CPU tensors in
PEFT orientation, bf16), both in the ``"trainer"`` group of one refit world, and an engine
process holding a TP=2 ``vllm.LLM`` of a tiny Llama with ``enable_lora``. Rank 0 (JAX)
drives the engine through :class:`tests.vllm_cases.StoreClient`; after each round the
engine compares every slot with the same adapter loaded by vLLM from a PEFT directory the
trainers wrote.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from xreshard.runtime.commcount import count_comm

from . import vllm_cases as cases

#: a tiny Llama: GQA (4 q heads, 2 kv heads of 32), untied head; TP=2 splits every module
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
R, MAX_RANK, ALPHA = 8, 16, 16
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
WORLD_ID = "xreshard-lora-test"
TIMEOUT = 300.0
ENGINE_START = 900.0


def module_shapes(c: dict = CONFIG) -> dict[str, tuple[int, int]]:
    """Module name -> its base weight's (out, in)."""
    D, I = c["hidden_size"], c["intermediate_size"]
    hd = D // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out_in = {"q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q),
              "gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}
    return {f"model.layers.{layer}.{part}.{m}": out_in[m]
            for layer in range(c["num_hidden_layers"]) for part, ms in MODULES.items()
            for m in ms}


def factors(seed: int, r: int = R) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Module -> (A [r, in], B [out, r]) in fp32, PEFT orientation; B is not zero (a
    trained adapter), so every module changes the model."""
    rng = np.random.default_rng(seed)
    return {m: ((0.3 * rng.standard_normal((r, i))).astype(np.float32),
                (0.3 * rng.standard_normal((o, r))).astype(np.float32))
            for m, (o, i) in module_shapes().items()}


def slice_bytes(tp: int, itemsize: int, r: int = R) -> int:
    """What one TP rank's LoRA layers read of one adapter, by vLLM's slicing (column
    layers: A whole, B's rows / tp; row layers: A's columns / tp, B whole), not by
    xreshard's probes."""
    total = 0
    for module, (o, i) in module_shapes().items():
        if module.endswith(("o_proj", "down_proj")):
            total += r * (i // tp) + o * r
        else:
            total += r * i + (o // tp) * r
    return total * itemsize


def write_model_dir(path: str, seed: int = 0) -> None:
    """config.json + a random fp32 Llama checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    rng = np.random.default_rng(seed)
    save_file({k: torch.from_numpy((0.2 * rng.standard_normal(tuple(v.shape))).astype(np.float32)
                                   + (1.0 if k.endswith("norm.weight") else 0.0))
               for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))


# ---------------------------------------------------------------------------- the engine

def engine(ctx: Any, tmp: str) -> dict:
    """A TP=2 fp32 Llama with two LoRA slots (and two CPU-cached adapters, so directory
    references evict in-memory adapters, which are then rebuilt); answers checks."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest
    from xreshard.adapters.vllm import lora_request

    control = cases._store(ctx.address, ENGINE_START)
    model_dir = os.path.join(tmp, "model")
    write_model_dir(model_dir)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2,
              dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
              max_logprobs=-1, enable_prefix_caching=False, enable_lora=True, max_loras=2,
              max_cpu_loras=2, max_lora_rank=MAX_RANK,
              worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
              weight_transfer_config={"backend": "xreshard"})
    dir_ids: dict[str, int] = {}

    def sample(request: Any) -> dict:
        return _sample(llm, request)

    def check(slots: list) -> dict:
        """``slots``: [name, lora_id, reference directory]. Each slot's in-memory adapter
        against vLLM's directory load of the same adapter, then the in-memory one again
        after vLLM dropped it (rebuilt from the committed bytes: scaled once more would
        differ)."""
        out = {"base": sample(None)["tokens"], "slots": []}
        for name, lora_id, path in slots:
            got = sample(lora_request(name, lora_id))
            ref_id = dir_ids.setdefault(path, 100 + len(dir_ids))
            ref = sample(LoRARequest(f"dir-{ref_id}", ref_id, path))
            llm.llm_engine.remove_lora(lora_id)         # vLLM drops it: rebuilt from memory
            again = sample(lora_request(name, lora_id))
            out["slots"].append({"name": name, "tokens": got["tokens"],
                                 "ref_tokens": ref["tokens"], "again_tokens": again["tokens"],
                                 "bit_equal": got["logprobs"] == ref["logprobs"],
                                 "again_bit_equal": again["logprobs"] == ref["logprobs"],
                                 "num_logprobs": sum(len(x) for x in got["logprobs"]) // 16})
        out["reports"] = llm.collective_rpc("xreshard_lora_report")
        return out

    try:
        cases.serve_requests(ctx, llm, control, {"check": check, "stop": lambda: None})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"dir_adapters": len(dir_ids)}


def _sample(llm: Any, request: Any) -> dict:
    """Greedy tokens and the full-vocab logprobs of every generated position (as hex
    bytes: bit-exact JSON). Not prompt logprobs: vLLM 0.32's CPU LoRA logits path fails on
    them (its punica wrapper sizes the LM-head LoRA by sampled tokens)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=cases.MAX_TOKENS, temperature=0.0, detokenize=False,
                        logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": [t % CONFIG["vocab_size"] for t in p]}
                         for p in cases.PROMPTS], sp, lora_request=request, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [np.array([[pos[t].logprob for t in sorted(pos)]
                                   for pos in o.outputs[0].logprobs]).tobytes().hex()
                         for o in outs]}


# ---------------------------------------------------------------------------- the trainers

#: (round, adapters the JAX trainer sends, adapters the torch trainer sends, slots checked);
#: an adapter is (name, lora_id, seed); slot "jax" gets A, B, A, then B again together with
#: the torch trainer's second adapter, in one call
SCRIPT = [("A", [("jax", 1, 1)], [], ["jax"]),
          ("B", [("jax", 1, 2)], [], ["jax"]),
          ("A again", [("jax", 1, 1)], [], ["jax"]),
          ("torch T", [], [("torch", 2, 3)], ["jax", "torch"]),
          ("B and T2", [("jax", 1, 2)], [("torch", 2, 4)], ["jax", "torch"])]
#: bad rounds, all from the JAX trainer into slot "jax": refused before anything moves
BAD = ["unknown module", "rank above max_lora_rank", "wrong shape"]


def _jax_adapter(name: str, lora_id: int, seed: int, mesh: Any) -> Any:
    """Flax-style kernels A [in, r] (in split over fsdp), B [r, out] (out split over tp)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters.lora import LoRAAdapter

    put = lambda x, spec: jax.device_put(np.ascontiguousarray(x.T),  # noqa: E731
                                         NamedSharding(mesh, spec))
    return LoRAAdapter(name, lora_id, R, ALPHA, kernel_layout=True, weights={
        m: (put(a, P("fsdp", None)), put(b, P(None, "tp"))) for m, (a, b) in factors(seed).items()})


def _torch_adapter(name: str, lora_id: int, seed: int) -> Any:
    """Plain bf16 CPU tensors in PEFT orientation (A [r, in], B [out, r])."""
    import torch
    from xreshard.adapters.lora import LoRAAdapter

    return LoRAAdapter(name, lora_id, R, ALPHA, weights={
        m: (torch.from_numpy(a).to(torch.bfloat16), torch.from_numpy(b).to(torch.bfloat16))
        for m, (a, b) in factors(seed).items()})


def _bad_adapter(case: str, mesh: Any) -> Any:
    from xreshard.adapters.lora import LoRAAdapter

    ok = _jax_adapter("jax", 1, 5, mesh)
    if case == "unknown module":
        a, b = next(iter(ok.weights.values()))
        return LoRAAdapter("jax", 1, R, ALPHA, kernel_layout=True,
                           weights={**ok.weights, "model.layers.0.mlp.fc9": (a, b)})
    if case == "rank above max_lora_rank":
        big = {m: (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T))
               for m, (a, b) in factors(5, r=2 * MAX_RANK).items()}
        return LoRAAdapter("jax", 1, 2 * MAX_RANK, ALPHA, kernel_layout=True, weights=big)
    rng = np.random.default_rng(6)           # q_proj with in=96: not the base weight's 128
    weights = dict(ok.weights)
    weights["model.layers.0.self_attn.q_proj"] = (
        rng.standard_normal((96, R)).astype(np.float32),
        rng.standard_normal((R, 128)).astype(np.float32))
    return LoRAAdapter("jax", 1, R, ALPHA, kernel_layout=True, weights=weights)


def _trainer_engine(ctx: Any, rank: int, client: Any, devices: Any) -> Any:
    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)
    info = XreshardTrainerInitInfo(rank=rank, engine_world_size=2, num_trainer_processes=2,
                                   address=ctx.address, world_id=WORLD_ID, timeout=TIMEOUT,
                                   devices=devices)
    return XreshardTrainerWeightTransferEngine.trainer_init(info, client=client)


def _round(engine: Any, adapters: list) -> dict:
    """Send, counting what this process's transports post per rollout rank."""
    ranks = engine.world.group_ranks("rollout")
    with count_comm() as counts:
        try:
            report = engine.send_loras(adapters)
            error, version = None, report.version
        except Exception as e:  # noqa: BLE001 - the test compares the messages
            error, version = f"{type(e).__name__}: {e}", None
    return {"error": error, "version": version, "sent_to": [counts.sent_to(r) for r in ranks],
            "messages_to": [sum(n for (_, d), n in counts.messages_sent.items() if d == r)
                            for r in ranks], "total_sent": counts.total_sent}


def _slots(names: list, held: dict, tmp: str) -> list:
    return [[n, held[n][0], os.path.join(tmp, f"peft-{n}-{held[n][1]}")] for n in names]


def jax_trainer(ctx: Any, tmp: str) -> dict:
    """Rank 0: JAX adapters into slot "jax"; drives the engine and its checks."""
    import jax
    from xreshard.adapters.lora import write_peft_dir

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    for _, mine, _, _ in SCRIPT:
        for name, lora_id, seed in mine:
            write_peft_dir(_jax_adapter(name, lora_id, seed, mesh),
                           os.path.join(tmp, f"peft-{name}-{seed}"))
    # a TP=2 engine with LoRA takes minutes to start on a loaded 2-core machine
    cases._wait(cases._store(ctx.address, ENGINE_START), "engine0/ready", ENGINE_START)
    client = cases.StoreClient(ctx.address)
    engine = _trainer_engine(ctx, 0, client, jax.local_devices())
    rollout_ranks = list(engine.world.group_ranks("rollout"))
    rounds, held = [], {}
    try:
        for label, mine, theirs, slots in SCRIPT:
            out = _round(engine, [_jax_adapter(n, i, s, mesh) for n, i, s in mine])
            held.update({n: (i, s) for n, i, s in mine + theirs})
            rounds.append({"label": label, **out,
                           **client.call("check", slots=_slots(slots, held, tmp))})
        bad = [{"case": case, **_round(engine, [_bad_adapter(case, mesh)])} for case in BAD]
        after_bad = client.call("check", slots=_slots(["jax", "torch"], held, tmp))
    finally:
        client.call("stop")
        engine.shutdown()
    return {"rounds": rounds, "bad": bad, "after_bad": after_bad,
            "rollout_ranks": rollout_ranks}


def torch_trainer(ctx: Any, tmp: str) -> dict:
    """Rank 1: plain torch adapters into slot "torch"; follows the same script."""
    from xreshard.adapters.lora import write_peft_dir

    for _, _, theirs, _ in SCRIPT:
        for name, lora_id, seed in theirs:
            write_peft_dir(_torch_adapter(name, lora_id, seed),
                           os.path.join(tmp, f"peft-{name}-{seed}"))
    cases._wait(cases._store(ctx.address, ENGINE_START), "engine0/ready", ENGINE_START)
    engine = _trainer_engine(ctx, 1, None, 1)
    rounds = []
    try:
        for label, _, theirs, _ in SCRIPT:
            rounds.append({"label": label, **_round(engine, [_torch_adapter(n, i, s)
                                                             for n, i, s in theirs])})
        bad = [{"case": case, **_round(engine, [])} for case in BAD]
    finally:
        engine.shutdown()
    return {"rounds": rounds, "bad": bad}
