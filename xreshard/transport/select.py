"""Choosing the transport between processes from the kinds of the world's ranks.

Decision record: a world moves bytes between processes over one transport, so the choice
is a property of the whole world, made once from every rank's device kind: NCCL when every
rank is a CUDA device, gloo when every rank is a CPU device. A mixed world is refused
rather than bridged. Staging GPU bytes through host memory would silently make a refit
several times slower, and the fix (put both sides on the same kind of device) belongs to
the user. Rejected: picking per pair of ranks (two transports in one group could deadlock,
each waiting inside its own group call), and inferring the kind from the local process
alone (every process must reach the same answer, so it is computed from the world's
metadata that every process holds).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import RefitError

__all__ = ["BACKENDS", "DEVICE_KINDS", "select_backend"]

#: device kind each backend moves
BACKENDS: dict[str, str] = {"nccl": "cuda", "gloo": "cpu"}
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (worlds have thousands of ranks)."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in (*ranks[1:], None):
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def select_backend(device_kinds: Sequence[str], requested: str = "auto") -> str:
    """The transport between the world's processes: ``"nccl"`` or ``"gloo"``.

    ``device_kinds[r]`` is rank ``r``'s kind, ``"cuda"`` or ``"cpu"`` (JAX's platform
    ``"gpu"`` is ``"cuda"`` here; map it first).

    | kinds         | "auto" | "nccl" | "gloo" |
    |---------------|--------|--------|--------|
    | all cuda      | nccl   | nccl   | error  |
    | all cpu       | gloo   | error  | gloo   |
    | cuda and cpu  | error  | error  | error  |

    Raises:
        RefitError: no ranks, an unknown kind or request, a mixed world, or a request the
            ranks cannot satisfy; the message says which ranks are which and what to do.
    """
    if requested not in ("auto", *BACKENDS):
        raise RefitError(f"unknown transport backend {requested!r}: expected 'auto', "
                         f"{', '.join(repr(b) for b in BACKENDS)}")
    kinds = list(device_kinds)
    if not kinds:
        raise RefitError("cannot select a transport for a world without ranks")
    by_kind: dict[str, list[int]] = {}
    for rank, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(rank)
    unknown = sorted(set(by_kind) - set(DEVICE_KINDS))
    if unknown:
        detail = "; ".join(f"ranks {_ranges(by_kind[k])} are {k!r}" for k in unknown)
        raise RefitError(f"unsupported device kind(s): {detail} - xreshard moves ranks on "
                         f"'cuda' (nccl) or 'cpu' (gloo) devices; JAX's platform 'gpu' is "
                         f"'cuda' here")
    present = sorted(by_kind, key=DEVICE_KINDS.index)
    table = "; ".join(f"ranks {_ranges(by_kind[k])} are {k!r}" for k in present)
    if len(present) > 1:
        wanted = f" ({requested!r} requested)" if requested != "auto" else ""
        raise RefitError(
            f"mixed world{wanted}: {table}. One world moves bytes over one transport - put "
            f"every rank on a GPU (nccl) or every rank on the CPU (gloo), e.g. give the JAX "
            f"trainer its CUDA devices instead of CPU devices, or join CPU ranks in a world of "
            f"their own")
    (kind,) = present
    if requested == "auto":
        return "nccl" if kind == "cuda" else "gloo"
    if BACKENDS[requested] != kind:
        other = "gloo" if requested == "nccl" else "nccl"
        raise RefitError(
            f"transport {requested!r} moves {BACKENDS[requested]!r} buffers, but {table} - "
            f"request {other!r} or 'auto' for this world")
    return requested
