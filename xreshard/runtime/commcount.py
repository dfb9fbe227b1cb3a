"""Counting what a process's transports move: messages, bytes and rounds, per peer.

The role of DTensor's ``CommDebugMode`` for xreshard. Any code in a process, a test most
often, switches counting on around the calls it wants to see::

    with xr.count_comm() as counts:
        refit()
    counts.bytes_sent            # {(src_rank, dst_rank): bytes} posted by this process
    counts.bytes_received        # {(src_rank, dst_rank): bytes} posted to land here
    counts.sent_to(3)            # bytes this process sent to world rank 3
    counts.rounds                # transport groups (one per executor round)
    counts.collectives           # {"refit/check": 1, ...}: the world's metadata collectives

Every transport a :class:`~xreshard.runtime.world.World` hands out is wrapped in
:class:`CountedTransport`, which reports each posted send and receive to the counters
active at that moment (none: one list check per message). Counters are per process, not
per thread: a refit started with ``Refit.start`` moves bytes on a worker thread and is
counted all the same. The copies the executor makes between two ranks of one process
cross no transport and are not counted (``RefitReport.bytes_local`` has them). Counts are
of posted buffers: a failed round counts what was posted before it failed.

Counters nest; each sees everything posted while it is active. ``as_json()`` gives the
counts as a JSON object (string keys ``"src->dst"``) for a multi-process test to gather.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Iterator

from ..transport.base import Transport, nbytes_of

__all__ = ["CommCounts", "CountedTransport", "count_comm"]

_LOCK = threading.Lock()
_ACTIVE: list[CommCounts] = []


class CommCounts:
    """What the transports of this process posted while the counter was active."""

    def __init__(self) -> None:
        self.bytes_sent: Counter[tuple[int, int]] = Counter()
        self.bytes_received: Counter[tuple[int, int]] = Counter()
        self.messages_sent: Counter[tuple[int, int]] = Counter()
        self.messages_received: Counter[tuple[int, int]] = Counter()
        self.rounds = 0
        #: the world's metadata collectives (all-gathers, broadcasts, barriers) this
        #: process entered, by kind (``"refit/check"``, ``"refit/outcome"``, ...)
        self.collectives: Counter[str] = Counter()

    def sent_to(self, dst_rank: int) -> int:
        """Bytes this process posted to world rank ``dst_rank`` (from any local rank)."""
        return sum(n for (_, d), n in self.bytes_sent.items() if d == dst_rank)

    def received_from(self, src_rank: int) -> int:
        """Bytes posted to land in this process from world rank ``src_rank``."""
        return sum(n for (s, _), n in self.bytes_received.items() if s == src_rank)

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.bytes_received.values())

    def __repr__(self) -> str:
        return (f"CommCounts(bytes_sent={dict(sorted(self.bytes_sent.items()))}, "
                f"bytes_received={dict(sorted(self.bytes_received.items()))}, "
                f"messages_sent={dict(sorted(self.messages_sent.items()))}, "
                f"messages_received={dict(sorted(self.messages_received.items()))}, "
                f"rounds={self.rounds}, collectives={dict(sorted(self.collectives.items()))})")

    def __str__(self) -> str:
        """A table, one row per ``(src_rank, dst_rank)`` pair this process posted::

            count_comm: 1 round, 2 messages; sent 2.01 MiB, received 0 B
              src -> dst |     sent | msgs | received | msgs
                0 ->   4 | 1.00 MiB |    1 |        - |    -
                1 ->   5 | 1.00 MiB |    1 |        - |    -
        """
        from ..units import format_bytes

        messages = sum(self.messages_sent.values()) + sum(self.messages_received.values())
        head = (f"count_comm: {self.rounds} round{'s' if self.rounds != 1 else ''}, "
                f"{messages} message{'s' if messages != 1 else ''}; sent "
                f"{format_bytes(self.total_sent)}, received {format_bytes(self.total_received)}")
        pairs = sorted(set(self.bytes_sent) | set(self.bytes_received))
        if not pairs:
            return head + " (nothing posted)"

        def cell(c: Counter, pair: tuple[int, int], size: bool) -> str:
            if pair not in c:
                return "-"
            return format_bytes(c[pair]) if size else str(c[pair])
        rows = [("src -> dst", "sent", "msgs", "received", "msgs")] + [
            (f"{s} -> {d}", cell(self.bytes_sent, (s, d), True),
             cell(self.messages_sent, (s, d), False), cell(self.bytes_received, (s, d), True),
             cell(self.messages_received, (s, d), False)) for s, d in pairs]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join([head] + ["  " + " | ".join(v.rjust(w) for v, w in zip(r, widths))
                                   for r in rows])

    def as_json(self) -> dict[str, Any]:
        """The counts as plain JSON: pair keys are ``"src->dst"`` strings."""
        def pairs(c: Counter) -> dict[str, int]:
            return {f"{s}->{d}": n for (s, d), n in sorted(c.items())}
        return {"bytes_sent": pairs(self.bytes_sent),
                "bytes_received": pairs(self.bytes_received),
                "messages_sent": pairs(self.messages_sent),
                "messages_received": pairs(self.messages_received),
                "rounds": self.rounds, "collectives": dict(sorted(self.collectives.items()))}

    @staticmethod
    def pairs_from_json(d: dict[str, int]) -> dict[tuple[int, int], int]:
        """``as_json()``'s ``{"src->dst": n}`` back to ``{(src, dst): n}``."""
        out = {}
        for key, n in d.items():
            s, _, t = key.partition("->")
            out[(int(s), int(t))] = int(n)
        return out


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounts]:
    """Count what this process's world transports post inside the ``with`` block."""
    counts = CommCounts()
    with _LOCK:
        _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        with _LOCK:
            _ACTIVE.remove(counts)


class CountedTransport:
    """A transport that reports every posted buffer to the active counters, then passes it
    on unchanged. Any other attribute is the wrapped transport's."""

    #: the thread the executors over this transport run their wire on
    #: (:class:`~xreshard.runtime.wire.WireThread`, a world's), or None: a thread per run
    wire_worker: Any = None

    def __init__(self, inner: Transport):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        for c in _ACTIVE:
            c.rounds += 1
        with self.inner.group(timeout):
            yield

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        if _ACTIVE:
            _count(buf, (src_rank, dst_rank), "sent")
        self.inner.send(buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        if _ACTIVE:
            _count(buf, (src_rank, dst_rank), "received")
        self.inner.recv(buf, src_rank, dst_rank, tag)

    def close(self) -> None:
        self.inner.close()


def count_collective(kind: str) -> None:
    """Note one metadata collective of ``kind`` entered by this process (the world calls
    it, only while some counter is active)."""
    for c in list(_ACTIVE):
        c.collectives[kind] += 1


def _count(buf: Any, pair: tuple[int, int], way: str) -> None:
    """Add one posted buffer to every active counter's ``bytes_<way>`` / ``messages_<way>``."""
    n = nbytes_of(buf)
    for c in list(_ACTIVE):
        getattr(c, "bytes_" + way)[pair] += n
        getattr(c, "messages_" + way)[pair] += 1
