"""Membership epochs of an elastic world (``World.join(..., elastic=True)``).

Decision record. A fleet's engines come and go between and during refits; a fixed world
marks itself broken at the first dead member and everyone must rendezvous again. An
elastic world instead numbers its member sets: epoch 0 is the world as it formed, and each
change (members that left or died, processes that asked to join) makes the next epoch.

- **One epoch = one join instance.** Epoch ``e > 0`` is formed exactly like a world: its
  members append signed join records under world id ``<world_id>~e<e>`` and wait for all
  of them (:func:`xreshard.runtime.joining.join_records`), so everything the join already
  guarantees (instance nonces, tokens, refusals) holds for every epoch, and the metadata of
  an epoch is sealed with its own nonce and epoch number: a payload from another epoch is
  refused as ``CollectiveMismatch`` (``Seal.open``). Ranks are renumbered per epoch by
  the usual rule (group order, then index), so a rejoining ``rollout[1]`` gets back the
  ranks it had; a :class:`~xreshard.runtime.binding.Bound` built by hand must be rebuilt
  from ``world.group_ranks`` when ``world.epoch`` moved (the adapters do it themselves).
- **Requests, not side doors.** A process that wants in (a new engine, a restarted one)
  or out (``world.leave()``) appends a signed request to ``<world_id>/requests``; members
  only act on requests at a collective they agree on (a refit's ``refit/check``, or the
  outcome of a call that lost a member), so every member moves to the same next epoch
  with the same members. The leader of the change (the lowest surviving position) then
  publishes the epoch record, signed, which the joining processes wait for.
- **Dead or gone, decided together.** Partial collectives stop waiting for a member that
  left (its request is in the log) or whose process is gone (same host: its pid and
  start time no longer run); which members arrived is then settled once for everyone
  (``waiting.settled``). A member on another host that stops answering is found at the
  collective's timeout instead.
- **Units fall together.** A process may join with a ``unit`` (``World.join(unit=...)``):
  the workers of one tensor-parallel engine, which cannot serve without any of them.
  Whenever members are lost (a partial collective settled without them), every member of
  their units is excluded with them (``ElasticWorld.excluded``), decided from the join
  records alone, so every survivor excludes the same; a unit-mate that arrived learns it
  is excluded from the same settled list and raises ``WorldBroken`` without forming the
  next epoch. Processes without a unit (the plain elastic worlds) are excluded alone.
- Rejected: renumbering ranks only for the new processes (stable ranks) - every
  transport keyed on dense ranks (gloo groups, NCCL communicators) would need a renumbering
  layer, and a restarted engine would come back under other ranks than its layouts name;
  a coordinator process (the store is already the one thing every member reaches).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import time
from typing import Any, Iterable

from ..errors import RefitError
from ..transport import peers
from .joining import KEY_ROOT, label
from .store import Seal

__all__ = ["ElasticWorld", "Membership", "Request", "epoch_world_id", "gone", "own_start",
           "publish_epoch", "read_entry", "read_epoch", "read_requests", "request",
           "same_process"]

logger = logging.getLogger("xreshard.runtime.world")


def epoch_world_id(world_id: str, epoch: int) -> str:
    """The join instance id of ``epoch`` (epoch 0 is the world's own id)."""
    return world_id if epoch == 0 else f"{world_id}~e{epoch}"


def _requests_key(world_id: str) -> str:
    return f"{KEY_ROOT}/{world_id}/requests"


def _epoch_key(world_id: str) -> str:
    return f"{KEY_ROOT}/{world_id}/epoch"


class Request(dict):
    """A request read from the log: ``kind`` ("join" / "leave"), ``id``, ``info`` (the
    process's join info: group, index, host, pid, start, ...)."""

    @property
    def label(self) -> str:
        return label(self["info"])


def request(store: Any, seal: Seal, kind: str, info: dict[str, Any]) -> str:
    """Append a signed ``kind`` request for the process ``info``; returns its id."""
    rid = secrets.token_hex(8)
    body = json.dumps({"kind": kind, "id": rid, "info": info})
    store.append(_requests_key(seal.world_id), seal.seal(f"member/{kind}", 0, -1, body) + "\n")
    return rid


def read_requests(store: Any, seal: Seal, consumed: Iterable[str] = ()) -> list[Request]:
    """The requests in the log not yet ``consumed``, in append order; lines that do not
    open with this world's token are skipped (an outsider cannot ask in or throw out)."""
    key = _requests_key(seal.world_id)
    if not store.check([key]):
        return []
    done = set(consumed)
    out = []
    for line in store.get(key).decode().splitlines():
        try:
            env = json.loads(line)
            kind = env.get("kind", "")
            value = seal.open(line, key=key, kind=kind, op=0, process=-1)
            if kind not in ("member/join", "member/leave") or value.get("id") in done:
                continue
            done.add(value.get("id"))       # a line appended twice (a replay) counts once
            out.append(Request(value))
        except Exception:       # noqa: BLE001 - garbage or another token's: not a request
            logger.debug("skipped a request line at %s", key, exc_info=True)
    return out


def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two join infos name one process (label, host, pid and start time): a leave
    request counts only for the very process that sent it, not for a later process with
    its label (a restart) or a reused pid."""
    return label(a) == label(b) and all(a.get(k) == b.get(k) for k in ("host", "pid", "start"))


def gone(info: dict[str, Any], leaving: Iterable[Request]) -> bool:
    """Whether the member ``info`` is known not to come: it asked to leave, or it ran on
    this machine, in this pid namespace (its ``node`` is ours: :func:`own_node`, whatever
    ``host`` it declared for the topology), and its process (pid and start time) no longer
    runs. A member elsewhere, or one that published no node, is never declared gone here:
    only its timeout tells."""
    for r in leaving:
        if r["kind"] == "leave" and same_process(r["info"], info):
            return True
    start, node = info.get("start"), info.get("node")
    if node is None or node != own_node() or not isinstance(start, str):
        return False
    return not peers.alive(int(info["pid"]), start)


def own_node() -> str | None:
    """Where this process's pids mean what they say, as members publish it (``node``): the
    host name, the kernel's boot id and the pid namespace. Two processes with one node see
    each other's ``/proc/<pid>``; pods sharing a host's name and network (``hostNetwork``)
    but not its pid namespace differ. None where ``/proc`` is not this namespace's (its
    entry for our pid is another process): then no pid here can be trusted. Read once per
    process (``gone`` asks it in every wait slice of a partial collective)."""
    return _node(os.getpid())


@functools.lru_cache(maxsize=4)
def _node(pid: int) -> str | None:
    """:func:`own_node` of the process ``pid`` (this one: a fork reads it again)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if peers.process_start_time(os.getpid()) != peers.own_start_time():
        return None
    return f"{socket.gethostname()}|{boot}|{namespace}"


def publish_epoch(store: Any, seal: Seal, record: dict[str, Any]) -> None:
    """The leader of a change publishes the next epoch (``epoch``, ``members``: labels,
    ``admitted``: request ids of the joining processes, ``consumed``: every request id
    acted on so far)."""
    store.set(_epoch_key(seal.world_id), seal.seal("member/epoch", 0, -1, json.dumps(record)))


def read_epoch(store: Any, seal: Seal) -> dict[str, Any] | None:
    """The current epoch record of a running elastic world, or None (none formed yet)."""
    key = _epoch_key(seal.world_id)
    if not store.check([key]):
        return None
    return seal.open(store.get(key), key=key, kind="member/epoch", op=0, process=-1)


def read_entry(store: Any, seal: Seal, key: str, kind: str) -> Any:
    """The signed value at ``key`` (see ``World.publish``), or None (none there, or not
    signed with the world's token: an outsider's is skipped)."""
    try:
        if not store.check([key]):
            return None
        return seal.open(store.get(key), key=key, kind=kind, op=0, process=-1)
    except Exception:       # noqa: BLE001 - not signed with this world's token
        logger.debug("skipped the entry at %s", key, exc_info=True)
        return None


def own_start() -> str | None:
    """This process's start time, published so that members on its host can tell its
    death from slowness (``gone``)."""
    return peers.own_start_time()


class Membership:
    """What an elastic world keeps of its membership: the base seal (requests and epoch
    records are sealed with the token and the world id alone, so a process that is not a
    member yet can write and read them), the group order, the epoch, and the ids of the
    requests acted on."""

    def __init__(self, seal: Seal, groups: Any, epoch: int, consumed: Iterable[str] = ()):
        self.base = Seal(seal.token, seal.world_id)
        self.groups = groups
        self.epoch = epoch
        self.consumed = set(consumed)
        #: a process that joined with ``wait=False``: its join info until it is admitted
        self.pending: dict[str, Any] | None = None
        #: the last admission round (its id, the request ids confirmed in it)
        self.round: tuple[str, set[str]] | None = None


class ElasticWorld:
    """The membership half of ``World`` (a mixin, like ``WorldTransports``)."""

    @property
    def epoch(self) -> int:
        """The membership epoch: 0 as the world formed, +1 at each change of members."""
        return 0 if self._elastic is None else self._elastic.epoch

    @property
    def elastic(self) -> bool:
        """Whether this world's members may change (``World.join(elastic=True)``)."""
        return self._elastic is not None

    @property
    def members(self) -> tuple[str, ...]:
        """The members' labels (``"rollout[1]"``) in process order, this epoch."""
        return tuple(label(info) for info in self._infos)

    @property
    def admitted(self) -> bool:
        """False while a process that joined a running world with ``wait=False`` has not
        been admitted (its first refit call, or ``admit()``, admits it)."""
        return self._elastic is None or self._elastic.pending is None

    @property
    def local_devices(self) -> tuple[Any, ...]:
        """This process's devices, as given to ``World.join``."""
        return self._devices

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def membership(self) -> Membership | None:
        """The membership record of an elastic world (None: a fixed world)."""
        return self._elastic

    def admit(self) -> None:
        """Ask to join the running world and wait until the members admit this process at
        their next refit call (``World.join(..., elastic=True, wait=False)``); then this
        world is the members' next epoch. Does nothing when admitted already.

        Raises:
            TransportTimeout: no member refit admitted it within the world's timeout (the
                request is withdrawn: no member waits for it); the world is then broken.
            RefitError: the members refused it (a member runs with its group and index).
        """
        m = self._elastic
        if m is None or m.pending is None:
            return
        from .joining import member_nonce, numbered
        me = m.pending
        where = f"{label(me)} joining world {self._world_id!r} at {self._address}"
        deadline = time.monotonic() + self._timeout
        try:
            joined, record = _ask_and_form(self._store, m.base, me, m.groups, deadline,
                                           self._timeout, where, self._address)
            infos, position = numbered(joined.members, m.groups, self._world_id,
                                       (me["group"], me["index"]))
        except Exception as e:      # noqa: BLE001 - no way back into this world
            self.mark_broken(f"admission failed: {type(e).__name__}: {e}")
            raise
        m.pending, m.epoch, m.consumed = None, int(record["epoch"]), set(record.get("consumed", ()))
        self._enter_epoch(joined, member_nonce(joined), infos, position)
        logger.debug("admitted %r at epoch %d", self, m.epoch)

    def publish(self, key: str, kind: str, body: Any, numbered: bool = False) -> None:
        """Write ``body`` signed with the world's token (not bound to an epoch: a process
        not admitted yet reads and writes these) at ``xreshard/<world_id>/<key>``; or, with
        ``numbered``, as the next entry of a sequence there (``<key>/<n>``, n = 1, 2, ...;
        readers wait for the next key instead of polling: ``read_entry``)."""
        m = self._elastic
        assert m is not None and self._store is not None
        full = f"{KEY_ROOT}/{self._world_id}/{key}"
        if numbered:
            full = f"{full}/{int(self._store.add(f'{full}/count', 1))}"
        self._store.set(full, m.base.seal(kind, 0, -1, json.dumps(body)))

    def published(self, key: str, kind: str) -> Any:
        """What ``publish`` wrote at ``key``, or None (nothing there, or not signed with
        this world's token)."""
        m, store = self._elastic, self._store
        if m is None or store is None:
            return None
        return read_entry(store, m.base, f"{KEY_ROOT}/{self._world_id}/{key}", kind)

    def current_members(self) -> list[str]:
        """The labels of the running world's members, from its epoch record (readable by
        a process not admitted yet)."""
        m = self._elastic
        if m is None or self._store is None:
            return list(self.members)
        record = read_epoch(self._store, m.base)
        return list(record["members"]) if record else list(self.members)

    def leave(self) -> None:
        """Leave an elastic world cleanly: ask out (signed), then close. The members
        exclude this process at their next collective without waiting for it. A call
        running in another thread finishes first (within the timeout, as ``close``), so
        the members never lose this process in the middle of a call it is still making.
        A second call does nothing.

        Raises:
            RefitError: the world is not elastic (close it; its members cannot go on).
        """
        if self._elastic is None:
            raise RefitError(f"world {self._world_id!r} is not elastic: leave() is for "
                             f"World.join(..., elastic=True); close() a fixed world")
        held = self._lock.acquire(timeout=self._timeout + 5.0)
        try:
            if self._store is not None and not self._closed and self.admitted:
                info = {k: v for k, v in self._infos[self._process_index].items()
                        if k != "ranks"}
                request(self._store, self._elastic.base, "leave", info)
            self.close()
        finally:
            if held:
                self._lock.release()

    def pending(self) -> list[Request]:
        """Join and leave requests no epoch has acted on yet (one store read)."""
        if self._elastic is None or self._store is None:
            return []
        return read_requests(self._store, self._elastic.base, self._elastic.consumed)

    def excluded(self, missing: Iterable[int]) -> list[int]:
        """The positions a change excludes when the members at ``missing`` are lost: those,
        and every member of their units (``World.join(unit=...)``: one tensor-parallel
        engine's workers, which cannot serve without one of them). The same on every
        member (the units are in the join records); members without a unit are excluded
        alone."""
        out = set(missing)
        units = {self._infos[p].get("unit") for p in out} - {None}
        out |= {p for p, info in enumerate(self._infos) if info.get("unit") in units}
        return sorted(out)

    def _all_gone(self, positions: Iterable[int]) -> bool:
        """Whether every process at ``positions`` is known not to come (``gone``): in any
        world, a process on this host that no longer runs; in an elastic one, also a
        member that asked to leave."""
        leaving = [] if self._elastic is None else [r for r in self.pending()
                                                     if r["kind"] == "leave"]
        return all(gone(self._infos[p], leaving) for p in positions)

    def _epoch_record(self, epoch: int, admitted: list[str], consumed: Iterable[str]
                      ) -> dict[str, Any]:
        return {"epoch": epoch, "members": list(self.members), "admitted": admitted,
                "consumed": sorted(consumed)}

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
        m, store = self._elastic, self._store
        assert m is not None and store is not None
        round_id = f"{m.epoch}.{self._num_ops}"
        joins = list(dict((r["id"], r) for r in joins if r["kind"] == "join").values())
        if m.round is not None and m.round[0] == round_id:      # decided in this round
            return [r for r in joins if r["id"] in m.round[1]]
        lost = set(lost)
        names = {label(info) for p, info in enumerate(self._infos) if p not in lost}
        last = {r.label: r["id"] for r in joins}       # a later request supersedes
        candidates = []
        for r in joins:
            why = (f"{r.label} is a member of world {self._world_id!r} already (give each "
                   f"process of a group its own index, or stop the other one first)"
                   if r.label in names else
                   f"another process asked to join as {r.label} after this one"
                   if last[r.label] != r["id"] else None)
            if why is not None:
                admission.offer(store, m.base, r["id"], round_id, m.epoch + 1, refused=why)
            elif admission.withdrawn(store, m.base, r["id"]):
                admission.verdict(store, m.base, r["id"], round_id, "withdrawn")
                candidates.append(r)
            elif gone(r["info"], ()):
                admission.verdict(store, m.base, r["id"], round_id, "expired", "gone")
                candidates.append(r)
            else:
                admission.offer(store, m.base, r["id"], round_id, m.epoch + 1)
                candidates.append(r)
        left = (self._timeout if deadline is None else deadline - time.monotonic())
        said = admission.Verdicts(store, m.base, round_id).collect(
            [r["id"] for r in candidates],
            time.monotonic() + min(admission.CONFIRM_GRACE, max(left, 0.0) / 2))
        confirmed = [r for r in candidates if said[r["id"]] == "confirmed"]
        m.round = (round_id, {r["id"] for r in confirmed})
        m.consumed |= {r["id"] for r in joins} - m.round[1]
        if len(confirmed) < len(joins):
            logger.info("world %r: join request(s) not admitted: %s", self._world_id,
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
        from .joining import join_records, member_nonce, numbered, retire
        m = self._elastic
        assert m is not None
        lost = set(lost)
        joins = self.confirm_joins(joins, lost, deadline)
        if not lost and not joins and not renew:
            return False
        survivors = [p for p in range(len(self._infos)) if p not in lost]
        stay = [self._infos[p] for p in survivors] + [r["info"] for r in joins]
        # every leave request but a survivor's (who asked out since the check) is acted on:
        # the lost's, strays', replays', and a rejoining process's own earlier one (it
        # would otherwise count against it as a member: ``gone``)
        leaving = [r for r in self.pending() if r["kind"] == "leave" and not any(
            same_process(r["info"], self._infos[p]) for p in survivors)]
        epoch = m.epoch + 1
        consumed = m.consumed | {r["id"] for r in joins} | {r["id"] for r in leaving}
        labels = [label(info) for info in stay]
        me = {k: v for k, v in self._infos[self._process_index].items() if k != "ranks"}
        if survivors[0] == self._process_index:
            publish_epoch(self._store, m.base, {
                "epoch": epoch, "members": labels, "consumed": sorted(consumed),
                "admitted": [r["id"] for r in joins]})
        logger.info("world %r: epoch %d -> %d: members %s (lost %s, joining %s)",
                    self._world_id, m.epoch, epoch, labels,
                    [label(self._infos[p]) for p in sorted(lost)], [r.label for r in joins])
        self._park_transports()     # gloo links the change does not touch are kept
        try:
            joined = join_records(self._store, Seal(m.base.token, epoch_world_id(
                self._world_id, epoch)), me, {"num_processes": len(labels),
                                              "groups": m.groups},
                len(labels), deadline, self._address)
        except Exception as e:      # noqa: BLE001 - the world cannot go on
            self.mark_broken(f"forming epoch {epoch} failed: {type(e).__name__}: {e}")
            raise
        if self._joined is not None:
            retire(self._store, self._joined)
        m.epoch, m.consumed = epoch, consumed
        infos, position = numbered(joined.members, m.groups, self._world_id,
                                   (me["group"], me["index"]))
        self._enter_epoch(joined, member_nonce(joined), infos, position)
        return True

    def _enter_epoch(self, joined: Any, nonce: str, infos: list[dict[str, Any]],
                     position: int) -> None:
        m = self._elastic
        wid = epoch_world_id(self._world_id, m.epoch)
        self._seal = m.base.at_epoch(m.epoch, nonce)
        self._joined = joined
        self._instance_seal = Seal(m.base.token, wid).with_nonce(joined.instance)
        self._refusal_until = time.monotonic() + self._timeout
        self._root = f"{KEY_ROOT}/{wid}"
        self._num_ops = 0
        self._broken = None
        self._set_members(infos, position)

    @classmethod
    def _join_running(cls, store: Any, server: Any, address: str, seal: Seal,
                      me: dict[str, Any], groups: Any, devices: Any, deadline: float,
                      timeout: float, running: dict[str, Any], wait: bool = True) -> Any:
        """``World.join`` of an elastic world that already runs: ask to join, wait for
        the epoch that admits this process, form it with the members. With ``wait=False``:
        a world not admitted yet (this process alone, its ranks from 0), which asks to
        join at ``admit()`` (its first refit call); meanwhile ``Refit.catch_up`` may fill
        its destinations from the members' replicas."""
        from .joining import member_nonce, numbered
        if not wait:
            membership = Membership(seal, groups, int(running["epoch"]),
                                    running.get("consumed", ()))
            membership.pending = me
            world = cls(store=store, server=server, address=address,
                        world_id=seal.world_id, timeout=timeout,
                        infos=[dict(me, ranks=list(range(me["num_ranks"])))],
                        process_index=0, devices=devices, seal=seal, elastic=membership)
            logger.debug("joined %r, not admitted yet", world)
            return world
        where = f"{label(me)} joining world {seal.world_id!r} at {address}"
        joined, record = _ask_and_form(store, seal, me, groups, deadline, timeout, where,
                                       address)
        epoch = int(record["epoch"])
        infos, position = numbered(joined.members, groups, seal.world_id,
                                   (me["group"], me["index"]))
        world = cls(store=store, server=server, address=address, world_id=seal.world_id,
                    timeout=timeout, infos=infos, process_index=position, devices=devices,
                    seal=seal, joined=joined,
                    elastic=Membership(seal, groups, epoch, record.get("consumed", ())))
        world._enter_epoch(joined, member_nonce(joined), infos, position)
        logger.debug("joined %r at epoch %d", world, epoch)
        return world


def _ask_and_form(store: Any, seal: Seal, me: dict[str, Any], groups: Any, deadline: float,
                  timeout: float, where: str, address: str) -> tuple[Any, dict[str, Any]]:
    """A joining process: ask in (``admission.ask_in``), then form the epoch that admits
    it with the members. Returns the join and the epoch record."""
    from .admission import ask_in
    from .joining import join_records
    record, deadline = ask_in(store, seal, me, deadline, timeout, where,
                              lambda: request(store, seal, "join", me),
                              lambda: read_epoch(store, seal))
    epoch, n = int(record["epoch"]), len(record["members"])
    joined = join_records(store, Seal(seal.token, epoch_world_id(seal.world_id, epoch)), me,
                          {"num_processes": n, "groups": groups}, n, deadline, address)
    return joined, record
