"""Shared-memory segments and the kernel's cross-process read, for :mod:`.shm`.

A segment is a named POSIX shared-memory object mapped with ``mmap`` (made with
``_posixshmem`` as ``multiprocessing.shared_memory`` does underneath, without its resource
tracker); :func:`pull` reads another process's memory with ``process_vm_readv`` (one syscall
per contiguous run). The transport (:class:`.shm.ShmTransport`) decides what goes where.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
from typing import Any

import numpy as np

from .base import TransportError

logger = logging.getLogger(__name__)

HEADER_BYTES = 64          # magic, generation; keeps the data 64-byte aligned
MAGIC = 0x5852_5348_4D31  # "XRSHM1"
ALIGN = 64
SHM_DIR = "/dev/shm"


def _posix() -> Any:
    try:
        import _posixshmem  # type: ignore[import-not-found]  # CPython's, no stub
    except ImportError as e:   # pragma: no cover - every CPython on Linux/macOS has it
        raise ImportError("the shm transport needs POSIX shared memory (_posixshmem)") from e
    return _posixshmem


def shm_names(prefix: str) -> list[str]:
    """The ``/dev/shm`` entries whose name starts with ``prefix`` (no leading slash)."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, prefix + "*")))


def remove_shm(prefix: str) -> int:
    """Unlink every segment of this user whose name starts with ``prefix``; returns how
    many. Names owned by another user are not ours (one who got to a name first): they are
    left alone, and nothing here raises (a cleanup never hides the error that called it)."""
    n = 0
    uid = os.geteuid()
    for name in shm_names(prefix):
        try:
            owner = os.stat(os.path.join(SHM_DIR, name)).st_uid
        except OSError:
            continue
        if owner != uid:
            logger.debug("left %s in %s alone: uid %d owns it, not this user", name,
                         SHM_DIR, owner)
            continue
        if _unlink(name):
            n += 1
    return n


def _unlink(name: str) -> bool:
    try:
        _posix().shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:        # PermissionError: not ours to remove
        logger.debug("could not unlink %s: %s", name, e)
        return False


_CMA: Any = None


def _process_vm_readv() -> Any:
    """libc's ``process_vm_readv`` through ctypes (the call releases the GIL), or None."""
    global _CMA
    if _CMA is None:
        import ctypes

        class IoVec(ctypes.Structure):
            _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.process_vm_readv
        except (OSError, AttributeError):
            _CMA = False
            return None
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                       ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
        _CMA = (fn, IoVec, ctypes)
    return _CMA or None


_PULL_CHUNK = 1 << 30


def _cma() -> tuple:
    """``(process_vm_readv, struct iovec, ctypes)``; OSError where the kernel has none."""
    cma = _process_vm_readv()
    if cma is None:
        raise OSError("process_vm_readv is not available")
    return cma


def pull(pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``remote_addr`` in process ``pid`` to ``local_addr`` here.

    Raises:
        OSError: the kernel refused or the peer is gone (errno says which).
    """
    fn, iovec, ctypes = _cma()
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _PULL_CHUNK)
        local = iovec(local_addr + done, n)
        remote = iovec(remote_addr + done, n)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got


#: the most iovecs one ``process_vm_readv`` takes (``IOV_MAX``: more is ``EINVAL``)
IOV_MAX = 1024


def row_runs(view: np.ndarray) -> np.ndarray:
    """The contiguous runs of ``view`` (its rows, or several rows merged where they touch) in
    its C order: an ``(n, 2)`` uint64 array of (address, length), laid out as ``n`` C
    ``struct iovec``. ``view``'s last dim is contiguous (the rows of a wider array)."""
    run, k = view.itemsize, view.ndim
    while k and (view.strides[k - 1] == run or view.shape[k - 1] == 1):
        run *= view.shape[k - 1]
        k -= 1
    offsets: np.ndarray = np.zeros(1, np.int64)
    for n, stride in zip(view.shape[:k], view.strides[:k]):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    runs: np.ndarray = np.empty((offsets.size, 2), np.uint64)
    runs[:, 0] = offsets + int(view.ctypes.data)
    runs[:, 1] = run
    return runs


def pull_rows(pid: int, runs: np.ndarray, remote_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``remote_addr`` in process ``pid`` into the local ``runs`` (from
    :func:`row_runs`, summing to ``nbytes``) in order: a local iovec per run, at most
    ``IOV_MAX`` of them per call, against one remote iovec (the message is contiguous
    there). The kernel scatters the bytes, so a strided destination is written once, with
    no staging. A short read (the kernel stops at a fault or at its per-call limit) goes on
    from where it stopped.

    Raises:
        OSError: the kernel refused or the peer is gone (errno says which).
    """
    fn, iovec, ctypes = _cma()
    assert ctypes.sizeof(iovec) == 16 and runs.dtype == np.uint64 and runs.shape[1:] == (2,)
    runs = np.array(runs, np.uint64, order="C")        # ours to advance past a short read
    done, i = 0, 0
    while i < len(runs) and done < nbytes:
        part = runs[i:i + IOV_MAX]
        want = int(part[:, 1].sum())
        remote = iovec(remote_addr + done, want)
        got = fn(pid, part.ctypes.data_as(ctypes.POINTER(iovec)), len(part),
                 ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got
        if got == want:
            i += len(part)
            continue
        filled = np.cumsum(part[:, 1].astype(np.int64))
        whole = int(np.searchsorted(filled, got, side="right"))    # runs read entirely
        i += whole
        into = got - (int(filled[whole - 1]) if whole else 0)      # bytes of the next one
        runs[i, 0] += np.uint64(into)
        runs[i, 1] -= np.uint64(into)
    if done != nbytes:
        raise OSError(0, f"process_vm_readv from pid {pid}: {done} of {nbytes} bytes landed "
                         f"in rows of {int(runs[:, 1].sum()) if len(runs) else 0}")


def can_pull(pid: int, remote_addr: int, expect: bytes) -> bool:
    """Whether ``pull`` reads ``expect`` at ``remote_addr`` in process ``pid`` (the probe)."""
    buf: np.ndarray = np.zeros(len(expect), np.uint8)
    try:
        pull(pid, int(buf.ctypes.data), remote_addr, len(expect))
    except OSError:
        return False
    return buf.tobytes() == expect


class Segment:
    """One mapped POSIX shared-memory segment: a header, then data."""

    __slots__ = ("name", "size", "mm", "arr", "linked", "created")

    def __init__(self, name: str, size: int, *, create: bool):
        posix = _posix()
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = posix.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                have = os.fstat(fd).st_size
                if have < size:
                    raise TransportError(f"shm segment {name!r} has {have} bytes, the record "
                                         f"says {size}")
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                _unlink(name)
            raise
        os.close(fd)
        self.name, self.size, self.created, self.linked = name, size, create, True
        self.arr = np.frombuffer(self.mm, np.uint8)
        if create:
            self.header[:] = (MAGIC, 0)

    @property
    def header(self) -> np.ndarray:
        return self.arr[:16].view(np.uint64)

    @property
    def address(self) -> int:
        return int(self.arr.ctypes.data)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            _unlink(self.name)

    def close(self) -> None:
        self.arr = None
        with contextlib.suppress(BufferError):   # views still alive: freed with them
            self.mm.close()


def probe_name(token: str) -> str:
    return f"xrp{token}"


def probe_path(token: str) -> str:
    """Where the probe of ``token`` shows in a process's maps."""
    return os.path.join(SHM_DIR, probe_name(token))


def create_probe(token: str) -> Segment | None:
    """A tiny segment holding ``token``: a peer that can read it shares this host's shm."""
    try:
        seg = Segment(probe_name(token), HEADER_BYTES + 64, create=True)
    except (OSError, ImportError):
        return None
    raw = token.encode()
    seg.arr[HEADER_BYTES:HEADER_BYTES + len(raw)] = np.frombuffer(raw, np.uint8)
    return seg


def read_probe(token: str) -> bool:
    """Whether the probe of ``token`` is visible here and holds that token."""
    try:
        seg = Segment(probe_name(token), HEADER_BYTES + 64, create=False)
    except (OSError, ImportError, TransportError):
        return False
    try:
        raw = token.encode()
        return bytes(seg.arr[HEADER_BYTES:HEADER_BYTES + len(raw)]) == raw
    finally:
        seg.close()


def as_numpy(buf: Any, rows: bool = False) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU buffer (numpy array or torch tensor);
    with ``rows``, a view whose last dim is contiguous (a row range of a wider array: a
    receive that lands in a destination region, ``ShmTransport.takes_views``) is returned
    as it is."""
    if isinstance(buf, np.ndarray):
        arr = buf
    elif hasattr(buf, "numpy") and hasattr(buf, "device"):
        if str(buf.device) != "cpu":
            raise TransportError(f"the shm transport moves CPU buffers, got one on {buf.device}; "
                                 f"GPU pairs go through cuda_ipc or nccl")
        arr = buf.detach().numpy()
    else:
        arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        if rows and arr.ndim > 1 and arr.strides[-1] == arr.itemsize:
            return arr
        # reshape would copy, and a receive would land in the copy
        raise TransportError(f"the shm transport moves contiguous buffers (or receives into "
                             f"rows whose last dim is contiguous), got one of shape "
                             f"{arr.shape} with strides {arr.strides}")
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = arr.reshape(-1).view(np.uint8)
    return arr
