"""The user-facing refit: one collective call moves every tensor shard to shard.

```python
world = xr.World.join(address, group="trainer", devices=jax.local_devices(), num_processes=3)
refit = xr.Refit(world, send=params)          # trainer: a pytree of jax.Arrays / a state dict
refit = xr.Refit(world, receive=state_dict)   # inference side: DTensors are written in place
report = refit(send=new_params)               # collective; prepares once, reuses the call
```

One call is a fixed sequence of steps, the same in every process. Every step that may
fail locally (binding, naming, adapters, planning, moving) catches what it raises and
carries it into the next metadata collective, so every process learns of it at the same
step and raises the same error (same class, same message):

```
 step           collective (kind)        what it carries
 identity       refit/identity           the world's first call only: each adapter's
                                         framework ids
 bind + check   refit/check              which Refit, version, layout generation, tuning,
                                         device bindings, every bind/check error
 (re)prepare    refit/layouts            only when some process's layouts (or the call's
                                         options) changed
                refit/schedule           preparing errors (planner.prepare runs between)
 fence          refit/fence              delta calls that may send deltas: destinations
                                         written outside xreshard (DeltaState.fence)
 move           (transport)              execute.run(prepared call)
 outcome        refit/outcome            each process's error, checksums (verify=)
```

Each metadata collective carries the Refit's identity, agreed by its processes at the
first call that passes ``refit/check``: the name given (``Refit(world, name=...)``), else
its position among the Refits of the world to run so far (``#1``, ``#2``, ...). Two Refits
of one world called in a different order on two processes (a policy and a reference
model) are refused as ``CollectiveMismatch`` on every process before any byte moves; the
world stays usable. Unnamed Refits whose very first calls cross would look the same (both
propose ``#1``), so a process that holds two unnamed Refits that never ran refuses the
first call of either, on every process (``RefitError``: name them).

A call that changes nothing (the same layouts everywhere) runs two metadata round trips,
refit/check before moving and refit/outcome after: the least that still refuses bad input
on every process before any byte moves.

Objects are bound by the adapter that accepts them (:mod:`xreshard.runtime.registry`: the
JAX and torch bridges, or one a third party registered), or passed as a :class:`Bound`.

Bad input (a ``XreshardError``, or any exception while binding, checking or preparing:
``RefitError``) is refused at ``refit/check`` or ``refit/schedule``, before any byte
moves; the world stays usable. A failure while moving (a dead or silent peer, or any
exception that is not xreshard's: ``RemoteError``) raises on every live process within
``RefitConfig.timeout`` plus a few seconds, keeps the first cause, leaves ``version``
unchanged and ``stale`` set, and marks the world broken (its transports are in an unknown
state): later calls raise ``WorldBroken``.

When a call returns, every destination byte has landed and every source byte was read, on
any stream: a consumer may read destinations on its current CUDA stream (torch, vLLM, a
side stream) and overwrite or donate sources without a device synchronize. ``version``
moves after the call released the world, so a collective issued the moment it moves is
not refused as concurrent.

JAX arrays are immutable: a JAX destination never has its live arrays written; it gets new
arrays built from the received buffers (``refit.received``). A refit keeps no reference to
sent JAX arrays after a call returns (so the trainer's next step can donate them): pass
``send=`` on every call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from . import writes
from .binding import Bound, side_problems
from ..config import RefitConfig, RefitReport, Tuning
from ..errors import (CommunicationError, RefitError, VerificationError,
                      XreshardError, error_from)
from . import execute
from .execute import gc_paused
from ..ir.layout import LayoutMemo
from .metadata import fit, merged_layouts, merged_quantized, stage_bindings
from .quantize_ahead import QuantAhead
from .quantized import quantized_report
from ..planner.plan import Plan, PlanCache
from ..planner.prepare import CallOptions, PreparedCall, prepare
from . import catchup, fleet, registry
from .atomic import Staging, left
from .comm_epochs import renumbering
from .delta_wire import DeltaState, delta_problems
from .handle import Background, RefitHandle, caller_streams
from .outcome import (Failed, Moved, crossed, entry, failed_call, failure_lines, rank_maps,
                      unrun_unnamed, world_state)
from .sides import Sides, on_device

__all__ = ["Bound", "Refit", "RefitConfig", "RefitHandle", "RefitReport", "Tuning"]

logger = logging.getLogger(__name__)


class Refit:
    """A collective weight refit between the processes of a world.

    Args:
        world: the joined :class:`xreshard.runtime.world.World`.
        send: what this process sends: a JAX pytree, a torch state dict / module, or a
            :class:`Bound`. A JAX pytree is not kept after a call: pass it on every call.
        receive: what this process receives into: a torch state dict / module (written in
            place), a JAX pytree of arrays or ``ShapeDtypeStruct`` with shardings (new
            arrays in ``received``), or a :class:`Bound`.
        names: tensor names: a mapping from the default name (JAX path ``"a/b/0/c"``,
            state-dict key) to the canonical name, or a callable.
        transpose: canonical names whose local tensors are ``[in, out]`` kernels of an
            ``[out, in]`` tensor (Flax ``Dense``); the layout is taken transposed, the
            bytes are read/written through a transposed view.
        rules: naming rules for a JAX pytree being sent: a
            ``xreshard.adapters.naming.NameMap`` (or a sequence of its rules), e.g.
            ``NameMap(jax_llama_rules())``. Trainer paths (``"layers/0/attn/q/kernel"``) are
            mapped onto canonical (HF) tensors as views of the shards, reshaped, transposed,
            split or unstacked as the rules say; ``names`` and ``transpose`` are then unused
            for that side. The adapter applies them (an adapter that cannot refuses them,
            on every rank, before moving).
        config: a :class:`RefitConfig` (the same in every process).
        tuning: a :class:`Tuning` (default: ``Tuning.from_env()``, read once here).
        name: this Refit's identity among the Refits of its world (the same in every
            process); default: its position among them (see the module docstring).

    Attributes:
        tuning: the :class:`Tuning`; may be replaced between calls.
        layout_memo: the layouts the adapters built, by sharding / spec and rank map, kept
            across calls so a refit every step converts each sharding once
            (``Tuning.layout_memo``). May be replaced between calls.
        version: calls that completed; moves after the call released the world.
        stale: a call failed while moving (or a started call failed with nobody waiting):
            the destinations may hold a mix of two versions.
    """

    def __init__(self, world: Any, *, send: Any = None, receive: Any = None,
                 names: Mapping[str, str] | Callable[[str], str] | None = None,
                 transpose: Iterable[str] = (), rules: Any = None,
                 config: RefitConfig | None = None, tuning: Tuning | None = None,
                 name: str | None = None):
        if config is not None and not isinstance(config, RefitConfig):
            raise RefitError(f"config must be a RefitConfig, got {type(config).__name__}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise RefitError(f"tuning must be a Tuning, got {type(tuning).__name__}")
        if name is not None and (not isinstance(name, str) or not name):
            raise RefitError(f"name must be a non-empty str, got {name!r}")
        registry.warm()     # what binding imports: before the first call's collectives
        self.world = world
        self.config = config or RefitConfig()
        self.tuning = tuning or Tuning.from_env()
        self.version = 0
        self.stale = False
        self.received: Any = None
        self.layout_memo = LayoutMemo()
        self._name = name
        self._id: str | None = None                  # agreed at the first checked call
        self._sides = Sides(send, receive, names, transpose, rules, world=world)
        self._naming = {"names": names, "transpose": tuple(transpose), "rules": rules}
        self._busy = threading.Lock()
        self._last_layouts: tuple | None = None     # this process's layouts, last call
        self._generation = 0                        # bumped when they change
        self._generations: tuple | None = None      # every process's, at the last prepare
        self._prepared: PreparedCall | None = None
        self._programs: dict = {}                   # pack programs of _prepared
        self._arena: Any = None                     # staging, reused across calls
        self._cache = PlanCache()
        self._identity: list[dict] | None = None
        self._maps: dict[str, Any] | None = None    # from _identity, once
        self._staging: Staging | None = None        # RefitConfig.atomic's shadows
        self._epoch = 0                             # the world's epoch at the last call
        self._members: list[dict] | None = None     # the world's processes at the last call
        self._tensors = (0, 0)                      # (planned, reused) by the last prepare
        #: RefitConfig(delta=True): baselines and fences, kept across calls (may be handed
        #: to the Refit of a new world: see xreshard.runtime.delta_wire)
        self.delta_state = DeltaState()
        #: FP8 items quantized while the call checks and plans (see quantize_ahead)
        self.quant_ahead = QuantAhead()
        self._claims: list[Any] = []                # every process's, this call
        #: held for a whole call: a catch-up server snapshots between calls (catchup.py)
        self.writing = threading.Lock()
        self.served: Bound | None = None    # the in-place destination of the last call
        self._server: Any = None            # its catch-up server (an elastic world)
        self.own_only = False               # bind only this process's ranks (catch-up)
        world_state(world).refits.add(self)
        if receive is not None:     # a process joining with wait=False: forms its catch-up
            catchup.ahead(self)     # world while it builds the rest

    @property
    def plan(self) -> Plan | None:
        """The current plan (after the first call); when relaying, stage 1's."""
        return None if self._prepared is None else self._prepared.plan

    @property
    def prepared(self) -> PreparedCall | None:
        """The prepared call the last call ran (see :mod:`xreshard.planner.prepare`)."""
        return self._prepared

    @property
    def staging(self) -> Any:
        """The staging memory this refit keeps across calls (per device), or None.

        Refits that run one after another can share one budget by handing it on:
        ``b.staging, a.staging = a.staging, None`` (the vLLM backend's streamed groups do).
        """
        return self._arena

    @staging.setter
    def staging(self, value: Any) -> None:
        self._arena = value

    @property
    def refit_id(self) -> str:
        """This Refit's identity in its world (agreed at its first call; until then the
        one it proposes: its name, or its position)."""
        return self._id if self._id is not None else self._proposal()

    def catch_up(self) -> RefitReport:
        """Fill the receive side with the members' current version from their replicas
        (the trainer sends nothing, no member's refit waits), in a process that joined a
        running elastic world with ``World.join(..., elastic=True, wait=False)``; then
        ``version`` is the version it holds, and the next call admits it and takes part
        like the rest (:mod:`xreshard.runtime.catchup`; a failure while moving sets ``stale``)."""
        if not self._busy.acquire(blocking=False):
            raise RefitError("this Refit is already running a call")
        previous, self.stale = self.stale, True
        try:
            report = catchup.catch_up(self, self._sides.receive.obj, self._naming)
            self.version, self.stale = report.version, False
            return report
        except XreshardError:       # refused before any byte moved
            self.stale = previous
            raise
        finally:
            self._busy.release()

    # ------------------------------------------------------------ the collective

    def __call__(self, send: Any = None, receive: Any = None) -> RefitReport:
        """Run one refit (collective over the world). New ``send``/``receive`` objects may be
        passed for this and later calls (e.g. the trainer's params after an optimizer step).

        Raises:
            XreshardError (RefitError, BindingError, PlanError, LayoutError, an adapter's
                own): bad input on any process, identically on every process, before any
                byte moves.
            CommunicationError (TransportTimeout, TransportError, CollectiveMismatch,
                VerificationError, WorldBroken, AuthenticationError, RemoteError): moving
                failed, within the timeout plus a few seconds; the version stays. A
                ``CollectiveMismatch`` at ``refit/check`` (processes in different Refits)
                moves nothing and leaves the world usable.
        """
        if not self._busy.acquire(blocking=False):
            raise RefitError("this Refit is already running a call in another thread; a "
                             "refit is collective and runs one call at a time")
        return self._run(send, receive, None)

    def start(self, send: Any = None, receive: Any = None) -> RefitHandle:
        """Start one refit in the background and return at once (collective, like a call).

        The caller keeps computing meanwhile; ``handle.wait()`` returns the report (or
        raises what the call raised, the same error on every rank), ``handle.done()``
        polls. The handle keeps ``send`` alive until the refit is done, so a JAX trainer
        can send step k's arrays while step k+1 runs: JAX arrays are immutable, no
        snapshot copy is needed (a step that donates them gets a copy from JAX instead).
        Torch senders must not write the sent tensors before ``wait()`` returns;
        ``RefitConfig(check_writes=True)`` detects it (content checksums taken here, before
        ``start()`` returns, and after the last send; see :mod:`xreshard.runtime.writes`)
        and fails the refit on every rank. Receivers hold the new version only once ``wait()``
        returned: the handle is the signal (the same Refit may be called again once
        ``wait()`` returned). While a refit runs, the world's other collectives from this
        process are refused (they would interleave with the refit's). A handle dropped
        without ``wait()`` whose refit fails logs the error at WARNING and sets ``stale``.

        Raises:
            RefitError: a call (or a started refit) of this Refit is still running.
        """
        if not self._busy.acquire(blocking=False):
            raise RefitError("this Refit is already running a call; wait() for it before "
                             "starting another")
        try:
            # the sent tensors' digests: before the caller's next line can write them
            snapshot = writes.take(send if send is not None else self._sides.send.obj) \
                if self.config.check_writes else None
            handle = RefitHandle(self, send, receive,
                                 lambda s, r: self._run(s, r, snapshot))
            handle.start()
        except BaseException:
            self._busy.release()
            raise
        return handle

    def _run(self, send: Any, receive: Any,
             snapshot: writes.Snapshot | None) -> RefitReport:
        """One call, on a Refit already acquired (``_busy``); releases it. The cyclic
        collector waits for the call's end (see ``gc_paused``: the call's objects are not
        cyclic, and a collection mid-call traverses the whole heap). The version moves
        once the world is released."""
        try:
            catchup.finish(self)    # the catch-ups are over (if any): end their world
            self.world.admit()      # joined with wait=False: the members' next call admits it
            with self.writing:      # the version moves after the world is released
                with self.world.exclusive("refit"), gc_paused(self.tuning.pause_gc):
                    report, finish = fleet.restarting(
                        self.world, lambda: self._call(send, receive, snapshot))
                if finish is not None:
                    self.received = finish()
                self.stale = False
                self.version = report.version
                if self._server is not None:        # serving a catch-up: snapshot it
                    self._server.keep(self)
            if self.served is not None and self.world.elastic:
                self._server = catchup.serve(self, self._server)
            logger.info("%s", report)
            return report
        except Failed as f:
            raise f.error from None
        finally:
            self.delta_state.stop_ahead()       # no thread reads the sources past the call
            self.quant_ahead.stop()
            self._busy.release()

    def _call(self, send: Any, receive: Any, snapshot: writes.Snapshot | None = None
              ) -> tuple[RefitReport, Callable[[], Any] | None]:
        """The call's steps; returns its report and the receiving side's ``finish``."""
        t0 = time.perf_counter()
        if self._epoch != self.world.epoch:      # other members: other ranks, a new plan
            self._epoch, self._maps, self._prepared, self._generations = \
                self.world.epoch, None, None, None
            if self._members is not None:       # templates of untouched tensors carry over
                self._cache.renumber(renumbering(self._members, self.world.processes))
        if self.world.elastic:
            self._members = self.world.processes
        src, dst, errors, snapshot = self._bind_sides(send, receive, snapshot)
        if self.config.delta:       # the diff overlaps refit/check (see delta_wire)
            self.delta_state.encode_ahead(self._prepared, src, atomic=self.config.atomic)
        if not errors:          # quantizing overlaps refit/check (see quantize_ahead)
            # but not what the delta encoder quantizes as it diffs: FP8 items once
            self.quant_ahead.start(self._prepared, src, self._programs,
                                   skip=self.delta_state.ahead_buckets)
        replanned = self._prepare(src, dst, errors, self.version + 1)
        target = self.version + 1       # a process new to the world adopted the version
        if self.config.delta and self.delta_state.fence_needed(self._claims):
            self._agree("refit/fence", {"errors": self.delta_state.fence(
                self._claims, self._prepared, dst)},
                f"refit v{target} refused before moving anything")
        plan_seconds = time.perf_counter() - t0
        error: list[str] | None = None
        moved = Moved()
        self.stale = not self.config.atomic
        try:
            moved = self._move(src, self._staged(dst), target, snapshot)
        except Exception as e:      # noqa: BLE001 - reported to the others before raising
            error = entry(e, "move")
            logger.debug("refit v%d failed here while moving", target, exc_info=True)
        if error is not None:       # (out of the except: its traceback holds gloo works)
            # peers may wait on posts this process will never make: fail them now, so they
            # reach the outcome at once, not at their timeout (and are not left out of it)
            me = self.world.describe_process(self.world.process_index)
            self.world.abort_transports(f"{me} failed while moving: {error[0]}: {error[1]}")
        try:
            verified = self._commit(error, moved.digests, target)
        except BaseException:
            if self._staging is not None:
                self._staging.abandon()
            if self.config.delta:       # every destination may hold a mix: dense next
                self.delta_state.abort()
            raise
        if self._staging is not None:       # every process agreed the call succeeded
            self._staging.commit()
        if moved.delta is not None:         # fingerprints of the destinations as committed
            self.delta_state.commit(moved.delta, dst, self._sides.receive.obj)
        self.served = dst if self.world.elastic and self._sides.receive.adapter != "jax" else None
        report = self._report(moved, target, time.perf_counter() - t0, plan_seconds,
                              replanned, verified)
        return report, (dst.finish if dst is not None else None)

    def _staged(self, dst: Bound | None) -> Bound | None:
        """``RefitConfig.atomic``: the destination to move into, its bindings replaced by
        staging (committed by ``_call`` once every process agreed); else ``dst``. JAX
        destinations are new arrays (atomic already) and are not shadowed."""
        if not self.config.atomic or dst is None or self._sides.receive.adapter == "jax":
            return dst
        if self._staging is None:
            self._staging = Staging()
        return self._staging.stage(dst)

    def _report(self, moved: Moved, target: int, seconds: float, plan_seconds: float,
                replanned: bool, verified: int) -> RefitReport:
        prepared, stats = self._prepared, moved.stats
        assert prepared is not None and stats is not None
        return RefitReport(
            version=target, seconds=seconds, plan_seconds=plan_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            bytes_local=stats.bytes_local, bytes_moved_world=prepared.bytes_moved,
            bytes_gather_broadcast_world=prepared.direct.stats.bytes_gather_broadcast,
            num_rounds=stats.num_rounds, num_messages=stats.num_messages,
            num_zero_copy=stats.num_zero_copy, staging_bytes=stats.staging_bytes,
            replanned=replanned, bytes_by_transport=moved.by_kind or None,
            tensors_planned=self._tensors[0] if replanned else 0,
            tensors_reused=self._tensors[1] if replanned else 0,
            verified=verified, bytes_forwarded=stats.bytes_forwarded,
            move_seconds=stats.seconds, quantized=quantized_report(prepared, stats),
            delta=moved.delta.summary() if moved.delta is not None else None)

    # ------------------------------------------------------------ moving

    def _move(self, src: Bound | None, dst: Bound | None, target: int,
              snapshot: writes.Snapshot | None) -> Moved:
        """Run the prepared call and, with ``verify``, checksum both ends of every stage.
        Raises whatever failed here (the caller reports it to the others)."""
        prepared, timeout = self._prepared, self.config.timeout
        assert prepared is not None
        with self.world.limited(timeout):     # creating it (first call) is collective
            transport = self.world.transport(self.config.transport)
        dst_layouts = dict(prepared.direct.dst_layouts)
        if prepared.quant is not None:      # scales are bound beside their codes
            dst_layouts.update({qt.scale: prepared.quant.scales[n]
                                for n, qt in prepared.quant.tensors.items()
                                if qt.scale not in dst_layouts})
        bindings = stage_bindings(prepared, fit(src, prepared.direct.src_layouts),
                                  fit(dst, dst_layouts))
        moved = Moved()
        before = dict(getattr(transport, "bytes_by_transport", None) or {})
        # sources do not change during a refit: their checksums overlap the move
        # (read on this thread's CUDA streams: the producers were ordered onto those)
        sent_half = digest = None
        if self.config.verify:
            from .verify import stage_digests
            digest = functools.partial(stage_digests, prepared, self._programs, self.world,
                                       self.config.verify, target)
            sent_half = Background(lambda: digest(0, bindings.src[0], {}, "send"),
                                   streams=caller_streams())
        # atomic: baselines move at the outcome; staged bases survive a failed call
        moved.delta = self.delta_state.begin(
            self._claims, prepared, atomic=self.config.atomic,
            staged=dst is not None and self._staging is not None) \
            if self.config.delta else None
        with self.quant_ahead.used(prepared, self._programs, timeout):
            moved.stats, self._arena = execute.run(
                prepared, bindings, transport, timeout=timeout, arena=self._arena,
                programs=self._programs, tuning=self.tuning, delta=moved.delta)
        after = getattr(transport, "bytes_by_transport", None) or {}
        moved.by_kind = {k: v - before.get(k, 0) for k, v in after.items()
                         if v - before.get(k, 0)}
        if sent_half is not None and digest is not None:
            merged = sent_half.result().merge(digest(0, {}, bindings.dst[0], "recv"))
            for k in range(1, len(prepared.stages)):     # forwards: both ends, after moving
                merged = merged.merge(digest(k, bindings.src[k], bindings.dst[k], "both"))
            moved.digests = merged.summary
        writes.check(snapshot)      # every source read: were they written meanwhile?
        return moved

    # ------------------------------------------------------------ binding

    def _bind_sides(self, send: Any, receive: Any, snapshot: writes.Snapshot | None
                    ) -> tuple[Bound | None, Bound | None, list[list[str]],
                               writes.Snapshot | None]:
        """Bind both sides; every local failure is collected (for refit/check), not raised.
        Returns (send side, receive side, errors, the sent tensors' write snapshot)."""
        sides = self._sides
        errors = sides.take(send, receive)
        if snapshot is None and self.config.check_writes:
            snapshot = writes.take(sides.send.obj)
        if snapshot is not None and snapshot.error is not None:
            errors.append(entry(snapshot.error, "check"))
        src = dst = None
        memo = self.layout_memo if self.tuning.layout_memo else None
        try:
            maps = self._rank_maps()
            src = sides.bind(sides.send, maps, memo)
            dst = sides.bind(sides.receive, maps, memo)
            if self.own_only:       # a catch-up world: what this process needs, no more
                dst = catchup.restricted(dst, self.world.rank_ids)
            errors += side_problems({"send": src, "receive": dst}, self.world.rank_ids,
                                    self.world.is_local, self.config.wire_dtype)
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            if isinstance(e, CommunicationError) and self.world.broken:
                raise       # a collective failed: nobody is in step to hear about it
            errors.append(entry(e, "check"))
        finally:
            sides.forget()
        return src, dst, errors, snapshot

    def _rank_maps(self) -> dict[str, Any]:
        """Framework ids -> world ranks per adapter (``{"torch": {...}, "jax": {...}}``), plus
        ``"local"``: this process's ranks; from one all-gather at the world's first refit
        call (a framework loaded, or a torch process group made, after it is not seen: join
        a new world).

        A DTensor's mesh names torch default-group ranks and a JAX mesh names device ids;
        both are resolved among the processes of this process's world group, which is
        therefore expected to be one torch job / one JAX job. A process may mix JAX and
        other devices: each JAX device publishes its id for its own rank.
        """
        if self._maps is None:
            self._identity, self._maps = rank_maps(self.world, self.config.timeout)
        return self._maps

    def _agree(self, kind: str, body: dict[str, Any], what: str,
               timeout: float | None = None) -> list[dict[str, Any]]:
        """All-gather ``body`` (with its ``errors`` and this Refit's identity); raise the
        same error everywhere if any process reported one, or (after ``refit/check``)
        named another Refit (an elastic world's members may change: ``fleet.after_check``)."""
        body, partial = dict(body, refit=self._id), self.world.elastic
        gathered = self.world.allgather_json(body, timeout=timeout or self.config.timeout,
                                             kind=kind, partial=partial)
        if partial:
            fleet.after_check(self, gathered)
        failed = []
        for p, g in enumerate(gathered):
            entries = g.get("errors") if isinstance(g, dict) else None
            if not isinstance(entries, list):
                raise Failed(error_from("CollectiveMismatch", f"{kind}: "
                              f"{self.world.describe_process(p)} sent a malformed payload"))
            failed += [(p, e) for e in entries]
        if failed:
            raise Failed(error_from(failed[0][1][0],
                                    f"{what}:\n  " + failure_lines(failed, self.world)))
        if kind != "refit/check" and len({g.get("refit") for g in gathered}) > 1:
            raise Failed(crossed(self.world, gathered, what))
        return gathered

    # ------------------------------------------------------------ metadata steps

    def _prepare(self, src: Bound | None, dst: Bound | None, errors: list[list[str]],
                 target: int) -> bool:
        """Exchange errors and metadata; prepare the call again when any layout (or the
        call's options) changed. Every process takes the same steps. Returns whether it
        prepared."""
        refused = f"refit v{target} refused before moving anything"
        key, options = self._check(src, dst, errors, refused)
        if (key == self._generations and self._prepared is not None
                and self._prepared.options == options):
            return False
        errors = []
        meta = {"send": src.describe() if src else {},
                "receive": dst.describe() if dst else {},
                "quantized": dst.describe_quantized() if dst else {},
                "config": self.config.to_dict(), "errors": []}
        metas = self._agree("refit/layouts", meta, refused)
        prepared = None
        counts = (self._cache.tensors_planned, self._cache.tensors_reused)
        try:
            src_layouts, dst_layouts = merged_layouts(metas, src, dst, self.world)
            prepared = prepare(src_layouts, dst_layouts, self.world.topology, options,
                               ranks=self.world.rank_ids, cache=self._cache,
                               quantized=merged_quantized(metas, self.world))
            errors += self._transport_problems(prepared)
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            errors.append(entry(e, "check"))
        self._agree("refit/schedule", {"errors": errors}, refused)
        assert prepared is not None
        self._tensors = (self._cache.tensors_planned - counts[0],
                         self._cache.tensors_reused - counts[1])
        self._prepared, self._programs = prepared, {}
        self._generations = key
        logger.debug("refit prepared: %s", prepared.direct.stats.to_dict())
        return True

    def _transport_problems(self, prepared: PreparedCall) -> list[list[str]]:
        """``RefitConfig(transport="local")`` copies only inside a process: a pair of this
        process's with another process is refused before any byte moves."""
        if self.config.transport != "local":
            return []
        world = self.world
        for rnd in prepared.schedule.rounds:
            for b in rnd:
                if not (world.is_local(b.src) and world.is_local(b.dst)):
                    far = b.dst if world.is_local(b.src) else b.src
                    return [["RefitError", (
                        f"RefitConfig(transport='local') copies only between the ranks of one "
                        f"process, but this refit moves {b.items[0].name!r} from rank {b.src} "
                        f"to rank {b.dst}, and rank {far} is in "
                        f"{world.describe_process(world.process_of(far))}; use "
                        f"transport='auto' (or 'gloo', 'shm', 'nccl')")]]
        return []

    def _check(self, src: Bound | None, dst: Bound | None, errors: list[list[str]],
               refused: str) -> tuple[tuple, CallOptions]:
        """refit/check: every process's Refit identity, version, layout generation, tuning,
        device bindings and errors, in one all-gather; raises (the same everywhere) on any
        error or disagreement. Returns every process's layout generation and the options
        the call is prepared with."""
        # a process says only whether its layouts changed since its last call (comparing
        # Layout objects is cheap; serializing every layout on every refit is not)
        mine = tuple((b.layouts, frozenset(b.local_only)) if b else None for b in (src, dst))
        if mine != self._last_layouts:
            self._last_layouts = mine
            self._generation += 1
        tuning = [self.tuning.executor, self.tuning.relay_overlap]
        claims = None
        if self.config.delta:       # fences: see xreshard.runtime.delta_wire
            claims, found = self.delta_state.claims(dst, self._sides.receive.obj)
            errors = errors + found + delta_problems(
                self.config, on_device(src, dst), tuning=self.tuning,
                sides=(on_device(src), on_device(dst)))
        if self._id is None and self._name is None:
            errors = errors + unrun_unnamed(self)
        gathered = self._agree("refit/check", {
            "version": self.version, "generation": self._generation, "tuning": tuning,
            "devices": on_device(src, dst), "propose": self._proposal(),
            "requests": fleet.check_body(self.world), "delta": claims,
            "errors": errors}, refused)
        self._same_refit(gathered, refused)
        self._claims = [g.get("delta") for g in gathered]
        describe = self.world.describe_process
        if any(g.get("tuning") != tuning for g in gathered):
            where = ", ".join(f"{describe(p)}: executor {g.get('tuning')[0]!r}, relay_overlap "
                              f"{g.get('tuning')[1]}" for p, g in enumerate(gathered))
            raise Failed(RefitError(f"{refused}: processes run different tunings ({where}); "
                                     f"pass the same Tuning (or set XRESHARD_EXECUTOR the "
                                     f"same) in every process"))
        versions = fleet.adopt_version(self, gathered)
        if len(versions) > 1:
            where = ", ".join(f"{describe(p)} at v{g.get('version')}"
                              for p, g in enumerate(gathered))
            raise Failed(RefitError(f"{refused}: processes are at different refit versions "
                                     f"({where}); every process must call the same Refit "
                                     f"the same number of times"))
        config = self.config
        options = CallOptions(
            bucket_bytes=config.bucket_bytes, staging_bytes=config.staging_bytes,
            wire_dtype=config.wire_dtype, relay=config.relay,
            relay_overlap=self.tuning.relay_overlap, delta=config.delta,
            # the pipelined host executor holds two rounds; device bindings run full ones
            halved=self.tuning.executor == "pipelined" and not any(g.get("devices")
                                                                  for g in gathered))
        return tuple(g.get("generation") for g in gathered), options

    def _proposal(self) -> str:
        """The identity this Refit proposes until its processes agreed on one."""
        return self._name if self._name is not None else \
            f"#{world_state(self.world).agreed + 1}"

    def _same_refit(self, gathered: list[dict[str, Any]], refused: str) -> None:
        """Agree on this Refit's identity (the first checked call), or check that every
        process is in the same Refit."""
        ids = [g.get("refit") for g in gathered]
        if fleet.one_refit(self.world, gathered):       # one agreed, the rest new to it
            if self._id is None:
                self._id = next(i for i in ids if i is not None)
                world_state(self.world).agreed += 1
            return
        if all(i is None for i in ids):
            proposals = {g.get("propose") for g in gathered}
            if len(proposals) == 1:
                self._id = proposals.pop()
                world_state(self.world).agreed += 1
                return
        elif len(set(ids)) == 1:
            return
        raise Failed(crossed(self.world, gathered, refused))

    # ------------------------------------------------------------ outcome

    def _commit(self, error: list[str] | None, digests: Any, target: int) -> int:
        """All-gather every process's outcome; raise the first cause if any failed (the
        version stays). A process that never reports within the timeout (or is gone) is
        named; every survivor builds its message from the same outcomes (the world settles
        which arrived, see ``World.allgather_json(partial=True)``). Returns how many
        checksums this process compared.

        A process that failed here waits the full timeout like the others: it told its
        peers at once (``World.abort_transports``), so they arrive promptly, and it has no
        evidence that they are lost (settling after a shorter grace would leave out, and in
        an elastic world exclude, healthy peers still on their way)."""
        outcomes = self.world.allgather_json(
            {"errors": [error] if error else [], "digests": digests, "refit": self._id},
            timeout=self.config.timeout, kind="refit/outcome", partial=True)
        missing = [p for p, o in enumerate(outcomes) if o is None]
        failed = [(p, o["errors"][0]) for p, o in enumerate(outcomes)
                  if o is not None and o.get("errors")]
        if failed or missing:       # the world dealt with, the same error everywhere
            raise Failed(failed_call(self, failed, missing, target))
        if len({o.get("refit") for o in outcomes}) > 1:
            self.world.mark_broken(f"refit v{target}: processes ended different Refits")
            raise Failed(crossed(self.world, outcomes, f"refit v{target} moved bytes, but"))
        if not self.config.verify:
            return 0
        from . import verify
        messages, compared = verify.compare([o.get("digests") for o in outcomes], self.world)
        if messages:        # the same list on every process: it compared the same digests
            raise Failed(VerificationError(
                f"refit v{target}: {len(messages)} transfer(s) arrived with other bytes than "
                f"were sent (checksums differ), {left(self.config.atomic, self.version)}:\n  "
                + "\n  ".join(messages[:20])
                + (f"\n  ... and {len(messages) - 20} more" if len(messages) > 20 else "")))
        return compared


