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
configuration. A grow (``ncclCommGrow``, NVIDIA/nccl ``src/nccl.h.in``): one existing rank
makes a single-use id from its communicator (``ncclCommGetUniqueId``) and shares it; the
existing ranks call ``ncclCommGrow(comm, size, id or NULL, -1)``, the new ones
``ncclCommGrow(NULL, size, id, rank)``; existing ranks keep their numbers, the new ones
follow.

Nothing here needs a GPU but the calls themselves; the tests drive ``Library`` with a
fake of the C functions.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from ..errors import RefitError
from .base import TransportError, TransportTimeout
from .nccl_setup import NCCL_UNIQUE_ID_BYTES as UNIQUE_ID_BYTES

__all__ = ["GROW_MIN_VERSION", "Library", "Pending", "RawComm", "Resizable", "SHRINK_ABORT",
           "SHRINK_MIN_VERSION", "SPLIT_MIN_VERSION", "loaded_library", "nccl_abilities"]

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

    def shrink(self, comm: int, excluded: Sequence[int], abort: bool) -> Pending:
        """``ncclCommShrink`` of communicator handle ``comm`` without the ranks
        ``excluded`` (sorted by NCCL), aborting the parent's pending work when ``abort``;
        the parent stays valid (the caller destroys or aborts it). Inside an NCCL group
        the new communicator exists only once the outer ``groupEnd`` returned (NCCL
        ``ncclCommInitChildComm`` leaves ``*newcomm`` NULL and defers the child's init to
        the group), so this returns a :class:`Pending`, read after that."""
        ranks = (ctypes.c_int * len(excluded))(*excluded)
        new = ctypes.c_void_p(0)
        self._check(self._lib.ncclCommShrink(
            ctypes.c_void_p(comm), ranks, ctypes.c_int(len(excluded)), ctypes.byref(new),
            None, ctypes.c_int(SHRINK_ABORT if abort else SHRINK_DEFAULT)), "ncclCommShrink")
        return Pending(self, new, "ncclCommShrink")


    def unique_id(self, comm: int) -> bytes:
        """``ncclCommGetUniqueId``: the single-use id a grow of communicator ``comm``
        rendezvous on (one unconsumed id per communicator at a time)."""
        out = (ctypes.c_char * UNIQUE_ID_BYTES)()
        self._check(self._lib.ncclCommGetUniqueId(ctypes.c_void_p(comm), ctypes.byref(out)),
                    "ncclCommGetUniqueId")
        return bytes(out.raw)

    def grow(self, comm: int | None, size: int, uid: bytes | None, rank: int) -> RawComm:
        """``ncclCommGrow`` to ``size`` ranks. An existing member passes its ``comm`` and
        ``rank=-1`` (the one that made ``uid`` passes it, the others None); a new member
        passes ``comm=None``, ``uid`` and its new rank. Existing ranks keep their numbers."""
        if uid is not None and len(uid) != UNIQUE_ID_BYTES:
            raise TransportError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        ident = None if uid is None else ctypes.byref(
            (ctypes.c_char * UNIQUE_ID_BYTES).from_buffer_copy(uid))
        new = ctypes.c_void_p(0)
        self._check(self._lib.ncclCommGrow(
            ctypes.c_void_p(comm or 0), ctypes.c_int(size), ident, ctypes.c_int(rank),
            ctypes.byref(new), None), "ncclCommGrow")
        if not new.value:
            raise TransportError("ncclCommGrow returned no communicator")
        return RawComm(self, new.value)


class Pending:
    """The ``ncclComm_t*`` a shrink or grow writes into, held (NCCL writes it during the
    outer ``groupEnd``) until :meth:`result` reads it after the group ended."""

    def __init__(self, library: Library, holder: ctypes.c_void_p, what: str):
        self._library, self._holder, self._what = library, holder, what

    def result(self) -> RawComm:
        """The communicator NCCL made; after the group that issued the call ended."""
        if not self._holder.value:
            raise TransportError(f"{self._what} returned no communicator")
        return RawComm(self._library, self._holder.value)


def resolved(made: Any) -> Any:
    """``made`` itself, or the communicator a :class:`Pending` holds."""
    return made.result() if isinstance(made, Pending) else made


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


_GRACE_S = 10.0     # how long aborting a shrunk parent may take before it is abandoned


def _usable_library(what: str) -> Library:
    library = loaded_library()
    ability = "shrink" if what == "ncclCommShrink" else "grow"
    if library is None or not getattr(library.abilities(), ability):
        need = "2.27" if ability == "shrink" else "2.29"
        raise TransportError(f"{what} is not in the loaded NCCL (needs {need}+)")
    return library


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a daemon thread, at most ``timeout`` s (a call stuck inside NCCL must
    not hold the caller or process exit)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:      # delivered to the waiting caller
            fut.set_exception(e)
    threading.Thread(target=run, name=f"xreshard-{what}", daemon=True).start()
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TransportTimeout(f"{what} did not complete within {timeout} s; "
                               "abandoned") from None


class Resizable:
    """``NcclTransport``'s communicator across a change of members: shrunk, grown, or
    joined by growing (a new member's side). Each returns a new transport and closes the
    old one; every call is collective over the ranks the library names."""

    _store: Any
    _local: tuple[int, ...]
    _devices: dict[int, int]
    _comms: dict[int, Any]
    _nccl: Any
    _worker: Any
    _broken: str | None
    _where: str
    key: str
    world_size: int

    def _check_usable(self) -> None: ...
    def _abort_comms(self) -> None: ...
    def close(self) -> None: ...

    def shrunk(self, excluded: Sequence[int], abort: bool, key: str, timeout: float) -> Any:
        """This communicator without ranks ``excluded`` (``ncclCommShrink`` of every local
        rank, in one NCCL group; ``abort``: an excluded rank died, its pending work is
        aborted first), as a new transport over ranks 0..n-1 (the others in their order);
        this one is closed. Collective over the remaining ranks; excluded ranks must not
        call it."""
        self._check_usable()
        library = _usable_library("ncclCommShrink")
        local = [r for r in self._local if r not in set(excluded)]
        try:
            made = self._in_group(lambda r: library.shrink(self._comms[r].comm, excluded,
                                                           abort), local, timeout)
        except concurrent.futures.TimeoutError:
            self._broken = "its ncclCommShrink timed out"
            raise TransportTimeout(f"ncclCommShrink ({self.key!r} -> {key!r}) on "
                                   f"{self._where} did not complete within {timeout} s; "
                                   "abandoned") from None
        keep = [r for r in range(self.world_size) if r not in set(excluded)]
        index = {r: i for i, r in enumerate(keep)}
        shrunk = type(self)(self._store, len(keep),  # type: ignore[call-arg]
                            {index[r]: self._devices[r] for r in local}, key=key,
                            timeout=timeout, comms={index[r]: made[r] for r in local})
        if abort:       # a member died: destroying the parent could wait for it
            self._broken = "shrunk away; the parent was aborted"
            with contextlib.suppress(Exception):
                self._worker.submit(self._abort_comms).result(timeout=_GRACE_S)
        self.close()
        return shrunk

    def grown(self, size: int, key: str, timeout: float) -> Any:
        """This communicator grown to ``size`` ranks (``ncclCommGrow``): its ranks keep
        their numbers; the new members take ranks ``world_size..size-1`` and call
        :meth:`joined_by_grow` with the same ``key`` at the same time. The process of rank
        0 makes the single-use id and shares it through the store (``key``); this one is
        closed."""
        from .nccl_setup import rendezvous
        self._check_usable()
        if size <= self.world_size:
            raise RefitError(f"a grow needs more than the {self.world_size} ranks the "
                             f"communicator has, got {size}")
        library = _usable_library("ncclCommGrow")
        uid = rendezvous(self._store, key, size, self._local, timeout,
                         make_id=lambda: library.unique_id(self._comms[0].comm))
        try:
            made = self._in_group(lambda r: library.grow(
                self._comms[r].comm, size, uid if r == 0 else None, -1), self._local, timeout)
        except concurrent.futures.TimeoutError:
            self._broken = "its ncclCommGrow timed out"
            raise TransportTimeout(f"ncclCommGrow ({self.key!r} -> {key!r}) on {self._where} "
                                   f"did not complete within {timeout} s; abandoned") from None
        grown = type(self)(self._store, size, dict(self._devices),  # type: ignore[call-arg]
                           key=key, timeout=timeout, comms=made)
        self.close()
        return grown

    @classmethod
    def joined_by_grow(cls, store: Any, size: int, devices: Mapping[int, int], key: str,
                       timeout: float) -> Any:
        """A new member's side of :meth:`grown`: its ranks (``devices``: new rank -> CUDA
        ordinal, all past the old communicator's) join the grown communicator."""
        from .nccl_setup import import_cupy, rendezvous
        library = _usable_library("ncclCommGrow")
        cupy, nccl = import_cupy()
        local = sorted(devices)
        uid = rendezvous(store, key, size, local, timeout)

        def run() -> dict[int, Any]:
            made: dict[int, Any] = {}
            nccl.groupStart()
            try:
                for r in local:
                    with cupy.cuda.Device(devices[r]):
                        made[r] = library.grow(None, size, uid, r)
            finally:
                nccl.groupEnd()
            return made
        made = _bounded(run, timeout, f"ncclCommGrow ({key!r}, new ranks {local})")
        # its own name in this process (a process may hold both sides: the GPU test)
        return cls(store, size, devices, key=f"{key}/joined",  # type: ignore[call-arg]
                   timeout=timeout, comms=made)

    def _in_group(self, call: Callable[[int], Any], ranks: Sequence[int], timeout: float
                  ) -> dict[int, Any]:
        """``call(rank)`` for each local rank in one NCCL group, on the transport's worker
        (NCCL's group state is per thread); at most ``timeout`` s."""
        def run() -> dict[int, Any]:
            self._nccl.groupStart()
            try:
                made = {r: call(r) for r in ranks}
            finally:
                self._nccl.groupEnd()
            # NCCL fills a shrunk communicator only at the outer groupEnd: read it now
            return {r: resolved(m) for r, m in made.items()}
        return self._worker.submit(run).result(timeout=timeout)
