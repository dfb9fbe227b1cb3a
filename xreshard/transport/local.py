"""The ``local`` transport: moves between two ranks of one process as a memory copy.

Decision record: a JAX host process owns several ranks, so many transfers of a refit start
and end in one process. They go through the same grouped protocol as the network
transports (the executor need not special-case them), but the group's exit is one memory
copy per message (``np.copyto`` / ``Tensor.copy_``), with no staging and no thread.
A send and a receive match on (src rank, dst rank, tag), exactly like the other transports,
so a schedule that works here has no pairing mistakes on the network either.
Device (CuPy) buffers, possibly on two GPUs of the process, are copied with one
``cudaMemcpyAsync`` (``cudaMemcpyDefault``: the driver knows each pointer's device) on the
stream the receive was posted on, after an event of the stream the send was posted on, and
the sender's stream then waits for the copy: the executor posts on its own stream of each
device, so its unpack follows the copy and its next pack waits for the copy to have read,
with no host wait per group (the executor waits once at the end of its run). A CuPy kernel
would run on whichever device the thread has current, which is not always the receiver's.
Rejected: aliasing the receive buffer to the send buffer (the executor owns both and unpacks
from the receive buffer, so a copy is the contract), and matching posts in post order
(order-dependent, and it would hide the tag mistakes the other transports punish).

A receive may be a strided host view (:meth:`LocalTransport.takes_views`): the executor then
posts the destination's own region (a row range of a wider shard) instead of staging, and
the group's exit copies the message's bytes into it in the region's C order. In one
process that is the only copy of a byte between two ranks, where staging made it two (the
copy into staging, then the executor's unpack).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator

import numpy as np

from ..dtypes import bits
from .base import TransportError, nbytes_of

__all__ = ["LocalTransport", "copy_bytes"]

Key = tuple[int, int, int]   # (src rank, dst rank, tag)
_MEMCPY_DEFAULT = 4          # cudaMemcpyDefault


def _on_cuda(buf: Any) -> bool:
    """A CuPy array (device memory), told by its module: CuPy is never imported here."""
    return type(buf).__module__.startswith("cupy")


def _posting_stream(buf: Any) -> Any:
    """The current CuPy stream of ``buf``'s device in this thread (None for host buffers)."""
    if not _on_cuda(buf):
        return None
    return sys.modules["cupy"].cuda.get_current_stream(buf.device.id)


def _device_copy(dst: Any, dst_stream: Any, src: Any, src_stream: Any) -> None:
    """``dst`` <- ``src`` (CuPy, any two devices of this process) on ``dst_stream`` after
    ``src_stream``; ``src_stream`` then waits for the copy (see the module docstring)."""
    cuda = sys.modules["cupy"].cuda
    src_dev, dst_dev = src.device.id, dst.device.id
    with cuda.Device(src_dev):
        produced = src_stream.record()
    with cuda.Device(dst_dev):
        dst_stream.wait_event(produced)
        cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes_of(dst), _MEMCPY_DEFAULT,
                                 dst_stream.ptr)
        copied = dst_stream.record()
    with cuda.Device(src_dev):
        src_stream.wait_event(copied)


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst``: numpy arrays, torch tensors (any device) or CuPy arrays.

    Both hold the same number of bytes; a numpy/torch pair shares memory through
    ``torch.from_numpy`` so it is still a single copy.
    """
    if isinstance(dst, np.ndarray):
        if not dst.flags.c_contiguous:
            _into_view(dst, src.get() if _on_cuda(src) else src)   # a region (takes_views)
        elif isinstance(src, np.ndarray):
            np.copyto(dst, src, casting="no")
        elif _on_cuda(src):
            src.get(out=dst)                                 # device -> host
        else:
            np.copyto(dst, np.asarray(src), casting="no")   # CPU torch tensor: zero-copy view
    elif hasattr(dst, "copy_"):                              # torch.Tensor
        if isinstance(src, np.ndarray):
            src = sys.modules["torch"].from_numpy(src)
        dst.copy_(src)
    elif _on_cuda(dst):                                      # host -> CuPy, on its device
        with sys.modules["cupy"].cuda.Device(dst.device.id):
            dst[...] = src
    else:                                                    # other array types
        dst[...] = src


def _into_view(dst: np.ndarray, src: np.ndarray) -> None:
    """A message's bytes (``src``, contiguous) into a strided view ``dst`` of as many bytes,
    in ``dst``'s C order: one copy of the bits, rows at a time."""
    out = bits(dst)
    np.copyto(out, src.reshape(-1).view(np.uint8).view(out.dtype).reshape(out.shape),
              casting="no")


class LocalTransport:
    """Same-process copies between ranks, matched by (src rank, dst rank, tag).

    Args:
        ranks: the ranks of this process; posts naming another rank raise. ``None``
            accepts any rank (all ranks simulated in one process, as in unit tests).
    """

    name = "local"

    def __init__(self, ranks: Iterable[int] | None = None):
        self._ranks = None if ranks is None else frozenset(ranks)
        self._sends: dict[Key, Any] | None = None
        self._recvs: dict[Key, Any] | None = None
        self._closed = False

    @contextlib.contextmanager
    def group(self, timeout: float) -> Iterator[None]:
        """Collect posts; on exit match every send with its receive and copy (host buffers:
        done at exit; device buffers: queued on the posting streams, see the module).

        ``timeout`` is accepted for the protocol; copies do not wait on anyone.

        Raises:
            TransportError: a post without its match, a duplicate (src, dst, tag), or a
                size mismatch; nothing is copied then.
        """
        if self._closed:
            raise TransportError("the local transport is closed")
        if self._sends is not None:
            raise TransportError("local transport groups do not nest")
        self._sends, self._recvs = {}, {}
        try:
            yield
            sends, recvs = self._sends, self._recvs
        finally:
            self._sends = self._recvs = None
        unmatched = [f"send {k[0]}->{k[1]} tag {k[2]} (no recv)" for k in sends if k not in recvs]
        unmatched += [f"recv {k[0]}->{k[1]} tag {k[2]} (no send)" for k in recvs if k not in sends]
        if unmatched:
            raise TransportError(f"local transport: {len(unmatched)} unmatched post(s) at group "
                                 f"exit: {'; '.join(sorted(unmatched))}")
        for key, (src, _) in sends.items():
            dst = recvs[key][0]
            if nbytes_of(src) != nbytes_of(dst):
                raise TransportError(f"local transport: {key[0]}->{key[1]} tag {key[2]}: send "
                                     f"buffer has {nbytes_of(src)} bytes, recv buffer "
                                     f"{nbytes_of(dst)}")
        for key, (src, src_stream) in sends.items():
            dst, dst_stream = recvs[key]
            if src_stream is not None and dst_stream is not None:
                if nbytes_of(dst):
                    _device_copy(dst, dst_stream, src, src_stream)
            else:
                copy_bytes(dst, src)

    def _post(self, posts: dict[Key, Any] | None, what: str, buf: Any, src_rank: int,
              dst_rank: int, tag: int) -> None:
        if posts is None:
            raise TransportError(f"local {what} {src_rank}->{dst_rank} tag {tag} posted outside "
                                 f"`with transport.group(timeout=...)`")
        if self._ranks is not None and not (src_rank in self._ranks and dst_rank in self._ranks):
            raise TransportError(f"local {what} {src_rank}->{dst_rank} tag {tag}: the local "
                                 f"transport only moves between this process's ranks "
                                 f"{sorted(self._ranks)}")
        key = (src_rank, dst_rank, tag)
        if key in posts:
            raise TransportError(f"local {what} {src_rank}->{dst_rank} tag {tag} posted twice "
                                 f"in one group")
        posts[key] = (buf, _posting_stream(buf))

    def takes_views(self, src_rank: int, dst_rank: int) -> bool:
        """Whether a receive ``src_rank -> dst_rank`` may be a strided host view (see the
        module): always, as long as both are this transport's ranks."""
        return self._ranks is None or (src_rank in self._ranks and dst_rank in self._ranks)

    def send(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._post(self._sends, "send", buf, src_rank, dst_rank, tag)

    def recv(self, buf: Any, src_rank: int, dst_rank: int, tag: int) -> None:
        self._post(self._recvs, "recv", buf, src_rank, dst_rank, tag)

    def close(self) -> None:
        self._closed = True
