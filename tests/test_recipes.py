"""Model inventories and recipes: who holds which region, checked by hand and by coverage."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

import xreshard as xr
from xreshard.catalog.models import MODELS_DIR, ModelError, load_model, list_models, to_stacked
from xreshard.catalog.recipes import FRAMEWORKS, Recipe, RecipeError, parse_recipe, recipe_layouts

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
MOE = ["deepseek_v3", "kimi_k2", "qwen3_235b_a22b", "qwen3_30b_a3b"]
DENSE = ["llama3_1_70b", "llama3_1_8b", "qwen2_5_0_5b"]
CFG = {"num_attention_heads": 4, "num_key_value_heads": 2}

# a 2-layer toy: embed, attention in layer 0, stacked experts in layer 1, head
TOY = [
    ("model.embed_tokens.weight", (8, 4), "bfloat16"),
    ("model.layers.0.self_attn.q_proj.weight", (8, 4), "bfloat16"),
    ("model.layers.0.self_attn.k_proj.weight", (4, 4), "bfloat16"),
    ("model.layers.0.self_attn.o_proj.weight", (4, 8), "bfloat16"),
    ("model.layers.0.input_layernorm.weight", (4,), "bfloat16"),
    ("model.layers.1.mlp.experts.gate_up_proj", (4, 8, 4), "bfloat16"),
    ("model.layers.1.mlp.experts.down_proj", (4, 4, 4), "bfloat16"),
    ("model.layers.1.mlp.gate.weight", (4, 4), "float32"),
    ("model.norm.weight", (4,), "bfloat16"),
    ("lm_head.weight", (8, 4), "bfloat16"),
]
# the same with 4 per-expert tensors per kind (expert e: gate, up, down)
TOY_PER_EXPERT = TOY[:5] + [
    (f"model.layers.1.mlp.experts.{e}.{kind}.weight", (4, 4), "bfloat16")
    for e in range(4) for kind in ("gate_proj", "up_proj", "down_proj")] + TOY[7:]


def held(layout: xr.Layout) -> dict[int, list[str]]:
    """rank -> its regions as strings, for ranks holding anything."""
    out = {}
    for r in layout.ranks:
        regions = [str(x) for x in layout.regions(r) if not x.is_empty]
        if regions:
            out[r] = regions
    return out


def assert_covers_exactly(layout: xr.Layout, name: str = "") -> int:
    """Every element is held by the same number (>= 1) of ranks, and no rank holds an
    element twice. Returns that replication count."""
    regions = {r: [x for x in layout.regions(r) if not x.is_empty] for r in layout.ranks}
    cuts = []
    for d, n in enumerate(layout.shape):
        b = {0, n}
        for rs in regions.values():
            for x in rs:
                b.update((x.starts[d], x.stops[d]))
        cuts.append(sorted(b))
    counts: dict[tuple, int] = {}
    for r, rs in regions.items():
        for i, x in enumerate(rs):
            for y in rs[i + 1:]:
                assert x.intersect(y) is None, f"{name}: rank {r} holds {x} and {y}"
            cells = [[j for j in range(len(c) - 1) if x.starts[d] <= c[j] and c[j + 1] <= x.stops[d]]
                     for d, c in enumerate(cuts)]
            for cell in _product(cells):
                counts[cell] = counts.get(cell, 0) + 1
    all_cells = list(_product([range(len(c) - 1) for c in cuts]))
    reps = {counts.get(cell, 0) for cell in all_cells}
    assert len(reps) == 1 and 0 not in reps, f"{name} {layout}: coverage counts {sorted(reps)}"
    volume = sum(x.size for rs in regions.values() for x in rs)
    assert volume == math.prod(layout.shape) * reps.copy().pop()
    return reps.pop()


def _product(lists):
    return itertools.product(*lists)


# ---------------------------------------------------------------------------- models

def test_packaged_models_are_listed_and_small():
    assert list_models() == sorted(MOE + DENSE)
    for f in MODELS_DIR.glob("*.json"):
        assert f.stat().st_size < 200_000, f          # per-expert lists are generated


@pytest.mark.parametrize("name", MOE)
def test_per_expert_generated_exactly_as_published(name):
    ref_path = SHARED / f"{name}.json"
    if not ref_path.is_file():
        pytest.skip(f"{ref_path} not available")
    ref = json.loads(ref_path.read_text())
    want = [(n, tuple(s), ref["dtype_overrides"].get(n, ref["dtype"])) for n, s in ref["params"]]
    model = load_model(name)
    assert model.layout == "per_expert"
    assert [tuple(p) for p in model.params] == want
    assert model.num_tensors == ref["num_tensors"]
    assert model.total_params == ref["total_params"]
    assert model.total_bytes == ref["total_bytes"]


@pytest.mark.parametrize("name", MOE)
def test_stacked_and_round_trip(name):
    stacked = load_model(name, "stacked")
    data = json.loads((MODELS_DIR / f"{name}_stacked.json").read_text())
    assert stacked.layout == "stacked" and stacked.num_tensors == data["num_tensors"]
    assert to_stacked(load_model(name).params) == stacked.params
    assert load_model(f"{name}_stacked", "stacked") is stacked       # cached, same object


def test_dtype_overrides_and_config():
    m = load_model("deepseek_v3")
    dtypes = {p.name: p.dtype for p in m.params}
    assert dtypes["model.layers.3.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtypes["model.layers.3.mlp.experts.7.up_proj.weight"] == "bfloat16"
    assert m.config["n_routed_experts"] == 256
    gate = [p for p in m.params if p.name == "model.layers.3.mlp.experts.255.down_proj.weight"]
    assert gate[0].shape == (7168, 2048)


def test_dense_models_ignore_layout_and_load_from_path(tmp_path):
    a = load_model("qwen2_5_0_5b", "stacked")
    assert a.layout == "dense" and a.num_tensors == 290 and "lm_head.weight" not in dict(
        (p.name, 1) for p in a.params)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model": "Tiny", "dtype": "float32", "params": [
        ["model.layers.0.mlp.experts.gate_up_proj", [2, 6, 4]],
        ["model.layers.0.mlp.experts.down_proj", [2, 4, 3]],
        ["model.norm.weight", [4]]], "dtype_overrides": {"model.norm.weight": "bfloat16"}}))
    m = load_model(str(path))
    assert [tuple(p) for p in m.params] == [
        ("model.layers.0.mlp.experts.0.gate_proj.weight", (3, 4), "float32"),
        ("model.layers.0.mlp.experts.0.up_proj.weight", (3, 4), "float32"),
        ("model.layers.0.mlp.experts.0.down_proj.weight", (4, 3), "float32"),
        ("model.layers.0.mlp.experts.1.gate_proj.weight", (3, 4), "float32"),
        ("model.layers.0.mlp.experts.1.up_proj.weight", (3, 4), "float32"),
        ("model.layers.0.mlp.experts.1.down_proj.weight", (4, 3), "float32"),
        ("model.norm.weight", (4,), "bfloat16")]
    assert m.name == "Tiny" and m.layout == "per_expert"


def test_model_errors():
    with pytest.raises(ModelError, match=r"unknown model 'gpt5'; packaged models are deepseek_v3"):
        load_model("gpt5")
    with pytest.raises(ModelError, match=r"model file '/nope.json' does not exist"):
        load_model("/nope.json")
    with pytest.raises(ModelError, match=r"layout 'fused' is not one of per_expert, stacked"):
        load_model("deepseek_v3", "fused")


# ---------------------------------------------------------------------------- recipe strings

def test_parse_defaults_and_canonical_string():
    r = parse_recipe("megatron:pp=4,ep=16,dp=2")
    assert r.sizes == (("pp", 4), ("dp", 2), ("ep", 16), ("tp", 1)) and r.world_size == 128
    assert str(r) == "megatron:pp=4,dp=2,ep=16,tp=1"
    assert parse_recipe(" VLLM : tp=8 , dp=16 ") == Recipe("vllm", (("dp", 16), ("tp", 8)))
    assert parse_recipe("fsdp").world_size == 1
    assert parse_recipe("jax:fsdp=4,tp=2").mesh(10).ranks == tuple(range(10, 18))
    assert parse_recipe(r) is r


@pytest.mark.parametrize("text, message", [
    ("tpu:tp=8", r"recipe 'tpu:tp=8': unknown framework 'tpu'; expected one of fsdp, jax, "
                 r"megatron, vllm, e\.g\. 'megatron:pp=4,ep=16,dp=2,tp=1'"),
    ("vllm:tp8", r"recipe 'vllm:tp8': entry 'tp8' is not axis=size; write e\.g\. "
                 r"'vllm:tp=8,dp=16'"),
    ("vllm:tp=8,ep=2", r"recipe 'vllm:tp=8,ep=2': vllm has no axis 'ep'; its axes are dp, tp"),
    ("fsdp:dp=0", r"recipe 'fsdp:dp=0': dp='0' is not a positive integer"),
    ("fsdp:dp=two", r"recipe 'fsdp:dp=two': dp='two' is not a positive integer"),
    ("jax:tp=2,tp=4", r"recipe 'jax:tp=2,tp=4': axis 'tp' is given twice"),
])
def test_bad_recipe_strings(text, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(text)
    assert issubclass(RecipeError, ValueError)


# ---------------------------------------------------------------------------- by hand

def test_megatron_by_hand():
    # mesh (pp=2, dp=1, ep=2, tp=2) from rank 10: stage 0 = 10..13, stage 1 = 14..17
    L = recipe_layouts(TOY, "megatron:pp=2,ep=2,tp=2", 10, config=CFG)
    # rank | (pp,ep,tp) | embed rows  (vocab-parallel, replicated over ep)
    assert held(L["model.embed_tokens.weight"]) == {
        10: ["[0:4, 0:4]"], 11: ["[4:8, 0:4]"], 12: ["[0:4, 0:4]"], 13: ["[4:8, 0:4]"]}
    assert held(L["model.layers.0.self_attn.o_proj.weight"]) == {
        10: ["[0:4, 0:4]"], 11: ["[0:4, 4:8]"], 12: ["[0:4, 0:4]"], 13: ["[0:4, 4:8]"]}
    assert held(L["model.layers.0.input_layernorm.weight"]) == {r: ["[0:4]"] for r in range(10, 14)}
    # layer 1 on stage 1: experts over ep on dim 0, gate and up rows each over tp
    assert held(L["model.layers.1.mlp.experts.gate_up_proj"]) == {
        14: ["[0:2, 0:2, 0:4]", "[0:2, 4:6, 0:4]"], 15: ["[0:2, 2:4, 0:4]", "[0:2, 6:8, 0:4]"],
        16: ["[2:4, 0:2, 0:4]", "[2:4, 4:6, 0:4]"], 17: ["[2:4, 2:4, 0:4]", "[2:4, 6:8, 0:4]"]}
    assert held(L["model.layers.1.mlp.experts.down_proj"]) == {
        14: ["[0:2, 0:4, 0:2]"], 15: ["[0:2, 0:4, 2:4]"],
        16: ["[2:4, 0:4, 0:2]"], 17: ["[2:4, 0:4, 2:4]"]}
    assert held(L["model.layers.1.mlp.gate.weight"]) == {r: ["[0:4, 0:4]"] for r in range(14, 18)}
    assert held(L["lm_head.weight"]) == {
        14: ["[0:4, 0:4]"], 15: ["[4:8, 0:4]"], 16: ["[0:4, 0:4]"], 17: ["[4:8, 0:4]"]}
    assert set(held(L["model.norm.weight"])) == set(range(14, 18))


def test_megatron_per_expert_by_hand():
    # mesh (pp=2, dp=2, ep=2, tp=1): stage 1 = ranks 4..7; (dp, ep) -> 4:(0,0) 5:(0,1) 6:(1,0) 7:(1,1)
    L = recipe_layouts(TOY_PER_EXPERT, "megatron:pp=2,dp=2,ep=2", 0, config=CFG)
    # expert e on ep rank e // 2, replicated over dp
    for e, ranks in [(0, [4, 6]), (1, [4, 6]), (2, [5, 7]), (3, [5, 7])]:
        for kind in ("gate_proj", "up_proj", "down_proj"):
            assert held(L[f"model.layers.1.mlp.experts.{e}.{kind}.weight"]) == {
                r: ["[0:4, 0:4]"] for r in ranks}
    # dense parameters: replicated over dp and ep of their stage
    assert set(held(L["model.layers.1.mlp.gate.weight"])) == {4, 5, 6, 7}
    assert set(held(L["model.embed_tokens.weight"])) == {0, 1, 2, 3}
    # per-expert with tp: sharded like the dense counterpart, on the expert's ranks only
    L = recipe_layouts(TOY_PER_EXPERT, "megatron:ep=2,tp=2", 0, config=CFG)
    assert held(L["model.layers.1.mlp.experts.3.gate_proj.weight"]) == {
        2: ["[0:2, 0:4]"], 3: ["[2:4, 0:4]"]}
    assert held(L["model.layers.1.mlp.experts.0.down_proj.weight"]) == {
        0: ["[0:4, 0:2]"], 1: ["[0:4, 2:4]"]}


def test_megatron_pipeline_stages_real_model():
    m = load_model("deepseek_v3")
    L = recipe_layouts(m, "megatron:pp=4,ep=16,dp=2", 0)
    stage = {n: min(l.ranks) // 32 for n, l in L.items()}
    # 61 layers over 4 stages: layer i on stage i*4//61 -> 16, 15, 15, 15 layers
    assert [sum(1 for i in range(61) if stage[f"model.layers.{i}.input_layernorm.weight"] == s)
            for s in range(4)] == [16, 15, 15, 15]
    assert stage["model.embed_tokens.weight"] == 0
    assert stage["lm_head.weight"] == stage["model.norm.weight"] == 3
    # expert 17 of layer 20 (stage 1): ep rank 17 // 16 = 1, dp 0 and 1 -> ranks 32+1, 32+17
    assert L["model.layers.20.mlp.experts.17.up_proj.weight"].ranks == (33, 49)
    assert len(L["model.layers.20.self_attn.q_b_proj.weight"].ranks) == 32


def test_megatron_tied_embedding_on_first_and_last_stage():
    L = recipe_layouts(load_model("qwen2_5_0_5b"), "megatron:pp=2,tp=2", 0)
    assert held(L["model.embed_tokens.weight"]) == {
        0: ["[0:75968, 0:896]"], 1: ["[75968:151936, 0:896]"],
        2: ["[0:75968, 0:896]"], 3: ["[75968:151936, 0:896]"]}
    assert L["model.norm.weight"].ranks == (2, 3)


def test_vllm_by_hand_with_kv_head_replication():
    # mesh (dp=2, tp=4) from 0; 2 kv heads of 2 rows: tp ranks (0,1) hold head 0, (2,3) head 1
    L = recipe_layouts(TOY, "vllm:tp=4,dp=2", 0, config=CFG)
    assert held(L["model.layers.0.self_attn.k_proj.weight"]) == {
        0: ["[0:2, 0:4]"], 1: ["[0:2, 0:4]"], 2: ["[2:4, 0:4]"], 3: ["[2:4, 0:4]"],
        4: ["[0:2, 0:4]"], 5: ["[0:2, 0:4]"], 6: ["[2:4, 0:4]"], 7: ["[2:4, 0:4]"]}
    assert held(L["model.layers.0.self_attn.q_proj.weight"])[5] == ["[2:4, 0:4]"]
    assert held(L["model.layers.0.self_attn.o_proj.weight"])[6] == ["[0:4, 4:6]"]
    # vLLM pads the 8-row vocab to 64 and splits that evenly: tp rank 0 holds every row
    assert held(L["lm_head.weight"]) == {0: ["[0:8, 0:4]"], 4: ["[0:8, 0:4]"]}
    assert held(L["model.layers.1.mlp.experts.gate_up_proj"])[1] == [
        "[0:4, 1:2, 0:4]", "[0:4, 5:6, 0:4]"]                       # gate row 1, up row 1
    assert held(L["model.layers.1.mlp.experts.down_proj"])[3] == ["[0:4, 0:4, 3:4]"]
    assert held(L["model.layers.1.mlp.gate.weight"]) == {r: ["[0:4, 0:4]"] for r in range(8)}
    # per-expert: every expert on every tp rank, gate/up rows and down columns split
    L = recipe_layouts(TOY_PER_EXPERT, "vllm:tp=2", 0, config=CFG)
    assert held(L["model.layers.1.mlp.experts.3.up_proj.weight"]) == {
        0: ["[0:2, 0:4]"], 1: ["[2:4, 0:4]"]}
    assert held(L["model.layers.1.mlp.experts.3.down_proj.weight"]) == {
        0: ["[0:4, 0:2]"], 1: ["[0:4, 2:4]"]}
    # a single kv head (MQA) is replicated on every tp rank
    L = recipe_layouts(TOY, "vllm:tp=4", 0, config={"num_key_value_heads": 1})
    assert held(L["model.layers.0.self_attn.k_proj.weight"]) == {
        r: ["[0:4, 0:4]"] for r in range(4)}


@pytest.mark.parametrize("vocab,tp", [(32001, 2), (151655, 4), (1000, 8), (129280, 8)])
def test_vllm_vocab_is_padded_as_vllm_pads_it(vocab, tp):
    # the rows each tp rank of a VocabParallelEmbedding / ParallelLMHead holds, from vLLM's
    # own functions (pad to a multiple of 64, split evenly), clipped to the real vocab
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size, vocab_range_from_global_vocab_size)
    params = [("model.embed_tokens.weight", (vocab, 16), "bfloat16")]
    L = recipe_layouts(params, f"vllm:tp={tp}", 0)["model.embed_tokens.weight"]
    padded = pad_vocab_size(vocab, DEFAULT_VOCAB_PADDING_SIZE)
    for t in range(tp):
        lo, hi = vocab_range_from_global_vocab_size(padded, t, tp)
        want = [f"[{min(lo, vocab)}:{min(hi, vocab)}, 0:16]"] if lo < vocab else []
        assert held(L).get(t, []) == want
    assert sum(reg.size for r in L.ranks for reg in L.regions(r)) == vocab * 16


def test_vllm_vocab_padding_that_tp_does_not_divide():
    params = [("lm_head.weight", (32001, 16), "bfloat16")]
    with pytest.raises(RecipeError, match="padded to 32064 .* does not split evenly over "
                                          "tp=7"):
        recipe_layouts(params, "vllm:tp=7", 0)


def test_fsdp_tp_strided_by_hand():
    # mesh (rep=1, dp=2, tp=2): dim 0 sharded by TP, then FSDP inside each TP block
    # (_StridedShard(0, 2), Shard(0)) - docs/layouts.md §4.4: ranks 0,1,2,3 rows 0-1, 4-5, 2-3, 6-7
    L = recipe_layouts(TOY, "fsdp:dp=2,tp=2", 0, config=CFG)
    q = L["model.layers.0.self_attn.q_proj.weight"]
    assert [str(s) for s in q.splits] == ["SS(0,2)", "S(0)"]
    assert held(q) == {0: ["[0:2, 0:4]"], 1: ["[4:6, 0:4]"], 2: ["[2:4, 0:4]"], 3: ["[6:8, 0:4]"]}
    # row-parallel: FSDP on dim 0, TP on dim 1
    assert held(L["model.layers.0.self_attn.o_proj.weight"]) == {
        0: ["[0:2, 0:4]"], 1: ["[0:2, 4:8]"], 2: ["[2:4, 0:4]"], 3: ["[2:4, 4:8]"]}
    assert held(L["model.norm.weight"]) == {0: ["[0:2]"], 1: ["[0:2]"], 2: ["[2:4]"], 3: ["[2:4]"]}
    # uneven dims follow torch.chunk: 4 rows over dp=3 -> 2, 2, 0
    L = recipe_layouts(TOY, "fsdp:dp=3", 0)
    assert held(L["model.norm.weight"]) == {0: ["[0:2]"], 1: ["[2:4]"]}
    # HSDP: replicas of the FSDP layout on rep
    L = recipe_layouts(TOY, "fsdp:rep=2,dp=2", 0)
    assert held(L["model.norm.weight"]) == {0: ["[0:2]"], 1: ["[2:4]"], 2: ["[0:2]"], 3: ["[2:4]"]}


def test_jax_by_hand_and_uneven_fallback(caplog):
    L = recipe_layouts(TOY, "jax:fsdp=2,tp=2", 0)
    # mesh (dp=1, fsdp=2, tp=2): rank = 2*fsdp + tp; q_proj P("tp", "fsdp")
    assert held(L["model.layers.0.self_attn.q_proj.weight"]) == {
        0: ["[0:4, 0:2]"], 1: ["[4:8, 0:2]"], 2: ["[0:4, 2:4]"], 3: ["[4:8, 2:4]"]}
    assert held(L["model.layers.0.self_attn.o_proj.weight"]) == {       # P("fsdp", "tp")
        0: ["[0:2, 0:4]"], 1: ["[0:2, 4:8]"], 2: ["[2:4, 0:4]"], 3: ["[2:4, 4:8]"]}
    assert held(L["model.layers.1.mlp.experts.gate_up_proj"])[3] == ["[0:4, 4:8, 2:4]"]
    assert held(L["model.norm.weight"]) == {r: ["[0:4]"] for r in range(4)}
    # 8 rows over tp=3 do not divide: that dim is replicated, fsdp still splits dim 1
    notes: list[str] = []
    with caplog.at_level("INFO", logger="xreshard.catalog.recipes"):
        L = recipe_layouts(TOY, "jax:fsdp=2,tp=3", 0, notes=notes)
    assert "replicated instead" in caplog.text
    # said once, for a terminal: how many tensors, which dims
    assert len(notes) == 1 and "replicated instead" in notes[0]
    assert "'model.layers.0.self_attn.q_proj.weight' dim 0 (8) over tp=3" in notes[0]
    q = L["model.layers.0.self_attn.q_proj.weight"]
    assert q.dim_axes(0) == () and held(q)[5] == ["[0:8, 2:4]"]


def test_jax_layouts_match_named_sharding():
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec as P
    import numpy as np
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX devices")
    mesh = JaxMesh(np.array(jax.devices()[:8]).reshape(1, 4, 2), ("dp", "fsdp", "tp"))
    seen = set()
    for name, layout in recipe_layouts(load_model("qwen3_30b_a3b", "stacked"),
                                       "jax:fsdp=4,tp=2", 0).items():
        if layout in seen:
            continue
        seen.add(layout)
        spec = P(*(tuple(layout.mesh.axis_names[a] for a in layout.dim_axes(d)) or None
                   for d in range(layout.ndim)))
        index = NamedSharding(mesh, spec).devices_indices_map(layout.shape)
        for pos, device in enumerate(mesh.devices.flat):
            want = tuple((s.start or 0, n if s.stop is None else s.stop)
                         for s, n in zip(index[device], layout.shape))
            (region,) = layout.regions(pos)
            assert tuple(zip(region.starts, region.stops)) == want, (name, pos)


# ---------------------------------------------------------------------------- coverage

RECIPES = {
    "qwen2_5_0_5b": ["megatron:pp=3,dp=2,tp=2", "vllm:tp=2,dp=3", "fsdp:dp=3,tp=2",
                     "fsdp:rep=2,dp=5", "jax:fsdp=4,tp=2"],
    "qwen3_30b_a3b": ["megatron:pp=2,ep=4,dp=2,tp=2", "vllm:tp=8,dp=2", "fsdp:dp=3,tp=4",
                      "jax:dp=2,fsdp=3,tp=4"],
    "deepseek_v3": ["megatron:pp=4,ep=8,tp=2", "vllm:tp=16", "fsdp:dp=6,tp=2",
                    "jax:fsdp=8,tp=4"],
}


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("model_name, recipe", [(m, r) for m, rs in RECIPES.items() for r in rs])
def test_every_recipe_covers_every_tensor_exactly(model_name, recipe, layout):
    model = load_model(model_name, layout)
    r = parse_recipe(recipe)
    L = recipe_layouts(model, r, 7)
    assert list(L) == [p.name for p in model.params]
    distinct = {id(x): x for x in L.values()}
    assert len(distinct) < 300                       # cached: identical layouts shared
    for name, layout_ in L.items():
        if distinct.pop(id(layout_), None) is None:
            continue                                 # checked already
        assert all(7 <= rk < 7 + r.world_size for rk in layout_.ranks), name
        assert_covers_exactly(layout_, name)
    if r.framework != "megatron":                    # one mesh (two with kv replication)
        assert len({x.mesh for x in L.values()}) <= 2


def test_replication_counts_real_model():
    m = load_model("qwen3_30b_a3b")
    L = recipe_layouts(m, "megatron:pp=2,ep=4,dp=2,tp=2", 0)
    assert assert_covers_exactly(L["model.layers.0.mlp.experts.5.gate_proj.weight"]) == 2  # dp
    assert assert_covers_exactly(L["model.layers.0.self_attn.q_proj.weight"]) == 8  # dp*ep
    assert assert_covers_exactly(L["model.layers.0.input_layernorm.weight"]) == 16
    L = recipe_layouts(m, "vllm:tp=8,dp=2", 0)
    assert assert_covers_exactly(L["model.layers.0.self_attn.k_proj.weight"]) == 4  # 2 x dp


def test_same_layout_same_object():
    L = recipe_layouts(load_model("deepseek_v3"), "vllm:tp=8,dp=16", 128)
    a = L["model.layers.10.mlp.experts.3.gate_proj.weight"]
    assert a is L["model.layers.40.mlp.experts.200.up_proj.weight"]
    assert a.mesh is L["model.layers.0.self_attn.o_proj.weight"].mesh
    assert len({id(x) for x in L.values()}) == len(set(L.values()))


# ---------------------------------------------------------------------------- model checks

@pytest.mark.parametrize("model_name, recipe, message", [
    ("qwen2_5_0_5b", "vllm:tp=4", r"vllm:dp=1,tp=4: num_attention_heads 14 % tp 4 != 0; vllm "
                                  r"splits attention heads evenly over tp - choose a tp dividing 14"),
    ("qwen3_30b_a3b", "megatron:tp=8", r"megatron:pp=1,dp=1,ep=1,tp=8: num_key_value_heads 4 % "
                                       r"tp 8 != 0; Megatron splits query groups evenly"),
    ("deepseek_v3", "megatron:ep=3", r"layer 3 has 256 routed experts, not divisible by ep 3"),
    ("llama3_1_8b", "megatron:pp=33", r"33 pipeline stages but the model has 32 layers; use "
                                      r"pp <= 32"),
])
def test_recipe_the_model_cannot_use(model_name, recipe, message):
    with pytest.raises(RecipeError, match=message):
        recipe_layouts(load_model(model_name), recipe)


def test_vllm_kv_heads_and_tp_must_nest():
    recipe_layouts(load_model("llama3_1_8b"), "vllm:tp=16")         # 8 kv heads, 2 replicas
    with pytest.raises(RecipeError, match=r"vllm:dp=1,tp=6: num_key_value_heads 8 and tp 6: "
                                          r"vLLM needs one to divide the other"):
        recipe_layouts(TOY, "vllm:tp=6", config={"num_attention_heads": 12,
                                                  "num_key_value_heads": 8})


def test_uneven_split_and_unknown_tensor():
    with pytest.raises(RecipeError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' dim 0 "
                                          r"\(size 6\) does not split evenly 4 ways over 'tp'"):
        recipe_layouts([("model.layers.0.mlp.up_proj.weight", (6, 4), "float32")], "vllm:tp=4")
    with pytest.raises(RecipeError, match=r"no recipe rule matches tensor "
                                          r"'model.layers.0.mlp.fc9.weight' \(searched as "
                                          r"'model.layers.N.mlp.fc9.weight'\); add a"):
        recipe_layouts([("model.layers.0.mlp.fc9.weight", (6, 4), "float32")], "fsdp:dp=2")


# ---------------------------------------------------------------------------- speed

def test_kimi_k2_layouts_build_for_every_tensor():
    # how fast is benchmarks/bench_plan.py's business ("layouts, both sides" column)
    model = load_model("kimi_k2")
    src = recipe_layouts(model, "megatron:pp=16,ep=64", 0)
    dst = recipe_layouts(model, "vllm:tp=16,dp=64", 1024)
    assert len(src) == len(dst) == 69_975
    assert src.keys() == dst.keys()


def test_frameworks_table_is_complete():
    roles = set(FRAMEWORKS["vllm"].table)
    for fw in FRAMEWORKS.values():
        assert set(fw.table) == roles, fw.name
        parse_recipe(fw.example)
