"""The checks a call may run: end-to-end checksums (``RefitConfig.verify``,
:mod:`xreshard.runtime.verify`) and the sent tensors' writes during the call
(``RefitConfig.check_writes``, :mod:`xreshard.runtime.writes`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

from . import Extension
from .. import writes
from ...errors import VerificationError
from ..atomic import left
from ..handle import Background, caller_streams
from ..outcome import Failed, entry

__all__ = ["CheckWrites", "Verify"]


class Verify(Extension):
    """Checksums of both ends of every stage, compared at ``refit/outcome``."""

    name = "verify"

    def __init__(self, mode: bool | str):
        self.mode = mode

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        """The sources do not change during a refit: their checksums overlap the move
        (read on this thread's CUDA streams: the producers were ordered onto those); the
        destinations' and the forwards' after it."""
        from ..verify import stage_digests
        prepared, bindings = call.prepared, call.bindings
        digest = functools.partial(stage_digests, prepared, call.programs, call.world,
                                   self.mode, call.target)
        sent_half = Background(lambda: digest(0, bindings.src[0], {}, "send"),
                               streams=caller_streams())
        yield
        merged = sent_half.result().merge(digest(0, {}, bindings.dst[0], "recv"))
        for k in range(1, len(prepared.stages)):     # forwards: both ends, after moving
            merged = merged.merge(digest(k, bindings.src[k], bindings.dst[k], "both"))
        call.told["digests"] = merged.summary

    def outcome(self, call: Any, outcomes: Sequence[Any], report: dict[str, Any]) -> None:
        from ..verify import compare
        messages, compared = compare([o.get("digests") for o in outcomes], call.world)
        if messages:        # the same list on every process: it compared the same digests
            raise Failed(VerificationError(
                f"refit v{call.target}: {len(messages)} transfer(s) arrived with other bytes "
                f"than were sent (checksums differ), "
                f"{left(call.refit.keeps_destinations, call.refit.version)}:\n  "
                + "\n  ".join(messages[:20])
                + (f"\n  ... and {len(messages) - 20} more" if len(messages) > 20 else "")))
        report["verified"] = compared


class CheckWrites(Extension):
    """A digest of every sent tensor before the call, compared once every source was
    read: a tensor written meanwhile fails the call on every process."""

    name = "check_writes"

    def __init__(self) -> None:
        self._snapshot: writes.Snapshot | None = None

    def started(self, send: Any) -> None:
        """``Refit.start``: the digests before the caller's next line can write them."""
        self._snapshot = writes.take(send)

    def bound(self, call: Any) -> None:
        if self._snapshot is None:
            self._snapshot = writes.take(call.send_obj)
        if self._snapshot is not None and self._snapshot.error is not None:
            call.errors.append(entry(self._snapshot.error, "check"))

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        yield
        writes.check(self._snapshot)    # every source read: were they written meanwhile?

    def end(self) -> None:
        self._snapshot = None
