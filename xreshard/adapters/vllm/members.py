"""Engines that come and go between updates: the ``"xreshard"`` backend over an elastic
world (``XreshardTrainerInitInfo(elastic=True)``; :mod:`xreshard.runtime.epochs`).

Decision record.

* **Membership changes at a round's start, nowhere else.** Every process of a round (the
  trainer processes and every live engine's workers) first runs :func:`sync`: a partial
  all-gather of the join requests each one sees. A member that left (the backend's
  ``shutdown``: ``World.leave``) or whose process is gone is not waited for; a change moves
  every survivor to the next epoch (``World.advance``), and the joining engines' workers,
  admitted there, run the epoch's setup with them (:meth:`Stream.enter_epoch
  <xreshard.adapters.vllm.stream.Stream.enter_epoch>`: ranks, versions, and each engine's
  model digest). Only then does the round's first refit start, so a round never admits
  anyone midway. Rejected: letting each group's Refit admit joiners at its own
  ``refit/check`` - a joiner admitted at group 3 would miss groups 0..2 of its first round.
* **Losses may happen midway.** An engine lost during a group's refit is excluded there
  (the survivors finish that group in the next epoch, :mod:`xreshard.runtime.fleet`);
  one lost after its last group at the round's last all-gather
  (:func:`lost_at_outcome`). Every worker joins with its engine's ``unit``
  (:func:`unit`), so a lost worker takes its whole engine out. With
  ``on_member_loss="fail"`` the round fails instead, with one :class:`EngineLost` on
  every survivor. Rank 0's side: :mod:`xreshard.adapters.vllm.control`.
* **Who is an engine.** An engine's workers are ``rollout[e * W + w]`` (W workers per engine,
  engine id e): the trainer's rank 0 names the engines it has clients for (``expect``), so
  every process can tell, from the same gathered payloads, an engine that is whole from one
  that is half-joined (some workers asked in, others did not; or it asked in but the trainer
  has no client for it; or the trainer added it but it never asked in). A half-joined
  engine is not admitted and the round is refused (:class:`HalfJoined`) on every process
  before any byte moves.
* **Identical engines only.** Engines refit together are replicas (one layout with an
  ``engine`` mesh axis, :meth:`Destination.place
  <xreshard.adapters.vllm.destination.Destination.place>`). A joining engine whose recording
  (model, dtypes, parallel config, loaders) differs from the others' is refused by name
  (:class:`EngineMismatch`) on every process, in the epoch's setup, before any byte moves;
  its workers then leave, and the next round goes on without it.
* **Catch-up.** By default a new engine receives the current weights from the trainer at
  the round that admits it (it adopts the members' version first). With
  ``XreshardTrainerInitInfo(elastic=True, catch_up=True)`` (the live workers serve
  catch-ups) and ``add_engine(client, catch_up=True)`` (``XreshardInitInfo.catch_up``)
  its workers join with ``wait=False`` at once, between rounds, and :func:`catch_up` fills every
  layer group from the live engines' workers that hold the same regions
  (:meth:`Stream.catch_up <xreshard.adapters.vllm.stream.Stream.catch_up>` over
  :mod:`xreshard.runtime.catchup`: the trainer is in no catch-up world), then vLLM loads
  them; the trainer's next round admits the engine (its sync) and sends it that round
  like the others. What a live worker serves between rounds is :func:`served`: the live
  parameters in mode ``"inplace"`` (no memory), else a kept copy of the group's last
  received bytes (memory: the worker's shard once more, on the receive buffers' device;
  vLLM's loaded parameters may be repacked, e.g. by CPU kernels, and cannot be read
  back). TODO(memory): keep that copy in host memory for GPU engines in reload mode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Mapping, Sequence

from xreshard.errors import RefitError, WorldBroken
from xreshard.runtime import fleet

__all__ = ["FleetError", "EngineMismatch", "HalfJoined", "EngineLost", "model_digest", "sync",
           "lost_engines", "engine_lost", "lost_at_outcome",
           "engine_problem", "joining_problem", "served", "catch_up"]

logger = logging.getLogger(__name__)

KIND = "xreshard-vllm/members"
#: the world unit of engine e's workers is UNIT + str(e)
UNIT = "xreshard-vllm/engine/"
#: how many membership changes one round's start acts on before giving up
MAX_CHANGES = 4


class FleetError(RefitError):
    """The engines of an elastic ``"xreshard"`` world cannot be refit together as they are."""


class EngineMismatch(FleetError):
    """A joining engine's model or parallel layout differs from the other engines'."""


class HalfJoined(FleetError):
    """An update while an engine is half-joined (not every worker in the world, or not known
    to the trainer)."""


class EngineLost(FleetError):
    """An engine was lost during an update with ``on_member_loss="fail"`` (the same error,
    naming it, on every surviving process; the world moved on without it)."""


def model_digest(recording: Any) -> str:
    """What must be equal for two engines to be refit together: every worker's recording
    (loaders, parameter shapes and dtypes, parallel ranks) and the HF tensors offered."""
    body = {"recordings": [r.to_dict() for r in recording.recordings],
            "shapes": {n: list(s) for n, s in sorted(recording.shapes.items())},
            "dtypes": dict(sorted(recording.dtypes.items()))}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _engines(processes: Sequence[Mapping[str, Any]], workers: int) -> dict[int, set[int]]:
    """engine id -> the worker indices among ``processes`` (join infos)."""
    out: dict[int, set[int]] = {}
    for p in processes:
        if p.get("group") == "rollout":
            out.setdefault(int(p["index"]) // workers, set()).add(int(p["index"]) % workers)
    return out


def joining_problem(members: Sequence[Mapping[str, Any]], joining: Sequence[Mapping[str, Any]],
                    workers: int | None, expect: Sequence[int] | None,
                    failed: Mapping[str, str] | None = None) -> str | None:
    """Why the engines about to form the next epoch cannot be refit (None: they can).

    Args:
        members: the join infos of the surviving members.
        joining: the join infos of the processes asking in.
        workers: workers per engine (None: no process knows; nothing to check).
        expect: the engine ids the trainer drives (None: no trainer said).
        failed: engine id (str) -> why the trainer's ``init_weight_transfer_engine`` of an
            engine it added failed.
    """
    if not workers:
        return None
    have, asking = _engines(members, workers), _engines(joining, workers)
    everyone = set(range(workers))
    problems = []
    for e, ws in sorted(asking.items()):
        if ws | have.get(e, set()) != everyone:
            problems.append(f"engine {e}: worker(s) {sorted(everyone - ws - have.get(e, set()))}"
                            f" of {workers} have not asked to join")
        if expect is not None and e not in expect:
            problems.append(f"engine {e} asked to join the world but the trainer has no "
                            "client for it (add it on the trainer with add_engine(client), or "
                            "stop it)")
    for e in sorted(set(have) - set(expect if expect is not None else have)):
        problems.append(f"engine {e} is a member but the trainer does not drive it (it has "
                        "no client for it)")
    for e in expect or ():
        if e not in have and e not in asking:
            why = (failed or {}).get(str(e))
            problems.append(f"engine {e} was added on the trainer but has not joined the world"
                            + (f" (its init_weight_transfer_engine failed: {why})" if why
                               else ""))
    if not problems:
        return None
    return ("half-joined engine(s): " + "; ".join(problems) + " - the update is refused on "
            "every process before any byte moves, and the world keeps its members")


def engine_problem(everyone: Sequence[Mapping[str, Any]]) -> tuple[str, list[int]] | None:
    """(message, engine ids) when the engines' model digests differ. The reference is the
    digest most engines already in the world hold (``fresh``: new to it; at the world's
    formation every engine is), ties to the lowest engine id's, so the odd ones are named."""
    digests: dict[int, str] = {}
    fresh: set[int] = set()
    for p in everyone:
        d = p.get("engine")
        if d and d.get("model"):
            digests.setdefault(int(d["engine"]), d["model"])
            if p.get("fresh"):
                fresh.add(int(d["engine"]))
    if len(set(digests.values())) <= 1:
        return None
    voters = [e for e in digests if e not in fresh] or list(digests)
    count: dict[str, int] = {}
    for e in voters:
        count[digests[e]] = count.get(digests[e], 0) + 1
    ref = max(sorted(voters), key=lambda e: (count[digests[e]], -e))
    odd = sorted(e for e, d in digests.items() if d != digests[ref])
    return (f"engine(s) {odd} record another model or parallel layout than engine {ref} "
            f"(the others refit together: same model, dtype, parallel config and loaders); "
            "refused on every process before any byte moves - start them with engine "
            f"{ref}'s model and config, or refit them in another world", odd)


def served(worker: Any, g: int, received: Any) -> Any:
    """What worker ``worker`` serves of group ``g`` between rounds, from its just
    received receive side: in mode ``"inplace"`` the same views of the live parameters,
    else a copy of the received bytes, kept per group (reused across rounds)."""
    from xreshard.runtime.atomic import Staging
    from xreshard.runtime.binding import Bound
    if worker._inplace:
        return Bound(received.layouts, dict(received.bindings),
                     local_only=received.local_only)
    kept = worker.__dict__.setdefault("_served_copies", {})
    return kept.setdefault(g, Staging()).stage(received)


def catch_up(worker: Any) -> Any:
    """A new engine's worker, joined with ``wait=False``: fill every group from the live
    engines (:meth:`Stream.catch_up`), loading each into vLLM as a round does. Returns
    the combined report (its ``bytes_received``: every byte of the worker's shard, all
    from the catch-up worlds)."""
    dest, held = worker._dest, {}

    def part(g: int, names: list[str], errs: list[str]) -> Any:
        held[g] = worker._bind_group(names, errs)
        bound = held[g][1]
        bound.errors = errs + bound.errors
        return bound

    def done(g: int, names: list[str]) -> None:
        dest.load(worker.model, worker.model_config, held[g][0], worker._inplace,
                  dest.with_scales(names))

    try:
        report = worker.stream.catch_up(part, done)
    finally:
        held.clear()
    logger.info("xreshard: engine %d worker %d caught up to version %d from the live "
                "engines (%d bytes)", worker._engine, dest.rec.worker, report.version,
                report.bytes_received)
    return report


def unit(engine: int) -> str:
    """The world unit of an engine's workers (``World.join(unit=...)``): a lost worker takes
    its whole engine out of the world (an engine missing a TP or PP rank cannot serve)."""
    return f"{UNIT}{int(engine)}"


def engine_of(info: Mapping[str, Any]) -> int | None:
    """The engine id of a member's join info (None: not an engine's worker)."""
    u = str(info.get("unit") or "")
    return int(u[len(UNIT):]) if u.startswith(UNIT) and u[len(UNIT):].isdigit() else None


def lost_engines(before: Sequence[Mapping[str, Any]], world: Any) -> tuple[list[int], list[str]]:
    """(engine ids, member labels) of the members of ``before`` (join infos) that are no
    members of ``world``'s epoch any more."""
    from xreshard.runtime.joining import label
    now = set(world.members)
    gone = [info for info in before if label(info) not in now]
    return (sorted({e for e in map(engine_of, gone) if e is not None}),
            [label(info) for info in gone])


def engine_lost(before: Sequence[Mapping[str, Any]], world: Any, version: int,
                cause: BaseException | None) -> EngineLost | None:
    """After a call of an elastic world's round failed or lost members with
    ``RefitConfig(on_member_loss="fail")``: :class:`EngineLost` naming the engines the
    world moved on without, when only engines' workers were lost; None otherwise (nobody
    lost, or a trainer process: its error stands). The same on every survivor (the world
    settled which members arrived)."""
    engines, labels = lost_engines(before, world)
    if not labels or any(not lab.startswith("rollout[") for lab in labels):
        return None
    why = f" ({type(cause).__name__})" if cause is not None else ""
    return EngineLost(f"engine(s) {engines} lost during update v{version} (members "
                      f"{labels} gone{why}): with on_member_loss='fail' the update fails on "
                      f"every surviving process; the world moved on without them (epoch "
                      f"{world.epoch}), so the next update goes to the live engines - "
                      "refit again before generating")


def lost_at_outcome(stream: Any, gathered: list[Any]) -> list[str]:
    """The end of a round of an elastic world: members missing from its last all-gather
    (lost after their last group, e.g. while vLLM loaded it) are excluded with their
    engines (the world moves to the next epoch); returns their labels, the survivors'
    round complete. With ``on_member_loss="fail"`` raises :class:`EngineLost` instead."""
    world = stream.world
    missing = [p for p, g in enumerate(gathered) if g is None]
    if not missing:
        return []
    before = world.processes
    missing = fleet.excluded(world, missing)
    lost = [world.members[p] for p in missing]
    world.advance(missing, [], time.monotonic() + stream.config.timeout)
    if stream.config.on_member_loss == "fail":
        raise engine_lost(before, world, stream.version + 1, None) or \
            RefitError(f"members {lost} lost at the end of update v{stream.version + 1}")
    return lost


def sync(stream: Any) -> list[str]:
    """At the start of a round in an elastic world: act on the members lost and the engines
    asking to join, the same way on every process. Returns the labels of the members lost.

    Raises:
        HalfJoined: an engine is half-joined (see :func:`joining_problem`); nobody is
            admitted (the lost are still excluded).
        EngineMismatch: a joining engine's model differs (from the epoch's setup).
        WorldBroken: this process came after the others settled without it.
    """
    world, timeout = stream.world, stream.config.timeout
    lost: list[str] = []
    for _ in range(MAX_CHANGES):
        mine = {"requests": [r["id"] for r in world.pending() if r["kind"] == "join"],
                "engine": stream.engine_info}
        gathered = world.allgather_json(mine, kind=KIND, partial=True, timeout=timeout)
        missing = [p for p, g in enumerate(gathered) if g is None]
        seen = {i for g in gathered if isinstance(g, dict) for i in g.get("requests") or ()}
        if world.process_index in missing:
            world.mark_broken("this process reached a round after the other members had "
                              "settled without it")
            raise WorldBroken(f"world {world.world_id!r} moved on without "
                              f"{world.describe_process(world.process_index)} (slower than "
                              "the timeout); join it again")
        missing = fleet.excluded(world, missing)    # a lost worker's engine goes whole
        joins = confirmed_joins(world, seen, missing, timeout)
        infos = [g.get("engine") or {} for g in gathered if isinstance(g, dict)]
        trainer = next((i for i in infos if "expect" in i), {})
        workers = trainer.get("workers") or next(
            (i["workers"] for i in infos if i.get("workers")), None)
        survivors = [world.processes[p] for p in range(world.num_processes) if p not in missing]
        problem = joining_problem(survivors, [r["info"] for r in joins], workers,
                                  trainer.get("expect"), trainer.get("failed"))
        if not missing and not seen and not problem:
            return lost
        lost += [world.members[p] for p in missing]
        if problem:
            joins = []
        if missing or joins:
            world.advance(missing, joins, time.monotonic() + timeout)
            stream.enter_epoch()
        if problem:
            raise HalfJoined(problem)
    raise RefitError(f"the members of world {world.world_id!r} changed {MAX_CHANGES} times "
                     f"at the start of one round (lost {lost}); try the update again")


def confirmed_joins(world: Any, seen: set[str], missing: list[int], timeout: float) -> list:
    """The join requests of ``seen`` whose processes are still there to confirm them
    (``Membership.confirm_joins``): a worker that gave up or died before it was admitted is
    never waited for, and an engine with such a worker is half-joined, not half-admitted."""
    return world.membership.confirm_joins(
        [r for r in world.pending() if r["id"] in seen], missing, time.monotonic() + timeout)
