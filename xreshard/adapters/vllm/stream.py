"""Streamed refits between a trainer and vLLM workers: one process's side (:class:`Stream`).

Both sides of the ``"xreshard"`` backend run the same collectives in the same order: the
workers (:mod:`~xreshard.adapters.vllm.worker`) receive group after group of tensors, the
trainer processes (:mod:`~xreshard.adapters.vllm.trainer`) send them. The world's groups
are :data:`GROUPS`: trainer processes first, then the vLLM workers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

from xreshard.errors import CommunicationError, RefitError, XreshardError
from xreshard.runtime.binding import Bound, Rebuilt
from xreshard.config import RefitConfig, RefitReport
from xreshard.runtime.refit import Refit
from xreshard.runtime.world import World

from xreshard.runtime import catchup

from . import members

logger = logging.getLogger(__name__)

__all__ = ["GROUPS", "DEFAULT_WORLD_ID", "Stream", "Placed"]

#: the world's group order: trainer ranks first, then the vLLM workers in TP order
GROUPS = ("trainer", "rollout")
DEFAULT_WORLD_ID = "xreshard-vllm"
#: how many times a catch-up brings its groups to one version before it gives up
CATCH_UP_PASSES = 4


class Placed(Rebuilt):
    """A receive side of an elastic world's round: ``bound`` as placed, bound again by
    ``rebind(world)`` when the world is at another epoch at the call (a member was lost
    during the call: the survivors finish it in the next epoch, under renumbered ranks
    and without the lost engine's axis). ``last``: the side the last call bound."""

    def __init__(self, bound: Bound, epoch: int, rebind: Callable[[Any], Bound]):
        self.last, self._epoch = bound, epoch

        def build(world: Any) -> Bound:
            if world.epoch != self._epoch:
                self.last.bindings.clear()
                self.last, self._epoch = rebind(world), world.epoch
            return self.last

        super().__init__(build)


class Stream:
    """One process's side of streamed refits between a trainer and vLLM workers.

    A round is a sequence of collective :class:`~xreshard.runtime.refit.Refit` calls, one per
    group of tensors, so that a worker holds receive buffers for one group at a time
    (:meth:`xreshard.adapters.vllm.EngineRecording.groups`, derived from the recordings and
    the budget). Every process of the world runs the same collectives in the same
    order:

    1. (construction) an all-gather of every process's world ranks and JAX device ids,
       so the trainer can bind JAX arrays without a collective of its own later;
    2. an all-gather of (side, groups id, names id); if a sender lacks the workers' groups,
       the first worker broadcasts them (JSON); if the names differ, an all-gather of the
       names finds which, and the round is refused before anything moves;
    3. one refit per group, each with its own plan, cached across rounds; errors known
       before the round (binding, names, versions) go into the first group's, so its
       error gather raises them on every rank before a byte moves; an error while loading
       group g into vLLM goes into group g+1's;
    4. an all-gather of the last group's load errors.

    A failure after the first group has loaded leaves the engine holding a mix of two
    rounds (the price of not holding a whole shard); the error says so, and the version
    advances only on rounds every process completed.
    """

    def __init__(self, world: World, side: str, *, config: RefitConfig, names: Any = None,
                 transpose: Iterable[str] = (), engine_info: dict[str, Any] | None = None,
                 on_epoch: Callable[[], None] | None = None,
                 serve: Callable[[int, list[str], Bound], Bound | None] | None = None
                 ) -> None:
        self.world, self.side, self.config = world, side, config
        self.groups: list[list[str]] = []
        self.groups_id: str | None = None
        self.version = 0
        self.lost: list[str] = []
        #: what this process says of the engines in an elastic world (see .members): a
        #: worker its engine, workers and model digest; the trainer's rank 0 the engines
        #: it drives
        self.engine_info = engine_info
        self.on_epoch = on_epoch
        #: a receiver in an elastic world: ``serve(g, names, received)`` after group g's
        #: refit, what its catch-up server serves between rounds (see :meth:`catch_up`)
        self.serve = serve
        self._refits: dict[int, Refit] = {}
        self._arena: Any = None
        self._refit_kwargs = {"names": names, "transpose": tuple(transpose)}
        self.jax_ranks: dict[int, int] = {}
        self._fresh = True      # until its first epoch setup: new to the world
        if world.admitted:      # else (joined with wait=False) at its first round
            self.enter_epoch()
            self._fresh = False

    def enter_epoch(self) -> None:
        """Collective: every process's world ranks and JAX device ids (so the trainer binds
        JAX arrays without a collective of its own later). In an elastic world also at
        each new epoch (a joining engine's workers run it from their constructor, the
        members from :func:`~.members.sync`): a process new to the world takes the
        members' version, and engines recording another model are refused.

        Raises:
            EngineMismatch: an engine's model digest differs (on every process alike).
        """
        world = self.world
        devs = [world.local_device(r) for r in world.rank_ids]
        jax_ids = [int(d.id) for d in devs] if devs and all(
            type(d).__module__.startswith("jax") for d in devs) else []
        me = {"group": world.processes[world.process_index]["group"],
              "ranks": list(world.rank_ids), "jax_ids": jax_ids}
        if world.elastic:
            me.update(engine=self.engine_info, version=self.version, fresh=self._fresh)
        everyone = world.allgather_json(me, timeout=self.config.timeout)
        self.jax_ranks = {int(i): int(r) for p in everyone if p["group"] == me["group"]
                          for i, r in zip(p["jax_ids"], p["ranks"])}
        if not world.elastic:
            return
        if self.version == 0 or self._fresh:    # new to the world (or caught up, maybe
            # behind since): receive the next version with them
            self.version = max(int(p.get("version") or 0) for p in everyone)
        problem = members.engine_problem(everyone)
        if problem is not None:
            raise members.EngineMismatch(problem[0])
        if self.on_epoch is not None:
            self.on_epoch()

    def set_groups(self, groups: Sequence[Sequence[str]]) -> None:
        lists = [list(g) for g in groups]
        gid = _json_digest(lists)
        if gid != self.groups_id:
            self.groups, self.groups_id, self._refits = lists, gid, {}

    def run(self, shapes: Mapping[str, Sequence[int]], errors: list[str],
            part: Callable[[int, list[str], list[str]], Any],
            done: Callable[[int, list[str]], None] | None = None) -> RefitReport:
        """One round. ``shapes``: this side's tensors; ``errors``: problems found before the
        round; ``part(g, names, errors)``: this side of group g's refit (a Bound carrying
        ``errors``, or a state dict when there are none); ``done(g, names)``: after group g
        committed (a worker loads it)."""
        world, timeout = self.world, self.config.timeout
        if not world.admitted:  # caught up (wait=False): the members' sync admits it
            self._admit()
        if world.elastic:       # members lost or joining: act on them before any group
            self.lost = members.sync(self)
        names_id = _json_digest(sorted([n, [int(x) for x in s]] for n, s in shapes.items()))
        info = world.allgather_json({"side": self.side, "groups": self.groups_id,
                                     "names": names_id}, timeout=timeout)
        receivers = [p for p, i in enumerate(info) if i["side"] == "receive"]
        ids = {info[p]["groups"] for p in receivers}
        if len(ids) != 1:
            raise RefitError("the vLLM workers stream in different groups (engines with "
                             "different models, parallel configs or budgets?); refit engines "
                             "together only when they are identical" if ids else
                             "no vLLM worker in the world")
        (gid,) = ids
        if any(i["groups"] != gid for i in info):
            root = receivers[0]
            groups = world.broadcast_json(self.groups if world.process_index == root else None,
                                          root_process=root, timeout=timeout)
            self.set_groups(groups)
            # every process starts the groups' Refits anew, so their identities (agreed at
            # their first call, in order) stay paired across processes
            self._refits = {}
        errors = list(errors)
        if len({i["names"] for i in info}) > 1:
            every = world.allgather_json({"side": self.side, "shapes": {
                n: [int(x) for x in s] for n, s in shapes.items()}}, timeout=timeout)
            problem = _names_problem(every)
            if problem and world.process_index == 0:
                errors.append(problem)
        reports: list[RefitReport] = []
        carried: str | None = None
        for g, names in enumerate(self.groups):
            errs = errors if g == 0 else []
            if carried is not None:
                errs, carried = errs + [carried], None
            obj = part(g, names, list(errs))
            refit = self._refits.get(g)
            if refit is None:
                # named in an elastic world: a joining engine's Refits take the members'
                name = f"xreshard-vllm/{self.groups_id}/{g}" if world.elastic else None
                refit = self._refits[g] = Refit(world, config=self.config, name=name,
                                                **self._refit_kwargs)
            reports.append(self._group(g, names, refit, obj))
            if done is not None:
                try:
                    done(g, names)
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    logger.exception("xreshard: loading group %d failed", g)
                    carried = (f"{world.describe_process(world.process_index)} failed to "
                               f"load group {g} ({len(names)} tensors from "
                               f"{names[0]!r}): {type(e).__name__}: {e}")
        outcomes = world.allgather_json({"error": carried}, timeout=timeout,
                                        kind="xreshard-vllm/outcome", partial=world.elastic)
        if world.elastic:   # lost after their last group: the survivors' round is complete
            self.lost += members.lost_at_outcome(self, outcomes)
        failed = [o["error"] for o in outcomes if o is not None and o["error"]]
        if failed:
            raise RefitError("; ".join(failed) + " - the engine holds a mix of two rounds; "
                             "refit again before generating")
        self.version += 1
        report = _combine(reports, self.version)
        if world.elastic:
            lost = tuple(dict.fromkeys([*self.lost, *(m for r in reports for m in r.lost)]))
            report = dataclasses.replace(report, lost=lost, epoch=world.epoch)
        return report

    def _group(self, g: int, names: list[str], refit: Refit, obj: Any) -> RefitReport:
        """Group ``g``'s refit of a round, this side ``obj``; ``serve`` keeps what a
        catch-up reads. In an elastic world with ``on_member_loss="fail"``, an engine lost
        during it fails the round with :class:`~.members.EngineLost` on every survivor."""
        world = self.world
        # one staging arena for every group, handed from refit to refit: each group's
        # refit would otherwise keep its own, and their sum is the whole shard again
        refit.staging, self._arena = self._arena, None
        before = world.processes
        try:
            report = refit(**{self.side: obj})
            if report.lost and self.config.on_member_loss == "fail":
                # lost between two groups (the refit found them at its check): the
                # update still lost them, and "fail" fails it on every survivor
                raise members.engine_lost(before, world, self.version + 1, None) or \
                    RefitError(f"members {list(report.lost)} lost during the update")
            bound = obj.last if isinstance(obj, Placed) else obj
            if self.serve is not None and isinstance(bound, Bound):
                served = self.serve(g, names, bound)    # before its bindings go
                with refit.writing:         # between calls, as its server reads it
                    refit.served = served
            return report
        except (XreshardError, CommunicationError) as e:
            lost = members.engine_lost(before, world, self.version + 1, e) \
                if world.elastic and self.config.on_member_loss == "fail" else None
            if lost is None and (g == 0 or not isinstance(e, XreshardError)):
                raise
            if g == 0 and lost is not None:     # (g == 0 without a loss was raised above)
                raise lost from e
            raise RefitError(f"{lost or e}\n(streamed round: groups 0..{g - 1} of "
                             f"{len(self.groups)} were already loaded, so the engine "
                             "holds a mix of two rounds; refit again before generating)"
                             ) from e
        finally:
            self._arena, refit.staging = refit.staging, None
            # the refit keeps its last send/receive object for argument-less calls:
            # emptied, it holds no group's buffers (or trainer arrays) past the call
            for held in (obj, obj.last if isinstance(obj, Placed) else None):
                if isinstance(held, Bound):
                    held.bindings.clear()
                elif isinstance(held, dict):
                    held.clear()

    def catch_up(self, part: Callable[[int, list[str], list[str]], Any],
                 done: Callable[[int, list[str]], None]) -> RefitReport:
        """A receiver of an engine that joined a running elastic world with ``wait=False``:
        fill every group from the live engines' workers that hold the same regions
        (:meth:`Refit.catch_up <xreshard.runtime.refit.Refit.catch_up>`; the trainer sends
        nothing), ``done(g, names)`` after each (the worker loads it). Its next round
        admits it (:meth:`run`).

        Groups are caught up one after another, each from the replicas' newest version
        common to them; a round of the members that completes meanwhile would leave the
        groups at two versions, so the groups behind are caught up again (the replicas
        keep their last two versions) until all hold one, at most ``CATCH_UP_PASSES``
        times. Returns the combined report (``version``: the one version every group
        holds).

        Raises:
            RefitError: this process is admitted already, the groups could not be brought
                to one version, or a group's receive side failed to bind.
            CommunicationError: a catch-up failed (within the configured timeout).
        """
        world = self.world
        if not world.elastic or world.admitted:
            raise RefitError("Stream.catch_up() is for an engine that joined a running "
                             "elastic world with wait=False, before its first round")
        if not self.groups:
            raise RefitError("Stream.catch_up(): no groups (set_groups first)")
        objs: dict[int, Any] = {}
        reports: dict[int, RefitReport] = {}
        try:
            for _ in range(CATCH_UP_PASSES):
                target = max((r.version for r in reports.values()), default=0)
                for g, names in enumerate(self.groups):
                    if g in reports and reports[g].version == target:
                        continue
                    if g not in objs:
                        objs[g] = part(g, names, [])
                        if objs[g].errors:
                            raise RefitError(f"catch-up of group {g}: "
                                             + "; ".join(objs[g].errors))
                    refit = self._refits.get(g)
                    if refit is None:
                        refit = self._refits[g] = Refit(
                            world, config=self.config, receive=objs[g],
                            name=f"xreshard-vllm/{self.groups_id}/{g}", **self._refit_kwargs)
                    reports[g] = refit.catch_up()
                    done(g, names)
                versions = {r.version for r in reports.values()}
                if len(versions) == 1:
                    break
            else:
                raise RefitError(f"catch-up: the groups hold versions {sorted(versions)} after "
                                 f"{CATCH_UP_PASSES} passes (the members' rounds outpace it); "
                                 "the engine's first round sends it whole")
        finally:
            for obj in objs.values():
                obj.bindings.clear()
        self.version = versions.pop()
        return _combine([reports[g] for g in sorted(reports)], self.version)

    def _admit(self) -> None:
        """Ask into the running world (its catch-up worlds closed first) and run the epoch
        setup with the members' sync that admits this process."""
        for refit in self._refits.values():
            catchup.finish(refit)
        self.world.admit()
        self.enter_epoch()
        self._fresh = False


def _json_digest(obj: Any) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


def _names_problem(every: Sequence[Mapping[str, Any]]) -> str | None:
    """What differs between the tensors the senders and the receivers describe."""
    sides: dict[str, dict[str, tuple]] = {"send": {}, "receive": {}}
    for p in every:
        sides[p["side"]].update({n: tuple(s) for n, s in p["shapes"].items()})
    src, dst = sides["send"], sides["receive"]

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        return ", ".join(repr(n) for n in names[:20]) + more

    problems = []
    only_src, only_dst = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if only_src:
        problems.append(f"{len(only_src)} tensor(s) only on the source side: {listed(only_src)}")
    if only_dst:
        problems.append(f"{len(only_dst)} tensor(s) only on the destination side: "
                        f"{listed(only_dst)}")
    bad = [f"{n!r} source {src[n]} vs destination {dst[n]}" for n in sorted(set(src) & set(dst))
           if src[n] != dst[n]]
    if bad:
        problems.append(f"shape mismatch in {len(bad)} tensor(s): " + "; ".join(bad[:20]))
    return "; ".join(problems) or None


def _combine(reports: Sequence[RefitReport], version: int) -> RefitReport:
    """One round's report from its groups' reports."""
    def total(field: str) -> Any:
        return sum(getattr(r, field) for r in reports)
    return RefitReport(
        version=version, seconds=total("seconds"), plan_seconds=total("plan_seconds"),
        bytes_sent=total("bytes_sent"), bytes_received=total("bytes_received"),
        bytes_local=total("bytes_local"), bytes_moved_world=total("bytes_moved_world"),
        bytes_gather_broadcast_world=total("bytes_gather_broadcast_world"),
        num_rounds=total("num_rounds"), num_messages=total("num_messages"),
        num_zero_copy=total("num_zero_copy"),
        staging_bytes=max((r.staging_bytes for r in reports), default=0),
        replanned=any(r.replanned for r in reports), move_seconds=total("move_seconds"),
        bytes_forwarded=total("bytes_forwarded"), verified=total("verified"),
        delta=_combine_delta([r.delta for r in reports if r.delta is not None]),
        quantized=_combine_quantized([r.quantized for r in reports if r.quantized is not None]))


def _combine_quantized(parts: Sequence[Mapping[str, int]]) -> dict[str, int] | None:
    """One round's ``RefitReport.quantized`` from its groups' (byte counts: they add up);
    None when no group quantized."""
    if not parts:
        return None
    return {k: sum(p.get(k, 0) for p in parts) for k in dict.fromkeys(k for p in parts for k in p)}


def _combine_delta(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One round's ``RefitReport.delta`` from its groups' (each group's refit keeps its own
    baselines, so their bytes add up; the encoder's threads do not)."""
    if not parts:
        return None
    return {k: (max if k == "encode_threads" else sum)(p.get(k, 0) for p in parts)
            for k in dict.fromkeys(k for p in parts for k in p)}
