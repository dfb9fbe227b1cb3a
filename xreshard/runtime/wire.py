"""The wire thread of the pipelined executor (see :mod:`xreshard.runtime.execute`).

Only this thread ever touches the transport while a pipelined run is in progress, so a
transport needs nothing beyond the grouped protocol of ``transport/base.py`` (NCCL's
groupStart/End semantics hold: the wire opens a group, posts, closes it).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

from ..planner.schedule import Bucket
from ..transport.base import Transport, TransportTimeout

__all__ = ["Wire", "WireThread"]


class Wire:
    """The thread that runs an executor's transport groups, one after another.

    The calling thread hands it ``open(k, receives)``, then each send as soon as it is
    packed, then ``close(k)``; the wire opens round k's group, posts the receives, posts
    each send as it comes and closes the group (which waits for every post, within the
    timeout). ``wait(k)`` returns once round k's group exited, or raises what it raised.
    """

    def __init__(self, transport: Transport, timeout: float):
        self.transport = transport
        self.timeout = timeout
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self._failed = threading.Event()
        self._thread: threading.Thread | None = None
        worker = getattr(transport, "wire_worker", None)
        self._ended = worker.run(self._loop) if isinstance(worker, WireThread) else None
        if self._ended is None:     # no idle worker of the transport's: a thread of its own
            self._thread = threading.Thread(target=self._loop, name="xreshard-wire",
                                            daemon=True)
            self._thread.start()

    def open(self, k: int, recvs: list[tuple[Any, Bucket]]) -> None:
        self._check()
        self._done[k] = threading.Event()
        self._q.put(("open", k, recvs))

    def send(self, buf: Any, b: Bucket) -> None:
        self._check()
        self._q.put(("send", buf, b))

    def close(self, k: int) -> None:
        self._q.put(("close", k, None))

    def _check(self) -> None:
        if self._failed.is_set():
            assert self._error is not None
            raise self._error

    def wait(self, k: int) -> None:
        """Until round k's group exited; raises the wire's error (a timeout names the peer)."""
        done = self._done[k]
        # the group bounds its own waits by the timeout; this bound only guards against a
        # transport that does not
        deadline = time.monotonic() + 2 * self.timeout + 5.0
        while not done.wait(0.05):
            if self._failed.is_set():
                break
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{self.transport.name}: round {k} did not complete "
                                       f"within {self.timeout} s (the transport did not "
                                       f"return from its group)")
        self._check()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """The executor's run ended: a failure aborts the open group first; the thread
        then ends either way. After a clean run every group the loop opened has exited
        (the run waited for each), so a kept thread's loop is left to end by itself: the
        caller goes on to its outcome without waiting for that hand-off (a wake-up of the
        thread, milliseconds on a loaded host); a next wire finds the thread idle, or
        starts its own."""
        if exc is not None:
            self.abort(exc)
        elif self._ended is not None:
            self._q.put(("stop", None, None))
            return
        self.stop()

    def abort(self, e: BaseException) -> None:
        """The calling thread failed: the open group exits with ``e`` (no more posts)."""
        self._q.put(("abort", e, None))

    def stop(self) -> None:
        """End the thread once it finished what it was handed (its waits are bounded)."""
        self._q.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(2 * self.timeout + 5.0)
        elif self._ended is not None:
            self._ended.wait(2 * self.timeout + 5.0)

    def _loop(self) -> None:
        group: Any = None
        k = -1
        while True:
            op, a, b = self._q.get()
            if op == "stop":
                if group is not None:       # never closed: the caller failed
                    with contextlib.suppress(BaseException):
                        group.__exit__(RuntimeError, RuntimeError("executor stopped"), None)
                return
            if self._failed.is_set():
                continue                    # drain: nothing more is posted after a failure
            try:
                if op == "open":
                    k = a
                    group = self.transport.group(self.timeout)
                    group.__enter__()
                    for buf, bk in b:
                        self.transport.recv(buf, bk.src, bk.dst, bk.tag)
                elif op == "send":
                    self.transport.send(a, b.src, b.dst, b.tag)
                elif op == "close":
                    g, group = group, None
                    g.__exit__(None, None, None)
                    self._done[a].set()
                elif op == "abort":
                    g, group = group, None
                    if g is not None:
                        with contextlib.suppress(BaseException):
                            g.__exit__(type(a), a, a.__traceback__)
                    self._fail(a)
            except BaseException as e:      # noqa: BLE001 - raised in the calling thread
                if group is not None and op != "close":
                    g, group = group, None
                    with contextlib.suppress(BaseException):
                        g.__exit__(type(e), e, e.__traceback__)
                group = None
                self._fail(e)
                if k in self._done:
                    self._done[k].set()

    def _fail(self, e: BaseException) -> None:
        if self._error is None:
            self._error = e
        self._failed.set()


class WireThread:
    """A thread kept across calls that runs one wire loop at a time: a world's transports
    hand it to every executor over them (``wire_worker``), so a call does not start a
    thread (``Thread.start`` waits until the new thread runs: 0.1-0.3 ms on a quiet
    2-core host, 2-6 ms on a loaded one, on every process's path into the move). It ends
    with the world's transports (``stop``)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def run(self, fn: Any) -> threading.Event | None:
        """Run ``fn`` on the thread; an event set once it returned, or None when the
        thread runs another loop (a wire that never ended) or was stopped."""
        with self._lock:
            if self._busy or self._stopped:
                return None
            self._busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="xreshard-wire",
                                                daemon=True)
                self._thread.start()
        ended = threading.Event()
        self._jobs.put((fn, ended))
        return ended

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, ended = job
            try:
                fn()
            finally:
                with self._lock:
                    self._busy = False
                ended.set()
                job = fn = None     # holds no wire between loops

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (after the loop it runs, waiting at most ``timeout`` s)."""
        with self._lock:
            thread, self._thread, self._stopped = self._thread, None, True
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
