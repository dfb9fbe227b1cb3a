"""What the processes of one refit call agree on after it: the shared per-world state of
the Refits in this process, the failure every process raises, how a local exception
crosses processes, and what a call's move left (split from :mod:`xreshard.runtime.refit`,
which runs the call)."""

from __future__ import annotations

import weakref
from typing import Any

from ..errors import error_message, error_name

__all__ = ["Failed", "Moved", "WORLDS", "WorldState", "entry", "failure_lines", "world_state"]


class WorldState:
    """What the Refits of one world share in this process: every process's framework ids
    (gathered at the world's first refit call, ``refit/identity``) and how many Refits
    agreed on their identity (every process agrees on them at the same collective, so the
    counts stay equal). Per world, not per Refit: a Refit created on one side only (after a
    refused call, or crossed) must not make one process gather while another checks."""

    def __init__(self) -> None:
        self.identity: list[dict] | None = None
        self.agreed = 0
        self.epoch = 0


#: world -> its WorldState in this process
WORLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def world_state(world: Any) -> WorldState:
    state = WORLDS.get(world)
    if state is None:
        state = WORLDS[world] = WorldState()
    return state


class Failed(Exception):
    """A failure every process agreed on: raise ``error`` (the same everywhere)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def entry(exc: BaseException, phase: str) -> list[str]:
    """How a local exception crosses processes: [class name, message] (see
    ``xreshard.errors``: a foreign exception is classified by ``phase``)."""
    return [error_name(exc, phase), error_message(exc)]


class Moved:
    """What one call's move left: executor stats (every stage's), checksums, bytes per
    transport kind."""

    def __init__(self) -> None:
        self.stats: Any = None
        self.digests: Any = None
        self.by_kind: dict[str, int] = {}
        self.delta: Any = None          # the call's DeltaCall (RefitConfig(delta=True))


def failure_lines(failed: list[tuple[int, list[str]]], world: Any, limit: int = 20) -> str:
    """One line per distinct error, naming the processes that reported it ("every
    process" for an error every process found in the same gathered metadata)."""
    by_error: dict[tuple[str, str], list[int]] = {}
    for p, (cls, msg) in failed:
        by_error.setdefault((cls, msg), []).append(p)
    lines = []
    for (cls, msg), procs in list(by_error.items())[:limit]:
        who = ("every process" if len(procs) == world.num_processes and len(procs) > 1
               else ", ".join(world.describe_process(p) for p in procs[:4])
               + (f" and {len(procs) - 4} more" if len(procs) > 4 else ""))
        lines.append(f"{who}: {msg}")
    if len(by_error) > limit:
        lines.append(f"... and {len(by_error) - limit} more")
    return "\n  ".join(lines)
