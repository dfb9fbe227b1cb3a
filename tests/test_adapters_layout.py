"""Adapters describe real framework objects as Layouts; checked against the frameworks.

JAX: ``layout_of(...).regions(rank)`` must equal ``devices_indices_map`` for every device.
torch: ``local_shape`` / ``dim_intervals`` must equal DTensor's own shape and offset
arithmetic (``_compute_local_shape_and_global_offset`` and the per-placement
``local_shard_size_and_offset``) at every mesh coordinate, including uneven, empty and
``_StridedShard`` shards. No process group is needed for those: the torch helpers take a
mesh shape and a coordinate, and ``DeviceMesh(..., _init_backend=False)`` builds a mesh
without one. One test uses a real single-process gloo group for a real DTensor.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xreshard.errors import LayoutError
from xreshard.ir.layout import Layout, Mesh, Region, Split

try:  # conftest.py has already asked for 8 CPU devices
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

    from xreshard.adapters import jax as xjax
except ImportError:  # pragma: no cover - the jax extra is optional
    jax = None

try:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import (
        Partial, Replicate, Shard, _StridedShard, _StridedShardOffsetMode)

    from xreshard.adapters import torch as xtorch
except ImportError:  # pragma: no cover - the torch extra is optional
    torch = None

needs_jax = pytest.mark.skipif(jax is None, reason="needs jax: pip install 'xreshard[jax]'")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch: pip install 'xreshard[torch]'")

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ============================================================================ JAX

def _devices8():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip(f"needs 8 JAX CPU devices (JAX_NUM_CPU_DEVICES=8), found {len(devices)}")
    return devices[:8]


def _jax_region(index, shape) -> Region:
    """devices_indices_map index -> Region, written independently of the adapter."""
    bounds = [(0 if s.start is None else s.start, n if s.stop is None else s.stop)
              for s, n in zip(index, shape)]
    return Region.of(bounds + [(0, n) for n in shape[len(bounds):]])


def _held(region: Region) -> tuple[Region, ...]:
    """What regions(rank) returns for a device holding ``region``: nothing if it is empty."""
    return () if region.is_empty else (region,)


@st.composite
def jax_meshes(draw):
    """(axis sizes with product <= 8, a permutation of the 8 devices)."""
    sizes, budget = [], 8
    for _ in range(draw(st.integers(1, 3))):
        sizes.append(draw(st.integers(1, budget)))
        budget //= sizes[-1]
    return tuple(sizes), draw(st.permutations(range(8)))


@st.composite
def jax_specs(draw, names, sizes):
    """(PartitionSpec, divisible shape): each mesh axis splits some dim or none, any order."""
    ndim = draw(st.integers(0, 3))
    dim_of = [draw(st.integers(-1, ndim - 1)) for _ in names]
    entries, shape = [], []
    for d in range(ndim):
        axes = draw(st.permutations([a for a, dd in zip(names, dim_of) if dd == d]))
        if not axes:
            entries.append(draw(st.sampled_from([None, P.UNCONSTRAINED])))
        elif len(axes) == 1:
            entries.append(draw(st.sampled_from([axes[0], (axes[0],)])))
        else:
            entries.append(tuple(axes))
        ways = math.prod(sizes[names.index(a)] for a in axes)
        shape.append(ways * draw(st.integers(0, 3)))
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()  # a short spec leaves trailing dims whole
    return P(*entries), tuple(shape)


def _rank_spec(kind: str, devices, world):
    """``ranks`` argument of each supported kind, giving devices[i] world rank world[i]."""
    if kind == "default":
        return None
    if kind == "device":
        return dict(zip(devices, world))
    if kind == "id":
        return {d.id: w for d, w in zip(devices, world)}
    if kind == "seq":
        return list(world)
    if kind == "array":
        return np.array(world)
    by_device = dict(zip(devices, world))
    return lambda d: by_device[d]


@needs_jax
@settings(FAST, max_examples=120)
@given(mesh_case=jax_meshes(), data=st.data())
def test_jax_named_sharding_matches_devices_indices_map(mesh_case, data):
    sizes, perm = mesh_case
    devices = _devices8()
    names = ("a", "b", "c")[:len(sizes)]
    n = math.prod(sizes)
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in perm[:n]]).reshape(sizes), names)
    flat = list(mesh.devices.flat)
    for _ in range(8):  # several specs per mesh: thousands of device checks overall
        spec, shape = data.draw(jax_specs(names, sizes))
        kind = data.draw(st.sampled_from(["default", "device", "id", "seq", "array", "call"]))
        world = (list(range(n)) if kind == "default" else
                 data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True)))
        sharding = NamedSharding(mesh, spec)
        layout = xjax.layout_of(sharding, shape, jnp.float32, _rank_spec(kind, flat, world))
        assert layout.is_product and layout.mesh.axis_names == names
        assert layout.shape == shape and layout.dtype == "float32"
        index_map = sharding.devices_indices_map(shape)
        for device, rank in zip(flat, world):
            want = _jax_region(index_map[device], shape)
            assert layout.regions(rank) == _held(want), (spec, shape, device, rank)
            assert layout.local_shape(rank) == want.shape


@needs_jax
@settings(FAST, max_examples=40)
@given(mesh_case=jax_meshes(), data=st.data())
def test_jax_gspmd_sharding_falls_back_to_index_map(mesh_case, data):
    """A GSPMDSharding (any tile assignment) becomes an explicit layout of the same boxes."""
    try:
        from jax._src.sharding_impls import GSPMDSharding
    except ImportError:  # pragma: no cover - private class, may move
        pytest.skip("this jax has no GSPMDSharding")
    sizes, perm = mesh_case
    devices = _devices8()
    names = ("a", "b", "c")[:len(sizes)]
    n = math.prod(sizes)
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in perm[:n]]).reshape(sizes), names)
    for _ in range(4):
        spec, shape = data.draw(jax_specs(names, sizes))
        named = NamedSharding(mesh, spec)
        gspmd = GSPMDSharding(tuple(mesh.devices.flat), named._to_xla_hlo_sharding(len(shape)))
        by_device = {d: 10 + i for i, d in enumerate(mesh.devices.flat)}
        explicit = xjax.layout_of(gspmd, shape, "bfloat16", by_device)
        product = xjax.layout_of(named, shape, "bfloat16", by_device)
        assert not explicit.is_product and explicit.dtype == "bfloat16"
        for d, rank in by_device.items():
            want = _held(_jax_region(gspmd.devices_indices_map(shape)[d], shape))
            assert explicit.regions(rank) == want == product.regions(rank)
        # default numbering for non-named shardings: position in device-id order
        default = xjax.layout_of(gspmd, shape, "bfloat16")
        for i, d in enumerate(sorted(by_device, key=lambda d: d.id)):
            assert default.regions(i) == explicit.regions(by_device[d])


@needs_jax
@pytest.mark.parametrize("build", ["make_mesh", "Mesh"])
def test_jax_permuted_mesh_real_array(build):
    """Device order differs from id order: ranks follow mesh positions, data agrees."""
    devices = _devices8()
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    order = [devices[i] for i in perm]
    if build == "make_mesh":
        mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=order)
    else:
        mesh = jax.sharding.Mesh(np.array(order).reshape(2, 4), ("dp", "tp"))
    assert [d.id for d in mesh.devices.flat] == [devices[i].id for i in perm]
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    arr = jax.device_put(x, NamedSharding(mesh, P(("tp", "dp"), None)))

    layout = xjax.layout_of(arr, name="w")
    assert layout.mesh.ranks == tuple(range(8)) and layout.dtype == "float32"
    flat = list(mesh.devices.flat)
    for shard in arr.addressable_shards:
        (region,) = layout.regions(flat.index(shard.device))
        np.testing.assert_array_equal(np.asarray(shard.data), x[region.slices()])
    # P(('tp','dp')): chunk index = tp*2 + dp, first-listed axis major
    #  rank | coord (dp,tp) | rows
    #     1 | (0,1)         | [2:3]
    #     4 | (1,0)         | [1:2]
    assert layout.regions(1) == (Region.of([(2, 3), (0, 6)]),)
    assert layout.regions(4) == (Region.of([(1, 2), (0, 6)]),)

    # explicit mappings, by device and by id, keyed on world ranks 100..107 in mesh order
    by_device = {d: 100 + i for i, d in enumerate(flat)}
    for ranks in (by_device, {d.id: r for d, r in by_device.items()},
                  lambda d: by_device[d], [100 + i for i in range(8)]):
        mapped = xjax.layout_of(arr, ranks=ranks)
        assert mapped.mesh.ranks == tuple(range(100, 108))
        for d, r in by_device.items():
            assert mapped.regions(r) == layout.regions(flat.index(d))


@needs_jax
def test_jax_single_device_sharding():
    devices = _devices8()
    arr = jax.device_put(np.ones((3, 4), np.int32), devices[3])
    assert isinstance(arr.sharding, SingleDeviceSharding)
    full = (Region.of([(0, 3), (0, 4)]),)
    assert xjax.layout_of(arr).regions(0) == full
    assert xjax.layout_of(arr, ranks={devices[3]: 7}).ranks == (7,)
    sharding = SingleDeviceSharding(devices[5])
    assert xjax.layout_of(sharding, (2, 2), "float16", {devices[5].id: 2}).regions(2) == (
        Region.of([(0, 2), (0, 2)]),)


@needs_jax
def test_jax_bind_hands_back_the_same_layouts_each_call():
    """The layout memo a refit passes: re-binding the same arrays gets the same Layout
    objects (caches warm); another rank map or sharding gets its own; a disabled memo builds
    equal layouts anew. No module state: two memos do not share."""
    from xreshard.ir.layout import LayoutMemo
    from xreshard.tools.testing import ColdMemo
    devices = _devices8()[:4]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
    tree = {"w": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("a"))),
            "v": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("b")))}
    ranks = {d.id: i for i, d in enumerate(devices)}
    memo = LayoutMemo()
    first = xjax.bind(tree, "send", ranks=ranks, memo=memo)
    again = xjax.bind(tree, "send", ranks=dict(ranks), memo=memo)
    assert all(again.layouts[n] is first.layouts[n] for n in tree)
    assert first.layouts["w"] != first.layouts["v"]
    shifted = xjax.bind(tree, "send", ranks={d: r + 10 for d, r in ranks.items()}, memo=memo)
    assert shifted.layouts["w"].ranks == (10, 11, 12, 13)
    cold = xjax.bind(tree, "send", ranks=ranks, memo=ColdMemo())
    assert cold.layouts["w"] == first.layouts["w"] and cold.layouts["w"] is not first.layouts["w"]
    # without a memo, layouts are still equal (and interned: the same objects)
    plain = xjax.bind(tree, "send", ranks=ranks)
    assert plain.layouts["w"] == first.layouts["w"]


@needs_jax
def test_jax_bind_names_a_tree_structure_once_per_cache():
    devices = _devices8()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    put = lambda: jax.device_put(np.zeros((4, 2), np.float32), NamedSharding(mesh, P("x")))  # noqa: E731
    ranks = {d.id: i for i, d in enumerate(devices)}
    cache: dict = {}
    first = xjax.bind({"a": {"k": put()}}, "send", ranks=ranks, cache=cache)
    assert list(first.layouts) == ["a/k"]
    # another structure, another names mapping: names are computed anew
    other = xjax.bind({"b": [put(), put()]}, "send", ranks=ranks, cache=cache,
                      names={"b/1": "second"})
    assert sorted(other.layouts) == ["b/0", "second"]
    again = xjax.bind({"b": [put(), put()]}, "send", ranks=ranks, cache=cache,
                      names={"b/1": "renamed"})
    assert sorted(again.layouts) == ["b/0", "renamed"]


@needs_jax
def test_jax_shape_dtype_struct_and_abstract_mesh():
    devices = _devices8()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("dp", "tp"))
    sds = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    layout = xjax.layout_of(sds)
    assert layout.dtype == "bfloat16" and layout.regions(5) == (Region.of([(2, 4), (0, 4)]),)
    abstract = NamedSharding(jax.sharding.AbstractMesh((2, 4), ("dp", "tp")), P("tp"))
    assert xjax.layout_of(abstract, (8, 4), jnp.bfloat16) == layout
    shifted = xjax.layout_of(abstract, (8, 4), jnp.bfloat16, ranks=list(range(10, 18)))
    assert shifted.regions(15) == layout.regions(5)
    with pytest.raises(LayoutError, match="AbstractMesh"):
        xjax.layout_of(abstract, (8, 4), jnp.bfloat16, ranks={0: 1})


@needs_jax
def test_jax_logical_device_ids_use_index_map():
    devices = _devices8()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("a", "b"), _logical_device_ids=tuple(range(7, -1, -1)))
    layout = xjax.layout_of(sharding, (4, 8), "float32")
    assert not layout.is_product
    index_map = sharding.devices_indices_map((4, 8))
    for pos, d in enumerate(mesh.devices.flat):
        assert layout.regions(pos) == (_jax_region(index_map[d], (4, 8)),)


@needs_jax
def test_jax_errors():
    devices = _devices8()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("dp", "tp"))
    uneven = NamedSharding(mesh, P("tp"))
    msg = (r"tensor 'w' dim 0 \(size 6\) is split 4 ways by mesh axes \('tp',\) but "
           r"6 % 4 != 0; JAX NamedSharding needs even splits")
    with pytest.raises(LayoutError, match=msg):
        xjax.layout_of(uneven, (6,), "float32", name="w")
    with pytest.raises(LayoutError, match=msg):
        xjax.layout_of(jax.ShapeDtypeStruct((6,), jnp.float32, sharding=uneven), name="w")

    explicit = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("dp", "tp"),
                                 axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(LayoutError, match=r"unreduced axes \['tp'\] \(a pending reduction\)"):
        xjax.layout_of(NamedSharding(explicit, P("dp", unreduced={"tp"})), (4,), "float32")

    with pytest.raises(LayoutError, match="needs the global shape and dtype"):
        xjax.layout_of(NamedSharding(mesh, P()))
    arr = jax.device_put(np.zeros((4,), np.float32), NamedSharding(mesh, P("tp")))
    with pytest.raises(LayoutError, match=r"shape \(8,\) was passed but the array has shape"):
        xjax.layout_of(arr, (8,))
    with pytest.raises(LayoutError, match="ranks has no entry for device"):
        xjax.layout_of(arr, ranks={devices[0]: 0})
    with pytest.raises(LayoutError, match="ranks has 3 entries but the sharding has 8 devices"):
        xjax.layout_of(arr, ranks=[0, 1, 2])
    with pytest.raises(LayoutError, match="each device needs its own world rank"):
        xjax.layout_of(arr, ranks=lambda d: 0)
    with pytest.raises(TypeError, match="expects a jax.Array"):
        xjax.layout_of(np.zeros(3))


# ============================================================================ torch

def _runs(indices) -> tuple[tuple[int, int], ...]:
    """Sorted-by-position global indices -> maximal runs of consecutive values."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def _torch_indices(shape, mesh_shape, coord, placements):
    """Global index of every local element per dim, composed from torch's per-placement math.

    This is the loop of ``_compute_local_shape_and_global_offset``, kept for all offsets
    instead of only the first (``offset_mode=ALL`` for ``_StridedShard``).
    """
    idx = [list(range(n)) for n in shape]
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            size, offsets = p.local_shard_size_and_offset(
                len(idx[p.dim]), mesh_shape[m], coord[m], offset_mode=_StridedShardOffsetMode.ALL)
            assert len(offsets) == size
            idx[p.dim] = [idx[p.dim][o] for o in offsets]
        elif isinstance(p, Shard):
            size, offset = Shard.local_shard_size_and_offset(len(idx[p.dim]), mesh_shape[m],
                                                             coord[m])
            idx[p.dim] = idx[p.dim][int(offset):int(offset) + int(size)]
    return idx


def _check_against_torch(layout, device_mesh, shape, placements, to_world=lambda r: r):
    """Every coordinate: local shape, first offset and all intervals match torch."""
    mesh_shape = tuple(device_mesh.mesh.shape)
    sharded = {p.dim for p in placements if isinstance(p, (Shard, _StridedShard))}
    for coord in itertools.product(*map(range, mesh_shape)):
        rank = to_world(int(device_mesh.mesh[coord]))
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements)
        assert layout.local_shape(rank) == tuple(local_shape), (coord, placements, shape)
        intervals = layout.dim_intervals(rank)
        for d, (ivs, idx) in enumerate(zip(intervals, _torch_indices(shape, mesh_shape, coord,
                                                                     placements))):
            assert ivs == _runs(idx), (coord, placements, shape, d)
            # torch reports an empty shard's offset as the dim size (zero_global_offset)
            first = ivs[0][0] if ivs else (shape[d] if d in sharded else 0)
            assert offset[d] == first, (coord, placements, shape, d)


def _no_backend_mesh(mesh_ranks, names=None):
    """A DeviceMesh without any process group: enough for geometry."""
    return DeviceMesh("cpu", mesh_ranks, mesh_dim_names=names, _init_backend=False, _rank=0)


@st.composite
def torch_meshes(draw):
    """(mesh shape, 1-3 axes of size 1-4, product <= 16; default-PG rank at each position)."""
    sizes, budget = [], 16
    for _ in range(draw(st.integers(1, 3))):
        sizes.append(draw(st.integers(1, min(4, budget))))
        budget //= sizes[-1]
    return tuple(sizes), draw(st.permutations(range(math.prod(sizes))))


@st.composite
def torch_placements(draw, num_axes):
    """(placements, shape): R / Shard / _StridedShard per mesh axis; uneven and empty dims."""
    ndim = draw(st.integers(1, 3))
    placements = []
    for _ in range(num_axes):
        kind = draw(st.sampled_from(["R", "S", "S", "SS"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 4))))
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    return placements, shape


@needs_torch
@settings(FAST, max_examples=100)
@given(mesh_case=torch_meshes(), data=st.data())
def test_torch_placements_match_dtensor_math(mesh_case, data):
    sizes, perm = mesh_case
    names = ("x", "y", "z")[:len(sizes)] if data.draw(st.booleans()) else None
    device_mesh = _no_backend_mesh(torch.tensor(perm).reshape(sizes), names)
    shift = data.draw(st.sampled_from([0, 3]))
    for _ in range(6):
        placements, shape = data.draw(torch_placements(len(sizes)))
        # ranks as identity, a mapping and a callable
        ranks = data.draw(st.sampled_from([None, "map", "call"])) if shift else None
        if ranks == "map":
            ranks = {r: r + shift for r in perm}
        elif ranks == "call":
            ranks = lambda r: r + shift  # noqa: E731
        layout = xtorch.layout_of(device_mesh, placements, shape, torch.float32, ranks=ranks)
        assert layout.mesh.axis_names == names and layout.dtype == "float32"
        _check_against_torch(layout, device_mesh, shape, placements,
                             (lambda r: r) if ranks is None else (lambda r: r + shift))
        # placements_of gives back the same geometry (here: the same layout)
        again = xtorch.placements_of(layout)
        assert xtorch.layout_of(device_mesh, again, shape, torch.float32, ranks=ranks) == layout


@needs_torch
def test_torch_strided_shard_docstring_example():
    """torch's _StridedShard docstring: (SS(0, sf=2), S(0)) on [[0,1],[2,3]], 8 rows."""
    mesh = _no_backend_mesh(torch.arange(4).reshape(2, 2), ("dp", "tp"))
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    layout = xtorch.layout_of(mesh, placements, (8,), "float32")
    # rank | coord (dp,tp) | rows
    #    0 | (0,0)         | [0:2]
    #    1 | (0,1)         | [4:6]
    #    2 | (1,0)         | [2:4]
    #    3 | (1,1)         | [6:8]
    assert [layout.regions(r) for r in range(4)] == [
        (Region.of([(a, a + 2)]),) for a in (0, 4, 2, 6)]
    # one strided shard alone gives several intervals on one dim
    alone = xtorch.layout_of(_no_backend_mesh(torch.arange(2)), [_StridedShard(0, split_factor=2)],
                             (8,), "float32")
    assert alone.dim_intervals(0) == (((0, 2), (4, 6)),)
    assert alone.local_shape(0) == (4,)


@needs_torch
def test_torch_permuted_mesh_and_names():
    mesh = _no_backend_mesh(torch.tensor([[3, 1], [2, 0]]), ("dp", "tp"))
    layout = xtorch.layout_of(mesh, [Shard(0), Shard(0)], (5, 3), torch.bfloat16)
    assert layout.mesh == Mesh((2, 2), (3, 1, 2, 0), ("dp", "tp"))
    # nested torch.chunk: 5 rows -> [0,1], [2], [3], [4] in mesh order (ranks 3, 1, 2, 0)
    assert [layout.regions(r)[0].starts[0] for r in (3, 1, 2, 0)] == [0, 2, 3, 4]
    assert layout.dtype == "bfloat16"


@needs_torch
def test_torch_errors():
    mesh = _no_backend_mesh(torch.arange(4).reshape(2, 2), ("dp", "tp"))
    with pytest.raises(LayoutError, match=r"tensor 'w': placement P\(sum\) on mesh axis 'tp' is "
                                          r"Partial \(a pending reduction\)"):
        xtorch.layout_of(mesh, [Shard(0), Partial()], (4,), "float32", name="w")
    with pytest.raises(LayoutError, match=r"shards dim 2 of a 2-d tensor"):
        xtorch.layout_of(mesh, [Shard(2), Replicate()], (4, 4), "float32")
    with pytest.raises(LayoutError, match=r"1 placements for a 2-d mesh .*: \[Replicate\(\)\]"):
        xtorch.layout_of(mesh, [Replicate()], (4,), "float32")
    with pytest.raises(LayoutError, match="needs all four"):
        xtorch.layout_of(mesh, [Replicate(), Replicate()])
    with pytest.raises(LayoutError,
                       match=r"the processes of torch ranks \[2, 3\] are not in this refit"):
        xtorch.layout_of(mesh, [Replicate(), Replicate()], (4,), "float32", ranks={0: 0, 1: 1})
    with pytest.raises(TypeError, match="DTensor or a DeviceMesh"):
        xtorch.layout_of(torch.zeros(3))
    # negative dims are normalised
    assert xtorch.layout_of(mesh, [Shard(-1), Replicate()], (4, 6), "float32").splits == (
        Split(1, 0),)


@needs_torch
def test_torch_shard_order_is_honoured():
    """A DTensorSpec with a non-default shard_order: tp shards dim 0 before dp."""
    try:
        from torch.distributed.tensor._dtensor_spec import (
            DTensorSpec, ShardOrderEntry, TensorMeta)
    except ImportError:  # pragma: no cover - torch < 2.10 has no shard_order
        pytest.skip("this torch has no DTensorSpec.shard_order")
    mesh = _no_backend_mesh(torch.arange(4).reshape(2, 2), ("dp", "tp"))
    shape = (8, 3)
    meta = TensorMeta(torch.Size(shape), (3, 1), torch.float32)
    spec = DTensorSpec(mesh, (Shard(0), Shard(0)), tensor_meta=meta,
                       shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),))
    dt = DTensor(torch.zeros(2, 3), spec, requires_grad=False)
    layout = xtorch.layout_of(dt)
    assert layout.dim_axes(0) == (1, 0)
    # torch's own conversion of that shard order to _StridedShard gives the same geometry
    strided = DTensorSpec._convert_shard_order_to_StridedShard(
        spec.shard_order, spec.placements, mesh)
    assert list(strided) == [_StridedShard(0, split_factor=2), Shard(0)]
    _check_against_torch(layout, mesh, shape, list(strided))
    # and placements_of finds that conversion from the layout alone
    assert xtorch.placements_of(layout) == list(strided)
    # the default order is plain left to right
    default = DTensor(torch.zeros(2, 3), DTensorSpec(mesh, (Shard(0), Shard(0)), tensor_meta=meta),
                      requires_grad=False)
    assert xtorch.layout_of(default).dim_axes(0) == (0, 1)


@needs_torch
def test_torch_real_dtensor_single_process_gloo(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    if dist.is_initialized():  # pragma: no cover - someone else owns the default group
        pytest.skip("a default process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.arange(1).reshape(1, 1), mesh_dim_names=("dp", "tp"))
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        dt = distribute_tensor(x, mesh, [Shard(0), _StridedShard(1, split_factor=2)])
        layout = xtorch.layout_of(dt, name="w")
        assert layout.shape == (4, 3) and layout.dtype == "float32"
        assert layout.regions(0) == (Region.of([(0, 4), (0, 3)]),)
        assert layout.local_shape(0) == tuple(dt.to_local().shape)
        assert xtorch.layout_of(dt, ranks={0: 9}).regions(9) == layout.regions(0)

        partial = DTensor.from_local(x, mesh, [Replicate(), Partial()])
        with pytest.raises(LayoutError, match=r"tensor 'g': placement P\(sum\) on mesh axis "
                                              r"'tp' is Partial \(a pending reduction\); "
                                              "xreshard does not reduce yet"):
            xtorch.layout_of(partial, name="g")
    finally:
        dist.destroy_process_group()


@needs_torch
def test_placements_of_refuses_what_dtensor_cannot_express():
    mesh = Mesh((2, 2), axis_names=("dp", "tp"))
    explicit = Layout.explicit_form((4,), "float32", {0: [[(0, 4)]]})
    with pytest.raises(LayoutError, match="explicit form"):
        xtorch.placements_of(explicit)
    # Out of mesh order and uneven: 7 rows on mesh (dp=3, tp=2), tp splits first (nested
    # torch.chunk), against the strided conversion (_StridedShard(0, sf=2), Shard(0)):
    #  rank | coord (dp,tp) | layout | DTensor
    #     4 | (2,0)         | []     | [6:7]
    #     5 | (2,1)         | [6:7]  | []
    mesh = Mesh((3, 2), axis_names=("dp", "tp"))
    uneven = Layout.product((7,), "float32", mesh, [Split(0, 1), Split(0, 0)])
    with pytest.raises(LayoutError, match=r"tensor 'w': .* dims \[0\] are split out of mesh-axis "
                                          r"order and unevenly \(rank 4 holds \(\(\),\) but"):
        xtorch.placements_of(uneven, name="w")
    # The check is exact, not a blanket refusal: where the conversion happens to match
    # (every even size, some uneven ones) the placements are returned and agree with torch.
    dm = _no_backend_mesh(torch.arange(6).reshape(3, 2))
    returned = 0
    for n in range(0, 25):
        layout = Layout.product((n,), "float32", mesh, [Split(0, 1), Split(0, 0)])
        try:
            placements = xtorch.placements_of(layout)
        except LayoutError:
            assert n % 6, n
            continue
        assert placements == [_StridedShard(0, split_factor=2), Shard(0)]
        _check_against_torch(layout, dm, (n,), placements)
        returned += 1
    assert returned > 25 // 6 + 1  # more than the even sizes


# ============================================================================ both

@needs_jax
@needs_torch
@settings(FAST, max_examples=40)
@given(mesh_case=jax_meshes(), data=st.data())
def test_jax_layout_to_dtensor_placements(mesh_case, data):
    """JAX -> Layout -> DTensor placements: torch's arithmetic gives JAX's boxes."""
    sizes, perm = mesh_case
    devices = _devices8()
    names = ("a", "b", "c")[:len(sizes)]
    n = math.prod(sizes)
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in perm[:n]]).reshape(sizes), names)
    device_mesh = _no_backend_mesh(torch.arange(n).reshape(sizes), names)
    for _ in range(4):
        spec, shape = data.draw(jax_specs(names, sizes))
        sharding = NamedSharding(mesh, spec)
        layout = xjax.layout_of(sharding, shape, jnp.float32)
        placements = xtorch.placements_of(layout)
        back = xtorch.layout_of(device_mesh, placements, shape, torch.float32)
        index_map = sharding.devices_indices_map(shape)
        for rank, d in enumerate(mesh.devices.flat):
            assert back.regions(rank) == _held(_jax_region(index_map[d], shape)), (spec, shape)
        _check_against_torch(back, device_mesh, shape, placements)


# ============================================================================ imports

def test_adapters_import_no_framework():
    code = ("import sys, xreshard.adapters.jax, xreshard.adapters.torch; "
            "bad = [m for m in ('jax', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_framework_names_the_extra(monkeypatch):
    from xreshard.adapters import jax as ajax
    from xreshard.adapters import torch as atorch

    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match=r"pip install 'xreshard\[jax\]'"):
        ajax.layout_of(None)
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)
    with pytest.raises(ImportError, match=r"pip install 'xreshard\[torch\]'"):
        atorch.layout_of(None)


# ---------------------------------------------------------------------------- the adapter registry

def test_a_third_party_adapter_registered_by_module_path_is_used_by_refit():
    pytest.importorskip("torch")        # the world's store is torch's TCPStore
    import xreshard as xr
    from xreshard.runtime import registry
    from . import refit_cases

    entry = registry.register_adapter("boxed", "tests.refit_cases")
    try:
        assert registry.adapters()[0] == entry
        found = registry.adapter_for(refit_cases.Boxed(np.zeros(2), 0))
        assert found is not None and found[0].name == "boxed" and found[1] is refit_cases
        assert registry.adapter_for(object()) is None
        with xr.serve() as server, xr.World.join(server.address, "solo", 1, num_processes=1,
                                                 index=0, timeout=10) as world:
            rank = world.rank_ids[0]
            src = np.arange(12, dtype=np.float32).reshape(3, 4)
            dst = np.zeros_like(src)
            refit = xr.Refit(world, send=refit_cases.Boxed(src, rank),
                             receive=refit_cases.Boxed(dst, rank))
            assert refit().version == 1 and np.array_equal(src, dst)
        assert ("send", True, (rank,)) in refit_cases.seen
        assert ("receive", True, (rank,)) in refit_cases.seen
    finally:
        assert registry.unregister_adapter("boxed")
    assert all(e.name != "boxed" for e in registry.adapters())


def test_core_modules_never_import_adapters():
    """The seam runs one way: only adapters (and the demo, CLI, launcher, testing helpers,
    and the integrations that sit on top: Tunix, Ray) may import xreshard.adapters; the
    core finds adapters by module path."""
    import ast
    import pathlib
    import xreshard
    root = pathlib.Path(xreshard.__file__).parent
    outside = {"demo.py", "cli.py", "__main__.py", "launch.py", "testing.py"}
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in ("adapters", "integrations") or rel.name in outside \
                or "testing" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.level and node.module is None:
                names = [a.name for a in node.names]
            offenders += [f"{rel}:{node.lineno} {n}" for n in names if "adapters" in n]
    assert not offenders, offenders
