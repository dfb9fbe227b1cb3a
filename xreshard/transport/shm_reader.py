"""The reader thread of :mod:`.shm`'s receiving side: a pulling peer's record batches read
ahead.

A receiver that pulls from a peer reads that peer's records in batches (see the shm module).
Read inline, each batch's store round trip comes after the last pull of the batch before,
and on a loaded host a round trip can stall for milliseconds while both receivers pull (the
store's server waits for a core). So a thread with its own store client waits for and opens
batch k+1 while the receiving thread pulls batch k.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator

from .base import TransportTimeout

__all__ = ["BatchReader"]

logger = logging.getLogger(__name__)

#: how long past its round's deadline a receiving thread waits for the reader thread (whose
#: every store wait is bounded by that deadline) before giving up on it
GRACE_S = 5.0


class BatchReader:
    """A thread that reads a pulling peer's record batches ahead of the receiving thread,
    through its own store ``client`` (the transport's stays free for failure records).

    It runs one job at a time: the batches of one (peer, round), each put on the job's queue
    as soon as it is opened, so the store round trip for batch k+1 overlaps the pulls of
    batch k. It lives as long as the transport (a thread started per round waits for the
    scheduler on a loaded host); ``stop`` ends it.
    """

    def __init__(self, client: Any, name: str):
        self.client = client
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), daemon=True,
                                        name=f"xreshard-{name}-read")
        self._thread.start()

    def stop(self) -> None:
        """End the thread after the job it runs, if any (bounded by that round's deadline;
        a failing transport does not wait for it: the job's result goes nowhere)."""
        self._jobs.put(None)

    @contextlib.contextmanager
    def read(self, key_of: Callable[[int], str],
             read_batch: Callable[[Any, int, threading.Event], dict[str, Any] | None],
             wake: Callable[[str], None], deadline: float,
             what: str) -> Iterator[Iterator[dict[str, Any]]]:
        """Batches 0, 1, ... (until one says ``more: False``) read on the thread with
        ``read_batch(client, k, stop)`` (None once ``stop`` is set); yields them in order.
        Leaving early (the receiving side failed) stops the job: ``wake(key)`` ends its
        store wait on ``key_of(k)``, and it is joined within the grace."""
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stop, finished = threading.Event(), threading.Event()
        awaited: list[str] = []             # the key the job waits on now

        def job() -> None:
            try:
                k = 0
                while True:
                    awaited[:] = [key_of(k)]
                    if stop.is_set():       # checked after naming the key: see the wake
                        return
                    rec = read_batch(self.client, k, stop)
                    if rec is None:
                        return
                    out.put(rec)
                    if not rec["more"]:
                        return
                    k += 1
            except BaseException as e:      # noqa: BLE001 - raised by the receiving thread
                out.put(e)
            finally:
                finished.set()

        last = [False]
        self._jobs.put(job)
        try:
            yield _drained(out, deadline, last, what)
        finally:
            if not last[0] and not finished.is_set():
                stop.set()
                if awaited:
                    wake(awaited[0])
            finished.wait(GRACE_S)


def _drained(out: queue.SimpleQueue[Any], deadline: float, last: list[bool],
             what: str) -> Iterator[dict[str, Any]]:
    """The reader job's records from ``out`` until the last one (``more`` false); a failure
    of the job is raised here."""
    while True:
        try:
            item = out.get(timeout=max(deadline - time.monotonic(), 0.0) + GRACE_S)
        except queue.Empty:
            raise TransportTimeout(f"shm: the reader of {what} did not answer within the "
                                   f"timeout") from None
        if isinstance(item, BaseException):
            raise item
        if not item["more"]:
            last[0] = True
        yield item
        if last[0]:
            return


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        job = None      # holds no transport between jobs
