"""Call-level features as extensions: what happens at the fixed steps of a call.

A ``Refit`` runs the same steps on every call (its module docstring): bind, check, prepare,
fence, move, outcome, report. A feature that changes what happens at those steps, not
the bytes of an item (those are codecs), is an :class:`Extension` with one hook per step;
``Refit`` loops over its list and names none of them. The list is data, built once per
Refit from its config (:func:`for_config`) or given explicitly (a catch-up's inner Refit:
:func:`for_catch_up`), so a feature that is off is not in the list and costs nothing:
no per-tensor work, no collective, no copy.

```
 step           hook                      who uses it
 construction   made(refit)               catch-up (form the joiner's world ahead)
 Refit.start()  started(send)             check_writes (snapshot before the caller goes on)
 call entry     entered(refit)            catch-up (end the joiner's catch-ups)
 binding        bound(call)               catch-up (own ranks only), check_writes
 refit/check    check(call) -> body part  delta (claims, encode ahead), FP8 work ahead
                checked(call, parts)      delta (every process's claims)
 planning       options                   delta (CallOptions.delta), verify and
                                          check_writes (CallOptions.canonical_wire)
 refit/fence    fence(call) -> errors     delta (destinations written outside xreshard)
 destinations   destinations(call, dst)   atomic (staging)
 move           begin(call): a context    delta (the call's decision), verify (digests),
                around the executor       FP8 work ahead (handed over), check_writes
 refit/outcome  outcome(call, outcomes)   verify (compare: may fail the call)
                commit(call) / abort()    atomic (copy in / forget), delta (baselines)
 report         report(call, fields)      delta, verify, FP8
 version moved  finished(refit)           catch-up (serve the new version)
 always         end()                     delta, FP8 (no thread reads past the call)
```

**State moves only at the outcome.** An extension may prepare anything while the call
runs, but what it keeps across calls changes in :meth:`Extension.commit`, after every
process confirmed the call; :meth:`Extension.abort` leaves it as the last confirmed call
left it (or, where the destinations were written in place, drops only what they made
invalid). So a failed call leaves every extension as it was: delta baselines are
transactional with or without ``atomic``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

__all__ = ["Call", "Extension", "for_config", "for_catch_up", "catch_up"]


class Call:
    """One call as its extensions see it (built by ``Refit`` for every call)."""

    def __init__(self, refit: Any):
        self.refit = refit
        self.world = refit.world
        self.config = refit.config
        self.tuning = refit.tuning
        self.src: Any = None
        """This process's bound sending side (a ``Bound``), or None; None again once the
        call moved (its views are freed while the outcome is exchanged)."""
        self.dst: Any = None
        """Its bound receiving side (the real destinations, not their staging)."""
        self.errors: list[list[str]] = []
        """Errors found while binding: refused at ``refit/check`` on every process."""
        self.prepared: Any = None
        """The prepared call: the last call's until this one prepared, then its own."""
        self.programs: dict = {}
        self.target = 0
        """The version this call makes."""
        self.staged = False
        """The destinations receive into staging (their bytes survive a failed call)."""
        self.run_args: dict[str, Any] = {}
        """Keyword arguments of ``execute.run`` the extensions set (``delta=``)."""
        self.told: dict[str, Any] = {}
        """What this process adds to ``refit/outcome`` (``digests``)."""
        self.bindings: Any = None
        """The stage bindings the executor runs (into the extensions' destinations),
        during the move (``begin``); None after it."""
        self.stats: Any = None
        """The executor's stats, after moving."""
        self.by_kind: dict[str, int] = {}
        """Bytes moved per transport kind, this call."""
        self.skip_ahead: Any = frozenset()
        """Buckets another extension works on ahead (the FP8 work ahead leaves them)."""

    @property
    def receive_obj(self) -> Any:
        return self.refit.receive_obj

    @property
    def send_obj(self) -> Any:
        return self.refit.send_obj


class Extension:
    """A call-level feature: every hook does nothing unless overridden."""

    name = ""
    """Its key in ``refit/check``'s and ``refit/outcome``'s bodies."""
    options: dict[str, Any] = {}
    """``CallOptions`` fields it sets (what the planner must know)."""
    keeps_destinations = False
    """A failed call leaves the destinations as they were (``Refit.stale`` stays False)."""

    def made(self, refit: Any) -> None:
        """The Refit was just made."""

    def started(self, send: Any) -> None:
        """``Refit.start()`` was called with ``send`` (before it returns to the caller)."""

    def entered(self, refit: Any) -> None:
        """A call begins (before it takes the world)."""

    def bound(self, call: Any) -> None:
        """Both sides are bound (``call.src``, ``call.dst``; errors go to ``call.errors``)."""

    def check(self, call: Any) -> tuple[Any, list[list[str]]]:
        """This process's part of ``refit/check`` (None: none) and the errors it found."""
        return None, []

    def checked(self, call: Any, parts: Sequence[Any]) -> None:
        """Every process's part (in process order), after ``refit/check`` passed."""

    def fence(self, call: Any) -> list[list[str]] | None:
        """Errors for ``refit/fence``, or None when this extension needs no fence (the
        decision must be the same on every process)."""
        return None

    def destinations(self, call: Any, dst: Any) -> Any:
        """The destination the call moves into (``dst``: what the extensions before gave)."""
        return dst

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        """Around the executor's run; what follows the ``yield`` runs only when it moved."""
        yield

    def outcome(self, call: Any, outcomes: Sequence[Any], report: dict[str, Any]) -> None:
        """Every process reported success (``outcomes``: their bodies); may raise a
        ``Failed`` (then the call fails and :meth:`abort` runs); may set ``report`` fields."""

    def commit(self, call: Any) -> None:
        """Every process confirmed the call: move the state kept across calls."""

    def abort(self) -> None:
        """The call failed somewhere (or was never confirmed): keep the state as it was."""

    def report(self, call: Any, fields: dict[str, Any]) -> None:
        """Set this extension's ``RefitReport`` fields."""

    def finished(self, refit: Any) -> None:
        """The version moved (``Refit.writing`` held)."""

    def released(self, refit: Any) -> None:
        """After :meth:`finished`, the world and ``Refit.writing`` released."""

    def end(self) -> None:
        """The call is over, whatever happened: stop any work started for it."""


def for_config(config: Any, tuning: Any) -> list[Extension]:
    """The extensions of a Refit with ``config`` and ``tuning``: only the switched-on
    features, but FP8 (the planner decides per tensor whether a call quantizes; its hooks
    return at once when the call does not) and the serving of catch-ups (an elastic
    world's, nothing in a fixed world)."""
    from ..codecs.kernels import Kernels
    from .features import Atomic, CatchUpServer, CheckWrites, Delta, Fp8, Joiner, Verify
    out: list[Extension] = [Joiner()]
    if config.atomic:
        out.append(Atomic())
    if config.delta:
        out.append(Delta())
    out.append(Fp8(tuning.fp8_ahead, Kernels.of(tuning)))
    if config.verify:
        out.append(Verify(config.verify))
    if config.check_writes:
        out.append(CheckWrites())
    out.append(CatchUpServer())
    return out


def for_catch_up(config: Any, tuning: Any) -> list[Extension]:
    """A catch-up's inner Refit (:mod:`xreshard.runtime.catchup`): it binds only this
    process's ranks, moves into the destinations in place (nothing to stage: the joiner
    was not admitted), keeps no delta baseline (a caught-up receiver's first member call
    is dense) and checks what its config asks."""
    from ..codecs.kernels import Kernels
    from .features import Fp8, OwnRanks, Verify
    out: list[Extension] = [OwnRanks(), Fp8(tuning.fp8_ahead, Kernels.of(tuning))]
    if config.verify:
        out.append(Verify(config.verify))
    return out


def catch_up(refit: Any) -> Any:
    """``Refit.catch_up``'s work (:func:`xreshard.runtime.catchup.catch_up`)."""
    from .. import catchup
    return catchup.catch_up(refit, refit.receive_obj, refit.naming)


def find(extensions: Sequence[Extension], kind: type) -> Any:
    """The extension of class ``kind`` in the list, or None."""
    return next((e for e in extensions if isinstance(e, kind)), None)


def exported(name: str, attr: str, doc: str) -> property:
    """A ``Refit`` property for attribute ``attr`` of its extension ``name`` (None when
    the Refit has none; setting it then raises ``RefitError``): the public handles on an
    extension's state, e.g. ``refit.delta_state``."""

    def get(refit: Any) -> Any:
        ext = next((e for e in refit.extensions if e.name == name), None)
        return None if ext is None else getattr(ext, attr)

    def put(refit: Any, value: Any) -> None:
        ext = next((e for e in refit.extensions if e.name == name), None)
        if ext is None:
            from ...errors import RefitError
            raise RefitError(f"this Refit has no {name!r} extension (its config does not "
                             f"ask for it): nothing to set {attr!r} of")
        setattr(ext, attr, value)

    return property(get, put, doc=doc)
