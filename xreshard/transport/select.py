"""Choosing the transports of a world: one cross-process kind, and a fast path per pair.

Decision record: every pair of ranks in different processes needs *some* transport, and
the world keeps one that reaches every pair: NCCL when every rank is a CUDA device, gloo
when every rank is a CPU device (``select_backend``). A mixed world is refused rather than
bridged: staging GPU bytes through host memory would silently make a refit several times
slower, and the fix (put both sides on the same kind of device) belongs to the user.

On top of it, pairs that share memory take a shortcut (``choose_routes``): processes of
one host exchange CPU bytes through POSIX shared memory (``shm``), and CUDA ranks on the
same GPU, or on GPUs the receiver can reach by peer access, through CUDA IPC handles
(``cuda_ipc``). The choice is per process pair (per device pair on GPU) and is computed
from metadata every process holds (the hosts the processes joined with, and what each
process could open of the others' probes), so every process reaches the same answer for
every pair. Several transports in one group cannot deadlock because each one starts its
posts when they are made and its group exit waits only on its own peers' posts and exits;
``RoutedTransport`` exits them in one fixed order in every process.
Rejected: one transport for the whole world (shared memory and IPC pairs would crawl
through TCP loopback, and NCCL refuses two ranks on one GPU); inferring the kind from the
local process alone (processes could disagree about a pair).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import RefitError

__all__ = ["BACKENDS", "DEVICE_KINDS", "FAST_PATHS", "KINDS", "Routes", "choose_routes",
           "select_backend"]

#: device kind each backend moves
BACKENDS: dict[str, str] = {"nccl": "cuda", "gloo": "cpu"}
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")
#: same-host shortcuts and the device kind each moves
FAST_PATHS: dict[str, str] = {"shm": "cpu", "cuda_ipc": "cuda"}
#: every transport kind, in the order a routed group exits them (see ``RoutedTransport``)
KINDS: tuple[str, ...] = ("local", "shm", "cuda_ipc", "gloo", "nccl")


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


@dataclass
class Routes:
    """Which transport moves each pair of ranks; the same object in every process.

    Built by ``choose_routes`` from every process's capabilities. ``kind(src, dst)`` is
    "local" inside a process, "shm"/"cuda_ipc" for pairs with a fast path, else ``cross``.
    """

    rank_process: tuple[int, ...]
    rank_kind: tuple[str, ...]
    cross: str
    shm_pairs: frozenset[tuple[int, int]]            # process pairs (p, q), p < q
    rank_device: tuple[str | None, ...]              # CUDA uuid per rank, None on CPU
    ipc_reach: tuple[frozenset[str], ...]            # per process: device uuids it can read
    requested: str = "auto"
    _cache: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)
    _reps_cache: list[dict[str | None, int]] | None = field(default=None, repr=False)

    def kind(self, src_rank: int, dst_rank: int) -> str:
        key = (src_rank, dst_rank)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._kind(src_rank, dst_rank)
        return got

    def _kind(self, src_rank: int, dst_rank: int) -> str:
        p, q = self.rank_process[src_rank], self.rank_process[dst_rank]
        if p == q:
            return "local"
        if self.requested in BACKENDS:
            return self.cross
        if self.rank_kind[src_rank] == "cpu":
            if (min(p, q), max(p, q)) in self.shm_pairs:
                return "shm"
        elif self.ipc_ok(src_rank, dst_rank):
            return "cuda_ipc"
        return self.cross

    def ipc_ok(self, src_rank: int, dst_rank: int) -> bool:
        """Both ranks on CUDA devices that both processes can read (same GPU, or peer
        access from each side to the other's device)."""
        a, b = self.rank_device[src_rank], self.rank_device[dst_rank]
        if a is None or b is None:
            return False
        p, q = self.rank_process[src_rank], self.rank_process[dst_rank]
        return a == b or (a in self.ipc_reach[q] and b in self.ipc_reach[p])

    def representatives(self) -> list[dict[str | None, int]]:
        """Per process: one representative rank per device (all CPU ranks share ``None``)."""
        if self._reps_cache is None:
            reps: list[dict[str | None, int]] = [
                {} for _ in range(max(self.rank_process, default=-1) + 1)]
            for r, p in enumerate(self.rank_process):
                reps[p].setdefault(self.rank_device[r], r)
            self._reps_cache = reps
        return self._reps_cache

    def process_kind(self, p: int, q: int) -> set[str]:
        """The kinds moving between processes ``p`` and ``q`` (several on multi-GPU hosts)."""
        if p == q:
            return {"local"}
        reps = self.representatives()
        return {self.kind(a, b) for a in reps[p].values() for b in reps[q].values()}

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every kind some pair uses, in ``KINDS`` order (the same tuple in every process)."""
        used: set[str] = set()
        n = len(self.representatives())
        if len(self.rank_process) > len(set(self.rank_process)):
            used.add("local")
        if n > 1 and self.requested in BACKENDS:
            used.add(self.cross)
        elif n > 1 and "cuda" not in self.rank_kind:
            # CPU worlds: count pairs instead of asking each (thousands of processes)
            if self.shm_pairs:
                used.add("shm")
            if len(self.shm_pairs) < n * (n - 1) // 2:
                used.add(self.cross)
        for p in range(n if "cuda" in self.rank_kind and self.requested not in BACKENDS
                       else 0):
            for q in range(p + 1, n):
                used |= self.process_kind(p, q) | self.process_kind(q, p)
        return tuple(k for k in KINDS if k in used)

    def ranks_using(self, kind: str, groups: Sequence[str] | None = None) -> tuple[int, ...]:
        """The ranks that move some pair over ``kind`` (ascending): the members NCCL needs
        in its communicator when "auto" routes only some pairs to it.

        ``groups[p]`` is process ``p``'s group: when given, only pairs of processes in
        different groups count (a refit moves bytes from one job to another; two engines
        that share nothing need no communicator between them).
        """
        reps = self.representatives()
        members: dict[tuple[int, str | None], list[int]] = {}
        for r, p in enumerate(self.rank_process):
            members.setdefault((p, self.rank_device[r]), []).append(r)
        used: set[int] = set()
        for p in range(len(reps)):
            for q in range(len(reps)):
                if p == q or (groups is not None and groups[p] == groups[q]):
                    continue
                for da, a in reps[p].items():
                    for db, b in reps[q].items():
                        if self.kind(a, b) == kind:
                            used.update(members[(p, da)])
                            used.update(members[(q, db)])
        return tuple(sorted(used))

    def peers(self, process: int, kind: str) -> list[int]:
        """The processes that ``process`` exchanges with over ``kind``."""
        n = len(self.representatives())
        return [q for q in range(n) if q != process
                and (kind in self.process_kind(process, q)
                     or kind in self.process_kind(q, process))]


def choose_routes(rank_process: Sequence[int], rank_kind: Sequence[str],
                  caps: Sequence[Mapping[str, Any]], requested: str = "auto") -> Routes:
    """The transport of every pair, from every process's capabilities (pure).

    ``caps[p]`` is process ``p``'s JSON capability record:

    - ``host``: the host it joined with (``World.join(host=...)``);
    - ``shm_reach``: the processes whose shared-memory probe it could open and read and
      whose process it sees as itself (the pid and start time that process published;
      empty when shm is off there, e.g. ``XRESHARD_SHM=0``);
    - ``cuda_devices``: the CUDA uuid of each of its ranks (``None`` for CPU ranks);
    - ``cuda_reach``: the device uuids it can read through IPC (its own devices and
      those it has peer access to).

    A pair takes ``shm`` when both processes share a host name *and* each read the
    other's probe and sees the other's process (two containers with one host name but
    separate ``/dev/shm`` do not; nor do containers sharing ``/dev/shm`` in separate pid
    namespaces, whose dead-peer watcher could not tell a live peer by its pid);
    ``cuda_ipc`` when both ranks are on one GPU or on GPUs each side can reach.

    | pair                                | "auto"   | "shm" / "cuda_ipc" | "gloo" / "nccl" |
    |-------------------------------------|----------|--------------------|-----------------|
    | one process                         | local    | local              | local           |
    | cpu, same host, probes read         | shm      | shm                | gloo            |
    | cpu, other host                     | gloo     | error              | gloo            |
    | cuda, same GPU or peer access       | cuda_ipc | cuda_ipc           | nccl            |
    | cuda, otherwise                     | nccl     | error              | nccl            |

    Raises:
        RefitError: as ``select_backend``; or a fast path was requested and some pair
            cannot take it (the message names the ranks, processes and why).
    """
    if requested not in ("auto", *BACKENDS, *FAST_PATHS):
        raise RefitError(f"unknown transport {requested!r}: expected 'auto', "
                         f"{', '.join(repr(b) for b in (*BACKENDS, *FAST_PATHS))}")
    backend_request = requested if requested in BACKENDS else "auto"
    if requested in FAST_PATHS:
        kinds = set(rank_kind)
        if kinds - {FAST_PATHS[requested]}:
            raise RefitError(f"transport {requested!r} moves {FAST_PATHS[requested]!r} "
                             f"buffers, but the world has {sorted(kinds)} ranks; request "
                             f"'auto'")
    cross = select_backend(rank_kind, backend_request)
    n = len(caps)
    shm_pairs = set()
    by_host: dict[str, list[int]] = {}
    for p in range(n):
        by_host.setdefault(caps[p]["host"], []).append(p)
    reach = [set(c.get("shm_reach", ())) for c in caps]
    for members in by_host.values():            # only processes of one host can share
        for i, p in enumerate(members):
            for q in members[i + 1:]:
                if q in reach[p] and p in reach[q]:
                    shm_pairs.add((p, q))
    rank_device: list[str | None] = []
    counts = Counter(rank_process)
    for p, c in enumerate(caps):
        devs = list(c.get("cuda_devices") or [])
        count = counts[p]
        devs += [None] * (count - len(devs))
        rank_device.extend(devs[:count])
    ipc_reach = tuple(frozenset(c.get("cuda_reach") or ()) for c in caps)
    routes = Routes(tuple(rank_process), tuple(rank_kind), cross, frozenset(shm_pairs),
                    tuple(rank_device), ipc_reach, requested)
    if requested in FAST_PATHS:
        _refuse_unreachable(routes, caps, requested)
    return routes


def _refuse_unreachable(routes: Routes, caps: Sequence[Mapping[str, Any]], requested: str) -> None:
    bad = []
    n = len(caps)
    for p in range(n):
        for q in range(n):
            if p == q or not routes.process_kind(p, q) - {requested}:
                continue
            if requested == "shm":
                why = ("on other hosts" if caps[p]["host"] != caps[q]["host"] else
                       "on one host name but cannot open each other's shared memory")
                bad.append(f"processes {p} ({caps[p]['host']}) and {q} ({caps[q]['host']}) "
                           f"are {why}")
            else:
                reps = routes.representatives()
                a, b = next((a, b) for a in reps[p].values() for b in reps[q].values()
                            if not routes.ipc_ok(a, b))
                bad.append(f"rank {a} (process {p}, GPU {routes.rank_device[a]}) and rank {b} "
                           f"(process {q}, GPU {routes.rank_device[b]}) are on different "
                           f"devices without peer access")
            if len(bad) >= 8:
                break
    if bad:
        other = "gloo" if requested == "shm" else "nccl"
        raise RefitError(f"transport {requested!r} cannot move every pair: "
                         + "; ".join(bad[:8]) + f". Request {other!r} or 'auto' (which takes "
                         f"{requested} where it can and {other} elsewhere)")
