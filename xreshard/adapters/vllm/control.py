"""Rank 0's control plane over the engines while an update runs, and engines lost in the
middle of one (issue 21, item 2).

Decision record.

* **Side by side.** A worker's side of a collective (join, refit) runs inside its engine's
  control call (vLLM's ``init_weight_transfer_engine`` / ``update_weights``), so rank 0
  runs each engine's blocking call in a thread while its own side runs here
  (:func:`concurrently`).
* **An engine lost mid-update is not waited for.** The refit survives a lost receiver
  (``RefitConfig(on_member_loss="continue")``, :mod:`xreshard.runtime.fleet`): the
  survivors finish each layer group in the next epoch, and the round's last all-gather
  excludes an engine lost after its last group (:func:`.members.lost_at_outcome`). But the
  dead engine's control call never answers (or answers late, with an error). So rank 0
  waits only for the calls of the engines the world still holds: an engine is *lost* once
  any of its workers is no member of the world's epoch (the survivors settled without it;
  its other workers go with it: one ``unit`` per engine, ``World.join(unit=...)``) or all
  its processes are gone (same host: pid and start time; an engine that died after its
  part of the round). Its pending call is abandoned in its daemon thread (the client's own
  timeout ends it); its failure is not raised; rank 0 stops driving it (no
  ``finish_weight_update``, dropped from the clients) and the next update goes to the
  live engines. Without a loss nothing changes: every call is waited for, at most the
  timeout after the trainer's side ended.
* Rejected: a deadline per call (a slow, live engine is not a lost one), and asking the
  engine's client whether it is alive (vLLM's clients have no such call; the world
  already settled it, the same way on every process).
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Any, Callable, Sequence

from xreshard.errors import RefitError, XreshardError
from xreshard.runtime.epochs import gone
from xreshard.runtime.joining import label

from .members import FleetError, engine_of

__all__ = ["concurrently", "Watch"]


def concurrently(calls: Sequence[Callable[[], Any]], work: Callable[[], Any], timeout: float,
                 what: str, lost: Callable[[], set[int]] | None = None) -> Any:
    """``work()`` here while the blocking control-plane ``calls`` (one per engine) run in
    threads.

    Raises ``work``'s error first, else the first failed call's. ``lost()`` (an elastic
    world): the indices of the calls whose engine was lost (:class:`Watch`); they are not
    waited for once ``work`` ended, and their failures are not raised.
    """
    failures: list[tuple[int, BaseException]] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failures.append((i, e))

    threads = [threading.Thread(target=run, args=(i, c), name=f"xreshard-{what}-{i}",
                                daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    dead: set[int] = set()
    try:
        result = work()
    except FleetError:
        raise       # the same typed error as on every other process (the engines' included)
    except XreshardError as e:
        dead = lost() if lost is not None else set()
        mine = [f for f in failures if f[0] not in dead]
        if mine:    # its engine refused, so a peer never joined: say why, not only who
            i, f = min(mine, key=operator.itemgetter(0))
            raise RefitError(f"{e}\n(engine {i}'s {what} call failed: {f})") from e
        raise
    finally:
        dead = _join(threads, time.monotonic() + timeout, lost)
    late = [i for i, t in enumerate(threads) if t.is_alive() and i not in dead]
    if late:
        raise RefitError(f"engine(s) {late}: the {what} call did not return within {timeout} s "
                         "after the trainer's side finished")
    failures = [f for f in failures if f[0] not in dead]
    if failures:
        i, first = min(failures, key=operator.itemgetter(0))
        who = f"engine {i}'s" if len(threads) > 1 else "the engine's"
        raise RefitError(f"{who} {what} call failed: {first}") from first
    return result


def _join(threads: Sequence[threading.Thread], deadline: float,
          lost: Callable[[], set[int]] | None) -> set[int]:
    """Wait for the threads, at most until ``deadline``; with ``lost``, not for those of
    lost engines (asked again while any other runs: an engine may be found gone late).
    Returns the indices of the lost calls."""
    if lost is None:
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return set()
    pause = 0.01
    while True:
        dead = lost()
        if all(not t.is_alive() for i, t in enumerate(threads) if i not in dead) \
                or time.monotonic() >= deadline:
            return dead
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


class Watch:
    """The engines of one update (``engines``: their ids, in the order of its control
    calls) as the world held them at its start; :meth:`lost` says which the world lost
    since. Build it after the round's membership sync could have run (or before: engines
    not in the world yet are never lost)."""

    def __init__(self, world: Any, engines: Sequence[int]):
        self.world, self.engines = world, list(engines)
        self.infos: dict[int, list[dict[str, Any]]] = {}
        for info in world.processes:
            e = engine_of(info)
            if e is not None:
                self.infos.setdefault(e, []).append(dict(info))

    def lost_engines(self) -> list[int]:
        """Engines any of whose workers is no member of the world's epoch now, or all of
        whose processes are gone (same host)."""
        members = set(self.world.members)
        return [e for e in self.engines if self.infos.get(e) and (
            any(label(i) not in members for i in self.infos[e])
            or all(gone(i, ()) for i in self.infos[e]))]

    def lost(self) -> set[int]:
        """The indices (in ``engines``) of the lost engines' calls."""
        out = set(self.lost_engines())
        return {i for i, e in enumerate(self.engines) if e in out}

    def labels(self, engines: Sequence[int]) -> list[str]:
        """The member labels of ``engines``' workers."""
        return [label(i) for e in engines for i in self.infos.get(e, ())]
