"""The message codec of a delta call (``RefitConfig(delta=True)``): encode on worker
threads, ahead of the wire.

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

from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from ...delta.codec import DENSE, HEADER_BYTES, Header, read_header
from ...delta.host import apply_numpy
from ...dtypes import bits_dtype
from ...planner.schedule import Bucket
from .. import quantized
from ..delta_encode import Encoded, Encoder, delta_spans, delta_unit
from ..delta_land import apply_host, gather, keep_landed_pieces
from .framing import Group

__all__ = ["DeltaCodec"]


class DeltaCodec:
    """The message codec of a delta call (``Sized`` framing: see the module docstring).

    The executor (:class:`~xreshard.runtime.execute.Executor`) runs it through its one
    round loop and its one pipelined loop: each group is :meth:`open` (what it receives
    and what it sends), :meth:`post` (the previous round's payloads, then this round's
    headers) and, once the group moved, :meth:`land`. Packing, unpacking and same-rank
    copies are the executor's (its item codecs). Host memory here; the device path
    (:class:`xreshard.runtime.delta_device.DeviceDeltaCodec`) overrides the memory hooks.

    Args:
        delta: the call's decision and accounting (``delta_wire.DeltaCall``); its
            ``encoder`` (started ahead of the call) is used when it encodes this call.
    """

    #: headers go one group ahead of their payloads: group ``k`` carries round ``k - 1``'s
    #: payloads and round ``k``'s headers (``lag`` 1), and its receives are sized by the
    #: headers of group ``k - 1``
    sized = True
    lag = 1

    def __init__(self, delta: Any):
        self.delta = delta
        self.ex: Any = None

    def pipelines(self, ex: Any) -> bool:
        """Whether the executor may run this call pipelined: not with a relay's forwards (a
        forward is encoded from bytes that landed two rounds before it, and the pipelined
        groups land after posting)."""
        return not ex.forwarded

    def start(self, ex: Any) -> None:
        """Before the rounds: the encoder of this call's sends (the one started ahead of
        the call when it covers them) and the forwards' bookkeeping."""
        self.ex = ex
        call = self.delta
        local = {r for t in ex.tables for r, _ in t.src_bindings}
        wanted = [(b, spans) for rnd in ex.schedule.rounds for b in rnd
                  if b.src in local and (b.src, b.dst) in call.pairs and not call.promised(b)
                  and (spans := delta_spans(ex, b)) is not None and not ex._is_forward(b)]
        encoder = call.encoder
        if encoder is None or not {b for b, _ in wanted} <= encoder.buckets \
                or not self._takes(encoder):
            if encoder is not None:
                encoder.stop()
                encoder.forget(call.state.sent)
            encoder = call.encoder = self._new_encoder([
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
        self._relayed(local)

    def _takes(self, encoder: Encoder) -> bool:
        """Whether an encoder started ahead of the call encodes as this codec does (the
        host path takes the host encoder; the device path its own)."""
        return type(encoder) is Encoder

    def stop(self, ex: Any) -> None:
        """After the rounds, whatever happened: the encoders' threads stopped, their time
        in the call's accounting."""
        call = self.delta
        encoder = getattr(self, "_encoder", None)
        if encoder is not None:
            encoder.stop()
        forwards = getattr(self, "_forward_encoder", None)
        if forwards is not None:
            forwards.stop()
        used = [e for e in (encoder, forwards) if e is not None and e.buckets]
        if used:
            call.encode_seconds = max(e.finished for e in used) - min(e.started
                                                                      for e in used)
            call.encode_threads = max(e.threads for e in used)

    def after_group(self, ex: Any, k: int) -> None:
        """Group ``k`` ran round after round: start encoding the forwards whose bytes
        landed."""
        self._encode_forwards(k + 1)

    # ------------------------------------------------------------ a relay's forwards

    def _relayed(self, local: set[int]) -> None:
        """This process's forwards that go as deltas, to encode once their bytes landed
        (:meth:`_encode_forwards`), on an encoder of their own that reads this executor's
        stage-1 bindings (views of the destination memory)."""
        call = self.delta
        self._forwards = deque(sorted(
            (b for rnd in self.ex.schedule.rounds for b in rnd
             if b.src in local and self.ex._is_forward(b) and (b.src, b.dst) in call.pairs
             and delta_spans(self.ex, b) is not None), key=lambda b: b.round))
        self._rounds_run = 0
        self._encode_forwards(1)

    def _encode_forwards(self, upto: int) -> None:
        """Start encoding the forwards of rounds up to ``upto``: every round two before
        theirs has landed (the schedule runs a delta call's forward two rounds after its
        bytes arrive; round ``k`` lands at the end of group ``k + 1``)."""
        jobs = []
        while self._forwards and self._forwards[0].round <= upto:
            b = self._forwards.popleft()
            spans = delta_spans(self.ex, b)
            base = None if spans is None else self.delta.baseline(b, spans.nbytes)
            if base is not None:
                jobs.append((b, base))
        if not jobs:
            return
        if self._forward_encoder is None:
            self._forward_encoder = self._new_encoder(jobs, forwards=True)
        else:
            self._forward_encoder.add(jobs)

    def _encoded(self, b: Bucket) -> Encoded | None:
        """Bucket ``b``'s encoding (waits for it), None when it was not encoded."""
        encoder = self._forward_encoder if self.ex._is_forward(b) else self._encoder
        return None if encoder is None else encoder.result(b, self.ex.timeout)

    def _count_wire(self, b: Bucket, nbytes: int, stats: Any) -> None:
        """``nbytes`` of bucket ``b`` posted: forwarded (a relay's) or sent."""
        if self.ex._is_forward(b):
            stats.bytes_forwarded += nbytes
        else:
            stats.bytes_sent += nbytes

    def open(self, ex: Any, k: int, buckets: Sequence[Bucket], offsets: dict,
             stats: Any) -> Group:
        """Group ``k`` (``buckets``: round ``k``'s, none for the last group): see
        :meth:`_open`."""
        incoming, recvs, previous, sends = self._open(buckets, offsets, stats)
        return Group(recvs, (previous, sends), incoming,
                     moves=bool(recvs or previous or sends),
                     idle=not (recvs or previous or sends or incoming))

    def post(self, ex: Any, group: Group, send: Callable[[Any, Bucket], None],
             offsets: dict, stats: Any, landed: Callable[[], None] | None = None) -> None:
        """Post group ``group``'s sends: the previous round's payloads, then the headers."""
        previous, sends = group.sends
        self._posts(send, previous, sends, offsets, stats)

    def land(self, ex: Any, landing: list) -> None:
        """The payloads of a group moved: unpack or apply each."""
        for b, buf, how in landing:
            with ex._on(b.dst):
                self._land(b, buf, how)

    def _open(self, buckets: Sequence[Bucket], offsets: dict, stats: Any
              ) -> tuple[list, list, list, list]:
        """What the next group moves: the previous round's landing buckets with where
        their payloads land (``incoming``), the receives to post (payloads, then
        ``buckets``' headers), the previous round's sends (their payloads) and
        ``buckets``' sends (their headers)."""
        call = self.delta
        previous, self._sent = self._sent, []
        incoming = [(b, *self._incoming_on(b, self._heads_in.pop(b, None), offsets, stats))
                    for b in self._landing]
        self._landing = [b for b in buckets if b.dst in self.ex._local_dst]
        call.local_dst.update(b.dst for b in self._landing)
        self._heads_in = {b: self._buffer(b.dst, HEADER_BYTES) for b in self._landing
                          if (b.src, b.dst) in call.pairs and delta_unit(self.ex, b) is not None
                          and not call.promised(b)}
        sends = [b for b in buckets if b.src in self.ex._local_src]
        call.sent_pairs.update((b.src, b.dst) for b in sends)
        recvs = [(buf, b) for b, buf, _ in incoming if buf is not None]
        return incoming, recvs + [(h, b) for b, h in self._heads_in.items()], previous, sends

    def _posts(self, send: Callable[[Any, Bucket], None], previous: list, sends: list,
               offsets: dict, stats: Any) -> None:
        """Post the previous round's payloads, then ``sends``' headers: the payloads move
        while this thread updates their baselines and waits for the headers' encodes."""
        # each bucket's packs and posts on its sender's device and stream: a process with
        # several GPUs packs on the bucket's device, and NCCL there orders after the pack
        copies = []
        for b, enc in previous:
            with self.ex._on(b.src):
                copies.append((b, self._send_payload(b, enc, offsets, stats, send)))
        for b, (base, pieces) in copies:
            if base is not None:
                with self.ex._on(b.src):
                    if len(pieces) == 1:        # the device path keeps its own memory
                        self._keep_dense(base, pieces[0])
                    else:
                        gather(base, pieces)
        for b in sends:
            with self.ex._on(b.src):
                self._send_header(b, stats, send)

    def _send_header(self, b: Bucket, stats: Any,
                     send: Callable[[Any, Bucket], None]) -> None:
        """Bucket ``b``'s header, when its pair goes as a delta (waits for its encode)."""
        call = self.delta
        stats.num_messages += 1
        call.bytes_dense += b.nbytes
        quantized.count(self.ex.quant, b, stats, "sent")
        enc = None
        spans = delta_spans(self.ex, b)
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

    def _send_payload(self, b: Bucket, enc: Encoded | None, offsets: dict, stats: Any,
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
        new = self.ex._message(b, offsets, stats)
        send(new, b)
        call.bytes_wire += b.nbytes
        self._count_wire(b, b.nbytes, stats)
        spans = delta_spans(self.ex, b)
        if spans is None or call.dropped(b):    # no baseline kept
            return None, None
        return (call.target(b, spans.nbytes, self._baseline_alloc(b)),
                [new[lo:hi] for lo, hi in spans.diffed])

    def _incoming_on(self, b: Bucket, head: Any, offsets: dict, stats: Any
                     ) -> tuple[Any, str]:
        with self.ex._on(b.dst):       # the header is read on the receiver's device
            return self._incoming(b, head, offsets, stats)

    def _incoming(self, b: Bucket, head: np.ndarray | None, offsets: dict,
                  stats: Any) -> tuple[Any, str]:
        """Where bucket ``b``'s payload lands and how it is then applied: ``"in place"``
        (the destination view itself), ``"unpack"`` (staging), ``"apply"`` (a delta), or
        ``(None, "unchanged")``: nothing follows the header."""
        quantized.count(self.ex.quant, b, stats, "received")
        if head is not None:
            stats.bytes_received += HEADER_BYTES
            spans = delta_spans(self.ex, b)
            assert spans is not None
            header = read_header(self._host(head), spans.unit, spans.nbytes // spans.unit)
            if header.kind != DENSE:
                size = header.nbytes if header.count else 0
                if not size:
                    return None, "unchanged"
                stats.bytes_received += size
                return self._buffer(b.dst, size), "apply"
        stats.bytes_received += b.nbytes
        buf = self.ex._zero_copy_recv(b)
        if buf is not None:
            stats.num_zero_copy += 1
            return buf, "in place"
        return self.ex._take(offsets, b.dst, b.nbytes), "unpack"

    def _land(self, b: Bucket, buf: Any, how: str) -> None:
        """Bucket ``b``'s payload arrived: unpack it, or apply the delta to its base (the
        destination items themselves, an FP8 item's scales and codes; a strided one read
        into scratch and written back; split blocks' pieces: see :mod:`.delta_land`)."""
        if how == "unpack":
            self.ex._unpack(b, buf)
        spans = delta_spans(self.ex, b)
        pieces = spans is not None and any(spans.rest)
        if how == "apply" or (how == "unchanged" and pieces):
            self._apply(b, buf)
        elif pieces:            # dense: the pieces as they landed, for the next delta
            keep_landed_pieces(self.ex, self.delta, b, spans)

    # ------------------------------------------------------------ memory hooks
    # host memory here; the device path (delta_device.DeviceDeltaCodec) overrides them

    def _new_encoder(self, jobs: Sequence[tuple[Bucket, np.ndarray]], *,
                     forwards: bool = False) -> Encoder:
        """An encoder of ``jobs``: a relay's ``forwards`` (encoded once their bytes
        landed, never packed into their baselines ahead) or this call's own sends."""
        if forwards:
            return Encoder(self.ex, jobs)
        return Encoder(self.ex, jobs, keep="new" if self.delta.atomic else "in place")

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
        spans = delta_spans(self.ex, b)
        assert spans is not None
        apply_host(self.ex, self.delta, b, spans, buf)
