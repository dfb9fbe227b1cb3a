"""A sending JAX refit reads small shards through jitted per-device stacks (issue 35, the
warm call; ``xreshard/adapters/jax_stack.py``): from a geometry's second call on, the
bindings of arrays of at most 8 KiB per shard are slices of one stacked block per device,
bit for bit the shards' bytes, holding the values the arrays had at bind time.

Real JAX arrays with real NamedShardings on 4 CPU devices; the last test runs a JAX
trainer and two torch receivers (DTensors over gloo) in real processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from xreshard.adapters import jax as xjax  # noqa: E402
from xreshard.adapters import jax_stack  # noqa: E402

from . import refit_cases as cases  # noqa: E402


def _mesh() -> Any:
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (JAX_NUM_CPU_DEVICES)")
    return jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices()[:4])


#: base name -> (shape, spec on ("a", "b"), dtype, copies): each base is one geometry
GROUPS = {
    "rows": ((16, 8), ("a",), "float32", 9),
    "cols": ((8, 6), (None, "b"), "bfloat16", 12),
    "both": ((8, 6), ("a", "b"), "float32", 20),       # K = 32: a short chunk
    "repl": ((6, 5), (), "bfloat16", 10),
    "uneven": ((7, 3), (), "int8", 8),
    "fp8": ((4, 16), ("b",), "float8_e4m3fn", 8),
    "flags": ((8,), ("b",), "bool", 9),
    "half": ((8, 4), ("a",), "float16", 8),
    "scalar": ((), (), "float32", 9),                   # rows of a stack are 0-d views
    "many": ((4, 4), (("a", "b"),), "float32", 520),   # K = 256 (received: 128): three
                                                        # chunks (five), one short
    "few": ((8, 8), ("a",), "float32", 3),              # under MIN_GROUP: views
    "large": ((64, 128), ("a",), "float32", 8),         # 16 KiB shards: views
}
STACKED = {"rows", "cols", "both", "repl", "uneven", "fp8", "flags", "half", "scalar", "many"}


def _tree(mesh: Any, step: int) -> dict:
    from jax.sharding import NamedSharding, PartitionSpec as P
    tree = {}
    for base, (shape, spec, dtype, copies) in GROUPS.items():
        for i in range(copies):
            value = cases.pattern(f"{base}.{i}", shape, "float32", step)
            if dtype == "bool":
                value = value > 0
            elif dtype == "int8":
                value = (value * 40).astype(np.int8)
            else:
                value = value.astype(jax.numpy.dtype(dtype))
            tree[f"{base}.{i}"] = jax.device_put(value, NamedSharding(mesh, P(*spec)))
    return tree


def _context(mesh: Any) -> Any:
    from xreshard.ir.layout import LayoutMemo
    from xreshard.runtime.registry import BindContext
    ranks = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    return BindContext(ranks=ranks, local_ranks=(0, 1, 2, 3), memo=LayoutMemo(), cache={})


def _shard_bytes(tree: dict, ranks: dict) -> dict:
    """(world rank, name) -> the shard's bytes, read from JAX's own shards."""
    return {(ranks[s.device.id], n): np.asarray(s.data).tobytes()
            for n, a in tree.items() for s in a.addressable_shards}


#: the stacked blocks jax_stack handed out in this process (kept alive: compared by id)
_BLOCKS: dict[int, np.ndarray] = {}


@pytest.fixture(autouse=True)
def _spy_blocks(monkeypatch):
    real = jax_stack.stack_blocks       # what the walk's stacks and a replay's read

    def spy(*args: Any) -> Any:
        got = real(*args)
        for per_device, _ in got or ():
            for _, block in per_device:
                root = _root(block)
                _BLOCKS[id(root)] = root
        return got
    monkeypatch.setattr(jax_stack, "stack_blocks", spy)
    yield
    _BLOCKS.clear()


def _root(view: np.ndarray) -> np.ndarray:
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


def _a_row(view: np.ndarray) -> bool:
    """Whether a receive binding is a row of a block: its memory's owner holds more than
    the binding and the alignment slack (a buffer of its own is exactly that)."""
    from xreshard.adapters.jax_landing import ALIGN
    return _root(view).nbytes > view.nbytes + ALIGN


def _stack_block(view: np.ndarray) -> np.ndarray | None:
    """The stacked block a binding is a slice of, or None (a view of its own shard)."""
    return _BLOCKS.get(id(_root(view)))


def test_the_second_bind_reads_small_shards_through_stacks_bit_exact():
    mesh = _mesh()
    context = _context(mesh)
    ranks = dict(context.ranks)
    for step in range(3):
        tree = _tree(mesh, step)        # new arrays every step, as after an optimizer step
        bound = xjax.refit_bind(tree, "send", context)
        want = _shard_bytes(tree, ranks)
        assert set(bound.bindings) == set(want)
        for key, view in bound.bindings.items():
            assert np.asarray(view).tobytes() == want[key], key
            stacked = _stack_block(view) is not None
            # the first call compiles nothing; small geometries are stacked from then on
            assert stacked == (step > 0 and key[1].split(".")[0] in STACKED), (step, key)
        assert bound.checked


def test_a_stacked_binding_keeps_the_values_the_arrays_had_when_bound():
    """The stack copies when it runs: a step that donates the arrays after the bind (a
    started refit still reading) leaves the bindings' bytes as they were."""
    mesh = _mesh()
    context = _context(mesh)
    tree = _tree(mesh, 0)
    xjax.refit_bind(tree, "send", context)
    tree = _tree(mesh, 1)
    want = _shard_bytes(tree, dict(context.ranks))
    bound = xjax.refit_bind(tree, "send", context)
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + a, p), donate_argnums=0)
    small = {n: a for n, a in tree.items() if n.split(".")[0] in STACKED - {"flags"}}
    jax.block_until_ready(step(small))
    assert all(a.is_deleted() for a in small.values())      # really donated
    for key, view in bound.bindings.items():
        if key[1] in small:
            assert np.asarray(view).tobytes() == want[key], key


def test_a_stack_that_fails_leaves_its_geometry_to_views(monkeypatch):
    mesh = _mesh()
    context = _context(mesh)
    calls = []

    def broken(out: Any) -> Any:
        calls.append(out)
        raise RuntimeError("no stack here")
    monkeypatch.setattr(jax_stack, "_program", broken)
    monkeypatch.setattr(jax_stack, "_refused", set())
    xjax.refit_bind(_tree(mesh, 0), "send", context)
    for step in (1, 2):
        tree = _tree(mesh, step)
        bound = xjax.refit_bind(tree, "send", context)
        want = _shard_bytes(tree, dict(context.ranks))
        assert all(np.asarray(v).tobytes() == want[k] and _stack_block(v) is None
                   for k, v in bound.bindings.items())
    assert len(calls) == len(STACKED)       # each geometry tried once, then left to views
    assert len(jax_stack.stack_refused()) == len(STACKED)


def test_a_deleted_array_is_refused_as_without_stacks_and_its_geometry_still_stacks():
    mesh = _mesh()
    context = _context(mesh)
    xjax.refit_bind(_tree(mesh, 0), "send", context)
    tree = _tree(mesh, 1)
    tree["rows.4"].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        xjax.refit_bind(tree, "send", context)
    with pytest.raises(RuntimeError, match="deleted"):     # the same error, stacks or not
        xjax.bind(tree, "send", ranks=dict(context.ranks))
    assert not jax_stack.stack_refused()
    tree = _tree(mesh, 2)
    bound = xjax.refit_bind(tree, "send", context)
    assert _stack_block(bound.bindings[(0, "rows.4")]) is not None


def test_one_shot_binds_compile_nothing(monkeypatch):
    """The public ``bind`` (a fresh cache every call) never stacks."""
    mesh = _mesh()
    called = []
    monkeypatch.setattr(jax_stack, "_program", lambda out: called.append(out))
    tree = _tree(mesh, 0)
    for _ in range(2):
        bound = xjax.bind(tree, "send", ranks={d.id: i for i, d in enumerate(mesh.devices.flat)})
        assert all(_stack_block(v) is None for v in bound.bindings.values())
    assert not called


def test_the_naming_rules_path_reads_small_shards_through_stacks_from_its_second_call():
    """``bind_rules`` with a refit's cache: every HF binding (transposed and reshaped views
    of the trainer's shards included) holds bit for bit what the per-shard path binds."""
    from xreshard.adapters.naming import NameMap, Reshape, Rule, Transpose
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = _mesh()
    ranks = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    rules = NameMap((Rule("layers/{i}/norm", "model.layers.{i}.norm.weight"),
                     Rule("layers/{i}/kernel", "model.layers.{i}.proj.weight", (Transpose(),)),
                     Rule("layers/{i}/heads", "model.layers.{i}.q.weight",
                          (Reshape(("@0", -1)),))))
    cache: dict = {}

    def tree(step: int) -> dict:
        out = {}
        for i in range(10):
            for leaf, shape, spec in (("norm", (16,), ("b",)), ("kernel", (8, 12), ("a", "b")),
                                      ("heads", (8, 2, 4), ("a", None, "b"))):
                value = cases.pattern(f"{leaf}{i}", shape, "bfloat16", step)
                out[f"layers/{i}/{leaf}"] = jax.device_put(value, NamedSharding(mesh, P(*spec)))
        return out
    for step in range(3):
        params = tree(step)
        bound = xjax.bind_rules(params, rules, ranks, cache=cache)
        plain = xjax.bind_rules(params, rules, ranks)            # no cache: shard by shard
        assert set(bound.bindings) == set(plain.bindings)
        for key, got in bound.bindings.items():
            want = plain.bindings[key]
            pairs = list(zip(got, want)) if isinstance(got, list) else [(got, want)]
            assert len(pairs) == (len(want) if isinstance(want, list) else 1)
            for view, piece in pairs:
                assert view.shape == piece.shape and view.tobytes() == piece.tobytes(), key
                assert (_stack_block(view) is not None) == (step > 0), (step, key)
                assert _stack_block(piece) is None


# ------------------------------------------------------- a receiving JAX side

def _bits_tree(mesh: Any, step: int) -> dict:
    """GROUPS' arrays of raw bit patterns: every float bit pattern may come up (NaNs with
    payloads, signalling NaNs, -0, subnormals), which a copy keeps and arithmetic would not."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    tree = {}
    for base, (shape, spec, dtype, copies) in GROUPS.items():
        np_dtype = jax.numpy.dtype(dtype)
        for i in range(copies):
            rng = np.random.default_rng([step, i, len(base)])
            if dtype == "bool":
                value = rng.integers(0, 2, shape).astype(bool)
            else:
                raw = rng.integers(0, 256, (*shape, np_dtype.itemsize), dtype=np.uint8)
                value = raw.view(np_dtype).reshape(shape)
            tree[f"{base}.{i}"] = jax.device_put(value, NamedSharding(mesh, P(*spec)))
    return tree


def _templates(mesh: Any) -> dict:
    """GROUPS' templates on the same mesh with its devices reversed: every shard moves."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    flipped = jax.sharding.Mesh(mesh.devices[::-1, ::-1], mesh.axis_names)
    return {f"{base}.{i}": jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                                sharding=NamedSharding(flipped, P(*spec)))
            for base, (shape, spec, dtype, copies) in GROUPS.items() for i in range(copies)}


@contextlib.contextmanager
def _solo(mesh: Any) -> Iterator[Any]:
    """A one-process world whose ranks are ``mesh``'s 4 devices."""
    import xreshard as xr
    server = xr.serve()
    world = xr.World.join(server.address, "solo", list(mesh.devices.flat), num_processes=1,
                          index=0, timeout=30)
    try:
        yield world
    finally:
        world.close()
        server.close()


def _raw(a: Any) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def test_a_receiving_bind_lands_rows_that_unstack_bit_exact_without_a_world():
    """The receiving side alone (no world, no torch: the newest-JAX leg runs it): each
    binding is written with its shard's bytes as a refit would, and the arrays ``finish``
    builds hold them bit for bit, sharded as the templates."""
    mesh = _mesh()
    templates = _templates(mesh)
    context = _context(mesh)
    ranks = dict(context.ranks)
    for step in range(3):
        src = _bits_tree(mesh, step)
        bound = xjax.refit_bind(templates, "receive", context)
        for n, arr in src.items():
            # each destination shard's bytes cut from the source with numpy (JAX's own
            # device_put reshard makes bf16 NaN payloads canonical: not a reference here)
            value = np.asarray(arr)
            for device, index in templates[n].sharding.addressable_devices_indices_map(
                    arr.shape).items():
                view = bound.bindings[(ranks[device.id], n)]
                bytes_of = np.ascontiguousarray(value[index]).reshape(-1).view(np.uint8)
                view.reshape(-1).view(np.uint8)[...] = bytes_of     # (0-d ones too)
            assert _a_row(bound.bindings[(0, n)]) == (
                step > 0 and n.split(".")[0] in STACKED), (step, n)
        got = bound.finish()
        for n, a in src.items():
            assert got[n].sharding == templates[n].sharding and _raw(got[n]) == _raw(a), n


@pytest.mark.parametrize("features", [{}, {"delta": True, "verify": True}, {"atomic": True},
                                      {"check_writes": True}])
def test_a_jax_receiver_lands_small_shards_in_stacks_bit_exact(features, monkeypatch):
    """A one-process JAX -> JAX refit, three calls of new bit patterns: from the second
    call, every small geometry lands in stack blocks and comes out of the jitted unstack
    bit for bit, with the templates' shardings, alone and with each feature."""
    pytest.importorskip("torch")      # the world's store is torch's TCPStore
    import xreshard as xr
    mesh = _mesh()
    unstacked: list[int] = []
    real = jax_stack.unstacked

    def spy(jx: Any, chunk: Any) -> Any:
        unstacked.append(len(chunk.at))
        return real(jx, chunk)
    monkeypatch.setattr(jax_stack, "unstacked", spy)
    templates = _templates(mesh)
    with _solo(mesh) as world:
        refit = xr.Refit(world, receive=templates, config=xr.RefitConfig(timeout=60, **features))
        for step in range(3):
            unstacked.clear()
            src = _bits_tree(mesh, step)
            refit(send=src)
            got = refit.received
            for name, arr in src.items():
                assert got[name].sharding == templates[name].sharding, name
                assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
                assert _raw(got[name]) == _raw(arr), (step, name)
            want = 0 if step == 0 else sum(GROUPS[b][3] for b in STACKED)
            assert sum(unstacked) == want, (step, unstacked)
        # the arrays compute like any other
        jax.block_until_ready(jax.numpy.stack([got[f"rows.{i}"] for i in range(9)]) + 0)


def test_a_receive_whose_unstack_fails_keeps_every_byte(monkeypatch):
    """If the jitted unstack cannot run, each leaf is assembled from copies of its rows,
    bit for bit, and its geometry lands shard by shard from then on."""
    pytest.importorskip("torch")      # the world's store is torch's TCPStore
    import xreshard as xr
    mesh = _mesh()
    monkeypatch.setattr(jax_stack, "_refused", set())

    def broken(out: Any, sharding: Any) -> Any:
        raise RuntimeError("no unstack here")
    monkeypatch.setattr(jax_stack, "_unstack_program", broken)
    templates = _templates(mesh)
    with _solo(mesh) as world:
        refit = xr.Refit(world, receive=templates, config=xr.RefitConfig(timeout=60))
        for step in range(3):
            src = _bits_tree(mesh, step)
            refit(send=src)
            assert all(_raw(refit.received[n]) == _raw(a) for n, a in src.items()), step
        assert len(jax_stack.stack_refused()) == len(STACKED)


# ---------------------------------------------------------------- real processes

#: every spec form of the JAX -> torch cases, 9 tensors each (one geometry, stacked from
#: the second call), and one form with 3 (views)
NAMES = {f"{base}.{i}": entry for base, entry in cases.JAX_TORCH_TENSORS.items()
         for i in range(9 if base != "bias" else 3)}
STEPS = 4


def stack_sender(ctx: Any, dtype: str) -> dict:
    import xreshard as xr
    from xreshard.adapters import jax_replay, jax_stack as stacks
    from xreshard.runtime import hostcopy

    stacked: list[int] = []
    replayed: list[bool] = []
    row_runs: list[int] = []
    real, real_replay, real_rows = stacks.stack_blocks, jax_replay.replay, hostcopy._rows_into

    def spy(key: Any, out: Any, leaves: Any, *args: Any) -> Any:
        got = real(key, out, leaves, *args)
        stacked[-1] += 0 if got is None else len(leaves)
        return got

    def spy_replay(*args: Any) -> Any:
        got = real_replay(*args)
        replayed[-1] = got is not None
        return got

    def spy_rows(*args: Any) -> bool:
        got = real_rows(*args)
        row_runs[-1] += got
        return got
    # looked up per call: jax_stack's own and jax_replay's stacks, replayed(), pack_runs
    stacks.stack_blocks, jax_replay.replay, hostcopy._rows_into = spy, spy_replay, spy_rows
    try:
        world = ctx.join(groups=["trainer", "rollout"])
        refit = xr.Refit(world, transpose={n for n, t in NAMES.items() if "T" in t[3]},
                         config=xr.RefitConfig(timeout=60))
        for step in range(STEPS):
            stacked.append(0)
            replayed.append(False)
            row_runs.append(0)
            refit(send=cases._jax_params(NAMES, dtype, step))
        world.close()
    finally:                        # the next case of the series spies on its own
        stacks.stack_blocks, jax_replay.replay, hostcopy._rows_into = \
            real, real_replay, real_rows
    return {"stacked": stacked, "replayed": replayed, "row_runs": row_runs}


def stack_receiver(ctx: Any, dtype: str) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    cases._torch_group(ctx, 2, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    state = cases._dtensors(NAMES, dtype, 2, None)
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60))
    checked = 0
    for step in range(STEPS):
        refit()
        checked += cases._check_dtensors(state, NAMES, dtype, step, dtype)     # bit-exact
    world.close()
    dist.destroy_process_group()
    return {"checked": checked}


def stack_series(ctx: Any) -> dict:
    programs = [[f"stack-{d}", "stack_sender", "stack_receiver", (d,)]
                for d in ("bfloat16", "float32")]
    return cases.run_series(ctx, programs, globals())


def test_a_jax_trainer_sends_stacked_small_shards_to_torch_receivers_bit_exact():
    pytest.importorskip("torch")
    from xreshard.tools.launch import Role, launch
    roles = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
             Role("torch", "rollout", 1)]
    results = [r.value for r in launch(stack_series, roles, timeout=240)]
    eligible = sum(1 for n in NAMES if not n.startswith("bias."))
    for case in ("stack-bfloat16", "stack-float32"):
        outs = [r[case] for r in results]
        assert all("error" not in o for o in outs), outs
        sent = outs[0]["value"]
        assert sent["stacked"] == [0, eligible, eligible, eligible]
        # the third call on is the second's bind replayed (jax_replay.py), and the
        # messages' runs of stacked rows are copied out of their blocks at once
        assert sent["replayed"] == [False, False, True, True]
        assert sent["row_runs"][:2] == [0, 0] and min(sent["row_runs"][2:]) > 0, sent
        assert all(o["value"]["checked"] > 0 for o in outs[1:])
