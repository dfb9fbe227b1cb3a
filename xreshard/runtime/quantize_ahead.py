"""Quantizing ahead: a sender's FP8 items quantized while the call still checks and plans.

On CPU quantizing is the slow stage of an FP8 refit, and a call spends its first part in
``refit/check`` (an all-gather), the metadata steps and the transport's setup, during
which the sender's cores idle. So, as the delta refit encodes ahead
(``DeltaState.encode_ahead``), a sender starts quantizing as soon as the call's sources
are bound, with the **last** call's prepared schedule, on one worker thread:

```
 worker thread    quantize item 0 | item 1 | item 2 | ...           (in pack order)
 calling thread   bind | refit/check | pack 0 (copy) | pack 1 (copy) | ... | outcome
```

The worker quantizes the FP8 items (whole blocks a local sender holds,
:mod:`xreshard.planner.quantize`) of the stage-0 buckets this process sends, in the order
the executor packs them, with the executor's own function on the same source views
(``quantized.quantize_step``), so its codes and scales are the bytes the executor would
compute. The call hands the work to the executor (:meth:`QuantAhead.used`) only when it
runs the very schedule the worker started from (the same ``PreparedCall`` and program
cache: nothing was re-planned, so no layout, dtype, ``wire_dtype`` or bucket changed);
otherwise the work is discarded. The executor's pack step then takes an item's result
(waiting for it when the worker is on it or before it) instead of quantizing; an item the
worker has not reached when the worker cannot go on (stopped, failed, or held by its
memory window) is quantized by the pack step itself, as without this module.

Bounds: one worker thread (the quantizer runs once per byte, as alone: the call does not
quantize on more cores than the quantizer alone does); results not yet taken stay within
``CallOptions.staging_bytes`` of codes and scales (the first item always goes); every wait
has the call's timeout. The worker is stopped and joined before the call returns,
whatever happened (:meth:`QuantAhead.stop`, called by ``Refit`` at the end of every call):
no thread reads a source past the call. A worker that fails leaves its items to the pack
step, which raises the same error in the call's thread if it is real.

In a delta call (``RefitConfig(delta=True)``) the buckets the delta encoder started ahead
encodes are left out: its threads quantize their FP8 items as they diff them (the
executor sends those buckets from the encoder's message, never packing them), so each
item is quantized once (``benchmarks/RESULTS.md``).

``Tuning(fp8_ahead=False)`` turns this off (environment: ``XRESHARD_FP8_AHEAD=0``, read by
``Tuning.from_env``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Collection, Iterator

from ..errors import RefitError
from ..planner.prepare import SOURCES
from . import quantized
from .metadata import fit
from .programs import Programs, Tables

__all__ = ["QuantAhead", "AheadRun"]

logger = logging.getLogger(__name__)

_PENDING, _RUNNING, _DONE, _FAILED, _CLAIMED, _TAKEN = range(6)


class _Entry:
    __slots__ = ("step", "state", "result", "nbytes")

    def __init__(self, step: Any):
        self.step = step
        self.state = _PENDING
        self.result: Any = None
        self.nbytes = 0


class AheadRun:
    """One call's work ahead: the worker thread and its results, by program step.

    Args:
        prepared: the ``PreparedCall`` whose schedule the worker follows.
        programs: its program cache (the steps are its objects: a step is found by
            identity).
        bindings: the call's stage-0 source bindings.
        steps: the FP8 steps to quantize, in pack order.
        budget: the most bytes of results (codes + scales) held before they are taken.
        kernels: the call's :class:`~.codecs.kernels.Kernels` (threads, device framework;
            None: the defaults), the ones its pack step would quantize with.
    """

    def __init__(self, prepared: Any, programs: dict, bindings: Any, steps: list,
                 budget: int, kernels: Any = None):
        self.prepared, self.programs = prepared, programs
        self._bindings = bindings
        self._kernels = kernels
        self._entries = [_Entry(e) for e in steps]
        self._by_id = {id(en.step): en for en in self._entries}
        self._budget = max(1, budget)
        self._held = 0                  # bytes of results done and not taken
        self._cond = threading.Condition()
        self._stopping = False
        self._blocked = False           # the worker waits for room in its window
        self._alive = True
        #: seconds a pack step waits for an item (the call's timeout, set when it is used)
        self.timeout = 1800.0
        self.worker_seconds = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="xreshard-fp8-ahead",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the worker

    def _work(self) -> None:
        t0 = time.perf_counter()
        try:
            for en in self._entries:
                with self._cond:
                    while self._held >= self._budget and not self._stopping:
                        self._blocked = True
                        self._cond.notify_all()
                        self._cond.wait()
                    self._blocked = False
                    if self._stopping:
                        return
                    if en.state != _PENDING:        # the pack step took it on itself
                        continue
                    en.state = _RUNNING
                try:
                    result = quantized.quantize_step(en.step, self._bindings,
                                                     kernels=self._kernels)
                except BaseException as e:      # noqa: BLE001 - the pack step redoes it
                    with self._cond:
                        en.state, self.error = _FAILED, e
                        self._cond.notify_all()
                    return
                with self._cond:
                    en.result, en.state = result, _DONE
                    en.nbytes = sum(a.nbytes for a in result)
                    self._held += en.nbytes
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._alive = False
                self.worker_seconds = time.perf_counter() - t0
                self._cond.notify_all()

    # ------------------------------------------------------------ the pack step

    def take(self, step: Any) -> tuple[Any, Any] | None:
        """``(codes, scales)`` of program step ``step`` as the worker quantized them
        (waiting for them, up to :attr:`timeout`, while the worker is on it or before it);
        None: the caller quantizes it (not in this run, or the worker cannot reach it)."""
        en = self._by_id.get(id(step))
        if en is None or en.step is not step:
            return None
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while en.state in (_PENDING, _RUNNING):
                if en.state == _PENDING and (self._blocked or self._stopping
                                             or not self._alive):
                    en.state = _CLAIMED
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RefitError(f"quantizing {step.key[1]!r} ahead (rank {step.key[0]}) "
                                     f"took more than the timeout ({timeout} s)")
                self._cond.wait(left)
            if en.state != _DONE:       # the worker failed on it: the caller does it
                en.state = _CLAIMED
                return None
            result, en.result, en.state = en.result, None, _TAKEN
            self._held -= en.nbytes
            if self._held < self._budget:      # the worker goes on: not a reason to claim
                self._blocked = False
            self._cond.notify_all()
            return result

    # ------------------------------------------------------------ the end

    def stop(self) -> dict[str, Any]:
        """Stop the worker (an item it is quantizing finishes) and join it; returns what
        it did: ``items``, ``taken`` (by the pack steps), ``by_call`` (quantized by the
        pack steps instead), ``bytes_taken``, ``worker_seconds``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        states = [en.state for en in self._entries]
        return {"items": len(states), "taken": states.count(_TAKEN),
                "by_call": states.count(_CLAIMED),
                "bytes_taken": sum(en.nbytes for en in self._entries if en.state == _TAKEN),
                "worker_seconds": self.worker_seconds,
                "error": None if self.error is None else repr(self.error)}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class QuantAhead:
    """A ``Refit``'s quantizing ahead, across its calls (see the module docstring).

    Attributes:
        enabled: whether it runs (``Tuning.fp8_ahead``).
        last: what the last call's work ahead did (:meth:`AheadRun.stop`, plus ``used``:
            whether the call took it; ``{}``: none started), for benchmarks and tests.
    """

    def __init__(self, enabled: bool = True, kernels: Any = None):
        self.enabled = enabled
        self.kernels = kernels      # the Refit's Kernels (Tuning): what the pack step uses
        self.last: dict[str, Any] = {}
        self._run: AheadRun | None = None
        self._used = False

    def start(self, prepared: Any, src: Any, programs: dict, skip: Collection[Any] = ()
              ) -> None:
        """Start quantizing this process's FP8 items of ``prepared`` (the last call's, or
        None) from ``src`` (this call's bound sending side, or None), but those of the
        buckets in ``skip`` (a delta call's encoder quantizes them as it diffs them)."""
        self.stop()
        self.last = {}          # this call's, once it ran
        if not self.enabled or prepared is None or prepared.formats.quant is None or src is None \
                or prepared.stages[0].src_from != SOURCES:
            return
        from .sides import on_device
        if on_device(src):      # device memory quantizes on its device, in the call
            return
        st = prepared.stages[0]
        try:
            bindings = fit(src, prepared.direct.src_layouts)
            progs = Programs((Tables(st.src_layouts, st.dst_layouts, st.wire_dtypes,
                                     bindings, {}),), programs, prepared.formats.quant)
            local = {r for r, _ in bindings}
            steps = [e for rnd in prepared.schedule.rounds for b in rnd
                     if b.stage == 0 and b.src in local and b not in skip
                     for e in progs.program(b, 0) if e.quant is not None]
        except Exception:       # noqa: BLE001 - only an optimization: the call packs as before
            logger.debug("not quantizing ahead: the last schedule does not fit these sources",
                         exc_info=True)
            return
        if steps:
            self._run = AheadRun(prepared, programs, bindings, steps,
                                 prepared.options.staging_bytes, self.kernels)

    @contextlib.contextmanager
    def used(self, prepared: Any, programs: dict, timeout: float) -> Iterator[None]:
        """Around the executor's run of ``prepared`` (with its program cache
        ``programs``): hand it the work ahead when it was started from this very schedule
        (else discard it), a pack step waiting at most ``timeout`` seconds for an item;
        stopped and joined on the way out."""
        run = self._run
        if run is None or run.prepared is not prepared or run.programs is not programs:
            self.stop()
            yield
            return
        self._used, run.timeout = True, timeout
        token = quantized.AHEAD.set(run)
        try:
            yield
        finally:
            quantized.AHEAD.reset(token)
            self.stop()

    def stop(self) -> None:
        """Stop and join the worker, if any: no thread reads a source once this returns."""
        run, self._run = self._run, None
        if run is not None:
            self.last = dict(run.stop(), used=self._used)
        self._used = False
