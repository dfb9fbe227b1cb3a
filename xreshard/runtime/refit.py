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
 fence          refit/fence              when an extension asks (delta: destinations
                                         written outside xreshard, DeltaState.fence)
 move           (transport)              execute.run(prepared call)
 outcome        refit/outcome            each process's error, extensions' parts
                                         (verify=: checksums)
```

The call-level features (``atomic`` staging, delta baselines and fences, ``verify``,
``check_writes``, catch-up, FP8 work ahead) are extensions
(:mod:`xreshard.runtime.extensions`): at each step the call runs every extension's hook
(``refit/check`` carries their parts; ``refit/fence`` runs when one asks for it), and an
extension's state kept across calls moves only when ``refit/outcome`` confirmed the call.
A feature that is off is not in the list and costs nothing.

Each metadata collective carries the Refit's identity, agreed by its processes at the
first call that passes ``refit/check``: the name given (``Refit(world, name=...)``), else
its position among the Refits of the world to run so far (``#1``, ``#2``, ...). Two Refits
of one world called in a different order on two processes (a policy and a reference
model) are refused as ``CollectiveMismatch`` on every process before any byte moves; the
world stays usable. Unnamed Refits whose very first calls cross would look the same (both
propose ``#1``), so a process that holds two unnamed Refits that never ran refuses the
first call of either, on every process (``RefitError``: name them).

A call that changes nothing runs two metadata round trips (refit/check, refit/outcome):
the least that still refuses bad input on every process before any byte moves. Objects are
bound by the adapter that accepts them (:mod:`xreshard.runtime.registry`), or passed as a
:class:`Bound`.

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

A JAX destination never has its live arrays written: it gets new arrays
(``refit.received``). A refit keeps no reference to sent JAX arrays after a call returns
(the trainer's next step may donate them): pass ``send=`` on every call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from .binding import Bound, side_problems
from ..config import RefitConfig, RefitReport, Tuning
from ..errors import CommunicationError, RefitError, XreshardError, error_from
from . import execute
from . import extensions as _extensions
from .gcpause import gc_paused
from .extensions import Call, Extension, exported
from ..ir.layout import LayoutMemo
from .metadata import fit, merged_layouts, merged_quantized, stage_bindings, stored_claims
from ..planner.plan import Plan, PlanCache
from ..planner.prepare import CallOptions, PreparedCall, prepare
from . import fleet, registry
from .comm_epochs import renumbering
from .handle import RefitHandle
from .outcome import (Failed, crossed, entry, failed_call, failure_lines, outcome_wait,
                      rank_maps, unrun_unnamed, world_state)
from .sides import Sides, on_device

__all__ = ["Bound", "Refit", "RefitConfig", "RefitHandle", "RefitReport", "Tuning"]

logger = logging.getLogger(__name__)

_FREE_INLINE = 512      # a call holding at most this many source views frees them inline


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
        extensions: the call-level features this Refit runs
            (:mod:`xreshard.runtime.extensions`); default: those ``config`` and ``tuning``
            switch on (``extensions.for_config``).

    Attributes:
        tuning: the :class:`Tuning`; may be replaced between calls.
        layout_memo: the layouts the adapters built, by sharding / spec and rank map, kept
            across calls so a refit every step converts each sharding once
            (``Tuning.layout_memo``). May be replaced between calls.
        version: calls that completed; moves after the call released the world.
        stale: a call failed while moving (or a started call failed with nobody waiting):
            the destinations may hold a mix of two versions.
        extensions: its call-level features, in the order their hooks run.
        served: the in-place destination of the last call (an elastic world's member
            serves it to catch-ups), or None.
        writing: held for a whole call (a catch-up server snapshots between calls).
    """

    delta_state = exported("delta", "state", "``RefitConfig(delta=True)``: baselines and "
                           "fences, kept across calls (may be handed to the Refit of a new "
                           "world: see xreshard.runtime.delta_wire); None without delta.")
    quant_ahead = exported("fp8", "ahead", "FP8 items quantized while the call checks and "
                           "plans (see xreshard.runtime.quantize_ahead).")
    _staging = exported("atomic", "staging", "``RefitConfig(atomic=True)``'s shadows.")

    def __init__(self, world: Any, *, send: Any = None, receive: Any = None,
                 names: Mapping[str, str] | Callable[[str], str] | None = None,
                 transpose: Iterable[str] = (), rules: Any = None,
                 config: RefitConfig | None = None, tuning: Tuning | None = None,
                 name: str | None = None, extensions: Sequence[Extension] | None = None):
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
        self._bound: threading.Event | None = None     # set once start()'s call bound
        self._last_layouts: tuple | None = None     # this process's layouts, last call
        self._generation = 0                        # bumped when they change
        self._generations: tuple | None = None      # every process's, at the last prepare
        self._prepared: PreparedCall | None = None
        self._programs: dict = {}                   # pack programs of _prepared
        self._arena: Any = None                     # staging, reused across calls
        self._cache = PlanCache()
        self._maps: dict[str, Any] | None = None    # from the identity exchange, once
        self._epoch = 0                             # the world's epoch at the last call
        self._members: list[dict] | None = None     # the world's processes at the last call
        self._tensors = (0, 0)                      # (planned, reused) by the last prepare
        self.extensions: list[Extension] = list(
            _extensions.for_config(self.config, self.tuning) if extensions is None
            else extensions)
        self.writing = threading.Lock()
        self.served: Bound | None = None
        world_state(world).refits.add(self)
        for ext in self.extensions:
            ext.made(self)

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
    def send_obj(self) -> Any:
        """What this process sends (the last object passed), or None."""
        return self._sides.send.obj

    @property
    def receive_obj(self) -> Any:
        """What this process receives into (the last object passed), or None."""
        return self._sides.receive.obj

    @property
    def receive_adapter(self) -> str | None:
        """The adapter that bound the receiving side ("jax", "torch", ...), or None."""
        return self._sides.receive.adapter

    @property
    def naming(self) -> dict[str, Any]:
        """The naming this Refit was made with (``names``, ``transpose``, ``rules``)."""
        return dict(self._naming)

    @property
    def keeps_destinations(self) -> bool:
        """A failed call leaves the destinations as they were (``atomic``)."""
        return any(ext.keeps_destinations for ext in self.extensions)

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
            report = _extensions.catch_up(self)
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
        return self._run(send, receive)

    def start(self, send: Any = None, receive: Any = None) -> RefitHandle:
        """Start one refit in the background (collective, like a call); return once it has
        bound its sides, or at once where it must first wait for the others (a world's
        first call, admission): from then on a JAX trainer may donate what it sent (read:
        stacks copied, views make JAX copy). ``handle.wait()`` returns the report or raises
        the call's error (the same on every rank); ``handle.done()`` polls. Torch senders
        must not write the sent tensors before ``wait()`` (``check_writes=True`` fails such
        a refit on every rank: :mod:`xreshard.runtime.writes`). Receivers hold the new
        version once ``wait()`` returned. While a refit runs, the world's other collectives
        from this process are refused; a dropped handle's failure is logged, sets ``stale``.

        Raises:
            RefitError: a call (or a started refit) of this Refit is still running.
        """
        if not self._busy.acquire(blocking=False):
            raise RefitError("this Refit is already running a call; wait() for it before "
                             "starting another")
        try:
            for ext in self.extensions:       # before the caller's next line (check_writes)
                ext.started(send if send is not None else self._sides.send.obj)
            handle = RefitHandle(self, send, receive, self._run)
            self._bound = threading.Event()
            handle.start(self._bound)
        except BaseException:
            for ext in self.extensions:
                ext.end()
            self._busy.release()
            raise
        return handle

    def _run(self, send: Any, receive: Any) -> RefitReport:
        """One call, on a Refit already acquired (``_busy``); releases it. The cyclic
        collector waits for the call's end (see ``gc_paused``: the call's objects are not
        cyclic, and a collection mid-call traverses the whole heap). The version moves
        once the world is released."""
        try:
            for ext in self.extensions:
                ext.entered(self)
            if not self.world.admitted:     # start() must not wait for the others
                self._started()
            self.world.admit()      # joined with wait=False: the members' next call admits it
            with self.writing:      # the version moves after the world is released
                with self.world.exclusive("refit"), gc_paused(self.tuning.pause_gc):
                    report, finish = fleet.restarting(
                        self.world, lambda: self._call(send, receive))
                if finish is not None:
                    self.received = finish()
                self.stale = False
                self.version = report.version
                for ext in self.extensions:
                    ext.finished(self)
            for ext in self.extensions:
                ext.released(self)
            logger.info("%s", report)
            return report
        except Failed as f:
            raise f.error from None
        finally:
            for ext in self.extensions:       # no thread reads the sources past the call
                ext.end()
            self._busy.release()

    def _call(self, send: Any, receive: Any) -> tuple[RefitReport, Callable[[], Any] | None]:
        """The call's steps; returns its report and the receiving side's ``finish``."""
        t0 = time.perf_counter()
        if self._epoch != self.world.epoch:      # other members: other ranks, a new plan
            self._epoch, self._maps, self._prepared, self._generations = \
                self.world.epoch, None, None, None
            if self._members is not None:       # templates of untouched tensors carry over
                self._cache.renumber(renumbering(self._members, self.world.processes))
        if self.world.elastic:
            self._members = self.world.processes
        call = Call(self)
        call.prepared, call.programs = self._prepared, self._programs
        self._bind_sides(call, send, receive)
        replanned = self._prepare(call, self.version + 1)
        call.target = target = self.version + 1     # a process new to the world adopted it
        call.prepared, call.programs = self._prepared, self._programs
        fences = [f for f in (ext.fence(call) for ext in self.extensions) if f is not None]
        if fences:      # the same decision on every process (from refit/check's parts)
            self._agree("refit/fence", {"errors": [x for f in fences for x in f]},
                        f"refit v{target} refused before moving anything")
        plan_seconds = time.perf_counter() - t0
        error: list[str] | None = None
        self.stale = not self.keeps_destinations
        try:
            self._move(call)
        except Exception as e:      # noqa: BLE001 - reported to the others before raising
            error = entry(e, "move")
            logger.debug("refit v%d failed here while moving", target, exc_info=True)
        if error is not None:       # (out of the except: its traceback holds gloo works)
            # peers may wait on posts never made here: fail them now, not at their timeout
            me = self.world.describe_process(self.world.process_index)
            self.world.transports.abort(f"{me} failed while moving: {error[0]}: {error[1]}")
        # nothing reads the sources after the move: thousands of views (~1 us each) go on a
        # thread while this one exchanges the outcome, a few hundred here (0.2-4 ms a start)
        held = [call.src, call.bindings]
        freeing = (threading.Thread(target=held.clear, name="xreshard-free", daemon=True)
                   if call.src is not None and len(call.src.bindings) > _FREE_INLINE else None)
        call.src = call.bindings = None
        if freeing is None:
            held.clear()
        else:
            freeing.start()
        try:
            fields = self._commit(call, error)
        except BaseException:
            for ext in self.extensions:       # every extension's state stays as it was
                ext.abort()
            raise
        finally:        # none left when the call returns (the trainer may donate them)
            if freeing is not None:
                freeing.join()
        for ext in self.extensions:       # every process agreed the call succeeded
            ext.commit(call)
        report = self._report(call, fields, time.perf_counter() - t0, plan_seconds,
                              replanned)
        return report, (call.dst.finish if call.dst is not None else None)

    def _report(self, call: Call, fields: dict[str, Any], seconds: float,
                plan_seconds: float, replanned: bool) -> RefitReport:
        prepared, stats = self._prepared, call.stats
        assert prepared is not None and stats is not None
        for ext in self.extensions:
            ext.report(call, fields)
        return RefitReport(
            version=call.target, seconds=seconds, plan_seconds=plan_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            bytes_local=stats.bytes_local, bytes_moved_world=prepared.bytes_moved,
            bytes_gather_broadcast_world=prepared.direct.stats.bytes_gather_broadcast,
            num_rounds=stats.num_rounds, num_messages=stats.num_messages,
            num_zero_copy=stats.num_zero_copy, staging_bytes=stats.staging_bytes,
            replanned=replanned, bytes_by_transport=call.by_kind or None,
            tensors_planned=self._tensors[0] if replanned else 0,
            tensors_reused=self._tensors[1] if replanned else 0,
            bytes_forwarded=stats.bytes_forwarded, move_seconds=stats.seconds, **fields)

    # ------------------------------------------------------------ moving

    def _move(self, call: Call) -> None:
        """Run the prepared call into the destinations the extensions give, inside their
        ``begin`` contexts. Raises whatever failed here (the caller reports it to the
        others)."""
        prepared, timeout = self._prepared, self.config.timeout
        assert prepared is not None
        with self.world.limited(timeout):     # creating it (first call) is collective
            transport = self.world.transport(self.config.transport)
        dst = call.dst
        for ext in self.extensions:
            dst = ext.destinations(call, dst)
        dst_layouts = dict(prepared.direct.dst_layouts)
        if prepared.formats.quant is not None:      # scales are bound beside their codes
            dst_layouts.update({qt.scale: prepared.formats.quant.scales[n]
                                for n, qt in prepared.formats.quant.tensors.items()
                                if qt.scale not in dst_layouts})
        call.bindings = bindings = stage_bindings(
            prepared, fit(call.src, prepared.direct.src_layouts), fit(dst, dst_layouts))
        before = dict(getattr(transport, "bytes_by_transport", None) or {})
        with contextlib.ExitStack() as hooks:
            for ext in self.extensions:
                hooks.enter_context(ext.begin(call))
            call.stats, self._arena = execute.run(
                prepared, bindings, transport, timeout=timeout, arena=self._arena,
                programs=self._programs, tuning=self.tuning, epoch=self.world.epoch,
                **call.run_args)
        after = getattr(transport, "bytes_by_transport", None) or {}
        call.by_kind = {k: v - before.get(k, 0) for k, v in after.items()
                        if v - before.get(k, 0)}

    # ------------------------------------------------------------ binding

    def _bind_sides(self, call: Call, send: Any, receive: Any) -> None:
        """Bind both sides into ``call`` (``src``, ``dst``); every local failure is
        collected in ``call.errors`` (for refit/check), not raised."""
        sides = self._sides
        call.errors = sides.take(send, receive)
        memo = self.layout_memo if self.tuning.layout_memo else None
        try:
            maps = self._rank_maps()
            call.src = sides.bind(sides.send, maps, memo)
            call.dst = sides.bind(sides.receive, maps, memo)
            for ext in self.extensions:
                ext.bound(call)
            call.errors += side_problems({"send": call.src, "receive": call.dst},
                                         self.world.rank_ids, self.world.is_local,
                                         self.config.wire_dtype)
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            if isinstance(e, CommunicationError) and self.world.broken:
                raise       # a collective failed: nobody is in step to hear about it
            call.errors.append(entry(e, "check"))
        finally:
            sides.forget()
            self._started()

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
            self._started()         # a collective: start() must not wait for the others
            _, self._maps = rank_maps(self.world, self.config.timeout)
        return self._maps

    def _started(self) -> None:
        """Let ``start()`` return: the call bound its sides, or must wait for the others."""
        if self._bound is not None:
            self._bound.set()

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

    def _prepare(self, call: Call, target: int) -> bool:
        """Exchange errors and metadata; prepare the call again when any layout (or the
        call's options) changed. Every process takes the same steps. Returns whether it
        prepared."""
        refused = f"refit v{target} refused before moving anything"
        key, options = self._check(call, refused)
        src, dst = call.src, call.dst
        if (key == self._generations and self._prepared is not None
                and self._prepared.options == options):
            return False
        errors = []
        meta = {"send": src.describe() if src else {},
                "transposed": src.stored_transposed() if src and self.tuning.send_stored else [],
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
                               quantized=merged_quantized(metas, self.world),
                               epoch=self.world.epoch,
                               stored_transposed=stored_claims(metas, self.world))
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

    def _check(self, call: Call, refused: str) -> tuple[tuple, CallOptions]:
        """refit/check: every process's Refit identity, version, layout generation, tuning,
        device bindings, extensions' parts and errors, in one all-gather; raises (the same
        everywhere) on any error or disagreement. Returns every process's layout generation
        and the options the call is prepared with."""
        src, dst, errors = call.src, call.dst, list(call.errors)
        # a process says only whether its layouts changed since its last call (comparing
        # Layout objects is cheap; serializing every layout on every refit is not)
        mine = tuple((b.layouts, frozenset(b.local_only)) if b else None for b in (src, dst))
        if mine != self._last_layouts:
            self._last_layouts = mine
            self._generation += 1
        tuning = [self.tuning.executor, self.tuning.relay_overlap]
        parts: dict[str, Any] = {}
        for ext in self.extensions:       # their work ahead overlaps the gather
            part, found = ext.check(call)
            errors += found
            if part is not None:
                parts[ext.name] = part
        if self._id is None and self._name is None:
            errors = errors + unrun_unnamed(self)
        gathered = self._agree("refit/check", {
            "version": self.version, "generation": self._generation, "tuning": tuning,
            "devices": on_device(src, dst), "propose": self._proposal(),
            "requests": fleet.check_body(self.world), "extensions": parts,
            "errors": errors}, refused)
        self._same_refit(gathered, refused)
        for ext in self.extensions:
            ext.checked(call, [(g.get("extensions") or {}).get(ext.name) for g in gathered])
        describe = self.world.describe_process
        if any(g.get("tuning") != tuning for g in gathered):
            seen = [g.get("tuning") or [None, None] for g in gathered]
            where = ", ".join(f"{describe(p)}: executor {t[0]!r}, relay_overlap {t[1]}"
                              for p, t in enumerate(seen))
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
        options = CallOptions(**{
            "bucket_bytes": config.bucket_bytes, "staging_bytes": config.staging_bytes,
            "wire_dtype": config.wire_dtype, "relay": config.relay,
            "relay_overlap": self.tuning.relay_overlap,
            # the pipelined host executor holds two rounds; device bindings run full ones
            "halved": self.tuning.executor == "pipelined" and not any(
                g.get("devices") for g in gathered),
            **{k: v for ext in self.extensions for k, v in ext.options.items()}})
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

    def _commit(self, call: Call, error: list[str] | None) -> dict[str, Any]:
        """All-gather every process's outcome; raise the first cause if any failed (the
        version stays). A process that never reports within the timeout (or is gone) is
        named; every survivor builds its message from the same outcomes (the world settles
        which arrived, see ``World.allgather_json(partial=True)``). Then each extension
        judges the outcomes (``verify`` compares checksums; it may fail the call). Returns
        the report fields they set.

        A process that failed here told its peers at once (``WorldTransports.abort``), so
        they arrive promptly, and it has no evidence that they are lost (settling after a
        shorter wait would leave out, and in an elastic world exclude, healthy peers still
        on their way): it waits the timeout plus a grace (``outcome_wait``), as a peer
        still in a transport wait fails at that wait's timeout, after it arrived."""
        target = call.target
        outcomes = self.world.allgather_json(
            {**call.told, "errors": [error] if error else [], "refit": self._id},
            timeout=outcome_wait(self.config.timeout, error), kind="refit/outcome", partial=True)
        missing = [p for p, o in enumerate(outcomes) if o is None]
        failed = [(p, o["errors"][0]) for p, o in enumerate(outcomes)
                  if o is not None and o.get("errors")]
        if failed or missing:       # the world dealt with, the same error everywhere
            raise Failed(failed_call(self, failed, missing, target))
        if len({o.get("refit") for o in outcomes}) > 1:
            self.world.mark_broken(f"refit v{target}: processes ended different Refits")
            raise Failed(crossed(self.world, outcomes, f"refit v{target} moved bytes, but"))
        fields: dict[str, Any] = {}
        for ext in self.extensions:
            ext.outcome(call, outcomes, fields)
        return fields
