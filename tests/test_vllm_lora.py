"""In-memory LoRA refits into a real vLLM engine (CPU, TP=2, ``enable_lora``).

One launch (tests/lora_cases.py): a JAX trainer (4 CPU devices; Flax-kernel factors,
sharded) and a torch trainer (plain bf16 tensors) in one refit world, and an engine
process with a tiny Llama served with two LoRA slots. The JAX trainer refits adapter A,
then B, then A again into slot "jax"; the torch trainer then refits T into slot "torch";
then both refit in one call. After every round each slot's greedy tokens and full-vocab
logprobs are bit-equal to vLLM loading the same adapter from a PEFT directory, and
again after the directory adapters evicted it from vLLM's cache (rebuilt from memory, not
scaled twice); each TP rank received exactly what its LoRA layers read (counted on the
trainers' transports, and compared with vLLM's slicing formulas). Three bad adapters are
refused with the same LoRAError on every process before any byte moves; the slots keep
serving what they served.

vLLM missing: skipped, unless XRESHARD_REQUIRE_VLLM is set (CI), where that is a failure.
"""

from __future__ import annotations

import pytest

from . import lora_cases as lc
from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

#: the engine core in the test's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one process
#: importing vLLM less (~10 s of CPU on these machines); the TP workers are processes anyway
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.slow
def test_lora_refits_into_vllm_slots_like_a_directory_load(tmp_path):
    roles = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "trainer", 1),
             Role("plain", "engine", 0, env=ENGINE_ENV)]
    results = launch([lc.jax_trainer, lc.torch_trainer, lc.engine], roles,
                     args=(str(tmp_path),), timeout=1500)
    jax_side, torch_side = results[0].value, results[1].value
    rounds = jax_side["rounds"]
    assert [r["label"] for r in rounds] == [s[0] for s in lc.SCRIPT]
    assert [r["version"] for r in rounds] == [1, 2, 3, 4, 5]
    assert [r["version"] for r in torch_side["rounds"]] == [1, 2, 3, 4, 5]
    n_logprobs = lc.CONFIG["vocab_size"] * cases.MAX_TOKENS * len(cases.PROMPTS)
    for r in rounds:
        assert r["error"] is None, r["error"]
        for slot in r["slots"]:
            where = (r["label"], slot["name"])
            assert slot["tokens"] == slot["ref_tokens"] == slot["again_tokens"], where
            assert slot["bit_equal"] and slot["again_bit_equal"], where
            assert slot["num_logprobs"] == n_logprobs
            assert slot["tokens"] != r["base"], where      # the adapter changes the model
    by_label = {r["label"]: r for r in rounds}
    # A, B, A: the slot follows the trainer and comes back
    assert by_label["A"]["slots"][0]["tokens"] != by_label["B"]["slots"][0]["tokens"]
    assert by_label["A"]["slots"][0]["tokens"] == by_label["A again"]["slots"][0]["tokens"]
    # the torch slot did not disturb the JAX one
    assert by_label["torch T"]["slots"][0]["tokens"] == by_label["A"]["slots"][0]["tokens"]

    # every TP rank received exactly what its LoRA layers read (vLLM's slicing formulas),
    # from whichever trainer holds the adapter, in a handful of messages, not one per tensor
    fp32, bf16 = lc.slice_bytes(2, 4), lc.slice_bytes(2, 2)
    num_tensors = 2 * len(lc.module_shapes())
    for label, jax_bytes, torch_bytes in [("A", fp32, 0), ("B", fp32, 0), ("A again", fp32, 0),
                                          ("torch T", 0, bf16), ("B and T2", fp32, bf16)]:
        j = by_label[label]
        t = next(x for x in torch_side["rounds"] if x["label"] == label)
        assert j["sent_to"] == [jax_bytes] * 2, (label, j["sent_to"])
        assert t["sent_to"] == [torch_bytes] * 2, (label, t["sent_to"])
        assert all(0 < m < num_tensors // 4 for m in j["messages_to"] + t["messages_to"]
                   if m), (label, j["messages_to"], t["messages_to"])
        for w in j["reports"]:
            assert w["shard_bytes"] == w["bytes_received"] == jax_bytes + torch_bytes, w
    last = by_label["B and T2"]["reports"]
    assert sorted(w["tp_rank"] for w in last) == [0, 1]
    for w in last:
        assert w["adapters"] == {"jax": {"lora_id": 1, "version": 4},
                                 "torch": {"lora_id": 2, "version": 2}}, w

    # bad adapters: the same LoRAError on every process (both trainers, both workers),
    # before any byte moved; the slots still serve what they served
    expect = {"unknown module": "target module 'model.layers.0.mlp.fc9' is not a LoRA module",
              "rank above max_lora_rank": "LoRA rank 32 is greater than max_lora_rank 16",
              "wrong shape": "expected [8, 128]"}
    for j, t in zip(jax_side["bad"], torch_side["bad"]):
        assert j["error"].startswith("LoRAError: LoRA refit refused before moving anything"), j
        assert expect[j["case"]] in j["error"], j
        assert t["error"] == j["error"]
        assert j["total_sent"] == t["total_sent"] == 0
    final = jax_side["after_bad"]
    assert [w["last_error"] for w in final["reports"]] == [jax_side["bad"][-1]["error"]] * 2
    assert [s["tokens"] for s in final["slots"]] == \
        [s["tokens"] for s in by_label["B and T2"]["slots"]]
    assert all(s["bit_equal"] for s in final["slots"])
