"""A transport made of links: one communicator per pair of processes (elastic worlds' gloo).

Decision record: a world-wide gloo group spans every process, so any change of members
reaches it and it must be rebuilt whole. An elastic world instead gives every pair of
processes its own two-process gloo group (a *link*): when a member leaves, dies or joins,
only the links to that member change, and every other link is kept, bytes and sockets
and all (``xreshard.runtime.comm_epochs`` decides; ``xreshard.runtime.world_links``
carries the links across epochs). A link is addressed by world ranks through a
``RenumberedTransport`` (its group numbers the pair's ranks 0..n-1), so a kept link only
gets a new rank index at an epoch change.

A link whose group failed (a post timed out or a peer died) may hold posts nobody waits
for: a later message with the same tag could meet one of them. Every link that had posts
in a failed group is therefore marked ``dirty`` and never kept or used again.
Rejected: one gloo group per epoch over all processes (rebuilt whole at every change, the
previous behaviour; fixed worlds keep it); links made lazily at the first message (two
processes would create them in different orders and wait on each other).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

from .base import Transport, TransportError

__all__ = ["Link", "LinkedTransport"]


class Link:
    """One pair's communicator as the world keeps it across epochs.

    Attributes:
        key: the link's name, the same in both processes (its members' ids).
        members: the two member ids, in the order of the group's ranks.
        inner: the pair's transport, over ranks 0..n-1 (the first member's ranks first).
        sizes: how many ranks each member hosts (fixed for a process's life).
        dirty: a group that posted on it failed: it is not used or kept again.
    """

    def __init__(self, key: str, members: tuple[str, str], inner: Transport,
                 sizes: tuple[int, int]):
        self.key = key
        self.members = members
        self.inner = inner
        self.sizes = sizes
        self.dirty = False

    @property
    def usable(self) -> bool:
        return not self.dirty and getattr(self.inner, "usable", True)

    def inner_ranks(self, member: str) -> range:
        """The ranks of ``member`` inside the link's group."""
        first = 0 if member == self.members[0] else self.sizes[0]
        return range(first, first + self.sizes[self.members.index(member)])

    def close(self) -> None:
        self.inner.close()


class LinkedTransport:
    """Sends each pair of ranks through the link of their processes.

    Args:
        links: ``{(p, q): (link, index)}`` for this process's links, ``p < q`` process
            positions of this epoch; ``index`` maps the world ranks of ``p`` and ``q`` to
            the link's ranks.
        rank_process: the process position of every world rank.
        name: the transport kind ("gloo").
    """

    def __init__(self, links: Mapping[tuple[int, int], tuple[Link, Mapping[int, int]]],
                 rank_process: Sequence[int], name: str = "gloo"):
        from .routed import RenumberedTransport
        self.name = name
        self._rank_process = tuple(rank_process)
        self._links = {pair: link for pair, (link, _) in links.items()}
        self._views = {pair: RenumberedTransport(link.inner, index, name)
                       for pair, (link, index) in links.items()}
        self._used: set[tuple[int, int]] | None = None

    @property
    def links(self) -> dict[tuple[int, int], Link]:
        """This process's links by process pair."""
        return dict(self._links)

    def _view(self, src_rank: int, dst_rank: int, what: str) -> Any:
        p, q = self._rank_process[src_rank], self._rank_process[dst_rank]
        pair = (min(p, q), max(p, q))
        view = self._views.get(pair)
        if view is None:
            raise TransportError(f"{self.name} {what} {src_rank}->{dst_rank}: no link between "
                                 f"processes {pair[0]} and {pair[1]} in this process")
        link = self._links[pair]
        if link.dirty:
            raise TransportError(f"{self.name} link {link.key} is unusable: a group that "
                                 f"posted on it failed; the next epoch makes it again")
        if self._used is not None:
            self._used.add(pair)
        return view

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        if self._used is not None:
            raise TransportError(f"{self.name} transport groups do not nest")
        self._used = set()
        ok = False
        try:
            with contextlib.ExitStack() as stack:
                for pair in sorted(self._views):
                    stack.enter_context(self._views[pair].group(timeout))
                yield
            ok = True
        finally:
            if not ok:      # posts on these links may be left behind: never reuse them
                for pair in self._used:
                    self._links[pair].dirty = True
            self._used = None

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._view(src_rank, dst_rank, "send").send(buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._view(src_rank, dst_rank, "recv").recv(buf, src_rank, dst_rank, tag)

    def abort(self, why: str) -> None:
        """This process failed mid-call: abort every link (``GlooTransport.abort``: peers
        waiting on this process fail now); each is dirty, the next epoch makes it again."""
        for link in self._links.values():
            link.dirty = True
            abort = getattr(link.inner, "abort", None)
            if abort is not None:
                abort(why)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
