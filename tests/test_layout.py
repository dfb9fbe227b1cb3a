"""Layout IR: geometry, validation messages, JSON, and a framework-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import xreshard as xr
from xreshard.ir.layout import split_intervals


def regions(layout, rank):
    return [str(r) for r in layout.regions(rank)]


def test_nested_chunk_is_not_flat():
    # 5 rows on (S0, S0) over 2x2: [0,1],[2],[3],[4] (nested torch.chunk, docs/vocabulary.md: split)
    lay = xr.Layout.from_placements((5, 3), "float32", xr.Mesh((2, 2)), ["S0", "S0"])
    assert [regions(lay, r) for r in range(4)] == [["[0:2, 0:3]"], ["[2:3, 0:3]"],
                                                   ["[3:4, 0:3]"], ["[4:5, 0:3]"]]


def test_chunk_leaves_trailing_ranks_empty():
    lay = xr.Layout.from_placements((6,), "float32", xr.Mesh((4,)), ["S0"])
    assert [lay.local_shape(r) for r in range(4)] == [(2,), (2,), (2,), (0,)]
    assert lay.regions(3) == ()


def test_strided_shard_gives_interval_lists():
    lay = xr.Layout.from_placements((8,), "float32", xr.Mesh((2,)), ["SS0/2"])
    assert regions(lay, 0) == ["[0:2]", "[4:6]"]
    assert lay.locate(0, xr.Region((4,), (6,))) == (0, (slice(2, 4),))
    # docstring example: (_StridedShard(0, sf=2), Shard(0)) on 8 rows over 2x2
    lay = xr.Layout.from_placements((8,), "float32", xr.Mesh((2, 2)), ["SS0/2", "S0"])
    assert [regions(lay, r) for r in range(4)] == [["[0:2]"], ["[4:6]"], ["[2:4]"], ["[6:8]"]]
    # uneven: 5 rows -> [0,1], [3], [2], [4]
    lay = xr.Layout.from_placements((5,), "float32", xr.Mesh((2, 2)), ["SS0/2", "S0"])
    assert [regions(lay, r) for r in range(4)] == [["[0:2]"], ["[3:4]"], ["[2:3]"], ["[4:5]"]]


def test_jax_axis_order_major_first():
    mesh = xr.Mesh((2, 4), axis_names=("dp", "tp"))
    lay = xr.Layout.from_spec((16, 3), "float32", mesh, (("tp", "dp"),))
    # c = tp * 2 + dp: device 1 (dp 0, tp 1) -> rows 4:6; device 4 (dp 1, tp 0) -> rows 2:4
    assert regions(lay, 1) == ["[4:6, 0:3]"] and regions(lay, 4) == ["[2:4, 0:3]"]


def test_even_product_equals_dtensor_strided():
    mesh = xr.Mesh((2, 4), axis_names=("dp", "tp"))
    jax_like = xr.Layout.from_spec((16,), "float32", mesh, (("tp", "dp"),))
    dtensor_like = xr.Layout.from_placements((16,), "float32", mesh, ["SS0/4", "S0"])
    assert [jax_like.regions(r) for r in range(8)] == [dtensor_like.regions(r) for r in range(8)]


def test_mesh_ranks_and_outside_rank():
    mesh = xr.Mesh((2, 2), ranks=(7, 3, 5, 1))
    lay = xr.Layout.from_placements((4,), "float32", mesh, ["S0", "R"])
    assert regions(lay, 5) == ["[2:4]"] and lay.regions(0) == ()
    assert mesh.coord(5) == (1, 0)


def test_scalar_and_replicated():
    lay = xr.Layout.replicated((), "float32", xr.Mesh((3,)))
    assert [r.shape for r in lay.regions(2)] == [()]


def test_split_intervals_of_lists():
    assert split_intervals(((0, 2), (4, 6)), 2, 1) == ((4, 6),)
    assert split_intervals(((0, 8),), 2, 0, 2) == ((0, 2), (4, 6))


def test_json_round_trip_and_hash():
    mesh = xr.Mesh((2, 2), ranks=(3, 2, 1, 0), axis_names=("a", "b"))
    lay = xr.Layout.from_placements((5, 7), "bfloat16", mesh, ["SS1/2", "S1"])
    back = xr.Layout.from_json(lay.to_json())
    assert back == lay and hash(back) == hash(lay)
    json.loads(lay.to_json())
    ex = xr.Layout.explicit_form((4, 4), "float32", {2: [[(0, 2), (0, 4)]], 0: []})
    assert xr.Layout.from_json(ex.to_json()) == ex
    assert {lay: 1}[back] == 1


def test_torch_placement_objects_by_name():
    class Shard:
        def __init__(self, dim):
            self.dim = dim

    class Replicate:
        pass

    a = xr.Layout.from_placements((4, 4), "float32", xr.Mesh((2, 2)), [Replicate(), Shard(1)])
    b = xr.Layout.from_placements((4, 4), "float32", xr.Mesh((2, 2)), ["R", "S1"])
    assert a == b


def test_errors_are_clear():
    mesh = xr.Mesh((2, 4), axis_names=("dp", "tp"))
    with pytest.raises(xr.LayoutError, match=r"tensor 'model.layers.3.mlp.down_proj.weight' dim 1 "
                       r"\(size 18\) is split 4 ways by mesh axes \('tp',\) but 18 % 4 != 0; JAX "
                       r"NamedSharding needs even splits - pad the tensor or change the PartitionSpec"):
        xr.Layout.from_spec((8, 18), "bfloat16", mesh, (None, "tp"),
                            name="model.layers.3.mlp.down_proj.weight")
    with pytest.raises(xr.LayoutError, match=r"mesh ranks \[1\] appear more than once"):
        xr.Mesh((2,), ranks=(1, 1))
    with pytest.raises(xr.LayoutError, match=r"placement 'P' on mesh axis '0' is Partial \(a pending reduction\)"):
        xr.Layout.from_placements((4,), "float32", xr.Mesh((2,)), ["P"])

    class Partial:
        reduce_op = "sum"

    with pytest.raises(xr.LayoutError, match=r"is Partial \(a pending reduction\); xreshard does "
                                             r"not reduce yet"):
        xr.Layout.from_placements((4,), "float32", xr.Mesh((2,)), [Partial()])
    with pytest.raises(xr.LayoutError, match=r"mesh axis 'xx' is not one of the mesh axis names"):
        xr.Layout.from_spec((4,), "float32", mesh, ("xx",))
    with pytest.raises(xr.LayoutError, match=r"mesh axis 'dp' appears twice"):
        xr.Layout.from_spec((8, 8), "float32", mesh, ("dp", "dp"))
    with pytest.raises(xr.LayoutError, match=r"3 placements for a 2-d mesh"):
        xr.Layout.from_placements((4,), "float32", mesh, ["R", "R", "R"])
    with pytest.raises(xr.LayoutError, match=r"placement 'S3' .* shards dim 3 of a 1-d tensor"):
        xr.Layout.from_placements((4,), "float32", xr.Mesh((2,)), ["S3"])
    with pytest.raises(xr.LayoutError, match=r"dtype 'int4' is not supported"):
        xr.Layout.replicated((4,), "int4", xr.Mesh((1,)))
    with pytest.raises(xr.LayoutError, match=r"overlap; a rank holds each element at most once"):
        xr.Layout.explicit_form((4,), "float32", {0: [[(0, 3)], [(2, 4)]]})


def test_import_pulls_in_no_framework():
    code = ("import sys, xreshard, xreshard.planner.plan, xreshard.tools.testing, xreshard.adapters; "
            "print(sorted({'torch', 'jax', 'cupy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_permuted_layout_matches_transposed_regions():
    mesh = xr.Mesh((2, 3), axis_names=("fsdp", "tp"))
    kernel = xr.Layout.from_spec((4, 9), "float32", mesh, ("fsdp", "tp"))   # [in, out]
    weight = kernel.permuted((1, 0))                                         # [out, in]
    assert weight.shape == (9, 4)
    for r in range(6):
        (k,), (w,) = kernel.regions(r), weight.regions(r)
        assert (w.starts, w.stops) == (k.starts[::-1], k.stops[::-1])


def test_placement_subclasses_are_recognised():
    class Shard:
        def __init__(self, dim):
            self.dim = dim

    class _StridedShard(Shard):          # how torch < 2.10 defined it
        def __init__(self, dim, split_factor):
            super().__init__(dim)
            self.split_factor = split_factor

    class MyShard(Shard):
        pass

    mesh = xr.Mesh((2, 2))
    a = xr.Layout.from_placements((8,), "float32", mesh, [_StridedShard(0, 2), MyShard(0)])
    assert a == xr.Layout.from_placements((8,), "float32", mesh, ["SS0/2", "S0"])


def test_rank_groups_group_replicas_and_skip_empty_ranks():
    lay = xr.Layout.from_placements((4,), "float32", xr.Mesh((2, 2)), ["S0", "R"])
    rows_0_2, rows_2_4 = (((0, 2),),), (((2, 4),),)       # per dim, that dim's intervals
    assert lay.rank_groups() == ((rows_0_2, (0, 1)), (rows_2_4, (2, 3)))
    assert lay.rank_groups() is lay.rank_groups()                  # cached by the layout
    empty = xr.Layout.from_placements((3,), "float32", xr.Mesh((4,)), ["S0"])
    assert [ranks for _, ranks in empty.rank_groups()] == [(0,), (1,), (2,)]
    with pytest.raises(xr.LayoutError, match="rank_groups needs a product-form layout"):
        xr.Layout.explicit_form((2,), "float32", {0: [[(0, 2)]]}).rank_groups()


def test_equal_meshes_and_layouts_are_one_object():
    import copy
    import gc
    import pickle

    from xreshard.ir import layout as layout_module

    mesh = xr.Mesh((2, 2), axis_names=("dp", "tp"))
    assert xr.Mesh([2, 2], ranks=[0, 1, 2, 3], axis_names=["dp", "tp"]) is mesh
    a = xr.Layout.from_spec((8, 4), "float32", mesh, ("dp",))
    b = xr.Layout.from_placements((8, 4), "float32", xr.Mesh((2, 2), axis_names=("dp", "tp")),
                                  ["S0", "R"])
    assert a is b                                   # built two ways, one object
    a.regions(3)
    assert ("iv", 3) in b._cache                    # so geometry is computed once
    assert pickle.loads(pickle.dumps(a)) is a and copy.deepcopy(a) is a
    assert xr.Layout.from_json(a.to_json()) is a
    assert xr.Layout.replicated((8, 4), "bfloat16", mesh) is not a
    # held weakly: a layout nobody holds leaves the table
    key = ((3, 3, 3), "float32")
    c = xr.Layout.replicated(key[0], key[1], xr.Mesh((5,), ranks=(9, 8, 7, 6, 5)))
    assert any(k[:2] == key for k in layout_module._LAYOUTS.keys())
    del c
    gc.collect()
    assert not any(k[:2] == key for k in layout_module._LAYOUTS.keys())


def test_cold_memo_builds_cold_twins():
    from xreshard.ir.layout import LayoutMemo
    from xreshard.tools.testing import ColdMemo

    memo = LayoutMemo()
    make = lambda: xr.Layout.from_placements((4,), "float32", xr.Mesh((2,)), ["S0"])  # noqa: E731
    warm = memo.get("k", make)
    assert memo.get("k", make) is warm and make() is warm
    cold = ColdMemo().get("k", make)
    assert cold == warm and hash(cold) == hash(warm) and cold is not warm
    assert cold.mesh == warm.mesh and cold.mesh is not warm.mesh and not cold._cache
    assert cold.regions(1) == warm.regions(1)
