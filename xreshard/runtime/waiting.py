"""Waiting on the other processes of a world: what a wait says while it lasts, and what
ends it before its timeout.

Decision record (issues "Trust, third pass" item 9 and "A newcomer's second hour" item 1).
A wait on other processes (reaching the store, a join, a metadata collective) used to say
nothing until its timeout (300 s by default), even where the answer was known at once.

- **Say who is missing, steadily.** A wait that lasts logs one line every
  :data:`REPORT_SECONDS` at WARNING on the ``xreshard.runtime.world`` logger:
  ``waiting for k of n processes (joined: ...; missing: ...)``. With logging not
  configured, Python prints WARNING records to stderr itself (``logging.lastResort``), so
  the line shows on a terminal, in a pipe and in a log file alike; an application that
  configured logging gets it through its own handlers. At a join the missing processes are
  named where the joined ones imply them (``rollout[0]`` when ``rollout[1]`` joined),
  else counted: a process that never reached the store left no trace to name.
- **Stop waiting for who will not come.** A wait that lasts past a second looks twice a
  second: a member on this node whose process no longer runs (``epochs.gone``: pid and
  start time) ends it at once, at a join as in every collective.
- **A world's end, posted once.** A process of a fixed world that closes it, or whose
  collective failed (a timeout, a payload out of step, a peer found dead), will take part
  in no further collective: it posts why at ``xreshard/<world_id>/ended/<nonce>`` (sealed,
  ``compare_set``: the first writer wins; ``nonce`` is the member set's). Every other
  member's wait reads it at its next look and raises that error, the same class and the
  same words, naming the process. A join's refusal (``joining.refusal``) travels the same
  way, under its own key, to processes still joining.

- **What it costs.** Nothing while a wait is short: its first second is the store's own
  blocking ``wait``, which returns the moment the last payload lands (most collectives end
  there). Past it, a poll every 50 ms (at most 5% of the time waited), a few round trips
  per look, and TCPStore's client logs its two C++ lines about a timed-out wait once.
  A close costs one ``compare_set``. Measured: benchmarks/bench_waits.py.

Rejected: polling from the first instant (1.6x per metadata all-gather on the loaded
2-core machine: sleeps of a fraction of a millisecond overshoot there); slicing the store's
``wait`` (TCPStore's client logs two C++ warning lines at every slice that times out); a
heartbeat thread per world (store traffic in every process all the time, and on one node
it tells nothing that a pid check and a posted end do not; across nodes a silent peer is
still found by the timeout, with the waiting lines naming it); asking at every collective
whether an end was posted before writing (a round trip per collective on the fast path,
for what a wait finds within its second and a half).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import CollectiveMismatch, CommunicationError, TransportError, error_from
from ..transport.base import TransportTimeout, format_seconds
from . import store as store_module
from .store import Seal, wait_keys

if TYPE_CHECKING:
    from .world import World

__all__ = ["REPORT_SECONDS", "Reporter", "ended_key", "missing_labels", "post_end",
           "read_end", "settled", "wait_for", "wait_payloads"]

logger = logging.getLogger("xreshard.runtime.world")

#: seconds between two waiting lines of one wait (the first comes after as many)
REPORT_SECONDS = store_module.REPORT_SECONDS

#: seconds a wait blocks in the store before it watches for processes that will not come
WATCH_AFTER = 1.0
#: seconds between two looks for them
LOOK_SECONDS = 0.5
#: seconds between two polls of a watched wait
POLL_SECONDS = 0.05


class Reporter:
    """Logs ``what: text`` every ``interval`` seconds while one wait lasts."""

    def __init__(self, what: str, interval: float = REPORT_SECONDS):
        self.what = what
        self.interval = interval
        self.begun = time.monotonic()
        self._next = self.begun + interval

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def say(self, text: str) -> None:
        now = time.monotonic()
        logger.warning("%s: %s, for %s so far", self.what, text,
                       format_seconds(now - self.begun))
        self._next = now + self.interval


def waiting_line(num_missing: int, num_total: int, present: Sequence[str],
                 missing: Sequence[str], present_word: str = "joined") -> str:
    """``waiting for 1 of 3 processes (joined: a, b; missing: c)``."""
    return (f"waiting for {num_missing} of {num_total} processes ({present_word}: "
            f"{', '.join(present) or 'none'}; missing: {', '.join(missing) or 'none'})")


def missing_labels(joined: Sequence[tuple[str, int]], num_missing: int) -> list[str]:
    """The processes a join still waits for, as far as the joined ``(group, index)`` pairs
    tell: the gaps below each group's highest index by name, the rest counted."""
    named = []
    by_group: dict[str, set[int]] = {}
    for group, index in joined:
        by_group.setdefault(group, set()).add(index)
    for group in sorted(by_group):
        seen = by_group[group]
        named += [f"{group}[{i}]" for i in range(max(seen)) if i not in seen]
    named = named[:num_missing]
    rest = num_missing - len(named)
    if rest:
        named.append(f"{rest} {'more ' if named else ''}not joined yet")
    return named


def wait_for(store: Any, keys: Sequence[str], readers: Sequence[int], deadline: float,
             reporter: Reporter, describe: Callable[[int], str],
             stop: Callable[[list[int]], None]) -> None:
    """Wait until every key of ``keys`` (the payloads of processes ``readers``) is set, at
    most until ``deadline``. Past :data:`WATCH_AFTER` seconds, every
    :data:`LOOK_SECONDS` the readers still missing go to ``stop(missing)``, which may
    raise to end the wait (a process that will not come), and ``reporter`` names them
    every interval.

    The first :data:`WATCH_AFTER` seconds are the store's own blocking ``wait`` (it
    returns the moment the last key lands: most collectives end there, at no cost); then
    it polls (``check``, about 50 us on loopback) every :data:`POLL_SECONDS`, at most 5%
    of the time already waited. Polling from the start costs 1.6x per all-gather on a
    loaded machine (benchmarks/bench_waits.py), and cutting the store's wait in slices
    makes TCPStore's client log two C++ warning lines per slice: this way a wait that
    lasts logs them once.

    Raises:
        TransportTimeout: the deadline passed.
        TransportError: the store failed.
        what ``stop`` raises.
    """
    try:
        return wait_keys(store, keys, min(deadline, time.monotonic() + WATCH_AFTER))
    except TransportTimeout:
        if time.monotonic() >= deadline:
            raise
    look = time.monotonic()
    while True:
        try:
            if store.check(list(keys)):
                return
            now = time.monotonic()
            if now >= deadline:
                raise TransportTimeout(f"timed out waiting for {len(keys)} key(s) "
                                       f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
            if now >= look:
                look = now + LOOK_SECONDS
                arrived = [bool(store.check([k])) for k in keys]
                missing = [p for p, a in zip(readers, arrived) if not a]
                if missing:
                    stop(missing)
                    if reporter.due():
                        reporter.say(waiting_line(
                            len(missing), len(readers),
                            [describe(p) for p, a in zip(readers, arrived) if a],
                            [describe(p) for p in missing], "arrived"))
        except CommunicationError:
            raise       # (a RuntimeError too)
        except RuntimeError as e:   # torch's DistStoreError / DistNetworkError derive from it
            raise TransportError(f"the rendezvous store failed: {e}") from e
        time.sleep(max(min(POLL_SECONDS, deadline - now), 0.0))


def ended_key(root: str, nonce: str) -> str:
    """Where the end of the world instance ``nonce`` under key root ``root`` is posted."""
    return f"{root}/ended/{nonce}"


def post_end(store: Any, seal: Seal, key: str, by: int, error: str, message: str
             ) -> Exception | None:
    """Post that process ``by`` ends the world with ``error`` (a class name that crosses
    processes, ``errors.error_name``) and ``message``, unless an end is posted there;
    returns the end that holds (the first posted), or None when the store cannot say."""
    draft = seal.seal("world/ended", 0, -1, json.dumps({"by": by, "error": error,
                                                        "message": message}))
    try:
        raw = store.compare_set(key, "", draft)
    except RuntimeError:
        return None
    return _opened(seal, key, raw)


def read_end(store: Any, seal: Seal, key: str) -> Exception | None:
    """The end posted at ``key`` (as its exception), or None."""
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
    except RuntimeError:
        return None
    return _opened(seal, key, raw)


def _opened(seal: Seal, key: str, raw: Any) -> Exception | None:
    try:
        body = seal.open(raw, key=key, kind="world/ended", op=0, process=-1)
    except CommunicationError:
        return None         # not a member's: an outsider's write ends nothing
    if not (isinstance(body, dict) and isinstance(body.get("error"), str)
            and isinstance(body.get("message"), str)):
        return None
    return error_from(body["error"], body["message"])


def settled(world: World, prefix: str, op: int, kind: str, readers: Sequence[int],
            arrived: list[bool]) -> list[bool]:
    """Which payloads of a partial collective count, the same for every process: the
    first process to get here writes the set it saw (``compare_set``: first writer
    wins), every other takes that set. Without it, a process whose grace ran out
    before a slow survivor posted, and that survivor, would build their outcomes from
    different payloads (and raise different messages, or one succeed)."""
    me = world.process_index
    mine = world._seal.seal(f"{kind}/settled", op, me,
                           json.dumps([p for p, a in zip(readers, arrived) if a]))
    raw = world._store.compare_set(f"{prefix}/settled", "",
                                  json.dumps({"by": me, "payload": mine}))
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        env = json.loads(text)
        writer, payload = int(env["by"]), env["payload"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        raise CollectiveMismatch(f"{kind} (collective #{op}): the settled arrivals at "
                                 f"{prefix}/settled are not an xreshard payload ({e})") \
            from None
    counted = set(world._seal.open(payload, key=f"{prefix}/settled", kind=f"{kind}/settled",
                                  op=op, process=writer,
                                  what=f"settled by {world.describe_process(writer)}"))
    return [p in counted for p in readers]


def wait_payloads(world: World, keys: list[str], readers: Sequence[int], deadline: float,
                  partial: bool, what: str = "a collective", begun: float = 0.0) -> None:
    """Wait for the payloads of a collective step of ``world`` at ``keys``, naming the
    missing readers every :data:`REPORT_SECONDS`. It stops before the deadline once a
    reader still missing is known not to come: its process, on this node, no longer runs
    (``epochs.gone``; a partial collective, a refit's outcome, stops only when every
    missing one is, or in an elastic world left); or (not partial) the world's refusal or
    end was posted (the world's failure path then raises that first cause)."""
    if partial:
        def stop(missing: list[int]) -> None:
            if world.membership.all_gone(missing):
                raise TransportTimeout(f"gone: {missing}")
    else:
        def stop(missing: list[int]) -> None:
            _stop_if_over(world, missing, what, begun)
    reporter = Reporter(f"world {world.world_id!r}: {what}")
    wait_for(world._store, keys, readers, deadline, reporter, world.describe_process, stop)


def _stop_if_over(world: World, missing: list[int], what: str, begun: float) -> None:
    """Raise when a wait on the processes ``missing`` cannot end well: some of them no
    longer run (this node), or a member posted the world's end (or, within the join
    timeout, its refusal)."""
    from .epochs import gone
    dead = [p for p in missing if gone(world.membership.infos[p], ())]
    if dead:
        raise TransportError(
            f"{what} in world {world.world_id!r}: "
            f"{'; '.join(world.describe_process(p) for p in dead)} no longer "
            f"run{'s' if len(dead) == 1 else ''} (exited on this node) and never "
            f"arrived: it ends the world")
    seal = world._seal
    if world._refusal(begun) is not None or (not world.elastic and read_end(
            world._store, seal, ended_key(world._root, seal.nonce)) is not None):
        raise CommunicationError(f"{what}: the world was ended by another process")
