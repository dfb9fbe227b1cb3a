"""Delta refit inside the executor (``RefitConfig(delta=True)``, issue 22 phase 2).

A bucket is the unit of a delta: its sender keeps the bytes that bucket last put on the
wire (its *baseline*, host memory, after ``wire_dtype`` casts), compares the new bucket
with it bit by bit and sends whichever of dense, bitmask + values or runs + values is
smallest (:mod:`xreshard.delta`). Its receiver's base is its destination memory itself:
what the last confirmed call wrote there.

```
 sender rank s                                   receiver rank r
 pack bucket (or read it in place)
 encode against baseline[s, r, tag] ─ header ─>  32 bytes: kind and exact length
 baseline <- new (in place)          ─ payload > dense: into the destination (or staging)
                                                 delta: validate, apply to the destination
                                                 (in place when it is one contiguous run;
                                                 else read it into staging, apply, unpack)
```

Message sizes depend on the data while transports need matching sizes, so each round
runs two groups: the headers of its delta buckets (32 bytes each), then the payloads of
exact size. Buckets of pairs that go dense skip the header and move as in a plain refit.

**Fences.** ``refit/check`` carries this process's claims (:meth:`DeltaState.claims`): per
sending pair ``(s, r)`` the call its baseline is of and the digest of the pair's buckets;
per receiving rank the call its destination holds, per peer digest. The call is named by a
hash of a nonce from every process (the same everywhere). After planning, every process
derives the same decision per pair (:meth:`DeltaState.begin`): delta only when the
sender's and the receiver's claims are the same call and both digests are the current
schedule's; otherwise (a new or restarted receiver, a receiver that failed or missed a
call, a re-plan, a mismatched baseline) the pair's buckets go dense in the same call.
The baseline memory is updated as buckets leave, but its call moves only when the
outcome exchange confirmed the call on every process (:meth:`DeltaState.commit`); a call
that failed anywhere invalidates every claim of every process (:meth:`DeltaState.abort`):
every receiver may hold a mix, so the next call is dense.

A receiver's destination memory is fingerprinted when a call commits: where it lives
(buffer addresses) and what it holds (torch write-version counters, else a checksum). New
memory (a JAX receiver gets new arrays every call) silently drops the claim; the same
memory written outside xreshard is refused on every process at ``refit/check``, before any
byte moves (and the claim is dropped: the next call is dense).

A bucket whose sample mostly changed (:func:`mostly_changed`) is sent dense without a diff,
and the baselines of dense buckets are copied while the payloads move.

Buckets whose receiver casts (its dtype is not the wire dtype) always go dense: the
receiver could not read its base back bit for bit. Delta runs round after round on host
bindings (a relay and device bindings are refused before any byte moves).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..delta.codec import DENSE, HEADER_BYTES, Header, read_header
from ..delta.host import apply_numpy, encode_numpy
from ..dtypes import bits_dtype, itemsize
from ..planner.schedule import Bucket
from .copies import copy_into
from .execute import ExecStats, Executor

__all__ = ["DeltaCall", "DeltaExecutor", "DeltaState", "delta_problems"]


def delta_problems(config: Any, on_device: bool, quantized: bool = False) -> list[list[str]]:
    """What ``RefitConfig(delta=True)`` cannot run in this process, as error entries for
    ``refit/check`` (refused on every process before any byte moves): device bindings,
    destinations quantized on the way (FP8 items are packed per region, not diffed), and
    ``atomic=True`` (its shadow destinations are not fenced)."""
    if not getattr(config, "delta", False):
        return []
    found = []
    if on_device:
        found.append(["RefitError", "RefitConfig(delta=True) moves host bindings only in this "
                      "version, and this process binds device memory; run with delta=False "
                      "(or hold the weights in host memory)"])
    if quantized:
        found.append(["RefitError", "RefitConfig(delta=True) does not diff destinations "
                      "quantized on the way (FP8) in this version; run with delta=False"])
    if getattr(config, "atomic", False):
        found.append(["RefitError", "RefitConfig(delta=True) and atomic=True do not combine "
                      "in this version (deltas apply to live destinations); choose one"])
    return found


@dataclass
class _Baseline:
    """What one sending pair last put on the wire: per bucket tag, the bytes."""

    call: str | None = None
    """The confirmed call these bytes are of (None: not valid)."""
    digest: str | None = None
    buffers: dict[int, np.ndarray] = field(default_factory=dict)


class DeltaState:
    """What a delta refit keeps in this process between calls: its senders' baselines, its
    receivers' base calls and the fingerprint of their destination memory.

    A ``Refit`` holds one (``refit.delta_state``); hand it to the Refit of a new world
    (``new.delta_state = old.delta_state``) to keep sending deltas after a restart: peers
    whose claims still match get deltas, the others a dense refit.
    """

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], _Baseline] = {}
        self.base: dict[int, tuple[str, dict[int, str]]] = {}
        self.memory: tuple[str, str] | None = None
        self._nonce = ""
        self._digests: tuple[Any, dict[tuple[int, int], str]] | None = None

    @property
    def baseline_bytes(self) -> int:
        """Host memory the senders' baselines take (the bytes this process sends per call)."""
        return sum(buf.nbytes for b in self.sent.values() for buf in b.buffers.values())

    def reset(self) -> None:
        """Forget every claim (the memory stays for reuse): the next call is dense."""
        for b in self.sent.values():
            b.call = None
        self.base.clear()
        self.memory = None

    # ------------------------------------------------------------ refit/check

    def claims(self, dst: Any, receive_obj: Any) -> tuple[dict, list[list[str]]]:
        """This process's part of ``refit/check``, and the errors found: destination memory
        written outside xreshard since the last call."""
        errors: list[list[str]] = []
        if self.base and self.memory is not None:
            where, what = fingerprint(dst, receive_obj)
            if where != self.memory[0]:
                self.base.clear()           # other memory: it holds no base
            elif what != self.memory[1]:
                self.base.clear()
                errors.append(["RefitError", (
                    "RefitConfig(delta=True): this process's destination tensors were written "
                    "outside xreshard since the last refit (their write counters or checksum "
                    "moved), so they no longer hold the version a delta applies to; refused "
                    "before any byte moves. The next call sends them dense; do not write "
                    "refit destinations between calls (or call refit.delta_state.reset())")])
        if not self.base:
            self.memory = None
        self._nonce = secrets.token_hex(8)
        return {"nonce": self._nonce,
                "send": [[s, r, b.call, b.digest] for (s, r), b in sorted(self.sent.items())
                         if b.call is not None],
                "recv": [[r, call, sorted(d.items())] for r, (call, d) in
                         sorted(self.base.items())]}, errors

    # ------------------------------------------------------------ the call

    def begin(self, gathered: Sequence[Any], prepared: Any) -> DeltaCall:
        """The call's decision, the same in every process, from every process's claims
        (``refit/check``) and this process's schedule."""
        bodies = [g for g in gathered if isinstance(g, dict)]
        call_id = hashlib.sha256(
            "/".join(str(g.get("nonce")) for g in bodies).encode()).hexdigest()[:24]
        send: dict[tuple[int, int], tuple] = {}
        recv: dict[tuple[int, int], tuple] = {}
        for g in bodies:
            for s, r, call, digest in g.get("send") or ():
                send[(int(s), int(r))] = (call, digest)
            for r, call, pairs in g.get("recv") or ():
                for s, digest in pairs:
                    recv[(int(s), int(r))] = (call, digest)
        digests = self.pair_digests(prepared)
        pairs = frozenset(p for p, d in digests.items()
                          if send.get(p) is not None and send.get(p) == recv.get(p)
                          and send[p][1] == d)
        return DeltaCall(self, call_id, pairs, digests)

    def pair_digests(self, prepared: Any) -> dict[tuple[int, int], str]:
        """A digest of every local pair's buckets (what both ends of a pair compute alike)."""
        if self._digests is not None and self._digests[0] is prepared:
            return self._digests[1]
        stage = prepared.stages[0]
        hashes: dict[tuple[int, int], Any] = {}
        for rnd in prepared.schedule.rounds:
            for b in rnd:
                h = hashes.setdefault((b.src, b.dst), hashlib.sha256())
                h.update(repr((b.round, b.tag, b.stage, b.nbytes, [
                    (it.name, it.region.starts, it.region.stops, it.nbytes,
                     str(stage.wire_dtypes[it.name]), stage.dst_layouts[it.name].dtype)
                    for it in b.items])).encode())
        digests = {p: h.hexdigest()[:24] for p, h in hashes.items()}
        self._digests = (prepared, digests)
        return digests

    def commit(self, call: DeltaCall, dst: Any, receive_obj: Any) -> None:
        """Every process confirmed ``call``: its baselines and bases are of it now."""
        for pair in call.sent_pairs:
            b = self.sent.setdefault(pair, _Baseline())
            b.call, b.digest = call.call_id, call.digests[pair]
        for r in call.local_dst:
            self.base[r] = (call.call_id, {s: d for (s, rr), d in call.digests.items()
                                           if rr == r})
        self.memory = fingerprint(dst, receive_obj) if self.base else None

    def abort(self) -> None:
        """The call failed somewhere: every destination may hold a mix of two versions."""
        self.reset()


def fingerprint(dst: Any, receive_obj: Any) -> tuple[str, str]:
    """``(where, what)`` of this process's destination memory: the buffers' addresses and
    shapes, and a checksum of their bytes (``receive_obj`` is not read: kept for callers)."""
    if dst is None:
        return "", ""
    where, arrays = hashlib.sha256(), []
    for key in sorted(dst.bindings, key=repr):
        value = dst.bindings[key]
        for arr in value if isinstance(value, (list, tuple)) else (value,):
            where.update(repr((key, arr.__array_interface__["data"][0], arr.shape,
                               arr.strides)).encode())
            arrays.append(arr)
    from . import verify
    # by content, never torch write counters: fused optimizers, ``.data`` and numpy views
    # write without moving them (see xreshard.runtime.writes)
    what = "/".join(verify.checksum(a) for a in arrays)
    return where.hexdigest(), hashlib.sha256(what.encode()).hexdigest()


@dataclass
class DeltaCall:
    """One call's delta decision and what it moved (see :class:`DeltaState`)."""

    state: DeltaState
    call_id: str
    pairs: frozenset[tuple[int, int]]
    """The ``(src, dst)`` pairs whose buckets go as deltas; the others dense."""
    digests: dict[tuple[int, int], str]
    sent_pairs: set[tuple[int, int]] = field(default_factory=set)
    local_dst: set[int] = field(default_factory=set)
    bytes_dense: int = 0
    """What these buckets take dense (the plain refit's bytes)."""
    bytes_wire: int = 0
    """What this process's senders put on the wire: headers and payloads."""
    num_delta: int = 0
    """Buckets sent encoded (not dense)."""
    encode_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"pairs": len([p for p in self.pairs if p in self.sent_pairs]),
                "bytes_dense": self.bytes_dense, "bytes_wire": self.bytes_wire,
                "num_delta": self.num_delta, "encode_seconds": self.encode_seconds,
                "baseline_bytes": self.state.baseline_bytes}


# ---------------------------------------------------------------------------- the executor

#: a bucket is sent dense without a diff when a sample of it changed at least this much
DENSE_SAMPLE_FRACTION = 0.9
_SAMPLE_BLOCKS, _SAMPLE_ELEMENTS = 16, 2048


def mostly_changed(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether most of a bucket changed, from 16 blocks spread over it: the diff is then
    skipped and the bucket sent dense (a cost policy: dense is always a valid message; a
    step that changed most weights costs a dense refit plus the baseline's copy)."""
    n = old.size
    if n <= _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS or old.dtype.kind != "u":
        return False
    stride = n // _SAMPLE_BLOCKS
    changed = sum(int(np.count_nonzero(old[a:a + _SAMPLE_ELEMENTS] != new[a:a + _SAMPLE_ELEMENTS]))
                  for a in range(0, stride * _SAMPLE_BLOCKS, stride))
    return changed >= DENSE_SAMPLE_FRACTION * _SAMPLE_BLOCKS * _SAMPLE_ELEMENTS



class DeltaExecutor(Executor):
    """The executor of a delta call: rounds one after another, each a group of headers then
    a group of payloads (see the module docstring). Pack, unpack and same-rank copies are
    the plain executor's."""

    def __init__(self, *args: Any, delta: DeltaCall, **kwargs: Any):
        kwargs["pipeline"] = False
        super().__init__(*args, **kwargs)
        self.delta = delta

    def _unit(self, b: Bucket) -> int | None:
        """The element size a bucket is compared in (its narrowest wire dtype), or None when
        it cannot go as a delta (its receiver casts: it cannot read its base back)."""
        t = self.tables[b.stage]
        wire = self.programs.wire(b.stage)
        if b.stage != 0 or any(t.dst_layouts[it.name].dtype != wire[it.name]
                               for it in b.items):
            return None
        return min(itemsize(wire[it.name]) for it in b.items)

    def _round(self, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        tr = time.perf_counter()
        call = self.delta
        offsets: dict[int | None, int] = {}
        sends = [b for b in buckets if b.src in self._local_src]
        recvs = [b for b in buckets if b.dst in self._local_dst]
        call.local_dst.update(b.dst for b in recvs)
        call.sent_pairs.update((b.src, b.dst) for b in sends)
        heads: dict[Bucket, np.ndarray] = {}
        out: dict[Bucket, Any] = {}
        self._copies: list[tuple[np.ndarray, Any]] = []     # baseline <- new, when sent
        for b in sends:
            out[b] = self._outgoing(b, offsets, heads, stats)
        heads_in: dict[Bucket, np.ndarray] = {b: np.empty(HEADER_BYTES, np.uint8) for b in recvs
                    if (b.src, b.dst) in call.pairs and self._unit(b)}
        if heads or heads_in:
            with self.transport.group(self.timeout):
                for b, h in heads_in.items():
                    self.transport.recv(h, b.src, b.dst, b.tag)
                for b, h in heads.items():
                    self.transport.send(h, b.src, b.dst, b.tag)
        incoming = [self._incoming(b, heads_in.get(b), offsets, stats) for b in recvs]
        with self.transport.group(self.timeout):
            for b, (buf, _) in zip(recvs, incoming):
                if buf is not None:
                    self.transport.recv(buf, b.src, b.dst, b.tag)
            for b, buf in out.items():
                if buf is not None:
                    self.transport.send(buf, b.src, b.dst, b.tag)
            # gloo and shm move posted sends at once: the baselines' copies overlap them
            for base, new in self._copies:
                np.copyto(base, new)
        for b, (buf, how) in zip(recvs, incoming):
            self._land(b, buf, how, offsets)
        stats.per_round_seconds.append(time.perf_counter() - tr)

    def _outgoing(self, b: Bucket, offsets: dict, heads: dict[Bucket, np.ndarray],
                  stats: ExecStats) -> Any:
        """Bucket ``b``'s payload (packed, or the bound view; None: nothing changed); encoded
        against its baseline when its pair goes as a delta (its header into ``heads``), and
        the baseline updated."""
        call = self.delta
        new = self._message(b, offsets, stats)
        stats.num_messages += 1
        call.bytes_dense += b.nbytes
        unit = self._unit(b)
        payload = new if unit is None else self._against_baseline(b, new, unit, heads)
        wire = (HEADER_BYTES if b in heads else 0) + (0 if payload is None else payload.nbytes)
        call.bytes_wire += wire
        stats.bytes_sent += wire
        return payload

    def _against_baseline(self, b: Bucket, new: Any, unit: int,
                          heads: dict[Bucket, np.ndarray]) -> Any:
        """Encode ``new`` against bucket ``b``'s baseline when its pair goes as a delta (the
        header into ``heads``); returns the payload (None: nothing changed) and updates the
        baseline (applying the message now, or copying ``new`` while the payloads move)."""
        call = self.delta
        t0 = time.perf_counter()
        pair = call.state.sent.setdefault((b.src, b.dst), _Baseline())
        base = pair.buffers.get(b.tag)
        if base is None or base.nbytes != b.nbytes:
            base = pair.buffers[b.tag] = np.empty(b.nbytes, np.uint8)
        bits = bits_dtype(unit)
        old, cur = base.view(bits), new.view(bits)
        payload = new
        if (b.src, b.dst) in call.pairs:
            n = b.nbytes // unit
            header, msg = Header(DENSE, unit, n, n, 0), None
            if not mostly_changed(old, cur):
                msg = encode_numpy(old, cur)
                header = msg.header
            heads[b] = np.frombuffer(header.pack(), np.uint8).copy()
            if msg is not None and header.kind != DENSE:
                call.num_delta += 1
                payload = msg.to_bytes() if header.count else None
                if payload is not None:
                    apply_numpy(payload, old)
        if payload is new:              # dense (or a dense pair, which seeds it)
            self._copies.append((base, new))
        call.encode_seconds += time.perf_counter() - t0
        return payload

    def _incoming(self, b: Bucket, head: np.ndarray | None, offsets: dict,
                  stats: ExecStats) -> tuple[Any, str]:
        """Where bucket ``b``'s payload lands and how it is then applied: ``"in place"``
        (the destination view itself), ``"unpack"`` (staging), ``"apply"`` (a delta), or
        ``(None, "unchanged")``: nothing changed, nothing follows the header."""
        if head is not None:
            stats.bytes_received += HEADER_BYTES
            unit = self._unit(b)
            assert unit is not None
            header = read_header(head, unit, b.nbytes // unit)
            if header.kind != DENSE and not header.count:
                return None, "unchanged"
            if header.kind != DENSE:
                stats.bytes_received += header.nbytes
                return np.empty(header.nbytes, np.uint8), "apply"
        stats.bytes_received += b.nbytes
        buf = self._zero_copy_recv(b)
        if buf is not None:
            stats.num_zero_copy += 1
            return buf, "in place"
        return self._take(offsets, b.dst, b.nbytes), "unpack"

    def _land(self, b: Bucket, buf: Any, how: str, offsets: dict) -> None:
        """Bucket ``b``'s payload arrived: unpack it, or apply the delta to its base."""
        if how == "unpack":
            self._unpack(b, buf)
        if how != "apply":
            return
        bits = bits_dtype(self._unit(b))
        view = self._zero_copy_recv(b)
        if view is not None:                    # the destination is the base: in place
            apply_numpy(buf, view.view(bits))
            return
        staging = self._take(offsets, b.dst, b.nbytes)
        self._read_back(b, staging)
        apply_numpy(buf, staging.view(bits))
        self._unpack(b, staging)

    def _read_back(self, b: Bucket, buf: np.ndarray) -> None:
        """Bucket ``b``'s destination regions into ``buf``, as the last call wrote them
        (bits: the receiver's dtype is the wire's)."""
        bindings = self.tables[b.stage].dst_bindings
        for e in self.programs.program(b, 1):
            out = buf[e.lo:e.hi].view(e.bits).reshape(e.shape)
            arr = bindings[e.key]
            copy_into(np, out, e.wire, (arr if e.index is None else arr[e.index])[e.slices],
                      e.dtype)

