"""Refits from a JAX trainer into a real vLLM engine (CPU), through the "xreshard" backend.

Each case runs in two processes (tests/vllm_cases.py; the four cases of a JAX trainer and
a TP=2-sized engine one after another in one launch of the two): a JAX trainer on 4 CPU devices
(mesh fsdp=2 x tp=2; or a torch trainer holding a plain HF state dict) that serves the
world and drives the engine, and an engine process with
``LLM(..., weight_transfer_config={"backend": "xreshard"})`` at TP=1 or TP=2. Three
rounds, A -> B -> A, then one refused round: after each the greedy tokens and the full-vocab prompt logprobs must
equal those of the same weights loaded by vLLM itself from a safetensors checkpoint
(``reload_weights(weights_path=...)``, plus re-processing the tied head, which vLLM's
reload leaves stale on CPU), and every vLLM rank must receive exactly its shard bytes.

Logits are compared through ``prompt_logprobs=-1`` (``max_logprobs=-1``): vLLM returns the
log-softmax of every vocab entry at every prompt position, computed in fp32 from the
logits, so bit-equal logprobs over the whole vocab mean bit-equal logits up to the
per-position normalizer. It needs no hook into the model runner.

vLLM missing: skipped, unless XRESHARD_REQUIRE_VLLM is set (CI), where that is a failure.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.adapters.naming import NameMap  # noqa: E402
from xreshard.tools.launch import Role, launch  # noqa: E402

#: the engine core in the engine role's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): at TP=1
#: ~3 s start; at TP=2 one process importing vLLM less (its workers are processes anyway)
ENGINE_ENV = {1: {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
              2: {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def _expected_shard_bytes(tp: int, rank: int, itemsize: int, c: dict = cases.CONFIG) -> int:
    """A TP rank's share, by vLLM's formulas (docs/layouts.md §7), not by the recorder."""
    V, D, I = c["vocab_size"], c["hidden_size"], c["intermediate_size"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    hd = D // H
    padded = -(-V // 64) * 64
    per = padded // tp
    vocab_rows = max(0, min(V, (rank + 1) * per) - rank * per)
    kv_rows = max(KV // tp, 1) * hd
    q_rows = H // tp * hd
    layer = (q_rows + 2 * kv_rows) * (D + 1)            # q/k/v weights and biases
    layer += D * q_rows                                 # o_proj columns
    layer += 3 * D * (I // tp)                          # gate, up rows; down columns
    layer += 2 * D                                      # the two norms, replicated
    return (vocab_rows * D + c["num_hidden_layers"] * layer + D) * itemsize


#: the cases of a JAX trainer (4 CPU devices) and one TP=2-sized engine process: run one after
#: another in one launch (:func:`tp2_runs`), key -> (kind of ``cases.SERIES``, args)
TP2_RUNS = {"2-float32-jax": ("checkpoint", (2, "float32")),
            "2-bfloat16-jax": ("checkpoint", (2, "bfloat16")),
            "moe-ep": ("digest", ("moe-ep",)), "pp": ("digest", ("pp",))}


def _tp2_key(item: pytest.Item) -> str | None:
    """The run of :data:`TP2_RUNS` a collected test of this module needs, if any."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("tp") == 2 and params.get("kind") == "jax":
        return f"2-{params['dtype']}-jax"
    return {"test_expert_parallel_engine_gets_each_expert_on_its_rank_only": "moe-ep",
            "test_pipeline_parallel_engine_gets_each_stage_its_layers_only": "pp"}.get(
        getattr(item, "originalname", item.name))


@pytest.fixture(scope="module")
def tp2_runs(request, tmp_path_factory) -> dict:
    """The selected runs of :data:`TP2_RUNS` in ONE launch of the same two processes (each
    its own world, store, model folder and ``LLM``; the engine process at TP=2 keeps its
    engine core, its workers are processes): the trainer's JAX and the engine process's
    vLLM start once, not once per case. key -> (trainer's value, engine's value); a case
    that raised raises its traceback in its own test."""
    keys = {_tp2_key(item) for item in request.session.items if item.module is request.module}
    runs = [(key, *TP2_RUNS[key]) for key in TP2_RUNS if key in keys]
    roles = [Role("jax", "trainer", 0, num_devices=4),
             Role("plain", "engine", 0, env={"VLLM_CPU_KVCACHE_SPACE": "1", **ENGINE_ENV[2]})]
    results = launch([cases.series, cases.series], roles,
                     args=(runs, str(tmp_path_factory.mktemp("tp2"))), timeout=300 * len(runs))
    return {key: tuple(r.value[key] for r in results) for key, _, _ in runs}


def _tp2_run(request, key: str) -> tuple[dict, dict]:
    """The trainer's and the engine's values of run ``key`` of the shared launch."""
    values = request.getfixturevalue("tp2_runs")[key]
    for v in values:
        assert "error" not in v, v["error"]
    return values[0]["value"], values[1]["value"]


#: every pair of (TP, dtype, trainer) values is in some case: (1, bf16, jax) was dropped as
#: a duplicate, its JAX sender's bf16 cast and refused rounds being (2, bf16, jax)'s and its
#: in-process TP=1 engine loading a bf16 wire being (1, bf16, torch)'s (one engine launch
#: less in CI)
@pytest.mark.slow
@pytest.mark.parametrize("tp,dtype,kind", [(1, "float32", "jax-stream"), (2, "float32", "jax"),
                                           (2, "bfloat16", "jax"), (1, "bfloat16", "torch")])
def test_trainer_refits_vllm_engine_like_a_checkpoint_load(tp, dtype, kind, tmp_path, request):
    if tp == 2 and kind == "jax":       # in the shared launch of the TP=2 cases
        trainer, engine = _tp2_run(request, f"{tp}-{dtype}-{kind}")
    else:
        trainer_role = Role("jax", "trainer", 0, num_devices=4) if kind.startswith("jax") \
            else Role("torch", "trainer", 0)
        roles = [trainer_role, Role("plain", "engine", 0,
                                    env={"VLLM_CPU_KVCACHE_SPACE": "1", **ENGINE_ENV[tp]})]
        results = launch([cases.trainer, cases.engine], roles,
                         args=(tp, dtype, str(tmp_path), kind), timeout=300)
        trainer, engine = results[0].value, results[1].value
    assert engine["rounds"] == 4
    rounds = trainer["rounds"]
    assert [r["name"] for r in rounds] == ["A", "B", "A"]
    assert [r["version"] for r in rounds] == [1, 2, 3]
    assert [r["replanned"] for r in rounds] == [True, False, False]
    itemsize = 4 if dtype == "float32" else 2
    config = cases.STREAM_CONFIG if kind == "jax-stream" else cases.CONFIG
    for r in rounds:
        assert r["tokens"] == r["ref_tokens"], r["name"]
        assert r["weight_version"] == str(r["version"])
        if dtype == "float32":
            assert r["logprobs_bit_equal"], (r["name"], r["logprobs_max_abs_diff"])
        else:   # bf16: the same bits reach the same kernels, so equal too (not required)
            assert r["logprobs_bit_equal"], (r["name"], r["logprobs_max_abs_diff"])
        assert r["num_logprobs"] == cases.CONFIG["vocab_size"] * sum(
            len(p) - 1 for p in cases.PROMPTS)
        reports = sorted(r["reports"], key=lambda x: x["tp_rank"])
        assert [x["version"] for x in reports] == [r["version"]] * tp
        for x in reports:
            want = _expected_shard_bytes(tp, x["tp_rank"], itemsize, config)
            assert x["bytes_received"] == x["shard_bytes"] == want, (x, want)
            if kind == "jax-stream":
                # streamed in groups of layers: the worker's extra memory during the refit
                # stays within the budget (+10%), though its shard is over 3x the budget
                budget = cases.STREAM_BUDGET
                assert x["budget_bytes"] == budget and x["shard_bytes"] > 3 * budget
                assert x["num_groups"] > 3
                assert x["peak_rss_growth"] <= 1.1 * budget, (x, budget)
                if r["version"] == 1:   # buffers, staging, plans: the measurement sees them
                    assert x["peak_rss_growth"] > budget // 8, x
        # the trainer sent each vLLM rank its shards and nothing else (on the wire dtype):
        # what its transports counted per destination rank is each TP rank's share
        assert r["bytes_sent"] == r["bytes_moved_world"] == sum(x["bytes_received"] for x in reports)
        assert sorted(r["counted_sent_to"]) == sorted(
            _expected_shard_bytes(tp, k, itemsize, config) for k in range(tp)), r["counted_sent_to"]
    # the refit changed the engine's answers, and changed them back
    assert rounds[0]["tokens"] != rounds[1]["tokens"]
    assert rounds[0]["tokens"] == rounds[2]["tokens"]
    # a round missing a tensor is refused on every rank before anything moves; the engine
    # keeps A (tokens, logprobs, version) and the versions stay in step
    refused = trainer["refused"]
    assert "only on the destination side: 'model.norm.weight'" in refused["errors"][0]
    assert len(refused["errors"]) == 1
    assert refused["version"] == 3 and refused["weight_version"] == "3"
    assert [x["version"] for x in refused["reports"]] == [3] * tp
    assert refused["tokens"] == refused["ref_tokens"] == rounds[2]["tokens"]
    assert refused["logprobs_bit_equal"]
    if tp > 1:   # shard-to-shard: each rank got about 1/tp of the model, not all of it
        full = trainer["full_bytes_fp32"] * itemsize // 4
        assert max(x["bytes_received"] for x in rounds[0]["reports"]) < 0.6 * full


@pytest.mark.slow
def test_one_trainer_refits_two_engines_at_once(tmp_path):
    """Two identical TP=1 engines (two processes) refit together from one JAX trainer: one
    collective refit, each engine receives every byte once, and both answer like vLLM
    loading the same checkpoint."""
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("plain", "engine", e, env={"VLLM_CPU_KVCACHE_SPACE": "1", **ENGINE_ENV[1]})
        for e in range(2)]
    results = launch([cases.engines_trainer] + [cases.engines_engine] * 2, roles,
                     args=(2, str(tmp_path)), timeout=300)
    rounds = results[0].value["rounds"]
    assert [r["name"] for r in rounds] == ["A", "B"]
    model = _expected_shard_bytes(1, 0, 4)
    for r in rounds:
        assert len(r["engines"]) == 2
        for e in r["engines"]:
            assert e["tokens"] == e["ref_tokens"], r["name"]
            assert e["logprobs_bit_equal"], (r["name"], e["logprobs_max_abs_diff"])
            assert e["weight_version"] == str(r["version"])
            (report,) = e["reports"]
            assert report["bytes_received"] == report["shard_bytes"] == model
        assert r["bytes_sent"] == r["bytes_moved_world"] == 2 * model
    assert rounds[0]["engines"][0]["tokens"] != rounds[1]["engines"][0]["tokens"]
    assert {e["reports"][0]["world_rank"] for e in rounds[0]["engines"]} == {4, 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_http_server_takes_the_backend_and_refits_through_vllms_http_client(tmp_path):
    """``--weight-transfer-config '{"backend":"xreshard"}'`` on the OpenAI server (TP=1):
    the trainer drives it with vLLM's own HTTPVLLMWeightSyncClient (dev-mode RL routes)."""
    import requests

    model = str(tmp_path / "engine")
    cases.write_model_dir(model)
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # `vllm serve` needs the "vllm" distribution's metadata, which vllm-cpu does not provide
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
           "--max-num-seqs", "4", "--no-enable-prefix-caching",
           "--worker-extension-cls", "xreshard.adapters.vllm.WorkerExtension",
           "--weight-transfer-config", '{"backend": "xreshard"}']
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + cases.ENGINE_START_TIMEOUT
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM server did not come up"
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        results = launch(cases.__name__ + ":http_trainer", [Role("jax", "trainer", 0,
                                                                 num_devices=4)],
                         args=(url, model, str(tmp_path)), timeout=200)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    got = results[0].value
    assert got["after"] == got["reference"] != got["before"]
    (worker,) = got["workers"]
    assert worker["bytes_received"] == worker["shard_bytes"] == got["bytes_sent"] == \
        _expected_shard_bytes(1, 0, 4)
    assert got["weight_version"] == "1"


# ---------------------------------------------------------------------------- no engine

def _mesh():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (tests/conftest.py sets 8)")
    return jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.devices()[:4])


def test_named_jax_tree_binds_views_of_its_shards_in_hf_coordinates():
    from xreshard.adapters.jax import bind_named

    mesh = _mesh()
    flat = cases.init_params(5)
    params = cases.shard(flat, mesh)
    ranks = {int(d.id): i for i, d in enumerate(mesh.devices.flat)}
    bound = bind_named(params, NameMap(cases.rules()), ranks)
    hf = cases.hf_tensors(flat)
    assert sorted(bound.layouts) == sorted(hf)
    p = "model.layers.1."
    assert str(bound.layouts[p + "self_attn.q_proj.weight"]) == \
        "Layout((128, 128) float32 on mesh(fsdp=2,tp=2)[0..3]: d0<-tp d1<-fsdp)"
    assert str(bound.layouts[p + "self_attn.o_proj.weight"]) == \
        "Layout((128, 128) float32 on mesh(fsdp=2,tp=2)[0..3]: d0<-fsdp d1<-tp)"
    assert str(bound.layouts[p + "self_attn.k_proj.bias"]) == \
        "Layout((64,) float32 on mesh(fsdp=2,tp=2)[0..3]: d0<-tp)"
    for (rank, name), local in bound.bindings.items():
        (region,) = bound.layouts[name].regions(rank)
        assert np.array_equal(local, hf[name][region.slices()]), (rank, name)
    assert len(bound.bindings) == 4 * len(hf)


def test_named_binding_unstacks_experts_sharded_over_a_mesh_axis():
    """Stacked experts [E, D, I] split over "fsdp" on E and "tp" on I: expert e's HF tensor
    lives only on the two devices of its fsdp block, split there over tp."""
    from xreshard.adapters.jax import bind_named

    mesh = _mesh()
    shapes = cases.moe_tree_shapes()
    flat = cases.init_params(7, shapes)
    ranks = {int(d.id): i for i, d in enumerate(mesh.devices.flat)}
    bound = bind_named(cases.shard(flat, mesh, shapes), NameMap(cases.moe_rules()), ranks)
    hf = cases.hf_tensors(flat, cases.moe_rules())
    assert sorted(bound.layouts) == sorted(hf)
    p = "model.layers.0.block_sparse_moe.experts."
    assert str(bound.layouts[p + "1.w1.weight"]) == \
        "Layout((128, 128) float32 on mesh(tp=2)[0..1]: d0<-tp)"
    assert str(bound.layouts[p + "2.w2.weight"]) == \
        "Layout((128, 128) float32 on mesh(tp=2)[2..3]: d1<-tp)"
    for (rank, name), local in bound.bindings.items():
        (region,) = bound.layouts[name].regions(rank)
        assert np.array_equal(local, hf[name][region.slices()]), (rank, name)
    assert {r for r, n in bound.bindings if n == p + "3.w3.weight"} == {2, 3}


def test_named_binding_splits_fused_kernels_sharded_on_the_fused_dim():
    """Fused qkv [D, H+2KV, hd] and gate_up [D, 2I] with "tp" splitting the fused dim: q is
    tp block 0, k and v lie inside block 1, gate and up are one block each - every part is
    sent by the ranks of its block only. A part straddling blocks is refused by name."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters.naming import NamingError, jax_llama_rules
    from xreshard.adapters.jax import bind_named

    mesh = _mesh()
    c = cases.CONFIG
    D, I, H, KV = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], \
        c["num_key_value_heads"]
    rng = np.random.default_rng(11)
    flat = {"layers/0/attn/qkv/kernel": rng.standard_normal((D, H + 2 * KV, D // H)),
            "layers/0/mlp/gate_up/kernel": rng.standard_normal((D, 2 * I))}
    flat = {n: a.astype(np.float32) for n, a in flat.items()}
    tree = {n: jax.device_put(a, NamedSharding(mesh, P("fsdp", "tp"))) for n, a in flat.items()}
    names = NameMap(jax_llama_rules(fused=True),
                    params={"num_heads": H, "num_kv_heads": KV, "intermediate": I})
    ranks = {int(d.id): i for i, d in enumerate(mesh.devices.flat)}
    bound = bind_named(cases.unflatten(tree), names, ranks)
    hf = {n: np.ascontiguousarray(t.view(flat)) for n, t in
          names.apply({n: a.shape for n, a in flat.items()}).items()}
    p = "model.layers.0."
    holders = {n: sorted(r for r, m in bound.bindings if m == n) for n in hf}
    assert holders[p + "self_attn.q_proj.weight"] == [0, 2]      # tp coordinate 0
    assert holders[p + "self_attn.k_proj.weight"] == [1, 3]
    assert holders[p + "mlp.up_proj.weight"] == [1, 3]
    for (rank, name), local in bound.bindings.items():
        (region,) = bound.layouts[name].regions(rank)
        assert np.array_equal(local, hf[name][region.slices()]), (rank, name)
    # 6 q heads of 8 on tp=2: q spans block 0 and half of block 1
    odd = NameMap(jax_llama_rules(fused=True),
                  params={"num_heads": 6, "num_kv_heads": 1, "intermediate": I})
    with pytest.raises(NamingError, match="'layers/0/attn/qkv/kernel': slices \\[0:6\\] of "
                                          "dim 1 \\(size 8\\), which mesh axes \\['tp'\\]"):
        bind_named(cases.unflatten(tree), odd, ranks)


def test_named_binding_refuses_a_shard_cut_by_a_reshape():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xreshard.adapters.naming import NameMap, NamingError, Reshape, Rule, Transpose
    from xreshard.adapters.jax import bind_named

    mesh = _mesh()
    # [D, H*hd] split on tp into 6 of 12 columns, reshaped to [D, 3, 4]: a shard is no box
    # (merging a split minor dim, [H, hd] -> [H*hd], is boxes: tests/test_naming_sharded.py)
    kernel = jax.device_put(np.zeros((8, 12), np.float32), NamedSharding(mesh, P(None, "tp")))
    rule = Rule("q", "q_proj.weight", (Reshape(("@0", 3, 4)), Transpose()))
    ranks = {int(d.id): i for i, d in enumerate(mesh.devices.flat)}
    with pytest.raises(NamingError, match="'q': reshape .* non-boxes"):
        bind_named({"q": kernel}, NameMap([rule]), ranks)


def _digest_rounds(case: str, request) -> list[dict]:
    rounds = _tp2_run(request, case)[0]["rounds"]      # in the shared launch of TP=2 cases
    assert [r["name"] for r in rounds] == ["B", "A"]
    for r in rounds:
        # every processed weight of every worker equals vLLM loading the checkpoint itself
        assert r["digests"] == r["ref_digests"], r["name"]
        assert r["bytes_sent"] == sum(x["bytes_received"] for x in r["reports"])
    return rounds


def _changed(rounds: list[dict], worker: int) -> set[str]:
    """Names whose digest differs between the two rounds; every tensor a checkpoint writes
    (A and B differ everywhere) must be among them, so no digest equality is vacuous (as it
    was while prepacked CPU linears hashed as empty tensors)."""
    b, a = rounds[0]["digests"][worker], rounds[1]["digests"][worker]
    changed = {n for n in b if b[n] != a[n]}
    # only the attention's kv-cache scales (buffers no checkpoint tensor writes) stay
    unchanged = sorted(n for n in b if n not in changed)
    assert all(re.fullmatch(r".*\.attn\._(k|v|q|prob)_scale", n) for n in unchanged), unchanged
    return changed


@pytest.mark.slow
def test_expert_parallel_engine_gets_each_expert_on_its_rank_only(request):
    """Mixtral at TP=2 with ``enable_expert_parallel``, refit from a JAX trainer whose
    stacked experts ``[E, D, I]`` are split over "fsdp" and their I over "tp": each vLLM
    rank receives its two experts whole (gathered from the trainer's pieces of them) and
    its attention shards."""
    rounds = _digest_rounds("moe-ep", request)
    c = cases.MOE_CONFIG
    V, D, I, L = c["vocab_size"], c["hidden_size"], c["intermediate_size"], \
        c["num_hidden_layers"]
    E, H, KV = c["num_local_experts"], c["num_attention_heads"], c["num_key_value_heads"]
    # per rank, by vLLM's formulas: half the vocab rows of embed and lm_head, half the
    # heads of q/k/v/o, norms and router whole, and two of the four experts whole
    want = 2 * (2 * V // 2 * D + L * ((H + 2 * KV) * (D // H) * D // 2 + D * D // 2
                                      + 2 * D + E * D + E // 2 * 3 * D * I) + D)
    for r in rounds:
        reports = sorted(r["reports"], key=lambda x: x["worker"])
        assert [x["bytes_received"] for x in reports] == [want, want]
        assert [x["shard_bytes"] for x in reports] == [want, want]
    # the digests see the weights that matter: each rank's experts and attention changed
    for worker in range(2):
        changed = _changed(rounds, worker)
        for part in ("experts.routed_experts.w13_weight", "experts.routed_experts.w2_weight",
                     "qkv_proj.weight", "embed_tokens.weight", "lm_head.weight"):
            assert any(part in n for n in changed), (part, sorted(changed))


@pytest.mark.slow
def test_pipeline_parallel_engine_gets_each_stage_its_layers_only(request):
    """Qwen2 over two pipeline stages, refit from the JAX trainer: stage 0 receives the
    embedding and layer 0, stage 1 layer 1, the final norm and the tied head."""
    rounds = _digest_rounds("pp", request)
    c = cases.CONFIG
    V, D, I = c["vocab_size"], c["hidden_size"], c["intermediate_size"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    layer = (H + 2 * KV) * (D // H) * (D + 1) + D * D + 3 * D * I + 2 * D
    for r in rounds:
        reports = sorted(r["reports"], key=lambda x: x["worker"])
        assert [(x["pp_rank"], x["tp_rank"]) for x in reports] == [(0, 0), (1, 0)]
        assert [x["bytes_received"] for x in reports] == \
            [2 * (V * D + layer), 2 * (layer + D + V * D)]
    stage0, stage1 = _changed(rounds, 0), _changed(rounds, 1)
    assert any("layers.0." in n for n in stage0) and not any("layers.1." in n for n in stage0)
    assert any("layers.1." in n for n in stage1) and not any("layers.0." in n for n in stage1)


def test_trainer_error_names_the_engine_whose_call_failed():
    """An engine that refuses at init never joins; the trainer's join then times out, and
    its error says which engine refused and why, not only that processes were missing."""
    from xreshard.adapters.vllm.trainer import _concurrently
    from xreshard.errors import RefitError

    def refuse() -> None:
        raise RefitError("engine 1 has 4 workers (pp x tp) but the trainer expects "
                         "engine_world_size=2")

    def join() -> None:
        time.sleep(0.2)
        raise RefitError("timed out waiting for rollout[2], rollout[3]")

    with pytest.raises(RefitError, match=r"(?s)rollout\[2\].*engine 1's init_weight_transfer_"
                                         r"engine call failed: engine 1 has 4 workers"):
        _concurrently([lambda: None, refuse], join, 5.0, "init_weight_transfer_engine")
    assert _concurrently([lambda: None], lambda: 7, 5.0, "x") == 7

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(RefitError, match="engine 0's x call failed: boom"):
        _concurrently([boom, lambda: None], lambda: None, 5.0, "x")


@pytest.mark.slow
def test_stream_errors_reach_every_rank_and_nothing_moves_when_known_before():
    """Streamed rounds (no engine, two processes): a worker's binding error and a tensor
    only the trainer has are refused on both sides before a byte moves; a worker's failure
    to load group 1 reaches the trainer too (through group 2's error gather); the version
    advances only on good rounds, and a good round after them recovers."""
    results = launch(cases.__name__ + ":stream_errors",
                     [Role("plain", "trainer", 0), Role("plain", "rollout", 0)], timeout=120)
    trainer, worker = (r.value["rounds"] for r in results)
    assert [r["case"] for r in trainer] == ["good", "bind", "load", "extra", "good"]
    for t, w in zip(trainer, worker):
        assert (t["error"] is None) == (w["error"] is None), (t, w)
        assert t["version"] == w["version"]
    assert [r["version"] for r in worker] == [1, 1, 1, 1, 2], [r["error"] for r in worker]
    good, bind, load, extra, again = worker
    assert good["buffers"] == {f"t{i}": [float(i)] * 4 for i in range(3)}
    assert good["moved"] == 3 * 16 and good["loaded"] == ["t0", "t1", "t2"]
    # known before the round: refused on both sides, nothing moved or loaded
    for t, w, what in ((trainer[1], bind, "could not bind its receive buffers: RuntimeError: "
                        "forced"), (trainer[3], extra, "1 tensor(s) only on the source side: "
                        "'t3'")):
        assert "refused before moving anything" in t["error"] and what in t["error"], t
        assert what in w["error"] and w["buffers"] == {n: [0.0] * 4 for n in ("t0", "t1", "t2")}
        assert w["loaded"] == []
    # a load failure on the worker: group 0 loaded, group 1 received but not loaded, group
    # 2 refused on both sides, naming the worker's failure
    assert load["loaded"] == ["t0"] and load["buffers"]["t2"] == [0.0] * 4
    for r in (trainer[2], load):
        assert "failed to load group 1" in r["error"] and "forced load failure" in r["error"]
        assert "groups 0..1 of 3 were already loaded" in r["error"]
    assert again["error"] is None and again["buffers"]["t2"] == [42.0] * 4


def test_a_binding_error_becomes_an_error_of_the_refit_not_a_raise_here():
    """GPU-only binding failures (DLPack, strides) on one worker are handed to the refit's
    error gather, which raises them on every rank; the worker itself does not raise."""
    from types import SimpleNamespace

    from xreshard.adapters.vllm import XreshardWeightTransferEngine
    from xreshard.ir.layout import Layout, Mesh

    def buffers(*args):
        raise RuntimeError("DLPack: cannot export a tensor with negative strides")

    lay = Layout.replicated((4,), "float32", Mesh((1,), (1,)))
    fake = SimpleNamespace(model=None, device="cuda:0", _inplace=True, _dest=SimpleNamespace(
        buffers=buffers, layouts={"w": lay}, rec=SimpleNamespace(worker=3), with_scales=list))
    errors: list[str] = []
    held, bound = XreshardWeightTransferEngine._bind_group(fake, ["w"], errors)
    assert errors == ["worker 3 could not bind its receive buffers: RuntimeError: DLPack: "
                      "cannot export a tensor with negative strides"]
    assert held == {} and bound.layouts == {"w": lay} and bound.bindings == {}
