"""Trainer -> HF name and transform rules (adapters/naming.py): bit-exact numpy views."""

import itertools

import numpy as np
import pytest

from xreshard.adapters.naming import (HF_IDENTITY, JAX_LLAMA, ConcatRule, NameMap, NamingError,
                                      Reshape, Rule, ShardedView, Split, StridedView, Transpose,
                                      flatten_tree, hf_stacked_experts_rules, jax_llama_rules,
                                      jax_moe_rules)
from xreshard.ir.layout import Layout, Mesh, Region

D, H, KV, HD, I, V, L, E = 8, 4, 2, 3, 10, 16, 2, 3


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _layer(rng, bias=False):
    attn = {"q": {"kernel": _rand(rng, D, H, HD)}, "k": {"kernel": _rand(rng, D, KV, HD)},
            "v": {"kernel": _rand(rng, D, KV, HD)}, "o": {"kernel": _rand(rng, H, HD, D)}}
    if bias:
        attn["q"]["bias"], attn["k"]["bias"], attn["v"]["bias"] = (
            _rand(rng, H, HD), _rand(rng, KV, HD), _rand(rng, KV, HD))
    return {"attn": attn,
            "mlp": {"gate": {"kernel": _rand(rng, D, I)}, "up": {"kernel": _rand(rng, D, I)},
                    "down": {"kernel": _rand(rng, I, D)}},
            "input_norm": {"scale": _rand(rng, D)}, "post_attn_norm": {"scale": _rand(rng, D)}}


def _tree(rng, bias=False):
    return {"embed": {"embedding": _rand(rng, V, D)}, "final_norm": {"scale": _rand(rng, D)},
            "lm_head": {"kernel": _rand(rng, D, V)},
            "layers": [_layer(rng, bias) for _ in range(L)]}


def _hf_by_hand(tree):
    """The HF state dict built with explicit numpy reshapes and transposes (copies)."""
    out = {"model.embed_tokens.weight": tree["embed"]["embedding"].copy(),
           "model.norm.weight": tree["final_norm"]["scale"].copy(),
           "lm_head.weight": np.ascontiguousarray(tree["lm_head"]["kernel"].T)}
    for i, lay in enumerate(tree["layers"]):
        p = f"model.layers.{i}"
        a, m = lay["attn"], lay["mlp"]
        out[f"{p}.self_attn.q_proj.weight"] = a["q"]["kernel"].reshape(D, H * HD).T.copy()
        out[f"{p}.self_attn.k_proj.weight"] = a["k"]["kernel"].reshape(D, KV * HD).T.copy()
        out[f"{p}.self_attn.v_proj.weight"] = a["v"]["kernel"].reshape(D, KV * HD).T.copy()
        out[f"{p}.self_attn.o_proj.weight"] = a["o"]["kernel"].reshape(H * HD, D).T.copy()
        for n in ("q", "k", "v"):
            if "bias" in a[n]:
                out[f"{p}.self_attn.{n}_proj.bias"] = a[n]["bias"].reshape(-1).copy()
        out[f"{p}.mlp.gate_proj.weight"] = m["gate"]["kernel"].T.copy()
        out[f"{p}.mlp.up_proj.weight"] = m["up"]["kernel"].T.copy()
        out[f"{p}.mlp.down_proj.weight"] = m["down"]["kernel"].T.copy()
        out[f"{p}.input_layernorm.weight"] = lay["input_norm"]["scale"].copy()
        out[f"{p}.post_attention_layernorm.weight"] = lay["post_attn_norm"]["scale"].copy()
    return out


def _check(hf_tensors, arrays, expected, rng, *, zero_copy=True):
    assert sorted(hf_tensors) == sorted(expected)
    for name, ref in expected.items():
        t = hf_tensors[name]
        assert t.shape == ref.shape, name
        got = t.view(arrays)
        assert got.dtype == ref.dtype and np.array_equal(got, ref), name
        if zero_copy and len(t.sources) == 1:
            assert np.shares_memory(got, arrays[t.sources[0].name]), name
        for _ in range(4):                       # random regions, bit-exact
            bounds = [sorted(rng.integers(0, n + 1, 2)) for n in ref.shape]
            region = Region.of(bounds)
            assert np.array_equal(t.view(arrays, region), ref[region.slices()]), (name, region)


def test_jax_llama_per_layer_views_equal_hand_built_hf_tensors():
    rng = np.random.default_rng(0)
    tree = _tree(rng)
    flat = flatten_tree(tree)
    assert "layers/1/attn/q/kernel" in flat
    hf = NameMap(JAX_LLAMA).apply({k: v.shape for k, v in flat.items()})
    _check(hf, flat, _hf_by_hand(tree), rng)


def test_jax_llama_scanned_layers_unstack_the_leading_axis():
    rng = np.random.default_rng(1)
    tree = _tree(rng, bias=True)
    stacked = {"embed": tree["embed"], "final_norm": tree["final_norm"],
               "layers": {}}
    for path in flatten_tree(tree["layers"][0]):
        arr = np.stack([flatten_tree(lay)[path] for lay in tree["layers"]])
        stacked["layers"][path] = arr
    flat = {("layers/" + k if not k.startswith(("embed", "final")) else k): v
            for k, v in flatten_tree({"embed": stacked["embed"],
                                      "final_norm": stacked["final_norm"]}).items()}
    flat.update({f"layers/{k}": v for k, v in stacked["layers"].items()})
    rules = jax_llama_rules(scanned=True, qkv_bias=True, tied=True)
    hf = NameMap(rules).apply({k: v.shape for k, v in flat.items()})
    expected = _hf_by_hand(tree)
    del expected["lm_head.weight"]
    _check(hf, flat, expected, rng)


def test_fused_qkv_and_gate_up_split_into_hf_tensors():
    rng = np.random.default_rng(2)
    tree = _tree(rng, bias=True)
    flat = {}
    for k, v in flatten_tree({"embed": tree["embed"], "final_norm": tree["final_norm"],
                              "lm_head": tree["lm_head"]}).items():
        flat[k] = v
    for i, lay in enumerate(tree["layers"]):
        a, m = lay["attn"], lay["mlp"]
        flat[f"layers/{i}/attn/qkv/kernel"] = np.concatenate(
            [a["q"]["kernel"], a["k"]["kernel"], a["v"]["kernel"]], axis=1)
        flat[f"layers/{i}/attn/qkv/bias"] = np.concatenate(
            [a["q"]["bias"], a["k"]["bias"], a["v"]["bias"]], axis=0)
        flat[f"layers/{i}/attn/o/kernel"] = a["o"]["kernel"]
        flat[f"layers/{i}/mlp/gate_up/kernel"] = np.concatenate(
            [m["gate"]["kernel"], m["up"]["kernel"]], axis=1)
        flat[f"layers/{i}/mlp/down/kernel"] = m["down"]["kernel"]
        flat[f"layers/{i}/input_norm/scale"] = lay["input_norm"]["scale"]
        flat[f"layers/{i}/post_attn_norm/scale"] = lay["post_attn_norm"]["scale"]
    nm = NameMap(jax_llama_rules(fused=True, qkv_bias=True),
                 params={"num_heads": H, "num_kv_heads": KV, "intermediate": I})
    hf = nm.apply({k: v.shape for k, v in flat.items()})
    _check(hf, flat, _hf_by_hand(tree), rng)
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert q.sources[0].name == "layers/0/attn/qkv/kernel"


def test_stacked_experts_unstack_to_per_expert_hf_names():
    rng = np.random.default_rng(3)
    flat = {"layers/0/moe/router/kernel": _rand(rng, D, E),
            "layers/0/moe/gate/kernel": _rand(rng, E, D, I),
            "layers/0/moe/up/kernel": _rand(rng, E, D, I),
            "layers/0/moe/down/kernel": _rand(rng, E, I, D)}
    hf = NameMap(jax_moe_rules()).apply({k: v.shape for k, v in flat.items()})
    p = "model.layers.0.mlp"
    expected = {f"{p}.gate.weight": flat["layers/0/moe/router/kernel"].T.copy()}
    for e in range(E):
        expected[f"{p}.experts.{e}.gate_proj.weight"] = flat["layers/0/moe/gate/kernel"][e].T.copy()
        expected[f"{p}.experts.{e}.up_proj.weight"] = flat["layers/0/moe/up/kernel"][e].T.copy()
        expected[f"{p}.experts.{e}.down_proj.weight"] = flat["layers/0/moe/down/kernel"][e].T.copy()
    _check(hf, flat, expected, rng)


def test_per_expert_hf_checkpoint_to_stacked_experts_concat():
    rng = np.random.default_rng(4)
    p = "model.layers.0.mlp.experts"
    flat = {}
    for e in range(E):
        flat[f"{p}.{e}.gate_proj.weight"] = _rand(rng, I, D)
        flat[f"{p}.{e}.up_proj.weight"] = _rand(rng, I, D)
        flat[f"{p}.{e}.down_proj.weight"] = _rand(rng, D, I)
    flat["model.norm.weight"] = _rand(rng, D)
    rules = hf_stacked_experts_rules() + (Rule("model.norm.weight", "model.norm.weight"),)
    hf = NameMap(rules).apply({k: v.shape for k, v in flat.items()})
    expected = {
        f"{p}.gate_up_proj": np.stack([np.concatenate([flat[f"{p}.{e}.gate_proj.weight"],
                                                       flat[f"{p}.{e}.up_proj.weight"]])
                                       for e in range(E)]),
        f"{p}.down_proj": np.stack([flat[f"{p}.{e}.down_proj.weight"] for e in range(E)]),
        "model.norm.weight": flat["model.norm.weight"],
    }
    _check(hf, flat, expected, rng)
    gu = hf[f"{p}.gate_up_proj"]
    assert gu.shape == (E, 2 * I, D) and len(gu.sources) == 2 * E
    # a region inside one expert's up block is a single zero-copy view
    region = Region.of([(1, 2), (I + 2, I + 5), (0, D)])
    (src, inter, view), = gu.pieces(region)
    assert src.name == f"{p}.1.up_proj.weight" and inter == region
    assert np.shares_memory(view.apply(flat[src.name]), flat[src.name])


def test_separate_qkv_to_fused_hf_tensor():
    rng = np.random.default_rng(5)
    flat = {f"layers/0/attn/{n}/kernel": _rand(rng, D, h, HD) for n, h in
            (("q", H), ("k", KV), ("v", KV))}
    rule = ConcatRule(tuple(f"layers/{{l}}/attn/{n}/kernel" for n in "qkv"),
                      "model.layers.{l}.self_attn.qkv_proj.weight", dim=0,
                      transforms=(Reshape(("@0", -1)), Transpose()))
    hf = NameMap([rule]).apply({k: v.shape for k, v in flat.items()})
    ref = np.concatenate([flat[f"layers/0/attn/{n}/kernel"].reshape(D, -1).T for n in "qkv"])
    _check(hf, flat, {"model.layers.0.self_attn.qkv_proj.weight": ref}, rng)


def test_hf_identity_rules_for_torch_models():
    rng = np.random.default_rng(6)
    flat = _hf_by_hand(_tree(rng))
    hf = NameMap(HF_IDENTITY).apply({k: v.shape for k, v in flat.items()})
    _check(hf, flat, flat, rng)


def test_unmapped_and_doubly_mapped_names_are_listed_in_one_error():
    rules = (Rule("a/{i}/w", "x.{i}"), Rule("a/{i}/{n:w|b}", "y.{i}.{n}"),
             Rule("c", "z"), Rule("d", "z"))
    shapes = {"a/0/w": (2,), "a/0/b": (2,), "c": (1,), "d": (1,), "nope/1": (3,), "nope/2": (3,)}
    with pytest.raises(NamingError) as info:
        NameMap(rules).apply(shapes)
    msg = str(info.value)
    assert "2 trainer names match no rule: nope/1, nope/2" in msg
    assert "1 trainer names match several rules: a/0/w" in msg
    assert "1 HF names are produced twice: z (from c, d)" in msg
    assert isinstance(info.value, ValueError)


def test_reshape_that_needs_a_copy_is_refused():
    rule = Rule("w", "w", (Transpose(), Reshape((-1,))))
    with pytest.raises(NamingError, match="'w': reshape .* would need a copy"):
        NameMap([rule]).apply({"w": (3, 4)})


def test_split_sizes_must_add_up_and_params_must_exist():
    rule = Rule("w", "{p}", (Split(0, "p", (("a", "n"), ("b", 2))),))
    with pytest.raises(NamingError, match="does not add up"):
        NameMap([rule], params={"n": 3}).apply({"w": (4, 2)})
    with pytest.raises(NamingError, match="not among the rule params"):
        NameMap([rule]).apply({"w": (4, 2)})


def test_strided_view_reshape_matches_numpy():
    rng = np.random.default_rng(7)
    for shape, perm, new in [((2, 3, 4), (0, 1, 2), (6, 4)), ((2, 3, 4), (0, 1, 2), (2, 12)),
                             ((2, 3, 4), (1, 0, 2), (3, 2, 2, 2)),
                             ((4, 1, 6), (2, 1, 0), (3, 2, 4)),
                             ((5, 6), (1, 0), (2, 3, 5)), ((2, 3, 4), (2, 0, 1), (4, 6))]:
        a = rng.standard_normal(shape)
        v = StridedView.identity(shape).transpose(perm).reshape(new)
        ref = a.transpose(perm).reshape(new)
        got = v.apply(a)
        assert np.array_equal(got, ref) and np.shares_memory(got, a)


def test_index_expr_reads_the_same_elements_as_the_view():
    rng = np.random.default_rng(8)
    a = rng.standard_normal((D, H, HD))
    view = StridedView.identity(a.shape).reshape((D, -1)).transpose()    # q_proj [H*HD, D]
    ref = a.reshape(D, -1).T
    for rows, cols in itertools.product([(0, H * HD), (HD, 3 * HD), (4, 5)], [(0, D), (2, 7)]):
        region = Region.of([rows, cols])
        box, perm = view.restrict(region).index_expr()
        got = a[box.slices()].transpose(perm).reshape(region.shape)
        assert np.array_equal(got, ref[region.slices()])
    with pytest.raises(NamingError, match="not a box"):
        view.restrict(Region.of([(1, 5), (0, D)])).index_expr()    # straddles two heads


def test_flatten_tree_paths():
    assert flatten_tree({"a": {"b": [1, 2]}, "c": 3}) == {"a/b/0": 1, "a/b/1": 2, "c": 3}


def test_concat_rule_takes_dim_only():
    assert ConcatRule(("a", "b"), "ab", 1) == ConcatRule(("a", "b"), "ab", dim=1)
    with pytest.raises(TypeError, match="axis"):
        ConcatRule(("a", "b"), "ab", axis=1)        # the old spelling is gone (axis: mesh axis)
    with pytest.raises(TypeError, match="dim"):
        ConcatRule(("a", "b"), "ab")


def _shards(layout: Layout, full: np.ndarray) -> dict:
    """Every rank's local array of ``full`` under ``layout`` (its intervals, in order)."""
    out = {}
    for r in layout.ranks:
        index = [np.concatenate([np.arange(a, b) for a, b in ivs])
                 for ivs in layout.dim_intervals(r)]
        out[r] = np.ascontiguousarray(full[np.ix_(*index)])
    return out


def test_sharded_views_follow_the_rules_as_whole_arrays_do():
    """One interpreter (NameMap.expand), two kinds of view: each rank's shard of a sharded
    trainer array carried through the rules (ShardedView) is bit for bit the region of the
    HF tensor (read through StridedView) that the resulting layout says the rank holds.
    Fused qkv / gate_up split on the fused dim, stacked experts split over the expert dim."""
    rng = np.random.default_rng(9)
    E = 4
    flat = {"layers/0/attn/qkv/kernel": _rand(rng, D, H + 2 * KV, HD),   # fused dim: tp blocks
            "layers/0/mlp/gate_up/kernel": _rand(rng, D, 2 * I),
            "layers/0/attn/o/kernel": _rand(rng, H, HD, D),
            "layers/0/moe/gate/kernel": _rand(rng, E, D, I)}
    specs = {"layers/0/attn/qkv/kernel": [(0, 0), (1, 1)], "layers/0/mlp/gate_up/kernel":
             [(0, 0), (1, 1)], "layers/0/attn/o/kernel": [(0, 1)],
             "layers/0/moe/gate/kernel": [(0, 0), (2, 1)]}
    mesh = Mesh((2, 2), (10, 11, 12, 13), ("fsdp", "tp"))
    names = NameMap(jax_llama_rules(fused=True) + jax_moe_rules(),
                    params={"num_heads": H, "num_kv_heads": KV, "intermediate": I})
    hf = names.apply({n: a.shape for n, a in flat.items()})
    seen = set()
    for name, full in flat.items():
        layout = Layout.product(full.shape, "float32", mesh, specs[name])
        shards = _shards(layout, full)
        (rule, fields), = [(r, m) for r in names.rules if (m := r.match(name)) is not None]
        for view, f in names.expand(ShardedView(layout, shards), fields, rule.transforms, name):
            tensor = hf[rule.dst.format(**f)]
            assert view.shape == tensor.shape
            for r, local in view.arrays.items():
                (region,) = view.layout.regions(r)
                assert np.array_equal(local, tensor.view(flat, region)), (tensor.name, r)
                assert np.shares_memory(local, shards[r]), (tensor.name, r)
            seen.add(tensor.name)
    assert seen == set(hf) and len(seen) == 3 + 2 + 1 + E
    # a part straddling two tp blocks of the fused dim: refused, naming the trainer array
    lay = Layout.product((D, 8, HD), "float32", mesh, [(1, 1)])
    odd = NameMap([Rule("q", "{p}", (Split(1, "p", (("a", 3), ("b", 5))),))])
    with pytest.raises(NamingError, match=r"'q': slices \[3:8\] of dim 1 \(size 8\), which "
                                          r"mesh axes \['tp'\] split into blocks of 4"):
        list(odd.expand(ShardedView(lay, {}), {}, odd.rules[0].transforms, "q"))
