"""What the processes of one refit call agree on after it: the shared per-world state of
the Refits in this process, the failure every process raises, how a local exception
crosses processes, and what a call's move left (split from :mod:`xreshard.runtime.refit`,
which runs the call)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from . import registry
from ..errors import (CollectiveMismatch, TransportError, XreshardError, error_from,
                      error_message, error_name, short_name)

__all__ = ["Failed", "WORLDS", "WorldState", "crossed", "entry", "failure_lines",
           "failed_call", "first_cause", "outcome_wait", "rank_maps", "unrun_unnamed",
           "world_state"]


class WorldState:
    """What the Refits of one world share in this process: every process's framework ids
    (gathered at the world's first refit call, ``refit/identity``) and how many Refits
    agreed on their identity (every process agrees on them at the same collective, so the
    counts stay equal). Per world, not per Refit: a Refit created on one side only (after a
    refused call, or crossed) must not make one process gather while another checks."""

    def __init__(self) -> None:
        self.identity: list[dict] | None = None
        self.agreed = 0
        self.epoch = 0
        #: this process's Refits of the world (see ``Refit._unnamed_problem``)
        self.refits: weakref.WeakSet = weakref.WeakSet()


#: world -> its WorldState in this process
WORLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def world_state(world: Any) -> WorldState:
    state = WORLDS.get(world)
    if state is None:
        state = WORLDS[world] = WorldState()
    return state


def unrun_unnamed(refit: Any) -> list[list[str]]:
    """An error entry for the first call of an unnamed Refit when this process holds two
    or more unnamed Refits of the world that never agreed on an identity: the first call of
    each proposes the same one (``#n``), so a trainer calling policy then reference and
    rollouts calling reference then policy would each receive the other model's weights."""
    def unrun() -> list[Any]:
        return [r for r in list(world_state(refit.world).refits)
                if r is not refit and r._id is None and r._name is None]
    if not unrun():
        return []
    gc.collect()        # Refits dropped without a call, not collected yet, do not count
    others = unrun()
    if not others:
        return []
    return [["RefitError",
             f"this process holds {len(others) + 1} Refits of world "
             f"{refit.world.world_id!r} with no name that have not run yet: the first call of "
             f"each proposes the same identity, so if another process called them in another "
             f"order, each would receive the other's weights; name every Refit of a world "
             f"that holds several (Refit(world, ..., name='policy'), the same name on every "
             f"process)"]]


class Failed(Exception):
    """A failure every process agreed on: raise ``error`` (the same everywhere)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def entry(exc: BaseException, phase: str) -> list[str]:
    """How a local exception crosses processes: [class name, message] (see
    ``xreshard.errors``: a foreign exception is classified by ``phase``)."""
    return [error_name(exc, phase), error_message(exc)]


def failure_lines(failed: list[tuple[int, list[str]]], world: Any, limit: int = 20) -> str:
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


def first_cause(failed: list[tuple[int, list[str]]]) -> str:
    """The error class every process raises for a call that failed while moving: the first
    process's (in process order) that failed for a reason of its own, not a transport
    error; a process whose transport failed because a peer aborted (or died) reports a
    ``TransportError`` that only echoes it. Only transport errors (or none: a process never
    reported): the first of them, else ``TransportTimeout``."""
    own = own_failures(failed)
    return own[0][1][0] if own else "TransportTimeout"


def _own(error: list[str]) -> bool:
    """Whether ``error`` ([class, message]) is a failure of the process's own, not a
    ``TransportError`` echoing a peer's abort or death."""
    return not isinstance(error_from(*error), TransportError)


def outcome_wait(timeout: float, error: list[str] | None = None) -> float:
    """How long ``refit/outcome`` waits for the others: the call's ``timeout``, plus a
    grace (a quarter of it, 2 to 10 s) for a process that failed for a reason of its own
    (``error``: [class, message], not a ``TransportError``).

    Such a process aborted its transports and arrives at once; a peer's abort does not
    always reach that peer's pending gloo wait, which then fails at its own transport
    timeout, up to ``timeout`` after the faulty process arrived. Waiting only
    ``timeout``, the faulty process settled the outcome without its healthy peers: a
    fixed world named them as never reporting, an elastic world kept only the faulty
    process. The healthy processes wait ``timeout`` as before (their failure stays
    bounded by it); only the process that caused the failure waits longer."""
    if error is None or not _own(error):
        return timeout
    return timeout + min(max(2.0, timeout / 4), 10.0)


def own_failures(failed: list[tuple[int, list[str]]]) -> list[tuple[int, list[str]]]:
    """The failures of processes that failed for a reason of their own: not a
    ``TransportError``, which a process whose peer aborted its transports reports as an
    echo (see :func:`first_cause`); all of them when every failure is one."""
    own = [(p, e) for p, e in failed if _own(e)]
    return own or failed


def failed_call(refit: Any, failed: list[tuple[int, list[str]]], missing: list[int],
                target: int) -> Exception:
    """A call whose outcome shows failures (``failed``: position, [class, message]) or
    processes that never reported it (``missing``): deal with the world, the same way in
    every process (they all hold the same settled outcomes), and return the error every
    one raises. An elastic world moves to a new epoch, without the missing, with
    transports made anew (``fleet.after_loss``; it may finish the call there instead:
    ``Restart``); a fixed world is broken when a process went missing or failed for a
    reason of its own that is not xreshard's (``own_failures``: a peer's
    ``TransportError`` that only echoes another process's abort does not count), else its
    transports are made anew (a process that failed aborted its own,
    ``WorldTransports.abort``)."""
    from . import fleet
    from .atomic import left
    world = refit.world
    lines = [failure_lines([(q, [e[0], f"{short_name(e[0])}: {e[1]}"]) for q, e in failed],
                           world, 10)]
    if missing:
        lines.append("never reported its outcome (dead, or stuck past the timeout): "
                     + "; ".join(world.describe_process(p) for p in missing[:10]))
    where = "\n  ".join(x for x in lines if x)
    if world.elastic:
        fleet.after_loss(refit, missing)
    elif missing or any(not isinstance(error_from(*e), XreshardError)
                        for _, e in own_failures(failed)):
        world.mark_broken(f"refit v{target} failed while moving: {where}")
    else:
        world.renew_transports()
    stale = left(refit.keeps_destinations, refit.version)
    return error_from(first_cause(failed),
                      f"refit v{target} failed while moving, {stale}:\n  {where}")


def rank_maps(world: Any, timeout: float) -> tuple[list[dict], dict[str, Any]]:
    """Every process's framework ids (``refit/identity``, gathered once per world and epoch
    in this process, shared by its Refits) and this process's map of them: framework ids ->
    world ranks per adapter, plus ``"local"`` (this process's ranks)."""
    shared = world_state(world)
    if shared.epoch != world.epoch:       # ranks renumbered: gather them again
        shared.identity, shared.epoch = None, world.epoch
    if shared.identity is None:
        ranks = list(world.rank_ids)
        me: dict[str, Any] = {"ranks": ranks, "ids": {}}
        try:
            me["ids"] = registry.identity([world.local_device(r) for r in ranks], ranks)
        except Exception as e:      # noqa: BLE001 - reported at refit/check instead
            me["error"] = entry(e, "check")
        shared.identity = world.allgather_json(me, timeout=timeout, kind="refit/identity")
    identity = shared.identity
    processes, index = world.processes, world.process_index
    maps: dict[str, Any] = {}
    # several single-process JAX jobs in one group (engine replicas) reuse device ids:
    # this process's own ids (last) are what its objects name
    infos = [info for p, info in enumerate(identity)
             if processes[p]["group"] == processes[index]["group"] and p != index]
    for info in infos + [identity[index]]:
        for name, pairs in (info.get("ids") or {}).items():
            known = maps.setdefault(name, {})
            for framework_id, rank in pairs:
                known[framework_id] = int(rank)
    mine = identity[index].get("error")
    if mine:
        raise error_from(*mine)
    maps["local"] = list(world.rank_ids)
    return identity, maps


def crossed(world: Any, gathered: list[dict[str, Any]], what: str) -> CollectiveMismatch:
    """The error of processes that called different Refits of one world."""
    def label(g: dict[str, Any]) -> str:
        agreed, proposed = g.get("refit"), g.get("propose")
        return (f"Refit {agreed}" if agreed is not None
                else f"a Refit on its first call ({proposed})")
    where = "; ".join(f"{world.describe_process(p)} in {label(g)}"
                      for p, g in enumerate(gathered))
    return CollectiveMismatch(
        f"{what}: the processes are in different Refits of world "
        f"{world.world_id!r} ({where}); every process must call the Refits of a "
        f"world in the same order (two Refits of one world, e.g. a policy and a "
        f"reference model: call them in the same order everywhere, and name them: "
        f"Refit(world, name=...))")
