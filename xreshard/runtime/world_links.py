"""An elastic world's communicators across epochs: gloo links kept, made and dropped by
``xreshard.runtime.comm_epochs``, with counters that say which.

``WorldTransports`` inherits these methods (a mixin over the world's members, store and
collectives). In an elastic world the "gloo" transport is a ``LinkedTransport``: one
two-process gloo group per pair of processes. At an epoch change the world *parks* its
links instead of closing them (``_park_transports``); the next ``transport("gloo")`` (a
collective, as every transport creation) gathers which links each process still holds
usable, decides every link's step with ``comm_epochs.plan_epoch`` (the same in every
process), keeps the links whose two members stay, closes those to members that left or
died, and creates the new ones, each process in one global order (so two processes never
wait on each other's other link). Every other kind (local, shm, cuda_ipc, nccl) is made
again for the new member set.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections import Counter
from typing import Any

from .comm_epochs import GLOO, member_id, plan_epoch
from .store import parse_address
from ..transport.links import Link, LinkedTransport

__all__ = ["WorldLinks"]

logger = logging.getLogger("xreshard.runtime.world")


class WorldLinks:
    """The communicator half of an elastic ``World`` (a mixin)."""

    @property
    def comm_steps(self) -> dict[str, str]:
        """What happened to this process's communicators since the last epoch change
        (or the join): gloo link key, or "nccl", -> the action taken ("keep", "shrink",
        "create", "recreate", "drop"; see ``comm_epochs``)."""
        return dict(self.__dict__.get("_comm_steps", {}))

    @property
    def comm_counts(self) -> dict[str, int]:
        """How many of this process's communicators each action touched since the world
        formed (cumulative, e.g. ``{"create": 3, "keep": 2, "drop": 1}``)."""
        return dict(self.__dict__.setdefault("_comm_counts", Counter()))

    def _parked_links(self) -> dict[str, Link]:
        return self.__dict__.setdefault("_links", {})

    def _park_transports(self) -> None:
        """At an epoch change: keep the gloo links aside (the next epoch decides which it
        keeps), close every other transport."""
        linked = self._transports.pop("gloo", None)
        if isinstance(linked, LinkedTransport):
            self._parked_links().update({link.key: link for link in linked.links.values()})
        elif linked is not None:
            self._transports["gloo"] = linked       # a fixed world's group: closed below
        nccl = self._transports.pop("nccl", None)
        members = self.__dict__.pop("_nccl_members", None)
        if nccl is not None and members is not None:    # a RenumberedTransport (elastic)
            self.__dict__["_parked_nccl"] = (nccl.inner, members)
        elif nccl is not None:
            self._transports["nccl"] = nccl
        self.__dict__["_comm_steps"] = {}       # the next epoch's steps from here
        self._close_transports()

    def _close_links(self) -> None:
        """Close every parked link (the world closes)."""
        for link in self._parked_links().values():
            try:
                link.close()
            except Exception:       # noqa: BLE001 - the others still close
                logger.warning("closing link %s failed", link.key, exc_info=True)
        self._parked_links().clear()
        parked = self.__dict__.pop("_parked_nccl", None)
        if parked is not None and parked[0] is not None:
            parked[0].close()

    def _make_links(self) -> LinkedTransport:
        """The gloo links of this epoch (collective: one all-gather, then the new links)."""
        prefix = self._next_prefix()
        parked = self._parked_links()
        ids = [member_id(info) for info in self._infos]
        me = self._process_index
        mine = {"held": sorted(k for k, link in parked.items() if link.usable)}
        # also the barrier gloo's own rendezvous lacks: it names who is missing
        gathered = self.allgather_json(mine, timeout=self._wait_seconds(), kind="gloo/links")
        held = [set(g["held"]) for g in gathered]
        index = {m: p for p, m in enumerate(ids)}
        old = {}
        for key, link in parked.items():
            a, b = link.members
            if a in index and b in index and key in held[index[a]] and key in held[index[b]]:
                old[key] = link.members
        new = {}
        for p in range(len(ids)):
            for q in range(p + 1, len(ids)):
                new["|".join(sorted((ids[p], ids[q])))] = (ids[p], ids[q])
        steps = plan_epoch(old, new, ids, GLOO)
        links: dict[tuple[int, int], tuple[Link, dict[int, int]]] = {}
        counts = self.__dict__.setdefault("_comm_counts", Counter())
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
            p, q = sorted(index[m] for m in link.members)
            ranks = {}
            for m in link.members:
                ranks.update(zip(self._infos[index[m]]["ranks"], link.inner_ranks(m)))
            links[(p, q)] = (link, ranks)
        for key in list(parked):            # links of members no longer here
            parked.pop(key).close()
            counts["drop"] += 1
            done[key] = "drop"
        self.__dict__.setdefault("_comm_steps", {}).update(done)
        logger.info("world %r epoch %d: gloo links %s", self._world_id, self.epoch,
                    dict(Counter(done.values())))
        return LinkedTransport(links, self._rank_process)

    def _new_link(self, prefix: str, key: str, members: tuple[str, ...],
                  ids: list[str]) -> Link:
        """Create the two-process gloo group of link ``key`` (collective between the two)."""
        from ..transport.gloo import GlooTransport, create_gloo_group

        index = {m: p for p, m in enumerate(ids)}
        me = self._process_index
        pos = members.index(ids[me])
        sizes = (self._infos[index[members[0]]]["num_ranks"],
                 self._infos[index[members[1]]]["num_ranks"])
        store_host, _ = parse_address(self._address)
        seconds = self._wait_seconds()
        self._store.set_timeout(datetime.timedelta(seconds=seconds))
        try:
            pg = create_gloo_group(self._store, f"{prefix}/link/{key}/", rank=pos, size=2,
                                   timeout=seconds, store_host=store_host)
        finally:
            self._store.set_timeout(datetime.timedelta(seconds=self._timeout))
        labels = [self.describe_process(index[m]) for m in members]
        inner = GlooTransport(pg, rank_process=[0] * sizes[0] + [1] * sizes[1],
                              process_index=pos, process_labels=labels)
        return Link(key, (members[0], members[1]), inner, sizes)

    # ------------------------------------------------------------------ nccl

    def _rank_members(self, ranks: Any) -> tuple[str, ...]:
        """Communicator members of world ranks: ``"rollout[1]#4242/0"`` (the process
        instance, then the rank's position among its ranks)."""
        out = []
        for r in ranks:
            info = self._infos[self._rank_process[r]]
            out.append(f"{member_id(info)}/{r - info['ranks'][0]}")
        return tuple(out)

    def _nccl_epoch(self, prefix: str, ranks: tuple[int, ...], devices: dict[int, int]
                    ) -> Any:
        """An elastic world's NCCL communicator over world ranks ``ranks`` (collective):
        the last epoch's kept or shrunk where ``comm_epochs`` says so and the loaded NCCL
        can, else made anew. ``devices``: this process's world rank -> CUDA ordinal.
        Returns a ``RenumberedTransport`` (world ranks -> communicator ranks)."""
        from ..transport.nccl import NcclTransport
        from ..transport.routed import RenumberedTransport
        from .comm_epochs import decide

        parked = self.__dict__.pop("_parked_nccl", None)
        before, old = (None, None) if parked is None else parked
        usable = before is None or before.usable
        mine_can = _nccl_abilities()
        agreed = self.allgather_json({"usable": usable, "old": None if old is None else
                                      list(old), "can": _ability_flags(mine_can)},
                                     timeout=self._wait_seconds(), kind="nccl/epoch")
        # a new member has no last epoch of its own: the members that do say what it was
        olds = {tuple(a["old"]) for a in agreed if a["old"] is not None}
        old = olds.pop() if len(olds) == 1 else None
        if not all(a["usable"] for a in agreed):
            old = None      # a failed group may have left work behind: make it anew
        new = self._rank_members(ranks)
        # what every process's NCCL can do: processes with different NCCLs (a trainer's
        # 2.29, an engine's 2.28) must take the same step, or one waits in a grow while the
        # other waits in a fresh rendezvous
        step = decide("nccl", old, new, self._rank_members(range(self.num_ranks)),
                      _common_abilities(mine_can, [a.get("can") for a in agreed]))
        mine = set(self._rank_members(self._rank_ids))
        resized = ("shrink", "grow", "shrink+grow")
        members = step.members if step.action in ("keep",) + resized else new
        index = {r: members.index(m) for r, m in zip(ranks, new)}
        local = {index[r]: devices[r] for r in self._rank_ids if r in index}
        action, inner = step.action, None
        if action == "keep":
            inner = before
        elif action in resized and local:
            inner = _resize(step, before, local, self._store, f"{prefix}/nccl",
                            self._wait_seconds())
        else:
            if before is not None:
                before.close()
            if action == "split":
                logger.info("world %r: NCCL could split the communicator; it is made anew "
                            "(split is not executed)", self._world_id)
            if action in resized or (action != "create" and not local):
                action = "drop"             # this process has no rank in it any more
            elif action != "create":
                action = "recreate"
            if local and action != "drop":
                inner = NcclTransport(self._store, len(members), local, key=f"{prefix}/nccl",
                                      timeout=self._wait_seconds())
        if mine & set(step.old or ()) or mine & set(members):
            counts = self.__dict__.setdefault("_comm_counts", Counter())
            counts[action] += 1
            self.__dict__.setdefault("_comm_steps", {})["nccl"] = action
        self.__dict__["_nccl_members"] = members
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
