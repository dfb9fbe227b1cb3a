"""vLLM destination layouts recorded from vLLM's own loaders (adapters/vllm/).

No engine: each TP rank's model is built on the meta device under ``fake_tp`` and its
``load_weights`` runs once on probes. Expected pieces are written by hand from the
formulas of docs/layouts.md §7 (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding with DEFAULT_VOCAB_PADDING_SIZE = 64).
"""

import json
import math

import pytest

from .vllm_cases import LazyModule, requires_vllm  # noqa: E402

requires_vllm()     # XRESHARD_REQUIRE_VLLM set: a missing vLLM fails instead of skipping
torch = pytest.importorskip("torch")
transformers = LazyModule("transformers")

from xreshard.adapters import vllm as xv  # noqa: E402
from xreshard.ir.layout import Layout, Mesh, Region  # noqa: E402

# Tiny Qwen2: V=1000 (padded to 1024), D=128, H=4, KV=2, hd=32, I=256, q/k/v bias, tied.
# Tiny Llama: V=960 (no padding), D=128, H=8, KV=2, hd=16, I=256, q/k/v/o bias, untied.

QWEN2 = {
    (1, 0): """
        embed_tokens.weight[0:1000, 0:128] -> embed_tokens.weight[0:1000, 0:128]
        q_proj.weight[0:128, 0:128] -> qkv_proj.weight[0:128, 0:128]
        q_proj.bias[0:128] -> qkv_proj.bias[0:128]
        k_proj.weight[0:64, 0:128] -> qkv_proj.weight[128:192, 0:128]
        k_proj.bias[0:64] -> qkv_proj.bias[128:192]
        v_proj.weight[0:64, 0:128] -> qkv_proj.weight[192:256, 0:128]
        v_proj.bias[0:64] -> qkv_proj.bias[192:256]
        o_proj.weight[0:128, 0:128] -> o_proj.weight[0:128, 0:128]
        gate_proj.weight[0:256, 0:128] -> gate_up_proj.weight[0:256, 0:128]
        up_proj.weight[0:256, 0:128] -> gate_up_proj.weight[256:512, 0:128]
        down_proj.weight[0:128, 0:256] -> down_proj.weight[0:128, 0:256]
    """,
    (2, 0): """
        embed_tokens.weight[0:512, 0:128] -> embed_tokens.weight[0:512, 0:128]
        q_proj.weight[0:64, 0:128] -> qkv_proj.weight[0:64, 0:128]
        q_proj.bias[0:64] -> qkv_proj.bias[0:64]
        k_proj.weight[0:32, 0:128] -> qkv_proj.weight[64:96, 0:128]
        k_proj.bias[0:32] -> qkv_proj.bias[64:96]
        v_proj.weight[0:32, 0:128] -> qkv_proj.weight[96:128, 0:128]
        v_proj.bias[0:32] -> qkv_proj.bias[96:128]
        o_proj.weight[0:128, 0:64] -> o_proj.weight[0:128, 0:64]
        gate_proj.weight[0:128, 0:128] -> gate_up_proj.weight[0:128, 0:128]
        up_proj.weight[0:128, 0:128] -> gate_up_proj.weight[128:256, 0:128]
        down_proj.weight[0:128, 0:128] -> down_proj.weight[0:128, 0:128]
    """,
    (2, 1): """
        embed_tokens.weight[512:1000, 0:128] -> embed_tokens.weight[0:488, 0:128]
        q_proj.weight[64:128, 0:128] -> qkv_proj.weight[0:64, 0:128]
        q_proj.bias[64:128] -> qkv_proj.bias[0:64]
        k_proj.weight[32:64, 0:128] -> qkv_proj.weight[64:96, 0:128]
        k_proj.bias[32:64] -> qkv_proj.bias[64:96]
        v_proj.weight[32:64, 0:128] -> qkv_proj.weight[96:128, 0:128]
        v_proj.bias[32:64] -> qkv_proj.bias[96:128]
        o_proj.weight[0:128, 64:128] -> o_proj.weight[0:128, 0:64]
        gate_proj.weight[128:256, 0:128] -> gate_up_proj.weight[0:128, 0:128]
        up_proj.weight[128:256, 0:128] -> gate_up_proj.weight[128:256, 0:128]
        down_proj.weight[0:128, 128:256] -> down_proj.weight[0:128, 0:128]
    """,
    # tp=4 > KV=2: one kv head per rank, replicated on rank pairs (0,1) and (2,3)
    (4, 0): """
        embed_tokens.weight[0:256, 0:128] -> embed_tokens.weight[0:256, 0:128]
        q_proj.weight[0:32, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[0:32] -> qkv_proj.bias[0:32]
        k_proj.weight[0:32, 0:128] -> qkv_proj.weight[32:64, 0:128]
        k_proj.bias[0:32] -> qkv_proj.bias[32:64]
        v_proj.weight[0:32, 0:128] -> qkv_proj.weight[64:96, 0:128]
        v_proj.bias[0:32] -> qkv_proj.bias[64:96]
        o_proj.weight[0:128, 0:32] -> o_proj.weight[0:128, 0:32]
        gate_proj.weight[0:64, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[0:64, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 0:64] -> down_proj.weight[0:128, 0:64]
    """,
    (4, 1): """
        embed_tokens.weight[256:512, 0:128] -> embed_tokens.weight[0:256, 0:128]
        q_proj.weight[32:64, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[32:64] -> qkv_proj.bias[0:32]
        k_proj.weight[0:32, 0:128] -> qkv_proj.weight[32:64, 0:128]
        k_proj.bias[0:32] -> qkv_proj.bias[32:64]
        v_proj.weight[0:32, 0:128] -> qkv_proj.weight[64:96, 0:128]
        v_proj.bias[0:32] -> qkv_proj.bias[64:96]
        o_proj.weight[0:128, 32:64] -> o_proj.weight[0:128, 0:32]
        gate_proj.weight[64:128, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[64:128, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 64:128] -> down_proj.weight[0:128, 0:64]
    """,
    (4, 2): """
        embed_tokens.weight[512:768, 0:128] -> embed_tokens.weight[0:256, 0:128]
        q_proj.weight[64:96, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[64:96] -> qkv_proj.bias[0:32]
        k_proj.weight[32:64, 0:128] -> qkv_proj.weight[32:64, 0:128]
        k_proj.bias[32:64] -> qkv_proj.bias[32:64]
        v_proj.weight[32:64, 0:128] -> qkv_proj.weight[64:96, 0:128]
        v_proj.bias[32:64] -> qkv_proj.bias[64:96]
        o_proj.weight[0:128, 64:96] -> o_proj.weight[0:128, 0:32]
        gate_proj.weight[128:192, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[128:192, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 128:192] -> down_proj.weight[0:128, 0:64]
    """,
    (4, 3): """
        embed_tokens.weight[768:1000, 0:128] -> embed_tokens.weight[0:232, 0:128]
        q_proj.weight[96:128, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[96:128] -> qkv_proj.bias[0:32]
        k_proj.weight[32:64, 0:128] -> qkv_proj.weight[32:64, 0:128]
        k_proj.bias[32:64] -> qkv_proj.bias[32:64]
        v_proj.weight[32:64, 0:128] -> qkv_proj.weight[64:96, 0:128]
        v_proj.bias[32:64] -> qkv_proj.bias[64:96]
        o_proj.weight[0:128, 96:128] -> o_proj.weight[0:128, 0:32]
        gate_proj.weight[192:256, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[192:256, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 192:256] -> down_proj.weight[0:128, 0:64]
    """,
}
# padded vocab: rows of embed_tokens that no HF row lands in (vLLM zero-fills them)
QWEN2_UNFILLED = {(1, 0): "[1000:1024, 0:128]", (2, 1): "[488:512, 0:128]",
                  (4, 3): "[232:256, 0:128]"}

LLAMA = {
    (1, 0): """
        embed_tokens.weight[0:960, 0:128] -> embed_tokens.weight[0:960, 0:128]
        q_proj.weight[0:128, 0:128] -> qkv_proj.weight[0:128, 0:128]
        q_proj.bias[0:128] -> qkv_proj.bias[0:128]
        k_proj.weight[0:32, 0:128] -> qkv_proj.weight[128:160, 0:128]
        k_proj.bias[0:32] -> qkv_proj.bias[128:160]
        v_proj.weight[0:32, 0:128] -> qkv_proj.weight[160:192, 0:128]
        v_proj.bias[0:32] -> qkv_proj.bias[160:192]
        o_proj.weight[0:128, 0:128] -> o_proj.weight[0:128, 0:128]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[0:256, 0:128] -> gate_up_proj.weight[0:256, 0:128]
        up_proj.weight[0:256, 0:128] -> gate_up_proj.weight[256:512, 0:128]
        down_proj.weight[0:128, 0:256] -> down_proj.weight[0:128, 0:256]
        lm_head.weight[0:960, 0:128] -> lm_head.weight[0:960, 0:128]
    """,
    (2, 0): """
        embed_tokens.weight[0:480, 0:128] -> embed_tokens.weight[0:480, 0:128]
        q_proj.weight[0:64, 0:128] -> qkv_proj.weight[0:64, 0:128]
        q_proj.bias[0:64] -> qkv_proj.bias[0:64]
        k_proj.weight[0:16, 0:128] -> qkv_proj.weight[64:80, 0:128]
        k_proj.bias[0:16] -> qkv_proj.bias[64:80]
        v_proj.weight[0:16, 0:128] -> qkv_proj.weight[80:96, 0:128]
        v_proj.bias[0:16] -> qkv_proj.bias[80:96]
        o_proj.weight[0:128, 0:64] -> o_proj.weight[0:128, 0:64]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[0:128, 0:128] -> gate_up_proj.weight[0:128, 0:128]
        up_proj.weight[0:128, 0:128] -> gate_up_proj.weight[128:256, 0:128]
        down_proj.weight[0:128, 0:128] -> down_proj.weight[0:128, 0:128]
        lm_head.weight[0:480, 0:128] -> lm_head.weight[0:480, 0:128]
    """,
    (2, 1): """
        embed_tokens.weight[480:960, 0:128] -> embed_tokens.weight[0:480, 0:128]
        q_proj.weight[64:128, 0:128] -> qkv_proj.weight[0:64, 0:128]
        q_proj.bias[64:128] -> qkv_proj.bias[0:64]
        k_proj.weight[16:32, 0:128] -> qkv_proj.weight[64:80, 0:128]
        k_proj.bias[16:32] -> qkv_proj.bias[64:80]
        v_proj.weight[16:32, 0:128] -> qkv_proj.weight[80:96, 0:128]
        v_proj.bias[16:32] -> qkv_proj.bias[80:96]
        o_proj.weight[0:128, 64:128] -> o_proj.weight[0:128, 0:64]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[128:256, 0:128] -> gate_up_proj.weight[0:128, 0:128]
        up_proj.weight[128:256, 0:128] -> gate_up_proj.weight[128:256, 0:128]
        down_proj.weight[0:128, 128:256] -> down_proj.weight[0:128, 0:128]
        lm_head.weight[480:960, 0:128] -> lm_head.weight[0:480, 0:128]
    """,
    (4, 0): """
        embed_tokens.weight[0:240, 0:128] -> embed_tokens.weight[0:240, 0:128]
        q_proj.weight[0:32, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[0:32] -> qkv_proj.bias[0:32]
        k_proj.weight[0:16, 0:128] -> qkv_proj.weight[32:48, 0:128]
        k_proj.bias[0:16] -> qkv_proj.bias[32:48]
        v_proj.weight[0:16, 0:128] -> qkv_proj.weight[48:64, 0:128]
        v_proj.bias[0:16] -> qkv_proj.bias[48:64]
        o_proj.weight[0:128, 0:32] -> o_proj.weight[0:128, 0:32]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[0:64, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[0:64, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 0:64] -> down_proj.weight[0:128, 0:64]
        lm_head.weight[0:240, 0:128] -> lm_head.weight[0:240, 0:128]
    """,
    (4, 1): """
        embed_tokens.weight[240:480, 0:128] -> embed_tokens.weight[0:240, 0:128]
        q_proj.weight[32:64, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[32:64] -> qkv_proj.bias[0:32]
        k_proj.weight[0:16, 0:128] -> qkv_proj.weight[32:48, 0:128]
        k_proj.bias[0:16] -> qkv_proj.bias[32:48]
        v_proj.weight[0:16, 0:128] -> qkv_proj.weight[48:64, 0:128]
        v_proj.bias[0:16] -> qkv_proj.bias[48:64]
        o_proj.weight[0:128, 32:64] -> o_proj.weight[0:128, 0:32]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[64:128, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[64:128, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 64:128] -> down_proj.weight[0:128, 0:64]
        lm_head.weight[240:480, 0:128] -> lm_head.weight[0:240, 0:128]
    """,
    (4, 2): """
        embed_tokens.weight[480:720, 0:128] -> embed_tokens.weight[0:240, 0:128]
        q_proj.weight[64:96, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[64:96] -> qkv_proj.bias[0:32]
        k_proj.weight[16:32, 0:128] -> qkv_proj.weight[32:48, 0:128]
        k_proj.bias[16:32] -> qkv_proj.bias[32:48]
        v_proj.weight[16:32, 0:128] -> qkv_proj.weight[48:64, 0:128]
        v_proj.bias[16:32] -> qkv_proj.bias[48:64]
        o_proj.weight[0:128, 64:96] -> o_proj.weight[0:128, 0:32]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[128:192, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[128:192, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 128:192] -> down_proj.weight[0:128, 0:64]
        lm_head.weight[480:720, 0:128] -> lm_head.weight[0:240, 0:128]
    """,
    (4, 3): """
        embed_tokens.weight[720:960, 0:128] -> embed_tokens.weight[0:240, 0:128]
        q_proj.weight[96:128, 0:128] -> qkv_proj.weight[0:32, 0:128]
        q_proj.bias[96:128] -> qkv_proj.bias[0:32]
        k_proj.weight[16:32, 0:128] -> qkv_proj.weight[32:48, 0:128]
        k_proj.bias[16:32] -> qkv_proj.bias[32:48]
        v_proj.weight[16:32, 0:128] -> qkv_proj.weight[48:64, 0:128]
        v_proj.bias[16:32] -> qkv_proj.bias[48:64]
        o_proj.weight[0:128, 96:128] -> o_proj.weight[0:128, 0:32]
        o_proj.bias[0:128] -> o_proj.bias[0:128]
        gate_proj.weight[192:256, 0:128] -> gate_up_proj.weight[0:64, 0:128]
        up_proj.weight[192:256, 0:128] -> gate_up_proj.weight[64:128, 0:128]
        down_proj.weight[0:128, 192:256] -> down_proj.weight[0:128, 0:64]
        lm_head.weight[720:960, 0:128] -> lm_head.weight[0:240, 0:128]
    """,
}
# replicated on every rank: the norms (2 per layer + final)
NORMS = """
    input_layernorm.weight[0:128] -> input_layernorm.weight[0:128]
    post_attention_layernorm.weight[0:128] -> post_attention_layernorm.weight[0:128]
    norm.weight[0:128] -> norm.weight[0:128]
"""

_PREFIXES = ("model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.0.", "model.")


def _short(name):
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _table(text):
    return {" ".join(line.split()) for line in (text + NORMS).strip().splitlines() if line.strip()}


def _recorded(rec, layer=0):
    """Layer-``layer`` and global pieces as the table's short strings."""
    out = set()
    for ps in rec.pieces.values():
        for p in ps:
            if ".layers." in p.hf_name and f".layers.{layer}." not in p.hf_name:
                continue
            hf, param = (p.hf_name.replace(f".layers.{layer}.", ".layers.0."),
                         p.param.replace(f".layers.{layer}.", ".layers.0."))
            out.add(f"{_short(hf)}{p.region} -> {_short(param)}{p.param_region}")
    return out


def _config(kind):
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(
            vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=256)
        cfg.architectures = ["Qwen2ForCausalLM"]
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=960, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
            tie_word_embeddings=False, max_position_embeddings=256)
        cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def recordings():
    """(model, tp) -> {tp_rank: Recording}, plus the HF specs per model."""
    out, specs = {}, {}
    for kind, tps in (("qwen2", (1, 2, 4)), ("llama", (1, 2, 4, 8))):
        cfg = _config(kind)
        vllm_config = xv.make_vllm_config(cfg, dtype="bfloat16")
        specs[kind] = xv.hf_tensor_specs(cfg, "bfloat16")
        for tp in tps:
            out[kind, tp] = {r: xv.record_from_config(vllm_config, r, tp, specs[kind])
                             for r in range(tp)}
    return out, specs


@pytest.mark.parametrize("kind,table", [("qwen2", QWEN2), ("llama", LLAMA)])
def test_recorded_pieces_equal_the_hand_table(recordings, kind, table):
    recs, _ = recordings
    for (tp, rank), text in table.items():
        rec = recs[kind, tp][rank]
        assert (rec.tp_rank, rec.tp_size) == (rank, tp)
        assert _recorded(rec) == _table(text), (kind, tp, rank)
        assert _recorded(rec, layer=1) == _table(text), (kind, tp, rank, "layer 1")


def test_padded_vocab_tail_is_unfilled(recordings):
    recs, _ = recordings
    for kind, tps in (("qwen2", (1, 2, 4)), ("llama", (1, 2, 4))):
        for tp in tps:
            for rank, rec in recs[kind, tp].items():
                tail = QWEN2_UNFILLED.get((tp, rank)) if kind == "qwen2" else None
                got = {n: [str(r) for r in rs] for n, rs in rec.unfilled.items()}
                want = {"model.embed_tokens.weight": [tail]} if tail else {}
                assert got == want, (kind, tp, rank)
                assert all(".attn._" in n for n in rec.unloaded), rec.unloaded   # kv-cache scales


def test_tied_embedding_is_one_parameter(recordings):
    recs, specs = recordings
    assert "lm_head.weight" not in specs["qwen2"]
    rec = recs["qwen2", 2][1]
    assert rec.aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert recs["llama", 2][1].aliases == {}


def test_feeding_a_tied_alias_records_nothing_for_it():
    cfg = _config("qwen2")
    specs = xv.hf_tensor_specs(cfg, "bfloat16")
    specs["lm_head.weight"] = specs["model.embed_tokens.weight"]
    rec = xv.record_from_config(xv.make_vllm_config(cfg, dtype="bfloat16"), 0, 2, specs)
    assert rec.pieces["lm_head.weight"] == []          # vLLM skips the alias
    assert len(rec.pieces["model.embed_tokens.weight"]) == 1


def _layouts(recs, specs):
    return xv.layouts_from_pieces(recs, {n: s for n, (s, _) in specs.items()},
                                  {n: d for n, (_, d) in specs.items()})


def test_layouts_are_product_form_where_vllm_is_and_explicit_for_padded_vocab(recordings):
    recs, specs = recordings
    q4 = _layouts(recs["qwen2", 4], specs["qwen2"])
    p = "model.layers.0."
    assert str(q4[p + "self_attn.q_proj.weight"]) == \
        "Layout((128, 128) bfloat16 on mesh(tp=4)[0..3]: d0<-tp)"
    assert str(q4[p + "self_attn.k_proj.weight"]) == \
        "Layout((64, 128) bfloat16 on mesh(tp=2,tp_rep=2)[0..3]: d0<-tp)"
    assert str(q4[p + "self_attn.o_proj.weight"]) == \
        "Layout((128, 128) bfloat16 on mesh(tp=4)[0..3]: d1<-tp)"
    assert str(q4[p + "mlp.down_proj.weight"]) == \
        "Layout((128, 256) bfloat16 on mesh(tp=4)[0..3]: d1<-tp)"
    assert str(q4["model.norm.weight"]) == "Layout((128,) bfloat16 on mesh(tp=4)[0..3]: replicated)"
    embed = q4["model.embed_tokens.weight"]
    assert not embed.is_product                   # 1000 rows: 256, 256, 256, 232 (not torch.chunk)
    assert [str(r) for rank in range(4) for r in embed.regions(rank)] == \
        ["[0:256, 0:128]", "[256:512, 0:128]", "[512:768, 0:128]", "[768:1000, 0:128]"]

    l8 = _layouts(recs["llama", 8], specs["llama"])
    assert str(l8["model.embed_tokens.weight"]) == \
        "Layout((960, 128) bfloat16 on mesh(tp=8)[0..7]: d0<-tp)"
    assert str(l8[p + "self_attn.v_proj.bias"]) == \
        "Layout((32,) bfloat16 on mesh(tp=2,tp_rep=4)[0..7]: d0<-tp)"
    assert str(l8[p + "self_attn.o_proj.bias"]) == \
        "Layout((128,) bfloat16 on mesh(tp=8)[0..7]: replicated)"   # row-parallel bias


def _hand_regions(text):
    """Short HF name -> its region, from a hand table (one region per tensor per rank)."""
    out = {}
    for line in _table(text):
        name, _, region = line.split(" -> ")[0].partition("[")
        out[name] = "[" + region
    return out


@pytest.mark.parametrize("kind,table", [("qwen2", QWEN2), ("llama", LLAMA)])
def test_layouts_equal_the_hand_table(recordings, kind, table):
    """The destination layouts (what the "xreshard" backend plans with) hold, on every rank,
    exactly the hand table's region of every tensor; product form except the padded vocab."""
    recs, specs = recordings
    for tp in (1, 2, 4):
        layouts = _layouts(recs[kind, tp], specs[kind])
        for rank in range(tp):
            got = {}
            for name, lay in layouts.items():
                if ".layers." in name and ".layers.0." not in name:
                    continue
                (region,) = lay.regions(rank)
                got[_short(name)] = str(region)
                uneven = kind == "qwen2" and name == "model.embed_tokens.weight" and tp > 1
                assert lay.is_product == (not uneven), (kind, tp, name)
            assert got == _hand_regions(table[tp, rank]), (kind, tp, rank)


def test_layouts_hold_exactly_the_recorded_regions(recordings):
    recs, specs = recordings
    for (kind, tp), by_rank in recs.items():
        layouts = _layouts(by_rank, specs[kind])
        for name, layout in layouts.items():
            for rank, rec in by_rank.items():
                want = {p.region for p in rec.pieces[name]}
                assert set(layout.regions(rank)) == want, (kind, tp, name, rank)
            assert Layout.from_json(layout.to_json()) == layout


def test_layouts_use_world_ranks_in_the_given_order(recordings):
    recs, specs = recordings
    by_world = {10 + 2 * r: rec for r, rec in recs["qwen2", 4].items()}
    lay = xv.layouts_from_pieces(by_world, {n: s for n, (s, _) in specs["qwen2"].items()},
                                 {n: d for n, (_, d) in specs["qwen2"].items()},
                                 order=[10, 12, 14, 16])
    k = lay["model.layers.0.self_attn.k_proj.weight"]
    assert k.mesh.ranks == (10, 12, 14, 16)
    assert [str(r) for r in k.regions(14)] == ["[32:64, 0:128]"]


def test_recording_round_trips_through_json(recordings):
    recs, _ = recordings
    rec = recs["qwen2", 4][3]
    back = xv.Recording.from_json(json.loads(json.dumps(rec.to_json())))
    assert back == rec


def test_fake_tp_restores_parallel_state():
    from vllm.distributed import parallel_state as ps
    before = ps._TP
    with xv.fake_tp(1, 2):
        assert ps.get_tensor_model_parallel_world_size() == 2
        assert ps.get_tensor_model_parallel_rank() == 1
    assert ps._TP is before
    with pytest.raises(ValueError, match="outside"):
        with xv.fake_tp(2, 2):
            pass


def test_shard_weights_load_like_full_tensors_through_vllm_loaders():
    """Rank 1 of TP=2 loaded from its recorded regions only == loaded from full tensors."""
    cfg = _config("qwen2")
    vllm_config = xv.make_vllm_config(cfg, dtype="float32")
    specs = xv.hf_tensor_specs(cfg, "float32")
    rec = xv.record_from_config(vllm_config, 1, 2, specs)
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, (s, _) in specs.items()}
    with xv.fake_tp(1, 2):
        a = xv.build_model(vllm_config, device="cpu")
        b = xv.build_model(vllm_config, device="cpu")
        a.load_weights(iter(full.items()))
        b.load_weights((n, xv.shard_weight(n, full[n].shape, xv.parts_from_full(ps, full[n])))
                       for n, ps in rec.pieces.items())
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in rec.pieces["model.layers.1.self_attn.k_proj.weight"]:
        assert torch.equal(pa[name.param][name.param_slices], pb[name.param][name.param_slices])
    for name, t in pa.items():
        if name in rec.unloaded:
            continue
        assert torch.equal(t, pb[name]), name
    q = rec.pieces["model.layers.0.self_attn.q_proj.weight"][0]
    assert torch.equal(pb[q.param][q.param_slices], full[q.hf_name][q.region.slices()])


class _Toy(torch.nn.Module):
    """One meta parameter and a hand-written loader ``fn(param, loaded)``."""

    def __init__(self, fn, shape=(4, 6)):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        self.fn = fn

    def load_weights(self, weights):
        for _, t in weights:
            self.fn(self.w, t)


def _record_toy(fn, shape=(8, 6), param_shape=(4, 6)):
    return xv.record_model(_Toy(fn, param_shape), {"x": (shape, "float32")}, tp_rank=0, tp_size=1)


def test_views_are_followed_through_chunk_index_and_setitem():
    def loader(w, t):
        top, bottom = t.chunk(2, dim=0)               # [0:4], [4:8]
        w.data[:2].copy_(bottom[1:3])                 # rows 5:7
        w.data[2:, 1:].copy_(top.narrow(1, 1, 5)[:2])  # rows 0:2, cols 1:6
        w.data[2:, 0] = t[6:, 0]                      # __setitem__, rows 6:8 col 0
    rec = _record_toy(loader)
    assert [str(p) for p in rec.pieces["x"]] == [
        "x[5:7, 0:6] -> w[0:2, 0:6]", "x[0:2, 1:6] -> w[2:4, 1:6]", "x[6:8, 0:1] -> w[2:4, 0:1]"]
    assert rec.unfilled == {}


@pytest.mark.parametrize("fn,match", [
    (lambda w, t: w.data.copy_(t[:4] * 2), "computes a new tensor from it with mul "),
    (lambda w, t: w.data.copy_(t[:6, :4].t()), "not a box in row-major order"),
    (lambda w, t: w.data.copy_(torch.cat([t[:2], t[2:4]])), "combines them with cat"),
    (lambda w, t: t.mul_(2), "in place"),
    (lambda w, t: w.data.copy_(t[:4].view(torch.int32)), "reinterprets its bits"),
    (lambda w, t: torch.empty(4, 6, device="meta").copy_(t[:4]), "temporary"),
    (lambda w, t: w.data.copy_(t[0]), "broadcasting"),
    (lambda w, t: w.data.copy_(t[::2, :]), "not a box"),
])
def test_non_slicing_loaders_raise_naming_the_tensor(fn, match):
    with pytest.raises(xv.RecordError, match="'x'") as info:
        _record_toy(fn)
    assert info.match(match)


def test_overlapping_writes_raise():
    def loader(w, t):
        w.data.copy_(t[:4])
        w.data[1:3].copy_(t[4:6])
    with pytest.raises(xv.RecordError, match="overlapping"):
        _record_toy(loader)


@pytest.mark.parametrize("ops", [
    [("narrow", 0, 1, 3)], [("select", 1, 2)], [("narrow", 2, 1, 2), ("select", 0, 1)],
    [("flatten", 1)], [("narrow", 0, 1, 1), ("flatten", 0)], [("unsqueeze", 1)],
    [("narrow", 1, 0, 2), ("flatten", 1)], [("transpose", 0, 1)], [("step", 1)],
])
def test_view_box_agrees_with_torch(ops):
    """A box returned by view_box reads exactly the elements of the torch view."""
    base = torch.arange(4 * 3 * 5).reshape(4, 3, 5)
    v = base
    for op, *args in ops:
        if op == "flatten":
            v = v.flatten(args[0])
        elif op == "step":
            v = v[::2]
        else:
            v = getattr(v, op)(*args)
    box = xv.view_box(tuple(v.shape), tuple(v.stride()), v.storage_offset(), tuple(base.shape))
    if ops[0][0] in ("transpose", "step"):
        assert box is None
    else:
        assert torch.equal(v.reshape(-1), base[box.slices()].reshape(-1))


def _tiny_mixtral_specs():
    cfg = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256)
    cfg.architectures = ["MixtralForCausalLM"]
    p = "model.layers.0.block_sparse_moe"
    specs = {n: v for n, v in xv.hf_tensor_specs(cfg, "bfloat16").items() if ".mlp." not in n}
    specs[f"{p}.gate.weight"] = ((4, 64), "bfloat16")
    for e in range(4):
        for w, shape in (("w1", (128, 64)), ("w2", (64, 128)), ("w3", (128, 64))):
            specs[f"{p}.experts.{e}.{w}.weight"] = (shape, "bfloat16")
    return cfg, p, specs


def test_mixtral_expert_parallel_puts_each_expert_whole_on_one_rank():
    """TP=2 with enable_expert_parallel: experts 0, 1 live whole on rank 0 and 2, 3 on rank
    1 (vLLM's linear placement, read from its expert map, not assumed); attention stays TP."""
    cfg, p, specs = _tiny_mixtral_specs()
    vllm_config = xv.make_vllm_config(cfg, dtype="bfloat16", tp_size=2,
                                      enable_expert_parallel=True)
    recs = {r: xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)}
    fused = f"{p}.experts.routed_experts"
    for r, rec in recs.items():
        for e in range(4):
            local = e - 2 * r
            got = [str(q) for w in ("w1", "w3", "w2")
                   for q in rec.pieces[f"{p}.experts.{e}.{w}.weight"]]
            assert got == ([] if not 0 <= local < 2 else [
                f"{p}.experts.{e}.w1.weight[0:128, 0:64] -> "
                f"{fused}.w13_weight[{local}:{local + 1}, 0:128, 0:64]",
                f"{p}.experts.{e}.w3.weight[0:128, 0:64] -> "
                f"{fused}.w13_weight[{local}:{local + 1}, 128:256, 0:64]",
                f"{p}.experts.{e}.w2.weight[0:64, 0:128] -> "
                f"{fused}.w2_weight[{local}:{local + 1}, 0:64, 0:128]"]), (r, e)
        assert rec.param_shapes[f"{fused}.w13_weight"] == (2, 256, 64)
    layouts = _layouts(recs, specs)
    assert str(layouts[f"{p}.experts.3.w2.weight"]) == \
        "Layout((64, 128) bfloat16 on mesh(tp=1)[1]: replicated)"
    assert layouts[f"{p}.experts.0.w1.weight"].regions(0) == (Region.of([(0, 128), (0, 64)]),)
    assert layouts[f"{p}.experts.0.w1.weight"].regions(1) == ()
    assert str(layouts["model.layers.0.self_attn.o_proj.weight"]) == \
        "Layout((64, 64) bfloat16 on mesh(tp=2)[0..1]: d1<-tp)"
    # every expert element is received by exactly one rank
    experts = [n for n in specs if ".experts." in n]
    assert sum(r.size for n in experts for k in range(2) for r in layouts[n].regions(k)) == \
        sum(math.prod(layouts[n].shape) for n in experts)


def test_mixtral_experts_land_in_fused_w13_and_w2():
    """Per-expert checkpoint tensors (w1 gate, w3 up, w2 down) -> FusedMoE w13/w2 slices.

    TP=2, no EP: every rank holds all 4 experts; w1/w3 rows and w2 columns are split at
    I/tp = 64 (docs/layouts.md §7, fused MoE).
    """
    cfg, p, specs = _tiny_mixtral_specs()
    vllm_config = xv.make_vllm_config(cfg, dtype="bfloat16")
    recs = {r: xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)}
    fused = f"{p}.experts.routed_experts"
    for r, rec in recs.items():
        rows = f"{64 * r}:{64 * r + 64}"
        got = {str(q) for e in range(4) for w in ("w1", "w2", "w3")
               for q in rec.pieces[f"{p}.experts.{e}.{w}.weight"]}
        want = set()
        for e in range(4):
            want |= {f"{p}.experts.{e}.w1.weight[{rows}, 0:64] -> "
                     f"{fused}.w13_weight[{e}:{e + 1}, 0:64, 0:64]",
                     f"{p}.experts.{e}.w3.weight[{rows}, 0:64] -> "
                     f"{fused}.w13_weight[{e}:{e + 1}, 64:128, 0:64]",
                     f"{p}.experts.{e}.w2.weight[0:64, {rows}] -> "
                     f"{fused}.w2_weight[{e}:{e + 1}, 0:64, 0:64]"}
        assert got == want, r
        assert [str(q) for q in rec.pieces[f"{p}.gate.weight"]] == [
            f"{p}.gate.weight[0:4, 0:64] -> {p}.gate.weight[0:4, 0:64]"]
    layouts = _layouts(recs, specs)
    assert str(layouts[f"{p}.experts.3.w3.weight"]) == \
        "Layout((128, 64) bfloat16 on mesh(tp=2)[0..1]: d0<-tp)"
    assert str(layouts[f"{p}.experts.3.w2.weight"]) == \
        "Layout((64, 128) bfloat16 on mesh(tp=2)[0..1]: d1<-tp)"


def test_shard_weight_refuses_regions_it_does_not_hold():
    full = torch.arange(48.0).reshape(8, 6)
    held = xv.shard_weight("x", (8, 6), [(Region.of([(0, 4), (0, 6)]), full[:4].clone())])
    w = torch.zeros(4, 6)
    w.copy_(held.narrow(0, 0, 4))
    assert torch.equal(w, full[:4])
    with pytest.raises(xv.RecordError, match="needs region \\[2:6, 0:6\\]"):
        w.copy_(held[2:6])


def test_checkpoint_specs_read_safetensors_headers(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"a.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
                                 "b": torch.zeros(2, dtype=torch.float32)},
                                str(tmp_path / "model.safetensors"))
    assert xv.checkpoint_specs(str(tmp_path)) == {"a.weight": ((3, 4), "bfloat16"),
                                                  "b": ((2,), "float32")}


def test_replicate_layout_stacks_engines_on_a_major_axis():
    """Several identical engines: product layouts gain a major "engine" axis, explicit ones
    (a padded vocab) are the union of each engine's relabelled regions."""
    shard = Layout.from_placements((8, 4), "bfloat16", Mesh((2,), axis_names=("tp",)),
                                      ["S0"])
    both = xv.replicate_layout(shard, [[10, 11], [20, 21]])
    assert str(both) == "Layout((8, 4) bfloat16 on mesh(engine=2,tp=2)[10,11,20,21]: d0<-tp)"
    for eng in ([10, 11], [20, 21]):
        assert [both.regions(r) for r in eng] == [shard.regions(0), shard.regions(1)]
    padded = Layout.explicit_form((6, 4), "bfloat16", {0: [[(0, 4), (0, 4)]],
                                                          1: [[(4, 6), (0, 4)]]})
    both = xv.replicate_layout(padded, [[10, 11], [20, 21]])
    assert both.regions(21) == padded.regions(1) and both.regions(10) == padded.regions(0)
    assert xv.replicate_layout(shard, [[5, 6]]).mesh == Mesh((2,), (5, 6), ("tp",))


# ---------------------------------------------------------------------------- digests

def _processed_qwen2(seed, monkeypatch=None, fallback=False):
    """The tiny Qwen2 (bf16) on CPU, loaded from random full tensors and processed by
    vLLM's own ``process_weights_after_loading`` - on this CPU's path, or (``fallback``)
    on the one an AVX2 CPU takes for bf16, where oneDNN refuses the matmul (and no AMX
    sgl kernel) so ``F.linear`` keeps multiplying the parameter. Returns (the processed
    model, the same weights loaded and left unprocessed)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import utils as vllm_utils
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    if fallback:
        def refuse(*args, **kwargs):
            raise RuntimeError("could not create a primitive descriptor (forced: AVX2 bf16)")
        monkeypatch.setattr(vllm_utils.ops, "create_onednn_mm", refuse)
        monkeypatch.setattr(vllm_utils, "check_cpu_sgl_kernel", lambda *a: False)
    cfg = _config("qwen2")
    vllm_config = xv.make_vllm_config(cfg, dtype="bfloat16")
    specs = xv.hf_tensor_specs(cfg, "bfloat16")
    gen = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, (s, _) in specs.items()}
    models = []
    with xv.fake_tp(0, 1), set_current_vllm_config(vllm_config):
        for _ in range(2):
            m = xv.build_model(vllm_config, device="cpu")
            m.load_weights(iter(full.items()))
            models.append(m)
        process_weights_after_loading(models[0], vllm_config.model_config, torch.device("cpu"))
    return models[0], models[1]


@pytest.mark.parametrize("fallback", [False, True], ids=["this-cpu", "avx2-bf16-fallback"])
def test_digest_sees_the_weights_cpu_kernels_compute_with(fallback, monkeypatch):
    """vLLM's CPU processing may move a linear weight into a prepacked kernel (oneDNN on
    AVX-512, sgl on AMX) and leave the parameter empty; the digest reads it back through
    the kernel, so it equals the loaded weights' hash on every path, and moves with them."""
    import hashlib

    processed, loaded = _processed_qwen2(0, monkeypatch, fallback)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    live = dict(processed.named_parameters())[qkv]
    if fallback:
        assert live.numel() > 0                # F.linear multiplies the parameter itself
    digest = xv.weights_digest(processed)
    want = {n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in loaded.state_dict().items()}
    assert digest == want
    # the read-back is the loaded weight itself, whatever the kernel holds
    module = processed.get_submodule(qkv.rpartition(".")[0])
    assert torch.equal(xv.gemm_weight(module), dict(loaded.named_parameters())[qkv])
    # other weights, other digests: no comparison is vacuous
    other = xv.weights_digest(_processed_qwen2(1, monkeypatch, fallback)[0])
    weights = dict(loaded.named_parameters())       # not the attention scales, rotary cache
    assert "lm_head.weight" in digest and qkv in weights
    assert sorted(n for n in weights if other[n] == digest[n]) == []


def test_digest_sees_a_replaced_weight_and_a_stale_prepacked_copy():
    """As vLLM does it: the parameter emptied and the weight held by the kernel only; and a
    stale kernel copy beside an up-to-date parameter (a tied head a reload did not re-process)."""
    import hashlib

    lin = torch.nn.Linear(6, 4, bias=False)
    w = lin.weight.detach().clone()
    lin.cpu_linear = lambda x, weight, bias, _w=w.clone(): torch.nn.functional.linear(x, _w, bias)
    lin.input_size_per_partition = 6
    lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    sha = hashlib.sha256(w.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    assert xv.weights_digest(lin) == {"weight": sha}
    lin.weight = torch.nn.Parameter(w + 1, requires_grad=False)     # the kernel kept w
    assert xv.weights_digest(lin)["weight"] != sha
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    assert xv.weights_digest(lin) == {"weight": sha}


def test_workers_exchange_recordings_as_json_not_pickle(monkeypatch):
    """The recording all-gather over vLLM's gloo CPU group moves JSON bytes (two ranks as
    threads on one store); pickling is made to fail to prove it is never used."""
    import datetime
    import pickle
    import threading

    import torch.distributed as dist

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "Pickler", no_pickle)
    store, out = dist.HashStore(), {}

    def run(rank):
        group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
        out[rank] = xv.allgather_json({"rank": rank, "text": "é" * (7 * rank)}, group)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = [{"rank": 0, "text": ""}, {"rank": 1, "text": "é" * 7}]
    assert out == {0: want, 1: want}


# ---------------------------------------------------------------------------- in place or reload

def _meta_model(cfg, tp_rank=0, tp_size=1, **kwargs):
    from vllm.config import set_current_vllm_config

    vllm_config = xv.make_vllm_config(cfg, dtype="bfloat16", tp_size=tp_size, **kwargs)
    with xv.fake_tp(tp_rank, tp_size), set_current_vllm_config(vllm_config):
        return vllm_config, xv.build_model(vllm_config)


def test_inplace_is_allowed_for_unquantized_dense_layers_on_cuda_only():
    """vLLM's own Qwen2 modules (built on meta): on CUDA every module's processing leaves
    the loaded weights as its kernels read them (linear, embedding, norms, attention); on
    CPU the linears and the embedding prepack, so in place is refused, naming each."""
    cfg = _config("qwen2")
    vllm_config, model = _meta_model(cfg)
    specs = xv.hf_tensor_specs(cfg, "bfloat16")
    rec = xv.record_from_config(vllm_config, 0, 1, specs)
    dest = xv.EngineRecording([rec], 0, specs)
    assert dest.inplace_refusals(model, "cuda") == []
    assert dest.fits_inplace(model, "cuda")
    refusals = dest.inplace_refusals(model, "cpu")
    assert "module 'model.layers.0.self_attn.qkv_proj' (QKVParallelLinear): quant method " \
        "UnquantizedLinearMethod is not known to leave loaded weights as its kernels read " \
        "them on cpu" in "\n".join(refusals)
    refused = {r.split("'")[1] for r in refusals}
    assert "model.embed_tokens" in refused and "model.layers.1.mlp.down_proj" in refused
    assert not any("norm" in m or m.endswith(".attn") for m in refused), refused


def test_inplace_refuses_moe_backends_that_convert_w13():
    """Unquantized fused MoE is in place only with a backend that uses w13/w2 as loaded
    (Triton); FlashInfer CUTLASS swaps w13's halves, the CPU kernel prepacks."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    cfg, p, specs = _tiny_mixtral_specs()
    _, model = _meta_model(cfg)
    experts = model.get_submodule(f"{p}.experts.routed_experts")
    method = experts.quant_method
    assert type(method).__name__ == "UnquantizedFusedMoEMethod"
    assert "backend CPU" in xv.inplace_refusal(experts, "cuda")
    method.unquantized_backend = UnquantizedMoeBackend.TRITON
    assert xv.inplace_refusal(experts, "cuda") is None
    assert xv.inplace_refusal(experts, "cpu") is not None
    method.unquantized_backend = UnquantizedMoeBackend.FLASHINFER_CUTLASS
    assert "backend FLASHINFER_CUTLASS: its processing converts w13/w2" in \
        xv.inplace_refusal(experts, "cuda")


def test_inplace_refuses_mla_attention_which_derives_from_kv_b_proj():
    """DeepSeek-V3's MLA (one dense layer, built on meta): kv_b_proj is a plain linear, but
    the attention derives W_UK/W_UV from it after loading - refused by the attention."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1,
        max_position_embeddings=256, n_group=1, topk_group=1)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    _, model = _meta_model(cfg)
    refused = {n: xv.inplace_refusal(m, "cuda") for n, m in model.named_modules()
               if xv.inplace_refusal(m, "cuda")}
    assert list(refused) == ["model.layers.0.self_attn.mla_attn.mla_attn"], refused
    assert "derives W_UK/W_UV from kv_b_proj" in refused[
        "model.layers.0.self_attn.mla_attn.mla_attn"]


# ---------------------------------------------------------------------------- streaming groups

def test_stream_groups_keep_modules_whole_and_fit_the_budget(recordings):
    """Groups for a streamed refit (Qwen2, TP=2): derived from the recordings alone, so
    every worker gets the same; every tensor once, in layerwise order; q/k/v (one
    qkv_proj) and gate/up never apart; each group's worst-worker cost within half the
    budget; a budget above the model gives one group."""
    from xreshard.dtypes import itemsize

    recs, specs = recordings
    ordered = [recs["qwen2", 2][r] for r in range(2)]
    dests = [xv.EngineRecording(ordered, w, specs["qwen2"]) for w in range(2)]
    budget = 96 << 10
    groups = dests[0].groups(budget)
    assert groups == dests[1].groups(budget)
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(dests[0].names) and len(flat) == len(set(flat))
    assert flat[0] == "model.embed_tokens.weight" and flat[-1] == "model.norm.weight"
    where = {n: i for i, g in enumerate(groups) for n in g}
    for layer in range(2):
        p = f"model.layers.{layer}."
        assert len({where[p + f"self_attn.{w}_proj.{k}"] for w in "qkv"
                    for k in ("weight", "bias")}) == 1
        assert where[p + "mlp.gate_proj.weight"] == where[p + "mlp.up_proj.weight"]
    for g in groups:
        for rec in ordered:
            params = {q.param for n in g for q in rec.pieces[n]}
            mods: dict = {}
            for q in params:
                mods[q.rpartition(".")[0]] = mods.get(q.rpartition(".")[0], 0) + \
                    math.prod(rec.param_shapes[q]) * itemsize(rec.param_dtypes[q])
            assert len(mods) == 1 or sum(mods.values()) + 2 * max(mods.values()) <= budget // 2
    assert len(groups) > 4
    assert dests[0].groups(1 << 30) == [flat]


def test_a_destination_is_placed_complete_with_its_world_rank(recordings):
    """Destination.place builds a worker's destination whole: its world rank and every
    tensor's layout over world ranks (two identical engines: a major engine axis, each
    engine's worker holding what the one engine's worker holds)."""
    recs, specs = recordings
    ordered = [recs["qwen2", 2][r] for r in range(2)]
    rec = xv.EngineRecording(ordered, 1, specs["qwen2"])
    one = xv.Destination.place(rec, [4, 5])
    assert one.rank == 5 and sorted(one.layouts) == sorted(rec.names)
    assert all(set(lay.ranks) <= {4, 5} for lay in one.layouts.values())
    two = xv.Destination.place(rec, [4, 5, 6, 7], engine=1)
    assert two.rank == 7 and two.shard_bytes() == one.shard_bytes() > 0
    for name, lay in two.layouts.items():
        assert lay.regions(7) == lay.regions(5) == one.layouts[name].regions(5), name
    with pytest.raises(xv.RecordError, match="not whole engines"):
        xv.Destination.place(rec, [4, 5, 6])
    with pytest.raises(xv.RecordError, match="no layout for"):
        xv.Destination(rec, {}, 5)
