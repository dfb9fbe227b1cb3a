"""Refitting a vLLM engine's speculative draft with its policy (vLLM CPU, real engines).

The engine runs speculative decoding with a separate draft model (``speculative_config=
{"method": "draft_model", ...}``: a one-layer Qwen2 next to the two-layer policy, both tied,
same vocab) at TP=1 and TP=2. A JAX trainer (4 CPU devices, mesh fsdp=2 x tp=2) refits the policy
with ``send_weights`` and the draft with ``send_draft_weights`` (vLLM's
``start_draft_weight_update`` session). After each draft round, the draft's weights as its
kernels use them (:func:`~xreshard.adapters.vllm.weights_digest`, every tensor of every TP
rank) must equal those vLLM's own loaders produce from a checkpoint of the same weights,
and each TP rank must have received exactly its draft shard bytes. A draft round missing a
tensor is refused on every rank before anything moves, and a draft round to an engine
without a draft raises ``DraftError`` on every trainer process, before the engine is asked.
"""

from __future__ import annotations

import os

import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

#: the draft: one layer, half the policy's MLP, the policy's vocab (vLLM checks it) and head
#: size (vLLM's CPU attention has no kernel for head_dim 16)
DRAFT_CONFIG = dict(cases.CONFIG, intermediate_size=128, num_hidden_layers=1)
TOKENS = 8


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in cases.PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def draft_engine(ctx, tp: int, tmp: str) -> dict:
    """An engine with a draft model; answers the trainer's calls (see tests/vllm_cases.py)."""
    from vllm import LLM

    control = cases._store(ctx.address, cases.ENGINE_START_TIMEOUT)
    target, draft = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
    cases.write_model_dir(target, seed=0)
    cases.write_model_dir(draft, seed=5, c=DRAFT_CONFIG)
    llm = LLM(model=target, skip_tokenizer_init=True, tensor_parallel_size=tp, dtype="float32",
              enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
              enable_prefix_caching=False,
              speculative_config={"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": 2},
              worker_extension_cls="xreshard.adapters.vllm.WorkerExtension",
              weight_transfer_config={"backend": "xreshard"})

    def digest(target: str) -> list[dict]:
        return llm.collective_rpc("xreshard_weights_digest", kwargs={"target": target})

    def check_policy(weights_path: str) -> dict:
        got, tokens = digest("policy"), _generate(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        llm.collective_rpc("xreshard_reprocess_tied")
        return {"equal": got == digest("policy"), "tokens": tokens, "ref_tokens": _generate(llm),
                "weight_version": llm.get_weight_version()}

    def check_draft(weights_path: str) -> dict:
        got, tokens = digest("draft"), _generate(llm)
        reports = llm.collective_rpc("xreshard_transfer_report", kwargs={"target": "draft"})
        llm.collective_rpc("xreshard_reload_draft", kwargs={"weights_path": weights_path})
        return {"digests": got, "ref_digests": digest("draft"), "reports": reports,
                "tokens": tokens, "ref_tokens": _generate(llm),
                "weight_version": llm.get_weight_version()}

    try:
        cases.serve_requests(ctx, llm, control, {"check_policy": check_policy,
                                                 "check_draft": check_draft,
                                                 "start_digest": lambda: digest("draft"),
                                                 "stop": lambda: None})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {}


def draft_trainer(ctx, tp: int, tmp: str) -> dict:
    """Refit the policy (A), then the draft (D1, D2), then a draft round missing a tensor."""
    import jax

    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.local_devices())
    shapes = cases.tree_shapes(DRAFT_CONFIG)
    policy = cases.init_params(1)
    drafts = {name: cases.init_params(seed, shapes) for name, seed in (("D1", 11), ("D2", 12))}
    cases.save_checkpoint(policy, os.path.join(tmp, "A"))
    for name, flat in drafts.items():
        cases.save_checkpoint(flat, os.path.join(tmp, name))
    # a TP=2 engine with a draft starts three processes, minutes on a loaded 2-core box
    client = cases.StoreClient(ctx.address, start_timeout=2 * cases.ENGINE_START_TIMEOUT)
    start = client.call("start_digest")
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=0, engine_world_size=tp, timeout=cases.REFIT_TIMEOUT,
                                rules=cases.rules()), client=client)
    out: dict = {"start_digests": start, "draft": []}
    try:
        report = engine.send_weights(cases.shard(policy, mesh))
        out["policy"] = {"version": report.version,
                         **client.call("check_policy", weights_path=os.path.join(tmp, "A"))}
        # D2 goes inside a larger tree (as an MTP head's weights go inside its policy's):
        # the draft takes its tensors, the second layer is left on the trainer
        wider = cases.tree_shapes(dict(DRAFT_CONFIG, num_hidden_layers=2))
        trees = {"D1": cases.shard(drafts["D1"], mesh, shapes),
                 "D2": cases.shard({**cases.init_params(99, wider), **drafts["D2"]}, mesh,
                                   wider)}
        for name, tree in trees.items():
            report = engine.send_draft_weights(tree)
            out["draft"].append({"name": name, "version": report.version,
                                 "bytes_sent": report.bytes_sent,
                                 **client.call("check_draft",
                                               weights_path=os.path.join(tmp, name))})
        bad = cases.shard({n: a for n, a in drafts["D1"].items() if n != "final_norm/scale"},
                          mesh, shapes)
        try:
            engine.send_draft_weights(bad)
            out["refused"] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            out["refused"] = f"{type(e).__name__}: {e}"
        out["after_refused"] = client.call("check_draft", weights_path=os.path.join(tmp, "D2"))
        out["draft_version"] = engine.draft_sender.version
    finally:
        client.call("stop")
        engine.shutdown()
    return out


ENGINE_ENV = {1: {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},      # in-process engine
              2: {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_refits_the_speculative_draft_like_vllms_own_load(tp, tmp_path):
    roles = [Role("jax", "trainer", 0, num_devices=4),
             Role("plain", "engine", 0, env={"VLLM_CPU_KVCACHE_SPACE": "1", **ENGINE_ENV[tp]})]
    trainer = launch([draft_trainer, draft_engine], roles, args=(tp, str(tmp_path)),
                     timeout=720)[0].value
    policy = trainer["policy"]
    assert policy["version"] == 1 and policy["weight_version"] == "1"
    assert policy["equal"] and policy["tokens"] == policy["ref_tokens"]
    rounds = trainer["draft"]
    assert [r["version"] for r in rounds] == [1, 2]
    for r in rounds:
        # every tensor of every TP rank's draft, as its kernels use it, is vLLM's own load
        assert len(r["digests"]) == tp and r["digests"] == r["ref_digests"], r["name"]
        # speculative decoding with the refit draft answers as with vLLM's load (greedy)
        assert r["tokens"] == r["ref_tokens"] == policy["tokens"]
        # the draft round does not touch the engine's weight version (the policy's)
        assert r["weight_version"] == "1"
        reports = sorted(r["reports"], key=lambda x: x["tp_rank"])
        assert [x["target"] for x in reports] == ["draft"] * tp
        assert [x["version"] for x in reports] == [r["version"]] * tp
        for x in reports:
            assert x["bytes_received"] == x["shard_bytes"] > 0, x
        # exactly the draft's shards crossed (D2's extra layer stayed on the trainer)
        assert r["bytes_sent"] == sum(x["bytes_received"] for x in reports)
        if tp > 1:      # shard to shard: no TP rank got the whole draft
            assert max(x["bytes_received"] for x in reports) < 0.7 * r["bytes_sent"]
    # the checks can fail: each draft round changed every TP rank's draft weights
    d0, d1, d2 = trainer["start_digests"], rounds[0]["digests"], rounds[1]["digests"]
    for rank in range(tp):
        changed = {n for n in d1[rank] if d1[rank][n] != d2[rank][n]}
        assert any("qkv_proj" in n for n in changed) and "model.embed_tokens.weight" in changed
        assert d0[rank] != d1[rank]
    # a draft round missing a tensor: refused before anything moved; the draft keeps D2
    assert trainer["refused"].startswith("RefitError")
    assert "only on the destination side: 'model.norm.weight'" in trainer["refused"]
    after = trainer["after_refused"]
    assert after["digests"] == after["ref_digests"] == rounds[1]["digests"]
    assert trainer["draft_version"] == 2
    assert [x["version"] for x in after["reports"]] == [2] * tp


def no_draft_trainer(ctx, tmp: str) -> dict:
    """One of two trainer processes: a draft round to an engine without a draft."""
    import numpy as np
    import torch

    from xreshard.adapters.vllm import XreshardTrainerInitInfo, XreshardTrainerWeightTransferEngine

    rank = ctx.role.index
    flat = cases.init_params(1)
    if rank == 0:
        cases.save_checkpoint(flat, os.path.join(tmp, "A"))
    state = {n: torch.from_numpy(np.array(a)) for n, a in cases.hf_tensors(flat).items()}
    client = cases.StoreClient(ctx.address) if rank == 0 else None
    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=rank, engine_world_size=1, num_trainer_processes=2,
                                address=ctx.address, world_id="no-draft",
                                timeout=cases.REFIT_TIMEOUT, devices=1), client=client)
    out = {}
    try:
        try:
            engine.send_draft_weights(state)
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            out["error"] = (type(e).__name__, str(e))
        # the world is intact: the policy's round goes on (each process sends its copy)
        out["version"] = engine.send_weights(state).version
        if rank == 0:
            out["check"] = client.call("check", weights_path=os.path.join(tmp, "A"))
    finally:
        if rank == 0:
            client.call("stop")
        engine.shutdown()
    return out


@pytest.mark.slow
def test_a_draft_round_to_an_engine_without_a_draft_is_refused_on_every_trainer(tmp_path):
    roles = [Role("torch", "trainer", 0), Role("torch", "trainer", 1),
             Role("plain", "engine", 0, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})]
    results = launch([no_draft_trainer, no_draft_trainer, _plain_engine], roles,
                     args=(str(tmp_path),), timeout=300)
    t0, t1 = results[0].value, results[1].value
    assert t0["error"] == t1["error"]
    kind, message = t0["error"]
    assert kind == "DraftError"
    assert "the engine has no draft to refit" in message and "speculative_config" in message
    assert t0["version"] == t1["version"] == 1
    assert t0["check"]["tokens"] == t0["check"]["ref_tokens"]
    assert t0["check"]["logprobs_bit_equal"]


def _plain_engine(ctx, tmp: str) -> dict:
    return cases.engine(ctx, 1, "float32", tmp)


def test_the_draft_verdict_names_the_first_engine_without_a_draft_and_the_client():
    from xreshard.adapters.vllm.draft import client_problem, draft_verdict

    assert draft_verdict([{}, {"engine": 0, "problem": None}, {"client": None}], 1) is None
    why = draft_verdict([{"client": None}, {"engine": 1, "problem": "no spec"},
                         {"engine": 0, "problem": None}, {"engine": 2, "problem": "pp"}], 3)
    assert why == "engine 1 has no draft to refit (and 1 more engine(s)): no spec"
    assert "has no start_draft_weight_update()" in client_problem([object()])
    assert draft_verdict([{"client": client_problem([object()])},
                          {"engine": 0, "problem": None}], 1).startswith("the client of engine 0")


def test_the_worker_swaps_in_the_drafts_state_for_a_draft_session_and_back():
    """One layer, no engine: vLLM's set/reset_weight_update_target swap the per-target state;
    a session that loads one target refuses the other's round; without a draft, a draft
    session's update_weights raises DraftError naming why."""
    from types import SimpleNamespace

    from xreshard.adapters.vllm.draft import TARGET_STATE, DraftError
    from xreshard.adapters.vllm.worker import XreshardUpdateInfo, XreshardWeightTransferEngine

    config = SimpleNamespace(parallel_config=SimpleNamespace(), model_config="policy-config")
    policy, draft = object(), object()
    engine = XreshardWeightTransferEngine(None, config, SimpleNamespace(type="cpu"), policy)
    engine._draft_refusal = "the engine has no draft to refit: no speculative_config"
    engine.set_weight_update_target(draft, "draft-config")
    assert engine.target == "draft" and engine.model is draft
    with pytest.raises(DraftError, match="no draft round: the engine has no draft to refit"):
        engine.update_weights({"version": 1, "draft": True})
    engine.reset_weight_update_target()
    assert engine.target == "policy" and engine.model is policy

    engine._other = {k: f"draft {k}" for k in TARGET_STATE}
    engine._draft_mode = "reload"
    engine.stream = "policy stream"
    engine.set_weight_update_target(draft, "draft-config")
    assert engine.stream == "draft stream" and engine.model_config == "draft-config"
    assert engine._other["stream"] == "policy stream"
    assert engine._target_errors(XreshardUpdateInfo(version=1, draft=True)) == []
    assert "sends the policy's weights but vLLM's update session loads the draft" in \
        engine._target_errors(XreshardUpdateInfo(version=1))[0]
    engine.reset_weight_update_target()
    assert engine.stream == "policy stream" and engine._other["stream"] == "draft stream"
    assert "loads the policy" in engine._target_errors(XreshardUpdateInfo(draft=True))[0]


def test_a_draft_sharing_the_policys_embedding_refuses_to_write_it():
    """vLLM shares an EAGLE head's embedding with the target: a draft round writing it would
    change the policy, so the draft's rounds are refused naming the tensor."""
    import torch

    from xreshard.adapters.vllm.draft import shared_with_policy

    policy = torch.nn.Module()
    policy.embed = torch.nn.Embedding(4, 2)
    draft = torch.nn.Module()
    draft.embed, draft.fc = policy.embed, torch.nn.Linear(2, 2)
    assert shared_with_policy(draft, policy, ["fc.weight"]) is None
    why = shared_with_policy(draft, policy, ["embed.weight", "fc.weight"])
    assert why.startswith("the draft's ['embed.weight'] are the policy's own tensors")
