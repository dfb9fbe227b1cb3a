"""Threads a refit runs beside its caller: a started refit (:class:`RefitHandle`) and the
checksums of the sources, computed while the bytes move (:class:`Background`).

A started refit binds and moves in its own thread, but the caller's CUDA streams are what
its tensors were produced on: CuPy's and torch's current streams are per thread, and
binding orders the copies after the *current* stream (DLPack's handshake). So ``start()``
captures the caller's current streams (CuPy's, and every loaded adapter's through its
optional ``capture_streams`` hook: torch's) and the thread makes them current before it
binds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable

__all__ = ["Background", "RefitHandle", "caller_streams"]


def caller_streams() -> Callable[[], Any]:
    """The calling thread's current CUDA streams (CuPy's, and those of every loaded adapter
    with a ``capture_streams`` hook), as a context factory that makes them current in
    another thread. Imports no framework: one that is not loaded has no streams."""
    from . import registry
    from .devices import capture_streams
    enters = [capture_streams()]
    for entry in registry.adapters():
        if entry.ready():
            hook = getattr(entry.load(), "capture_streams", None)
            got = hook() if hook is not None else None
            if got is not None:
                enters.append(got)

    @contextlib.contextmanager
    def enter() -> Any:
        with contextlib.ExitStack() as stack:
            for e in enters:
                stack.enter_context(e())
            yield
    return enter

logger = logging.getLogger("xreshard.runtime.refit")


class Background:
    """Runs ``fn`` in a thread; ``result()`` joins it and returns or raises its outcome.
    ``streams`` (from :func:`caller_streams`): CUDA streams made current there first, so
    that device reads are ordered after the producers the caller's streams wait for."""

    def __init__(self, fn: Callable[[], Any], name: str = "xreshard-verify",
                 streams: Callable[[], Any] | None = None):
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                if streams is None:
                    self._value = fn()
                else:       # the caller's CUDA streams current here (caller_streams)
                    with streams():
                        self._value = fn()
            except BaseException as e:      # noqa: BLE001 - raised again from result()
                self._error = e
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; whether it finished."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _Outcome:
    """What a started refit ended with, shared by its thread and its handle (the thread
    holds no reference to the handle, so a dropped handle is collected while it runs)."""

    def __init__(self, refit: Any):
        self._lock = threading.Lock()
        self._refit = refit
        self.error: BaseException | None = None
        self.observed = False
        self.dropped = False

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            report = self.dropped
        if report:
            self._unobserved()

    def drop(self) -> None:
        """The handle was collected (``weakref.finalize``)."""
        with self._lock:
            self.dropped = True
            report = self.error is not None and not self.observed
        if report:
            self._unobserved()

    def _unobserved(self) -> None:
        """A failure nobody will ``wait()`` for: say so, and mark the destination stale."""
        kept = self._refit.config.atomic      # atomic: destinations kept their version
        self._refit.stale = self._refit.stale or not kept
        logger.warning("a started refit failed and its handle was dropped without wait() "
                       "(destination %s at v%d): %s: %s", "kept" if kept else "stale",
                       self._refit.version,
                       type(self.error).__name__, self.error)


class RefitHandle:
    """A refit started with :meth:`xreshard.runtime.refit.Refit.start`, running in a background
    thread.

    A handle dropped without ``wait()`` whose refit fails logs the error at WARNING and
    sets ``refit.stale`` (nobody else will hear of it).

    Args:
        refit: the refit (its ``version`` names the call in messages).
        send, receive: this call's objects, kept alive until ``wait()`` returned.
        run: ``run(send, receive)`` runs the call and returns its report (or raises the
            error every rank raises).
    """

    def __init__(self, refit: Any, send: Any, receive: Any,
                 run: Callable[[Any, Any], Any]):
        self._refit = refit
        self._send = send           # kept alive until the refit is done
        self._receive = receive
        self._run = run
        self._thread: Background | None = None
        self._outcome = _Outcome(refit)

    def start(self, read: threading.Event | None = None) -> None:
        """Run the refit in a thread, on the caller's current CUDA streams (captured here,
        in the caller's thread: see the module docstring); return once ``read`` is set
        (the call bound its sides) or the refit ended.

        The caller's next step may donate the arrays it sends: a donation racing the bind
        from another thread crashed JAX's dispatch (a segfault in a jitted ``jnp.stack``,
        in pure JAX too). Once bound, the stacks hold copies and the per-shard views make
        JAX copy instead of donating."""
        streams = caller_streams()
        run, send, receive, outcome = self._run, self._send, self._receive, self._outcome

        def body() -> Any:
            try:
                with streams():
                    return run(send, receive)
            except BaseException as e:
                outcome.failed(e)
                raise
        self._thread = Background(body, name="xreshard-refit")
        weakref.finalize(self, outcome.drop)
        while read is not None and not read.wait(0.05) and not self.done():
            pass

    def done(self) -> bool:
        """Whether the refit finished (successfully or not)."""
        return self._thread is not None and self._thread.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The report (a ``RefitReport``), once the refit finished; raises what it raised.

        Args:
            timeout: seconds to wait; None waits as long as the refit may take (its own
                waits are bounded by ``RefitConfig.timeout``).

        Raises:
            TimeoutError: still running after ``timeout`` seconds (the refit goes on).
        """
        assert self._thread is not None, "wait() on a handle that was never started"
        if not self._thread.join(timeout):
            raise TimeoutError(f"refit v{self._refit.version + 1} still running after "
                               f"{timeout} s")
        self._send = self._receive = None
        self._outcome.observed = True
        return self._thread.result()
