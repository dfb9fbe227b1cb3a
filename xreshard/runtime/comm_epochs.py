"""What each communicator does when an elastic world moves to a new epoch (pure).

Decision record. An epoch change (``xreshard.runtime.epochs``) removes members (left,
died) and adds members (joined); ranks are renumbered (group order, then index). A
transport made of several communicators need not be rebuilt whole: a communicator whose
members all stay is *kept* as it is (only the world ranks it is addressed by change), one
that lost members is *shrunk*, one that gains members is *grown*, one whose excluded
members are alive and take part may be *split*, and otherwise it is *recreated*; a
communicator nobody needs any more is *dropped*, a new one *created*. What a
communicator can do depends on its library: gloo groups can only be kept or recreated;
NCCL shrinks from 2.27 (``ncclCommShrink``, with ``NCCL_SHRINK_ABORT`` when an excluded
member died), grows from 2.29 (``ncclCommGrow``) and splits from 2.18
(``ncclCommSplit``), each only where the loaded library has the symbol
(``Abilities``; ``xreshard.transport.nccl_epochs.nccl_abilities`` reads them).

A member is a process *instance*: its label (``"rollout[1]"``) and its pid. A process
restarted under its old label is a new member (its communicators were lost with the old
one). Every process computes the same steps from the same epoch tables, so no step is
negotiated. Everything here is pure: member tuples in, steps out.

Rank order inside a communicator follows the library: a kept communicator keeps its
order; a shrunk one closes the gaps in the old order (``ncclCommShrink``); a grown one
keeps the old ranks and appends the new members in the new epoch's order
(``ncclCommGrow``: "existing ranks keep their numbers"); a split one orders by key (the
old rank here, so the old order); a created or recreated one takes the new epoch's order.
``Step.members`` is that order; the transport maps world ranks onto it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["ACTIONS", "Abilities", "GLOO", "Step", "decide", "member_id", "plan_epoch",
           "renumbering"]

#: every action a step may take
ACTIONS = ("keep", "shrink", "grow", "shrink+grow", "split", "recreate", "create", "drop")


def member_id(info: Mapping[str, Any]) -> str:
    """A process instance as communicators know it: ``"rollout[1]#4242"`` (label, pid)."""
    return f"{info['group']}[{info['index']}]#{info['pid']}"


@dataclass(frozen=True, slots=True)
class Abilities:
    """What a communicator library can do to an existing communicator."""

    shrink: bool = False
    grow: bool = False
    split: bool = False
    name: str = "gloo"

    def __str__(self) -> str:
        can = [k for k in ("shrink", "grow", "split") if getattr(self, k)]
        return f"{self.name} ({', '.join(can) if can else 'keep or recreate only'})"


#: gloo groups: a fixed set of processes, no shrink, grow or split
GLOO = Abilities()


@dataclass(frozen=True, slots=True)
class Step:
    """What one communicator does at an epoch change.

    Attributes:
        key: the communicator's name (the same in every process).
        action: one of ``ACTIONS``.
        old: its members before (None: it did not exist).
        members: its members after, in communicator rank order (() when dropped).
        excluded: old communicator ranks that leave it (shrink, split).
        abort: an excluded member died (not a clean leave): NCCL shrinks with
            ``NCCL_SHRINK_ABORT`` (pending work on the old communicator is aborted).
        added: members new to it (grow), in the order they are appended.
        rank_map: old communicator rank -> new communicator rank of every member that
            stays in it (empty when created or recreated: everything is new).
    """

    key: str
    action: str
    old: tuple[str, ...] | None
    members: tuple[str, ...]
    excluded: tuple[int, ...] = ()
    abort: bool = False
    added: tuple[str, ...] = ()
    rank_map: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action

    @property
    def touched(self) -> bool:
        """Whether the change reaches the communicator itself (anything but keep)."""
        return self.action != "keep"


def decide(key: str, old: Sequence[str] | None, new: Sequence[str], alive: Iterable[str],
           abilities: Abilities = GLOO) -> Step:
    """The step of one communicator.

    Args:
        key: its name.
        old: its members at the last epoch, in communicator rank order; None if it did not
            exist.
        new: the members it needs in the new epoch (the new epoch's order); fewer than 2:
            it is not needed.
        alive: the members of the new epoch (a member not in it left or died).
        abilities: what its library can do.
    """
    new = tuple(new)
    if len(new) < 2:
        return Step(key, "drop", None if old is None else tuple(old), ())
    if old is None:
        return Step(key, "create", None, new)
    old = tuple(old)
    if old == new or (set(old) == set(new) and len(old) == len(new)):
        return Step(key, "keep", old, old, rank_map={i: i for i in range(len(old))})
    stay = [m for m in old if m in set(new)]
    excluded = tuple(i for i, m in enumerate(old) if m not in set(new))
    added = tuple(m for m in new if m not in set(old))
    alive = set(alive)
    died = any(old[i] not in alive for i in excluded)
    shrunk = {old.index(m): j for j, m in enumerate(stay)}
    if len(stay) < 2 and added:
        return Step(key, "recreate", old, new)     # nothing worth keeping
    if not added:
        if abilities.shrink:
            return Step(key, "shrink", old, tuple(stay), excluded, died, rank_map=shrunk)
        if abilities.split and not died:
            # every old member takes part in a split: the excluded ones with no color
            return Step(key, "split", old, tuple(stay), excluded, rank_map=shrunk)
        return Step(key, "recreate", old, new)
    if not excluded:
        if abilities.grow:
            return Step(key, "grow", old, old + added, added=added,
                        rank_map={i: i for i in range(len(old))})
        return Step(key, "recreate", old, new)
    if abilities.shrink and abilities.grow:
        return Step(key, "shrink+grow", old, tuple(stay) + added, excluded, died, added,
                    shrunk)
    return Step(key, "recreate", old, new)


def plan_epoch(old: Mapping[str, Sequence[str]], new: Mapping[str, Sequence[str]],
               alive: Iterable[str], abilities: Abilities = GLOO) -> dict[str, Step]:
    """The step of every communicator, old and new, in key order: those in ``old`` only
    are dropped, those in ``new`` only created, the others decided by ``decide``."""
    alive = tuple(alive)
    return {k: decide(k, old.get(k), new.get(k, ()), alive, abilities)
            for k in sorted(set(old) | set(new))}


def renumbering(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
                ) -> dict[int, int]:
    """Old world rank -> new world rank of every rank whose process instance is in both
    member tables (``World.processes`` of two epochs: group, index, pid, ranks).

    Ranks are numbered by group order then index, and a member keeps its group and index,
    so the map is increasing (survivors keep their relative order).
    """
    now = {member_id(info): info for info in new}
    out: dict[int, int] = {}
    for info in old:
        twin = now.get(member_id(info))
        if twin is not None and len(twin["ranks"]) == len(info["ranks"]):
            out.update(zip(info["ranks"], twin["ranks"]))
    return out
