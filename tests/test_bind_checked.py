"""A JAX sending side bound from checked geometries skips the per-binding walk (issue 35).

The JAX adapter compares each (sharding, shape, dtype) it meets with its layout once: the
shape JAX gives every per-device array of that geometry (``sharding.shard_shape``) against
the layout's local shape of each addressable rank, and the dtypes. A side the refit binds
(``refit_bind``) made only of such bindings is ``Bound.checked``, and ``side_problems``
does not walk its thousands of bindings again each call. Everything the adapter cannot
vouch for (a transposed kernel, a receiving side, a side built by hand or handed to the
caller by ``bind``, who may change it, a geometry that disagrees) is walked as before.

Real JAX arrays on 4 CPU devices; the refits over them are in ``test_comm_count``,
``test_refit`` and ``test_bind_cache``.
"""

from __future__ import annotations

import numpy as np
import pytest

from xreshard.ir.layout import LayoutMemo
from xreshard.runtime import binding
from xreshard.runtime.binding import Bound, binding_problems, side_problems

try:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from xreshard.adapters import jax as xjax
    from xreshard.adapters.jax_replay import geometry_agrees
except ImportError:  # pragma: no cover - the jax extra is not installed
    jax = None  # type: ignore[assignment]

from .test_bind_cache import _mesh4

pytestmark = pytest.mark.skipif(jax is None, reason="needs jax: pip install 'xreshard[jax]'")


def _tree(mesh) -> dict:
    import ml_dtypes
    base = np.arange(64, dtype=np.float32).reshape(8, 8)
    return {"rows": jax.device_put(base, NamedSharding(mesh, P("a", None))),
            "grid": jax.device_put(base, NamedSharding(mesh, P("a", "b"))),
            "both": jax.device_put(base, NamedSharding(mesh, P(("a", "b"), None))),
            "whole": jax.device_put(base[0], NamedSharding(mesh, P())),
            "bf16": jax.device_put(base.astype(ml_dtypes.bfloat16),
                                   NamedSharding(mesh, P(None, "b")))}


def _refit_bind(tree: dict, ranks: dict, side: str = "send", **kw) -> Bound:
    from xreshard.runtime.registry import BindContext
    kw.setdefault("memo", LayoutMemo())
    kw.setdefault("cache", {})
    return xjax.refit_bind(tree, side, BindContext(ranks=ranks, local_ranks=tuple(
        ranks.values()), **kw))


def _problems(bound: Bound, ranks: dict) -> list:
    local = list(ranks.values())
    return side_problems({"send": bound, "receive": None}, local, lambda r: r in local, None)


def test_a_checked_jax_side_is_not_walked_and_the_walk_would_agree(monkeypatch):
    mesh, ranks = _mesh4()
    memo, cache = LayoutMemo(), {}
    tree = _tree(mesh)
    for step in range(3):       # the first call, the same arrays, a step's new arrays
        if step == 2:
            tree = jax.tree.map(lambda a: a + 1, tree)
        bound = _refit_bind(tree, ranks, memo=memo, cache=cache)
        assert bound.checked
        assert binding_problems(bound.layouts, bound.bindings, "send", ranks.values()) == []
        for name, arr in tree.items():        # and the bindings are the shards' own bytes
            for s in arr.addressable_shards:
                got = bound.bindings[(ranks[s.device.id], name)]
                assert got.tobytes() == np.asarray(s.data).tobytes()

        def walked(*a, **k):
            raise AssertionError("a checked side was walked again")
        with monkeypatch.context() as m:
            m.setattr(binding, "binding_problems", walked)
            assert _problems(bound, ranks) == []


def test_what_the_adapter_cannot_vouch_for_is_walked():
    mesh, ranks = _mesh4()
    tree = _tree(mesh)
    flipped = _refit_bind(tree, ranks, transpose=frozenset({"grid"}))
    assert not flipped.checked and _problems(flipped, ranks) == []
    # a receiving side's buffers are the adapter's own, taken for this call alone: vouched
    # for (and the walk agrees); the public bind hands them to the caller: walked
    received = _refit_bind(tree, ranks, "receive")
    assert received.checked and received.fresh
    assert binding_problems(received.layouts, received.bindings, "receive", ranks.values()) == []
    handed_in = xjax.bind(tree, "receive", ranks=ranks)
    assert not handed_in.checked and not handed_in.fresh
    # bind() hands its Bound to the caller, who may change it before passing it to a refit
    handed = xjax.bind(tree, "send", ranks=ranks)
    assert _refit_bind(tree, ranks).checked and not handed.checked
    handed.bindings[(0, "rows")] = np.zeros((3, 8), np.float32)
    assert any("'rows' on rank 0" in p[1] for p in _problems(handed, ranks))
    # a side built by hand with a wrong shape is refused, as ever
    good = _refit_bind(tree, ranks)
    bad = dict(good.bindings)
    bad[(0, "rows")] = np.zeros((3, 8), np.float32)
    by_hand = Bound(dict(good.layouts), bad)
    assert not by_hand.checked
    problems = _problems(by_hand, ranks)
    assert problems and problems[0][0] == "BindingError" and "'rows' on rank 0" in problems[0][1]


def test_a_geometry_that_disagrees_with_its_layout_is_not_vouched_for():
    mesh, ranks = _mesh4()
    tree = _tree(mesh)
    rank_of = xjax._rank_of(ranks)
    leaf = tree["rows"]
    shard_ranks = xjax._shard_ranks(leaf.sharding, rank_of)
    assert shard_ranks is not None
    right = xjax.layout_of(leaf, ranks=ranks)
    local = frozenset(ranks.values())
    assert geometry_agrees(leaf, right, shard_ranks, local)
    for wrong in (xjax.layout_of(tree["grid"], ranks=ranks),           # other local shapes
                  xjax.layout_of(tree["bf16"], ranks=ranks),           # other dtype
                  xjax.layout_of(leaf, ranks={d: r + 4 for d, r in ranks.items()})):
        assert not geometry_agrees(leaf, wrong, shard_ranks, local)
    assert not geometry_agrees(leaf, right, None, local)  # JAX did not list the devices
    assert not geometry_agrees(leaf, right, shard_ranks[:1] * 4, local)  # a rank twice
    # a rank of this process that the layout gives elements but no shard binds
    assert not geometry_agrees(leaf, right, shard_ranks[:3], local)
    assert geometry_agrees(leaf, right, shard_ranks[:3], local - {shard_ranks[3][0]})
