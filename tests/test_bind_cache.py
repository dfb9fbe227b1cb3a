"""Binding a side a refit bound before is a lookup, never a stale answer (issue 35).

A warm call over the same objects, or over new arrays of the same shardings (what an
optimizer step hands back), looks up what it bound before instead of walking every shard
and spec again; but whatever the binding was made of that can change in place (a torch
tensor's memory, shape, strides, dtype, a DTensor's spec or local tensor; a JAX array's
sharding, shape, dtype) is looked at every call, and a change binds anew, so the checks
that stand between a caller and a wrong weight (``binding_problems``) see the new state.

Real JAX arrays on 8 CPU devices, real DTensors over a one-process gloo group; the
multi-process end of it is in ``test_comm_count`` (new arrays each call, the collectives
of a warm plain call pinned) and ``test_refit``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.ir.layout import LayoutMemo
from xreshard.runtime.binding import binding_problems

try:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from xreshard.adapters import jax as xjax
except ImportError:  # pragma: no cover - the jax extra is not installed
    jax = None  # type: ignore[assignment]

try:
    import torch

    from xreshard.adapters import torch as xtorch
except ImportError:  # pragma: no cover - the torch extra is not installed
    torch = None  # type: ignore[assignment]

needs_jax = pytest.mark.skipif(jax is None, reason="needs jax: pip install 'xreshard[jax]'")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch: pip install 'xreshard[torch]'")


# ------------------------------------------------------------------------------------ JAX

def _mesh4() -> tuple:
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip(f"needs 4 JAX CPU devices (JAX_NUM_CPU_DEVICES=8), found {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    return mesh, {d.id: i for i, d in enumerate(devices[:4])}


def _shards_of(arr: Any, ranks: dict) -> dict:
    return {ranks[s.device.id]: np.asarray(s.data) for s in arr.addressable_shards}


def _assert_bound_exactly(bound, tree: dict, ranks: dict) -> None:
    """Every binding is the bytes of its array's shard on that rank, and checks clean."""
    for name, arr in tree.items():
        for rank, want in _shards_of(arr, ranks).items():
            got = bound.bindings[(rank, name)]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, rank)
    assert binding_problems(bound.layouts, bound.bindings, "send", ranks.values()) == []


@needs_jax
def test_jax_warm_bind_over_new_arrays_of_the_same_shardings_builds_no_shards(monkeypatch):
    """After an optimizer step (new arrays, new equal sharding objects) the bind finds each
    array's layout and shard ranks by its geometry: no ``Shard`` object is built, no layout
    converted; the bindings are the new arrays' bytes."""
    from jax._src import array as jax_array
    mesh, ranks = _mesh4()
    rows = NamedSharding(mesh, P("a", "b"))
    tree = {f"w{i}": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4) + i, rows)
            for i in range(5)}
    memo, cache = LayoutMemo(), {}
    first = xjax.bind(tree, "send", ranks=ranks, memo=memo, cache=cache)
    _assert_bound_exactly(first, tree, ranks)

    built = []
    real_shard = jax_array.Shard.__init__

    def counting(self, *a, **k):
        built.append(1)
        real_shard(self, *a, **k)
    monkeypatch.setattr(jax_array.Shard, "__init__", counting)
    converted = []
    monkeypatch.setattr(xjax, "layout_of", lambda *a, **k: converted.append(1))
    stepped = jax.tree.map(lambda a: a * 3 + 1, tree)       # new arrays, same shardings
    again = xjax.bind(stepped, "send", ranks=ranks, memo=memo, cache=cache)
    assert built == [] and converted == []
    assert all(again.layouts[n] is first.layouts[n] for n in tree)
    monkeypatch.undo()
    _assert_bound_exactly(again, stepped, ranks)


@needs_jax
def test_jax_warm_bind_sees_a_changed_sharding_shape_or_dtype():
    """What an array of a new geometry binds is its own: another sharding, shape or dtype
    under the same name is converted and bound anew, never the last call's."""
    mesh, ranks = _mesh4()
    memo, cache = LayoutMemo(), {}
    base = np.arange(32, dtype=np.float32).reshape(8, 4)
    tree = {"w": jax.device_put(base, NamedSharding(mesh, P("a", "b")))}
    first = xjax.bind(tree, "send", ranks=ranks, memo=memo, cache=cache)
    for changed in (jax.device_put(base, NamedSharding(mesh, P("b", "a"))),      # sharding
                    jax.device_put(base, NamedSharding(mesh, P(None, ("a", "b")))),
                    jax.device_put(base.reshape(4, 8), NamedSharding(mesh, P("a", "b"))),
                    jax.device_put(base.astype(np.float16), NamedSharding(mesh, P("a", "b")))):
        bound = xjax.bind({"w": changed}, "send", ranks=ranks, memo=memo, cache=cache)
        assert bound.layouts["w"] != first.layouts["w"]
        assert bound.layouts["w"] == xjax.layout_of(changed, ranks=ranks)
        _assert_bound_exactly(bound, {"w": changed}, ranks)
    # another rank map, through memos that number rank maps anew (no memo: a fresh one
    # per bind, as Tuning(layout_memo=False) does): its own ranks, not the cached ones
    shifted = {d: r + 10 for d, r in ranks.items()}
    for rank_map in (ranks, shifted, ranks):
        bound = xjax.bind(tree, "send", ranks=rank_map, cache=cache)
        assert bound.layouts["w"].ranks == tuple(sorted(rank_map.values()))
        assert {r for r, _ in bound.bindings} == set(rank_map.values())
    # and back: the first geometry again binds the first layout, the new array's bytes
    back = {"w": jax.device_put(base + 7, NamedSharding(mesh, P("a", "b")))}
    bound = xjax.bind(back, "send", ranks=ranks, memo=memo, cache=cache)
    assert bound.layouts["w"] is first.layouts["w"]
    _assert_bound_exactly(bound, back, ranks)


# ------------------------------------------------------------------------------------ torch

def _dt(mesh, local, placements=None):
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(local, mesh, placements or [Shard(0)], run_check=False)


def _bind(state, cache, memo, side="receive", transpose=frozenset()):
    return xtorch.bind(state, side, ranks={0: 0}, local_ranks=[0], memo=memo, cache=cache,
                       transpose=transpose)


def _writes_land(bound, state: dict, transpose=frozenset()) -> None:
    """Writing each receiving binding writes exactly the tensor it is bound to."""
    for name, value in state.items():
        b = bound.bindings[(0, name)]
        b = b[0] if isinstance(b, list) else b      # a plain tensor: one explicit region
        b[...] = np.arange(b.size, dtype=b.dtype).reshape(b.shape) + 1
        local = value.to_local() if hasattr(value, "to_local") else value
        got = local.t() if name in transpose else local
        assert got.contiguous().numpy().tobytes() == np.ascontiguousarray(b).tobytes(), name


@needs_torch
def test_torch_warm_bind_of_unchanged_tensors_is_a_lookup(gloo1):
    """The same state dict again: the same views (no tensor exported again), the same
    layouts, checks clean, and writes still land in the tensors."""
    state = {f"w{i}": _dt(gloo1, torch.zeros(4, 3)) for i in range(4)}
    state["plain"] = torch.zeros(2, 2)
    state["t"] = _dt(gloo1, torch.zeros(3, 5))
    memo, cache = LayoutMemo(), {}
    first = _bind(state, cache, memo, transpose=frozenset({"t"}))
    again = _bind(state, cache, memo, transpose=frozenset({"t"}))
    assert all(again.bindings[k] is first.bindings[k] for k in first.bindings)
    assert all(again.layouts[n] is first.layouts[n] for n in first.layouts)
    assert again.local_only == first.local_only == {"plain"}
    assert binding_problems(again.layouts, again.bindings, "receive", [0]) == []
    _writes_land(again, state, frozenset({"t"}))


@needs_torch
def test_torch_warm_bind_sees_every_in_place_change(gloo1, monkeypatch):
    """A tensor changed in place since the last call binds anew: new memory (``set_``)
    is written, not the old; a new shape, dtype or strides reaches the checks (a wrong
    shape or dtype is refused there); a DTensor given another spec gets its layout."""
    from torch.distributed.tensor import Replicate, Shard
    memo, cache = LayoutMemo(), {}
    state = {"w": _dt(gloo1, torch.zeros(4, 3)), "plain": torch.zeros(4, 3)}
    local = xtorch._local_of(state["w"])            # the DTensor's own local tensor
    first = _bind(state, cache, memo)
    assert binding_problems(first.layouts, first.bindings, "receive", [0]) == []

    # new memory, same shape: the binding is the new memory
    local.set_(torch.zeros(4, 3))
    state["plain"].set_(torch.zeros(4, 3))
    moved = _bind(state, cache, memo)
    assert moved.bindings[(0, "w")] is not first.bindings[(0, "w")]
    _writes_land(moved, state)

    # strides: the same elements laid out column-major; the view follows them
    local.set_(torch.zeros(3, 4).t())
    strided = _bind(state, cache, memo)
    assert binding_problems(strided.layouts, strided.bindings, "receive", [0]) == []
    _writes_land(strided, state)

    # a shape the layout does not have: refused, naming the tensor
    local.resize_(2, 3)
    problems = binding_problems(*_parts(_bind(state, cache, memo)))
    assert any("'w'" in p and "local shape (2, 3)" in p for p in problems), problems
    state["plain"].set_(torch.zeros(5, 3))
    plain = _bind(state, cache, memo)
    assert plain.layouts["plain"].shape == (5, 3)

    # a dtype the layout does not have (the local tensor's data replaced)
    local.resize_(4, 3)
    local.data = torch.zeros(4, 3, dtype=torch.float64)
    problems = binding_problems(*_parts(_bind(state, cache, memo)))
    assert any("'w'" in p and "local dtype float64" in p for p in problems), problems

    # a DTensor whose spec or local tensor changed
    state["w"] = _dt(gloo1, torch.zeros(4, 3), [Replicate()])
    spec = _bind(state, cache, memo)
    assert spec.layouts["w"] == xtorch.layout_of(state["w"], ranks={0: 0})
    state["w"]._local_tensor = torch.zeros(4, 3)
    swapped = _bind(state, cache, memo)
    _writes_land(swapped, state)
    # the same DTensor given another spec object (of other placements): converted anew
    converted = []
    real = xtorch.layout_of
    monkeypatch.setattr(xtorch, "layout_of", lambda *a, **k: converted.append(1) or real(*a, **k))
    _bind(state, cache, memo)
    assert converted == []
    state["w"]._spec = _dt(gloo1, torch.zeros(4, 3), [Shard(1)])._spec
    respecced = _bind(state, cache, memo)
    assert converted == [1]
    assert respecced.layouts["w"] == real(state["w"], ranks={0: 0})


@needs_torch
def test_torch_bind_cache_is_per_rank_map_and_names(gloo1):
    """Another rank map or another names= mapping binds anew (names, ranks follow)."""
    memo, cache = LayoutMemo(), {}
    state = {"w": _dt(gloo1, torch.zeros(4, 3))}
    first = _bind(state, cache, memo)
    shifted = xtorch.bind(state, "receive", ranks={0: 5}, local_ranks=[5], memo=memo,
                          cache=cache)
    assert list(shifted.bindings) == [(5, "w")] and shifted.layouts["w"].ranks == (5,)
    renamed = xtorch.bind(state, "receive", ranks={0: 0}, local_ranks=[0], memo=memo,
                          cache=cache, names={"w": "v"})
    assert list(renamed.layouts) == ["v"] and list(renamed.bindings) == [(0, "v")]
    again = _bind(state, cache, memo)
    assert list(again.layouts) == ["w"] and again.layouts["w"] == first.layouts["w"]
    # memos that number rank maps anew (none given: a fresh one per bind)
    for rank in (0, 5, 0):
        bound = xtorch.bind(state, "receive", ranks={0: rank}, local_ranks=[rank], cache=cache)
        assert list(bound.bindings) == [(rank, "w")] and bound.layouts["w"].ranks == (rank,)


def _parts(bound) -> tuple:
    return bound.layouts, bound.bindings, "receive", [0]


# ------------------------------------------------------------------------------- overlaps

def test_overlap_sweep_is_redone_when_an_array_changes():
    """The receiving arrays found not to overlap are remembered weakly; the same arrays
    again are not swept again, but any other array (or one reshaped in place) is."""
    from xreshard.runtime.binding import _overlaps
    base = np.zeros(64, np.float32)
    a, b = base[:32], base[32:]
    items = [("a", a), ("b", b)]
    assert _overlaps(items) == []
    assert _overlaps(items) == []                   # the same: remembered
    c = base[16:48]                                 # overlaps both
    assert len(_overlaps([("a", a), ("c", c)])) == 1
    assert _overlaps(items) == []
    b.shape = (2, 16)                               # the same object, reshaped: swept again
    assert _overlaps([("a", a), ("b", b)]) == []
    b = base[32:48]
    assert _overlaps([("a", a), ("b", b)]) == []
    b.strides = (-4,)           # the same object, now running back over a's last elements
    assert len(_overlaps([("a", a), ("b", b)])) == 1


# ------------------------------------------------------------------- across real processes

R, C = 32, 16


def _trainer(ctx: Any) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr
    from xreshard.errors import BindingError

    world = ctx.join(groups=["trainer", "rollout"])
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.local_devices())
    base = jnp.arange(R * C, dtype=jnp.float32).reshape(R, C)
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=60))
    for step in range(4):       # a new array of the same sharding every call (a step's output)
        # column blocks: each lands in a receiver's rows as a strided block (via staging)
        w = jax.device_put(base * (step + 1), NamedSharding(mesh, P(None, "tp")))
        try:
            refit(send={"w": w})
        except BindingError as e:
            out = {"error": type(e).__name__, "calls": step}
            break
    else:
        out = {"error": None, "calls": 4}
    world.close()
    return out


def _rollout(ctx: Any) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xreshard as xr
    from xreshard.errors import BindingError
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store),
                            rank=ctx.role.index, world_size=2)
    world = ctx.join(groups=["trainer", "rollout"])
    mesh = init_device_mesh("cpu", (2,))

    def dtensor() -> Any:
        return DTensor.from_local(torch.zeros(R // 2, C), mesh, [Shard(0)],
                                  shape=torch.Size((R, C)), stride=(C, 1), run_check=False)
    state = {"w": dtensor()}
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60))
    rows = slice(ctx.role.index * R // 2, (ctx.role.index + 1) * R // 2)
    want = lambda step: (np.arange(R * C, dtype=np.float32).reshape(R, C)  # noqa: E731
                         * (step + 1))[rows].tobytes()
    exact, kept, error = [], [], None
    for step in range(4):
        local = xtorch._local_of(state["w"])
        old = local.clone()
        if step == 1:       # new memory under the same DTensor and local tensor
            local.set_(torch.zeros(R // 2, C))
        elif step == 2:     # a new DTensor under the same name
            swapped = local
            state["w"] = dtensor()
        elif step == 3:     # a local tensor the layout does not fit
            local.set_(torch.zeros(R // 4, C))
        try:
            refit()
        except BindingError as e:
            error = (type(e).__name__, "local shape (8, 16)" in str(e))
            break
        exact.append(xtorch._local_of(state["w"]).numpy().tobytes() == want(step))
        if step == 2:       # the tensor swapped out was not written
            kept.append(swapped.numpy().tobytes() == old.numpy().tobytes())
    world.close()
    dist.destroy_process_group()
    return {"exact": exact, "kept": kept, "error": error}


@needs_jax
@needs_torch
@pytest.mark.slow
def test_refits_land_in_memory_changed_between_calls_and_refuse_a_wrong_shape():
    """Warm calls into destinations changed between calls: new memory under the same
    DTensor, a new DTensor, then a local tensor of the wrong shape. Each call's bytes land
    bit-exact in the memory the destination has now (not the memory it had, which keeps
    its last bytes), and the wrong shape is refused on every process with BindingError."""
    from xreshard.tools.launch import Role, launch
    roles = [Role("jax", "trainer", 0, num_devices=4),
             Role("torch", "rollout", 0), Role("torch", "rollout", 1)]
    results = launch([_trainer, _rollout, _rollout], roles, timeout=150)
    assert results[0].value == {"error": "BindingError", "calls": 3}
    for res in results[1:]:
        assert res.value == {"exact": [True, True, True], "kept": [True],
                             "error": ["BindingError", True]}, res.value
