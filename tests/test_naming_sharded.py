"""Sharded JAX arrays through naming rules where a reshape merges a split minor dim.

Tunix's default Gemma4 sharding splits the per-layer dim ``P`` of ``[V, L, P]`` and
``[D, L, P]``; HF's tensors merge it as the minor part of ``L*P``. Each device's shard is
then ``L`` boxes of the HF tensor (an explicit-form layout, ``Layout.merged``), each bound as
the strided view ``shard[:, l, :]``: nothing copied, nothing gathered. Real JAX arrays with
NamedShardings on 4 CPU devices; the refit runs every rank in this process (``Executor``
over ``LocalTransport``) into a numpy receiver on two more ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.adapters.naming import NameMap, NamingError, Reshape, Rule, Transpose
from xreshard.errors import LayoutError
from xreshard.ir.layout import Layout, Mesh, Region

V, L, P, D = 8, 4, 4, 6

#: Tunix's Gemma4 rules for the two per-layer tables (xreshard.integrations.tunix_gemma4)
RULES = [Rule("emb", "model.embed_tokens_per_layer.weight", (Reshape(("@0", -1)),)),
         Rule("proj", "model.per_layer_model_projection.weight",
              (Reshape(("@0", -1)), Transpose()))]

#: spec name -> (emb spec, proj spec): Tunix's default, P only, and V and P both split
SPECS = {"tunix-default": (("tp", None, "fsdp"), ("fsdp", None, "tp")),
         "p-only": ((None, None, "tp"), (None, None, "tp")),
         "l-and-p": ((None, "fsdp", "tp"), (None, "tp", "fsdp"))}


def _tree(spec: str):
    jax = pytest.importorskip("jax")
    from jax.sharding import NamedSharding, PartitionSpec as PS

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (tests/conftest.py sets 8)")
    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.devices()[:4])
    rng = np.random.default_rng(3)
    full = {"emb": rng.standard_normal((V, L, P)).astype(np.float32),
            "proj": rng.standard_normal((D, L, P)).astype(np.float32)}
    specs = dict(zip(("emb", "proj"), SPECS[spec]))
    tree = {n: jax.device_put(a, NamedSharding(mesh, PS(*specs[n]))) for n, a in full.items()}
    ranks = {int(d.id): i for i, d in enumerate(mesh.devices.flat)}
    return tree, full, ranks


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_a_split_minor_dim_merged_binds_each_shard_as_views_of_hf_boxes(spec):
    """Every piece each rank binds is bit for bit its region of the HF tensor, a view of
    that rank's shard (no copy); the pieces of all ranks cover each HF element once per
    replica."""
    from xreshard.adapters.jax import bind_named, host_view

    tree, full, ranks = _tree(spec)
    hf = NameMap(RULES).apply({n: a.shape for n, a in full.items()})
    bound = bind_named(tree, NameMap(RULES), ranks)
    assert sorted(bound.layouts) == sorted(hf)
    shards = {(ranks[int(s.device.id)], n): host_view(s.data)
              for n, a in tree.items() for s in a.addressable_shards}
    src = {"model.embed_tokens_per_layer.weight": "emb",
           "model.per_layer_model_projection.weight": "proj"}
    for name, layout in bound.layouts.items():
        want = np.ascontiguousarray(hf[name].view(full))
        assert layout.shape == want.shape == ((V, L * P) if "embed" in name else (L * P, D))
        covered = np.zeros(want.shape, int)
        for rank in layout.ranks:
            pieces = bound.bindings[(rank, name)]
            regions = layout.regions(rank)
            assert isinstance(pieces, list) and len(pieces) == len(regions) > 1
            for piece, region in zip(pieces, regions):
                assert piece.tobytes() == want[region.slices()].tobytes(), (name, rank, region)
                assert np.shares_memory(piece, shards[(rank, src[name])]), (name, rank)
                covered[region.slices()] += 1
        assert (covered == (2 if spec == "p-only" else 1)).all(), (name, covered)


@pytest.mark.parametrize("spec", ["tunix-default", "l-and-p"])
def test_the_boxes_refit_exactly_into_a_receiver(spec):
    """The explicit-form send side plans and executes: a receiver on two other ranks (rows
    split, as a vLLM TP=2 engine's replicated embedding or row-parallel weight) gets exactly
    the HF tensors' bytes."""
    from xreshard.adapters.jax import bind_named
    from xreshard.dtypes import numpy_dtype
    from xreshard.planner.schedule import peer_counts, schedule
    from xreshard.runtime.execute import Executor
    from xreshard.tools.testing import local_arrays_from_global
    from xreshard.transport.local import LocalTransport

    tree, full, ranks = _tree(spec)
    hf = NameMap(RULES).apply({n: a.shape for n, a in full.items()})
    bound = bind_named(tree, NameMap(RULES), ranks)
    dst_mesh = Mesh((2,), (4, 5), ("tp",))
    dst = {n: Layout.from_placements(lay.shape, lay.dtype, dst_mesh, ["S0"])
           for n, lay in bound.layouts.items()}
    plan = xr.plan(dict(bound.layouts), dst)
    world = list(range(6))
    sched = schedule(plan, world, peer_counts(plan, world), bucket_bytes=1 << 10,
                     staging_bytes=1 << 12)
    dst_b = {(r, n): np.zeros(lay.local_shape(r), numpy_dtype(lay.dtype))
             for n, lay in dst.items() for r in lay.ranks}
    Executor(sched, plan.src_layouts, plan.dst_layouts, plan.wire_dtypes,
             dict(bound.bindings), dst_b, LocalTransport(world), timeout=30).run()
    for (r, n), got in dst_b.items():
        want = local_arrays_from_global(dst[n], r, np.ascontiguousarray(hf[n].view(full)))
        assert got.tobytes() == want.tobytes(), (r, n)


def test_merged_layout_boxes_and_what_stays_refused():
    """``Layout.merged`` on the pure IR: the boxes of ``[V, L, P]`` with P split, and the
    reshapes that have no box form (a split dim split into several dims, not its run's major
    one) or too many boxes stay refused; only a transpose may follow a merge."""
    mesh = Mesh((2,), (0, 1), ("tp",))
    lay = Layout.product((V, L, P), "float32", mesh, [(2, 0)])
    with pytest.raises(LayoutError, match="non-boxes"):
        lay.reshaped((V, L * P))                         # no product form
    merged, index = lay.merged((V, L * P))
    assert merged.regions(1) == tuple(Region((0, k * P + 2), (V, k * P + 4)) for k in range(L))
    assert index[1] == tuple((slice(None), k, slice(0, 2)) for k in range(L))
    assert lay.merged((V, L * P)) == (merged, index)     # memoized
    with pytest.raises(LayoutError, match="non-boxes"):
        Layout.product((2, 12), "float32", mesh, [(1, 0)]).merged((2, 3, 4))
    with pytest.raises(LayoutError, match="into 48 boxes"):
        Layout.product((48, 4), "float32", mesh, [(1, 0)]).merged((192,), limit=32)
    from xreshard.adapters.naming import ShardedView
    view = ShardedView(lay, {}).reshape((V, -1))
    assert not view.layout.is_product and view.transpose().shape == (L * P, V)
    with pytest.raises(NamingError, match="only a transpose may follow"):
        view.index(0, 0)


def test_merged_reads_the_numpy_reshape_on_every_rank():
    """``Layout.merged`` on every layout of tests/test_layout_ops.py (and ``[V, L, P]`` with
    ``P`` or ``L`` and ``P`` split, torch.chunk's uneven and DTensor's strided splits among
    them) and every merge, split and flatten: refused as non-boxes, or each rank's boxes are
    exactly the elements it holds, each read from its local array by its index."""
    from .test_layout_ops import LAYOUTS, _full, _local, _reshapes

    mesh = Mesh((2, 2), axis_names=("fsdp", "tp"))
    layouts = {**LAYOUTS, "ple": Layout.product((V, L, P), "float32", mesh, [(0, 1), (2, 0)]),
               "l-and-p": Layout.product((V, L, P), "float32", mesh, [(1, 0), (2, 1)])}
    merges = 0
    for name, lay in layouts.items():
        full = _full(lay.shape)
        for shape in _reshapes(lay.shape) + [(full.size,)]:
            try:
                out, index = lay.merged(shape)
            except LayoutError as e:
                assert "non-boxes" in str(e), (name, shape)
                continue
            want = full.reshape(shape)
            for r in lay.mesh.ranks:
                local, boxes = _local(lay, full, r), out.regions(r)
                assert sum(b.size for b in boxes) == lay.num_elements(r), (name, shape, r)
                for ix, box in zip(index[r], boxes, strict=True):
                    got = local[ix].reshape(box.shape)
                    assert np.array_equal(got, want[box.slices()]), (name, shape, r, box)
            merges += len(out.regions(0)) > 1
    assert merges >= 4
