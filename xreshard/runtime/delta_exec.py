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
The encoder may even start before ``refit/check`` (:meth:`DeltaState.encode_ahead`: the
diff overlaps the check's gather and the receivers' fingerprints), since it only reads the
sources and the baselines: a baseline is written by the calling thread alone, once the
call's decision is known, as its bucket's payload is posted (a delta: the message applied;
dense: the new bytes copied while they move).

A bucket is read in place for the diff when its items are contiguous views that need no
cast (a JAX array's or a torch tensor's memory; nothing is packed); otherwise the encoder
packs it into scratch of its own. Its receiver applies a delta to its destination items
in place (contiguous views of the wire dtype), or reads a strided item into scratch,
applies and writes it back. One round's staging is live at a time (round ``k - 1``'s,
during group ``k``; landed before group ``k + 1``), so the arena is the largest round's.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..delta.codec import DENSE, HEADER_BYTES, Header, read_header
from ..delta.host import apply_numpy, apply_parts, encode_parts
from ..dtypes import bits_dtype, itemsize
from ..errors import RefitError
from ..planner.schedule import Bucket
from .copies import copy_into
from .execute import ExecStats, Executor

__all__ = ["DeltaExecutor", "Encoder", "Encoded", "ENCODE_THREADS", "mostly_changed",
           "delta_unit"]

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
    n = old.size
    if n <= _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS or old.dtype.kind != "u":
        return False
    stride, changed, base, k = n // _SAMPLE_BLOCKS, 0, 0, 0
    for a in range(0, stride * _SAMPLE_BLOCKS, stride):
        while base + parts[k].size <= a:
            base += parts[k].size
            k += 1
        p = parts[k][a - base:a - base + _SAMPLE_ELEMENTS]       # clipped at a part's end
        changed += int(np.count_nonzero(old[a:a + p.size] != p))
    return changed >= DENSE_SAMPLE_FRACTION * _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS


def delta_unit(reader: Executor, b: Bucket) -> int | None:
    """The element size bucket ``b`` is compared in (its narrowest wire dtype), or None
    when it cannot go as a delta (its receiver casts: it could not read its base back bit
    for bit). A relay's forwards (stage 1) go as deltas too (see
    :mod:`xreshard.planner.relay`)."""
    if b.stage >= len(reader.tables):
        return None
    t, wire = reader.tables[b.stage], reader.programs.wire(b.stage)
    if any(t.dst_layouts[it.name].dtype != wire[it.name] for it in b.items):
        return None
    return min(itemsize(wire[it.name]) for it in b.items)


@dataclass
class Encoded:
    """What the encoder made of one bucket."""

    message: np.ndarray | None
    """The delta message (header included); None: send the bucket dense."""
    header: Header
    seconds: float


class Encoder:
    """Finds and encodes the changes of buckets against their baselines on worker threads,
    in the order given, without waiting for anything (see the module docstring).

    It reads the sources (through ``reader``, an executor over the call's source bindings)
    and the baselines, and writes neither: the calling thread updates a baseline once its
    bucket's payload is posted.

    Args:
        reader: an executor whose stage-0 source bindings and programs the buckets read.
        jobs: ``(bucket, baseline)`` in schedule order (a baseline of ``bucket.nbytes``).
        threads: worker threads.
    """

    def __init__(self, reader: Executor, jobs: Sequence[tuple[Bucket, np.ndarray]],
                 threads: int = ENCODE_THREADS):
        self.reader = reader
        self.threads = max(1, threads)
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

    @property
    def seconds(self) -> float:
        """Wall time from the first encode's start to the last one's end."""
        return self.finished - self.started

    def _encode(self, b: Bucket, base: np.ndarray) -> Encoded | None:
        if self._stop.is_set():
            return None
        t0 = time.perf_counter()
        unit = delta_unit(self.reader, b)
        assert unit is not None, "a bucket that cannot go as a delta was given to encode"
        bits = bits_dtype(unit)
        n = b.nbytes // unit
        parts = self._parts(b, bits)
        old = base.view(bits)
        msg = None if mostly_changed(old, parts) else encode_parts(old, parts)
        header = Header(DENSE, unit, n, n, 0) if msg is None else msg.header
        out = Encoded(None if msg is None else msg.to_bytes(), header,
                      time.perf_counter() - t0)
        with self._lock:
            self.finished = max(self.finished, time.perf_counter())
        return out

    def _parts(self, b: Bucket, bits: Any) -> list[np.ndarray]:
        """Bucket ``b``'s new bytes as contiguous pieces of ``bits`` elements: its items'
        own memory when every item is a contiguous view that needs no cast, else the
        bucket packed into this worker's scratch."""
        reader = self.reader
        steps = reader.programs.program(b, 0)
        bindings = reader.tables[b.stage].src_bindings
        if len(steps) <= _MAX_PARTS and all(e.quant is None and e.dtype == e.wire
                                            for e in steps):
            views = [(bindings[e.key] if e.index is None else bindings[e.key][e.index])
                     [e.slices] for e in steps]
            if all(isinstance(v, np.ndarray) and v.flags.c_contiguous for v in views):
                return [v.reshape(-1).view(np.uint8).view(bits) for v in views]
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or scratch.nbytes < b.nbytes:
            scratch = self._scratch.buf = np.empty(b.nbytes, np.uint8)
        buf = scratch[:b.nbytes]
        reader._pack(b, buf)
        return [buf.view(bits)]


class DeltaExecutor(Executor):
    """The executor of a delta call (see the module docstring). Packing, unpacking and
    same-rank copies are the plain executor's.

    Args:
        delta: the call's decision and accounting (``delta_wire.DeltaCall``); its
            ``encoder`` (started ahead of the call) is used when it encodes this call.
    """

    def __init__(self, *args: Any, delta: Any, **kwargs: Any):
        kwargs["pipeline"] = False
        super().__init__(*args, **kwargs)
        self.delta = delta

    def run(self) -> ExecStats:
        """Move everything (see :meth:`Executor.run`); the encoder's threads are stopped
        before this returns, whatever happened."""
        call = self.delta
        local = {r for t in self.tables for r, _ in t.src_bindings}
        wanted = [b for rnd in self.schedule.rounds for b in rnd
                  if b.src in local and (b.src, b.dst) in call.pairs
                  and delta_unit(self, b) is not None and not self._is_forward(b)]
        encoder = call.encoder
        if encoder is None or not set(wanted) <= encoder.buckets:
            if encoder is not None:
                encoder.stop()
            encoder = call.encoder = self._encoder([(b, base) for b in wanted
                                                    if (base := call.baseline(b)) is not None])
        else:
            want = set(wanted)
            encoder.drop(want.__contains__)
        self._encoder = encoder
        self._forward_encoder: Encoder | None = None
        self._sent: list[tuple[Bucket, Encoded | None]] = []    # headers sent, payloads next
        self._heads_in: dict[Bucket, np.ndarray] = {}
        self._landing: list[Bucket] = []        # received headers, payloads next
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
             and delta_unit(self, b) is not None), key=lambda b: b.round))
        self._rounds_run = 0
        self._encode_forwards(1)

    def _encode_forwards(self, upto: int) -> None:
        """Start encoding the forwards of rounds up to ``upto``: every round two before
        theirs has landed (the schedule runs a delta call's forward two rounds after its
        bytes arrive; round ``k`` lands at the end of group ``k + 1``)."""
        jobs = []
        while self._forwards and self._forwards[0].round <= upto:
            b = self._forwards.popleft()
            base = self.delta.baseline(b)
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
        """One group: the previous round's payloads and ``buckets``' headers; then the
        previous round lands."""
        tr = time.perf_counter()
        call = self.delta
        offsets: dict[int | None, int] = {}
        previous, self._sent = self._sent, []
        incoming = [(b, *self._incoming(b, self._heads_in.pop(b, None), offsets, stats))
                    for b in self._landing]
        self._landing = [b for b in buckets if b.dst in self._local_dst]
        call.local_dst.update(b.dst for b in self._landing)
        heads_in = {b: self._buffer(b.dst, HEADER_BYTES) for b in self._landing
                    if (b.src, b.dst) in call.pairs and delta_unit(self, b) is not None}
        sends = [b for b in buckets if b.src in self._local_src]
        call.sent_pairs.update((b.src, b.dst) for b in sends)
        if not (incoming or heads_in or previous or sends):
            return
        with self.transport.group(self.timeout):
            for b, buf, _ in incoming:
                if buf is not None:
                    self.transport.recv(buf, b.src, b.dst, b.tag)
            for b, h in heads_in.items():
                self.transport.recv(h, b.src, b.dst, b.tag)
            # the payloads go first and move while this thread updates their baselines
            # and waits for the encodes of this round's headers
            copies = [self._send_payload(b, enc, offsets, stats) for b, enc in previous]
            for base, new in copies:
                if base is not None:
                    self._keep_dense(base, new)
            for b in sends:
                self._send_header(b, stats)
        for b, buf, how in incoming:
            self._land(b, buf, how)
        self._heads_in = heads_in
        stats.per_round_seconds.append(time.perf_counter() - tr)

    def _send_header(self, b: Bucket, stats: ExecStats) -> None:
        """Bucket ``b``'s header, when its pair goes as a delta (waits for its encode)."""
        call = self.delta
        stats.num_messages += 1
        call.bytes_dense += b.nbytes
        enc = None
        if (b.src, b.dst) in call.pairs and delta_unit(self, b) is not None:
            enc = self._encoded(b)
            if enc is None:         # no baseline of this bucket's size: dense
                unit = delta_unit(self, b)
                n = b.nbytes // unit
                enc = Encoded(None, Header(DENSE, unit, n, n, 0), 0.0)
            head = self._outgoing(b.src, np.frombuffer(enc.header.pack(), np.uint8))
            self.transport.send(head, b.src, b.dst, b.tag)
            call.bytes_wire += HEADER_BYTES
            self._count_wire(b, HEADER_BYTES, stats)
        self._sent.append((b, enc))

    def _send_payload(self, b: Bucket, enc: Encoded | None, offsets: dict,
                      stats: ExecStats) -> tuple[np.ndarray | None, Any]:
        """Post bucket ``b``'s payload (none when nothing changed) and update its baseline:
        a delta is applied now; returns ``(baseline, new bytes)`` to copy for a dense one
        (``(None, None)`` otherwise: also a bucket whose receiver casts, which never goes
        as a delta and keeps no baseline)."""
        call = self.delta
        if enc is not None and enc.message is not None:      # a delta
            call.num_delta += 1
            if enc.header.count:
                self.transport.send(enc.message, b.src, b.dst, b.tag)
                call.bytes_wire += enc.message.nbytes
                self._count_wire(b, enc.message.nbytes, stats)
                self._advance(enc, call.baseline(b))
            return None, None
        new = self._message(b, offsets, stats)
        self.transport.send(new, b.src, b.dst, b.tag)
        call.bytes_wire += b.nbytes
        self._count_wire(b, b.nbytes, stats)
        if delta_unit(self, b) is None:
            return None, None
        return call.baseline(b, create=True, alloc=self._baseline_alloc(b)), new

    def _incoming(self, b: Bucket, head: np.ndarray | None, offsets: dict,
                  stats: ExecStats) -> tuple[Any, str]:
        """Where bucket ``b``'s payload lands and how it is then applied: ``"in place"``
        (the destination view itself), ``"unpack"`` (staging), ``"apply"`` (a delta), or
        ``(None, "unchanged")``: nothing changed, nothing follows the header."""
        if head is not None:
            stats.bytes_received += HEADER_BYTES
            unit = delta_unit(self, b)
            assert unit is not None
            header = read_header(self._host(head), unit, b.nbytes // unit)
            if header.kind != DENSE and not header.count:
                return None, "unchanged"
            if header.kind != DENSE:
                stats.bytes_received += header.nbytes
                return self._buffer(b.dst, header.nbytes), "apply"
        stats.bytes_received += b.nbytes
        buf = self._zero_copy_recv(b)
        if buf is not None:
            stats.num_zero_copy += 1
            return buf, "in place"
        return self._take(offsets, b.dst, b.nbytes), "unpack"

    def _land(self, b: Bucket, buf: Any, how: str) -> None:
        """Bucket ``b``'s payload arrived: unpack it, or apply the delta to its base (the
        destination items themselves; a strided one read into scratch and written back)."""
        if how == "unpack":
            self._unpack(b, buf)
        if how == "apply":
            self._apply(b, buf)

    # ------------------------------------------------------------ memory hooks
    # host memory here; the device path (delta_device.DeviceDeltaExecutor) overrides them

    def _encoder(self, jobs: Sequence[tuple[Bucket, np.ndarray]]) -> Encoder:
        return Encoder(self, jobs)

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
        """Apply the delta ``buf`` to bucket ``b``'s destination items in place."""
        unit = delta_unit(self, b)
        bits = bits_dtype(unit)
        bindings = self.tables[b.stage].dst_bindings
        parts, back = [], []
        for e in self.programs.program(b, 1):
            arr = bindings[e.key]
            view = (arr if e.index is None else arr[e.index])[e.slices]
            if isinstance(view, np.ndarray) and view.flags.c_contiguous \
                    and view.flags.writeable:
                parts.append(view.reshape(-1).view(np.uint8).view(bits))
                continue
            scratch = np.empty(e.hi - e.lo, np.uint8)
            copy_into(np, scratch.view(e.bits).reshape(e.shape), e.wire, view, e.dtype)
            parts.append(scratch.view(bits))
            back.append((e, view, scratch))
        apply_parts(buf, parts, unit, b.nbytes // unit)
        for e, view, scratch in back:
            copy_into(np, view, e.dtype, scratch.view(e.bits).reshape(e.shape), e.wire)
