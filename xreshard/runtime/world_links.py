"""An elastic world's communicators across epochs: gloo links kept, made and dropped by
``xreshard.runtime.comm_epochs``, with counters that say which.

``EpochLinks`` is a part of the world's transports (``World.transports.links``), with its
own state: the links parked at an epoch change, the NCCL communicator parked with its
members, and the steps and counts of what happened to each. In an elastic world the
"gloo" transport is a ``LinkedTransport``: one two-process gloo group per pair of
processes. At an epoch change the world *parks* its links instead of closing them
(``park``); the next ``transport("gloo")`` (a collective, as every transport creation)
gathers which links each process still holds usable, decides every link's step with
``comm_epochs.plan_epoch`` (the same in every process), keeps the links whose two members
stay, closes those to members that left or died, and creates the new ones, each process in
one global order (so two processes never wait on each other's other link). Every other
kind (local, shm, cuda_ipc, nccl) is made again for the new member set.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from .comm_epochs import GLOO, member_id, plan_epoch
from .store import parse_address
from ..transport.base import Transport
from ..transport.links import Link, LinkedTransport

if TYPE_CHECKING:
    from .world import World

__all__ = ["EpochLinks"]

logger = logging.getLogger("xreshard.runtime.world")


class EpochLinks:
    """The communicators an elastic world keeps across epochs (its own state: what is
    parked, and what happened to each communicator)."""

    def __init__(self, world: World):
        self._world = world     # its members, store and collectives
        self.parked: dict[str, Link] = {}
        #: the last epoch's NCCL communicator (or None) and its members, until the next
        self.parked_nccl: tuple[Any, tuple[str, ...]] | None = None
        #: the members of the NCCL communicator of this epoch (an elastic world's)
        self.nccl_members: tuple[str, ...] | None = None
        self.steps: dict[str, str] = {}
        self.counts: Counter[str] = Counter()

    def park(self, transports: dict[str, Transport]) -> None:
        """At an epoch change: take the gloo links out of ``transports`` and keep them
        aside (the next epoch decides which it keeps), and the NCCL communicator of an
        elastic world; the caller closes every other transport."""
        linked = transports.pop("gloo", None)
        if isinstance(linked, LinkedTransport):
            self.parked.update({link.key: link for link in linked.links.values()})
        elif linked is not None:
            transports["gloo"] = linked       # a fixed world's group: closed by the caller
        nccl = transports.pop("nccl", None)
        members, self.nccl_members = self.nccl_members, None
        if nccl is not None and members is not None:    # a RenumberedTransport (elastic)
            self.parked_nccl = (getattr(nccl, "inner", None), members)
        elif nccl is not None:
            transports["nccl"] = nccl
        self.steps = {}         # the next epoch's steps from here

    def close(self) -> None:
        """Close every parked link (the world closes)."""
        for link in self.parked.values():
            try:
                link.close()
            except Exception:       # noqa: BLE001 - the others still close
                logger.warning("closing link %s failed", link.key, exc_info=True)
        self.parked.clear()
        parked, self.parked_nccl = self.parked_nccl, None
        if parked is not None and parked[0] is not None:
            parked[0].close()

    def make_links(self) -> LinkedTransport:
        """The gloo links of this epoch (collective: one all-gather, then the new links)."""
        world, ms = self._world, self._world.membership
        prefix = world._next_prefix()
        parked = self.parked
        ids = [member_id(info) for info in ms.infos]
        me = ms.process_index
        mine = {"held": sorted(k for k, link in parked.items() if link.usable)}
        # also the barrier gloo's own rendezvous lacks: it names who is missing
        gathered = world.allgather_json(mine, timeout=world._wait_seconds(), kind="gloo/links")
        held = [set(g["held"]) for g in gathered]
        index = {mid: p for p, mid in enumerate(ids)}
        old = {}
        for key, kept in parked.items():
            a, b = kept.members
            if a in index and b in index and key in held[index[a]] and key in held[index[b]]:
                old[key] = kept.members
        new = {}
        for p in range(len(ids)):
            for q in range(p + 1, len(ids)):
                new["|".join(sorted((ids[p], ids[q])))] = (ids[p], ids[q])
        steps = plan_epoch(old, new, ids, GLOO)
        links: dict[tuple[int, int], tuple[Link, dict[int, int]]] = {}
        counts = self.counts
        done: dict[str, str] = {}
        for key, step in steps.items():      # one global order: no two processes cross
            members = step.members or (step.old or ())
            if ids[me] not in members and ids[me] not in (step.old or ()):
                continue
            link = parked.pop(key, None)
            action = "recreate" if step.action == "create" and link is not None else step.action
            counts[action] += 1
            done[key] = action
            if action != "keep" and link is not None:
                link.close()
                link = None
            if action == "drop":
                continue
            if link is None:
                link = self._new_link(prefix, key, step.members, ids)
            p, q = sorted(index[mid] for mid in link.members)
            ranks: dict[int, int] = {}
            for member in link.members:
                ranks.update(zip(ms.infos[index[member]]["ranks"], link.inner_ranks(member)))
            links[(p, q)] = (link, ranks)
        for key in list(parked):            # links of members no longer here
            parked.pop(key).close()
            counts["drop"] += 1
            done[key] = "drop"
        self.steps.update(done)
        logger.info("world %r epoch %d: gloo links %s", world.world_id, ms.epoch,
                    dict(Counter(done.values())))
        return LinkedTransport(links, ms.rank_process)

    def _new_link(self, prefix: str, key: str, members: tuple[str, ...],
                  ids: list[str]) -> Link:
        """Create the two-process gloo group of link ``key`` (collective between the two)."""
        from ..transport.gloo import GlooTransport, create_gloo_group

        world, infos = self._world, self._world.membership.infos
        index = {m: p for p, m in enumerate(ids)}
        pos = members.index(ids[world.process_index])
        sizes = (infos[index[members[0]]]["num_ranks"], infos[index[members[1]]]["num_ranks"])
        store_host, _ = parse_address(world.address)
        seconds = world._wait_seconds()
        store = world._store
        store.set_timeout(datetime.timedelta(seconds=seconds))
        try:
            pg = create_gloo_group(store, f"{prefix}/link/{key}/", rank=pos, size=2,
                                   timeout=seconds, store_host=store_host)
        finally:
            store.set_timeout(datetime.timedelta(seconds=world.timeout))
        labels = [world.describe_process(index[m]) for m in members]
        inner = GlooTransport(pg, rank_process=[0] * sizes[0] + [1] * sizes[1],
                              process_index=pos, process_labels=labels)
        return Link(key, (members[0], members[1]), inner, sizes)

    # ------------------------------------------------------------------ nccl

    def rank_members(self, ranks: Any) -> tuple[str, ...]:
        """Communicator members of world ranks: ``"rollout[1]#4242/0"`` (the process
        instance, then the rank's position among its ranks)."""
        m = self._world.membership
        out = []
        for r in ranks:
            info = m.infos[m.rank_process[r]]
            out.append(f"{member_id(info)}/{r - info['ranks'][0]}")
        return tuple(out)

    def nccl_epoch(self, prefix: str, ranks: tuple[int, ...], devices: dict[int, int]
                   ) -> Any:
        """An elastic world's NCCL communicator over world ranks ``ranks`` (collective):
        the last epoch's kept or shrunk where ``comm_epochs`` says so and the loaded NCCL
        can, else made anew. ``devices``: this process's world rank -> CUDA ordinal.
        Returns a ``RenumberedTransport`` (world ranks -> communicator ranks)."""
        from ..transport.nccl import NcclTransport
        from ..transport.routed import RenumberedTransport
        from .comm_epochs import decide

        world = self._world
        parked, self.parked_nccl = self.parked_nccl, None
        before, old = (None, None) if parked is None else parked
        usable = before is None or before.usable
        mine_can = _nccl_abilities()
        agreed = world.allgather_json({"usable": usable, "old": None if old is None else
                                       list(old), "can": _ability_flags(mine_can)},
                                      timeout=world._wait_seconds(), kind="nccl/epoch")
        # a new member has no last epoch of its own: the members that do say what it was
        olds = {tuple(a["old"]) for a in agreed if a["old"] is not None}
        old = olds.pop() if len(olds) == 1 else None
        if not all(a["usable"] for a in agreed):
            old = None      # a failed group may have left work behind: make it anew
        new = self.rank_members(ranks)
        # what every process's NCCL can do: processes with different NCCLs (a trainer's
        # 2.29, an engine's 2.28) must take the same step, or one waits in a grow while the
        # other waits in a fresh rendezvous
        step = decide("nccl", old, new, self.rank_members(range(world.num_ranks)),
                      _common_abilities(mine_can, [a.get("can") for a in agreed]))
        mine = set(self.rank_members(world.rank_ids))
        resized = ("shrink", "grow", "shrink+grow")
        members = step.members if step.action in ("keep",) + resized else new
        index = {r: members.index(m) for r, m in zip(ranks, new)}
        local = {index[r]: devices[r] for r in world.rank_ids if r in index}
        action, inner = step.action, None
        if action == "keep":
            inner = before
        elif action in resized and local:
            inner = _resize(step, before, local, world._store, f"{prefix}/nccl",
                            world._wait_seconds())
        else:
            if before is not None:
                before.close()
            if action == "split":
                logger.info("world %r: NCCL could split the communicator; it is made anew "
                            "(split is not executed)", world.world_id)
            if action in resized or (action != "create" and not local):
                action = "drop"             # this process has no rank in it any more
            elif action != "create":
                action = "recreate"
            if local and action != "drop":
                inner = NcclTransport(world._store, len(members), local, key=f"{prefix}/nccl",
                                      timeout=world._wait_seconds())
        if mine & set(step.old or ()) or mine & set(members):
            self.counts[action] += 1
            self.steps["nccl"] = action
        self.nccl_members = members
        return RenumberedTransport(inner, index, "nccl")


def _resize(step: Any, before: Any, local: dict[int, int], store: Any, key: str,
            wait: float) -> Any:
    """Shrink and/or grow the last epoch's communicator as ``step`` says (collective). A
    new member (no ``before``) joins the grow; the others shrink the excluded ranks away
    first, then grow (the new members take the ranks after theirs)."""
    from ..transport.nccl import NcclTransport
    if before is None:
        assert step.added, step     # only a grow takes members without a communicator
        return NcclTransport.joined_by_grow(store, len(step.members), local, key, wait)
    if step.excluded:
        before = before.shrunk(step.excluded, step.abort,
                               f"{key}/shrunk" if step.added else key, wait)
    if step.added:
        before = before.grown(len(step.members), key, wait)
    return before


def _nccl_abilities() -> Any:
    """What the NCCL loaded in this process can do (keep or recreate only without one)."""
    from .comm_epochs import GLOO
    from ..transport.nccl_epochs import loaded_library
    from ..transport.nccl_setup import import_cupy
    try:
        import_cupy()
    except ImportError:
        return GLOO
    library = loaded_library()
    return GLOO if library is None else library.abilities()


_FLAGS = ("shrink", "grow", "split")


def _ability_flags(can: Any) -> dict[str, bool]:
    return {k: bool(getattr(can, k)) for k in _FLAGS}


def _common_abilities(mine: Any, gathered: list[Any]) -> Any:
    """What every process can do: ``mine`` with each flag ANDed over the processes'
    gathered flags (a process that sent none, or a flag it does not know, counts as
    unable)."""
    common = {k: bool(getattr(mine, k)) and all(isinstance(g, dict) and g.get(k) is True
                                                for g in gathered) for k in _FLAGS}
    return dataclasses.replace(mine, **common)
