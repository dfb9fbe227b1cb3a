"""The ``gloo`` transport: CPU buffers between processes over a private gloo group.

Decision record: CPU ranks (tests, CPU-only users, JAX CPU devices) need a transport that
works wherever torch does, with no extra dependency. We build a private
``ProcessGroupGloo`` directly over a ``PrefixStore`` of the world's ``TCPStore``, one gloo
rank per *process* (not per world rank), and post ``send``/``recv`` with tags. The default
process group is never created or touched, so this coexists with the engines' own groups.
Gloo pairs are per process pair, so the several world ranks a process may host are told
apart by the tag, which encodes (src rank, dst rank, tag) injectively (see ``GlooTransport``).
Gloo's send waits for the receiver's matching post before moving data, so nothing is
buffered on either side, and a grouped isend/irecv + wait cannot deadlock. Each post is
started as soon as it is made (gloo's own threads move it) and the group's exit waits for
all of them, so the executor packs the next message while the previous one is on the wire.
Rejected: ``init_process_group`` (owns the global default group, which the inference
engine may already own); one gloo rank per world rank (N^2 socket pairs instead of P^2 and
one gloo context per local rank); shipping typed tensors or pickled objects (bytes only;
metadata crosses as JSON through the world).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from ..extras import require
from .base import TransportError, TransportTimeout, format_seconds

__all__ = ["GlooTransport", "create_gloo_group", "GLOO_TAG_BITS"]

# (is send, buffer, peer process, gloo tag, src rank, dst rank, tag)
_Post = tuple[bool, Any, int, int, int, int, int]

GLOO_TAG_BITS = 31   # c10d checks gloo tags as non-negative int32


def _torch() -> Any:
    require("torch.distributed", "torch", "the gloo transport")
    return require("torch", "torch", "the gloo transport")


def _local_address_toward(host: str) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent).

    It is the address peers can reach us on if they reach the store: loopback when the
    store is on loopback (then all processes are on this host), the routed NIC otherwise.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return ""   # gloo's default device: resolve this host's name


def create_gloo_group(store: Any, prefix: str, *, rank: int, size: int, timeout: float,
                      store_host: str) -> Any:
    """A private ``ProcessGroupGloo`` of ``size`` processes over ``PrefixStore(prefix, store)``.

    Collective: every process calls it with the same ``prefix``. Binds to the address this
    process uses toward ``store_host``, or to the interfaces in ``GLOO_SOCKET_IFNAME``
    (comma-separated) when set, as torch does.

    Raises:
        TransportTimeout: not every process connected within ``timeout`` s.
    """
    torch = _torch()
    pg_gloo = torch.distributed.ProcessGroupGloo
    opts = pg_gloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifnames:
        opts._devices = [pg_gloo.create_device(interface=n) for n in ifnames.split(",")]
    else:
        opts._devices = [pg_gloo.create_device(hostname=_local_address_toward(store_host))]
    try:
        return pg_gloo(torch.distributed.PrefixStore(prefix, store), rank, size, opts)
    except RuntimeError as e:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise TransportTimeout(f"gloo group {prefix!r}: not all {size} processes "
                                   f"connected within {format_seconds(timeout)}: {e}") from e
        raise TransportError(f"gloo group {prefix!r} failed to connect: {e}") from e


class GlooTransport:
    """Grouped point-to-point moves of CPU byte buffers over a private gloo group.

    Gloo ranks are process positions. A message's gloo tag encodes its world ranks and its
    tag; with ``L`` the most ranks any process hosts and ``s``, ``d`` the positions of the
    src and dst ranks within their processes::

        gloo_tag = (tag * L + s) * L + d          valid for 0 <= tag < 2**31 // L**2

    Gloo already tells process pairs apart, and (process, position in it) is the world
    rank, so (src rank, dst rank, tag) -> (src process, dst process, gloo_tag) is
    injective. For example, with L = 2:

        # src rank (process, s) | dst rank (process, d) | tag | gloo_tag
        #        0 (0, 0)       |        2 (1, 0)       |   0 | 0
        #        1 (0, 1)       |        2 (1, 0)       |   0 | 2
        #        1 (0, 1)       |        3 (1, 1)       |   5 | 23

    Args:
        pg: the ``ProcessGroupGloo`` (``create_gloo_group``), one gloo rank per process.
        rank_process: ``rank_process[rank]`` is the process position hosting world ``rank``;
            a process's ranks are consecutive.
        process_index: this process's position.
        process_labels: a name per process position, for error messages.
    """

    name = "gloo"

    def __init__(self, pg: Any, rank_process: Sequence[int], process_index: int,
                 process_labels: Sequence[str] | None = None):
        self._torch = _torch()
        self._pg = pg
        self._me = process_index
        self._rank_process = tuple(rank_process)
        first: dict[int, int] = {}
        for rank, p in enumerate(self._rank_process):
            first.setdefault(p, rank)
        self._rank_slot = tuple(r - first[p] for r, p in enumerate(self._rank_process))
        counts = [self._rank_process.count(p) for p in set(self._rank_process)]
        self._num_slots = max(counts, default=1)
        self.tag_limit = (1 << GLOO_TAG_BITS) // (self._num_slots * self._num_slots)
        self._labels = tuple(process_labels or (f"process {p}" for p in range(pg.size())))
        self._posts: list[tuple[_Post, Any]] | None = None
        self._post_error: RuntimeError | None = None
        self._broken: str | None = None
        self._abandoned: list[Any] = []   # works of a failed group: keep their buffers alive

    @property
    def usable(self) -> bool:
        """False once a group failed or the transport was closed (it is then rebuilt)."""
        return self._broken is None

    def _check(self, local_rank: int, peer_rank: int, tag: int, what: str) -> int:
        n = len(self._rank_process)
        if not (0 <= local_rank < n and 0 <= peer_rank < n):
            raise TransportError(f"gloo {what}: ranks {local_rank}, {peer_rank} not in 0..{n - 1}")
        if self._rank_process[local_rank] != self._me:
            raise TransportError(f"gloo {what}: rank {local_rank} is not in this process "
                                 f"({self._labels[self._me]})")
        peer = self._rank_process[peer_rank]
        if peer == self._me:
            raise TransportError(f"gloo {what}: ranks {local_rank} and {peer_rank} are both in "
                                 f"this process; move them with the local transport "
                                 f"(world.transport('auto') routes pairs for you)")
        if not 0 <= tag < self.tag_limit:
            raise TransportError(f"gloo {what}: tag {tag} is outside 0..{self.tag_limit - 1} "
                                 f"(31-bit gloo tags / {self._num_slots}^2 rank pairs)")
        return peer

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._post(True, buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._post(False, buf, src_rank, dst_rank, tag)

    def _post(self, is_send: bool, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        what = "send" if is_send else "recv"
        if self._posts is None:
            raise TransportError(f"gloo {what} {src_rank}->{dst_rank} tag {tag} posted outside "
                                 f"`with transport.group(timeout=...)`")
        local, remote = (src_rank, dst_rank) if is_send else (dst_rank, src_rank)
        peer = self._check(local, remote, tag, what)
        L = self._num_slots
        self._start((is_send, buf, peer,
                     (tag * L + self._rank_slot[src_rank]) * L + self._rank_slot[dst_rank],
                     src_rank, dst_rank, tag))

    def _start(self, post: _Post) -> None:
        """Start one post now; its Work is waited on when the group exits."""
        buf = post[1]
        if isinstance(buf, np.ndarray):
            if buf.flags.writeable:
                t = self._torch.from_numpy(buf)
            else:
                # a JAX shard's numpy view is read-only; gloo only reads a send buffer
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    t = self._torch.from_numpy(buf)
        else:
            t = buf
        if t.numel() == 0:
            return                      # both sides skip: the protocol gives equal lengths
        if self._post_error is not None:
            return
        try:
            work = (self._pg.send if post[0] else self._pg.recv)([t], post[2], post[3])
        except RuntimeError as e:       # reported, with the others, when the group exits
            self._post_error = e
            return
        if self._posts is None:         # _post checked; only a group exited meanwhile gets here
            raise TransportError(f"gloo {'send' if post[0] else 'recv'} {post[4]}->{post[5]} tag "
                                 f"{post[6]} started after its group exited")
        self._posts.append((post, work))

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        """Collect posts; on exit start them all and wait for each, ``timeout`` s in all.

        Raises:
            TransportTimeout: a message did not complete in time; names the peer rank and
                the tag. Gloo closes the pair that timed out, so the transport is unusable
                afterwards (as after any failure): rebuild the world.
            TransportError: a peer closed its connection (died), or gloo failed otherwise.
        """
        if self._broken is not None:
            raise TransportError(f"gloo transport unusable after an earlier failure: "
                                 f"{self._broken}")
        if self._posts is not None:
            raise TransportError("gloo transport groups do not nest")
        self._posts = []
        self._post_error = None
        try:
            yield
            posts = self._posts
        finally:
            self._posts = None
        self._run(posts, timeout)

    def _run(self, started: list[tuple[_Post, Any]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        works = [w for _, w in started]
        if self._post_error is not None:
            self._fail(works, None, timeout, self._post_error, deadline)
        timedelta, monotonic = datetime.timedelta, time.monotonic
        for post, work in started:
            try:
                work.wait(timedelta(seconds=max(deadline - monotonic(), 0.001)))
            except RuntimeError as e:
                self._fail(works, post, timeout, e, deadline)

    def _fail(self, works: list[Any], post: _Post | None, timeout: float,
              e: RuntimeError, deadline: float) -> None:
        self._abandoned.extend(works)
        if post is None:
            self._broken = f"posting failed: {e}"
            raise TransportError(f"gloo: could not start the group's posts: {e}") from e
        is_send, _, peer, _, src_rank, dst_rank, tag = post
        what = (f"gloo {'send to' if is_send else 'recv from'} rank "
                f"{dst_rank if is_send else src_rank} on {self._labels[peer]}, tag {tag} "
                f"({src_rank}->{dst_rank})")
        msg = str(e)
        if "timed out" in msg.lower() or time.monotonic() >= deadline - 0.01:
            self._broken = f"{what} timed out"
            raise TransportTimeout(f"{what} did not complete within "
                                   f"{format_seconds(timeout)}: the peer "
                                   f"never posted its side or is stuck; {msg}") from e
        self._broken = f"{what} failed: {msg}"
        raise TransportError(f"{what} failed (did the peer process die?): {msg}") from e

    def abort(self, why: str) -> None:
        """This process failed in the middle of a call: close the group's sockets now, so a
        peer waiting on one of this process's posts fails at once ("connection closed by
        peer") instead of at its timeout; the transport is unusable afterwards.

        Gloo cannot interrupt a wait from outside (neither ``ProcessGroupGloo.abort`` nor
        ``shutdown`` wakes a pending ``Work.wait``, on this side or the peer's); only
        destroying the group's context closes its pairs, and every ``Work`` holds the
        context: the group and the works of failed groups are dropped here.
        """
        if self._broken == "closed" or self._pg is None:
            return
        self._broken = self._broken or f"aborted: {why}"
        self._abandoned.clear()
        pg, self._pg = self._pg, None
        with contextlib.suppress(RuntimeError):
            pg.shutdown()
        del pg

    def close(self) -> None:
        """Shut the gloo group down; the transport is unusable afterwards."""
        if self._broken != "closed":
            self._broken = "closed"
            self._abandoned.clear()
            if self._pg is not None:
                with contextlib.suppress(RuntimeError):
                    self._pg.shutdown()
