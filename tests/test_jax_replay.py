"""A refit's warm JAX send bind is a lookup (issue 35, item 3; ``adapters/jax_replay.py``):
from the third call on, a tree whose structure, names and geometries did not change is
bound from the second call's record, and binds exactly what the walk binds (the same keys
in the same order, the same bytes, the same layouts); anything that changed is walked and
recorded again. The executor copies runs of stacked rows out of their blocks
(``Programs.row_plan``).

Real JAX arrays with real NamedShardings on 4 CPU devices.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from xreshard.adapters import jax as xjax  # noqa: E402
from xreshard.adapters import jax_replay  # noqa: E402
from xreshard.runtime.binding import RowBindings  # noqa: E402
from xreshard.runtime.programs import Programs  # noqa: E402

from .test_jax_stack import _context, _mesh, _shard_bytes, _tree  # noqa: E402


@pytest.fixture
def replays(monkeypatch) -> list[bool]:
    """Whether each bind that had a record replayed it."""
    got: list[bool] = []
    real = jax_replay.replay

    def spy(*args: Any) -> Any:
        out = real(*args)
        got.append(out is not None)
        return out
    monkeypatch.setattr(jax_replay, "replay", spy)
    return got


def _walk(tree: dict, context: Any) -> Any:
    """The walk's bind of ``tree`` in ``context``'s state, its record left as it was."""
    kept = context.cache.pop("replay", None)
    try:
        return xjax.refit_bind(tree, "send", context)
    finally:
        context.cache["replay"] = kept


def _warmed(calls: int) -> tuple[Any, Any]:
    """(mesh, context) after ``calls`` binds of new arrays in one refit's context."""
    mesh = _mesh()
    context = _context(mesh)
    for step in range(calls):
        xjax.refit_bind(_tree(mesh, step), "send", context)
    return mesh, context


def _raw(view: Any) -> bytes:
    return np.ascontiguousarray(view).reshape(-1).view(np.uint8).tobytes()


def _assert_same(bound: Any, walked: Any, tree: dict, ranks: dict, order: bool = True,
                 shards: bool = True) -> None:
    """``bound`` binds what ``walked`` does; in its order too when ``order`` (a walk that
    meets a geometry first views its leaves where it meets them, a later walk stacks or
    views them after the others)."""
    assert set(bound.bindings) == set(walked.bindings)
    if order:
        assert list(bound.bindings) == list(walked.bindings)
    assert bound.layouts == walked.layouts and list(bound.layouts) == list(walked.layouts)
    assert not bound.errors
    if order:
        assert bound.checked == walked.checked
    want = _shard_bytes(tree, ranks)
    for key, view in bound.bindings.items():
        assert _raw(view) == _raw(walked.bindings[key]), key
        assert not shards or _raw(view) == want[key], key


def test_the_third_call_on_replays_what_the_walk_binds(replays):
    mesh = _mesh()
    context, ranks = _context(mesh), None
    ranks = dict(context.ranks)
    trees = [_tree(mesh, step) for step in range(4)]      # new arrays, equal shardings
    trees.append(trees[-1])                               # the same arrays again
    for step, tree in enumerate(trees):
        bound = xjax.refit_bind(tree, "send", context)
        _assert_same(bound, _walk(tree, context), tree, ranks, order=step > 0)
        if step >= 2:
            assert isinstance(bound.bindings, RowBindings)
            rows = bound.bindings.rows
            assert rows and len(bound.bindings.blocks) > 1
            for key, (block, row) in rows.items():      # each row is its binding's bytes
                assert _raw(bound.bindings.blocks[block][row, ...]) == _raw(bound.bindings[key])
    assert replays == [True, True, True]        # the second call records, the third on replay


def _changed(mesh: Any, what: str, tree: dict) -> tuple[dict, dict]:
    """``tree`` with one change, and BindContext overrides."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    tree = dict(tree)
    a = tree["rows.3"]
    if what == "shape":
        tree["rows.3"] = jax.device_put(np.zeros((8, 8), np.float32), a.sharding)
    elif what == "dtype":
        tree["rows.3"] = a.astype(jax.numpy.bfloat16)
    elif what == "sharding":
        tree["rows.3"] = jax.device_put(a, NamedSharding(mesh, P(None, "b")))
    elif what == "added":
        tree["rows.99"] = a + 1
    elif what == "removed":
        del tree["rows.3"]
    elif what == "names":
        return tree, {"names": {"rows.3": "renamed"}}
    elif what == "transpose":
        return tree, {"transpose": frozenset({"cols.2"})}
    return tree, {}


@pytest.mark.parametrize("what", ["shape", "dtype", "sharding", "added", "removed", "names",
                                  "transpose"])
def test_what_changed_is_walked_then_replayed(what, replays):
    mesh, context = _warmed(3)
    ranks = dict(context.ranks)
    assert replays == [True]
    tree, over = _changed(mesh, what, _tree(mesh, 3))
    if over:
        from xreshard.runtime.registry import BindContext
        context = BindContext(**{**{f: getattr(context, f) for f in (
            "ranks", "local_ranks", "memo", "cache", "names", "transpose")}, **over})
    for i in range(4):
        bound = xjax.refit_bind(tree, "send", context)
        if i == 0:                      # the old record is never replayed for it
            assert replays[1:] in ([], [False]), replays
        # what the public bind (a walk of its own, no stacks, no record) binds
        public = xjax.bind(tree, "send", ranks=ranks, names=context.names,
                           transpose=context.transpose)
        _assert_same(bound, public, tree, ranks, order=False, shards=not over)
        assert bound.layouts == public.layouts
    assert replays[-2:] == [True, True]         # a new geometry takes two walks


def test_not_an_array_or_a_deleted_one_is_refused_as_the_walk_refuses(replays):
    mesh, context = _warmed(3)
    tree = _tree(mesh, 3)
    tree["rows.4"].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        xjax.refit_bind(tree, "send", context)
    tree = _tree(mesh, 4)
    tree["large.1"].delete()            # a leaf viewed shard by shard, not stacked
    with pytest.raises(RuntimeError, match="deleted"):
        xjax.refit_bind(tree, "send", context)
    tree = _tree(mesh, 5)
    tree["rows.2"] = np.asarray(tree["rows.2"])     # not a jax.Array
    with pytest.raises(Exception) as replayed:
        xjax.refit_bind(tree, "send", context)
    with pytest.raises(type(replayed.value)):
        _walk(tree, context)
    bound = xjax.refit_bind(_tree(mesh, 6), "send", context)    # and on it goes
    assert not bound.errors and replays[-1]


def test_a_replayed_binding_keeps_the_values_the_arrays_had_when_bound(replays):
    mesh, context = _warmed(2)
    tree = _tree(mesh, 2)
    want = _shard_bytes(tree, dict(context.ranks))
    bound = xjax.refit_bind(tree, "send", context)
    assert replays == [True]
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + a, p), donate_argnums=0)
    small = {n: a for n, a in tree.items() if (0, n) in bound.bindings.rows}
    assert small
    jax.block_until_ready(step(small))
    assert all(a.is_deleted() for a in small.values())
    for name in small:
        for rank in range(4):
            assert _raw(bound.bindings[(rank, name)]) == want[(rank, name)]


# ---------------------------------------------------------------- the executor's plan

def _run(spans: list[tuple[int, int, Any]]) -> Any:
    """A run of whole steps: ``(lo, hi, key)`` each."""
    steps = tuple(SimpleNamespace(lo=lo, hi=hi) for lo, hi, _ in spans)
    return SimpleNamespace(steps=steps, keys=tuple(k for _, _, k in spans))


def test_a_runs_plan_copies_consecutive_rows_and_gathers_the_rest():
    programs = Programs(())
    rows = {(0, f"t{i}"): (0, i) for i in range(16)} | {(1, f"t{i}"): (1, i) for i in range(16)}
    # t0..t7 abut (one segment), then two strangers, then t8..t15 of block 1 in order
    spans = [(16 * i, 16 * i + 16, (0, f"t{i}")) for i in range(8)]
    spans += [(128, 130, (0, "x")), (130, 132, (0, "y"))]
    spans += [(132 + 16 * j, 148 + 16 * j, (1, f"t{8 + j}")) for j in range(8)]
    run = _run(spans)
    plan = programs.row_plan(run, rows)
    assert plan == ((0, 128, 0, 0, 8), (128, 132, None, ((0, "x"), (0, "y"))),
                    (132, 260, 1, 8, 16))
    assert programs.row_plan(run, rows) is plan                   # kept per run and rows
    assert programs.row_plan(run, dict(rows)) == plan             # other rows: made again
    # bytes that do not abut (padding between items) start a new segment
    gap = _run([(0, 16, (0, "t0")), (32, 48, (0, "t1"))] + [(48 + 16 * i, 64 + 16 * i, (0, "z"))
                                                           for i in range(6)])
    assert programs.row_plan(gap, rows) is None                   # 3 segments for 8 items
    # rows out of order are a segment each: no cheaper than gathering
    shuffled = _run([(16 * i, 16 * i + 16, (0, f"t{7 - i}")) for i in range(8)])
    assert programs.row_plan(shuffled, rows) is None
    assert programs.row_plan(_run([(0, 2, (0, "x")), (2, 4, (0, "y"))]), rows) is None


# ---------------------------------------------------------------- a started refit

def test_a_started_refit_returns_once_it_read_the_arrays_the_caller_then_donates(monkeypatch):
    """``Refit.start`` returns once its call bound its sides (after the world's first call,
    whose identity exchange start() must not wait for): the caller's next step may donate
    the arrays it sent (a donation racing the bind on the refit's thread crashed JAX's
    dispatch), and the refit still delivers the values they had."""
    pytest.importorskip("torch")      # the world's store is torch's TCPStore
    import threading
    import time

    import xreshard as xr
    from xreshard.runtime.refit import Refit

    from .test_jax_stack import _bits_tree, _raw as raw, _solo, _templates
    mesh = _mesh()
    real = Refit._bind_sides
    bound = threading.Event()

    def slow(self: Any, call: Any, send: Any, receive: Any) -> None:
        time.sleep(0.3)         # the thread is late: start() must still wait for the bind
        real(self, call, send, receive)
        bound.set()
    monkeypatch.setattr(Refit, "_bind_sides", slow)
    step_fn = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + 1, p), donate_argnums=0)
    with _solo(mesh) as world:
        refit = xr.Refit(world, receive=_templates(mesh), config=xr.RefitConfig(timeout=60))
        refit(send=_bits_tree(mesh, 9))     # a world's first call: start() would not wait
        for step in range(4):
            src = _bits_tree(mesh, step)
            want = {n: raw(a) for n, a in src.items()}
            bound.clear()
            handle = refit.start(send=src)
            assert bound.is_set()           # start() returned after the sides were bound
            jax.block_until_ready(step_fn(src))         # the next step donates them
            handle.wait()
            got = refit.received
            assert all(raw(got[n]) == w for n, w in want.items()), step


def test_row_bindings_forget_their_rows_once_changed_and_copy_as_plain_dicts():
    import copy
    import pickle
    block = np.arange(12, dtype=np.float32).reshape(3, 4)
    make = lambda: RowBindings({(0, f"t{i}"): block[i] for i in range(3)},    # noqa: E731
                               {(0, f"t{i}"): (0, i) for i in range(3)}, [block])
    kept = make()
    assert kept.same().rows is kept.rows and type(kept.same()) is RowBindings
    for copied in (copy.copy(kept), copy.deepcopy(kept), pickle.loads(pickle.dumps(kept)),
                   kept.copy(), dict(kept)):
        assert type(copied) is dict and set(copied) == set(kept)
    changes = [lambda b: b.__setitem__((0, "t1"), np.zeros(4, np.float32)),
               lambda b: b.__delitem__((0, "t1")), lambda b: b.update({}),
               lambda b: b.setdefault((0, "t9"), None), lambda b: b.pop((0, "t0")),
               lambda b: b.popitem(), lambda b: b.clear(), lambda b: b.__ior__({})]
    for change in changes:          # the executor then reads every binding as itself
        b = make()
        change(b)
        assert not b.rows and not b.blocks
