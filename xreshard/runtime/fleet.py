"""What a refit does when its world's members change (an elastic world, see
:mod:`xreshard.runtime.epochs`).

Two moments, both at a collective every member agrees on:

- ``refit/check`` (every call): each member says which join/leave requests it saw, and
  the collective is partial (a member that died or left since the last call is not waited
  for). Any change - a member missing, a request seen - moves every survivor to the next
  epoch, then the call starts over in it (the joining processes make their first call
  there); the planner prepares again for the new member set.
- ``refit/outcome`` of a call that lost members while moving: with
  ``RefitConfig(on_member_loss="continue")`` and no lost member holding a source region of
  the call, the survivors move to the next epoch and run the call again, in the same call:
  every surviving destination then holds every byte of this version (the call is
  re-prepared, so a lost relay's regions come from another holder), and the report names
  the lost (``RefitReport.lost``). A lost source, or ``"fail"``, fails the call on every
  survivor with one typed error, as a fixed world does, and the world moves to the next
  epoch without the lost instead of being broken: a restarted trainer joins it.
- ``refit/outcome`` of a call that failed with nobody lost (one process's own fault: it
  aborted its transports, so its peers arrived at once; nobody settles early, see
  ``Refit._commit``): the call fails on every member with one typed error and the same
  members form the next epoch, with fresh transports (``after_loss``).
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import WorldBroken

__all__ = ["Restart", "check_body", "after_check", "after_loss", "excluded", "lost_sources"]

#: how many times one call may start over because the members changed under it
MAX_RESTARTS = 4


class Restart(Exception):
    """The world moved to a new epoch during a call: run the call again in it."""

    def __init__(self, lost: list[str]):
        super().__init__(f"members changed (lost {lost})")
        self.lost = lost


def check_body(world: Any) -> list[str]:
    """The ids of the join requests this process sees, for ``refit/check``. Leave requests
    are no change by themselves: a member that left is missing from the collective (and
    not waited for); one from anyone else (a stray, a replay) must not move the epoch."""
    return [r["id"] for r in world.pending() if r["kind"] == "join"] if world.elastic else []


def _deadline(refit: Any) -> float:
    return time.monotonic() + refit.config.timeout


def excluded(world: Any, missing: list[int]) -> list[int]:
    """``missing`` (the positions a partial collective settled without) and every member
    of their units (``World.excluded``); raises ``WorldBroken`` in a process among them:
    it is no member of the next epoch and must not take part in forming it (its join
    record would take a survivor's slot)."""
    lost = world.excluded(missing)
    if world.process_index in lost and world.process_index not in missing:
        gone = [world.members[p] for p in missing]
        world.mark_broken(f"a member of this process's unit was lost ({gone}): it is "
                          f"excluded with it from epoch {world.epoch + 1}")
        raise WorldBroken(f"world {world.world_id!r} moved on without "
                          f"{world.describe_process(world.process_index)}: a member of its "
                          f"unit {world.processes[world.process_index].get('unit')!r} was "
                          f"lost ({', '.join(gone)}), and a unit stands or falls together; "
                          f"restart the unit and join the running world again")
    _excluded(world, lost)
    return lost


def _excluded(world: Any, missing: list[int]) -> None:
    """This process arrived after the others settled without it: it is no member of the
    next epoch; it must not take part in forming it (its join record would take a
    survivor's slot)."""
    if world.process_index in missing:
        world.mark_broken(f"this process reached a collective after the other members "
                          f"had settled without it (slower than the timeout); it is no "
                          f"member of epoch {world.epoch + 1}")
        raise WorldBroken(f"world {world.world_id!r} moved on without this process "
                          f"({world.describe_process(world.process_index)}), which was "
                          f"slower than the timeout; join the running world again")


def after_check(refit: Any, gathered: list[Any]) -> None:
    """After the partial ``refit/check`` of an elastic world: raise :class:`Restart` once
    every survivor moved to the next epoch, when a member is missing or a join request
    seen was confirmed by its process (``Membership.confirm_joins``); return when nothing
    changed (requests not confirmed are dropped, the epoch stays)."""
    world = refit.world
    missing = [p for p, g in enumerate(gathered) if g is None]
    seen = {rid for g in gathered if isinstance(g, dict) for rid in g.get("requests") or ()}
    if not missing and not seen:
        return
    missing = excluded(world, missing)
    deadline = _deadline(refit)
    joins = world.membership.confirm_joins(
        [r for r in world.pending() if r["id"] in seen], missing, deadline)
    if not missing and not joins:
        return
    lost = [world.members[p] for p in missing]
    world.advance(missing, joins, deadline)
    raise Restart(lost)


def lost_sources(refit: Any, missing: list[int]) -> list[str]:
    """The lost members that held a source region of the call (no other holder is
    assumed: the planner chose their regions' senders among the live ones)."""
    prepared = refit.prepared
    if prepared is None:
        return []
    held = set()
    for layout in prepared.direct.src_layouts.values():
        held |= set(layout.rank_set)
    world = refit.world
    return [world.members[p] for p in missing
            if held & set(world.processes[p]["ranks"])]


def after_loss(refit: Any, missing: list[int]) -> bool:
    """After ``refit/outcome`` of an elastic world found members missing or a failure:
    every survivor moves to the next epoch, without the missing, and with fresh transports
    either way - also when nobody is lost (one process's local fault: its transports, and
    those of the peers it failed, are unusable, and a process that failed locally is no
    evidence that anyone is lost). Raises :class:`Restart` when the survivors finish the
    call there; else returns True: the call fails (the caller raises its error) and the
    world, not broken, runs the next call."""
    world = refit.world
    missing = excluded(world, missing)
    sources = lost_sources(refit, missing)
    lost = [world.members[p] for p in missing]
    world.advance(missing, [], _deadline(refit), renew=True)
    if missing and not sources and refit.config.on_member_loss == "continue":
        raise Restart(lost)
    return True


def restarting(world: Any, call: Any) -> tuple[Any, Any]:
    """Run ``call()`` (one refit call: returns its report and ``finish``), again in each
    new epoch the members moved to during it; the report names the members lost."""
    import dataclasses
    from ..errors import RefitError
    lost: list[str] = []
    for restarts in range(MAX_RESTARTS + 1):
        try:
            report, finish = call()
            break
        except Restart as r:
            lost += r.lost
            if restarts == MAX_RESTARTS:
                raise RefitError(f"the members of world {world.world_id!r} changed "
                                 f"{restarts + 1} times during one call (lost {lost})") \
                    from None
    if world.elastic:
        report = dataclasses.replace(report, lost=tuple(lost), epoch=world.epoch)
    return report, finish


def adopt_version(refit: Any, gathered: list[dict[str, Any]]) -> set[Any]:
    """The versions ``refit/check`` compares. In an elastic world, the processes new to
    this Refit (no agreed identity yet: a new member at version 0, or one that caught up
    from a replica and may be behind since) take the version of those that have one: they
    receive the next one with them (every receiver gets its regions whole). Returns the
    versions left to compare."""
    versions = {g.get("version") for g in gathered}
    known = {g.get("version") for g in gathered if g.get("refit") is not None}
    if not refit.world.elastic or not known:
        return versions
    if len(known) == 1 and gathered[refit.world.process_index].get("refit") is None:
        refit.version = next(iter(known))
    return known


def one_refit(world: Any, gathered: list[dict[str, Any]]) -> bool:
    """In an elastic world: every process names one agreed Refit, or is new to the world
    (no identity yet) and proposes that one (it then takes it)."""
    ids = [g.get("refit") for g in gathered]
    agreed = {i for i in ids if i is not None}
    return world.elastic and len(agreed) == 1 and all(
        i is not None or g.get("propose") in agreed for i, g in zip(ids, gathered))
