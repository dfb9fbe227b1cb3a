"""``RefitConfig(delta=True)`` as an extension: baselines, claims and fences across calls.

The state (:class:`~xreshard.runtime.delta_wire.DeltaState`: the senders' baselines, the
receivers' bases and their fingerprints) is kept across calls and moves only at the
outcome (:meth:`Delta.commit`): a call's baseline changes are held by its
:class:`~xreshard.runtime.delta_wire.DeltaCall` until then, with or without ``atomic``,
so a call that failed anywhere leaves every sender's baselines and claims as they were
(:meth:`Delta.abort`); only the bases of destinations written in place (not staged) are
dropped, since those may hold a mix of two versions. How the bytes move (headers one
group ahead, the diff on worker threads): the delta codec, ``execute.run(delta=)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from . import Extension
from ..delta_wire import DeltaState, delta_problems
from ..sides import on_device

__all__ = ["Delta"]


class Delta(Extension):
    """Delta baselines, claims (``refit/check``) and fences (``refit/fence``)."""

    name = "delta"
    options = {"delta": True}

    def __init__(self, state: DeltaState | None = None):
        self.state = state or DeltaState()
        self._claims: list[Any] = []
        self._call: Any = None      # the DeltaCall begun, until the outcome

    def check(self, call: Any) -> tuple[Any, list[list[str]]]:
        """Start diffing ahead (with the last call's schedule), then say this process's
        claims and what it cannot run."""
        self.state.encode_ahead(call.prepared, call.src, atomic=True)
        call.skip_ahead = self.state.ahead_buckets
        claims, found = self.state.claims(call.dst, call.receive_obj)
        src, dst = call.src, call.dst
        return claims, found + delta_problems(call.config, on_device(src, dst),
                                              tuning=call.tuning,
                                              sides=(on_device(src), on_device(dst)))

    def checked(self, call: Any, parts: Sequence[Any]) -> None:
        self._claims = list(parts)

    def fence(self, call: Any) -> list[list[str]] | None:
        if not self.state.fence_needed(self._claims):
            return None
        return self.state.fence(self._claims, call.prepared, call.dst)

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        self._call = self.state.begin(self._claims, call.prepared, atomic=True,
                                      staged=call.dst is not None and call.staged)
        call.run_args["delta"] = self._call
        yield

    def commit(self, call: Any) -> None:
        """Fingerprints of the destinations as committed (after any staging's commit)."""
        done, self._call = self._call, None
        if done is not None:
            self.state.commit(done, call.dst, call.receive_obj)

    def abort(self) -> None:
        self._call = None
        self.state.abort()

    def report(self, call: Any, fields: dict[str, Any]) -> None:
        delta = call.run_args.get("delta")
        if delta is not None:
            fields["delta"] = delta.summary()

    def end(self) -> None:
        self.state.stop_ahead()     # no thread reads the sources past the call
