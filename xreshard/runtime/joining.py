"""Joining a world: its instance nonce, the signed join records, and what a join refuses.

Decision record. A world is the first ``num_processes`` valid join records appended to one
key of the store, in append order (the same order for every reader), so nothing an
outsider appends can take a member's slot. What "valid" means, and why:

- **Bound to one instance of the world.** The first joiner of a world draws its instance
  nonce and publishes it once, with ``compare_set`` (first writer wins, every reader gets
  the winner), at ``xreshard/<world_id>/instance/<key id>``: sealed with the token and
  bound to the nonce that the store's starter wrote (``store.STORE_NONCE_KEY``). Every join
  record carries the instance and is sealed with it, so a record of another instance (an
  earlier world with this ``world_id`` and token on this store, a record copied from an
  old store) never opens: it is refused by name and takes no slot. ``retire`` (called by
  ``World.close``) blanks the instance, so the next world with this id draws a new one.
  The key is per token (``Seal.key_id``): a process with a wrong token draws an instance
  of its own instead of blocking the members' (or being blocked by theirs).
- **Refused early.** A process that cannot open ``num_processes`` records of others (its
  token differs from the members') is refused at once, not at its timeout. Processes whose
  records disagree on ``num_processes`` or ``groups`` all raise ``WorldMismatch`` with one
  message: the first to see the disagreement publishes it (``compare_set``, signed) at
  ``xreshard/<world_id>/refused/<instance>``, and members that formed a world before the
  disagreeing record arrived read it at their next collective, for one join timeout
  (``refusal``). A process that raises it from a step others may already wait in (its
  join's end, a collective) first writes its payload of that step as a wake-up, so
  nobody waits for its timeout to learn it.

Rejected: a slot counter (an outsider's increments take slots); deleting the join key
when a world forms or closes (a process that appended its record but has not read it yet
would wait forever); a store-wide nonce from the server (``serve()`` cannot sign it, the
worlds' tokens are theirs, and an old signed nonce replays as well as an old record).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import (AuthenticationError, CommunicationError, RefitError,
                      TransportError, WorldMismatch, error_from)
from ..transport.base import TransportTimeout
from . import waiting
from .store import Seal, connect, store_nonce

__all__ = ["KEY_ROOT", "Joined", "join_records", "label", "member_nonce", "numbered",
           "join_arguments", "refusal", "refuse_unjoined", "retire"]

logger = logging.getLogger("xreshard.runtime.world")

KEY_ROOT = "xreshard"


def label(info: Mapping[str, Any]) -> str:
    return f"{info['group']}[{info['index']}]"


@dataclass
class Joined:
    """What a join decided: the members' records (append order) and the instance."""
    members: list[dict[str, Any]]
    instance: str                   # the instance nonce
    instance_key: str
    instance_raw: str               # what ``retire`` compares before blanking the key
    refused_key: str
    join_key: str
    refused: Exception | None = None    # raise it once the members are woken


@dataclass
class _Seen:
    """The join records at one read, sorted by what they are to this process."""
    valid: list[dict[str, Any]] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)      # other instances, by name
    foreign: int = 0                # well-formed, but not signed with this token
    foreign_closed: int = 0         # the same, of instances whose world closed
    garbage: list[str] = field(default_factory=list)


def _store_call(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except RuntimeError as e:       # torch's DistStoreError / DistNetworkError derive from it
        raise TransportError(f"the rendezvous store failed while {what}: {e}") from e


def _instance(store: Any, seal: Seal, address: str) -> tuple[str, str, str]:
    """The world's instance nonce (drawing and publishing it if this process is first),
    its key and the raw record there."""
    world_id = seal.world_id
    key = f"{KEY_ROOT}/{world_id}/instance/{seal.key_id()}"
    bound = store_nonce(store)
    draft = seal.seal("instance", 0, -1, json.dumps({"nonce": secrets.token_hex(16),
                                                     "store": bound}))
    raw = _store_call("publishing the world's instance", store.compare_set, key, "", draft)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    where = f"world {world_id!r} at {address}: the instance record at store key {key!r}"
    try:
        body = seal.open(text, key=key, kind="instance", op=0, process=-1)
    except CommunicationError as e:
        raise AuthenticationError(f"{where} is not a member's ({e}); a process without "
                                  f"the token wrote it there first, so this world_id cannot "
                                  f"form on this store: find what writes to the store, and "
                                  f"join with another world_id (or on a new store)") from None
    if not (isinstance(body, dict) and isinstance(body.get("nonce"), str)
            and body.get("store") == bound):
        named = body.get("store") if isinstance(body, dict) else body
        raise AuthenticationError(f"{where} was drawn on another store (it names store "
                                  f"{str(named)[:60]!r}, this store is {bound[:60]!r}): a "
                                  f"replay; refused")
    return body["nonce"], key, text


def _valid_shape(rec: Any) -> bool:
    info = rec.get("info") if isinstance(rec, dict) else None
    return (isinstance(info, dict) and isinstance(info.get("group"), str)
            and isinstance(info.get("index"), int)
            and isinstance(info.get("num_ranks"), int) and info["num_ranks"] >= 0
            and isinstance(info.get("device_kinds"), list)
            and len(info["device_kinds"]) == info["num_ranks"]
            and isinstance(rec.get("nonce"), str) and isinstance(rec.get("expect"), dict))


def _claimed_instance(line: str) -> str | None:
    """The instance a record says it belongs to (unverified), or None."""
    try:
        rec = json.loads(json.loads(line)["body"])
        inst = rec.get("instance")
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return inst if isinstance(inst, str) else None


def _retired(lines: list[str]) -> set[str]:
    """The instances whose world closed (``retire`` appends a line naming each)."""
    out = set()
    for line in lines:
        if not line.startswith('{"retired"'):
            continue
        try:
            value = json.loads(line).get("retired")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, str):
            out.add(value)
    return out


def _read(raw: bytes, key: str, wseal: Seal, instance: str) -> _Seen:
    """Sort the records at ``key`` into valid (this instance, this token), stale (another
    instance of this world: verified under its own nonce, or, signed with another token,
    of an instance whose world closed), foreign and garbage."""
    seen = _Seen()
    lines = raw.decode(errors="replace").splitlines()
    retired = _retired(lines)
    for n, line in enumerate(lines):
        if line.startswith('{"retired"'):
            continue
        try:
            rec = wseal.open(line, key=key, kind="join", op=0, process=-1)
        except (CommunicationError, KeyError, TypeError) as e:
            claimed = _claimed_instance(line)
            if claimed is not None and claimed != instance:
                try:
                    old = wseal.with_nonce(claimed).open(line, key=key, kind="join", op=0,
                                                         process=-1)
                    if _valid_shape(old):
                        seen.stale.append(_describe(old))
                        continue
                except (CommunicationError, KeyError, TypeError):
                    pass
                if claimed in retired and isinstance(e, AuthenticationError):
                    seen.foreign_closed += 1    # another token's closed world: no evidence
                    continue
            if isinstance(e, AuthenticationError):
                seen.foreign += 1
            else:
                seen.garbage.append(f"line {n}: {type(e).__name__}")
            continue
        if not _valid_shape(rec):
            seen.garbage.append(f"line {n}: not a join record")
        elif rec.get("instance") != instance:
            seen.stale.append(_describe(rec))       # unsigned worlds: nothing else tells
        else:
            seen.valid.append(rec)
    return seen


def _describe(rec: Mapping[str, Any]) -> str:
    info = rec["info"]
    inst = rec.get("instance")
    return (f"{label(info)} (pid {info.get('pid')} on {info.get('host')}, instance "
            f"{str(inst)[:8] if inst else 'none'})")


def _expectation(expect: Mapping[str, Any]) -> str:
    groups = expect.get("groups")
    return (f"num_processes={expect.get('num_processes')}"
            + (f", groups={groups}" if groups is not None else ""))


def _disagreement(world_id: str, valid: list[dict[str, Any]]) -> str | None:
    """The message naming who passed what, when the records' expectations differ."""
    by: dict[str, list[str]] = {}
    for rec in valid:
        by.setdefault(json.dumps(rec["expect"], sort_keys=True), []).append(label(rec["info"]))
    if len(by) < 2:
        return None
    parts = [f"{', '.join(names)} passed {_expectation(json.loads(e))}"
             for e, names in sorted(by.items(), key=lambda kv: kv[1])]
    return (f"processes of world {world_id!r} disagree: {'; '.join(parts)}; pass the same "
            f"num_processes (the count of every process of the world, over all groups) and "
            f"groups everywhere")


def _refuse(store: Any, wseal: Seal, refused_key: str, message: str,
            error: str = "WorldMismatch") -> Exception:
    """Publish ``message`` (raised as ``error``, a class name that crosses processes) as
    this world's refusal unless one is there; the refusal to raise (the first published
    one, so every process raises the same words)."""
    draft = wseal.seal("refused", 0, -1, json.dumps({"message": message, "error": error}))
    try:
        raw = store.compare_set(refused_key, "", draft)
        return _refusal_of(wseal.open(raw, key=refused_key, kind="refused", op=0,
                                      process=-1)) or error_from(error, message)
    except (RuntimeError, CommunicationError):
        return error_from(error, message)   # an outsider's marker is never raised; ours stands


def _refusal_of(body: Any) -> Exception | None:
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str):
        return None
    error = body.get("error", "WorldMismatch")
    return error_from(error if isinstance(error, str) else "WorldMismatch", message)


def refusal(store: Any, wseal: Seal, refused_key: str) -> Exception | None:
    """The world's published refusal (``WorldMismatch``, or what a joining process found:
    a member that no longer runs), if a process of the world published one."""
    try:
        if not store.check([refused_key]):
            return None
        body = wseal.open(store.get(refused_key), key=refused_key, kind="refused", op=0,
                          process=-1)
    except (RuntimeError, CommunicationError):
        return None
    return _refusal_of(body)


def _default_index(devices: Any) -> int:
    """The process index within its group when the framework makes it unambiguous."""
    if not isinstance(devices, int) and devices and hasattr(devices[0], "platform"):
        jax = sys.modules.get("jax")
        if jax is not None and jax.process_count() > 1:
            return int(jax.process_index())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    raise RefitError("World.join needs index= (this process's position within its group): "
                     "it is only inferred from a multi-process JAX job (jax.process_index()) "
                     "or an initialized torch.distributed (its rank)")


def _checked(group: str, devices: Sequence[Any] | int, num_processes: int,
             groups: Sequence[str] | None) -> tuple[list[str] | None, list[Any]]:
    """``World.join``'s arguments checked: (groups as a list, the local devices). Warms
    the adapters too (``registry.warm``: their imports, seconds on a loaded machine), so
    that it happens within the join's wait, not between a first refit's collectives."""
    from . import registry
    registry.warm()
    if not isinstance(group, str) or not group:
        raise RefitError(f"group must be a non-empty string, got {group!r}")
    if num_processes < 1:
        raise RefitError(f"num_processes must be >= 1, got {num_processes}")
    if groups is not None:
        groups = list(groups)
        if group not in groups:
            raise RefitError(f"group {group!r} is not in groups={groups}; "
                             f"add it or pass groups=None for sorted group names")
    if isinstance(devices, int):
        if devices < 0:
            raise RefitError(f"devices must be a device list or a count >= 0, got {devices}")
        return groups, ["cpu"] * devices
    return groups, list(devices)


def join_arguments(address: str, seal: Seal, group: str, devices: Sequence[Any] | int,
                   num_processes: int, groups: Sequence[str] | None, index: int | None,
                   is_server: bool) -> tuple[list[str] | None, list[Any], int]:
    """``World.join``'s arguments checked: (groups as a list, the local devices, the
    index). A process refused here would leave the others waiting for it: the refusal is
    published for them first (``refuse_unjoined``; not by the store's host, whom nobody
    reaches)."""
    try:
        groups, local_devices = _checked(group, devices, num_processes, groups)
        return groups, local_devices, _default_index(local_devices) if index is None else index
    except RefitError as e:
        if is_server or not isinstance(group, str):
            raise
        who = f"{group}[{'?' if index is None else index}] (pid {os.getpid()})"
        raise refuse_unjoined(address, seal, who, e) from None


def refuse_unjoined(address: str, seal: Seal, who: str, problem: Exception) -> WorldMismatch:
    """A process refused by its own arguments (``num_processes=0``, a group not in
    ``groups``, no index) before it joins: publish the refusal for the world's instance,
    so the processes joining it (and members that formed without this one, within their
    join timeout) raise the same ``WorldMismatch`` at once instead of waiting for it; the
    error to raise. The store is tried once, briefly: unreachable, the refusal stays local.
    """
    message = (f"world {seal.world_id!r}: {who} cannot join it: {problem}; every process "
               f"of the world stops here")
    try:
        store = connect(address, 1.0)
        instance, _, _ = _instance(store, seal, address)
    except (CommunicationError, RefitError, RuntimeError):
        return WorldMismatch(message)
    refused = _refuse(store, seal.with_nonce(instance),
                      f"{KEY_ROOT}/{seal.world_id}/refused/{instance}", message)
    return refused if isinstance(refused, WorldMismatch) else WorldMismatch(message)


def retire(store: Any, joined: Joined) -> None:
    """Blank the world's instance if it is still the one this process joined (the first
    member to close does it), so the next world with this id draws a fresh one, and say so
    in the join key: a process with another token then knows that these records (which it
    cannot open) are no evidence against its token. A forged line only makes such a
    process wait for its timeout, as before."""
    try:
        now = store.compare_set(joined.instance_key, joined.instance_raw, "")
        if not now:
            store.append(joined.join_key, json.dumps({"retired": joined.instance}) + "\n")
    except RuntimeError:
        logger.debug("could not retire instance %s", joined.instance_key, exc_info=True)


def join_records(store: Any, seal: Seal, me: dict[str, Any], expect: dict[str, Any],
                 num_processes: int, deadline: float, address: str) -> Joined:
    """Append this process's join record and wait for ``num_processes`` valid ones.

    Raises:
        WorldMismatch: records of this world disagree on ``num_processes`` or ``groups``.
        AuthenticationError: ``num_processes`` records are signed with another token (at
            once), or too few with this one by the deadline; or the instance is forged.
        TransportTimeout: too few processes joined by the deadline.
        RefitError: the world formed without this process (it came too late).
    """
    world_id = seal.world_id
    instance, instance_key, instance_raw = _instance(store, seal, address)
    wseal = seal.with_nonce(instance)
    key = f"{KEY_ROOT}/{world_id}/join"
    refused_key = f"{KEY_ROOT}/{world_id}/refused/{instance}"
    mine = {"info": me, "expect": expect, "nonce": secrets.token_hex(16), "instance": instance}
    _store_call("appending the join record", store.append, key,
                wseal.seal("join", 0, -1, json.dumps(mine)) + "\n")
    where = f"world {world_id!r} at {address}"
    pause = 0.002
    refused = None
    reporter, look = waiting.Reporter(where), time.monotonic()
    while True:
        raw = _store_call("reading the join records", store.get, key)
        seen = _read(raw, key, wseal, instance)
        disagree = _disagreement(world_id, seen.valid)
        if disagree is not None:
            refused = _refuse(store, wseal, refused_key, disagree)
            formed = seen.valid[:num_processes]
            if not (len(formed) == num_processes and all(r["expect"] == expect for r in formed)
                    and any(r["nonce"] == mine["nonce"] for r in formed)):
                raise refused
            # the world had formed with us before the other record came: its members may
            # wait for us in the first collective; World.join wakes them, then raises
            break
        if len(seen.valid) >= num_processes:
            break
        if seen.foreign >= num_processes or time.monotonic() >= deadline:
            _log(world_id, seen)
            if not any(r["nonce"] == mine["nonce"] for r in seen.valid):
                raise TransportError(f"{where}: this process's own join record is not among "
                                     f"the {len(seen.valid)} valid record(s) the store "
                                     f"returns: another store answers at this address, or "
                                     f"the key was overwritten; check the address")
            raise _short(where, seen, num_processes, seal.signed, deadline)
        if time.monotonic() >= look:
            look = time.monotonic() + 0.5
            _look(store, wseal, refused_key, seen, str(mine["nonce"]), num_processes, reporter)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    _log(world_id, seen)
    members = seen.valid[:num_processes]
    if not any(r["nonce"] == mine["nonce"] for r in members):
        raise RefitError(f"{label(me)} came too late to {where}: {num_processes} processes "
                         f"joined before it ({', '.join(label(r['info']) for r in members)}); "
                         f"give every world on one store its own world_id and every process "
                         f"the same num_processes")
    return Joined(members, instance, instance_key, instance_raw, refused_key, key, refused)


def _look(store: Any, wseal: Seal, refused_key: str, seen: _Seen, mine: str,
          num_processes: int, reporter: waiting.Reporter) -> None:
    """Between the polls of a join, twice a second: raise the world's published refusal (a
    process refused by its own arguments, or one that found a joiner dead); refuse the
    instance when a process that took a member's slot no longer runs (on this node: it
    cannot come back under its record, a restart of it would be a second process with its
    label); name the missing every ``waiting.REPORT_SECONDS``."""
    published = refusal(store, wseal, refused_key)
    if published is not None:
        raise published
    from .epochs import gone        # epochs builds on this module
    dead = [r["info"] for r in seen.valid[:num_processes]
            if r["nonce"] != mine and gone(r["info"], ())]
    if dead:
        raise _refuse(store, wseal, refused_key, (
            f"{reporter.what}: {', '.join(_describe(r) for r in seen.valid if r['info'] in dead)} "
            f"joined and then exited (no longer runs on this node) before the world formed; "
            f"it cannot form with that record: start its processes again on a new world_id "
            f"(or a new store)"), "TransportError")
    if reporter.due():
        joined = [(r["info"]["group"], r["info"]["index"]) for r in seen.valid]
        short = num_processes - len(seen.valid)
        reporter.say(waiting.waiting_line(short, num_processes,
                                          [label(r["info"]) for r in seen.valid],
                                          waiting.missing_labels(joined, short)))


def _log(world_id: str, seen: _Seen) -> None:
    if seen.stale or seen.foreign_closed:
        logger.info("world %r: ignored %d join record(s) of other instances of this world "
                    "(an earlier world with this id, or a replay): %s", world_id,
                    len(seen.stale) + seen.foreign_closed,
                    "; ".join(seen.stale[:5]) or "signed with other tokens")
    if seen.garbage or seen.foreign:
        logger.warning("world %r: skipped %d join record(s) that are not this world's "
                       "(%d signed with another token or none; %s)", world_id,
                       len(seen.garbage) + seen.foreign, seen.foreign,
                       ", ".join(seen.garbage[:5]) or "no garbage")


def _short(where: str, seen: _Seen, num_processes: int, signed: bool,
           deadline: float) -> CommunicationError:
    """The error of a join that found too few valid records."""
    arrived = ", ".join(label(r["info"]) for r in seen.valid) or "none"
    stale = (f"; ignored {len(seen.stale)} record(s) of other instances of this world "
             f"({'; '.join(seen.stale[:3])})") if seen.stale else ""
    if seen.foreign or seen.foreign_closed:
        now = " at once" if seen.foreign >= num_processes and time.monotonic() < deadline \
            else ""
        mine = "this process's token" if signed else "no token (this process has none)"
        closed = f" ({seen.foreign_closed} of worlds that closed)" if seen.foreign_closed \
            else ""
        return AuthenticationError(
            f"{where}: refused{now}: {len(seen.valid)} of {num_processes} processes joined "
            f"with {mine} ({arrived}); {seen.foreign + seen.foreign_closed} record(s) are "
            f"signed with another token{' or none' if signed else ''}{closed}: every "
            f"process must pass the same token (token= or XRESHARD_TOKEN){stale}")
    return TransportTimeout(f"{where}: {len(seen.valid)} of {num_processes} processes joined "
                            f"in time ({arrived}); {num_processes - len(seen.valid)} never "
                            f"did{stale}")



def _group_key(groups: Sequence[str] | None) -> Any:
    if groups is None:
        return lambda info: (info["group"], info["index"])
    order = {g: i for i, g in enumerate(groups)}
    return lambda info: (order[info["group"]], info["index"])


def numbered(records: list[dict[str, Any]], groups: Sequence[str] | None, world_id: str,
              me: tuple[str, int]) -> tuple[list[dict[str, Any]], int]:
    """The members' infos in process order, with their ranks, and this process's position
    (see ``World``: groups in ``groups`` order, else sorted; then index)."""
    infos = sorted((rec["info"] for rec in records), key=_group_key(groups))
    for a, b in zip(infos, infos[1:]):
        if (a["group"], a["index"]) == (b["group"], b["index"]):
            raise RefitError(f"two processes joined world {world_id!r} as {label(a)} "
                             f"(pids {a['pid']} on {a['host']} and {b['pid']} on "
                             f"{b['host']}); give each process of a group its own index")
    first = 0
    for info in infos:
        info["ranks"] = list(range(first, first + info["num_ranks"]))
        first += info["num_ranks"]
    position = next(p for p, info in enumerate(infos) if (info["group"], info["index"]) == me)
    return infos, position


def member_nonce(joined: Joined) -> str:
    """What a world's metadata is bound to: its instance and its member set."""
    return hashlib.sha256(json.dumps([joined.instance,
                                      sorted(rec["nonce"] for rec in joined.members)])
                          .encode()).hexdigest()[:32]
