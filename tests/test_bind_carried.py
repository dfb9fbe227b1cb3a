"""A side bound entry for entry as on the last call, which passed its check, is not walked
again (issue 35, item 3: a warm call re-checks only what can have changed).

The torch adapter keeps each state-dict entry's binding across calls and looks it up when
the tensor, its spec and its memory are unchanged. When every entry of a side is such a
lookup and the last call's side passed ``side_problems``, the new side is the same layout
and view objects over the same memory: ``carried_over`` marks it ``checked`` and
``side_problems`` skips the walk (shapes, dtypes, coverage, writability, overlaps) for a
receiving side too. Anything changed in place, added or dropped, and a side that failed
its last check, is walked as before and refused as before.

Real DTensors over a one-process gloo group (``test_bind_cache.gloo1``); the refits over
them are in ``test_refit``, ``test_comm_count`` and ``bench_overhead``.
"""

from __future__ import annotations

import pytest

from xreshard.ir.layout import LayoutMemo
from xreshard.runtime import binding
from xreshard.runtime.binding import side_problems
from xreshard.runtime.registry import BindContext

torch = pytest.importorskip("torch")

from xreshard.adapters import torch as xtorch  # noqa: E402

from .test_bind_cache import _dt  # noqa: E402


def _refit_bind(state: dict, cache: dict, memo: LayoutMemo, side: str = "receive"):
    return xtorch.refit_bind(state, side, BindContext(ranks={0: 0}, local_ranks=(0,),
                                                      memo=memo, cache=cache))


def _check(bound, side: str = "receive") -> list:
    return side_problems({side: bound}, [0], lambda r: r == 0, None)


class _Walks:
    def __init__(self, monkeypatch):
        self.n = 0
        real = binding.binding_problems

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(binding, "binding_problems", counted)


def test_an_unchanged_side_that_passed_is_not_walked_again(gloo1, monkeypatch):
    walks = _Walks(monkeypatch)
    state = {f"w{i}": _dt(gloo1, torch.zeros(4, 3)) for i in range(5)}
    state["plain"] = torch.zeros(2, 2)
    memo, cache = LayoutMemo(), {}
    first = _refit_bind(state, cache, memo)
    assert not first.checked and _check(first) == [] and walks.n == 1 and first.passed
    for _ in range(2):
        again = _refit_bind(state, cache, memo)
        assert again.checked
        before = walks.n
        assert _check(again) == [] and walks.n == before and again.passed
    send_cache: dict = {}                           # a torch sending side likewise
    sent = _refit_bind(state, send_cache, memo, "send")
    assert not sent.checked and _check(sent, "send") == []
    assert _refit_bind(state, send_cache, memo, "send").checked
    # and the views are still the tensors' memory: writes land
    b = again.bindings[(0, "w0")]
    b[...] = 7
    assert float(state["w0"].to_local().sum()) == 7 * 12


def test_what_changed_is_walked_and_refused_as_before(gloo1, monkeypatch):
    walks = _Walks(monkeypatch)
    memo, cache = LayoutMemo(), {}
    state = {"a": _dt(gloo1, torch.zeros(4, 3)), "b": _dt(gloo1, torch.zeros(4, 3))}
    assert _check(_refit_bind(state, cache, memo)) == []
    assert _refit_bind(state, cache, memo).checked      # (and passes, unwalked)
    assert _check(_refit_bind(state, cache, memo)) == []

    # one tensor's memory now aliases the other's: bound anew, walked, the overlap refused
    xtorch._local_of(state["b"]).set_(xtorch._local_of(state["a"]))
    aliased = _refit_bind(state, cache, memo)
    assert not aliased.checked
    n = walks.n
    problems = _check(aliased)
    assert walks.n == n + 1 and not aliased.passed
    assert any("share memory" in p[1] for p in problems), problems
    # the same (bad) side again: every entry a lookup, but the last one failed: walked
    again = _refit_bind(state, cache, memo)
    assert not again.checked and _check(again) != []

    # fixed; then an entry added, then one dropped: each walked once, then carried
    xtorch._local_of(state["b"]).set_(torch.zeros(4, 3))
    for change in ("fixed", "added", "dropped"):
        if change == "added":
            state["c"] = _dt(gloo1, torch.zeros(4, 3))
        if change == "dropped":
            del state["a"]
        changed = _refit_bind(state, cache, memo)
        assert not changed.checked, change
        assert _check(changed) == [], change
        assert _refit_bind(state, cache, memo).checked, change

    # a wrong shape (resized in place) is bound anew and refused
    xtorch._local_of(state["b"]).resize_(2, 3)
    resized = _refit_bind(state, cache, memo)
    assert not resized.checked
    assert any("'b'" in p[1] and "(2, 3)" in p[1] for p in _check(resized))


def test_a_bound_handed_to_the_caller_is_never_vouched_for(gloo1):
    """``xreshard.adapters.torch.bind`` (public) returns a side its caller may change
    before a refit sees it: never ``checked``, whatever its cache holds."""
    memo, cache = LayoutMemo(), {}
    state = {"w": _dt(gloo1, torch.zeros(4, 3))}
    for _ in range(3):
        bound = xtorch.bind(state, "receive", ranks={0: 0}, local_ranks=[0], memo=memo,
                            cache=cache)
        assert not bound.checked and _check(bound) == []


def test_a_side_with_any_problem_has_not_passed(gloo1):
    """``Bound.passed`` means nothing at all was wrong with the side: an adapter's error or
    a rank of another process counts, so the next call's side is walked."""
    memo, cache = LayoutMemo(), {}
    state = {"w": _dt(gloo1, torch.zeros(4, 3))}
    good = _refit_bind(state, cache, memo)
    assert _check(good) == [] and good.passed
    good.errors.append("something the adapter found")
    assert _check(good) != [] and not good.passed
    assert not _refit_bind(state, cache, memo).checked       # the last one did not pass
    other = _refit_bind(state, {}, memo)
    assert side_problems({"receive": other}, [1], lambda r: r == 1, None) != []
    assert not other.passed
