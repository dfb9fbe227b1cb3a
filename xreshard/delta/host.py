"""The numpy delta kernels: host buffers (and CPU-resident JAX arrays and torch tensors,
read in place).

One pass over the two versions in cache-sized chunks, so temporaries stay in cache and
memory traffic is one read of each version plus the message. While changes are sparse (the
RL case) a chunk is compared 8 bytes at a time (``uint64`` XOR: 4 bf16 or 8 fp8 elements
per word) and only the differing words are looked into, lane by lane, for the changed
elements' indices: the work per unchanged element is a fraction of one comparison. Once
changes are dense (more than :data:`SPARSE_BELOW` so far) the pass switches to
element-wise masks (count, packed mask, run boundaries while runs can still win). It stops
as soon as the count makes dense certain.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .codec import (BITMASK, DENSE, RUNS, Encoded, Header, align8, choose, dense_threshold,
                    index_width, parse, words)

__all__ = ["encode_numpy", "apply_numpy", "changed_mask"]

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


def _nonzero_words(x: np.ndarray, group: int = 8) -> np.ndarray:
    """``np.flatnonzero(x)`` for a sparse ``x``, faster: OR the ``group`` stripes of
    ``x`` together (contiguous, vectorized), find the columns where any stripe is nonzero,
    and look only there. Ascending, as flatnonzero."""
    if x.size % group or x.size < 64 * group:
        return np.flatnonzero(x)
    stripes = x.reshape(group, -1)
    cols = np.flatnonzero(np.bitwise_or.reduce(stripes, axis=0))
    rows, at = np.nonzero(stripes[:, cols])
    return rows * stripes.shape[1] + cols[at]


def _changed_indices(o: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Indices of the elements of a chunk whose bits differ, ascending; elements under 8
    bytes are compared a 64-bit word (several lanes) at a time, and only the differing
    words are looked into, lane by lane (the words viewed back as their elements)."""
    if o.ndim == 2:                                        # 16-byte elements: word pairs
        return np.flatnonzero((o != w).any(axis=1))
    lanes = 8 // o.itemsize
    whole = o.size - o.size % lanes
    if lanes == 1 or whole == 0:
        return np.flatnonzero(o != w)
    x = o[:whole].view(np.uint64) ^ w[:whole].view(np.uint64)
    hit = _nonzero_words(x)
    out = hit
    if hit.size:
        differs = x[hit].view(o.dtype).reshape(-1, lanes) != 0       # (words, lanes)
        at = np.flatnonzero(differs)                                   # ascending
        out = hit[at // lanes] * lanes + at % lanes
    if whole < o.size:
        out = np.concatenate((out, whole + np.flatnonzero(o[whole:] != w[whole:])))
    return out


class _Pass:
    """What one chunked pass over the two versions found."""

    def __init__(self, n: int, itemsize: int) -> None:
        self.n, self.itemsize = n, itemsize
        self.count = self.nruns = 0
        self.sparse = True
        self.indices: list[np.ndarray] = []            # sparse: changed element indices
        self.masks: list[np.ndarray] = []              # dense: packed masks per chunk
        self.starts: list[np.ndarray] | None = []      # dense: None once runs cannot win
        self.stops: list[np.ndarray] = []
        self.mask_bytes = align8((n + 7) // 8)
        self.width = index_width(n)

    def chunk(self, at: int, o: np.ndarray, w: np.ndarray) -> None:
        """Account for the chunk of ``o`` / ``w`` starting at element ``at``."""
        if self.sparse:
            idx = _changed_indices(o, w)
            self.count += idx.size
            self.indices.append(idx + at)
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
        seen = np.zeros(upto, bool)
        idx = np.concatenate(self.indices)
        seen[idx] = True
        self.count -= idx.size
        self.indices = []
        for at in range(0, upto, CHUNK):
            self._dense_chunk(at, seen[at:at + CHUNK])

    def _dense_chunk(self, at: int, d: np.ndarray) -> None:
        prev_last = at > 0 and bool(self.last)
        self.last = d[-1]
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
            idx = np.concatenate(self.indices) if self.indices else np.zeros(0, np.int64)
            if not idx.size:
                return idx, idx
            breaks = np.flatnonzero(np.diff(idx) != 1)
            return (idx[np.concatenate(([0], breaks + 1))],
                    idx[np.concatenate((breaks, [idx.size - 1]))] + 1)
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        return cat(self.starts), cat(self.stops)


def encode_numpy(old: np.ndarray, new: np.ndarray) -> Encoded:
    """Encode ``new`` against the baseline ``old`` (same shape and element size)."""
    o, w = words(old, "baseline"), words(new, "new")
    if o.shape != w.shape:
        raise ValueError(f"baseline has {o.shape[0]} elements, new {w.shape[0]}: a delta "
                         "compares two versions of the same region")
    isz, n = new.dtype.itemsize, w.shape[0]
    dense = Encoded(Header(DENSE, isz, n, n, 0), (w,))
    threshold = dense_threshold(n, isz)
    found = _Pass(n, isz)
    for at in range(0, n, CHUNK):
        found.chunk(at, o[at:at + CHUNK], w[at:at + CHUNK])
        if found.count >= threshold:
            return dense
    if found.sparse:
        starts, stops = found.runs()
        found.nruns = starts.size
    kind = choose(n, found.count, found.nruns, isz)
    if kind == DENSE:
        return dense
    header = Header(kind, isz, n, found.count, found.nruns if kind == RUNS else 0)
    if found.sparse:
        idx = np.concatenate(found.indices) if found.indices else np.zeros(0, np.int64)
        values = w[idx]
        if kind == BITMASK:
            seen = np.zeros(n, bool)
            seen[idx] = True
            return Encoded(header, (np.packbits(seen, bitorder="little"), values))
    else:
        mask = np.concatenate(found.masks)
        values = w[np.unpackbits(mask, count=n, bitorder="little").view(bool)]
        if kind == BITMASK:
            return Encoded(header, (mask, values))
        starts, stops = found.runs()
    ix = np.uint32 if header.width == 4 else np.uint64
    return Encoded(header, (np.concatenate((starts, stops - starts)).astype(ix), values))


def apply_numpy(message: Any, target: np.ndarray) -> np.ndarray:
    """Overwrite ``target``'s changed elements with ``message``'s (in place); returns it."""
    tw = words(target, "target")
    if not target.flags.writeable:
        raise ValueError("target: a read-only array cannot take a delta")
    msg = parse(message, target.dtype.itemsize, tw.shape[0])
    values = msg.values.reshape((-1,) + tw.shape[1:])
    if msg.header.kind == DENSE:
        tw[...] = values
    elif msg.header.kind == BITMASK:
        tw[msg.mask()] = values
    elif msg.header.count:
        starts, lengths = msg.starts, msg.lengths
        if starts.size * 16 < msg.header.count:     # long runs: copy them as slices
            at = 0
            for s, ln in zip(starts.tolist(), lengths.tolist()):
                tw[s:s + ln] = values[at:at + ln]
                at += ln
        else:
            tw[msg.indices()] = values
    return target
