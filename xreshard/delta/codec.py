"""The delta wire format, the choice of encoding, and the numpy (host) kernels.

One encoded message says how to turn the receiver's copy of a region (its baseline) into
the sender's new bytes of that region. Layout (little-endian; every section starts at a
multiple of 8 bytes, zero-padded)::

    offset  size  field
         0     4  magic b"XRDL"
         4     1  format version (1)
         5     1  kind: 0 dense, 1 bitmask, 2 runs
         6     1  itemsize: bytes per element (1, 2, 4, 8, 16)
         7     1  index width of the run table (runs: 4 or 8; else 0)
         8     8  n: elements of the region
        16     8  count: elements whose values follow
        24     8  nruns: runs in the table (runs; else 0)
        32        dense:   n values
                  bitmask: ceil(n/8) mask bytes (bit i of byte j is element 8j+i), values
                  runs:    nruns starts, nruns lengths (index width each), values

Values are the new elements' raw bytes in element order. Elements are compared by their
bits, never their values (``-0.0`` vs ``+0.0``, NaN payloads, bf16 and fp8 are just bits).
Applying overwrites the changed elements with the sent ones: applying a message twice is
applying it once (never XOR). A receiver validates the whole message against its region
before writing a byte (:func:`parse`): a malformed or truncated message raises
:class:`DeltaFormatError` and leaves the region untouched.

The encoding is whichever of dense, bitmask + values and runs + values is smallest
(:func:`choose`, from the element count, the changed count and the run count only, so every
backend makes the same choice and the same bytes); a step where most elements changed
costs no more than a dense message plus the 32-byte header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CommunicationError

__all__ = ["DeltaFormatError", "Encoded", "Header", "HEADER_BYTES", "DENSE", "BITMASK", "RUNS",
           "KINDS", "choose", "payload_sizes", "parse", "words_dtype", "index_width", "assemble",
           "section_bytes", "Parsed", "dense_wins_without_runs", "dense_threshold", "words",
           "align8", "read_header"]

MAGIC = b"XRDL"
VERSION = 1
HEADER_BYTES = 32
DENSE, BITMASK, RUNS = 0, 1, 2
KINDS = {DENSE: "dense", BITMASK: "bitmask", RUNS: "runs"}
_HEADER = struct.Struct("<4sBBBBQQQ")
_ITEMSIZES = (1, 2, 4, 8, 16)


class DeltaFormatError(CommunicationError):
    """A delta message is malformed, truncated or not for the region it is applied to;
    nothing was written."""


def align8(n: int) -> int:
    return (n + 7) & ~7


def index_width(n: int) -> int:
    """Bytes per run-table entry for a region of ``n`` elements."""
    return 4 if n < (1 << 32) else 8


def payload_sizes(n: int, count: int, nruns: int, itemsize: int) -> dict[int, int]:
    """Payload bytes (after the header) of each encoding."""
    values = count * itemsize
    return {DENSE: n * itemsize,
            BITMASK: align8((n + 7) // 8) + values,
            RUNS: align8(2 * nruns * index_width(n)) + values}


def choose(n: int, count: int, nruns: int, itemsize: int) -> int:
    """The smallest encoding; ties go to dense, then runs (cheaper to apply)."""
    sizes = payload_sizes(n, count, nruns, itemsize)
    return min((DENSE, RUNS, BITMASK), key=lambda k: sizes[k])


def dense_wins_without_runs(n: int, count: int, itemsize: int) -> bool:
    """Whether dense is chosen whatever the run count (at least one run): the kernels
    then skip finding the runs."""
    sizes = payload_sizes(n, count, 1, itemsize)
    return sizes[DENSE] <= min(sizes[BITMASK], sizes[RUNS])


def dense_threshold(n: int, itemsize: int) -> int:
    """The least changed count (at least 1: no change is the empty runs message) at which
    dense is chosen whatever the runs: a kernel counting changes may stop there."""
    if n == 0:
        return 1
    c = max(1, n - align8((n + 7) // 8) // itemsize, n - 16 // itemsize)
    while c > 1 and dense_wins_without_runs(n, c - 1, itemsize):
        c -= 1
    while not dense_wins_without_runs(n, c, itemsize):
        c += 1
    return c


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    itemsize: int
    n: int
    count: int
    nruns: int

    @property
    def width(self) -> int:
        return index_width(self.n) if self.kind == RUNS else 0

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.kind, self.itemsize, self.width, self.n,
                            self.count, self.nruns)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message."""
        sizes = payload_sizes(self.n, self.count, self.nruns, self.itemsize)
        return HEADER_BYTES + sizes[self.kind]


@dataclass(frozen=True)
class Encoded:
    """One encoded message: its header and its sections as arrays of the encoding backend
    (numpy, ``jax.Array`` or torch, on their device), each viewable as uint8 and at least
    as long as the format says (a device kernel may leave a padded tail:
    :meth:`to_bytes` keeps :func:`section_bytes` of each)."""

    header: Header
    sections: tuple[Any, ...]

    @property
    def kind(self) -> str:
        return KINDS[self.header.kind]

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    def to_bytes(self) -> np.ndarray:
        """The message as one host uint8 array (copies device sections to the host)."""
        return assemble(self.header, [_host_u8(s) for s in self.sections])


def _host_u8(section: Any) -> np.ndarray:
    if isinstance(section, np.ndarray):
        return section.reshape(-1).view(np.uint8)
    if hasattr(section, "cpu") and hasattr(section, "numpy"):         # torch
        return section.detach().cpu().reshape(-1).numpy().view(np.uint8)
    return np.asarray(section).reshape(-1).view(np.uint8)             # jax


def section_bytes(header: Header) -> list[int]:
    """Bytes of each section, in order (before padding)."""
    values = header.count * header.itemsize
    if header.kind == DENSE:
        return [header.n * header.itemsize]
    if header.kind == BITMASK:
        return [(header.n + 7) // 8, values]
    return [2 * header.nruns * header.width, values]


def assemble(header: Header, sections: list[np.ndarray]) -> np.ndarray:
    """Header + sections (host uint8), each but the last padded to a multiple of 8 bytes."""
    out: Any = np.zeros(header.nbytes, np.uint8)
    out[:HEADER_BYTES] = np.frombuffer(header.pack(), np.uint8)
    at = HEADER_BYTES
    sizes = section_bytes(header)
    if len(sections) != len(sizes):
        raise AssertionError(f"{len(sections)} sections for a {KINDS[header.kind]} message")
    for i, (sec, size) in enumerate(zip(sections, sizes)):
        if sec.size < size:
            raise AssertionError(f"section {i} has {sec.size} bytes, the header needs {size}")
        out[at:at + size] = sec[:size]
        at += size if i == len(sizes) - 1 else align8(size)
    return out


# ---------------------------------------------------------------------------- words

def words_dtype(itemsize: int) -> np.dtype:
    """The unsigned integer an element's bits are compared as (16-byte elements: pairs)."""
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32}.get(itemsize, np.uint64))


def words(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr``'s elements as bits: ``(n,)`` unsigned ints, or ``(n, 2)`` uint64 for
    16-byte elements. Zero-copy; refuses non-contiguous arrays."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.itemsize not in _ITEMSIZES:
        raise DeltaFormatError(f"{what}: elements of {arr.dtype.itemsize} bytes; the delta "
                               f"format takes {_ITEMSIZES}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the delta kernels read contiguous buffers (a bucket); "
                         "got a strided view")
    flat = arr.reshape(-1).view(words_dtype(arr.dtype.itemsize))
    return flat.reshape(-1, 2) if arr.dtype.itemsize == 16 else flat


# ---------------------------------------------------------------------------- parsing

@dataclass(frozen=True)
class Parsed:
    """A validated message: its header and views of its sections (host numpy)."""

    header: Header
    values: np.ndarray
    mask_bytes: np.ndarray | None = None
    starts: np.ndarray | None = None
    lengths: np.ndarray | None = None

    def mask(self) -> np.ndarray:
        """Bitmask messages: the changed elements as a bool array of ``n``."""
        return np.unpackbits(self.mask_bytes, count=self.header.n, bitorder="little").view(bool)

    def indices(self) -> np.ndarray:
        """Runs messages: the changed elements' indices, ascending (``count`` of them)."""
        assert self.lengths is not None and self.starts is not None, "a runs message"
        lengths: Any = self.lengths.astype(np.int64)
        offsets = np.cumsum(lengths) - lengths
        return np.arange(self.header.count, dtype=np.int64) + np.repeat(
            self.starts.astype(np.int64) - offsets, lengths)


def _bad(why: str) -> DeltaFormatError:
    return DeltaFormatError(f"delta message refused, nothing written: {why}")


def _as_u8(message: Any) -> np.ndarray:
    if isinstance(message, (bytes, bytearray, memoryview)):
        return np.frombuffer(message, np.uint8)
    if isinstance(message, np.ndarray) and message.dtype == np.uint8 and message.ndim == 1:
        return message
    raise TypeError(f"a delta message is bytes or a 1-D uint8 numpy array, got "
                    f"{type(message).__name__}")


def read_header(message: Any, itemsize: int, n: int) -> Header:
    """The header of a message for a region of ``n`` elements of ``itemsize`` bytes, from its
    first 32 bytes alone (a receiver learns the exact length of what follows; the whole
    message is validated by :func:`parse` before anything is written).

    Raises:
        DeltaFormatError: a header that is malformed or meant for another region.
    """
    buf = _as_u8(message)
    if buf.size < HEADER_BYTES:
        raise _bad(f"{buf.size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, kind, isz, width, hn, count, nruns = _HEADER.unpack(
        buf[:HEADER_BYTES].tobytes())
    if magic != MAGIC or version != VERSION:
        raise _bad(f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    if kind not in KINDS:
        raise _bad(f"unknown encoding kind {kind}")
    if isz != itemsize or hn != n:
        raise _bad(f"it encodes {hn} elements of {isz} bytes, the region has {n} of {itemsize}")
    header = Header(kind, isz, n, count, nruns)
    if width != header.width:
        raise _bad(f"index width {width}, expected {header.width}")
    if (kind == DENSE and (count != n or nruns)) or (kind == BITMASK and nruns) or count > n \
            or nruns > count:
        raise _bad(f"{KINDS[kind]} with count {count} and {nruns} runs for {n} elements")
    return header


def parse(message: Any, itemsize: int, n: int) -> Parsed:
    """Validate ``message`` against a region of ``n`` elements of ``itemsize`` bytes.

    Every field is checked before anything is returned: magic, version, kind, itemsize,
    index width, element count, the exact length, and the sections themselves (runs
    ascending, disjoint, inside the region, summing to ``count``; no mask bit past ``n``,
    popcount equal to ``count``).

    Raises:
        DeltaFormatError: anything malformed, truncated or meant for another region.
    """
    buf = _as_u8(message)
    header = read_header(buf, itemsize, n)
    kind, isz, count, nruns, width = (header.kind, header.itemsize, header.count,
                                      header.nruns, header.width)
    if buf.size != header.nbytes:
        raise _bad(f"{buf.size} bytes, the header describes {header.nbytes} (truncated or "
                   "padded)")
    at = HEADER_BYTES
    wd = words_dtype(isz)
    if kind == DENSE:
        return Parsed(header, buf[at:].view(wd))
    if kind == BITMASK:
        nb = (n + 7) // 8
        mask = buf[at:at + nb]
        tail = n % 8
        if tail and mask[-1] >> tail:
            raise _bad("mask bits set past the last element")
        if int(np.unpackbits(mask).sum()) != count:
            raise _bad(f"the mask marks {int(np.unpackbits(mask).sum())} elements, count is "
                       f"{count}")
        at += align8(nb)
        return Parsed(header, buf[at:at + count * isz].view(wd), mask_bytes=mask)
    ix: Any = np.dtype("<u4") if width == 4 else np.dtype("<u8")
    starts = buf[at:at + nruns * width].view(ix)
    lengths = buf[at + nruns * width:at + 2 * nruns * width].view(ix)
    _check_runs(starts, lengths, n, count)
    at += align8(2 * nruns * width)
    return Parsed(header, buf[at:at + count * isz].view(wd), starts=starts, lengths=lengths)


def _check_runs(starts: np.ndarray, lengths: np.ndarray, n: int, count: int) -> None:
    if not starts.size:
        return
    if int(lengths.min()) < 1:
        raise _bad("a run of length 0")
    if int(starts.max()) >= n or int(lengths.max()) > n:
        raise _bad(f"a run starts or reaches past element {n}")
    s: Any = starts.astype(np.uint64)       # both <= n: no overflow
    ln: Any = lengths.astype(np.uint64)
    stops = s + ln
    if int(stops[-1]) > n:
        raise _bad(f"the last run ends at {int(stops[-1])}, past element {n}")
    if starts.size > 1 and bool(np.any(s[1:] < stops[:-1])):
        raise _bad("runs overlap or are out of order")
    if int(ln.sum()) != count:
        raise _bad(f"runs cover {int(ln.sum())} elements, count is {count}")
