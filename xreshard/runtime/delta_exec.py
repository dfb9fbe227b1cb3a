"""The executor of a delta call (``RefitConfig(delta=True)``): encode on worker threads,
ahead of the wire.

Message sizes depend on the data while transports need matching sizes, so a bucket of a
pair that goes as a delta sends a 32-byte header (kind and exact length) one group before
its payload. Group ``k`` carries round ``k - 1``'s payloads and round ``k``'s headers, and
the changes are found by an :class:`Encoder` (worker threads, buckets in schedule order)
that runs ahead of the groups on its own:

```
 encoder threads   encode 0, 1 | encode 2, 3 | encode 4, 5 ...          (never wait)
 calling thread    group 0: headers 0 | group 1: payloads 0 + headers 1 | land 0 | ...
                   (posts round k-1's payloads, then waits for round k's encodes)
```

So the wire moves round ``k - 1``'s payloads while round ``k`` (and later ones) are being
encoded, and a delta call costs about the larger of the diff and the wire, not their sum.

With the pipelined executor (``Tuning.executor``, the default; host bindings) the groups
run on the wire thread (:class:`~.wire.Wire`), and landing overlaps the wire as in the
plain executor: group ``k`` opens once group ``k - 1`` exited (its headers size group
``k``'s payload receives), and round ``k - 2`` lands (unpack, apply) while group ``k``
moves; a dense payload moves while the next one packs. So a call whose buckets mostly
changed (sent dense, without a diff) pipelines like a plain one. Its arena holds two
rounds' payload staging (round ``j``'s at the bottom when ``j`` is even, at the top when
odd), as the plain executor's; where that does not fit ``staging_bytes``, the groups run
one after another on the calling thread (``Tuning(executor="rounds")``, device bindings
and a call with a relay's forwards too: a forward is encoded from bytes that landed two
rounds before it, and the pipelined groups land after posting).
The encoder may even start before ``refit/check`` (:meth:`DeltaState.encode_ahead`: the
diff overlaps the check and the receivers' fence), since it only reads the sources and
the baselines, but for the buckets said dense (mostly changed), which it packs into their
baselines (see :class:`Encoder`). Other baselines are written by the calling thread once
the call's decision is known, as their bucket's payload is posted (a delta: the message
applied; dense: the new bytes copied while they move).

A bucket is read in place for the diff when its items are contiguous views that need no
cast (a JAX array's or a torch tensor's memory; nothing is packed); otherwise the encoder
packs it into scratch of its own (FP8 items quantized as the message carries them: their
scales and codes are diffed as bytes). A bucket's :class:`Spans` say what is diffed. Its
receiver applies a delta to its destination items in place (contiguous views of the wire
dtype; an FP8 item's scales and codes), or reads a strided item into scratch, applies and
writes it back; the bf16 pieces of FP8 blocks split across senders to the bytes it kept
of them (:mod:`.delta_land`). Run round
after round, one round's staging is live at a time (round ``k - 1``'s, during group
``k``; landed before group ``k + 1``), so the arena is the largest round's.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..delta.codec import DENSE, HEADER_BYTES, Header, read_header
from ..delta.host import apply_numpy, encode_parts
from ..dtypes import bits_dtype, itemsize
from ..errors import RefitError
from ..planner.schedule import Bucket
from . import quantized
from .delta_land import apply_host, gather, keep_landed_pieces
from .execute import ExecStats, Executor
from .programs import packed
from .wire import Wire

__all__ = ["DeltaExecutor", "Encoder", "Encoded", "ENCODE_THREADS", "mostly_changed",
           "delta_unit", "delta_spans", "Spans"]

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
    message; a step that changed most weights costs a dense refit plus the baseline's
    copy)."""
    new = sample(parts)
    if new is None or old.size != sum(p.size for p in parts) or old.dtype.kind != "u":
        return False
    stride = old.size // _SAMPLE_BLOCKS
    mine = [old[a:a + _SAMPLE_ELEMENTS] for a in range(0, stride * _SAMPLE_BLOCKS, stride)]
    if len(parts) > 1:          # the blocks clipped at a part's end, as sample() clips
        base, k = 0, 0
        for i, a in enumerate(range(0, stride * _SAMPLE_BLOCKS, stride)):
            while base + parts[k].size <= a:
                base += parts[k].size
                k += 1
            mine[i] = mine[i][:min(_SAMPLE_ELEMENTS, base + parts[k].size - a)]
    return sampled_changed(np.concatenate(mine), new)


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


def sampled_changed(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether two :func:`sample` s of a bucket differ in at least
    ``DENSE_SAMPLE_FRACTION`` of the blocks' full size."""
    return old.shape == new.shape and int(np.count_nonzero(old != new)) >= \
        DENSE_SAMPLE_FRACTION * _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS


def in_place_sample(reader: Executor, b: Bucket) -> tuple[Any, np.ndarray] | None:
    """``(bits dtype, sample)`` of bucket ``b``'s new bytes read in place (no packing),
    or None: it cannot be sampled so (its items need packing, it is too small, or it
    cannot go as a delta)."""
    spans = delta_spans(reader, b)
    if spans is None or spans.diffed != ((0, b.nbytes),):
        return None
    bits = bits_dtype(spans.unit)
    parts = _in_place(reader, b, bits)
    got = None if parts is None else sample(parts)
    return None if got is None else (bits, got)


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
        units, diffed, rest = [], [], []
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
        start: begin at once (else at :meth:`start`).
    """

    def __init__(self, reader: Executor, jobs: Sequence[tuple[Bucket, np.ndarray]],
                 threads: int = ENCODE_THREADS, keep: str | None = None,
                 start: bool = True):
        self.reader = reader
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
        self._jobs = list(jobs)
        self._futures: dict[Bucket, Future] = {}
        if start:
            self.start()

    def start(self) -> None:
        """Begin encoding (once; see ``start``)."""
        jobs, self._jobs = self._jobs, []
        if jobs and not self._futures:
            self.started = self.finished = time.perf_counter()
        for b, base in jobs:
            self._futures[b] = self._pool.submit(self._encode, b, base)

    @property
    def buckets(self) -> frozenset[Bucket]:
        return frozenset(self._futures) | {b for b, _ in self._jobs}

    def add(self, jobs: Sequence[tuple[Bucket, np.ndarray]]) -> None:
        """Encode more buckets, after those given so far (a relay's forwards, once their
        bytes landed)."""
        for b, base in jobs:
            self._futures[b] = self._pool.submit(self._encode, b, base)

    def drop(self, keep: Callable[[Bucket], bool]) -> None:
        """Cancel the buckets ``keep`` rejects (their pairs go dense after all)."""
        self._jobs = [(b, base) for b, base in self._jobs if keep(b)]
        for b in [b for b in self._futures if not keep(b)]:
            self._futures.pop(b).cancel()

    def result(self, b: Bucket, timeout: float) -> Encoded | None:
        """Bucket ``b``'s encoding (waits for it); None: ``b`` was not encoded."""
        self.start()
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
        self._jobs = []
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
        msg = None if mostly_changed(old, parts) else encode_parts(old, parts)
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


class DeltaExecutor(Executor):
    """The executor of a delta call (see the module docstring): its groups round after
    round, or pipelined on the wire thread. Packing, unpacking and same-rank copies are
    the plain executor's.

    Args:
        delta: the call's decision and accounting (``delta_wire.DeltaCall``); its
            ``encoder`` (started ahead of the call) is used when it encodes this call.
    """

    def __init__(self, *args: Any, delta: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delta = delta

    def run(self) -> ExecStats:
        """Move everything (see :meth:`Executor.run`); the encoder's threads are stopped
        before this returns, whatever happened."""
        call = self.delta
        local = {r for t in self.tables for r, _ in t.src_bindings}
        wanted = [(b, spans) for rnd in self.schedule.rounds for b in rnd
                  if b.src in local and (b.src, b.dst) in call.pairs and not call.promised(b)
                  and (spans := delta_spans(self, b)) is not None and not self._is_forward(b)]
        encoder = call.encoder
        if encoder is None or not {b for b, _ in wanted} <= encoder.buckets:
            if encoder is not None:
                encoder.stop()
                encoder.forget(call.state.sent)
            encoder = call.encoder = self._encoder([
                (b, base) for b, spans in wanted
                if (base := call.baseline(b, spans.nbytes)) is not None])
        else:
            want = {b for b, _ in wanted}
            encoder.drop(want.__contains__)
        self._encoder = encoder
        self._forward_encoder: Encoder | None = None
        self._sent: list[tuple[Bucket, Encoded | None]] = []    # headers sent, payloads next
        self._heads_in: dict[Bucket, np.ndarray] = {}
        self._landing: list[Bucket] = []        # received headers, payloads next
        if self.forwarded:      # a forward's encode waits for its bytes to land: round by
            self.pipeline = False       # round (the pipelined groups land after posting)
        try:
            self._relayed(local)
            return super().run()
        finally:
            encoder.stop()
            forwards = self._forward_encoder
            if forwards is not None:
                forwards.stop()
            used = [e for e in (encoder, forwards) if e is not None and e.buckets]
            if used:
                call.encode_seconds = max(e.finished for e in used) - min(e.started
                                                                          for e in used)
                call.encode_threads = max(e.threads for e in used)

    # ------------------------------------------------------------ a relay's forwards

    def _relayed(self, local: set[int]) -> None:
        """This process's forwards that go as deltas, to encode once their bytes landed
        (:meth:`_encode_forwards`), on an encoder of their own that reads this executor's
        stage-1 bindings (views of the destination memory)."""
        call = self.delta
        self._forwards = deque(sorted(
            (b for rnd in self.schedule.rounds for b in rnd
             if b.src in local and self._is_forward(b) and (b.src, b.dst) in call.pairs
             and delta_spans(self, b) is not None), key=lambda b: b.round))
        self._rounds_run = 0
        self._encode_forwards(1)

    def _encode_forwards(self, upto: int) -> None:
        """Start encoding the forwards of rounds up to ``upto``: every round two before
        theirs has landed (the schedule runs a delta call's forward two rounds after its
        bytes arrive; round ``k`` lands at the end of group ``k + 1``)."""
        jobs = []
        while self._forwards and self._forwards[0].round <= upto:
            b = self._forwards.popleft()
            spans = delta_spans(self, b)
            base = None if spans is None else self.delta.baseline(b, spans.nbytes)
            if base is not None:
                jobs.append((b, base))
        if not jobs:
            return
        if self._forward_encoder is None:
            self._forward_encoder = Encoder(self, jobs)
        else:
            self._forward_encoder.add(jobs)

    def _encoded(self, b: Bucket) -> Encoded | None:
        """Bucket ``b``'s encoding (waits for it), None when it was not encoded."""
        encoder = self._forward_encoder if self._is_forward(b) else self._encoder
        return None if encoder is None else encoder.result(b, self.timeout)

    def _count_wire(self, b: Bucket, nbytes: int, stats: ExecStats) -> None:
        """``nbytes`` of bucket ``b`` posted: forwarded (a relay's) or sent."""
        if self._is_forward(b):
            stats.bytes_forwarded += nbytes
        else:
            stats.bytes_sent += nbytes

    def _round(self, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        self._group(buckets, stats)
        self._rounds_run += 1
        self._encode_forwards(self._rounds_run)

    def _rounds_done(self, stats: ExecStats) -> None:
        self._group((), stats)          # the last round's payloads

    def _group(self, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        """One group, round after round: the previous round's payloads and ``buckets``'
        headers; then the previous round lands."""
        tr = time.perf_counter()
        offsets: dict[int | None, int] = {}
        incoming, recvs, previous, sends = self._open(buckets, offsets, stats)
        if not (recvs or previous or sends or incoming):
            return
        if recvs or previous or sends:      # else only buckets that did not change land
            with self.transport.group(self.timeout):
                for buf, b in recvs:
                    self.transport.recv(buf, b.src, b.dst, b.tag)
                self._posts(self._post, previous, sends, offsets, stats)
        for b, buf, how in incoming:
            self._land(b, buf, how)
        stats.per_round_seconds.append(time.perf_counter() - tr)

    def _pipelined(self, needs: list[dict[int | None, int]], arena: dict[int | None, int],
                   stats: ExecStats) -> None:
        """The groups on the wire thread (see the module docstring): group ``k`` is opened
        once group ``k - 1`` exited (its headers size group ``k``'s payload receives), and
        round ``k - 2`` lands while group ``k`` moves. Round ``j``'s payloads (the dense
        ones' staging, send and receive) sit at the bottom of the arena when ``j`` is even,
        at its top when odd: a round's half is free again once it landed."""
        rounds = self.schedule.rounds
        landing: list = []
        started = 0.0
        with Wire(self.transport, self.timeout) as wire:
            for k in range(len(rounds) + 1):
                if k:
                    wire.wait(k - 1)
                j = k - 1
                offsets = {} if j < 0 else {dev: 0 if j % 2 == 0 else arena[dev] - needs[j].get(
                    dev, 0) for dev in arena}
                incoming, recvs, previous, sends = self._open(
                    rounds[k] if k < len(rounds) else (), offsets, stats)
                wire.open(k, recvs)
                self._posts(wire.send, previous, sends, offsets, stats)
                wire.close(k)
                if k == 0:      # same-rank copies overlap the first group's wire
                    self._local_copies(stats, forwarded=False)
                self._land_all(landing, started, stats)
                landing, started = incoming, time.perf_counter()
            wire.wait(len(rounds))
            self._land_all(landing, started, stats)
            self._local_copies(stats, forwarded=True)

    def _land_all(self, incoming: list, started: float, stats: ExecStats) -> None:
        for b, buf, how in incoming:
            self._land(b, buf, how)
        if incoming:
            stats.per_round_seconds.append(time.perf_counter() - started)

    def _open(self, buckets: Sequence[Bucket], offsets: dict, stats: ExecStats
              ) -> tuple[list, list, list, list]:
        """What the next group moves: the previous round's landing buckets with where
        their payloads land (``incoming``), the receives to post (payloads, then
        ``buckets``' headers), the previous round's sends (their payloads) and
        ``buckets``' sends (their headers)."""
        call = self.delta
        previous, self._sent = self._sent, []
        incoming = [(b, *self._incoming(b, self._heads_in.pop(b, None), offsets, stats))
                    for b in self._landing]
        self._landing = [b for b in buckets if b.dst in self._local_dst]
        call.local_dst.update(b.dst for b in self._landing)
        self._heads_in = {b: self._buffer(b.dst, HEADER_BYTES) for b in self._landing
                          if (b.src, b.dst) in call.pairs and delta_unit(self, b) is not None
                          and not call.promised(b)}
        sends = [b for b in buckets if b.src in self._local_src]
        call.sent_pairs.update((b.src, b.dst) for b in sends)
        recvs = [(buf, b) for b, buf, _ in incoming if buf is not None]
        return incoming, recvs + [(h, b) for b, h in self._heads_in.items()], previous, sends

    def _posts(self, send: Callable[[Any, Bucket], None], previous: list, sends: list,
               offsets: dict, stats: ExecStats) -> None:
        """Post the previous round's payloads, then ``sends``' headers: the payloads move
        while this thread updates their baselines and waits for the headers' encodes."""
        copies = [self._send_payload(b, enc, offsets, stats, send) for b, enc in previous]
        for base, pieces in copies:
            if base is not None:
                if len(pieces) == 1:        # the device path keeps its own memory
                    self._keep_dense(base, pieces[0])
                else:
                    gather(base, pieces)
        for b in sends:
            self._send_header(b, stats, send)

    def _post(self, buf: Any, b: Bucket) -> None:
        self.transport.send(buf, b.src, b.dst, b.tag)

    def _send_header(self, b: Bucket, stats: ExecStats,
                     send: Callable[[Any, Bucket], None]) -> None:
        """Bucket ``b``'s header, when its pair goes as a delta (waits for its encode)."""
        call = self.delta
        stats.num_messages += 1
        call.bytes_dense += b.nbytes
        quantized.count(self.quant, b, stats, "sent")
        enc = None
        spans = delta_spans(self, b)
        if (b.src, b.dst) in call.pairs and spans is not None:
            enc = self._encoded(b)
            promised = call.promised(b)     # dense, said at refit/check: no header
            if enc is None or (promised and enc.message is not None):
                n = spans.nbytes // spans.unit      # no baseline of this size, or said
                enc = Encoded(None, Header(DENSE, spans.unit, n, n, 0), 0.0)
            if not promised:
                send(self._outgoing(b.src, np.frombuffer(enc.header.pack(), np.uint8)), b)
                call.bytes_wire += HEADER_BYTES
                self._count_wire(b, HEADER_BYTES, stats)
        self._sent.append((b, enc))

    def _send_payload(self, b: Bucket, enc: Encoded | None, offsets: dict, stats: ExecStats,
                      send: Callable[[Any, Bucket], None]) -> tuple[np.ndarray | None, Any]:
        """Post bucket ``b``'s payload (none when nothing changed)
        and update its baseline (through the call: in place, or held until the outcome):
        a delta's message now; returns ``(target, new bytes)`` for a dense one to copy
        into (``(None, None)`` otherwise: also a bucket that cannot go as a delta, which
        keeps no baseline)."""
        call = self.delta
        if enc is not None and enc.packed is not None:      # dense, packed by the encoder
            send(enc.packed, b)
            call.bytes_wire += b.nbytes
            self._count_wire(b, b.nbytes, stats)
            if call.atomic:     # new memory: the baseline from the outcome on
                call.pending.append(((b.src, b.dst), b.tag, "replace", enc.packed))
            return None, None
        if enc is not None and enc.message is not None:      # a delta
            call.num_delta += 1
            payload = enc.payload
            if payload is not None:
                send(payload, b)
                call.bytes_wire += payload.nbytes
                self._count_wire(b, payload.nbytes, stats)
            if enc.header.count:
                call.applied(b, enc, self._advance)
            return None, None
        new = self._message(b, offsets, stats)
        send(new, b)
        call.bytes_wire += b.nbytes
        self._count_wire(b, b.nbytes, stats)
        spans = delta_spans(self, b)
        if spans is None or call.dropped(b):    # no baseline kept
            return None, None
        return (call.target(b, spans.nbytes, self._baseline_alloc(b)),
                [new[lo:hi] for lo, hi in spans.diffed])

    def _incoming(self, b: Bucket, head: np.ndarray | None, offsets: dict,
                  stats: ExecStats) -> tuple[Any, str]:
        """Where bucket ``b``'s payload lands and how it is then applied: ``"in place"``
        (the destination view itself), ``"unpack"`` (staging), ``"apply"`` (a delta), or
        ``(None, "unchanged")``: nothing follows the header."""
        quantized.count(self.quant, b, stats, "received")
        if head is not None:
            stats.bytes_received += HEADER_BYTES
            spans = delta_spans(self, b)
            assert spans is not None
            header = read_header(self._host(head), spans.unit, spans.nbytes // spans.unit)
            if header.kind != DENSE:
                size = header.nbytes if header.count else 0
                if not size:
                    return None, "unchanged"
                stats.bytes_received += size
                return self._buffer(b.dst, size), "apply"
        stats.bytes_received += b.nbytes
        buf = self._zero_copy_recv(b)
        if buf is not None:
            stats.num_zero_copy += 1
            return buf, "in place"
        return self._take(offsets, b.dst, b.nbytes), "unpack"

    def _land(self, b: Bucket, buf: Any, how: str) -> None:
        """Bucket ``b``'s payload arrived: unpack it, or apply the delta to its base (the
        destination items themselves, an FP8 item's scales and codes; a strided one read
        into scratch and written back; split blocks' pieces: see :mod:`.delta_land`)."""
        if how == "unpack":
            self._unpack(b, buf)
        spans = delta_spans(self, b)
        pieces = spans is not None and any(spans.rest)
        if how == "apply" or (how == "unchanged" and pieces):
            self._apply(b, buf)
        elif pieces:            # dense: the pieces as they landed, for the next delta
            keep_landed_pieces(self, b, spans)

    # ------------------------------------------------------------ memory hooks
    # host memory here; the device path (delta_device.DeviceDeltaExecutor) overrides them

    def _encoder(self, jobs: Sequence[tuple[Bucket, np.ndarray]]) -> Encoder:
        return Encoder(self, jobs, keep="new" if self.delta.atomic else "in place")

    def _buffer(self, rank: int, nbytes: int) -> Any:
        """An uninitialized message buffer of ``nbytes`` for ``rank``'s memory."""
        return np.empty(nbytes, np.uint8)

    def _outgoing(self, rank: int, data: np.ndarray) -> Any:
        """Host bytes ``data`` (a header) where ``rank``'s transport sends from."""
        return data

    def _host(self, buf: Any) -> np.ndarray:
        """A received buffer's bytes in host memory."""
        return buf

    def _baseline_alloc(self, b: Bucket) -> Callable[[int], Any] | None:
        """How bucket ``b``'s baseline is allocated (None: host memory)."""
        return None

    def _keep_dense(self, base: Any, new: Any) -> None:
        """A dense bucket's bytes ``new`` (being sent) into its baseline ``base``."""
        np.copyto(base, new)

    def _advance(self, enc: Encoded, base: Any) -> None:
        """A sent delta ``enc`` applied to its baseline ``base``."""
        apply_numpy(enc.message, base.view(bits_dtype(enc.header.itemsize)))

    def _apply(self, b: Bucket, buf: Any) -> None:
        """Apply the delta ``buf`` (None: nothing changed) to bucket ``b``'s items in place
        (:func:`.delta_land.apply_host`)."""
        spans = delta_spans(self, b)
        assert spans is not None
        apply_host(self, b, spans, buf)
