"""Who is in a world (``World.membership``): its processes and their ranks, and, in an
elastic world, the epoch and the changes of members (admission, exclusion, renewal).

A component with its own state, composed by ``World``: the rank tables of the current
member set (``set_members``, at the join and at each new epoch) and the elastic record
(the base seal requests and epoch records are sealed with, the group order, the epoch,
the requests acted on). What a change of members does to the transports is theirs
(``World.transports.park``); what it does to the world's collectives (a new seal, a new
key root, the step counter from 0) is the world's (``World._enter_epoch``). The protocol
itself (requests, epoch records, who is gone) is :mod:`xreshard.runtime.epochs`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..config import Tuning
from ..errors import RefitError
from ..ir.topology import Topology
from .epochs import (Request, ask_and_form, epoch_world_id, gone, own_node, own_start,
                     publish_epoch, read_entry, read_epoch, read_requests, request,
                     same_process)
from .joining import KEY_ROOT, join_arguments, join_records, label, member_nonce, numbered
from .store import Seal

if TYPE_CHECKING:
    from .world import World

__all__ = ["Membership", "join_world"]

logger = logging.getLogger("xreshard.runtime.world")


class Membership:
    """The members of one world, as this process sees them.

    Attributes:
        world_id: the world's id (an epoch's join instance adds ``~e<epoch>`` to it).
        base: the seal of the token and the world id alone: requests and epoch records
            are sealed with it, so a process not admitted yet can write and read them.
        groups: the group order the world joined with (``World.join(groups=)``; None:
            sorted group names).
        elastic: whether members may change (``World.join(elastic=True)``).
        epoch: 0 as the world formed, +1 at each change of members.
        consumed: the ids of the requests acted on so far.
        joining: a process that joined a running world with ``wait=False``: its join
            info until it is admitted, else None.
        round: the last admission round (its id, the request ids confirmed in it).
        infos: every member's join info in process order, with its ``ranks``.
        process_index: this process's position in that order.
        devices: this process's devices, as given to ``World.join``.
        rank_process / rank_kind: every world rank's process position and device kind.
        rank_ids: this process's ranks, in local device order.
        topology: process and host of every rank, for the planner.
    """

    def __init__(self, world: World, seal: Seal, groups: Sequence[str] | None,
                 infos: list[dict[str, Any]], process_index: int, devices: Sequence[Any],
                 *, elastic: bool = False, epoch: int = 0, consumed: Iterable[str] = ()):
        self._world = world         # its store and collectives, for the elastic changes
        self.world_id = seal.world_id
        self.base = Seal(seal.token, seal.world_id)
        self.groups = groups
        self.elastic = elastic
        self.epoch = epoch
        self.consumed = set(consumed)
        self.joining: dict[str, Any] | None = None
        self.round: tuple[str, set[str]] | None = None
        self.devices = tuple(devices)
        self.infos: list[dict[str, Any]] = []
        self.process_index = 0
        self.rank_process: tuple[int, ...] = ()
        self.rank_kind: tuple[str, ...] = ()
        self.rank_ids: tuple[int, ...] = ()
        self.local: frozenset[int] = frozenset()
        self.topology = Topology.of({})
        self.set_members(infos, process_index)

    def set_members(self, infos: list[dict[str, Any]], process_index: int) -> None:
        """The rank tables of a member set (at the join, and at each new epoch)."""
        self.infos = infos
        self.process_index = process_index
        rank_process: list[int] = []
        kinds: list[str] = []
        for pos, info in enumerate(infos):
            rank_process.extend([pos] * info["num_ranks"])
            kinds.extend(info["device_kinds"])
        self.rank_process = tuple(rank_process)
        self.rank_kind = tuple(kinds)
        self.rank_ids = tuple(infos[process_index]["ranks"])
        self.local = frozenset(self.rank_ids)
        self.topology = Topology.of({r: (p, infos[p]["host"])
                                     for r, p in enumerate(rank_process)})

    # ------------------------------------------------------------------ who is where

    @property
    def num_ranks(self) -> int:
        return len(self.rank_process)

    @property
    def num_processes(self) -> int:
        return len(self.infos)

    @property
    def members(self) -> tuple[str, ...]:
        """The members' labels (``"rollout[1]"``) in process order, this epoch."""
        return tuple(label(info) for info in self.infos)

    @property
    def admitted(self) -> bool:
        """False while a process that joined a running world with ``wait=False`` has not
        been admitted (its first refit call, or ``admit()``, admits it)."""
        return self.joining is None

    @property
    def processes(self) -> list[dict[str, Any]]:
        """Per-process info in process order (a copy): group, index, host, pid,
        num_ranks, device_kinds, devices (strings) and ranks."""
        return [json.loads(json.dumps(info)) for info in self.infos]

    @property
    def groups_in_rank_order(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(info["group"] for info in self.infos))

    def group_ranks(self, name: str) -> tuple[int, ...]:
        """The ranks of group ``name``, ascending."""
        ranks = tuple(r for info in self.infos if info["group"] == name for r in info["ranks"])
        if not ranks:
            raise RefitError(f"world {self.world_id!r} has no group {name!r}; "
                             f"its groups are {list(self.groups_in_rank_order)}")
        return ranks

    def check_rank(self, rank: int) -> int:
        """``rank``, refused unless it is one of the world's."""
        if not 0 <= rank < len(self.rank_process):
            raise RefitError(f"rank {rank} is not in world {self.world_id!r} "
                             f"(ranks 0..{len(self.rank_process) - 1})")
        return rank

    def local_device(self, rank: int) -> Any:
        """The device object this process passed to ``join`` for its ``rank``."""
        if rank not in self.local:
            raise RefitError(f"rank {rank} is not local to process {self.process_index} "
                             f"(its ranks are {list(self.rank_ids)})")
        return self.devices[rank - self.rank_ids[0]]

    def describe_process(self, position: int) -> str:
        """``"trainer[0] (process 2, pid 123 on host-a)"``, for error messages."""
        info = self.infos[position]
        return f"{label(info)} (process {position}, pid {info['pid']} on {info['host']})"

    def own_info(self) -> dict[str, Any]:
        """This process's join info, without its ranks (they are numbered per epoch)."""
        return {k: v for k, v in self.infos[self.process_index].items() if k != "ranks"}

    # ------------------------------------------------------------------ requests

    def requests(self) -> list[Request]:
        """Join and leave requests no epoch has acted on yet (one store read)."""
        store = self._world._store
        if not self.elastic or store is None:
            return []
        return read_requests(store, self.base, self.consumed)

    def excluded(self, missing: Iterable[int]) -> list[int]:
        """The positions a change excludes when the members at ``missing`` are lost: those,
        and every member of their units (``World.join(unit=...)``: one tensor-parallel
        engine's workers, which cannot serve without one of them). The same on every
        member (the units are in the join records); members without a unit are excluded
        alone."""
        out = set(missing)
        units = {self.infos[p].get("unit") for p in out} - {None}
        out |= {p for p, info in enumerate(self.infos) if info.get("unit") in units}
        return sorted(out)

    def all_gone(self, positions: Iterable[int]) -> bool:
        """Whether every process at ``positions`` is known not to come (``gone``): in any
        world, a process on this host that no longer runs; in an elastic one, also a
        member that asked to leave."""
        leaving = [r for r in self.requests() if r["kind"] == "leave"]
        return all(gone(self.infos[p], leaving) for p in positions)

    def epoch_record(self, epoch: int, admitted: list[str], consumed: Iterable[str]
                     ) -> dict[str, Any]:
        return {"epoch": epoch, "members": list(self.members), "admitted": admitted,
                "consumed": sorted(consumed)}

    def publish(self, key: str, kind: str, body: Any, numbered: bool = False) -> None:
        """Write ``body`` signed with the world's token (not bound to an epoch: a process
        not admitted yet reads and writes these) at ``xreshard/<world_id>/<key>``; or, with
        ``numbered``, as the next entry of a sequence there (``<key>/<n>``, n = 1, 2, ...;
        readers wait for the next key instead of polling: ``read_entry``)."""
        store = self._world._store
        assert self.elastic and store is not None
        full = f"{KEY_ROOT}/{self.world_id}/{key}"
        if numbered:
            full = f"{full}/{int(store.add(f'{full}/count', 1))}"
        store.set(full, self.base.seal(kind, 0, -1, json.dumps(body)))

    def published(self, key: str, kind: str) -> Any:
        """What ``publish`` wrote at ``key``, or None (nothing there, or not signed with
        this world's token)."""
        store = self._world._store
        if not self.elastic or store is None:
            return None
        return read_entry(store, self.base, f"{KEY_ROOT}/{self.world_id}/{key}", kind)

    def current_members(self) -> list[str]:
        """The labels of the running world's members, from its epoch record (readable by
        a process not admitted yet)."""
        store = self._world._store
        if not self.elastic or store is None:
            return list(self.members)
        record = read_epoch(store, self.base)
        return list(record["members"]) if record else list(self.members)

    # ------------------------------------------------------------------ changes

    def admit(self) -> None:
        """Ask to join the running world and wait until the members admit this process at
        their next refit call (``World.join(..., elastic=True, wait=False)``); then this
        world is the members' next epoch. Does nothing when admitted already.

        Raises:
            TransportTimeout: no member refit admitted it within the world's timeout (the
                request is withdrawn: no member waits for it); the world is then broken.
            RefitError: the members refused it (a member runs with its group and index).
        """
        me, world = self.joining, self._world
        if me is None:
            return
        where = f"{label(me)} joining world {self.world_id!r} at {world.address}"
        deadline = time.monotonic() + world.timeout
        try:
            joined, record = ask_and_form(world._store, self.base, me, self.groups, deadline,
                                          world.timeout, where, world.address)
            infos, position = numbered(joined.members, self.groups, self.world_id,
                                       (me["group"], me["index"]))
        except Exception as e:      # noqa: BLE001 - no way back into this world
            world.mark_broken(f"admission failed: {type(e).__name__}: {e}")
            raise
        self.joining, self.epoch = None, int(record["epoch"])
        self.consumed = set(record.get("consumed", ()))
        world._enter_epoch(joined, member_nonce(joined), infos, position)
        logger.debug("admitted %r at epoch %d", world, self.epoch)

    def leave(self) -> None:
        """Leave an elastic world cleanly: ask out (signed), then close. The members
        exclude this process at their next collective without waiting for it. A call
        running in another thread finishes first (within the timeout, as ``close``), so
        the members never lose this process in the middle of a call it is still making.
        A second call does nothing.

        Raises:
            RefitError: the world is not elastic (close it; its members cannot go on).
        """
        world = self._world
        if not self.elastic:
            raise RefitError(f"world {self.world_id!r} is not elastic: leave() is for "
                             f"World.join(..., elastic=True); close() a fixed world")
        held = world._lock.acquire(timeout=world.timeout + 5.0)
        try:
            if world._store is not None and not world.closed and self.admitted:
                request(world._store, self.base, "leave", self.own_info())
            world.close()
        finally:
            if held:
                world._lock.release()

    def confirm_joins(self, joins: Iterable[Request], lost: Iterable[int] = (),
                      deadline: float | None = None) -> list[Request]:
        """The join requests among ``joins`` whose processes confirmed that they are still
        there (:mod:`xreshard.runtime.admission`), in log order. Collective among the
        survivors: every one passes the same ``joins`` and ``lost`` (e.g. from one settled
        all-gather) and gets the same answer. A request under a survivor's label, or
        superseded by a later one for its label, is refused (its process raises
        ``RefitError``); one whose process gave up, died or waits no more is dropped.
        Every request passed is acted on once: none of them is offered again.

        Args:
            joins: the requests the survivors saw (leave requests are ignored).
            lost: positions of the members leaving in this change (their labels are free).
            deadline: when the call's wait ends; the grace for confirmations is at most
                half of what is left (default: the world's timeout).
        """
        from . import admission
        world, store = self._world, self._world._store
        assert self.elastic and store is not None
        round_id = f"{self.epoch}.{world._num_ops}"
        joins = list(dict((r["id"], r) for r in joins if r["kind"] == "join").values())
        if self.round is not None and self.round[0] == round_id:    # decided in this round
            confirmed_ids = self.round[1]
            return [r for r in joins if r["id"] in confirmed_ids]
        lost = set(lost)
        names = {label(info) for p, info in enumerate(self.infos) if p not in lost}
        last = {r.label: r["id"] for r in joins}       # a later request supersedes
        candidates = []
        for r in joins:
            why = (f"{r.label} is a member of world {self.world_id!r} already (give each "
                   f"process of a group its own index, or stop the other one first)"
                   if r.label in names else
                   f"another process asked to join as {r.label} after this one"
                   if last[r.label] != r["id"] else None)
            if why is not None:
                admission.offer(store, self.base, r["id"], round_id, self.epoch + 1,
                                refused=why)
            elif admission.withdrawn(store, self.base, r["id"]):
                admission.verdict(store, self.base, r["id"], round_id, "withdrawn")
                candidates.append(r)
            elif gone(r["info"], ()):
                admission.verdict(store, self.base, r["id"], round_id, "expired", "gone")
                candidates.append(r)
            else:
                admission.offer(store, self.base, r["id"], round_id, self.epoch + 1)
                candidates.append(r)
        left = world.timeout if deadline is None else deadline - time.monotonic()
        said = admission.Verdicts(store, self.base, round_id).collect(
            [r["id"] for r in candidates],
            time.monotonic() + min(admission.CONFIRM_GRACE, max(left, 0.0) / 2))
        confirmed = [r for r in candidates if said[r["id"]] == "confirmed"]
        self.round = (round_id, {r["id"] for r in confirmed})
        self.consumed |= {r["id"] for r in joins} - self.round[1]
        if len(confirmed) < len(joins):
            logger.info("world %r: join request(s) not admitted: %s", self.world_id,
                        ", ".join(f"{r.label} ({said.get(r['id'], 'refused')})"
                                  for r in joins if r not in confirmed))
        return confirmed

    def advance(self, lost: Iterable[int], joins: Iterable[Request], deadline: float,
                renew: bool = False) -> bool:
        """Move every survivor to the next epoch: without the members at positions
        ``lost``, with the processes of ``joins`` that confirm (``confirm_joins``).
        Collective among the survivors (every one passes the same ``lost`` and ``joins``,
        e.g. from one settled all-gather); the joining processes wait in ``World.join``
        for it. Returns False, moving nothing, when nobody is lost and no join confirmed,
        unless ``renew``: then the same members form the next epoch, with transports
        made anew (after a call that failed while moving: see ``fleet.after_loss``).

        Raises:
            TransportTimeout: a survivor or a joining process did not form the epoch by
                ``deadline`` (the world is then broken).
        """
        from .joining import retire
        world, store = self._world, self._world._store
        assert self.elastic and store is not None
        lost = set(lost)
        joins = self.confirm_joins(joins, lost, deadline)
        if not lost and not joins and not renew:
            return False
        survivors = [p for p in range(len(self.infos)) if p not in lost]
        stay = [self.infos[p] for p in survivors] + [r["info"] for r in joins]
        # every leave request but a survivor's (who asked out since the check) is acted on:
        # the lost's, strays', replays', and a rejoining process's own earlier one (it
        # would otherwise count against it as a member: ``gone``)
        leaving = [r for r in self.requests() if r["kind"] == "leave" and not any(
            same_process(r["info"], self.infos[p]) for p in survivors)]
        epoch = self.epoch + 1
        consumed = self.consumed | {r["id"] for r in joins} | {r["id"] for r in leaving}
        labels = [label(info) for info in stay]
        me = self.own_info()
        if survivors[0] == self.process_index:
            publish_epoch(store, self.base, {
                "epoch": epoch, "members": labels, "consumed": sorted(consumed),
                "admitted": [r["id"] for r in joins]})
        logger.info("world %r: epoch %d -> %d: members %s (lost %s, joining %s)",
                    self.world_id, self.epoch, epoch, labels,
                    [label(self.infos[p]) for p in sorted(lost)], [r.label for r in joins])
        world.transports.park()     # gloo links the change does not touch are kept
        try:
            joined = join_records(store, Seal(self.base.token, epoch_world_id(
                self.world_id, epoch)), me, {"num_processes": len(labels),
                                             "groups": self.groups},
                len(labels), deadline, world.address)
        except Exception as e:      # noqa: BLE001 - the world cannot go on
            world.mark_broken(f"forming epoch {epoch} failed: {type(e).__name__}: {e}")
            raise
        if world._joined is not None:
            retire(store, world._joined)
        self.epoch, self.consumed = epoch, consumed
        infos, position = numbered(joined.members, self.groups, self.world_id,
                                   (me["group"], me["index"]))
        world._enter_epoch(joined, member_nonce(joined), infos, position)
        return True


# ---------------------------------------------------------------------- joining

def join_world(cls: type[World], address: str, group: str, devices: Sequence[Any] | int, *,
               num_processes: int, index: int | None, groups: Sequence[str] | None,
               host: str | None, timeout: float, world_id: str, is_server: bool,
               token: str | bytes | None, elastic: bool, wait: bool, unit: str | None,
               tuning: Tuning | None) -> World:
    """``World.join`` (its docstring says what each argument does)."""
    from .store import StoreServer, connect, parse_address, token_from
    from .world_transports import device_kind
    if tuning is not None and not isinstance(tuning, Tuning):
        raise RefitError(f"tuning must be a Tuning, got {type(tuning).__name__}")
    tuning = tuning or Tuning.from_env()
    seal = Seal(token_from(token), world_id)
    groups, local_devices, index = join_arguments(
        address, seal, group, devices, num_processes, groups, index, is_server)
    deadline = time.monotonic() + timeout
    server = None
    if is_server:
        host_name, port = parse_address(address)
        server = StoreServer(host_name, port, timeout=timeout)
        store, address = server.store, server.address
    else:
        store = connect(address, timeout)

    me = {"group": group, "index": int(index), "host": host or socket.gethostname(),
          "node": own_node(), "pid": os.getpid(), "start": own_start(),
          "num_ranks": len(local_devices), "devices": [str(d) for d in local_devices],
          "device_kinds": [device_kind(d) for d in local_devices]}
    expect = {"num_processes": num_processes, "groups": groups}
    common = {"store": store, "server": server, "address": address, "timeout": timeout,
              "world_id": world_id, "devices": local_devices, "groups": groups,
              "elastic": elastic, "tuning": tuning}
    if elastic:
        me.update({} if unit is None else {"unit": unit})
        running = read_epoch(store, seal)
        if running is not None:
            return _join_running(cls, seal, me, deadline, running, wait, common)
    try:
        joined = join_records(store, seal, me, expect, num_processes, deadline, address)
        infos, position = numbered(joined.members, groups, world_id, (group, index))
    except BaseException:
        if server is not None:
            server.close()
        raise
    nonce = member_nonce(joined)
    world = cls(infos=infos, process_index=position, seal=seal.with_nonce(nonce),
                joined=joined, instance_seal=seal.with_nonce(joined.instance), **common)
    world._refuse_if_refused()
    if elastic and world.process_index == 0:
        publish_epoch(store, seal, world.membership.epoch_record(0, [], []))
    logger.debug("joined %r", world)
    return world


def _join_running(cls: type[World], seal: Seal, me: dict[str, Any], deadline: float,
                  running: dict[str, Any], wait: bool, common: dict[str, Any]) -> World:
    """``join`` of an elastic world that already runs: ask to join, wait for the epoch
    that admits this process, form it with the members. With ``wait=False``: a world not
    admitted yet (this process alone, its ranks from 0), which asks to join at ``admit()``
    (its first refit call); meanwhile ``Refit.catch_up`` may fill its destinations from
    the members' replicas."""
    if not wait:
        world = cls(infos=[dict(me, ranks=list(range(me["num_ranks"])))], process_index=0,
                    seal=seal, epoch=int(running["epoch"]),
                    consumed=running.get("consumed", ()), **common)
        world.membership.joining = me
        logger.debug("joined %r, not admitted yet", world)
        return world
    store, address, groups = common["store"], common["address"], common["groups"]
    where = f"{label(me)} joining world {seal.world_id!r} at {address}"
    joined, record = ask_and_form(store, seal, me, groups, deadline, common["timeout"],
                                  where, address)
    infos, position = numbered(joined.members, groups, seal.world_id,
                               (me["group"], me["index"]))
    world = cls(infos=infos, process_index=position, seal=seal, joined=joined,
                epoch=int(record["epoch"]), consumed=record.get("consumed", ()), **common)
    world._enter_epoch(joined, member_nonce(joined), infos, position)
    logger.debug("joined %r at epoch %d", world, world.epoch)
    return world
