"""The executor: the only stage that touches memory and the network.

For each round of a schedule it packs buckets from source bindings into staging (or sends
the bound view itself when a bucket is one contiguous run), posts every send and receive
of the round in one transport group, then unpacks received staging into destination
bindings. Casting happens on the sender at pack time, so the wire carries the smaller
dtype.

A *binding* is what a rank holds of a tensor, in the tensor's canonical coordinates: an
array (numpy on CPU, CuPy on GPU) for product layouts, a list of arrays (one per region)
for explicit ones. Bindings may be strided views (a transposed Flax kernel, one row range
of vLLM's fused qkv); ``layout.locate(rank, region)`` says where a region sits in them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .dtypes import itemsize
from .errors import RefitError
from .layout import Layout, Region
from .schedule import Bucket, Schedule
from .transport.base import Transport

logger = logging.getLogger(__name__)

#: (rank, tensor name) -> binding
Bindings = Mapping[tuple[int, str], Any]


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of a canonical dtype name (bfloat16 and float8 through ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - jax and the dev extra bring it
            raise ImportError(f"moving {name} on CPU needs ml_dtypes: pip install ml_dtypes") from e
        return np.dtype(getattr(ml_dtypes, name))


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.dtype("V16")}


def _xp(arr: Any) -> Any:
    """The array module of ``arr``: numpy, or CuPy for device arrays."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # only device bindings get here
    return cupy


_TILE = 256


def copy_into(xp: Any, out: Any, src: Any) -> None:
    """``out[...] = src`` (same shape; dtypes may differ for a cast).

    A 2-D source or destination whose inner dim is the strided one (a transposed Flax
    kernel) is copied in square tiles so both sides stay in cache: numpy's plain strided
    copy of a transpose runs at a fraction of memory bandwidth.
    """
    same = out.dtype == src.dtype
    if same:
        out, src = out.view(_BITS[out.dtype.itemsize]), src.view(_BITS[src.dtype.itemsize])
    casting = "no" if same else "unsafe"
    if xp is np and out.ndim == 2 and out.size > _TILE * _TILE and (
            src.strides[0] < src.strides[1] or out.strides[0] < out.strides[1]):
        rows, cols = out.shape
        for i in range(0, rows, _TILE):
            for j in range(0, cols, _TILE):
                np.copyto(out[i:i + _TILE, j:j + _TILE], src[i:i + _TILE, j:j + _TILE],
                          casting=casting)
        return
    xp.copyto(out, src, casting=casting)


def view_of(binding: Any, layout: Layout, rank: int, region: Region) -> Any:
    """The part of ``binding`` (held by ``rank``) that stores ``region``."""
    i, slices = layout.locate(rank, region)
    arr = binding if layout.is_product else binding[i]
    return arr[slices + (Ellipsis,)]


@dataclass
class ExecStats:
    """What one process moved in one run."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    num_messages: int = 0
    num_zero_copy: int = 0
    num_rounds: int = 0
    staging_bytes: int = 0
    seconds: float = 0.0
    per_round_seconds: list[float] = field(default_factory=list)


class Executor:
    """Runs a schedule between bindings over a transport.

    Args:
        schedule: this process's buckets (see :mod:`xreshard.schedule`).
        src_layouts / dst_layouts: layouts of every tensor on each side.
        wire_dtypes: dtype on the wire per tensor.
        src_bindings / dst_bindings: ``(rank, name) -> binding`` for this process's ranks.
        transport: moves the buckets (routes same-process pairs to a local copy).
        timeout: seconds each round may take.
    """

    def __init__(self, schedule: Schedule, src_layouts: Mapping[str, Layout],
                 dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str],
                 src_bindings: Bindings, dst_bindings: Bindings, transport: Transport,
                 timeout: float, alloc: Callable[[int], Any] | None = None):
        self.schedule = schedule
        self.src_layouts = src_layouts
        self.dst_layouts = dst_layouts
        self.wire = {n: numpy_dtype(d) for n, d in wire_dtypes.items()}
        self.src_bindings = src_bindings
        self.dst_bindings = dst_bindings
        self.transport = transport
        self.timeout = timeout
        if alloc is None:
            # staging lives where the bindings live: host memory, or the device for CuPy
            first = next(iter(src_bindings.values()), None)
            if first is None:
                first = next(iter(dst_bindings.values()), None)
            if isinstance(first, list):
                first = first[0] if first else None
            xp = np if first is None else _xp(first)
            alloc = lambda n: xp.empty(n, np.uint8)   # noqa: E731
        self._alloc = alloc
        self._arena: Any = None

    # ------------------------------------------------------------ views

    def _src(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.src_bindings[(rank, name)], self.src_layouts[name], rank, region)

    def _dst(self, rank: int, name: str, region: Region) -> Any:
        return view_of(self.dst_bindings[(rank, name)], self.dst_layouts[name], rank, region)

    def _zero_copy_send(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        it = b.items[0]
        view = self._src(b.src, it.name, it.region)
        if view.dtype != self.wire[it.name] or not view.flags.c_contiguous:
            return None
        return view.reshape(-1).view(np.uint8)

    def _zero_copy_recv(self, b: Bucket) -> Any:
        if len(b.items) != 1:
            return None
        it = b.items[0]
        view = self._dst(b.dst, it.name, it.region)
        if view.dtype != self.wire[it.name] or not view.flags.c_contiguous \
                or not getattr(view.flags, "writeable", True):
            return None
        return view.reshape(-1).view(np.uint8)

    # ------------------------------------------------------------ pack / unpack

    def _pack(self, b: Bucket, buf: Any) -> None:
        off = 0
        for it in b.items:
            src = self._src(b.src, it.name, it.region)
            out = buf[off:off + it.nbytes].view(self.wire[it.name]).reshape(it.region.shape)
            copy_into(_xp(out), out, src)
            off += it.nbytes

    def _unpack(self, b: Bucket, buf: Any) -> None:
        off = 0
        for it in b.items:
            dst = self._dst(b.dst, it.name, it.region)
            data = buf[off:off + it.nbytes].view(self.wire[it.name]).reshape(it.region.shape)
            copy_into(_xp(dst), dst, data)
            off += it.nbytes

    def _local_copy(self, t: Any) -> int:
        src = self._src(t.src, t.name, t.region)
        dst = self._dst(t.dst, t.name, t.region)
        wire = self.wire[t.name]
        xp = _xp(dst)
        if src.dtype == wire:
            copy_into(xp, dst, src)
        else:       # the cast the wire would have made, then the receiver's
            copy_into(xp, dst, src.astype(wire))
        return t.nbytes

    # ------------------------------------------------------------ run

    def _staging_needed(self) -> int:
        need = 0
        for buckets in self.schedule.rounds:
            total = 0
            for b in buckets:
                if b.src in self._local_src and self._zero_copy_send(b) is None:
                    total += b.nbytes
                if b.dst in self._local_dst and self._zero_copy_recv(b) is None:
                    total += b.nbytes
            need = max(need, total)
        return need

    def run(self) -> ExecStats:
        """Move everything; raises RefitError (TransportTimeout on a silent peer)."""
        stats = ExecStats()
        t0 = time.perf_counter()
        self._local_src = {r for r, _ in self.src_bindings}
        self._local_dst = {r for r, _ in self.dst_bindings}
        for t in self.schedule.local_copies:
            stats.bytes_local += self._local_copy(t)
        need = self._staging_needed()
        if self._arena is None or len(self._arena) < need:
            self._arena = self._alloc(need)
        stats.staging_bytes = need
        for rnd, buckets in enumerate(self.schedule.rounds):
            tr = time.perf_counter()
            off = 0
            unpack: list[tuple[Bucket, Any]] = []
            with self.transport.group(self.timeout):
                # receives first, so peers' sends can start while this process packs
                for b in buckets:
                    if b.dst in self._local_dst:
                        buf = self._zero_copy_recv(b)
                        if buf is None:
                            buf = self._arena[off:off + b.nbytes]
                            off += b.nbytes
                            unpack.append((b, buf))
                        else:
                            stats.num_zero_copy += 1
                        self.transport.recv(buf, b.src, b.dst, b.tag)
                        stats.bytes_received += b.nbytes
                # transports that start posts at once (gloo) move message i while i+1 packs
                for b in buckets:
                    if b.src in self._local_src:
                        buf = self._zero_copy_send(b)
                        if buf is None:
                            buf = self._arena[off:off + b.nbytes]
                            off += b.nbytes
                            self._pack(b, buf)
                        else:
                            stats.num_zero_copy += 1
                        self.transport.send(buf, b.src, b.dst, b.tag)
                        stats.bytes_sent += b.nbytes
                        stats.num_messages += 1
            for b, buf in unpack:
                self._unpack(b, buf)
            stats.per_round_seconds.append(time.perf_counter() - tr)
        stats.num_rounds = len(self.schedule.rounds)
        stats.seconds = time.perf_counter() - t0
        return stats


def check_bindings(layouts: Mapping[str, Layout], bindings: Bindings, side: str) -> None:
    """Every binding has the shape and dtype its layout says (before any byte moves)."""
    bad = []
    for (rank, name), b in bindings.items():
        lay = layouts[name]
        arrays = [b] if lay.is_product else list(b)
        shapes = [lay.local_shape(rank)] if lay.is_product else [r.shape for r in lay.regions(rank)]
        if len(arrays) != len(shapes):
            bad.append(f"{name!r} on rank {rank}: {len(arrays)} arrays for {len(shapes)} regions")
            continue
        for a, shape in zip(arrays, shapes):
            if tuple(a.shape) != tuple(shape):
                bad.append(f"{name!r} on rank {rank}: local shape {tuple(a.shape)}, layout says "
                           f"{tuple(shape)}")
            elif a.dtype.itemsize != itemsize(lay.dtype):
                bad.append(f"{name!r} on rank {rank}: local dtype {a.dtype}, layout says {lay.dtype}")
    if bad:
        raise RefitError(f"{side} bindings do not match their layouts: " + "; ".join(bad[:20]))
