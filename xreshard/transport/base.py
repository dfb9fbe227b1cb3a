"""The transport protocol: grouped point-to-point moves of contiguous byte buffers.

Decision record: every transport moves flat ``uint8`` buffers between two world ranks;
dtypes, casts and strided views are the executor's business. Posts happen inside
``with transport.group(timeout=...)``: the block collects sends and receives and, on exit,
starts them all together and waits for all of them (NCCL ``groupStart/groupEnd``, gloo
``isend/irecv`` + ``wait``), so no post order between peers can deadlock. Every wait is
bounded; a timeout raises ``TransportTimeout`` naming the peer and the tag.
Rejected: a blocking ``send``/``recv`` API (order-dependent deadlocks), and moving typed
tensors (bf16 has no numpy dtype and CuPy cannot export it; bytes have no such problem).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

from ..errors import TransportError, TransportTimeout

__all__ = ["CudaError", "RecordingTransport", "Transport", "TransportError", "TransportTimeout",
           "event_done", "format_seconds", "nbytes_of"]

#: cudaErrorNotReady: what cudaEventQuery returns while the work before the event runs
CUDA_NOT_READY = 600


class CudaError(TransportError):
    """CUDA reported a hard error (an illegal address, a launch failure, an ECC error) while
    the refit's copies or transfers ran. Raised at once, never waited out as a timeout nor
    counted as a finished copy; the message carries CUDA's own text. CUDA errors of this kind
    are sticky: the process's context is unusable afterwards, restart it. Crosses processes
    as a ``TransportError`` with the same message."""


def event_done(runtime: Any, event: int, where: str) -> bool:
    """Whether the work before CUDA event ``event`` finished, asked of ``runtime`` (CuPy's
    ``cupy.cuda.runtime``).

    ``cudaEventQuery`` returns cudaSuccess, cudaErrorNotReady, or the error of earlier
    asynchronous work (CUDA Runtime API, cudaEventQuery); CuPy's ``eventQuery`` returns that
    status without raising, and ``cupy.cuda.Event.done`` is ``status == 0``, so an error
    polled through ``done`` looks like "not yet" until the timeout. Here it raises at once.

    Raises:
        CudaError: any status but those two, with CUDA's name and text for it.
    """
    try:
        status = runtime.eventQuery(event)
    except Exception as e:      # a runtime binding that raises its statuses
        if getattr(e, "status", None) == CUDA_NOT_READY:
            return False
        raise CudaError(f"{where}: CUDA reported {e}") from e
    if status == 0:
        return True
    if status == CUDA_NOT_READY:
        return False
    try:
        text = str(runtime.CUDARuntimeError(status))
    except Exception:       # noqa: BLE001 - the status alone still says what happened
        text = f"CUDA error {status}"
    raise CudaError(f"{where}: CUDA reported {text}")


def format_seconds(seconds: float) -> str:
    """A duration for messages: ``"5 s"``, ``"0.25 s"``, ``"12 s"`` (not ``2.9874120 s``)."""
    seconds = float(seconds)
    if seconds >= 10:
        return f"{seconds:.0f} s"
    text = f"{seconds:.2f}".rstrip("0").rstrip(".")
    return f"{text} s" if text != "0" else f"{seconds:.2g} s"


@runtime_checkable
class Transport(Protocol):
    """Moves contiguous byte buffers between world ranks.

    ``buf`` is a 1-D contiguous ``uint8`` buffer (numpy array or torch tensor on CPU; a torch
    or CuPy array on GPU) of the same length on both sides. ``tag`` is a non-negative int
    that, with (src_rank, dst_rank), identifies one message within a group.
    """

    name: str

    def group(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Collect posts; on exit start them all and wait for all, at most ``timeout`` s."""

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        """Post a send of ``buf`` from ``src_rank`` (local) to ``dst_rank``."""

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        """Post a receive into ``buf`` at ``dst_rank`` (local) from ``src_rank``."""

    def close(self) -> None:
        """Release communicators; the transport is unusable afterwards."""


class RecordingTransport:
    """Wraps a transport and counts what crosses it (for tests: bytes sent == plan bytes)."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.name = f"recording({inner.name})"
        self.bytes_sent = 0
        self.bytes_received = 0
        self.sends: list[tuple[int, int, int, int]] = []   # (src, dst, tag, nbytes)

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        with self.inner.group(timeout):
            yield

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        n = nbytes_of(buf)
        self.bytes_sent += n
        self.sends.append((src_rank, dst_rank, tag, n))
        self.inner.send(buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self.bytes_received += nbytes_of(buf)
        self.inner.recv(buf, src_rank, dst_rank, tag)

    def close(self) -> None:
        self.inner.close()


def takes_view(transport: Any, bucket: Any, view: Any) -> bool:
    """Whether ``transport`` takes ``view`` (a strided host array, a destination's own
    region) as the receive buffer of ``bucket`` instead of staging: its ``takes_views(src,
    dst)`` says so for the pair (``LocalTransport``: both ranks in this process;
    ``ShmTransport``: the receiver's pairs with its shm peers, pulled a row per iovec). The
    executor asks before it takes staging to unpack from. Only views whose last dim is
    contiguous (rows of a wider array): a transposed one is unpacked by the executor's
    tiled copy (``runtime/copies.py``), which a plain strided copy would not match."""
    takes = getattr(transport, "takes_views", None)
    return (takes is not None and isinstance(view, np.ndarray) and view.flags.writeable
            and view.ndim > 0 and view.strides[-1] == view.itemsize
            and bool(takes(bucket.src, bucket.dst)))


def nbytes_of(buf: Any) -> int:
    """Byte length of a buffer: a numpy / CuPy array (``nbytes``) or a torch tensor."""
    n = getattr(buf, "nbytes", None)
    if n is None:
        n = buf.numel() * buf.element_size()
    return int(n)
