"""Before an NCCL communicator exists: finding CuPy and NCCL, and the rendezvous.

Split out of ``nccl.py`` (the transport itself): what is installed (``cuda_major``,
``install_hint``, ``import_cupy``), what is visible (``visible_devices``), whether NCCL
takes two ranks of one GPU (``multi_rank_gpu``), and the store barrier every rank passes
before NCCL's init starts (``rendezvous``; see the decision record in ``nccl.py``, points
1 and 2). Nothing here needs a GPU except ``import_cupy``'s libnccl check; ``rendezvous``
is tested on CPU with a stub id maker.

One NCCL per process, torch's. torch's CUDA wheels depend on the NCCL wheel of their CUDA
major (``nvidia-nccl-cu13`` for CUDA 13), and ``nvidia-nccl-cu12`` and ``-cu13`` install the
same file, ``nvidia/nccl/lib/libnccl.so.2``: a CUDA 12 NCCL installed beside a CUDA 13
torch replaces torch's silently. So no xreshard extra brings an NCCL wheel where torch
brings one (pyproject.toml), ``import_cupy`` makes CuPy load the NCCL torch already loaded
(CuPy finds an already loaded ``libnccl.so.2`` first), and it refuses an install whose
NCCL file belongs to another CUDA major than the loaded torch's, saying how to repair it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..errors import RefitError
from .base import TransportError, TransportTimeout

__all__ = ["MULTI_RANK_MIN_VERSION", "NCCL_UNIQUE_ID_BYTES", "NoCudaDeviceError", "cuda_major",
           "format_version", "import_cupy", "install_hint", "loaded_nccl_paths",
           "multi_rank_gpu", "nccl_wheel_clash", "ranks_str", "rendezvous", "torch_nccl",
           "visible_devices"]

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128
#: NCCL takes several ranks of one GPU from 2.30 on, when NCCL_MULTI_RANK_GPU_ENABLE=1
#: (NVIDIA/nccl src/init.cc and src/graph/topo.cc ``ncclCheckMultiRank``, v2.30.3-1)
MULTI_RANK_MIN_VERSION = 23000


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
        return (f"pip install 'xreshard[gpu-cu{major}]' beside a torch or JAX built for CUDA "
                f"{major} (CuPy and NVRTC: cupy-cuda{major}x, cuda-toolkit[nvrtc,cudart]=="
                f"{major}.*; NCCL is the one torch/JAX bring), or 'xreshard[nccl-cu{major}]' "
                f"where neither is installed (adds nvidia-nccl-cu{major})")
    return ("pip install 'xreshard[gpu-cu13]' beside a CUDA 13 torch or JAX, "
            "'xreshard[gpu-cu12]' beside a CUDA 12 one (NCCL is the one they bring), or "
            "'xreshard[nccl-cu13]' / 'xreshard[nccl-cu12]' where neither is installed; pick "
            "the CUDA major of your torch build (torch.version.cuda)")


def torch_nccl() -> tuple[int, str] | None:
    """(NCCL version code, torch's CUDA version) of the torch loaded in this process, when
    it is a CUDA build; None otherwise. Never imports torch."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if torch is None or not cuda:
        return None
    try:
        import importlib
        got = importlib.import_module("torch.cuda.nccl").version()    # torch is loaded
    except Exception:       # noqa: BLE001 - a torch built without NCCL
        return None
    if isinstance(got, int):
        return got, str(cuda)
    major, minor, patch = (int(x) for x in tuple(got)[:3])
    return major * 10000 + minor * 100 + patch, str(cuda)


def loaded_nccl_paths() -> list[str]:
    """Paths of every ``libnccl.so`` mapped into this process (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({ln.split(None, 5)[5] for ln in maps.splitlines()
                   if "libnccl.so" in ln and len(ln.split(None, 5)) == 6})


def nccl_wheel_clash(torch_cuda: str | None, paths: Iterable[str] | None = None) -> str | None:
    """Why the installed ``libnccl.so.2`` is not the NCCL of the loaded torch's CUDA major,
    or None. Both ``nvidia-nccl-cu12`` and ``-cu13`` install ``nvidia/nccl/lib/libnccl.so.2``;
    the file on disk is the last one installed, told apart by the sha256 in each wheel's
    RECORD.

    Args:
        torch_cuda: the loaded torch's CUDA version (``torch.version.cuda``), or None.
        paths: where to look for installed distributions (default: ``sys.path``).
    """
    if not torch_cuda:
        return None
    import importlib.metadata as md
    want = int(str(torch_cuda).split(".")[0])
    dists: dict[int, md.Distribution] = {}
    for d in md.distributions() if paths is None else md.distributions(path=list(paths)):
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name in ("nvidia-nccl-cu12", "nvidia-nccl-cu13"):
            dists.setdefault(int(name[-2:]), d)
    if len(dists) < 2:
        return None
    owner = None
    for major, d in sorted(dists.items()):
        for f in d.files or ():
            if str(f).endswith("nvidia/nccl/lib/libnccl.so.2") and f.hash is not None:
                located = Path(str(d.locate_file(f)))
                if located.exists() and _sha256(located) == f.hash.value:
                    owner = major
    if owner is None or owner == want:
        return None
    other = dists[owner].version
    pin = dists[want].version
    return (f"the loaded torch is built for CUDA {torch_cuda} and needs nvidia-nccl-cu{want} "
            f"({pin} installed), but nvidia/nccl/lib/libnccl.so.2 on disk is "
            f"nvidia-nccl-cu{owner} {other}'s, installed after it (both wheels write that "
            f"file; an extra such as xreshard[nccl] or [nccl-cu{owner}] beside this torch "
            f"does it). Repair: pip uninstall -y nvidia-nccl-cu{owner} && pip install "
            f"--force-reinstall --no-deps nvidia-nccl-cu{want}=={pin}; then install "
            f"'xreshard[gpu-cu{want}]', which brings no NCCL")


@functools.lru_cache(maxsize=4)
def _sha256(path: Path) -> str:
    import base64
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def multi_rank_gpu(version: int, env: Any = None) -> tuple[bool, str]:
    """Whether this process's NCCL (``version`` code) takes several ranks of one GPU in a
    communicator, and when not, what it would take (for the refusal's message).

    NCCL >= 2.30 does with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` in every process (it then turns
    NVLS off); before 2.30 it refuses ("Duplicate GPU detected").
    """
    env = os.environ if env is None else env
    raw = str(env.get("NCCL_MULTI_RANK_GPU_ENABLE", "")).strip()
    try:
        enabled = int(raw or "0") != 0
    except ValueError:
        enabled = False
    supported = version >= MULTI_RANK_MIN_VERSION
    have = f"NCCL {format_version(version)}" if version else "this NCCL"
    if enabled and supported:
        return True, ""
    if enabled:
        return False, (f"NCCL_MULTI_RANK_GPU_ENABLE=1 is set, but {have} predates 2.30 and "
                       f"allows one rank per GPU in a communicator: install NCCL >= 2.30 "
                       f"(the NCCL of your torch build), or give each rank a GPU of its own")
    if supported:
        return False, (f"{have} allows several ranks on one GPU only with "
                       f"NCCL_MULTI_RANK_GPU_ENABLE=1 set in every process of the refit "
                       f"(NVLS is then off); set it, or give each rank a GPU of its own")
    return False, (f"{have} allows one rank per GPU in a communicator (NCCL >= 2.30 allows "
                   f"more with NCCL_MULTI_RANK_GPU_ENABLE=1); give each rank a GPU of its own")


def import_cupy() -> tuple[Any, Any]:
    """CuPy and its NCCL binding, over the NCCL the loaded torch uses (see the module).

    Raises:
        ImportError: no CuPy, no NCCL, or an NCCL file of another CUDA major than the
            loaded torch's (says how to repair the install).
    """
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"the nccl transport needs CuPy: {install_hint()}") from e
    torch = torch_nccl()
    if torch is not None and "cupy.cuda.nccl" not in sys.modules:
        clash = nccl_wheel_clash(torch[1])
        if clash:
            raise ImportError(f"the nccl transport cannot use this install's NCCL: {clash}")
        import ctypes
        for path in loaded_nccl_paths():      # torch's: CuPy then finds it loaded
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
    from cupy.cuda import nccl      # CuPy loads an already loaded libnccl first, else a wheel's
    if torch is not None and getattr(nccl, "available", False) and \
            int(nccl.get_version()) != torch[0]:
        logger.warning("two NCCLs in this process: torch's %s and CuPy's %s (torch built "
                       "with NCCL linked in, or CuPy loaded before torch); they work side "
                       "by side, but mismatched versions across a refit's processes can hang",
                       format_version(torch[0]), format_version(int(nccl.get_version())))
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
