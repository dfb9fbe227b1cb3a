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
  their units is excluded with them (``Membership.excluded``), decided from the join
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
from typing import Any, Iterable

from ..transport import peers
from .joining import KEY_ROOT, label
from .store import Seal

__all__ = ["Request", "ask_and_form", "epoch_world_id", "gone", "own_start", "publish_epoch",
           "read_entry", "read_epoch", "read_requests", "request", "same_process"]

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


def ask_and_form(store: Any, seal: Seal, me: dict[str, Any], groups: Any, deadline: float,
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
