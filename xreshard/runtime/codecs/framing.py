"""Message codecs: how a pair's messages are framed on the wire, for the executor's one
round loop and one pipelined loop (:mod:`xreshard.runtime.execute`).

A message codec turns each *group* (one transport group: what the wire moves at once)
into receives to post, sends to post, and what lands once the group moved:

```
 group k = codec.open(k, round k's buckets)    receives (buffers sized now)
           codec.post(group, send)             sends (packed into staging, or in place)
           ... the group moves ...
           codec.land(group.landing)           unpack / apply into the destinations
```

* :class:`Fixed` (every plain, cast and FP8 call): a bucket's message is as long as the
  schedule says, so group ``k`` is round ``k`` (``lag`` 0): its receives, its sends, its
  unpacks.
* ``Sized`` (:class:`.delta.DeltaCodec`): a message's length depends on the data, so each
  is announced by a header one group ahead: group ``k`` carries round ``k - 1``'s payloads
  (sized by the headers group ``k - 1`` received) and round ``k``'s headers (``lag`` 1,
  ``sized`` True: the pipelined loop opens group ``k`` only once group ``k - 1`` moved).
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...planner.schedule import Bucket

__all__ = ["Fixed", "Group", "FIXED"]


@dataclass
class Group:
    """What one group posts and lands (see the module docstring)."""

    recvs: list
    """``(buffer, bucket)`` receives to post."""
    sends: Any
    """What :meth:`Fixed.post` (or the codec's) posts: the codec's own."""
    landing: list
    """What :meth:`Fixed.land` (or the codec's) lands once the group moved."""
    moves: bool = True
    """Whether the group posts anything (a plain round always opens its group)."""
    idle: bool = False
    """Nothing to post and nothing to land: the group is skipped."""


class Fixed:
    """The framing of a plain call: messages of the sizes the schedule says (see the
    module docstring). Stateless: one value serves every call."""

    sized = False
    lag = 0

    def pipelines(self, ex: Any) -> bool:
        return True

    def start(self, ex: Any) -> None:
        pass

    def stop(self, ex: Any) -> None:
        pass

    def after_group(self, ex: Any, k: int) -> None:
        pass

    def open(self, ex: Any, k: int, buckets: Sequence[Bucket], offsets: dict,
             stats: Any) -> Group:
        """Round ``k``: its receives (into the destination itself, or staging taken at
        ``offsets``), its sends, and the receives to unpack."""
        recvs, unpack = ex._recv_buffers(buckets, offsets, stats)
        local = ex._local_src
        return Group(recvs, _send_order(buckets, local), unpack)

    def post(self, ex: Any, group: Group, send: Callable[[Any, Bucket], None],
             offsets: dict, stats: Any, landed: Callable[[], None] | None = None) -> None:
        """Pack and post each send. A send of a ``forwarded`` tensor reads what an earlier
        round received: ``landed`` (the pipelined loop) waits for and unpacks every earlier
        round before the first one is packed; round ``k``'s other sends go first, so they
        still leave early."""
        sends = group.sends
        if landed is not None and ex.forwarded:
            sends = sorted(sends, key=ex._is_forward)
        for b in sends:
            if landed is not None and ex._is_forward(b):
                landed()
                landed = None
            with ex._on(b.src):
                send(ex._message(b, offsets, stats), b)
            ex._count_send(b, stats)

    def land(self, ex: Any, landing: list) -> None:
        for b, buf in landing:
            with ex._on(b.dst):
                ex._unpack(b, buf)


def interleaved(sends: Sequence[Bucket]) -> list[Bucket]:
    """``sends`` with their destinations taken in turn, byte for byte: the next send goes to
    the destination rank with the fewest bytes posted so far; each keeps its own order.

    The schedule lists a round's buckets by (source, destination) pair, so a sender of
    several ranks posted nearly all of one receiver's messages before the other's: the
    second receiver started pulling only once the first had most of its bytes (a 128 MiB
    refit to two shm receivers: 3 ms later), and finished as much later, alone."""
    by_dst: dict[int, list[Bucket]] = {}
    for b in sends:
        by_dst.setdefault(b.dst, []).append(b)
    if len(by_dst) < 2:
        return list(sends)
    heap = [(0, d, 0) for d in by_dst]      # (bytes posted, destination, next index)
    out: list[Bucket] = []
    while heap:
        posted, d, i = heap[0]
        b = by_dst[d][i]
        out.append(b)
        if i + 1 < len(by_dst[d]):
            heapq.heapreplace(heap, (posted + b.nbytes, d, i + 1))
        else:
            heapq.heappop(heap)
    return out


#: round -> its send order (``interleaved``), by the round's identity: a prepared call
#: keeps its schedule, so a warm call reuses the order (3,000 buckets take ~2 ms)
_ORDERS: dict[int, tuple[Sequence[Bucket], frozenset, list[Bucket]]] = {}
_ORDERS_KEPT = 8
_ORDERS_LOCK = threading.Lock()


def _send_order(buckets: Sequence[Bucket], local: Any) -> list[Bucket]:
    """This process's sends of round ``buckets`` (sources in ``local``), interleaved."""
    with _ORDERS_LOCK:      # refits of two threads (``Refit.start``)
        hit = _ORDERS.get(id(buckets))
        if hit is not None and hit[0] is buckets and hit[1] == local:
            return hit[2]
    order = interleaved([b for b in buckets if b.src in local])
    with _ORDERS_LOCK:
        if len(_ORDERS) >= _ORDERS_KEPT:
            _ORDERS.pop(next(iter(_ORDERS)))
        _ORDERS[id(buckets)] = (buckets, frozenset(local), order)
    return order


#: the one value of :class:`Fixed`
FIXED = Fixed()
