"""LoRA adapters (xreshard.adapters.lora) and the regions each vLLM TP rank reads of them.

The regions come from running vLLM's own LoRA layers' slicing on index probes
(``read_regions``); here real vLLM layer classes are built for each TP rank in one process
(``fake_tp``) and the regions are compared with vLLM's slicing written out by hand
(docs/lora.md): column-parallel A whole and B's rows, qkv per sub-module with kv heads
replicated when tp > kv heads, row-parallel A's columns and B whole, and the
``fully_sharded_loras`` variants. The engine round trip is tests/test_vllm_lora.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from xreshard.adapters.lora import LoRAAdapter, LoRAError, merge_specs, write_peft_dir

R, MAX_RANK, HIDDEN, HEAD, HEADS, KV, INTER = 8, 16, 128, 32, 4, 2, 256


def _adapter(**kw):
    a = np.zeros((R, HIDDEN), np.float32)
    b = np.zeros((HIDDEN, R), np.float32)
    args = dict(name="p", lora_id=1, r=R, alpha=16,
                weights={"model.layers.0.self_attn.q_proj": (a, b)})
    args.update(kw)
    return LoRAAdapter(**args)


def test_adapter_names_shapes_and_config():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((HIDDEN, R)).astype(np.float32), \
        rng.standard_normal((R, 2 * HIDDEN)).astype(np.float32)
    ad = LoRAAdapter("policy", 3, R, 16, {"model.layers.1.mlp.up_proj": (a, b)},
                     kernel_layout=True)
    assert ad.shapes() == {
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": ((R, HIDDEN), "float32"),
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight": ((2 * HIDDEN, R), "float32")}
    spec = ad.spec()
    assert spec["lora_id"] == 3 and spec["config"]["r"] == R and spec["config"]["lora_alpha"] == 16
    assert spec["config"]["target_modules"] == ["up_proj"]
    assert json.loads(json.dumps(spec)) == spec
    assert ad.num_bytes() == (a.size + b.size) * 4


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -8, 0, True, "16"])
def test_alpha_must_be_a_finite_positive_number(alpha):
    with pytest.raises(LoRAError, match="alpha"):
        _adapter(alpha=alpha)
    assert _adapter(alpha=np.float32(8.0)).spec()["config"]["lora_alpha"] == 8.0


def test_write_peft_dir_writes_what_vllm_reads(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((HIDDEN, R)).astype(np.float32), \
        rng.standard_normal((R, HIDDEN)).astype(np.float32)
    ad = LoRAAdapter("p", 1, R, 16, {"model.layers.0.self_attn.o_proj": (a, b)},
                     kernel_layout=True)
    path = write_peft_dir(ad, str(tmp_path))
    got = load_file(os.path.join(path, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    assert torch.equal(got[prefix + ".lora_A.weight"], torch.from_numpy(a.T.copy()))
    assert torch.equal(got[prefix + ".lora_B.weight"], torch.from_numpy(b.T.copy()))
    with open(os.path.join(path, "adapter_config.json")) as f:
        assert json.load(f)["r"] == R


@pytest.mark.parametrize("kw,match", [
    (dict(r=4), "r=4"),
    (dict(name="a/b"), "free of '/'"),
    (dict(lora_id=0), "lora_id must be >= 1"),
    (dict(weights={"base_model.model.x.lora_A": (np.zeros((R, 4)), np.zeros((4, R)))}),
     "name modules as the base model does"),
    (dict(weights={"m": (np.zeros((R, 4), np.int32), np.zeros((4, R), np.float32))}),
     "LoRA factors are floats"),
    (dict(weights={"m": (np.zeros((R, 4), np.float32),)}), r"a pair \(A, B\)"),
])
def test_bad_adapters_are_refused_where_they_are_made(kw, match):
    with pytest.raises(LoRAError, match=match):
        _adapter(**kw)


def test_merge_specs_unions_processes_and_refuses_disagreement():
    one, two = _adapter(name="a", lora_id=1).spec(), _adapter(name="b", lora_id=2).spec()
    adapters, problems = merge_specs([[one], [two, one], []])
    assert [a["name"] for a in adapters] == ["a", "b"] and problems == []
    other = _adapter(name="a", lora_id=1, alpha=8).spec()
    _, problems = merge_specs([[one], [other]])
    assert problems and "describe adapter 'a' differently" in problems[0]
    _, problems = merge_specs([[one], [_adapter(name="c", lora_id=1).spec()]])
    assert problems and "both use lora_id 1" in problems[0]
    _, problems = merge_specs([[{"name": "x"}]])
    assert problems and "missing" in problems[0]


# ---------------------------------------------------------------------------- vLLM's slicing

def _layers(kind: str, rank: int, tp: int, full: bool):
    """A real vLLM LoRA layer of ``kind`` as TP rank ``rank`` of ``tp``, its weights on meta."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.lora import LoRAConfig
    from vllm.lora import layers as L
    from vllm.model_executor.layers import linear

    from xreshard.adapters.vllm import fake_tp

    cfg = LoRAConfig(max_lora_rank=MAX_RANK, max_loras=1, fully_sharded_loras=full,
                     lora_dtype=torch.float32)
    sharded = "Sharded" if full else ""
    with set_current_vllm_config(VllmConfig()), fake_tp(rank, tp):
        with torch.device("meta"):
            if kind == "qkv":
                base = linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV, bias=False)
                layer = getattr(L, f"MergedQKVParallelLinearWith{sharded}LoRA")(base)
            elif kind == "gate_up":
                base = linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False)
                layer = getattr(L, f"MergedColumnParallelLinearWith{sharded}LoRA")(base)
            elif kind == "column":
                base = linear.ColumnParallelLinear(HIDDEN, INTER, bias=False)
                layer = getattr(L, f"ColumnParallelLinearWith{sharded}LoRA")(base)
            else:
                base = linear.RowParallelLinear(INTER, HIDDEN, bias=False)
                layer = getattr(L, f"RowParallelLinearWith{sharded}LoRA")(base)
        layer.create_lora_weights(1, cfg)
    return layer


def _expected(kind: str, index, rank: int, tp: int, full: bool) -> tuple[list, list]:
    """vLLM 0.32's slicing, written out: ([A rows, A cols], [B rows, B cols]) per rank."""
    def part(n: int) -> list:
        return [rank * n // tp, (rank + 1) * n // tp]
    a_rows = [0, R]
    if full and kind != "row":     # S-LoRA: A's rank rows split by max_lora_rank / tp
        per = MAX_RANK // tp
        a_rows = [min(R, rank * per), min(R, (rank + 1) * per)]
    if kind == "row":
        b_rows = part(HIDDEN) if full else [0, HIDDEN]
        return [[0, R], part(INTER)], [b_rows, [0, R]]
    if kind == "qkv" and index > 0:    # k, v: kv heads replicated over tp // KV ranks
        reps = max(1, tp // KV)
        shard = max(1, KV // tp) * HEAD
        kv_id = rank // reps
        b_rows = [kv_id * shard, (kv_id + 1) * shard]
    else:
        b_rows = part({"qkv": HEADS * HEAD, "gate_up": INTER, "column": INTER}[kind])
    return [a_rows, [0, HIDDEN]], [b_rows, [0, R]]


@pytest.mark.parametrize("full", [False, True], ids=["lora", "fully_sharded"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "column", "row"])
def test_each_rank_reads_the_slice_vllm_slices(kind, tp, full):
    from xreshard.adapters.vllm import read_regions
    from xreshard.ir.layout import Region

    out_sizes = {"qkv": [HEADS * HEAD, KV * HEAD, KV * HEAD], "gate_up": [INTER, INTER],
                 "column": [INTER], "row": [HIDDEN]}[kind]
    in_size = INTER if kind == "row" else HIDDEN
    for rank in range(tp):
        layer = _layers(kind, rank, tp, full)
        for i, out in enumerate(out_sizes):
            index = i if kind in ("qkv", "gate_up") else None
            want_a, want_b = _expected(kind, i, rank, tp, full)
            if tp == 1:
                want_a, want_b = [[0, R], [0, in_size]], [[0, out], [0, R]]
            got_a = read_regions(layer, index, (R, in_size), "A")
            got_b = read_regions(layer, index, (out, R), "B")
            empty = want_a[0][0] == want_a[0][1]
            assert got_a == ([] if empty else [Region.of(want_a)]), (rank, i)
            assert got_b == [Region.of(want_b)], (rank, i)


def test_a_factor_that_does_not_fit_the_layer_is_refused():
    from xreshard.adapters.vllm import read_regions

    layer = _layers("row", 1, 2, False)     # rank 1 reads columns 128:256 of A
    with pytest.raises(LoRAError, match="does not fit the base layer"):
        read_regions(layer, None, (R, INTER - 2), "A")      # in = 254, not the base's 256
    with pytest.raises(LoRAError, match="does not fit the base layer"):
        read_regions(layer, None, (HIDDEN, 2 * MAX_RANK), "B")     # r above max_lora_rank
