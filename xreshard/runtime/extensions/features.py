"""The call-level features, one :class:`~xreshard.runtime.extensions.Extension` each
(how they compose: the package docstring).

- :class:`Atomic` (``RefitConfig(atomic=True)``): the call moves into staging, copied
  into the destinations only once every process confirmed it (:mod:`..atomic`).
- :class:`Delta` (``RefitConfig(delta=True)``): baselines, claims (``refit/check``) and
  fences (``refit/fence``) across calls (:mod:`..delta_wire`). The state moves only at
  the outcome: a call's baseline changes are held by its ``DeltaCall`` until then, with
  or without ``atomic``, so a call that failed anywhere leaves every sender's baselines
  and claims as they were; only the bases of destinations written in place (not staged)
  are dropped, since those may hold a mix of two versions. How the bytes move (headers
  one group ahead, the diff on worker threads): the delta codec, ``execute.run(delta=)``.
- :class:`Verify` (``RefitConfig.verify``): end-to-end checksums (:mod:`..verify`).
- :class:`CheckWrites` (``RefitConfig.check_writes``): the sent tensors' writes during
  the call (:mod:`..writes`).
- :class:`Fp8`: FP8 destinations quantized on the way: the sender's work ahead
  (:mod:`..quantize_ahead`, ``Tuning.fp8_ahead``) and the report's ``quantized``. The
  planner decides per tensor whether a call quantizes, so every Refit holds it; on a call
  that quantizes nothing each hook returns at once (one attribute test: no per-tensor
  work).
- Elastic worlds' catch-ups (:mod:`..catchup`): :class:`Joiner` (the joining process's
  side), :class:`CatchUpServer` (the serving members' side) and :class:`OwnRanks` (the
  catch-up's inner Refit binds only this process's ranks).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

from . import Extension
from .. import writes
from ...errors import VerificationError
from ..atomic import Staging, left
from ..delta_wire import DeltaState, delta_problems
from ..handle import Background, caller_streams
from ..outcome import Failed, entry
from ..quantize_ahead import QuantAhead
from ..sides import on_device

__all__ = ["Atomic", "CatchUpServer", "CheckWrites", "Delta", "Fp8", "Joiner", "OwnRanks",
           "Verify"]


class Atomic(Extension):
    """Transactional destinations: shadows kept across calls (``staging.nbytes``)."""

    name = "atomic"
    keeps_destinations = True

    def __init__(self) -> None:
        self.staging: Staging | None = None

    def destinations(self, call: Any, dst: Any) -> Any:
        """``dst`` with its bindings replaced by staging (refreshed from the destinations).
        JAX destinations are new arrays (atomic already) and are not shadowed."""
        if dst is None or call.refit.receive_adapter == "jax":
            return dst
        if self.staging is None:
            self.staging = Staging()
        call.staged = True
        return self.staging.stage(dst)

    def commit(self, call: Any) -> None:
        if self.staging is not None:
            self.staging.commit()

    def abort(self) -> None:
        if self.staging is not None:
            self.staging.abandon()


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
        self.state.encode_ahead(call.prepared, call.src, atomic=True, tuning=call.tuning)
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


class Verify(Extension):
    """Checksums of both ends of every stage, compared at ``refit/outcome``."""

    name = "verify"
    # each item's wire bytes stay canonical row-major (no sender-order kernels): what it
    # checks crossed as the executor has always sent it
    options = {"canonical_wire": True}

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
    options = {"canonical_wire": True}      # as verify's

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


class Fp8(Extension):
    """Quantize this process's FP8 items while the call checks and plans."""

    name = "fp8"

    def __init__(self, ahead: bool = True, kernels: Any = None):
        self.ahead = QuantAhead(enabled=ahead, kernels=kernels)

    def check(self, call: Any) -> tuple[Any, list[list[str]]]:
        """Start the work ahead (not on a call refused already, and not for the buckets
        a delta encoder quantizes as it diffs them: each FP8 item once)."""
        if call.errors:
            return None, []
        if call.prepared is not None and call.prepared.formats.quant is not None:
            self.ahead.start(call.prepared, call.src, call.programs, skip=call.skip_ahead)
        else:
            self.ahead.last = {}        # none started for this call
        return None, []

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        if call.prepared.formats.quant is None:     # nothing quantized: work ahead ends at end()
            yield
            return
        with self.ahead.used(call.prepared, call.programs, call.config.timeout):
            yield

    def report(self, call: Any, fields: dict[str, Any]) -> None:
        if call.prepared.formats.quant is not None:
            from ..quantized import quantized_report
            fields["quantized"] = quantized_report(call.prepared, call.stats)

    def end(self) -> None:
        self.ahead.stop()


class Joiner(Extension):
    """A process that joined a running elastic world with ``wait=False``: its catch-up
    world forms while it builds the rest, and ends once it is admitted."""

    name = "joiner"

    def made(self, refit: Any) -> None:
        if refit.receive_obj is not None and refit.world.elastic \
                and not refit.world.admitted:
            from .. import catchup
            catchup.ahead(refit)

    def entered(self, refit: Any) -> None:
        if refit.world.elastic:
            from .. import catchup
            catchup.finish(refit)       # the catch-ups are over (if any): end their world


class CatchUpServer(Extension):
    """An elastic world's member that receives in place serves its version to joiners:
    a snapshot of each of its last versions while one catches up."""

    name = "serve"

    def __init__(self) -> None:
        self._server: Any = None

    def commit(self, call: Any) -> None:
        refit = call.refit
        refit.served = call.dst if call.world.elastic and refit.receive_adapter != "jax" \
            else None

    def finished(self, refit: Any) -> None:
        if self._server is not None:        # serving a catch-up: snapshot it
            self._server.keep(refit)

    def released(self, refit: Any) -> None:
        if refit.served is not None and refit.world.elastic:
            from .. import catchup
            self._server = catchup.serve(refit, self._server)


class OwnRanks(Extension):
    """A catch-up world's inner Refit: bind what this process needs, no more."""

    name = "own_ranks"

    def bound(self, call: Any) -> None:
        from ..catchup import restricted
        call.dst = restricted(call.dst, call.world.rank_ids)
