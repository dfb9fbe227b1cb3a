"""NCCL communicators across a change of members: what the loaded NCCL can do, and
shrinking a communicator through it.

Decision record. NCCL shrinks a communicator from 2.27 (``ncclCommShrink``; with
``NCCL_SHRINK_ABORT`` it first aborts the parent's pending work, for members that died),
grows one from 2.29 (``ncclCommGrow``, with a single-use id from
``ncclCommGetUniqueId``) and splits one from 2.18 (``ncclCommSplit``). What counts is the
library *loaded in this process* (torch's, which CuPy then uses: ``nccl_setup``), so
``nccl_abilities`` reads its version and looks its symbols up; the header of a wheel on
disk says nothing about it. CuPy 14's binding wraps ``ncclCommSplit`` only (no shrink,
no grow, and no way to wrap a raw ``ncclComm_t`` in its ``NcclCommunicator``), so shrink
calls the loaded library through ctypes and the result is a :class:`RawComm`, which has
the few methods the transport calls on CuPy's communicators (send, recv,
check_async_error, abort, destroy) over the same library.

Rules from NCCL's source (NVIDIA/nccl ``src/init.cc``, ``ncclCommInitChildComm``,
``ncclCommShrink``): the excluded ranks must not call ``ncclCommShrink``; the others call
it together (inside one group when a thread drives several of its ranks); the new ranks
close the gaps in the old order; with ``config=NULL`` the child inherits the parent's
configuration. Growing is decided (``comm_epochs``) but not executed here yet: the world
creates a grown member set anew.

Nothing here needs a GPU but the calls themselves; the tests drive ``Library`` with a
fake of the C functions.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Sequence

from .base import TransportError

__all__ = ["GROW_MIN_VERSION", "Library", "RawComm", "SHRINK_ABORT", "SHRINK_MIN_VERSION",
           "SPLIT_MIN_VERSION", "loaded_library", "nccl_abilities"]

logger = logging.getLogger(__name__)

SPLIT_MIN_VERSION = 21800       # ncclCommSplit
SHRINK_MIN_VERSION = 22700      # ncclCommShrink (NCCL 2.27)
GROW_MIN_VERSION = 22900        # ncclCommGrow, ncclCommGetUniqueId (NCCL 2.29)
SHRINK_DEFAULT = 0              # nccl.h: NCCL_SHRINK_DEFAULT
SHRINK_ABORT = 1                # nccl.h: NCCL_SHRINK_ABORT


def nccl_abilities(version: int, has: Callable[[str], bool]) -> Any:
    """What the NCCL of ``version`` (code, e.g. 23203) whose symbols ``has`` finds can do
    to an existing communicator (a ``comm_epochs.Abilities``)."""
    from ..runtime.comm_epochs import Abilities     # pure; the transports' layer stays below
    return Abilities(
        shrink=version >= SHRINK_MIN_VERSION and has("ncclCommShrink"),
        grow=version >= GROW_MIN_VERSION and has("ncclCommGrow") and has("ncclCommGetUniqueId"),
        split=version >= SPLIT_MIN_VERSION and has("ncclCommSplit"), name="nccl")


def loaded_library() -> Library | None:
    """The NCCL loaded in this process (CuPy's binding imported first), or None."""
    from .nccl_setup import loaded_nccl_paths
    for path in loaded_nccl_paths():
        try:
            lib = ctypes.CDLL(path)     # the loaded one: dlopen finds it by its path
        except OSError:
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p    # not the default int
        return Library(lib)
    return None


class Library:
    """The few NCCL entry points a change of members needs, over a loaded ``libnccl``
    (a ``ctypes.CDLL``, or a fake with the same attributes)."""

    def __init__(self, lib: Any):
        self._lib = lib

    def has(self, symbol: str) -> bool:
        return hasattr(self._lib, symbol)

    def version(self) -> int:
        code = ctypes.c_int(0)
        self._check(self._lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
        return code.value

    def abilities(self) -> Any:
        return nccl_abilities(self.version(), self.has)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            try:
                text = self._lib.ncclGetErrorString(ctypes.c_int(status))
                text = text.decode() if isinstance(text, bytes) else str(text)
            except Exception:       # noqa: BLE001 - the status alone still says it
                text = "unknown"
            raise TransportError(f"{what} failed: NCCL error {status} ({text})")

    def shrink(self, comm: int, excluded: Sequence[int], abort: bool) -> RawComm:
        """``ncclCommShrink`` of communicator handle ``comm`` without the ranks
        ``excluded`` (sorted by NCCL), aborting the parent's pending work when ``abort``;
        the parent stays valid (the caller destroys or aborts it)."""
        ranks = (ctypes.c_int * len(excluded))(*excluded)
        new = ctypes.c_void_p(0)
        self._check(self._lib.ncclCommShrink(
            ctypes.c_void_p(comm), ranks, ctypes.c_int(len(excluded)), ctypes.byref(new),
            None, ctypes.c_int(SHRINK_ABORT if abort else SHRINK_DEFAULT)), "ncclCommShrink")
        if not new.value:
            raise TransportError("ncclCommShrink returned no communicator")
        return RawComm(self, new.value)


class RawComm:
    """A communicator NCCL made without CuPy (a shrink's result): the methods the nccl
    transport calls on CuPy's ``NcclCommunicator``, through the same library."""

    def __init__(self, library: Library, handle: int):
        self._library, self._handle = library, handle

    @property
    def comm(self) -> int:
        """The raw ``ncclComm_t`` (0 once destroyed or aborted), as CuPy's ``comm``."""
        return self._handle

    def _call(self, name: str, *args: Any) -> None:
        if not self._handle:
            raise TransportError(f"{name} on a destroyed communicator")
        lib = self._library._lib
        self._library._check(getattr(lib, name)(*args), name)

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._call("ncclSend", ctypes.c_void_p(ptr), ctypes.c_size_t(count),
                   ctypes.c_int(dtype), ctypes.c_int(peer), ctypes.c_void_p(self._handle),
                   ctypes.c_void_p(stream))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._call("ncclRecv", ctypes.c_void_p(ptr), ctypes.c_size_t(count),
                   ctypes.c_int(dtype), ctypes.c_int(peer), ctypes.c_void_p(self._handle),
                   ctypes.c_void_p(stream))

    def check_async_error(self) -> None:
        status = ctypes.c_int(0)
        self._call("ncclCommGetAsyncError", ctypes.c_void_p(self._handle),
                   ctypes.byref(status))
        self._library._check(status.value, "an asynchronous NCCL operation")

    def abort(self) -> None:
        if self._handle:
            handle, self._handle = self._handle, 0
            self._library._lib.ncclCommAbort(ctypes.c_void_p(handle))

    def destroy(self) -> None:
        if self._handle:
            handle, self._handle = self._handle, 0
            self._library._lib.ncclCommDestroy(ctypes.c_void_p(handle))
