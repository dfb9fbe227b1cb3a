"""The numpy delta kernels: host buffers (and CPU-resident JAX arrays and torch tensors,
read in place).

One pass over the two versions in cache-sized chunks, so temporaries stay in cache and
memory traffic is one read of each version plus the message. While changes are sparse (the
RL case) a chunk is compared 8 bytes at a time (``uint64`` words: 4 bf16 or 8 fp8 elements
per word) into a byte per word, only the differing words are read again and looked into,
lane by lane, for the changed elements' indices, and the changed values are gathered from
the chunk while it is in cache. Once changes are dense (more than :data:`SPARSE_BELOW` so
far) the pass switches to element-wise masks (count, packed mask, run boundaries while runs
can still win). It stops as soon as the count makes dense certain.

The new version may be given in parts (:func:`encode_parts`: a bucket's items read in place
from their tensors, never packed), and a message applied to a region held in parts
(:func:`apply_parts`: the destination tensors of a bucket's items).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .codec import (BITMASK, DENSE, RUNS, Encoded, Header, align8, choose, dense_threshold,
                    index_width, parse, words)

__all__ = ["encode_numpy", "encode_parts", "apply_numpy", "apply_parts", "changed_mask"]

#: elements per chunk: both versions' chunks and the temporaries stay in a core's cache
CHUNK = 1 << 18
#: above this changed fraction (so far) the pass works element-wise: dense is likely
SPARSE_BELOW = 1 / 16


def changed_mask(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Which elements' bits differ (bool, one per element)."""
    o, w = words(old, "baseline"), words(new, "new")
    if o.shape != w.shape:
        raise ValueError(f"baseline has {o.shape[0]} elements, new {w.shape[0]}: a delta "
                         "compares two versions of the same region")
    diff = o != w
    return diff.any(axis=1) if diff.ndim == 2 else diff


def _changed_indices(o: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Indices of the elements of a chunk whose bits differ, ascending. Elements under 8
    bytes are compared a 64-bit word (several lanes) at a time into one byte per word;
    only the differing words are read again and looked into, lane by lane."""
    if o.ndim == 2:                                        # 16-byte elements: word pairs
        return np.flatnonzero((o != w).any(axis=1))
    lanes = 8 // o.itemsize
    whole = o.size - o.size % lanes
    if lanes == 1 or whole == 0:
        return np.flatnonzero(o != w)
    o64, w64 = o[:whole].view(np.uint64), w[:whole].view(np.uint64)
    hit = np.flatnonzero(o64 != w64)
    out = hit
    if hit.size:
        # the differing words' lanes, viewed back as elements (little-endian: lane j of
        # word i is element lanes * i + j)
        at = np.flatnonzero((o64[hit] ^ w64[hit]).view(o.dtype))
        out = hit[at // lanes] * lanes + at % lanes
    if whole < o.size:
        out = np.concatenate((out, whole + np.flatnonzero(o[whole:] != w[whole:])))
    return out


def _cat(xs: list[np.ndarray], like: Any = np.int64) -> np.ndarray:
    return np.concatenate(xs) if xs else np.zeros(0, like)


class _Pass:
    """What one chunked pass over the two versions found."""

    def __init__(self, n: int, itemsize: int, dtype: Any) -> None:
        self.n, self.itemsize, self.dtype = n, itemsize, dtype
        self.count = self.nruns = 0
        self.sparse = True
        self.news: list[tuple[int, np.ndarray]] = []   # every chunk of the new version
        self.indices: list[np.ndarray] = []            # sparse: changed element indices
        self.values: list[np.ndarray] = []             # sparse: their new values
        self.masks: list[np.ndarray] = []              # dense: packed masks per chunk
        self.starts: list[np.ndarray] | None = []      # dense: None once runs cannot win
        self.stops: list[np.ndarray] = []
        self.mask_bytes = align8((n + 7) // 8)
        self.width = index_width(n)

    def chunk(self, at: int, o: np.ndarray, w: np.ndarray) -> None:
        """Account for the chunk of ``o`` / ``w`` starting at element ``at``."""
        self.news.append((at, w))
        if self.sparse:
            idx = _changed_indices(o, w)
            self.count += idx.size
            self.indices.append(idx + at)
            self.values.append(w[idx])
            if self.count > SPARSE_BELOW * (at + w.shape[0]):
                self._to_dense(at + w.shape[0])
            return
        d = o != w
        if d.ndim == 2:
            d = d.any(axis=1)
        self._dense_chunk(at, d)

    def _to_dense(self, upto: int) -> None:
        """Switch to element-wise masks: redo what the sparse chunks found as masks."""
        self.sparse = False
        seen: Any = np.zeros(upto, bool)
        idx = np.concatenate(self.indices)
        seen[idx] = True
        self.count -= idx.size
        self.indices, self.values = [], []
        for at, w in self.news:
            self._dense_chunk(at, seen[at:at + w.shape[0]])

    def _dense_chunk(self, at: int, d: np.ndarray) -> None:
        prev_last = at > 0 and bool(self.last)
        self.last = bool(d[-1])
        self.masks.append(np.packbits(d, bitorder="little"))
        k = int(np.count_nonzero(d))
        if not k:
            return
        self.count += k
        # run boundaries: a run open at the chunk's end closes there unless the next chunk
        # continues it (then that stop is dropped)
        starts = np.flatnonzero(d[1:] & ~d[:-1]) + 1
        if d[0] and not prev_last:
            starts = np.concatenate(([0], starts))
        self.nruns += starts.size
        if self.starts is None:
            return
        if 2 * self.width * self.nruns > self.mask_bytes:     # runs now lose to the mask
            self.starts = None
            return
        stops = np.flatnonzero(d[:-1] & ~d[1:]) + 1
        if d[-1]:
            stops = np.concatenate((stops, [d.size]))
        if d[0] and prev_last and self.stops:       # continues the previous chunk's run
            self.stops[-1] = self.stops[-1][:-1]
        self.starts.append(starts + at)
        self.stops.append(stops + at)

    last = False

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, stops) of the changed runs (what the pass can still give)."""
        if self.sparse:
            idx = _cat(self.indices)
            if not idx.size:
                return idx, idx
            breaks = np.flatnonzero(np.diff(idx) != 1)
            return (idx[np.concatenate(([0], breaks + 1))],
                    idx[np.concatenate((breaks, [idx.size - 1]))] + 1)
        assert self.starts is not None and self.stops is not None
        return _cat(self.starts), _cat(self.stops)

    def mask(self) -> np.ndarray:
        """Dense: the packed mask of the whole region (chunk masks are concatenated as they
        are when every chunk but the last is whole bytes, else repacked)."""
        if all(w.shape[0] % 8 == 0 for _, w in self.news[:-1]):
            return np.concatenate(self.masks)
        return np.packbits(np.concatenate([
            np.unpackbits(m, count=w.shape[0], bitorder="little")
            for (_, w), m in zip(self.news, self.masks)]), bitorder="little")

    def changed_values(self) -> np.ndarray:
        """The changed elements' new values, in element order."""
        if self.sparse:
            return _cat(self.values, self.dtype)
        return np.concatenate([w[np.unpackbits(m, count=w.shape[0], bitorder="little")
                                 .view(bool)] for (_, w), m in zip(self.news, self.masks)])


def encode_parts(old: np.ndarray, parts: Sequence[np.ndarray]) -> Encoded | None:
    """Encode the new version of a region, given as ``parts`` (contiguous arrays, element
    size that of ``old``, their concatenation as long as ``old``: a bucket's items read in
    place) against the baseline ``old``; None when dense is the smallest encoding (the
    caller holds the new bytes)."""
    o = words(old, "baseline")
    ws = [words(p, "new") for p in parts]
    isz, n = old.dtype.itemsize, o.shape[0]
    if sum(w.shape[0] for w in ws) != n or any(p.dtype.itemsize != isz for p in parts):
        raise ValueError(f"the parts hold {sum(w.shape[0] for w in ws)} elements of "
                         f"{sorted({p.dtype.itemsize for p in parts})} bytes, the baseline "
                         f"{n} of {isz}: a delta compares two versions of the same region")
    threshold = dense_threshold(n, isz)
    found = _Pass(n, isz, o.dtype)
    base = 0
    for w in ws:
        for a in range(0, w.shape[0], CHUNK):
            chunk = w[a:a + CHUNK]
            found.chunk(base + a, o[base + a:base + a + chunk.shape[0]], chunk)
            if found.count >= threshold:
                return None
        base += w.shape[0]
    if found.sparse:
        found.nruns = found.runs()[0].size
    kind = choose(n, found.count, found.nruns, isz)
    if kind == DENSE:
        return None
    header = Header(kind, isz, n, found.count, found.nruns if kind == RUNS else 0)
    values = found.changed_values()
    if kind == BITMASK:
        if found.sparse:
            seen = np.zeros(n, bool)
            seen[_cat(found.indices)] = True
            return Encoded(header, (np.packbits(seen, bitorder="little"), values))
        return Encoded(header, (found.mask(), values))
    starts, stops = found.runs()
    ix = np.uint32 if header.width == 4 else np.uint64
    return Encoded(header, (np.concatenate((starts, stops - starts)).astype(ix), values))


def encode_numpy(old: np.ndarray, new: np.ndarray) -> Encoded:
    """Encode ``new`` against the baseline ``old`` (same shape and element size)."""
    o, w = words(old, "baseline"), words(new, "new")
    if o.shape != w.shape:
        raise ValueError(f"baseline has {o.shape[0]} elements, new {w.shape[0]}: a delta "
                         "compares two versions of the same region")
    msg = encode_parts(old, [new])
    n = w.shape[0]
    return msg if msg is not None else Encoded(Header(DENSE, new.dtype.itemsize, n, n, 0), (w,))


def apply_numpy(message: Any, target: np.ndarray) -> np.ndarray:
    """Overwrite ``target``'s changed elements with ``message``'s (in place); returns it."""
    tw = words(target, "target")
    if not target.flags.writeable:
        raise ValueError("target: a read-only array cannot take a delta")
    apply_parts(message, [target], target.dtype.itemsize, tw.shape[0])
    return target


def apply_parts(message: Any, parts: Sequence[np.ndarray], itemsize: int, n: int) -> None:
    """Apply ``message`` to a region of ``n`` elements of ``itemsize`` bytes held in
    ``parts`` (contiguous writeable arrays of that element size, their concatenation the
    region: the destinations of a bucket's items). The whole message is validated before
    a byte is written."""
    msg = parse(message, itemsize, n)
    targets, at = [], 0
    for p in parts:
        if not p.flags.writeable:
            raise ValueError("target: a read-only array cannot take a delta")
        w = words(p, "target")
        if p.dtype.itemsize != itemsize:
            raise ValueError(f"target: elements of {p.dtype.itemsize} bytes, the message's "
                             f"of {itemsize}")
        targets.append((at, w))
        at += w.shape[0]
    if at != n:
        raise ValueError(f"the parts hold {at} elements, the message's region {n}")
    values = msg.values.reshape((-1,) + (2,) * (itemsize == 16))
    kind, count = msg.header.kind, msg.header.count
    if kind == DENSE:
        for lo, t in targets:
            t[...] = values[lo:lo + t.shape[0]]
        return
    if not count:
        return
    if kind == RUNS and msg.starts is not None and msg.lengths is not None \
            and msg.starts.size * 16 < count:       # long runs: copy them as slices
        _apply_runs(msg.starts.tolist(), msg.lengths.tolist(), values, targets)
        return
    idx = msg.indices() if kind == RUNS else np.flatnonzero(msg.mask())
    bounds = np.concatenate(([0], np.searchsorted(idx, [lo for lo, _ in targets[1:]]),
                             [idx.size])).tolist()
    for (lo, t), a, b in zip(targets, bounds[:-1], bounds[1:]):
        if b > a:
            t[idx[a:b] - lo] = values[a:b]


def _apply_runs(starts: list[int], lengths: list[int], values: np.ndarray,
                targets: list[tuple[int, np.ndarray]]) -> None:
    """Copy long runs into the parts they fall in, slice by slice."""
    k, at = 0, 0
    for s, ln in zip(starts, lengths):
        while ln:
            while targets[k][0] + targets[k][1].shape[0] <= s:
                k += 1
            lo, t = targets[k]
            take = min(ln, lo + t.shape[0] - s)
            t[s - lo:s - lo + take] = values[at:at + take]
            s, ln, at = s + take, ln - take, at + take
