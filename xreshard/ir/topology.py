"""Where ranks live: which process and which host own each world rank.

The planner uses this to prefer senders in the same process, then the same host. A
``World`` (world.py) exposes one as ``world.topology``; tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True, slots=True)
class Topology:
    """``process[rank]`` is an opaque process id, ``host[rank]`` a host name."""

    process: Mapping[int, int]
    host: Mapping[int, str]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "process", dict(self.process))
        object.__setattr__(self, "host", dict(self.host))
        object.__setattr__(self, "_hash", hash((tuple(sorted(self.process.items())),
                                                tuple(sorted(self.host.items())))))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, processes: Mapping[int, tuple[int, str]]) -> Topology:
        """From ``{rank: (process id, host)}``."""
        return cls({r: p for r, (p, _) in processes.items()},
                   {r: h for r, (_, h) in processes.items()})

    def process_of(self, rank: int) -> int | None:
        return self.process.get(rank)

    def host_of(self, rank: int) -> str | None:
        return self.host.get(rank)
