"""Processes of the real-engine tests (module level, so launched children import them).

Two children per case: a trainer (JAX on 4 CPU devices, mesh fsdp=2 x tp=2, or torch with
a plain HF state dict) that serves the refit world and drives the engine through the
``"xreshard"`` trainer engine, and an engine process holding a ``vllm.LLM`` with
``weight_transfer_config={"backend": "xreshard"}``. :func:`http_trainer` drives a
``vllm serve`` process through vLLM's own HTTP client instead.
The trainer reaches the engine's control plane through :class:`StoreClient`, a
``VLLMWeightSyncClient`` over the launch's store, the way a real trainer reaches a vLLM
server over HTTP; the engine process answers in :func:`engine`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from typing import Any

import numpy as np

from xreshard.runtime.commcount import count_comm

#: a tiny Qwen2: padded vocab (1000 -> 1024 rows), GQA (4 q heads, 2 kv heads), q/k/v bias,
#: tied embeddings
CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
#: a larger Qwen2 (53 MB in fp32, its largest module 2.4 MB) refit through a streaming
#: budget of a third of that: the worker receives and reloads it in groups of layers
STREAM_CONFIG = dict(CONFIG, hidden_size=384, intermediate_size=768, num_hidden_layers=10,
                     num_attention_heads=6, num_key_value_heads=2)
STREAM_BUDGET = 16 << 20
#: a Qwen2 whose linears are whole 128 x 128 blocks in every shard (trainer mesh 2 x 2, engine
#: TP 1 or 2), served from a DeepSeek-style block-FP8 checkpoint (:func:`fp8_checkpoint`)
FP8_CONFIG = dict(CONFIG, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                  num_key_value_heads=2)
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7] * 12, [999, 0, 512, 513, 17]]
MAX_TOKENS = 10
ENGINE_START_TIMEOUT = 240.0
RPC_TIMEOUT = 240.0
REFIT_TIMEOUT = 120.0


def requires_vllm() -> None:
    """At a module's top: skip it where vLLM is not installed (fail it with
    XRESHARD_REQUIRE_VLLM set), without importing vLLM: importing it takes ~10 s of every
    collection, fast tier included; the tests import it when they run."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("XRESHARD_REQUIRE_VLLM"):
        from xreshard.adapters.vllm.record import INSTALL_HINT
        raise ImportError(f"XRESHARD_REQUIRE_VLLM is set but vLLM is not installed; install "
                          f"it ({INSTALL_HINT})")
    pytest.skip("needs vllm", allow_module_level=True)


class LazyModule:
    """A module imported at its first attribute, for module-level names of test files
    (``transformers = LazyModule("transformers")``): collection stays fast."""

    def __init__(self, name: str):
        import importlib.util

        import pytest

        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {name}", allow_module_level=True)
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        import importlib
        if attr.startswith("_") or attr == "pytestmark":     # pytest inspecting the module
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def importorskip_vllm() -> Any:
    """``pytest.importorskip("vllm")``, except that with XRESHARD_REQUIRE_VLLM set (CI) a
    missing vLLM fails the module instead of skipping it silently."""
    import pytest

    if not os.environ.get("XRESHARD_REQUIRE_VLLM"):
        return pytest.importorskip("vllm")
    from xreshard.adapters.vllm.record import INSTALL_HINT
    try:
        import vllm
    except ImportError as e:
        raise ImportError("XRESHARD_REQUIRE_VLLM is set but vLLM is not importable; install "
                          f"it ({INSTALL_HINT})") from e
    return vllm


# ---------------------------------------------------------------------------- the JAX tree

def rules() -> Any:
    from xreshard.adapters.naming import jax_llama_rules
    return jax_llama_rules(tied=True, qkv_bias=True)


def tree_shapes(c: dict = CONFIG) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Trainer name -> (shape, PartitionSpec entries on mesh ("fsdp", "tp"))."""
    V, D, I = c["vocab_size"], c["hidden_size"], c["intermediate_size"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    hd = D // H
    out = {"embed/embedding": ((V, D), ("tp", "fsdp")), "final_norm/scale": ((D,), ())}
    for layer in range(c["num_hidden_layers"]):
        p = f"layers/{layer}/"
        for w, heads in (("q", H), ("k", KV), ("v", KV)):
            out[p + f"attn/{w}/kernel"] = ((D, heads, hd), ("fsdp", "tp", None))
            out[p + f"attn/{w}/bias"] = ((heads, hd), ("tp", None))
        out[p + "attn/o/kernel"] = ((H, hd, D), ("tp", None, "fsdp"))
        out[p + "mlp/gate/kernel"] = ((D, I), ("fsdp", "tp"))
        out[p + "mlp/up/kernel"] = ((D, I), ("fsdp", "tp"))
        out[p + "mlp/down/kernel"] = ((I, D), ("tp", "fsdp"))
        out[p + "input_norm/scale"] = ((D,), ())
        out[p + "post_attn_norm/scale"] = ((D,), ())
    return out


def init_params(seed: int, shapes: dict | None = None) -> dict[str, np.ndarray]:
    """Flat trainer name -> fp32 array; weights N(0, 0.2), norm scales N(1, 0.2).
    ``shapes``: :func:`tree_shapes` (default) or :func:`moe_tree_shapes`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in (shapes or tree_shapes()).items():
        mean = 1.0 if name.endswith("/scale") else 0.0
        out[name] = (mean + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parts, last = name.split("/")
        for part in parts:
            node = node.setdefault(part, {})
        node[last] = value
    tree["layers"] = [tree["layers"][str(i)] for i in range(len(tree["layers"]))]
    return tree


def shard(flat: dict[str, np.ndarray], mesh: Any, shapes: dict | None = None) -> dict:
    """The pytree of jax.Arrays on ``mesh`` (axes "fsdp", "tp")."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    specs = shapes or tree_shapes()
    return unflatten({n: jax.device_put(a, NamedSharding(mesh, P(*specs[n][1])))
                      for n, a in flat.items()})


def hf_tensors(flat: dict[str, np.ndarray], table: Any = None) -> dict[str, np.ndarray]:
    """HF name -> array, through the same naming rules (what a checkpoint would hold)."""
    from xreshard.adapters.naming import NameMap

    hf = NameMap(table or rules()).apply({n: a.shape for n, a in flat.items()})
    return {name: np.ascontiguousarray(t.view(flat)) for name, t in hf.items()}


def save_checkpoint(flat: dict[str, np.ndarray], path: str, table: Any = None) -> int:
    """fp32 safetensors of the HF tensors; returns their bytes."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = hf_tensors(flat, table)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def write_model_dir(path: str, seed: int = 0, c: dict = CONFIG) -> None:
    """config.json + a random fp32 checkpoint the engine starts from."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**c)
    cfg.architectures = ["Qwen2ForCausalLM"]
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    save_checkpoint(init_params(seed, tree_shapes(c)), path)


def xreshard_llm(model_dir: str) -> Any:
    """An in-process TP=1 fp32 engine of the tiny model at ``model_dir`` (its worker runs in
    this process: vLLM without multiprocessing) with xreshard as its weight transfer
    backend: what the fleet, catch-up and loss tests refit."""
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=64, max_num_seqs=4, seed=0, max_logprobs=-1,
               enable_prefix_caching=False,
               worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
               weight_transfer_config={"backend": "xreshard"})


def fp8_kernels_missing() -> str | None:
    """Why vLLM cannot run block-FP8 layers on this machine (None: it can). vLLM's CPU
    backend needs AMX (``CPUFp8BlockScaledMMKernel`` checks
    ``torch.cpu._is_amx_tile_supported()``); a GPU has them."""
    import torch
    if torch.cuda.is_available():
        return None
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None
    return "vLLM's CPU FP8 kernels need AMX (Sapphire Rapids or newer); this CPU has none"


def fp8_checkpoint(src: str, dst: str, config: dict | None = None) -> None:
    """vLLM's own block-FP8 checkpoint of the bf16 values of ``src``'s fp32 checkpoint:
    every decoder linear quantized by vLLM's ``per_block_cast_to_fp8`` (128 x 128,
    ``use_ue8m0=False``), its scales as ``weight_scale_inv``; with ``config``, a
    config.json declaring the quantization too (a model directory)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        t = t.to(torch.bfloat16)
        if re.search(r"layers\.\d+\..*_proj\.weight$", name):
            out[name], out[name + "_scale_inv"] = per_block_cast_to_fp8(
                t, [128, 128], use_ue8m0=False)
        else:
            out[name] = t
    os.makedirs(dst, exist_ok=True)
    save_file({n: t.contiguous() for n, t in out.items()},
              os.path.join(dst, "model.safetensors"))
    if config is not None:
        cfg = Qwen2Config(**config)
        cfg.architectures = ["Qwen2ForCausalLM"]
        cfg.quantization_config = dict(FP8_QUANT)
        cfg.to_json_file(os.path.join(dst, "config.json"))


# ---------------------------------------------------------------------------- control plane

def _store(address: str, timeout: float) -> Any:
    import torch.distributed as dist
    from xreshard.runtime.world import parse_address

    host, port = parse_address(address)
    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _wait(store: Any, key: str, timeout: float) -> bytes:
    store.wait([key], datetime.timedelta(seconds=timeout))
    return store.get(key)


class StoreClient:
    """``VLLMWeightSyncClient`` over a TCPStore: each call is a numbered request the engine
    process (:func:`serve_requests`) answers. ``check``/``stop`` drive the test."""

    def __init__(self, address: str, engine: int = 0, timeout: float = RPC_TIMEOUT,
                 start_timeout: float = ENGINE_START_TIMEOUT, run: str = "") -> None:
        self.store, self.timeout, self.n = _store(address, timeout), timeout, 0
        self.prefix = f"{run}engine{engine}/"
        _wait(self.store, self.prefix + "ready", start_timeout)

    def call(self, method: str, **kwargs: Any) -> Any:
        n, self.n = self.n, self.n + 1
        key = f"{self.prefix}rpc/{n}"
        self.store.set(key, json.dumps({"method": method, "kwargs": kwargs}))
        out = json.loads(_wait(self.store, key + "/out", self.timeout))
        if "error" in out:
            raise RuntimeError(f"engine {method} failed: {out['error']}")
        return out["value"]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self.call("start_draft_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version=weight_version)


def serve_requests(ctx: Any, llm: Any, store: Any, handlers: dict, run: str = "") -> None:
    """Say the engine is ready, then answer its trainer's calls until "stop" (``run``: the
    keys' prefix of one case of :func:`series`)."""
    from xreshard.adapters.vllm import LLMClient

    prefix = f"{run}engine{ctx.role.index}/"
    store.set(prefix + "ready", "1")
    client = LLMClient(llm)
    n = 0
    while True:
        key = f"{prefix}rpc/{n}"
        req = json.loads(_wait(store, key, RPC_TIMEOUT))
        method = req["method"]
        fn = handlers.get(method) or getattr(client, method)
        try:
            out = {"value": fn(**req["kwargs"])}
        except Exception as e:  # noqa: BLE001 - the trainer raises it
            out = {"error": f"{type(e).__name__}: {e}"}
        store.set(key + "/out", json.dumps(out))
        n += 1
        if method == "stop":
            return


# ---------------------------------------------------------------------------- the two processes

def sample(llm: Any) -> dict:
    """Greedy tokens and the full-vocab prompt logprobs of every prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False,
                        prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [np.array([[pos[t].logprob for t in sorted(pos)] for pos in o.prompt_logprobs[1:]])
                for o in outs]
    return {"tokens": tokens, "logprobs": logprobs}


def config_of(kind: str) -> dict:
    """The model config a case ``kind`` trains and serves."""
    return {"jax-stream": STREAM_CONFIG, "jax-fp8": FP8_CONFIG}.get(kind, CONFIG)


def check_against_reload(llm: Any, weights_path: str) -> dict:
    """What the engine answers now, then vLLM's own load of ``weights_path`` (which it
    keeps): tokens of both, bit-equality of the full-vocab prompt logprobs, the worker's
    transfer report and the engine's weight version."""
    got = sample(llm)
    (report,) = llm.collective_rpc("xreshard_transfer_report")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
    llm.collective_rpc("xreshard_reprocess_tied")
    ref = sample(llm)
    return {"tokens": got["tokens"], "ref_tokens": ref["tokens"], "report": report,
            "logprobs_bit_equal": all(a.shape == b.shape and a.tobytes() == b.tobytes()
                                      for a, b in zip(got["logprobs"], ref["logprobs"])),
            "weight_version": llm.get_weight_version()}


def engine(ctx: Any, tp: int, dtype: str, tmp: str, kind: str = "jax", run: str = "") -> dict:
    """Build the engine, then answer the trainer's requests until it says stop."""
    from vllm import LLM

    control = _store(ctx.address, ENGINE_START_TIMEOUT)
    model_dir = os.path.join(tmp, f"engine{ctx.role.index}")
    write_model_dir(model_dir, c=config_of(kind))
    if kind == "jax-fp8":       # served from vLLM's own block-FP8 quantization of those weights
        fp8_checkpoint(model_dir, model_dir, FP8_CONFIG)
    t0 = time.monotonic()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=tp, dtype=dtype,
              enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0, max_logprobs=-1,
              enable_prefix_caching=False,
              worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
              weight_transfer_config={"backend": "xreshard"})
    start_seconds = time.monotonic() - t0
    rounds = []

    def check(weights_path: str) -> dict:
        got = sample(llm)
        if kind == "jax-fp8":   # the reference: vLLM loading its own quantization of them
            fp8_checkpoint(weights_path, weights_path + "-fp8")
            weights_path += "-fp8"
        reports = llm.collective_rpc("xreshard_transfer_report")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        llm.collective_rpc("xreshard_reprocess_tied")   # vLLM's reload leaves a stale tied head on CPU
        ref = sample(llm)
        diffs = [np.abs(a - b).max() if a.shape == b.shape else np.inf
                 for a, b in zip(got["logprobs"], ref["logprobs"])]
        out = {"tokens": got["tokens"], "ref_tokens": ref["tokens"], "reports": reports,
               "logprobs_bit_equal": all(a.shape == b.shape and a.tobytes() == b.tobytes()
                                         for a, b in zip(got["logprobs"], ref["logprobs"])),
               "logprobs_max_abs_diff": float(max(diffs)),
               "num_logprobs": int(sum(a.size for a in got["logprobs"])),
               "weight_version": llm.get_weight_version()}
        rounds.append(out)
        return out

    try:
        serve_requests(ctx, llm, control, {"check": check, "stop": lambda: None}, run)
    finally:    # launched children end with os._exit: stop the engine core and its workers
        llm.llm_engine.engine_core.shutdown()
    return {"start_seconds": start_seconds, "rounds": len(rounds)}


def trainer(ctx: Any, tp: int, dtype: str, tmp: str, kind: str = "jax",
            run: str = "") -> dict:
    """Serve the world, hand it to the engine, refit A -> B -> A, check each round.

    ``kind`` "jax": a pytree sharded over 4 CPU devices, named by the JAX Llama rules;
    "jax-stream": the same for :data:`STREAM_CONFIG`'s larger model, streamed to the
    workers within :data:`STREAM_BUDGET` (their peak RSS growth is reported);
    "torch": a plain HF-named state dict of CPU tensors in one process (one world rank).
    """
    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    shapes = tree_shapes(config_of(kind))
    weights = {name: init_params(seed, shapes) for name, seed in (("A", 1), ("B", 2))}
    full_bytes = {name: save_checkpoint(w, os.path.join(tmp, name)) for name, w in weights.items()}
    if kind.startswith("jax"):
        import jax

        mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
        naming = {"rules": rules()}
        if kind == "jax-stream":
            naming.update(stream_bytes=STREAM_BUDGET, measure_memory=True)

        def make(flat: dict) -> Any:
            return shard(flat, mesh, shapes)
    else:
        import torch

        naming = {"devices": 1}

        def make(flat: dict) -> Any:
            return {n: torch.from_numpy(a) for n, a in hf_tensors(flat).items()}
    client = StoreClient(ctx.address, run=run)
    info = XreshardTrainerInitInfo(rank=0, engine_world_size=tp, timeout=REFIT_TIMEOUT,
                                   wire_dtype=None if dtype == "float32" else dtype, **naming)
    t0 = time.monotonic()
    engine = XreshardTrainerWeightTransferEngine.trainer_init(info, client=client)
    init_seconds = time.monotonic() - t0
    rounds = []
    try:
        for name in ("A", "B", "A"):
            params = make(weights[name])
            t0 = time.monotonic()
            with count_comm() as counts:
                report = engine.send_weights(params)
            seconds = time.monotonic() - t0
            out = client.call("check", weights_path=os.path.join(tmp, name))
            sent_to = {d: counts.sent_to(d) for d in sorted({d for _, d in counts.bytes_sent})}
            rounds.append({"name": name, "bytes_sent": report.bytes_sent,
                           "counted_sent_to": list(sent_to.values()),
                           "bytes_moved_world": report.bytes_moved_world,
                           "version": report.version, "replanned": report.replanned,
                           "send_seconds": seconds, **out})
        # bad rounds are refused on every process before anything moves; the engine keeps A
        # (a q kernel split on its head dim, once refused here as no HF box, now binds as
        # boxes: tests/test_naming_sharded.py; what stays refused: test_named_binding_*)
        bad = [make({n: a for n, a in weights["B"].items() if n != "final_norm/scale"})]
        errors = []
        for params in bad:
            try:
                engine.send_weights(params)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - the test checks the message
                errors.append(f"{type(e).__name__}: {e}")
        refused = {"name": "A", "errors": errors, "version": engine.sender.version,
                   **client.call("check", weights_path=os.path.join(tmp, "A"))}
    finally:
        client.call("stop")
        engine.shutdown()
    return {"rounds": rounds, "refused": refused, "full_bytes_fp32": full_bytes["A"],
            "init_seconds": init_seconds}


# ---------------------------------------------------------------------------- the HTTP server

def _post(url: str, path: str, body: dict, timeout: float = RPC_TIMEOUT) -> dict:
    import requests

    r = requests.post(f"{url}/{path}", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json() if r.content else {}


def complete(url: str, model: str) -> list[list[int]]:
    """Greedy completions of PROMPTS through the OpenAI-compatible route (token ids in/out)."""
    out = []
    for p in PROMPTS:
        got = _post(url, "v1/completions", {"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "return_token_ids": True})
        out.append(got["choices"][0]["token_ids"])
    return out


def http_trainer(ctx: Any, url: str, model: str, tmp: str) -> dict:
    """Refit a running ``vllm serve`` through vLLM's HTTP weight-sync client; compare with the
    server's own reload of the same checkpoint (dev-mode ``/collective_rpc``)."""
    import jax
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    flat = init_params(1)
    save_checkpoint(flat, os.path.join(tmp, "A"))
    before = complete(url, model)
    info = XreshardTrainerInitInfo(rank=0, engine_world_size=1, timeout=REFIT_TIMEOUT,
                                   rules=rules())
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url, timeout=RPC_TIMEOUT))
    try:
        report = engine.send_weights(shard(flat, mesh))
    finally:
        engine.shutdown()
    after = complete(url, model)
    version = json.loads(__import__("requests").get(f"{url}/weight_info", timeout=30).text)
    workers = _post(url, "collective_rpc", {"method": "xreshard_transfer_report"})["results"]
    _post(url, "collective_rpc", {"method": "reload_weights",
                                  "kwargs": {"weights_path": os.path.join(tmp, "A")}})
    _post(url, "collective_rpc", {"method": "xreshard_reprocess_tied"})
    return {"before": before, "after": after, "reference": complete(url, model),
            "bytes_sent": report.bytes_sent, "workers": workers,
            "weight_version": version.get("weight_version")}


# ---------------------------------------------------------------------------- MoE, expert parallel

#: a tiny Mixtral: 4 experts, top 2; per-expert checkpoint names (w1 gate, w3 up, w2 down)
MOE_CONFIG = dict(vocab_size=1024, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)


def moe_rules() -> Any:
    from xreshard.adapters.naming import jax_llama_rules, jax_moe_rules
    return jax_llama_rules() + jax_moe_rules(hf="mixtral")


def moe_tree_shapes(c: dict = MOE_CONFIG) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """The JAX Mixtral tree: Llama attention, stacked experts ``[E, D, I]`` / ``[E, I, D]``
    sharded over "fsdp" (two experts per device pair) and their I over "tp"."""
    V, D, I, E = c["vocab_size"], c["hidden_size"], c["intermediate_size"], \
        c["num_local_experts"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    hd = D // H
    out = {"embed/embedding": ((V, D), ("tp", "fsdp")), "final_norm/scale": ((D,), ()),
           "lm_head/kernel": ((D, V), ("fsdp", "tp"))}
    for layer in range(c["num_hidden_layers"]):
        p = f"layers/{layer}/"
        for w, heads in (("q", H), ("k", KV), ("v", KV)):
            out[p + f"attn/{w}/kernel"] = ((D, heads, hd), ("fsdp", "tp", None))
        out[p + "attn/o/kernel"] = ((H, hd, D), ("tp", None, "fsdp"))
        out[p + "moe/router/kernel"] = ((D, E), ("fsdp", None))
        out[p + "moe/gate/kernel"] = ((E, D, I), ("fsdp", None, "tp"))
        out[p + "moe/up/kernel"] = ((E, D, I), ("fsdp", None, "tp"))
        out[p + "moe/down/kernel"] = ((E, I, D), ("fsdp", "tp", None))
        out[p + "input_norm/scale"] = ((D,), ())
        out[p + "post_attn_norm/scale"] = ((D,), ())
    return out


def write_moe_dir(path: str, seed: int) -> None:
    from transformers import MixtralConfig

    cfg = MixtralConfig(**MOE_CONFIG)
    cfg.architectures = ["MixtralForCausalLM"]
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    save_checkpoint(init_params(seed, moe_tree_shapes()), path, moe_rules())


def digest_engine(ctx: Any, case: str, tmp: str, run: str = "") -> dict:
    """An engine vLLM's CPU kernels cannot run forward in: a TP=2 Mixtral with expert
    parallelism ("moe-ep": the CPU fused-MoE kernel crashes) or a Qwen2 over two pipeline
    stages ("pp": the CPU runner fails its first step). It loads, reloads and records all
    the same, so it is compared by the digest of its processed weights, not by tokens."""
    from vllm import LLM

    control = _store(ctx.address, ENGINE_START_TIMEOUT)
    model_dir = os.path.join(tmp, "engine")
    if case == "moe-ep":
        write_moe_dir(model_dir, 0)
        parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    else:
        write_model_dir(model_dir)
        parallel = {"pipeline_parallel_size": 2}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=64, max_num_seqs=4, seed=0, **parallel,
              worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
              weight_transfer_config={"backend": "xreshard"})

    def check(weights_path: str) -> dict:
        got = llm.collective_rpc("xreshard_weights_digest")
        reports = llm.collective_rpc("xreshard_transfer_report")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        llm.collective_rpc("xreshard_reprocess_tied")
        return {"digests": got, "ref_digests": llm.collective_rpc("xreshard_weights_digest"),
                "reports": reports}

    try:
        serve_requests(ctx, llm, control, {"check": check, "stop": lambda: None}, run)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {}


def digest_trainer(ctx: Any, case: str, tmp: str, run: str = "") -> dict:
    """Refit the engine B -> A from the JAX trainer (fp32 on 4 CPU devices, bf16 on the
    wire): the dense tree for "pp", the Mixtral tree with stacked experts for "moe-ep"."""
    import jax

    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    moe = case == "moe-ep"
    shapes, table = (moe_tree_shapes(), moe_rules()) if moe else (tree_shapes(), rules())
    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    naming = {"rules": table, "wire_dtype": "bfloat16"}

    def make(seed: int) -> Any:
        return shard(init_params(seed, shapes), mesh, shapes)
    for name, seed in (("A", 0), ("B", 1)):
        save_checkpoint(init_params(seed, shapes), os.path.join(tmp, name), table)
    client = StoreClient(ctx.address, run=run)
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=0, engine_world_size=2, timeout=REFIT_TIMEOUT, **naming),
        client=client)
    rounds = []
    try:
        for name, seed in (("B", 1), ("A", 0)):
            report = engine.send_weights(make(seed))
            rounds.append({"name": name, "bytes_sent": report.bytes_sent,
                           **client.call("check", weights_path=os.path.join(tmp, name))})
    finally:
        client.call("stop")
        engine.shutdown()
    return {"rounds": rounds}


# ---------------------------------------------------------------------------- cases in series

#: a case kind of :func:`series` -> its (trainer, engine) functions
SERIES = {"checkpoint": (trainer, engine), "digest": (digest_trainer, digest_engine)}


def series(ctx: Any, runs: list, tmp: str) -> dict:
    """Engine cases of the same two roles one after another in one launch (the trainer's
    JAX and the engine process's vLLM imported once, not once per case): each ``(key,
    kind, args)`` of ``runs`` is ``SERIES[kind]``'s function of this role with ``args``,
    in a folder of its own, on control keys of its own; each trainer serves its own store
    and world, each engine builds its own ``LLM`` and shuts it down before the next. A case
    that raises is recorded (key -> ``{"error": traceback}``) and the next one runs, so a
    failure fails its own test only. Returns key -> ``{"value": ...}`` or the error."""
    import traceback

    side = 0 if ctx.role.group == "trainer" else 1
    out: dict[str, Any] = {}
    for key, kind, args in runs:
        folder = os.path.join(tmp, key)
        os.makedirs(folder, exist_ok=True)
        try:
            out[key] = {"value": SERIES[kind][side](ctx, *args, folder, run=f"{key}/")}
        except Exception:  # noqa: BLE001 - the test shows it
            out[key] = {"error": traceback.format_exc()}
    return out


# ---------------------------------------------------------------------------- several engines

def engines_trainer(ctx: Any, num_engines: int, tmp: str) -> dict:
    """One JAX trainer refits ``num_engines`` identical TP=1 fp32 engines at once, A -> B."""
    import jax

    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    weights = {name: init_params(seed) for name, seed in (("A", 1), ("B", 2))}
    for name, w in weights.items():
        save_checkpoint(w, os.path.join(tmp, name))
    clients = [StoreClient(ctx.address, engine=e) for e in range(num_engines)]
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=0, engine_world_size=1, num_engines=num_engines,
                                timeout=REFIT_TIMEOUT, rules=rules()), client=clients)
    rounds = []
    try:
        for name in ("A", "B"):
            report = engine.send_weights(shard(weights[name], mesh))
            rounds.append({"name": name, "bytes_sent": report.bytes_sent,
                           "bytes_moved_world": report.bytes_moved_world,
                           "version": report.version,
                           "engines": [c.call("check", weights_path=os.path.join(tmp, name))
                                       for c in clients]})
    finally:
        for c in clients:
            c.call("stop")
        engine.shutdown()
    return {"rounds": rounds}


def engines_engine(ctx: Any, num_engines: int, tmp: str) -> dict:
    """One of :func:`engines_trainer`'s engines (TP=1, fp32)."""
    return engine(ctx, 1, "float32", tmp)


# ---------------------------------------------------------------------------- streaming, no engine

def stream_errors(ctx: Any) -> dict:
    """A trainer and one worker stream three one-tensor groups through ``Stream``, as the
    backend does, round after round: a good round; a round whose worker fails to bind its
    buffers (the GPU-only binding errors: DLPack, strides); a round whose worker fails to
    load group 1; a round where the trainer sends a tensor the worker lacks; a good round.
    Returns what each round did on this side: the error text, the version, the buffers."""
    import torch
    from xreshard.adapters.torch import tensor_view
    from xreshard.adapters.vllm import GROUPS, Stream
    from xreshard.ir.layout import Layout, Mesh
    from xreshard.runtime.refit import Bound, RefitConfig

    world = ctx.join(groups=GROUPS, timeout=60)
    side = "send" if ctx.role.group == "trainer" else "receive"
    stream = Stream(world, side, config=RefitConfig(timeout=60))
    names = ["t0", "t1", "t2"]
    rank = world.rank_ids[0]
    if side == "receive":
        stream.set_groups([[n] for n in names])
    lay = {n: Layout.replicated((4,), "float32", Mesh((1,), (rank,))) for n in names}
    out = []
    for k, case in enumerate(["good", "bind", "load", "extra", "good"]):
        errors: list[str] = []
        if side == "send":
            extra = ["t3"] if case == "extra" else []
            tensors = {n: torch.full((4,), float(10 * k + i)) for i, n in enumerate(names + extra)}
            layouts = {n: Layout.replicated((4,), "float32", Mesh((1,), (rank,)))
                       for n in tensors}

            def part(g, group, errs):
                return Bound({n: layouts[n] for n in group if n in layouts},
                             {(rank, n): tensor_view(tensors[n]) for n in group},
                             errors=errs)
            shapes = {n: (4,) for n in tensors}
            done = None
        else:
            buffers = {n: torch.zeros(4) for n in names}
            loaded = []

            def part(g, group, errs):
                if case == "bind" and g == 0:      # as XreshardWeightTransferEngine._bind_group
                    errs.append("worker 0 could not bind its receive buffers: RuntimeError: "
                                "forced")
                    return Bound({n: lay[n] for n in group}, {}, errors=errs)
                return Bound({n: lay[n] for n in group},
                             {(rank, n): tensor_view(buffers[n]) for n in group}, errors=errs)

            def done(g, group):
                if case == "load" and g == 1:
                    raise RuntimeError("forced load failure")
                loaded.extend(group)
            shapes = {n: (4,) for n in names}
        try:
            report = stream.run(shapes, errors, part, done)
            error, moved = None, report.bytes_received + report.bytes_sent
        except Exception as e:  # noqa: BLE001 - the test compares the messages
            error, moved = f"{type(e).__name__}: {e}", None
        row = {"case": case, "error": error, "version": stream.version, "moved": moved}
        if side == "receive":
            row["buffers"] = {n: b.tolist() for n, b in buffers.items()}
            row["loaded"] = loaded
        out.append(row)
    world.close()
    return {"rounds": out}
