"""Before an NCCL communicator exists: finding CuPy and NCCL, and the rendezvous.

Split out of ``nccl.py`` (the transport itself): what is installed (``cuda_major``,
``install_hint``, ``import_cupy``), what is visible (``visible_devices``), and the store
barrier every rank passes before NCCL's init starts (``rendezvous``; see the decision
record in ``nccl.py``, points 1 and 2). Nothing here needs a GPU except ``import_cupy``'s
libnccl check; ``rendezvous`` is tested on CPU with a stub id maker.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Sequence

from ..errors import RefitError
from .base import TransportError, TransportTimeout

__all__ = ["NCCL_UNIQUE_ID_BYTES", "NoCudaDeviceError", "cuda_major", "format_version",
           "import_cupy", "install_hint", "ranks_str", "rendezvous", "visible_devices"]

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128


class NoCudaDeviceError(RefitError):
    """The nccl transport was asked for where no CUDA device is visible."""


def cuda_major() -> int | None:
    """The CUDA major version the installed CuPy wheel is built for (12, 13), else None.

    Read from the wheel's distribution name (``cupy-cuda13x``), which needs neither a GPU
    nor importing CuPy; a source build of CuPy (``cupy``) says nothing, so None.
    """
    import importlib.metadata as md
    for major in (13, 12):
        try:
            md.version(f"cupy-cuda{major}x")
            return major
        except md.PackageNotFoundError:
            continue
    return None


def install_hint(major: int | None = None) -> str:
    """What to pip install for the GPU path, for the installed CUDA major (or both)."""
    major = cuda_major() if major is None else major
    if major in (12, 13):
        return (f"pip install 'xreshard[nccl-cu{major}]' (CuPy, NCCL and NVRTC for CUDA "
                f"{major}: cupy-cuda{major}x, nvidia-nccl-cu{major}, "
                f"cuda-toolkit[nvrtc,cudart]=={major}.*)")
    return ("pip install 'xreshard[nccl-cu13]' for CUDA 13 or 'xreshard[nccl-cu12]' for CUDA "
            "12 (cupy-cuda13x + nvidia-nccl-cu13, or cupy-cuda12x + nvidia-nccl-cu12); pick "
            "the CUDA major of your driver and torch build (torch.version.cuda)")


def import_cupy() -> tuple[Any, Any]:
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"the nccl transport needs CuPy: {install_hint()}") from e
    from cupy.cuda import nccl      # CuPy loads whichever libnccl is installed (wheel first)
    if not getattr(nccl, "available", False):
        major = cuda_major()
        wheel = f"nvidia-nccl-cu{major}" if major else "nvidia-nccl-cu13 or nvidia-nccl-cu12"
        raise ImportError(f"the nccl transport needs CuPy with NCCL, but CuPy {cupy.__version__} "
                          f"could not load libnccl: pip install {wheel}, or "
                          f"{install_hint(major)}")
    return cupy, nccl


def visible_devices(cupy: Any) -> tuple[int, str]:
    """(number of CUDA devices CuPy sees, why none when 0)."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:          # CUDARuntimeError: no driver, driver too old, no device
        return 0, f"{type(e).__name__}: {e}"
    return count, "cudaGetDeviceCount() returned 0"


def format_version(code: int) -> str:
    if code >= 20900:               # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


# ---------------------------------------------------------------------------- rendezvous

def _encode_id(raw: Any) -> bytes:
    """CuPy's unique id (``bytes`` in CuPy 14, a tuple of signed chars before) -> bytes."""
    data = bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(int(b) & 0xFF for b in raw)
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise TransportError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got "
                             f"{len(data)}")
    return data


def _store_wait(store: Any, keys: Sequence[str], deadline: float) -> list[str]:
    """Wait until every key exists; returns the keys still missing at ``deadline``.

    Uses ``store.check(keys)`` (torch ``TCPStore``) to poll. A store without ``check`` is
    read with ``get``, whose bound is the store's own timeout.
    """
    check = getattr(store, "check", None)
    if check is None:
        for key in keys:
            store.get(key)
        return []
    interval = 0.005
    while not check(list(keys)):
        if time.monotonic() >= deadline:
            return [k for k in keys if not check([k])]
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 2, 0.1)
    return []


def ranks_str(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def rendezvous(store: Any, key: str, world_size: int, local_ranks: Sequence[int],
               timeout: float, *, make_id: Callable[[], Any] | None = None) -> bytes:
    """Share the NCCL unique id of one communicator and wait until every rank arrived.

    The process hosting rank 0 creates the id and stores it under ``{key}/id`` as JSON
    text (hex id, world size, NCCL version), never pickle. Every process then posts
    ``{key}/arrived/{rank}`` for its ranks and waits for all ``world_size`` of them. So
    when NCCL's init starts, every rank is known to be alive and about to call it.

    Args:
        store: a key-value store with ``set(key, bytes)`` and ``get(key)`` (torch
            ``TCPStore``); with ``check(keys)`` too, waits end at the deadline.
        key: a prefix unique to this communicator: every creation needs a fresh one.
        world_size: ranks in the communicator.
        local_ranks: the ranks this process hosts.
        timeout: seconds to wait, in all.
        make_id: creates the unique id; default ``cupy.cuda.nccl.get_unique_id``.

    Returns:
        The 128-byte NCCL unique id, identical in every process.

    Raises:
        TransportTimeout: rank 0's process never published the id, or some ranks never
            arrived; names them.
        RefitError: the id was made for another world size.
    """
    deadline = time.monotonic() + timeout
    local = sorted(local_ranks)
    id_key = f"{key}/id"
    if 0 in local:
        if make_id is None:
            _, nccl = import_cupy()
            make_id, version = nccl.get_unique_id, int(nccl.get_version())
        else:
            version = 0
        raw = _encode_id(make_id())
        store.set(id_key, json.dumps({"nccl_unique_id": raw.hex(), "world_size": world_size,
                                      "nccl_version": version}).encode())
    else:
        if _store_wait(store, [id_key], deadline):
            raise TransportTimeout(
                f"nccl rendezvous {key!r} on rank(s) {ranks_str(local)} timed out after "
                f"{timeout} s: the process hosting rank 0 never published the NCCL unique "
                f"id (store key {id_key!r}) - start it, and check that every process uses "
                f"the same store and key")
        record = json.loads(store.get(id_key))
        raw = bytes.fromhex(record["nccl_unique_id"])
        if record["world_size"] != world_size:
            raise RefitError(f"nccl rendezvous {key!r}: rank 0 made the communicator for "
                             f"{record['world_size']} ranks, but ranks {ranks_str(local)} "
                             f"expect {world_size} - every process must pass the same "
                             f"world size")
        _warn_version_mismatch(record.get("nccl_version", 0), local)
    for rank in local:
        store.set(f"{key}/arrived/{rank}", json.dumps(
            {"rank": rank, "pid": os.getpid()}).encode())
    keys = [f"{key}/arrived/{r}" for r in range(world_size)]
    missing = _store_wait(store, keys, deadline)
    if missing:
        absent = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
        raise TransportTimeout(
            f"nccl rendezvous {key!r} on rank(s) {ranks_str(local)} timed out after "
            f"{timeout} s: rank(s) {ranks_str(absent)} never arrived - start the "
            f"processes hosting them, or check that they use the same store and key")
    return raw


def _warn_version_mismatch(rank0_version: int, local: Sequence[int]) -> None:
    if not rank0_version:
        return
    try:
        _, nccl = import_cupy()
        mine = int(nccl.get_version())
    except ImportError:
        return
    if mine != rank0_version:
        logger.warning("NCCL %s on ranks %s but %s on rank 0: NCCL versions should match "
                       "across a communicator (mismatches can hang)", format_version(mine),
                       list(local), format_version(rank0_version))
