"""Layout view algebra (``Layout.sliced``, ``selected``, ``reshaped``): bit-exact against numpy.

For every rank, the rank's local array of the input layout, viewed as the method says
(``local[sliced index]``, ``local[index]``, ``local.reshape(new.local_shape(rank))``), must
equal the rank's local array of the resulting layout cut from the numpy view of the full
array (``full[a:b]``, ``full[i]``, ``full.reshape(shape)``), and every rank the result
places must hold exactly that. This is what naming rules do to sharded trainer arrays.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from xreshard.errors import LayoutError
from xreshard.ir.layout import Layout, Mesh, Region, Split

MESH22 = Mesh((2, 2), axis_names=("fsdp", "tp"))

LAYOUTS = {
    # product meshes: a 2-d kernel on (fsdp, tp), stacked experts on (ep, tp), a dim split
    # by two axes (nested), a replicated one
    "kernel": Layout.product((8, 6), "float32", MESH22, [Split(0, 1), Split(1, 0)]),
    "experts": Layout.product((4, 8, 6), "float32", Mesh((4, 2), axis_names=("ep", "tp")),
                              [Split(0, 0), Split(2, 1)]),
    "nested": Layout.product((8, 3), "float32", MESH22, [Split(0, 0), Split(0, 1)]),
    "replicated": Layout.replicated((3, 4), "float32", Mesh((3,), (5, 6, 7))),
    # torch.chunk's uneven split (3 + 2 rows) and DTensor's strided shard
    "uneven": Layout.from_placements((5, 4), "float32", Mesh((2,)), ["S0"]),
    "strided": Layout.from_placements((8, 4), "float32", Mesh((2,)), ["SS0/2"]),
}


def _full(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def _local(layout: Layout, full: np.ndarray, rank: int) -> np.ndarray:
    """``rank``'s local array: its intervals of every dim, in local order."""
    per_dim = layout.dim_intervals(rank)
    index = [np.concatenate([np.arange(a, b) for a, b in ivs] or [np.arange(0)])
             for ivs in per_dim]
    return full[np.ix_(*index)] if index else full


def _cut(dim: int, index) -> tuple:
    return (slice(None),) * dim + (index,)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sliced_reads_the_numpy_slice_on_every_rank(name):
    lay = LAYOUTS[name]
    full = _full(lay.shape)
    checked = 0
    for dim in range(lay.ndim):
        for a, b in itertools.combinations_with_replacement(range(lay.shape[dim] + 1), 2):
            try:
                out, local = lay.sliced(dim, a, b)
            except LayoutError:
                assert lay.dim_axes(dim), (name, dim, a, b)      # only a split dim refuses
                continue
            want = full[_cut(dim, slice(a, b))]
            assert out.shape == want.shape and set(local) == set(out.mesh.ranks)
            for r in local:
                got = _local(lay, full, r)[_cut(dim, local[r])]
                assert np.array_equal(got, _local(out, want, r)), (name, dim, a, b, r)
            checked += 1
    assert checked


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_selected_reads_the_numpy_index_on_every_rank(name):
    lay = LAYOUTS[name]
    full = _full(lay.shape)
    for dim, i in ((d, i) for d in range(lay.ndim) for i in range(lay.shape[d])):
        out, local = lay.selected(dim, i)
        want = full[_cut(dim, i)]
        assert out.shape == want.shape and set(local) == set(out.mesh.ranks)
        holders = {r for r in lay.ranks if any(reg.starts[dim] <= i < reg.stops[dim]
                                               for reg in lay.regions(r))}
        assert set(local) == holders, (name, dim, i)
        for r in local:
            got = _local(lay, full, r)[_cut(dim, local[r])]
            assert np.array_equal(got, _local(out, want, r)), (name, dim, i, r)


def _reshapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every merge of two neighbouring dims, every split of a dim in two, and an unsqueeze."""
    out = [shape[:k] + (shape[k] * shape[k + 1],) + shape[k + 2:] for k in range(len(shape) - 1)]
    for k, n in enumerate(shape):
        out += [shape[:k] + (f, n // f) + shape[k + 1:] for f in range(1, n + 1) if n % f == 0]
    return out + [(1,) + shape, shape + (1,)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_reshaped_reads_the_numpy_reshape_on_every_rank(name):
    lay = LAYOUTS[name]
    full = _full(lay.shape)
    done = 0
    for shape in _reshapes(lay.shape):
        try:
            out = lay.reshaped(shape)
        except LayoutError as e:
            assert "non-boxes" in str(e), (name, shape)
            continue
        want = full.reshape(shape)
        assert out.mesh == lay.mesh
        for r in lay.mesh.ranks:
            got = _local(lay, full, r).reshape(out.local_shape(r))
            assert np.array_equal(got, _local(out, want, r)), (name, shape, r)
        done += 1
    assert done


def test_slices_of_a_split_dim_keep_the_ranks_of_their_blocks():
    """The docstring's table: 8 rows on tp=4."""
    lay = Layout.product((8,), "bfloat16", Mesh((4,), (10, 11, 12, 13), ("tp",)), [Split(0, 0)])
    one, local = lay.sliced(0, 2, 4)
    assert dict(local) == {11: slice(0, 2)} and one.mesh == Mesh((1,), (11,), ("tp",))
    two, local = lay.sliced(0, 4, 8)
    assert dict(local) == {12: slice(None), 13: slice(None)}
    assert two.regions(13) == (Region((2,), (4,)),)
    with pytest.raises(LayoutError, match=r"slices \[1:5\] of dim 0 \(size 8\), which mesh "
                                          r"axes \['tp'\] split into blocks of 2"):
        lay.sliced(0, 1, 5)
    empty, local = lay.sliced(0, 8, 8)
    assert empty.shape == (0,) and dict(local) == {13: slice(2, 2)}


def test_selecting_an_expert_drops_the_expert_axis():
    lay = LAYOUTS["experts"]
    out, local = lay.selected(0, 2)                  # expert 2: ep coordinate 2
    assert dict(local) == {4: 0, 5: 0}
    assert str(out) == "Layout((8, 6) float32 on mesh(tp=2)[4..5]: d1<-tp)"


def test_uneven_and_strided_splits():
    uneven = LAYOUTS["uneven"]                       # rows 0:3 on rank 0, 3:5 on rank 1
    assert dict(uneven.selected(0, 4)[1]) == {1: 1}
    assert uneven.sliced(1, 1, 3)[0].regions(1) == (Region((3, 0), (5, 2)),)
    with pytest.raises(LayoutError, match="split into blocks"):
        uneven.sliced(0, 0, 3)                       # even blocks only, even inside one
    assert uneven.reshaped((5, 2, 2)).regions(0) == (Region((0, 0, 0), (3, 2, 2)),)
    with pytest.raises(LayoutError, match=r"reshape \(5, 4\) -> \(20,\) would cut"):
        uneven.reshaped((20,))
    strided = LAYOUTS["strided"]                     # rank 0: rows 0:2 and 4:6
    assert dict(strided.selected(0, 5)[1]) == {0: 3}
    with pytest.raises(LayoutError, match="split into blocks"):
        strided.sliced(0, 0, 2)


def test_refusals_name_what_is_wrong():
    lay = LAYOUTS["kernel"]
    explicit = Layout.explicit_form((4, 4), "float32", {0: [[(0, 4), (0, 2)]],
                                                        1: [[(0, 4), (2, 4)]]})
    for call in (lambda: explicit.sliced(0, 0, 2), lambda: explicit.selected(0, 1),
                 lambda: explicit.reshaped((16,))):
        with pytest.raises(LayoutError, match="needs a product-form layout"):
            call()
    with pytest.raises(LayoutError, match=r"slice \[2:9\] of dim 1 is outside"):
        lay.sliced(1, 2, 9)
    with pytest.raises(LayoutError, match="index 8 of dim 0 is outside"):
        lay.selected(0, 8)
    with pytest.raises(LayoutError, match=r"cannot reshape \(8, 6\) to \(7, 6\)"):
        lay.reshaped((7, 6))
    with pytest.raises(LayoutError, match=r"cannot reshape an empty tensor \(0, 6\)"):
        Layout.replicated((0, 6), "float32", MESH22).reshaped((6, 0))
    # (8, 6): d0 by tp, d1 by fsdp - merging them interleaves the shards
    with pytest.raises(LayoutError, match=r"dims \[0, 1\] \(split by mesh axes \['tp', "
                                          r"'fsdp'\]\) into non-boxes"):
        lay.reshaped((48,))


def test_views_are_memoized_and_read_only():
    lay = LAYOUTS["kernel"]
    first = lay.sliced(1, 0, 3)
    assert lay.sliced(1, 0, 3) is first and lay.reshaped((2, 4, 6)) is lay.reshaped([2, 4, 6])
    with pytest.raises(TypeError):
        first[1][0] = slice(None)   # type: ignore[index]
