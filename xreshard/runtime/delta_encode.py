"""Finding and encoding a delta call's changes, bucket by bucket (``RefitConfig(delta=True)``):
what a bucket's message is diffed as (:class:`Spans`), the sample that says a bucket mostly
changed (:func:`sample`), and the :class:`Encoder`, worker threads that diff buckets
against their baselines ahead of the wire. The executor that moves the messages:
:mod:`.codecs.delta`; the state kept between calls and the fences: :mod:`.delta_wire`.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, NamedTuple, Sequence

import numpy as np

from ..delta.codec import DENSE, Header
from ..delta.host import encode_parts
from ..dtypes import bits_dtype, itemsize
from ..errors import RefitError
from ..planner.schedule import Bucket
from .programs import packed

if TYPE_CHECKING:       # an annotation only: the executor imports the codecs, not back
    from .execute import Executor

__all__ = ["Encoder", "Encoded", "ENCODE_THREADS", "mostly_changed", "delta_unit",
           "delta_spans", "Spans", "sample", "sample_of", "sampled_changed",
           "in_place_sample"]


#: worker threads that find and encode the changes (numpy releases the GIL in its kernels)
ENCODE_THREADS = max(1, min(4, os.cpu_count() or 1))
#: a bucket is sent dense without a diff when a sample of it changed at least this much
DENSE_SAMPLE_FRACTION = 0.9
_SAMPLE_BLOCKS, _SAMPLE_ELEMENTS = 16, 2048
#: a bucket of more items than this is packed before its diff (one numpy call per part)
_MAX_PARTS = 64


def mostly_changed(old: np.ndarray, parts: Sequence[np.ndarray]) -> bool:
    """Whether most of a bucket changed, from 16 blocks spread over it (``old``: the
    baseline; ``parts``: the new version in pieces, as :func:`encode_parts` takes it): the
    diff is then skipped and the bucket sent dense (a cost policy: dense is always a valid
    message). The encoder asks this of every bucket it diffs; it decides for those the
    sender has to pack (the others were sampled in place before ``refit/check``, and said
    dense there if they mostly changed: ``DeltaState.encode_ahead``)."""
    new = sample(parts)
    if new is None or old.size != sum(p.size for p in parts) or old.dtype.kind != "u":
        return False
    mine = sample_as(old, [p.size for p in parts])
    return mine is not None and sampled_changed(mine, new)


class Spans(NamedTuple):
    """How a bucket's message is diffed when its pair goes as a delta: the byte ranges
    compared with the baseline (in message order; their concatenation is what the
    baseline holds)."""

    unit: int
    """The element size the diffed bytes are compared in (their narrowest; 1 with FP8
    items: codes are bytes)."""
    diffed: tuple[tuple[int, int], ...]
    rest: tuple[bool, ...]
    """Per item in message order (``programs.packed``): whether it is a piece of FP8
    blocks split across senders (its receiver's base: the bytes it last received, see
    :mod:`.delta_land`)."""

    @property
    def nbytes(self) -> int:
        """The diffed bytes (a baseline's size)."""
        return sum(hi - lo for lo, hi in self.diffed)


_SPANS: weakref.WeakKeyDictionary[Executor, dict[int, Spans | None]] = \
    weakref.WeakKeyDictionary()


def sample(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """The elements :func:`mostly_changed` compares of a bucket given in ``parts`` (its
    message in pieces), as one new array (``_SAMPLE_BLOCKS`` blocks of up to
    ``_SAMPLE_ELEMENTS``, spread over it); None: the bucket is too small or not raw bits
    (it is never sampled)."""
    n = sum(p.size for p in parts)
    if n <= _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS or parts[0].dtype.kind != "u":
        return None
    stride, base, k, out = n // _SAMPLE_BLOCKS, 0, 0, []
    if len(parts) == 1:         # the blocks as one strided view: one copy
        return np.array(parts[0][:stride * _SAMPLE_BLOCKS].reshape(_SAMPLE_BLOCKS, stride)[
            :, :_SAMPLE_ELEMENTS]).reshape(-1)
    for a in range(0, stride * _SAMPLE_BLOCKS, stride):
        while base + parts[k].size <= a:
            base += parts[k].size
            k += 1
        out.append(parts[k][a - base:a - base + _SAMPLE_ELEMENTS])   # clipped at its end
    return np.concatenate(out)


def sample_as(old: np.ndarray, sizes: Sequence[int]) -> np.ndarray | None:
    """The :func:`sample` of ``old`` (one array: a baseline) cut in parts of ``sizes``
    elements, as the bucket's new version is given: the same elements, blocks clipped at
    the same part ends (a baseline sampled whole would not compare with it)."""
    return sample(np.split(old, np.cumsum(sizes)[:-1]))


def sample_of(base: np.ndarray, bits: Any, sizes: Sequence[int]) -> np.ndarray | None:
    """The :func:`sample` of a baseline ``base`` viewed as ``bits``, cut in parts of
    ``sizes`` elements as its bucket's items are (:func:`sample_as`)."""
    return sample_as(base.view(bits), sizes)


def sampled_changed(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether two :func:`sample` s of a bucket differ in at least
    ``DENSE_SAMPLE_FRACTION`` of their elements (of the sample's own size: a bucket of
    small items clips every block at an item's end, so its sample may hold far fewer than
    the blocks' full size even when every element changed)."""
    return old.shape == new.shape and int(np.count_nonzero(old != new)) >= \
        DENSE_SAMPLE_FRACTION * new.size


def in_place_sample(reader: Executor, b: Bucket
                    ) -> tuple[Any, np.ndarray, tuple[int, ...]] | None:
    """``(bits dtype, sample, part sizes)`` of bucket ``b``'s new bytes read in place (no
    packing: the parts are its items, of those sizes in elements; sample its baseline in
    the same parts, :func:`sample_as`), or None: it cannot be sampled so (its items need
    packing, it is too small, or it cannot go as a delta)."""
    spans = delta_spans(reader, b)
    if spans is None or spans.diffed != ((0, b.nbytes),):
        return None
    bits = bits_dtype(spans.unit)
    parts = _in_place(reader, b, bits)
    got = None if parts is None else sample(parts)
    return None if got is None or parts is None else \
        (bits, got, tuple(p.size for p in parts))


def _in_place(reader: Executor, b: Bucket, bits: Any) -> list[np.ndarray] | None:
    """Bucket ``b``'s new bytes as its items' own memory, contiguous pieces of ``bits``
    elements, when every item is a contiguous view that needs no cast nor quantizing (else
    None: the bucket has to be packed)."""
    steps = reader.programs.program(b, 0)
    bindings = reader.tables[b.stage].src_bindings
    if len(steps) > _MAX_PARTS or not all(e.quant is None and e.dtype == e.wire
                                          for e in steps):
        return None
    views = [(bindings[e.key] if e.index is None else bindings[e.key][e.index])[e.slices]
             for e in steps]
    if all(isinstance(v, np.ndarray) and v.flags.c_contiguous for v in views):
        return [v.reshape(-1).view(np.uint8).view(bits) for v in views]
    return None


def delta_spans(reader: Executor, b: Bucket) -> Spans | None:
    """Bucket ``b``'s :class:`Spans`, or None when it cannot go as a delta: its receiver
    casts (it could not read its base back bit for bit), or nothing of it is diffed (every
    item a piece of split FP8 blocks). A relay's forwards (stage 1) go as deltas too (see
    :mod:`xreshard.planner.relay`). An FP8 item (whole blocks quantized
    by the sender: scales then codes) is diffed as bytes against what was last sent: its
    receiver holds exactly those codes and scales."""
    cache = _SPANS.setdefault(reader, {})
    if id(b) in cache:
        return cache[id(b)]
    spans = None
    if b.stage < len(reader.tables):        # a relay's forwards (stage 1) too
        t, wire, quant = reader.tables[b.stage], reader.programs.wire(b.stage), reader.quant
        units: list[int] = []
        diffed: list[tuple[int, int]] = []
        rest: list[bool] = []
        for it, off in packed(b, wire):
            if t.dst_layouts[it.name].dtype != wire[it.name]:
                break
            # a piece of split blocks (stage 0 only: a relay forwards finished codes)
            piece = b.stage == 0 and quant is not None and it.name in quant.tensors \
                and not it.quantized
            rest.append(piece)
            units.append(1 if it.quantized else itemsize(wire[it.name]))
            if diffed and diffed[-1][1] == off:
                diffed[-1] = (diffed[-1][0], off + it.nbytes)
            else:
                diffed.append((off, off + it.nbytes))
        else:
            if diffed:
                spans = Spans(min(units), tuple(diffed), tuple(rest))
    cache[id(b)] = spans
    return spans


def delta_unit(reader: Executor, b: Bucket) -> int | None:
    """The element size bucket ``b`` is compared in, or None when it cannot go as a delta
    (see :func:`delta_spans`)."""
    spans = delta_spans(reader, b)
    return None if spans is None else spans.unit


@dataclass
class Encoded:
    """What the encoder made of one bucket."""

    message: np.ndarray | None
    """The delta message (header included); None: send the bucket dense."""
    header: Header
    seconds: float
    packed: np.ndarray | None = None
    """A bucket sent dense: its message, packed by the encoder into what becomes its
    baseline (see :class:`Encoder`'s ``keep``); None: the executor packs it."""

    @property
    def payload(self) -> np.ndarray | None:
        """What follows the header on the wire (a delta): the message when something
        changed; None: nothing."""
        return self.message if self.header.count else None


class Encoder:
    """Finds and encodes the changes of buckets against their baselines on worker threads,
    in the order given, without waiting for anything (see the module docstring).

    It reads the sources (through ``reader``, an executor over the call's source bindings)
    and the baselines. It writes no source, and no baseline but with ``keep="in place"``:
    a bucket that mostly changed (sent dense) is then packed into its baseline, and its
    message sent from there (``Encoded.packed``: the new bytes are copied once, on a worker
    thread, ahead of the wire, where the executor would pack them into staging and copy them
    into the baseline as they move). That is sound whatever the call decides, since the
    bucket goes dense, and a failed call drops every claim; a bucket packed so whose
    encoding the call does not take has its baseline dropped (:meth:`forget`: the next
    encoding of it finds none and it goes dense). ``keep="new"`` (``atomic``: baselines
    change at the outcome) packs into new memory; None: the executor packs.

    Args:
        reader: an executor whose stage-0 source bindings and programs the buckets read.
        jobs: ``(bucket, baseline)`` in schedule order (a baseline of ``bucket.nbytes``).
        threads: worker threads.
        keep: where a bucket sent dense is packed: "in place", "new" or None (see above).
        sampled: buckets whose sample (against this baseline) already showed they did not
            mostly change: diffed without sampling them again.
    """

    def __init__(self, reader: Executor, jobs: Sequence[tuple[Bucket, np.ndarray]],
                 threads: int = ENCODE_THREADS, keep: str | None = None,
                 sampled: Collection[Bucket] = ()):
        self.reader = reader
        self.sampled = frozenset(sampled)
        self.threads = max(1, threads)
        self.keep = keep
        #: buckets whose baseline holds their new bytes (``keep="in place"``)
        self.kept: set[Bucket] = set()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="xreshard-diff")
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self._stop = threading.Event()
        self.started = time.perf_counter()
        self.finished = self.started
        self._futures: dict[Bucket, Future] = {
            b: self._pool.submit(self._encode, b, base) for b, base in jobs}

    @property
    def buckets(self) -> frozenset[Bucket]:
        return frozenset(self._futures)

    def add(self, jobs: Sequence[tuple[Bucket, np.ndarray]]) -> None:
        """Encode more buckets, after those given so far (a relay's forwards, once their
        bytes landed)."""
        for b, base in jobs:
            self._futures[b] = self._pool.submit(self._encode, b, base)

    def drop(self, keep: Callable[[Bucket], bool]) -> None:
        """Cancel the buckets ``keep`` rejects (their pairs go dense after all)."""
        for b in [b for b in self._futures if not keep(b)]:
            self._futures.pop(b).cancel()

    def result(self, b: Bucket, timeout: float) -> Encoded | None:
        """Bucket ``b``'s encoding (waits for it); None: ``b`` was not encoded."""
        fut = self._futures.get(b)
        if fut is None:
            return None
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise RefitError(f"RefitConfig(delta=True): encoding bucket {b.tag} of pair "
                             f"({b.src}, {b.dst}) took more than the timeout ({timeout} s)"
                             ) from None

    def stop(self) -> None:
        """Cancel what has not started and wait for what has: no worker reads a source or
        a baseline once this returns."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def forget(self, sent: dict) -> None:
        """After :meth:`stop`, when the call does not take this encoder's work: drop the
        baselines it packed new bytes into (``sent``: ``DeltaState.sent``), so that no diff
        compares a source with its own bytes."""
        for b in self.kept:
            pair = sent.get((b.src, b.dst))
            if pair is not None:
                pair.buffers.pop(b.tag, None)
        self.kept.clear()

    @property
    def seconds(self) -> float:
        """Wall time from the first encode's start to the last one's end."""
        return self.finished - self.started

    def _encode(self, b: Bucket, base: np.ndarray) -> Encoded | None:
        if self._stop.is_set():
            return None
        t0 = time.perf_counter()
        spans = delta_spans(self.reader, b)
        assert spans is not None, "a bucket that cannot go as a delta was given to encode"
        bits = bits_dtype(spans.unit)
        n = spans.nbytes // spans.unit
        buf = self._read(b, bits, spans)
        parts = [buf.view(bits)] if isinstance(buf, np.ndarray) else buf
        if isinstance(buf, np.ndarray) and len(spans.diffed) > 1:
            parts = [buf[lo:hi].view(bits) for lo, hi in spans.diffed]
        old = base.view(bits)
        msg = None if b not in self.sampled and mostly_changed(old, parts) \
            else encode_parts(old, parts)
        header = Header(DENSE, spans.unit, n, n, 0) if msg is None else msg.header
        packed = None
        if msg is None and self.keep and spans.diffed == ((0, b.nbytes),):
            packed = base if self.keep == "in place" else np.empty(b.nbytes, np.uint8)
            if isinstance(buf, np.ndarray):
                np.copyto(packed, buf)
            else:
                at, into = 0, packed.view(bits)
                for p in parts:
                    np.copyto(into[at:at + p.size], p)
                    at += p.size
        out = Encoded(None if msg is None else msg.to_bytes(), header,
                      time.perf_counter() - t0, packed)
        with self._lock:
            self.finished = max(self.finished, time.perf_counter())
            if packed is base:
                self.kept.add(b)
        return out

    def _read(self, b: Bucket, bits: Any, spans: Spans) -> Any:
        """Bucket ``b``'s new bytes: its items' own memory as contiguous pieces of ``bits``
        elements (a list) when every item is a contiguous view that needs no cast nor
        quantizing and is diffed whole, else the bucket packed into this worker's scratch
        (one uint8 array, FP8 items quantized as the message carries them)."""
        reader = self.reader
        parts = _in_place(reader, b, bits) if spans.diffed == ((0, b.nbytes),) else None
        if parts is not None:
            return parts
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or scratch.nbytes < b.nbytes:
            scratch = self._scratch.buf = np.empty(b.nbytes, np.uint8)
        buf = scratch[:b.nbytes]
        reader._pack(b, buf)
        return buf
