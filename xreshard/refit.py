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
 identity       refit/identity           first call only: torch ranks, JAX device ids
 bind + check   refit/check              version, layout generation, every bind/check error
 (re)plan       refit/layouts            only when some process's layouts changed
 schedule       refit/schedule           peer counts, planning errors
 move           (transport)
 outcome        refit/outcome            each process's error, checksums (verify=)
```

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

import json
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from .binding import Bound, binding_problems
from .dtypes import dtype_name
from .errors import (CommunicationError, RefitError, VerificationError, XreshardError,
                     error_from, error_name)
from .execute import Executor, device_problems, pipelined_by_default
from .config import RefitConfig, RefitReport
from .layout import Layout
from .metadata import fit, framework_of, identity_of, merge
from .plan import Plan, PlanCache, plan
from .schedule import Schedule, peer_counts, schedule

__all__ = ["Bound", "Refit", "RefitConfig", "RefitHandle", "RefitReport"]

logger = logging.getLogger(__name__)

#: seconds a process that already failed waits for the others' outcomes
_GRACE = 3.0


class _Failed(Exception):
    """A failure every process agreed on: raise ``error`` (the same everywhere)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _entry(exc: BaseException) -> list[str]:
    """How a local exception crosses processes: [class name, message]."""
    return [error_name(exc), str(exc) or type(exc).__name__]


class Refit:
    """A collective weight refit between the processes of a world.

    Args:
        world: the joined :class:`xreshard.world.World`.
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
        config: a :class:`RefitConfig`.
    """

    def __init__(self, world: Any, *, send: Any = None, receive: Any = None,
                 names: Mapping[str, str] | Callable[[str], str] | None = None,
                 transpose: Iterable[str] = (), config: RefitConfig | None = None):
        if config is not None and not isinstance(config, RefitConfig):
            raise RefitError(f"config must be a RefitConfig, got {type(config).__name__}")
        self.world = world
        self.config = config or RefitConfig()
        self.version = 0
        self.stale = False
        self.received: Any = None
        self._send = send
        self._receive = receive
        self._names = names
        self._transpose = frozenset(transpose)
        self._busy = threading.Lock()
        self._last_layouts: tuple | None = None     # this process's layouts, last call
        self._generation = 0                        # bumped when they change
        self._generations: tuple | None = None      # every process's, at the last plan
        self._plan: Plan | None = None
        self._schedule: Schedule | None = None
        self._relay: _Stages | None = None           # RefitConfig.relay: the two stages
        self._arena: Any = None                     # staging, reused across calls
        self._cache = PlanCache()
        self._identity: list[dict] | None = None
        self._sent_jax = False
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
        try:
            with self.world.exclusive("refit"):
                return self._call(send, receive)
        except _Failed as f:
            raise f.error from None
        finally:
            self._busy.release()

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
        handle = RefitHandle(self, send, receive)
        if self.config.check_writes:      # before the caller's next line can write them
            handle._versions = _torch_versions(send if send is not None else self._send)
        try:
            handle._thread.start()
        except BaseException:
            self._busy.release()
            raise
        return handle

    def _run_started(self, handle: RefitHandle) -> None:
        try:
            with self.world.exclusive("refit"):
                handle._report = self._call(handle._send, handle._receive, handle._versions)
        except _Failed as f:
            handle._error = f.error
        except BaseException as e:      # noqa: BLE001 - raised again from wait()
            handle._error = e
        finally:
            self._busy.release()

    def _call(self, send: Any, receive: Any,
              versions: Mapping[str, int] | None = None) -> RefitReport:
        t0 = time.perf_counter()
        timeout = self.config.timeout
        target = self.version + 1
        if send is not None:
            self._send = send
        if receive is not None:
            self._receive = receive
        errors: list[list[str]] = []
        if versions is None:
            versions = _torch_versions(self._send) if self.config.check_writes else {}
        if send is None and self._sent_jax:
            errors.append(["RefitError", "this process sent JAX arrays before and passed no "
                           "send= now: a Refit keeps no reference to sent JAX arrays (so the "
                           "trainer can donate them); pass send=params on every call"])
        src = dst = None
        try:
            self._pipeline = None
            self._pipeline = self._pipelined()
            maps = self._rank_maps()
            src = self._bind(self._send, "send", maps)
            dst = self._bind(self._receive, "receive", maps)
            errors += self._local_problems(src, dst)
        except Exception as e:      # noqa: BLE001 - every local failure reaches every rank
            if isinstance(e, CommunicationError) and self.world.broken:
                raise       # a collective failed: nobody is in step to hear about it
            errors.append(_entry(e))
        finally:
            self._forget_sent()
        replanned = self._prepare(src, dst, errors, target)
        assert self._plan is not None and self._schedule is not None
        plan_seconds = time.perf_counter() - t0

        error: list[str] | None = None
        stats = stats2 = relay_digests = None
        digests: Any = None
        transport = None
        by_kind: dict[str, int] = {}
        self.stale = True
        try:
            with self.world.limited(timeout):     # creating it (first call) is collective
                transport = self.world.transport(self.config.transport)
            relay = self._relay
            src_bindings = fit(src, self._plan.src_layouts)
            if relay is None:
                dst_bindings = fit(dst, self._plan.dst_layouts)
            else:       # stage 1 writes views of the real destination memory
                from .relay import stage_views
                real_dst = fit(dst, relay.dst_layouts)
                dst_bindings = stage_views(relay.dst_layouts, real_dst,
                                           relay.layouts.stage1_dst, self.world.rank_ids)
            # pipelined: two rounds share the staging budget, so rounds of half of it
            # (every process picks the same: checked at refit/check)
            pipeline = bool(self._pipeline)
            sched = self._schedule
            if pipeline:
                half = getattr(self, "_half_schedule", None)
                if half is None or half[0] is not self._plan:
                    mine = self.world.rank_ids
                    paired = {r for m in mine for t in self._plan.transfers_for(m)
                              for r in (t.src, t.dst)}
                    half = (self._plan, schedule(
                        self._plan, list(mine), peer_counts(self._plan, sorted(paired)),
                        bucket_bytes=self.config.bucket_bytes,
                        staging_bytes=max(1, self.config.staging_bytes // 2)))
                    self._half_schedule = half
                sched = half[1]
            executor = Executor(sched, self._plan.src_layouts, self._plan.dst_layouts,
                                self._plan.wire_dtypes, src_bindings, dst_bindings,
                                transport, timeout, pipeline=pipeline,
                                staging_bytes=self.config.staging_bytes)
            if self._arena is not None:
                executor._arena = self._arena       # staging is reused across calls
            before = dict(getattr(transport, "bytes_by_transport", None) or {})
            # sources do not change during a refit: their checksums overlap the move
            sent_half = _Background(lambda: self._digest(src_bindings, {}, target, "send")) \
                if self.config.verify else None
            stats = executor.run()
            self._arena = executor._arena
            if relay is not None and relay.plan2 is not None:
                # stage 2 (inside domains): this process's stage 1 is complete, and a
                # forward leaves only once its sender's own stage 1 completed
                forwarded = self._forward(relay, sched, pipeline, real_dst, timeout,
                                          transport, target)
                stats2, relay_digests = forwarded
            after = getattr(transport, "bytes_by_transport", None) or {}
            by_kind = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            if sent_half is not None:
                received = self._digest({}, dst_bindings, target, "recv")
                merged = sent_half.result().merge(received)
                if relay_digests is not None:
                    merged = merged.merge(relay_digests)
                digests = merged.summary
            if versions:
                _check_unwritten(self._send, versions)
        except Exception as e:      # noqa: BLE001 - reported to the others before raising
            error = _entry(e)
            logger.debug("refit v%d failed here while moving", target, exc_info=True)
        finally:
            executor = None         # no reference to the sent arrays survives the call
        verified = self._commit(error, digests, target)
        if dst is not None and dst.finish is not None:
            self.received = dst.finish()
        self.stale = False
        self.version = target
        moved_world = self._plan.stats.bytes_moved
        gather_broadcast = self._plan.stats.bytes_gather_broadcast
        if self._relay is not None:
            gather_broadcast = self._relay.bytes_gather_broadcast
            if self._relay.plan2 is not None:
                moved_world += self._relay.plan2.stats.bytes_moved
        two = [s for s in (stats, stats2) if s is not None]
        report = RefitReport(
            version=self.version, seconds=time.perf_counter() - t0, plan_seconds=plan_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=sum(s.bytes_received for s in two),
            bytes_local=sum(s.bytes_local for s in two), bytes_moved_world=moved_world,
            bytes_gather_broadcast_world=gather_broadcast,
            num_rounds=sum(s.num_rounds for s in two),
            num_messages=sum(s.num_messages for s in two),
            num_zero_copy=sum(s.num_zero_copy for s in two),
            staging_bytes=max(s.staging_bytes for s in two),
            replanned=replanned, bytes_by_transport=by_kind or None,
            verified=verified, bytes_forwarded=stats2.bytes_sent if stats2 else 0)
        logger.info("%s", report)
        return report

    def _forward(self, relay: _Stages, sched1: Schedule, pipeline: bool, real_dst: dict,
                 timeout: float, transport: Any, target: int) -> tuple[Any, Any]:
        """Stage 2 of a relayed refit: forward inside each domain what stage 1 brought.
        Returns its executor stats and, with ``verify``, its digests (both sides)."""
        from .relay import stage_views
        sched = relay.schedules.get(pipeline)
        if sched is None or sched[0] is not sched1:
            staging = self.config.staging_bytes // 2 if pipeline else self.config.staging_bytes
            sched = relay.schedules[pipeline] = (sched1, _stage2_schedule(
                relay.plan2, sched1, list(self.world.rank_ids), self.config.bucket_bytes,
                max(1, staging)))
        ranks = self.world.rank_ids
        layouts = relay.layouts
        src2 = stage_views(relay.dst_layouts, real_dst, layouts.stage2_src, ranks)
        dst2 = stage_views(relay.dst_layouts, real_dst, layouts.stage2_dst, ranks)
        executor = Executor(sched[1], layouts.stage2_src, layouts.stage2_dst,
                            relay.plan2.wire_dtypes, src2, dst2, transport, timeout,
                            pipeline=pipeline, staging_bytes=self.config.staging_bytes)
        if self._arena is not None:
            executor._arena = self._arena
        stats = executor.run()
        self._arena = executor._arena
        digests = None
        if self.config.verify:
            from . import verify
            digests = verify.digest_bindings(relay.plan2, ranks, src2, dst2,
                                             mode=self.config.verify, version=target)
        return stats, digests

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

    def _rank_maps(self) -> dict[str, Any]:
        """Framework ids -> world ranks, from one all-gather (torch ranks, JAX device ids).

        A DTensor's mesh names torch default-group ranks and a JAX mesh names device ids;
        both are resolved among the processes of this process's world group, which is
        therefore expected to be one torch job / one JAX job. A process may mix JAX and
        other devices: each JAX device publishes its id for its own rank.
        """
        if self._identity is None:
            me: dict[str, Any] = {"ranks": list(self.world.rank_ids), "torch_rank": None,
                                  "jax_ids": []}
            try:
                me.update(identity_of([self.world.local_device(r) for r in self.world.rank_ids],
                                       self.world.rank_ids))
            except Exception as e:      # noqa: BLE001 - reported at refit/check instead
                me["error"] = _entry(e)
            self._identity = self.world.allgather_json(me, timeout=self.config.timeout,
                                                       kind="refit/identity")
        torch_ranks: dict[int, int] = {}
        jax_ids: dict[int, int] = {}
        processes = self.world.processes
        my_group = processes[self.world.process_index]["group"]
        for p, info in enumerate(self._identity):
            if processes[p]["group"] != my_group:
                continue
            if info.get("torch_rank") is not None:
                torch_ranks[int(info["torch_rank"])] = info["ranks"][0]
            for device_id, rank in info.get("jax_ids", ()):
                jax_ids[int(device_id)] = int(rank)
        # several single-process JAX jobs in one group (engine replicas) reuse device ids:
        # this process's own devices are what its arrays name
        for device_id, rank in self._identity[self.world.process_index].get("jax_ids", ()):
            jax_ids[int(device_id)] = int(rank)
        mine = self._identity[self.world.process_index].get("error")
        if mine:
            raise error_from(*mine)
        return {"torch": torch_ranks, "jax": jax_ids, "local": list(self.world.rank_ids)}

    def _bind(self, obj: Any, side: str, maps: dict[str, Any]) -> Bound | None:
        if obj is None:
            return None
        if isinstance(obj, Bound):
            return obj
        kind = framework_of(obj)
        if kind == "torch":
            from xreshard.adapters import torch as adapter
            ranks = maps["torch"] or None
            return adapter.bind(obj, side, ranks=ranks, local_ranks=maps["local"],
                                names=self._names, transpose=self._transpose)
        if kind == "jax":
            from xreshard.adapters import jax as adapter
            return adapter.bind(obj, side, ranks=maps["jax"], names=self._names,
                                transpose=self._transpose)
        raise RefitError(f"cannot tell which framework {side}={type(obj).__name__} belongs to; "
                         "pass a JAX pytree, a torch state dict or module, or an xreshard Bound")

    def _forget_sent(self) -> None:
        """Keep no reference to JAX arrays: sent ones are dropped (pass ``send=`` again),
        received templates are kept as ``ShapeDtypeStruct``s."""
        if framework_of(self._send) == "jax":
            self._send = None
            self._sent_jax = True
        if framework_of(self._receive) == "jax":
            import jax
            self._receive = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self._receive)

    def _local_problems(self, src: Bound | None, dst: Bound | None) -> list[list[str]]:
        """This process's own problems with its sides (before any exchange)."""
        out = []
        for side, bound in (("send", src), ("receive", dst)):
            if bound is None:
                continue
            out += [["RefitError", e] for e in bound.errors]
            for name in bound.layouts:
                if not isinstance(name, str):
                    out.append(["RefitError", f"{side} tensor name {name!r} is not a str"])
            problems = binding_problems(bound.layouts, bound.bindings, side,
                                        local_ranks=self.world.rank_ids)
            if problems:
                out.append(["BindingError", f"{side} bindings do not match their layouts: "
                            + "; ".join(problems[:20])])
            for (rank, _), _b in bound.bindings.items():
                if not self.world.is_local(rank):
                    out.append(["BindingError", f"{side} binds world rank {rank}, which is not "
                                f"one of this process's ranks {list(self.world.rank_ids)}"])
                    break
        if not out:
            sides = {side: (b.bindings, b.layouts) for side, b in (("send", src),
                                                                   ("receive", dst)) if b}
            out += [["RefitError", e] for e in device_problems(
                sides, lambda side, name: self._wire_of(name, sides[side][1][name]))]
        return out

    def _wire_of(self, name: str, layout: Layout) -> str:
        """The wire dtype of ``name`` as this process knows it before planning: the cast
        the config asks for, else the tensor's own dtype (both sides must then agree)."""
        wire = self.config.wire_dtype
        if isinstance(wire, Mapping):
            wire = wire.get(name)
        return dtype_name(wire) if wire is not None else layout.dtype

    # ------------------------------------------------------------ metadata steps

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

    def _prepare(self, src: Bound | None, dst: Bound | None, errors: list[list[str]],
                 target: int) -> bool:
        """Exchange errors and metadata; (re)plan when any layout changed. Every process
        takes the same steps. Returns whether it planned."""
        refused = f"refit v{target} refused before moving anything"
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
        key = tuple(g.get("generation") for g in gathered)
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
            new_plan = self._plan_from(metas, src, dst)
            relay = self._stages(new_plan)
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

    def _plan_from(self, metas: list[dict], src: Bound | None, dst: Bound | None) -> Plan:
        """The plan from every process's layouts (identical in every process), after
        checking what only the merged layouts can tell."""
        configs = {json.dumps(m["config"], sort_keys=True) for m in metas}
        if len(configs) > 1:
            raise RefitError(f"processes pass different RefitConfigs: {sorted(configs)}; "
                             f"every process must use the same config")
        src_layouts = merge([m["send"] for m in metas], "send", self.world)
        dst_layouts = merge([m["receive"] for m in metas], "receive", self.world)
        num_ranks = self.world.num_ranks
        for side, layouts in (("send", src_layouts), ("receive", dst_layouts)):
            for name, lay in layouts.items():
                outside = [r for r in lay.ranks if not 0 <= r < num_ranks]
                if outside:
                    raise RefitError(f"{side} layout of {name!r} places ranks {outside[:5]}, "
                                     f"but world {self.world.world_id!r} has ranks "
                                     f"0..{num_ranks - 1}; check the rank map of its mesh")
        problems = []
        for side, layouts, bound in (("send", src_layouts, src), ("receive", dst_layouts, dst)):
            bindings = fit(bound, layouts)
            problems += binding_problems(layouts, bindings, side, self.world.rank_ids)
        if problems:
            from .errors import BindingError
            raise BindingError("bindings do not cover what the merged layouts give this "
                               "process's ranks: " + "; ".join(problems[:20]))
        return plan(src_layouts, dst_layouts, topology=self.world,
                    wire_dtype=self.config.wire_dtype, cache=self._cache)

    def _stages(self, direct: Plan) -> _Stages | None:
        """The two plans of a relayed refit (``RefitConfig.relay``), or None for the direct
        plan: "off", or "auto" when nothing would be forwarded."""
        if self.config.relay == "off":
            return None
        from .relay import relay_layouts
        layouts = relay_layouts(direct.src_layouts, direct.dst_layouts, self.world)
        if self.config.relay == "auto" and not layouts.forwards:
            return None
        plan1 = plan(direct.src_layouts, layouts.stage1_dst, topology=self.world,
                     wire_dtype=self.config.wire_dtype, cache=self._cache)
        plan2 = plan(layouts.stage2_src, layouts.stage2_dst, topology=self.world,
                     cache=self._cache) if layouts.forwards else None
        logger.debug("refit relays %d bytes inside domains", layouts.bytes_relayed)
        return _Stages(dict(direct.dst_layouts), layouts, plan1, plan2,
                       direct.stats.bytes_gather_broadcast)

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


class _Stages:
    """A relayed refit (``RefitConfig.relay``): stage 1 sends across domains into views of
    the real destination memory, stage 2 forwards inside domains (see xreshard/relay.py)."""

    def __init__(self, dst_layouts: dict[str, Layout], layouts: Any, plan1: Plan,
                 plan2: Plan | None, bytes_gather_broadcast: int):
        self.dst_layouts = dst_layouts          # the real (merged) destination layouts
        self.layouts = layouts                  # relay.RelayLayouts
        self.plan1 = plan1
        self.plan2 = plan2
        self.bytes_gather_broadcast = bytes_gather_broadcast
        #: pipelined? -> (the stage-1 schedule it follows, the stage-2 schedule)
        self.schedules: dict[bool, tuple[Schedule, Schedule]] = {}


def _stage2_schedule(plan2: Plan, sched1: Schedule, ranks: list[int], bucket_bytes: int,
                     staging_bytes: int) -> Schedule:
    """Stage 2's schedule for this process's ranks. A pair that also talked in stage 1
    continues its message numbers (tags) after stage 1's: no barrier separates the stages,
    so a tag is never reused within a call. Both ends of a pair see the pair's stage-1
    buckets, so they agree on the offset."""
    import dataclasses
    paired = {r for m in ranks for t in plan2.transfers_for(m) for r in (t.src, t.dst)}
    sched = schedule(plan2, ranks, peer_counts(plan2, sorted(paired)),
                     bucket_bytes=bucket_bytes, staging_bytes=staging_bytes)
    first: dict[tuple[int, int], int] = {}
    for rnd in sched1.rounds:
        for b in rnd:
            first[(b.src, b.dst)] = max(first.get((b.src, b.dst), 0), b.tag + 1)
    if not first:
        return sched
    rounds = tuple(tuple(dataclasses.replace(b, tag=b.tag + first.get((b.src, b.dst), 0))
                         for b in rnd) for rnd in sched.rounds)
    return Schedule(rounds, sched.local_copies, sched.max_round_bytes)


class _Background:
    """Runs ``fn`` in a thread; ``result()`` joins it and returns or raises its outcome."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as e:      # noqa: BLE001 - raised again from result()
                self._error = e
        self._thread = threading.Thread(target=run, name="xreshard-verify", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class RefitHandle:
    """A refit started with :meth:`Refit.start`, running in a background thread."""

    def __init__(self, refit: Refit, send: Any, receive: Any):
        self._refit = refit
        self._send = send           # kept alive until the refit is done
        self._receive = receive
        self._versions: dict[str, int] | None = None
        self._report: RefitReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=refit._run_started, args=(self,),
                                        name="xreshard-refit", daemon=True)

    def done(self) -> bool:
        """Whether the refit finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> RefitReport:
        """The report, once the refit finished; raises what it raised.

        Args:
            timeout: seconds to wait; None waits as long as the refit may take (its own
                waits are bounded by ``RefitConfig.timeout``).

        Raises:
            TimeoutError: still running after ``timeout`` seconds (the refit goes on).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"refit v{self._refit.version + 1} still running after "
                               f"{timeout} s")
        self._send = self._receive = None
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report


def _torch_values(obj: Any) -> dict[str, Any]:
    import sys
    torch = sys.modules.get("torch")
    if torch is None or framework_of(obj) != "torch":
        return {}
    items = obj.state_dict(keep_vars=True).items() if isinstance(obj, torch.nn.Module) \
        else obj.items()
    out = {}
    for key, value in items:
        local = getattr(value, "local", value)                      # Sharded
        if hasattr(local, "to_local"):                              # DTensor
            local = local.to_local()
        if isinstance(local, torch.Tensor):
            out[key] = local
    return out


def _torch_versions(obj: Any) -> dict[str, int]:
    """Version counters of the torch tensors of a send object (views share them)."""
    return {k: int(t._version) for k, t in _torch_values(obj).items()}


def _check_unwritten(obj: Any, versions: Mapping[str, int]) -> None:
    now = _torch_versions(obj)
    moved = [f"{k!r} ({v} -> {now[k]})" for k, v in versions.items()
             if k in now and now[k] != v]
    if moved:
        raise RefitError(f"sent torch tensors were written while the refit read them: "
                         f"{', '.join(moved[:10])}; do not write sent tensors before "
                         f"handle.wait() (or the call) returns")


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
