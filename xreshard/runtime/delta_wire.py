"""Delta refit inside the executor (``RefitConfig(delta=True)``, issue 22 phase 2): the
state a process keeps between calls and the version fences.

A bucket is the unit of a delta: its sender keeps the bytes that bucket last put on the
wire (its *baseline*, host memory, after ``wire_dtype`` casts), compares the new bucket
with it bit by bit and sends whichever of dense, bitmask + values or runs + values is
smallest (:mod:`xreshard.delta`). Its receiver's base is its destination memory itself:
what the last confirmed call wrote there. How a call moves (headers one group ahead of
their payloads, the diff on worker threads ahead of the wire): :mod:`.codecs.delta`.

```
 sender rank s                                      receiver rank r
 encoder threads: diff bucket vs baseline[s, r, tag]
 group k:   header (32 bytes: kind, exact length) ─>  sizes its receive
 group k+1: payload ─────────────────────────────>  dense: into the destination (or staging)
            baseline <- new (a delta applied,        delta: validate, apply to the
            dense bytes copied while they move)      destination items in place
```

**Fences.** ``refit/check`` carries this process's claims (:meth:`DeltaState.claims`): per
sending pair ``(s, r)`` the call its baseline is of and the digest of the pair's buckets;
per receiving rank the call its destination holds, per peer digest. The call is named by a
hash of a nonce from every process (the same everywhere). After planning, every process
derives the same decision per pair (:meth:`DeltaState.begin`): delta only when the
sender's and the receiver's claims are the same call and both digests are the current
schedule's; otherwise (a new or restarted receiver, a receiver that failed or missed a
call, a re-plan, a mismatched baseline) the pair's buckets go dense in the same call.
The baselines are transactional (the ``delta`` extension,
:class:`xreshard.runtime.extensions.features.Delta`): a dense bucket's new bytes go to
new memory and a delta's message is kept, both applied to the baselines, and their call
moved, only when the outcome exchange confirmed the call on every process
(:meth:`DeltaState.commit`). A call that failed anywhere leaves every sender's baselines
and claims as they were (:meth:`DeltaState.abort`); a receiver whose destinations were
written in place may hold a mix, so its bases go and its pairs are dense next call.

A receiver's destination memory is fingerprinted when a call commits: where it lives
(buffer addresses) and what each destination tensor holds (a checksum of its bytes). New
memory (a JAX receiver gets new arrays every call) silently drops the claim at
``refit/check``. After planning, where some bucket may go as a delta
(:meth:`DeltaState.fence_needed`, from the claims alone), ``refit/fence`` checks the
tensors such buckets write, only those (:meth:`DeltaState.fence`): one written outside
xreshard is refused on every process before any byte moves (and its claim is dropped: the
next call is dense).
A sender samples each bucket before ``refit/check`` and says which it sends dense whatever
they hold (those that mostly changed, and those it holds no baseline of): they go without a
header, and the tensors only they write are overwritten whole, so they are not read. Those
that mostly changed also drop their baselines at commit (their samples are kept), and the
tensors only they wrote are not checksummed then: no delta can reach them next call.

**Encoding ahead.** A sender starts encoding the buckets of the pairs its baselines hold a
claim for as soon as the call's sources are bound (:meth:`DeltaState.encode_ahead`), with
the schedule of the last call, so the diff overlaps ``refit/check`` (the gather and the
fence). The encoder reads sources and baselines, and packs a bucket said dense into its
baseline (its message is sent from there; see :class:`~.delta_encode.Encoder`); the call
uses its work only when the schedule stayed and the pair goes as a delta (else the
baselines it packed are dropped), and it is stopped before the call returns, whatever
happened. Where this call's sources no longer fit that schedule (a tensor dropped: the call
re-plans), nothing is encoded ahead, and the call goes on as without it.

**With ``atomic=True``** (:mod:`.atomic`) a receiver's destinations are shadowed: the
shadows are refreshed from the live destinations at the start of the call, so a delta
applies onto the base its claim names, and the fingerprints are of the real destinations
(checked at ``refit/fence``, taken after the staging is committed). A call that fails
anywhere then leaves every staged destination and every baseline as the last confirmed
call left them, and the claims stay valid: the next call sends deltas again (a restarted
or new process still gets a dense refit of its pairs). Memory of the transactional
baselines: a sender holds, until the outcome, the new bytes of the buckets it sent dense
(at most as many bytes again as its baselines, the first call excepted: there is no old
baseline then) and the delta messages it sent.

**FP8 destinations quantized on the way** (:mod:`.quantized`): an FP8 item (whole blocks
the sender holds, quantized at pack time) is diffed as what goes on the wire, its float32
scales then its e4m3 codes, in bytes (:func:`.delta_encode.delta_spans`), against what was
last sent for that bucket: its receiver's destination holds exactly those codes and
scales, and the delta is applied to them in place. The sender requantizes every block of
the bucket each call (a changed element changes its block's codes and maybe its scale:
a changed block requantizes whole) and only changed code and scale bytes move. The bf16
pieces of blocks split across senders land in the receiver's scratch, which the receiver
quantizes itself: they are diffed like any item, against the bytes the receiver kept of
them when the last confirmed call landed (the scratch is no fenced base; see
:mod:`.delta_land`).

Buckets whose receiver casts (its dtype is not the wire dtype) always go dense: the
receiver could not read its base back bit for bit. Device bindings take the device path
(:mod:`.delta_device`: the diff with JAX or torch ops on the device, baselines on the host
or the device). Through a relay (host bindings), a forwarding rank is the sender of its
forwarded pairs: it keeps their baselines and claims them like any sender (why, and how
forwards are timed: :mod:`xreshard.planner.relay`).

**What composes, what is refused** (:func:`delta_problems`, at ``refit/check``, on every
process before any byte moves). Host bindings: delta composes with ``wire_dtype``,
``atomic=True``, FP8 destinations and ``relay``, in any combination. Through a relay with
``atomic=True`` a forwarder's baselines are transactional like any sender's (its forwards'
new bytes and messages are held until the outcome) and it forwards from its staging; with
FP8 destinations a forwarder diffs the finished codes and scales it forwards (plain
tensors of stage 2) against what it last forwarded. Device bindings: the same, by the
device path: ``wire_dtype``, ``atomic=True`` (the baselines' changes are held until the
outcome and applied by the device ops then), FP8 destinations (quantized and diffed on
the sender's device, applied to codes, scales and split blocks' pieces on the
receiver's: :mod:`.delta_device`) and ``relay`` (a forwarder diffs what it forwards on
its device, from the bytes that landed there, with the same ops as its sends).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..planner.prepare import SOURCES
from ..planner.schedule import Bucket
from .delta_fence import claimed, sums_of, where_of
from .execute import Executor
from .metadata import fit

__all__ = ["DeltaCall", "DeltaState", "delta_problems"]

logger = logging.getLogger(__name__)


def _written(b: Bucket, prepared: Any) -> list[tuple[int, str]]:
    """The destination bindings bucket ``b`` writes: its items' tensors on its receiving
    rank, and the scales of those quantized on the way."""
    quant = getattr(prepared, "quant", None)
    out = []
    for it in b.items:
        out.append((b.dst, it.name))
        if quant is not None and it.name in quant.tensors:
            out.append((b.dst, quant.tensors[it.name].scale))
    return out


def delta_problems(config: Any, on_device: bool, *, tuning: Any = None,
                   sides: tuple[bool, bool] = (True, True)) -> list[list[str]]:
    """What ``RefitConfig(delta=True)`` cannot run in this process, as error entries for
    ``refit/check`` (refused on every process before any byte moves): with device bindings
    (``on_device``), no framework to diff or apply on the device (:mod:`.delta_device`;
    ``sides``: whether this process sends, receives). Delta composes with everything else
    on both kinds of bindings (see the module docstring)."""
    if not getattr(config, "delta", False):
        return []
    if not (on_device or getattr(tuning, "host_device_ops", None) is not None):  # host: all
        return []
    from ..config import Tuning
    from .delta_device import device_delta_problems
    return device_delta_problems(tuning or Tuning(), *sides)


@dataclass
class _Baseline:
    """What one sending pair last put on the wire: per bucket tag, the bytes."""

    call: str | None = None
    """The confirmed call these bytes are of (None: not valid)."""
    digest: str | None = None
    buffers: dict[int, np.ndarray] = field(default_factory=dict)
    samples: dict[int, np.ndarray] = field(default_factory=dict)
    """Per bucket tag that holds no bytes (it went dense whole, its baseline dropped: see
    :meth:`DeltaState.encode_ahead`): the sample of what it last sent, to tell whether
    the next version mostly changed too."""


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
        #: (src, dst, tag) -> split blocks' pieces that bucket last brought (delta_land)
        self.pieces: dict[tuple[int, int, int], np.ndarray] = {}
        #: (where, checksum per binding) of the destinations as the last call left them
        self.memory: tuple[str, dict[str, str]] | None = None
        self._nonce = ""
        self._digests: tuple[Any, dict[tuple[int, int], str]] | None = None
        self._ahead: tuple[Any, Any] | None = None      # (prepared, Encoder)
        #: (src, dst, tag) of the buckets this process's senders send dense this call
        self._promised: frozenset[tuple[int, int, int]] = frozenset()
        #: the pairs every bucket of which this process's senders send dense this call
        self._whole: frozenset[tuple[int, int]] = frozenset()
        #: of ``_promised``, those whose baselines are dropped at commit (kept: a sample
        #: of the new bytes, here until then)
        self._dropped: dict[tuple[int, int, int], np.ndarray] = {}
        self._decided: tuple[Any, Any, tuple] | None = None
        self._open: DeltaCall | None = None     # begun, neither committed nor aborted

    @property
    def baseline_bytes(self) -> int:
        """Memory the senders' baselines take, host and device (the bytes this process
        sends per call)."""
        return sum(buf.nbytes for b in self.sent.values()
                   for buf in (*b.buffers.values(), *b.samples.values()))

    @property
    def baseline_device_bytes(self) -> int:
        """Of :attr:`baseline_bytes`, what device memory holds
        (``Tuning(delta_baseline="device")``)."""
        return sum(buf.nbytes for b in self.sent.values() for buf in b.buffers.values()
                   if not isinstance(buf, np.ndarray))

    def reset(self) -> None:
        """Forget every claim (the memory stays for reuse): the next call is dense."""
        for b in self.sent.values():
            b.call = None
        self.base.clear()
        self.pieces.clear()
        self.memory = None

    # ------------------------------------------------------------ refit/check

    def claims(self, dst: Any, receive_obj: Any) -> tuple[dict, list[list[str]]]:
        """This process's part of ``refit/check`` (and the errors found: none, the fence
        checks what destinations hold, :meth:`fence`): its baselines' and bases' calls, and
        the buckets its senders send dense whatever they hold (``dense``: those that
        mostly changed, sampled by :meth:`encode_ahead`)."""
        if self._open is not None:      # the last call neither committed nor failed cleanly
            self._open = None
            self.reset()
        if self.base and self.memory is not None and where_of(dst) != self.memory[0]:
            self.base.clear()           # other memory: it holds no base
        if not self.base:
            self.memory = None
        self._nonce = secrets.token_hex(8)
        return {"nonce": self._nonce,
                "send": [[s, r, b.call, b.digest] for (s, r), b in sorted(self.sent.items())
                         if b.call is not None],
                "recv": [[r, call, sorted(d.items())] for r, (call, d) in
                         sorted(self.base.items())],
                "dense": [list(k) for k in sorted(self._promised)],
                "drop": [list(k) for k in sorted(self._dropped)],
                "dense_pairs": [list(p) for p in sorted(self._whole)]}, []

    def fence(self, gathered: Sequence[Any], prepared: Any, dst: Any) -> list[list[str]]:
        """This process's part of ``refit/fence`` (after ``refit/check`` and planning, run
        where some bucket may go as a delta: :meth:`fence_needed`): the destination tensors a
        delta may apply to this call, checksummed against what the last confirmed call left
        there. Those only: a tensor every bucket of which goes dense (its pair does, or its
        sender said so at ``refit/check``) is overwritten whole, whatever it holds. Returns
        the errors (a tensor written outside xreshard: refused on every process before any
        byte moves; its claim is dropped, so the next call sends it dense)."""
        if not self.base or self.memory is None or dst is None:
            return []
        try:        # whatever fails here reaches refit/fence: the others wait for it there
            keys = {k for b in self._fenced(gathered, prepared) if b.dst in self.base
                    for k in _written(b, prepared) if k in dst.bindings}
            now, held = sums_of(dst, keys), self.memory[1]
        except Exception as e:      # noqa: BLE001 - said on every process, before moving
            self.base.clear()
            self.memory = None
            return [["RefitError", f"RefitConfig(delta=True): checking the destinations "
                     f"failed on this process ({type(e).__name__}: {e}); the next call is "
                     "dense"]]
        if all(held.get(k) == v for k, v in now.items()):
            return []
        self.base.clear()
        self.memory = None
        return [["RefitError", (
            "RefitConfig(delta=True): this process's destination tensors were written "
            "outside xreshard since the last refit (their checksum moved), so they no longer "
            "hold the version a delta applies to; refused before any byte moves. The next "
            "call sends them dense; do not write refit destinations between calls (or call "
            "refit.delta_state.reset())")]]

    # ------------------------------------------------------------ encoding ahead

    def encode_ahead(self, prepared: Any, src: Any, threads: int | None = None,
                     atomic: bool = True, tuning: Any = None) -> None:
        """Start encoding this process's buckets against its baselines now, with the last
        call's schedule ``prepared`` (None: none yet) and this call's bound sources ``src``,
        so the diff overlaps ``refit/check``: only pairs whose baseline holds a claim for
        that schedule, which may go as deltas. :meth:`begin` hands the work to the call
        when the schedule stayed; :meth:`stop_ahead` ends it (call it whatever happens).
        First each bucket it would diff is sampled, read in place (``delta_encode.sample``,
        against its baseline, or the sample kept of a bucket whose baseline was dropped):
        one that mostly changed goes dense, said at ``refit/check`` (no header; its
        receiver does not fence it), and its baseline is dropped at commit (its sample
        kept): a step that changed most weights costs a dense refit, not a copy of every
        byte besides. A bucket with no baseline goes dense, said too (its baseline is set
        as it is sent). The encoder packs a bucket it finds mostly changed into its
        baseline (``atomic``: new memory), and it is sent from there (see
        :class:`~.delta_encode.Encoder`). ``tuning`` (the Refit's) says whether these
        sources take the device path (``Tuning.host_device_ops``): then nothing is
        encoded ahead, as the call's device codec encodes them."""
        self.stop_ahead()
        self._promised, self._whole, self._dropped = frozenset(), frozenset(), {}
        if prepared is None or src is None or prepared.stages[0].src_from != SOURCES:
            return
        from .delta_device import device_path
        if device_path(src.bindings, tuning=tuning):    # device memory: encoded in the call
            return
        from .delta_encode import ENCODE_THREADS, Encoder
        try:
            reader, jobs, said, scanned, self._dropped, sampled = self._scan(prepared, src)
        except Exception:       # noqa: BLE001 - only an optimization: the call decides as before
            # the last schedule does not fit these sources (they changed: the call
            # re-plans, and a missing binding must not fail this process alone)
            logger.debug("not encoding ahead: the last schedule does not fit these sources",
                         exc_info=True)
            return
        self._promised = frozenset(said)
        # a pair that forwards too (a relay's stage 2) is never whole: its forwards may go
        # as deltas, fenced like any
        forwarding = {(b.src, b.dst) for rnd in prepared.schedule.rounds for b in rnd
                      if b.stage > 0}
        mixed = {k[:2] for k in scanned - said} | forwarding
        self._whole = frozenset({k[:2] for k in scanned} - mixed)
        if jobs:        # what remains to diff: the diff is the call's critical path
            self._ahead = (prepared, Encoder(reader, jobs, threads or ENCODE_THREADS,
                                             keep="new" if atomic else "in place",
                                             sampled=sampled))

    def _scan(self, prepared: Any, src: Any
              ) -> tuple[Executor, list, set, set, dict, set]:
        """:meth:`encode_ahead`'s look at this call's sources with the last call's schedule:
        ``(reader, jobs to encode, buckets said dense, buckets sampled or diffed, the samples
        of those whose baselines are dropped, the jobs sampled already)``; it may raise
        where the sources no longer fit that schedule."""
        from .delta_encode import delta_spans, in_place_sample, sample_of, sampled_changed
        st = prepared.stages[0]
        reader = Executor(prepared.schedule, st.src_layouts, st.dst_layouts, st.wire_dtypes,
                          fit(src, prepared.direct.src_layouts), {},
                          None, 0.0,  # type: ignore[arg-type]  # reads sources only: no wire
                          quant=prepared.formats.quant)
        local = {r for r, _ in reader.src_bindings}
        digests = self.pair_digests(prepared)
        jobs, said, scanned, dropped, sampled = [], set(), set(), {}, set()
        for rnd in prepared.schedule.rounds:
            for b in rnd:
                pair = self.sent.get((b.src, b.dst))
                if b.src not in local or pair is None or pair.call is None \
                        or pair.digest != digests.get((b.src, b.dst)):
                    continue
                spans = delta_spans(reader, b)
                if spans is None:
                    continue
                key = (b.src, b.dst, b.tag)
                scanned.add(key)
                base = pair.buffers.get(b.tag)
                if base is not None and base.nbytes != spans.nbytes:
                    base = None
                got = in_place_sample(reader, b)
                if got is not None:
                    bits, new, sizes = got
                    old = pair.samples.get(b.tag) if base is None else \
                        sample_of(base, bits, sizes)
                    if old is not None and sampled_changed(old, new):
                        # mostly changed: dense, and its baseline dropped (no copy of a
                        # version that mostly changes again); its sample kept instead
                        said.add(key)
                        dropped[key] = new
                        continue
                if base is None:        # nothing to diff: dense (its baseline kept)
                    said.add(key)
                    continue
                if got is not None:     # sampled against this baseline: not mostly changed
                    sampled.add(b)
                jobs.append((b, base))
        return reader, jobs, said, scanned, dropped, sampled

    @property
    def ahead_buckets(self) -> frozenset[Any]:
        """The buckets the encoder started ahead encodes (it quantizes their FP8 items:
        ``quantize_ahead`` leaves them alone)."""
        return frozenset() if self._ahead is None else self._ahead[1].buckets

    def stop_ahead(self) -> None:
        """Stop an encoder started ahead that no call took: no thread reads the sources or
        the baselines once this returns."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].stop()
            ahead[1].forget(self.sent)      # its packed baselines: no call took them

    # ------------------------------------------------------------ the call

    def begin(self, gathered: Sequence[Any], prepared: Any, atomic: bool = True,
              staged: bool = False) -> DeltaCall:
        """The call's decision, the same in every process, from every process's claims
        (``refit/check``) and this process's schedule. ``atomic``: the baselines change
        only at :meth:`commit` (what every call of a ``Refit`` does; False only for unit
        tests of the executor); ``staged``: this process's destinations receive into
        staging (its bases survive a failed call)."""
        call_id, pairs, dense = self._decide(gathered, prepared)
        dropped = {(int(s), int(r), int(t)) for g in gathered if isinstance(g, dict)
                   for s, r, t in g.get("drop") or ()}
        drop = frozenset(k for k in dense if k in dropped)
        keys: dict[tuple[int, str], bool] = {}  # destination key -> written by kept ones
        for rnd in prepared.schedule.rounds:
            for b in rnd:
                kept = not (b.stage == 0 and (b.src, b.dst, b.tag) in drop)
                for k in _written(b, prepared):
                    keys[k] = keys.get(k, False) or kept
        call = DeltaCall(self, call_id, pairs, self.pair_digests(prepared), atomic=atomic,
                         staged=staged, dense=dense, drop=drop,
                         unsummed=frozenset(k for k, kept in keys.items() if not kept))
        self._open = call
        if self._ahead is not None and self._ahead[0] is prepared:
            call.encoder, self._ahead = self._ahead[1], None    # the executor takes it
        self.stop_ahead()
        return call

    @staticmethod
    def fence_needed(gathered: Sequence[Any]) -> bool:
        """Whether the call runs ``refit/fence``, from ``refit/check``'s claims alone (the
        same in every process, whose schedules hold their own buckets only): some pair's
        sender and receiver claim the same call, and its sender did not say it sends every
        bucket of it dense."""
        send, recv, whole = claimed(gathered)
        return any(c == recv.get(p) and p not in whole for p, c in send.items())

    def _fenced(self, gathered: Sequence[Any], prepared: Any) -> list[Bucket]:
        """The buckets that may go as deltas this call (of any process): their pair does
        and their sender did not say it sends them dense."""
        _, pairs, dense = self._decide(gathered, prepared)
        return [b for rnd in prepared.schedule.rounds for b in rnd
                if (b.src, b.dst) in pairs
                and not (b.stage == 0 and (b.src, b.dst, b.tag) in dense)]

    def _decide(self, gathered: Sequence[Any], prepared: Any
                ) -> tuple[str, frozenset[tuple[int, int]], frozenset[tuple[int, int, int]]]:
        """The call's id, its pairs that go as deltas and the buckets of those sent dense
        whatever they hold: the same in every process (from every process's claims and the
        schedule)."""
        if self._decided is not None and self._decided[0] is gathered \
                and self._decided[1] is prepared:
            return self._decided[2]
        bodies = [g for g in gathered if isinstance(g, dict)]
        call_id = hashlib.sha256(
            "/".join(str(g.get("nonce")) for g in bodies).encode()).hexdigest()[:24]
        send, recv, whole = claimed(gathered)
        said = {(int(s), int(r), int(t)) for g in bodies for s, r, t in g.get("dense") or ()}
        digests = self.pair_digests(prepared)
        pairs = frozenset(p for p, d in digests.items()
                          if send.get(p) is not None and send.get(p) == recv.get(p)
                          and send[p][1] == d)
        # a pair said whole: all its buckets (those without a baseline too)
        dense = frozenset((b.src, b.dst, b.tag) for rnd in prepared.schedule.rounds
                          for b in rnd if b.stage == 0 and (b.src, b.dst) in pairs
                          and ((b.src, b.dst, b.tag) in said or (b.src, b.dst) in whole))
        self._decided = (gathered, prepared, (call_id, pairs, dense))
        return call_id, pairs, dense

    def pair_digests(self, prepared: Any) -> dict[tuple[int, int], str]:
        """A digest of every local pair's buckets (what both ends of a pair compute alike)."""
        if self._digests is not None and self._digests[0] is prepared:
            return self._digests[1]
        hashes: dict[tuple[int, int], Any] = {}
        for rnd in prepared.schedule.rounds:
            for b in rnd:
                stage = prepared.stages[b.stage]        # a relay's forwards: stage 1
                h = hashes.setdefault((b.src, b.dst), hashlib.sha256())
                h.update(repr((b.round, b.tag, b.stage, b.nbytes, [
                    (it.name, it.region.starts, it.region.stops, it.nbytes, it.quantized,
                     str(stage.wire_dtypes[it.name]), stage.dst_layouts[it.name].dtype)
                    for it in b.items])).encode())
        digests = {p: h.hexdigest()[:24] for p, h in hashes.items()}
        self._digests = (prepared, digests)
        return digests

    def commit(self, call: DeltaCall, dst: Any, receive_obj: Any) -> None:
        """Every process confirmed ``call`` (and its staging, with ``atomic``, is
        committed): its baselines and bases are of it now."""
        self._open = None
        call.settle()
        for s, r, tag in call.drop:
            held = self.sent.get((s, r))
            if held is not None and (s, r, tag) in self._dropped:
                held.buffers.pop(tag, None)
                held.samples[tag] = self._dropped[(s, r, tag)]
        for pair in call.sent_pairs:
            b = self.sent.setdefault(pair, _Baseline())
            b.call, b.digest = call.call_id, call.digests[pair]
            for tag in [t for t in b.samples if t in b.buffers]:    # bytes again
                del b.samples[tag]
        for r in call.local_dst:
            self.base[r] = (call.call_id, {s: d for (s, rr), d in call.digests.items()
                                           if rr == r})
        self.pieces = {k: v for k, v in self.pieces.items()
                       if k[1] not in call.local_dst} | call.pieces
        # the tensors only dropped buckets wrote cannot get a delta next call (their
        # senders hold no baseline of them): not checksummed
        self.memory = (where_of(dst), sums_of(dst, [k for k in dst.bindings
                                                    if k not in call.unsummed])) \
            if self.base and dst is not None else None

    def abort(self) -> None:
        """The call failed somewhere (or was never confirmed). The senders' baselines
        changed nothing (their changes were held by the call: :meth:`DeltaCall.settle`),
        so their claims stay, with or without ``atomic``. A receiver whose destinations
        were written in place (not staged) may hold a mix of two versions: its bases go
        (its pairs are dense next call). A call that never began here wrote nothing here."""
        call, self._open = self._open, None
        if call is None:
            return
        call.pending.clear()
        if not call.staged:
            self.base.clear()
            self.pieces.clear()
            self.memory = None


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
    """Wall time of the diff: from the encoder's start (maybe ahead of the call's move) to
    its last bucket's end, on ``encode_threads`` worker threads."""
    encode_threads: int = 0
    encoder: Any = None
    """The ``delta_encode.Encoder`` at work on this call (started ahead, or by the executor)."""

    atomic: bool = True
    """Baselines change at :meth:`settle` (the outcome confirmed the call), not as buckets
    leave, so a failed call leaves them as they were (every call of a ``Refit``, with or
    without ``RefitConfig.atomic``; False only for unit tests of the executor)."""
    staged: bool = False
    pending: list[tuple[tuple[int, int], int, str, Any]] = field(default_factory=list)
    """``atomic``: the baselines' changes until the outcome, ``(pair, tag, how, what)``."""
    pieces: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    """The split blocks' pieces this call's buckets brought (:meth:`keep_pieces`)."""
    dense: frozenset[tuple[int, int, int]] = frozenset()
    """``(src, dst, tag)`` of the buckets of :attr:`pairs` sent dense whatever they hold
    (said by their sender at ``refit/check``): no header goes before their payloads."""
    drop: frozenset[tuple[int, int, int]] = frozenset()
    """Of :attr:`dense`, those whose baselines are dropped (not copied as they are sent)."""
    unsummed: frozenset[tuple[int, str]] = frozenset()
    """Destination keys only :attr:`drop` buckets write (not checksummed at commit)."""

    def dropped(self, b: Bucket) -> bool:
        """Whether bucket ``b``'s baseline is dropped (see :attr:`drop`)."""
        return b.stage == 0 and (b.src, b.dst, b.tag) in self.drop

    def promised(self, b: Bucket) -> bool:
        """Whether bucket ``b`` goes dense whatever it holds, without a header (see
        :attr:`dense`)."""
        return b.stage == 0 and (b.src, b.dst, b.tag) in self.dense

    def pieces_base(self, b: Bucket, nbytes: int) -> np.ndarray:
        """A copy of the split blocks' pieces bucket ``b`` brought in the last confirmed
        call (``nbytes`` of them): what its delta applies to (see :mod:`.delta_land`).
        Its pair's fence vouches for them; missing, it raises (never a wrong base)."""
        held = self.state.pieces.get((b.src, b.dst, b.tag))
        if held is None or held.nbytes != nbytes:
            from ..errors import RefitError
            raise RefitError(
                f"RefitConfig(delta=True): rank {b.dst} received a delta of bucket {b.tag} "
                f"from rank {b.src} but holds no base of its split FP8 blocks' pieces "
                f"({nbytes} bytes); nothing of it was applied. The next call is dense; "
                "report this (a fence that should have sent it dense)")
        return held.copy()

    def keep_pieces(self, b: Bucket, data: np.ndarray) -> None:
        """Bucket ``b``'s split blocks' pieces as this call left them: the base of the
        next call's delta once the outcome confirmed this one (:meth:`DeltaState.commit`)."""
        self.pieces[(b.src, b.dst, b.tag)] = data

    def baseline(self, b: Bucket, nbytes: int, create: bool = False,
                 alloc: Callable[[int], Any] | None = None) -> Any:
        """Bucket ``b``'s baseline (``nbytes``: the bucket's diffed bytes), or None when
        there is none of that size; ``create``: a new one then (its contents are set as the
        bucket is sent), from ``alloc(nbytes)`` (None: host memory; a baseline held in
        another kind of memory than ``alloc`` gives is replaced)."""
        pair = self.state.sent.get((b.src, b.dst))
        if pair is None:
            if not create:
                return None
            pair = self.state.sent[(b.src, b.dst)] = _Baseline()
        base = pair.buffers.get(b.tag)
        alloc = alloc or _host_bytes
        if create and (base is None or base.nbytes != nbytes
                       or type(base) is not type(alloc(0))):
            base = pair.buffers[b.tag] = alloc(nbytes)
        return base if base is not None and base.nbytes == nbytes else None

    def target(self, b: Bucket, nbytes: int, alloc: Callable[[int], Any] | None = None) -> Any:
        """Where a dense bucket's diffed bytes go as they are sent: its baseline, or with
        ``atomic`` new memory (from ``alloc``, as :meth:`baseline`) that replaces it at
        :meth:`settle`."""
        if not self.atomic:
            return self.baseline(b, nbytes, create=True, alloc=alloc)
        out = (alloc or _host_bytes)(nbytes)
        self.pending.append(((b.src, b.dst), b.tag, "replace", out))
        return out

    def applied(self, b: Bucket, enc: Any, advance: Callable[[Any, Any], None]) -> None:
        """Bucket ``b`` went as delta ``enc`` (a ``delta_encode.Encoded``):
        ``advance(enc, baseline)`` applies it to the baseline now (with ``atomic``, at
        :meth:`settle`)."""
        if self.atomic:
            self.pending.append(((b.src, b.dst), b.tag, "apply", (enc, advance)))
            return
        advance(enc, self.state.sent[(b.src, b.dst)].buffers[b.tag])

    def settle(self) -> None:
        """Apply the pending baseline changes (``atomic``: the call was confirmed)."""
        pending, self.pending = self.pending, []
        for pair, tag, how, what in pending:
            held = self.state.sent.setdefault(pair, _Baseline())
            if how == "replace":
                held.buffers[tag] = what
            else:
                enc, advance = what
                advance(enc, held.buffers[tag])

    def summary(self) -> dict[str, Any]:
        return {"pairs": len([p for p in self.pairs if p in self.sent_pairs]),
                "bytes_dense": self.bytes_dense, "bytes_wire": self.bytes_wire,
                "num_delta": self.num_delta, "encode_seconds": self.encode_seconds,
                "encode_threads": self.encode_threads,
                "baseline_bytes": self.state.baseline_bytes,
                "baseline_device_bytes": self.state.baseline_device_bytes}


def _host_bytes(n: int) -> np.ndarray:
    return np.empty(n, np.uint8)
