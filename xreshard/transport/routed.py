"""Transports made of transports: per-pair routing over several kinds, and a transport
over a subset of the world's ranks renumbered 0..n-1 (NCCL over the ranks that need it).

Decision record: "auto" picks a kind per pair of ranks (local, shm, cuda_ipc, gloo,
nccl); a ``RoutedTransport`` holds one transport per kind and sends each post through the
kind its pair was given, entering every part's group together so their posts start at
once. Rejected: one transport per world (a colocated pair would go through the network),
and choosing per message (both sides must agree without talking).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

from ..errors import RefitError
from .base import Transport, TransportError, nbytes_of

__all__ = ["RenumberedTransport", "RoutedTransport"]


class RenumberedTransport:
    """A transport over a subset of the world's ranks, numbered 0..n-1 inside (NCCL over
    the ranks that need it); posts name world ranks and are renumbered here. ``inner`` is
    None in a process with no member: it never posts to this transport (routing says so),
    and a post raises."""

    def __init__(self, inner: Transport | None, index: Mapping[int, int], name: str):
        self.inner = inner
        self._index = dict(index)
        self.name = name

    def group(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.inner is None else self.inner.group(timeout)

    def _inner(self, what: str, src_rank: int, dst_rank: int) -> tuple[Transport, int, int]:
        if self.inner is None or src_rank not in self._index or dst_rank not in self._index:
            raise TransportError(f"{self.name} {what} {src_rank}->{dst_rank}: not both in its "
                                 f"communicator (ranks {sorted(self._index)})")
        return self.inner, self._index[src_rank], self._index[dst_rank]

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        inner, s, d = self._inner("send", src_rank, dst_rank)
        inner.send(buf, s, d, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        inner, s, d = self._inner("recv", src_rank, dst_rank)
        inner.recv(buf, s, d, tag)

    def abort(self, why: str) -> None:
        abort = getattr(self.inner, "abort", None)
        if abort is not None:
            abort(why)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class RoutedTransport:
    """One transport over several: each pair goes through the kind ``route(src, dst)``
    names ("local", "shm", "cuda_ipc", "gloo", "nccl"), as ``World.route`` says.

    Inside ``group`` every sub-transport collects its posts; on exit they complete in
    the fixed order of ``select.KINDS`` in every process (local copies first, then the
    shared-memory paths, then the network). That cannot deadlock: each transport starts
    its sends when they are posted and its exit waits only on its own peers' posts and
    exits, which every process reaches in the same order. Each is given the group's
    timeout from the moment the group was entered.

    Attributes:
        parts: the sub-transports by kind.
        bytes_sent_by_transport / bytes_received_by_transport: bytes posted per kind,
            cumulative (take differences around a refit for its own share).
        alloc: staging in shared memory (``ShmTransport.alloc``) when shm is one of the
            parts, else None; pass it as the executor's ``alloc`` so that staged sends
            are exposed to shm peers without a copy.
    """

    def __init__(self, parts: Mapping[str, Transport], route: Any, local_ranks: Sequence[int]):
        from .select import KINDS

        unknown = set(parts) - set(KINDS)
        if unknown:
            raise RefitError(f"unknown transport kinds {sorted(unknown)}; expected {KINDS}")
        self.parts = {k: parts[k] for k in KINDS if k in parts}
        self._route = route
        self.name = f"auto({'+'.join(self.parts)})"
        self._local = frozenset(local_ranks)
        self.bytes_sent_by_transport = {k: 0 for k in self.parts}
        self.bytes_received_by_transport = {k: 0 for k in self.parts}
        shm = self.parts.get("shm")
        self.alloc = getattr(shm, "alloc", None)

    @property
    def local(self) -> Transport:
        return self.parts["local"]

    @property
    def bytes_by_transport(self) -> dict[str, int]:
        """Bytes sent + received per kind by this process, cumulative."""
        return {k: self.bytes_sent_by_transport[k] + self.bytes_received_by_transport[k]
                for k in self.parts}

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            # ExitStack exits in reverse: enter last what must complete first
            for kind in reversed(self.parts):
                stack.enter_context(self.parts[kind].group(timeout))
            yield

    def _part(self, src_rank: int, dst_rank: int, what: str) -> tuple[str, Transport]:
        kind = self._route(src_rank, dst_rank)
        part = self.parts.get(kind)
        if part is None:
            raise TransportError(f"{what} {src_rank}->{dst_rank}: routed to {kind!r}, which "
                                 f"this world did not create ({self.name})")
        return kind, part

    def takes_views(self, src_rank: int, dst_rank: int) -> bool:
        """Whether the pair's transport takes a strided host view as a receive buffer
        (``LocalTransport.takes_views``, ``ShmTransport.takes_views``)."""
        takes = getattr(self.parts.get(self._route(src_rank, dst_rank)), "takes_views", None)
        return bool(takes is not None and takes(src_rank, dst_rank))

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        kind, part = self._part(src_rank, dst_rank, "send")
        self.bytes_sent_by_transport[kind] += nbytes_of(buf)
        part.send(buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        kind, part = self._part(src_rank, dst_rank, "recv")
        self.bytes_received_by_transport[kind] += nbytes_of(buf)
        part.recv(buf, src_rank, dst_rank, tag)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
