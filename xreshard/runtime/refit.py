"""The user-facing refit: one collective call moves every tensor shard to shard.

```python
world = xr.World.join(address, group="trainer", devices=jax.local_devices(), num_processes=3)
refit = xr.Refit(world, send=params)          # trainer: a pytree of jax.Arrays / a state dict
refit = xr.Refit(world, receive=state_dict)   # inference side: DTensors are written in place
report = refit(send=new_params)               # collective; plans once, reuses the plan
```

One call is a fixed sequence of steps, the same in every process. Every step that may
fail locally (binding, naming, adapters, planning, moving) catches what it raises and
carries it into the next metadata collective, so every process learns of it at the same
step and raises the same error (same class, same message):

```
 step           collective (kind)        what it carries
 identity       refit/identity           first call only: each adapter's framework ids
 bind + check   refit/check              version, layout generation, every bind/check error
 (re)plan       refit/layouts            only when some process's layouts changed
 schedule       refit/schedule           peer counts, planning errors
 move           (transport)
 outcome        refit/outcome            each process's error, checksums (verify=)
```

A call that changes nothing (the same layouts everywhere) runs two metadata round trips,
refit/check before moving and refit/outcome after: the least that still refuses bad input
on every process before any byte moves.

Objects are bound by the adapter that accepts them (:mod:`xreshard.runtime.registry`: the JAX and
torch bridges, or one a third party registered), or passed as a :class:`Bound`.

Bad input (a ``XreshardError``) is refused at ``refit/check`` or ``refit/schedule``,
before any byte moves; the world stays usable. A failure while moving (a dead or silent
peer) raises on every live process within ``RefitConfig.timeout`` plus a few seconds,
keeps the first cause, leaves ``version`` unchanged and ``stale`` set, and marks the world
broken (its transports are in an unknown state): later calls raise ``WorldBroken``.

When a call returns, every destination byte has landed and every source byte was read, on
any stream: a consumer may read destinations on its current CUDA stream (torch, vLLM, a
side stream) and overwrite or donate sources without a device synchronize.

JAX arrays are immutable: a JAX destination never has its live arrays written; it gets new
arrays built from the received buffers (``refit.received``). A refit keeps no reference to
sent JAX arrays after a call returns (so the trainer's next step can donate them): pass
``send=`` on every call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from . import registry
from .binding import Bound, side_problems
from ..errors import (CommunicationError, RefitError, VerificationError, XreshardError,
                     error_from, error_name)
from .execute import Executor, gc_paused, pipelined_by_default
from ..config import RefitConfig, RefitReport
from ..ir.layout import LayoutMemo
from .metadata import fit, plan_from
from ..planner.plan import Plan, PlanCache
from ..planner.schedule import Schedule, peer_counts, schedule
from .handle import Background, RefitHandle
from ..planner.stages import Stages, half_schedule, stages_of

__all__ = ["Bound", "Refit", "RefitConfig", "RefitHandle", "RefitReport"]

logger = logging.getLogger(__name__)

#: seconds a process that already failed waits for the others' outcomes
_GRACE = 3.0

#: the name tests and tools knew stage 2's schedule by


class _Failed(Exception):
    """A failure every process agreed on: raise ``error`` (the same everywhere)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _entry(exc: BaseException) -> list[str]:
    """How a local exception crosses processes: [class name, message]."""
    return [error_name(exc), str(exc) or type(exc).__name__]


class _Side:
    """One side (send or receive) of this process, as the last call bound it."""

    def __init__(self, name: str):
        self.name = name
        self.obj: Any = None            # what the next argument-less call binds
        self.adapter: str | None = None  # the adapter of the last bound object
        self.cache: dict = {}           # that adapter's BindContext.cache
        self.module: Any = None         # that adapter's module, this call
        self.dropped: str | None = None  # LABEL of an object the adapter would not keep


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
        config: a :class:`RefitConfig`.

    Attributes:
        layout_memo: the layouts the adapters built, by sharding / spec and rank map, kept
            across calls so a refit every step converts each sharding once. Assign a fresh
            ``LayoutMemo`` (``enabled = False`` for none) to measure a call without it.
    """

    def __init__(self, world: Any, *, send: Any = None, receive: Any = None,
                 names: Mapping[str, str] | Callable[[str], str] | None = None,
                 transpose: Iterable[str] = (), rules: Any = None,
                 config: RefitConfig | None = None):
        if config is not None and not isinstance(config, RefitConfig):
            raise RefitError(f"config must be a RefitConfig, got {type(config).__name__}")
        self.world = world
        self.config = config or RefitConfig()
        self.version = 0
        self.stale = False
        self.received: Any = None
        self.layout_memo = LayoutMemo()
        self._sides = {"send": _Side("send"), "receive": _Side("receive")}
        self._sides["send"].obj, self._sides["receive"].obj = send, receive
        self._names = names
        self._transpose = frozenset(transpose)
        self._rules = rules
        self._busy = threading.Lock()
        self._last_layouts: tuple | None = None     # this process's layouts, last call
        self._generation = 0                        # bumped when they change
        self._generations: tuple | None = None      # every process's, at the last plan
        self._plan: Plan | None = None
        self._schedule: Schedule | None = None
        self._half: tuple[Plan, Schedule] | None = None   # the pipelined schedule, per plan
        self._relay: Stages | None = None           # RefitConfig.relay: the two stages
        self._arena: Any = None                     # staging, reused across calls
        self._cache = PlanCache()
        self._identity: list[dict] | None = None
        self._maps: dict[str, Any] | None = None    # from _identity, once
        self._pipeline: bool | None = None

    @property
    def plan(self) -> Plan | None:
        """The current plan (after the first call); when relaying, stage 1's."""
        return self._plan

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

    # ------------------------------------------------------------ the collective

    def __call__(self, send: Any = None, receive: Any = None) -> RefitReport:
        """Run one refit (collective over the world). New ``send``/``receive`` objects may be
        passed for this and later calls (e.g. the trainer's params after an optimizer step).

        Raises:
            XreshardError (RefitError, BindingError, PlanError, LayoutError): bad input on
                any process, identically on every process, before any byte moves.
            CommunicationError (TransportTimeout, TransportError, CollectiveMismatch,
                VerificationError, WorldBroken, AuthenticationError): moving failed, within
                the timeout plus a few seconds; the version stays.
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
        ``RefitConfig(check_writes=True)`` detects it (torch version counters) and fails
        the refit on every rank. Receivers hold the new version only once ``wait()``
        returned. While a refit runs, the world's other collectives from this process are
        refused (they would interleave with the refit's).

        Raises:
            RefitError: a call (or a started refit) of this Refit is still running.
        """
        if not self._busy.acquire(blocking=False):
            raise RefitError("this Refit is already running a call; wait() for it before "
                             "starting another")
        try:
            # the sent tensors' write counters: before the caller's next line can write them
            versions = self._write_versions(send if send is not None else
                                            self._sides["send"].obj) \
                if self.config.check_writes else None
            handle = RefitHandle(self, send, receive,
                                 lambda s, r: self._run(s, r, versions))
            handle.start()
        except BaseException:
            self._busy.release()
            raise
        return handle

    def _run(self, send: Any, receive: Any,
             versions: Mapping[str, int] | None) -> RefitReport:
        """One call, on a Refit already acquired (``_busy``); releases it. The cyclic
        collector waits for the call's end (see ``gc_paused``: the call's objects are not
        cyclic, and a collection mid-call traverses the whole heap)."""
        try:
            with self.world.exclusive("refit"), gc_paused():
                return self._call(send, receive, versions)
        except _Failed as f:
            raise f.error from None
        finally:
            self._busy.release()

    def _call(self, send: Any, receive: Any,
              versions: Mapping[str, int] | None = None) -> RefitReport:
        t0 = time.perf_counter()
        target = self.version + 1
        src, dst, errors, versions = self._bind_sides(send, receive, versions)
        replanned = self._prepare(src, dst, errors, target)
        assert self._plan is not None and self._schedule is not None
        plan_seconds = time.perf_counter() - t0
        error: list[str] | None = None
        moved = _Moved()
        self.stale = True
        try:
            moved = self._move(src, dst, target, versions)
        except Exception as e:      # noqa: BLE001 - reported to the others before raising
            error = _entry(e)
            logger.debug("refit v%d failed here while moving", target, exc_info=True)
        verified = self._commit(error, moved.digests, target)
        if dst is not None and dst.finish is not None:
            self.received = dst.finish()
        self.stale = False
        self.version = target
        report = self._report(moved, time.perf_counter() - t0, plan_seconds, replanned,
                              verified)
        logger.info("%s", report)
        return report

    def _report(self, moved: _Moved, seconds: float, plan_seconds: float, replanned: bool,
                verified: int) -> RefitReport:
        assert self._plan is not None and moved.stats is not None
        moved_world = self._plan.stats.bytes_moved
        gather_broadcast = self._plan.stats.bytes_gather_broadcast
        if self._relay is not None:
            gather_broadcast = self._relay.bytes_gather_broadcast
            if self._relay.plan2 is not None:
                moved_world += self._relay.plan2.stats.bytes_moved
        stats = moved.stats
        return RefitReport(
            version=self.version, seconds=seconds, plan_seconds=plan_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            bytes_local=stats.bytes_local, bytes_moved_world=moved_world,
            bytes_gather_broadcast_world=gather_broadcast, num_rounds=stats.num_rounds,
            num_messages=stats.num_messages, num_zero_copy=stats.num_zero_copy,
            staging_bytes=stats.staging_bytes,
            replanned=replanned, bytes_by_transport=moved.by_kind or None,
            verified=verified, bytes_forwarded=stats.bytes_forwarded,
            move_seconds=stats.seconds)

    # ------------------------------------------------------------ moving

    def _move(self, src: Bound | None, dst: Bound | None, target: int,
              versions: Mapping[str, int]) -> _Moved:
        """Move this call's bytes (relayed: both stages) and, with ``verify``, checksum
        both ends. Raises whatever failed here (the caller reports it to the others)."""
        assert self._plan is not None and self._schedule is not None
        p, timeout = self._plan, self.config.timeout
        with self.world.limited(timeout):     # creating it (first call) is collective
            transport = self.world.transport(self.config.transport)
        relay = self._relay
        src_bindings = fit(src, p.src_layouts)
        real_dst: dict = {}
        if relay is None:
            dst_bindings = fit(dst, p.dst_layouts)
        else:       # stage 1 writes views of the real destination memory
            from ..planner.relay import stage_views
            real_dst = fit(dst, relay.dst_layouts)
            dst_bindings = stage_views(relay.dst_layouts, real_dst, relay.layouts.stage1_dst,
                                       self.world.rank_ids)
        pipeline = bool(self._pipeline)
        sched = self._schedule
        if pipeline:
            if self._half is None or self._half[0] is not p:
                self._half = (p, half_schedule(p, list(self.world.rank_ids),
                                               self.config.bucket_bytes,
                                               self.config.staging_bytes))
            sched = self._half[1]
        moved = _Moved()
        before = dict(getattr(transport, "bytes_by_transport", None) or {})
        # sources do not change during a refit: their checksums overlap the move
        sent_half = Background(lambda: self._digest(src_bindings, {}, target, "send")) \
            if self.config.verify else None
        relay_digests = None
        if relay is not None and relay.plan2 is not None:
            # both stages in one run, forwarding overlapped with arrival (see relay.py)
            from ..planner.relay import overlapped_executor
            executor, views2 = overlapped_executor(
                relay, src_bindings, dst_bindings, real_dst, transport, timeout,
                ranks=self.world.rank_ids, pipeline=pipeline,
                bucket_bytes=self.config.bucket_bytes, staging_bytes=self.config.staging_bytes,
                arena=self._arena)
            moved.stats = self._execute(executor)
            if self.config.verify:
                from . import verify
                relay_digests = verify.digest_bindings(
                    relay.plan2, self.world.rank_ids, *views2, mode=self.config.verify,
                    version=target)
        else:
            moved.stats = self._execute(Executor(
                sched, p.src_layouts, p.dst_layouts, p.wire_dtypes, src_bindings, dst_bindings,
                transport, timeout, pipeline=pipeline, staging_bytes=self.config.staging_bytes,
                arena=self._arena))
        after = getattr(transport, "bytes_by_transport", None) or {}
        moved.by_kind = {k: v - before.get(k, 0) for k, v in after.items()
                         if v - before.get(k, 0)}
        if sent_half is not None:
            merged = sent_half.result().merge(self._digest({}, dst_bindings, target, "recv"))
            if relay_digests is not None:
                merged = merged.merge(relay_digests)
            moved.digests = merged.summary
        if versions:
            self._check_unwritten(versions)
        return moved

    def _execute(self, executor: Executor) -> Any:
        """Run ``executor``, keeping its staging for the next call (``Refit.staging``)."""
        stats = executor.run()
        self._arena = executor.arena
        return stats

    def _pipelined(self) -> bool:
        """Whether this process runs the pipelined executor (``refit.executor_kind``, else
        ``XRESHARD_EXECUTOR``); every process of a refit must agree."""
        kind = getattr(self, "executor_kind", None)
        return pipelined_by_default() if kind is None else kind == "pipelined"

    def _digest(self, src_bindings: Any, dst_bindings: Any, target: int, sides: str) -> Any:
        from . import verify
        return verify.digest_bindings(self._plan, self.world.rank_ids, src_bindings,
                                      dst_bindings, mode=self.config.verify, version=target,
                                      sides=sides)

    # ------------------------------------------------------------ binding

    def _bind_sides(self, send: Any, receive: Any, versions: Mapping[str, int] | None
                    ) -> tuple[Bound | None, Bound | None, list[list[str]], Mapping[str, int]]:
        """Bind both sides; every local failure is collected (for refit/check), not raised.
        Returns (send side, receive side, errors, write versions of the sent tensors)."""
        sides = self._sides
        if send is not None:
            sides["send"].obj = send
        if receive is not None:
            sides["receive"].obj = receive
        errors: list[list[str]] = []
        if versions is None:
            versions = self._write_versions(sides["send"].obj) if self.config.check_writes \
                else {}
        dropped = sides["send"].dropped
        if send is None and dropped:
            errors.append(["RefitError", f"this process sent {dropped} before and passed no "
                           f"send= now: a Refit keeps no reference to sent {dropped} (so the "
                           f"trainer can donate them); pass send=params on every call"])
        src = dst = None
        for state in sides.values():
            state.module = None
        try:
            self._pipeline = None
            self._pipeline = self._pipelined()
            maps = self._rank_maps()
            src = self._bind(sides["send"].obj, "send", maps)
            dst = self._bind(sides["receive"].obj, "receive", maps)
            errors += self._local_problems(src, dst)
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            if isinstance(e, CommunicationError) and self.world.broken:
                raise       # a collective failed: nobody is in step to hear about it
            errors.append(_entry(e))
        finally:
            self._forget()
        return src, dst, errors, versions

    def _rank_maps(self) -> dict[str, Any]:
        """Framework ids -> world ranks per adapter (``{"torch": {...}, "jax": {...}}``), plus
        ``"local"``: this process's ranks; from one all-gather on the first call.

        A DTensor's mesh names torch default-group ranks and a JAX mesh names device ids;
        both are resolved among the processes of this process's world group, which is
        therefore expected to be one torch job / one JAX job. A process may mix JAX and
        other devices: each JAX device publishes its id for its own rank.
        """
        if self._maps is not None:
            return self._maps
        if self._identity is None:
            ranks = list(self.world.rank_ids)
            me: dict[str, Any] = {"ranks": ranks, "ids": {}}
            try:
                me["ids"] = registry.identity([self.world.local_device(r) for r in ranks],
                                              ranks)
            except Exception as e:      # noqa: BLE001 - reported at refit/check instead
                me["error"] = _entry(e)
            self._identity = self.world.allgather_json(me, timeout=self.config.timeout,
                                                       kind="refit/identity")
        processes, index = self.world.processes, self.world.process_index
        maps: dict[str, Any] = {}
        # several single-process JAX jobs in one group (engine replicas) reuse device ids:
        # this process's own ids (last) are what its objects name
        infos = [info for p, info in enumerate(self._identity)
                 if processes[p]["group"] == processes[index]["group"] and p != index]
        for info in infos + [self._identity[index]]:
            for name, pairs in (info.get("ids") or {}).items():
                known = maps.setdefault(name, {})
                for framework_id, rank in pairs:
                    known[framework_id] = int(rank)
        mine = self._identity[index].get("error")
        if mine:
            raise error_from(*mine)
        maps["local"] = list(self.world.rank_ids)
        self._maps = maps       # the world's processes and their ids do not change
        return maps

    def _bind(self, obj: Any, side: str, maps: dict[str, Any]) -> Bound | None:
        if obj is None:
            return None
        if isinstance(obj, Bound):
            return obj
        found = registry.adapter_for(obj)
        if found is None:
            raise RefitError(f"cannot tell which framework {side}={type(obj).__name__} belongs "
                             "to; pass a JAX pytree, a torch state dict or module, or an "
                             "xreshard Bound (or register an adapter for it: "
                             "xreshard.runtime.registry.register_adapter)")
        entry, module = found
        state = self._sides[side]
        state.module = module
        if state.adapter != entry.name:
            state.adapter, state.cache = entry.name, {}
        context = registry.BindContext(
            ranks=maps.get(entry.name, {}), local_ranks=tuple(maps["local"]),
            names=self._names, transpose=self._transpose,
            rules=self._rules if side == "send" else None, memo=self.layout_memo,
            cache=state.cache)
        return module.refit_bind(obj, side, context)

    def _forget(self) -> None:
        """Keep of each side's object only what its adapter allows: no sent JAX arrays (pass
        ``send=`` again), received JAX templates as ``ShapeDtypeStruct``s."""
        for state in self._sides.values():
            obj, module = state.obj, state.module
            if obj is None or isinstance(obj, Bound):
                continue
            if module is None:      # binding failed before finding it
                try:
                    found = registry.adapter_for(obj)
                except Exception:       # noqa: BLE001 - already reported by binding
                    found = None
                module = found[1] if found else None
            keep = getattr(module, "keep", None)
            if keep is None:
                continue
            state.obj = keep(obj, state.name)
            state.dropped = getattr(module, "LABEL", "arrays") if state.obj is None else None

    def _write_versions(self, obj: Any) -> dict[str, int]:
        """Write counters of a send object's tensors (``RefitConfig.check_writes``)."""
        if obj is None or isinstance(obj, Bound):
            return {}
        found = registry.adapter_for(obj)
        versions = getattr(found[1], "write_versions", None) if found else None
        return versions(obj) if versions is not None else {}

    def _check_unwritten(self, versions: Mapping[str, int]) -> None:
        now = self._write_versions(self._sides["send"].obj)
        moved = [f"{k!r} ({v} -> {now[k]})" for k, v in versions.items()
                 if k in now and now[k] != v]
        if moved:
            raise RefitError(f"sent torch tensors were written while the refit read them: "
                             f"{', '.join(moved[:10])}; do not write sent tensors before "
                             f"handle.wait() (or the call) returns")

    def _local_problems(self, src: Bound | None, dst: Bound | None) -> list[list[str]]:
        """This process's own problems with its sides (before any exchange)."""
        return side_problems({"send": src, "receive": dst}, self.world.rank_ids,
                             self.world.is_local, self.config.wire_dtype)

    def _agree(self, kind: str, body: dict[str, Any], what: str,
               timeout: float | None = None) -> list[dict[str, Any]]:
        """All-gather ``body`` (with its ``errors``); raise the same error everywhere if any
        process reported one."""
        gathered = self.world.allgather_json(body, timeout=timeout or self.config.timeout,
                                             kind=kind)
        failed = []
        for p, g in enumerate(gathered):
            entries = g.get("errors") if isinstance(g, dict) else None
            if not isinstance(entries, list):
                raise _Failed(error_from("CollectiveMismatch", f"{kind}: "
                              f"{self.world.describe_process(p)} sent a malformed payload"))
            failed += [(p, e) for e in entries]
        if failed:
            raise _Failed(error_from(failed[0][1][0], f"{what}:\n  " + _lines(failed, self.world)))
        return gathered

    # ------------------------------------------------------------ metadata steps

    def _prepare(self, src: Bound | None, dst: Bound | None, errors: list[list[str]],
                 target: int) -> bool:
        """Exchange errors and metadata; (re)plan when any layout changed. Every process
        takes the same steps. Returns whether it planned."""
        refused = f"refit v{target} refused before moving anything"
        key = self._check(src, dst, errors, refused)
        if key == self._generations and self._plan is not None:
            return False
        errors = []
        meta = {"send": src.describe() if src else {},
                "receive": dst.describe() if dst else {},
                "config": self.config.to_dict(), "errors": []}
        metas = self._agree("refit/layouts", meta, refused)
        new_plan = None
        relay = None
        counts: dict[str, int] = {}
        try:
            new_plan = plan_from(metas, src, dst, self.world, self.config.wire_dtype,
                                 self._cache)
            relay = stages_of(new_plan, self.world, self.config.relay, self.config.wire_dtype,
                              self._cache)
            if relay is not None:
                new_plan = relay.plan1
            counts = {str(r): c for r, c in peer_counts(new_plan, self.world.rank_ids).items()}
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            errors.append(_entry(e))
        everyone = self._agree("refit/schedule", {"counts": counts, "errors": errors}, refused)
        all_counts = {int(r): c for d in everyone for r, c in d["counts"].items()}
        self._schedule = schedule(new_plan, list(self.world.rank_ids), all_counts,
                                  bucket_bytes=self.config.bucket_bytes,
                                  staging_bytes=self.config.staging_bytes)
        self._plan = new_plan
        self._relay = relay
        self._generations = key
        logger.debug("refit planned: %s", new_plan.stats.to_dict())
        return True

    def _check(self, src: Bound | None, dst: Bound | None, errors: list[list[str]],
               refused: str) -> tuple:
        """refit/check: every process's version, layout generation, executor kind and
        errors, in one all-gather; raises (the same everywhere) on any error or
        disagreement. Returns every process's layout generation."""
        # a process says only whether its layouts changed since its last call (comparing
        # Layout objects is cheap; serializing every layout on every refit is not)
        mine = tuple((b.layouts, frozenset(b.local_only)) if b else None for b in (src, dst))
        if mine != self._last_layouts:
            self._last_layouts = mine
            self._generation += 1
        gathered = self._agree("refit/check", {"version": self.version,
                                               "generation": self._generation,
                                               "pipelined": self._pipeline,
                                               "errors": errors}, refused)
        if len({g.get("pipelined") for g in gathered}) > 1:
            where = ", ".join(f"{self.world.describe_process(p)}: "
                              f"{'pipelined' if g.get('pipelined') else 'rounds'}"
                              for p, g in enumerate(gathered))
            raise _Failed(RefitError(f"{refused}: processes run different executors ({where}); "
                                     f"set XRESHARD_EXECUTOR (or refit.executor_kind) the same "
                                     f"in every process"))
        versions = {g.get("version") for g in gathered}
        if len(versions) > 1:
            where = ", ".join(f"{self.world.describe_process(p)} at v{g.get('version')}"
                              for p, g in enumerate(gathered))
            raise _Failed(RefitError(f"{refused}: processes are at different refit versions "
                                     f"({where}); every process must call the same Refit "
                                     f"the same number of times"))
        return tuple(g.get("generation") for g in gathered)

    # ------------------------------------------------------------ outcome

    def _commit(self, error: list[str] | None, digests: Any, target: int) -> int:
        """All-gather every process's outcome; raise the first cause if any failed (the
        version stays). A process that already failed waits only a short grace for the
        others; a process that never reports is named, and every survivor builds its
        message from the outcomes that did arrive (the same ones, as a rule). Returns how
        many checksums this process compared."""
        timeout = self.config.timeout if error is None else min(_GRACE, self.config.timeout)
        outcomes = self.world.allgather_json(
            {"errors": [error] if error else [], "digests": digests},
            timeout=timeout, kind="refit/outcome", partial=True)
        missing = [p for p, o in enumerate(outcomes) if o is None]
        failed = [(p, o["errors"][0]) for p, o in enumerate(outcomes)
                  if o is not None and o.get("errors")]
        if failed or missing:
            lines = [_lines([(q, [e[0], f"{e[0]}: {e[1]}"]) for q, e in failed], self.world, 10)]
            if missing:
                lines.append("never reported its outcome (dead, or stuck past the timeout): "
                             + "; ".join(self.world.describe_process(p) for p in missing[:10]))
            where = "\n  ".join(x for x in lines if x)
            if missing or any(not isinstance(error_from(*e), XreshardError) for _, e in failed):
                # a peer failed or went silent: the transports are in an unknown state
                self._broken(f"refit v{target} failed while moving: {where}")
            cls = failed[0][1][0] if failed else "TransportTimeout"
            raise _Failed(error_from(cls, f"refit v{target} failed while moving, destination "
                                          f"left stale at v{self.version}:\n  {where}"))
        if not self.config.verify:
            return 0
        from . import verify
        messages, compared = verify.compare([o.get("digests") for o in outcomes], self.world)
        if messages:        # the same list on every process: it compared the same digests
            raise _Failed(VerificationError(
                f"refit v{target}: {len(messages)} transfer(s) arrived with other bytes than "
                f"were sent (checksums differ), destination left stale at v{self.version}:\n  "
                + "\n  ".join(messages[:20])
                + (f"\n  ... and {len(messages) - 20} more" if len(messages) > 20 else "")))
        return compared

    def _broken(self, cause: str) -> None:
        """A failure while moving leaves the transports in an unknown state."""
        self.world.mark_broken(cause)


class _Moved:
    """What one call's move left: executor stats (both stages' when relaying), checksums,
    bytes per transport kind."""

    def __init__(self) -> None:
        self.stats: Any = None
        self.digests: Any = None
        self.by_kind: dict[str, int] = {}


def _lines(failed: list[tuple[int, list[str]]], world: Any, limit: int = 20) -> str:
    """One line per distinct error, naming the processes that reported it ("every
    process" for an error every process found in the same gathered metadata)."""
    by_error: dict[tuple[str, str], list[int]] = {}
    for p, (cls, msg) in failed:
        by_error.setdefault((cls, msg), []).append(p)
    lines = []
    for (cls, msg), procs in list(by_error.items())[:limit]:
        who = ("every process" if len(procs) == world.num_processes and len(procs) > 1
               else ", ".join(world.describe_process(p) for p in procs[:4])
               + (f" and {len(procs) - 4} more" if len(procs) > 4 else ""))
        lines.append(f"{who}: {msg}")
    if len(by_error) > limit:
        lines.append(f"... and {len(by_error) - limit} more")
    return "\n  ".join(lines)
