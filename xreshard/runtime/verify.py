"""End-to-end checksums of a refit: what each sender meant a receiver to hold, and what it holds.

``RefitConfig(verify=True | "sample")``: after the executor ran, every process hashes, for
each transfer it takes part in (tensor, region, src rank, dst rank), the region's bytes on
its side; the digests cross in the refit's outcome exchange and every process compares
them, so every rank raises the same ``VerificationError`` naming the tensor, the region,
the sender and the receiver.

What is hashed, so both sides hash the same bytes (exact, no tolerance):

- the **sender** hashes what the receiver must end up holding: its source region cast to
  the wire dtype and then to the destination dtype, exactly as the executor casts (the
  same :func:`xreshard.runtime.execute.copy_into`), in the destination dtype's bytes; with equal
  dtypes on both sides these are the source bits, hashed in place when the view is one
  contiguous run;
- the **receiver** hashes its destination region's bytes as they are after the move.

Both walk the region in canonical row-major order, whatever the binding's strides (a
transposed Flax kernel, one row range of a fused qkv). Local copies (colocated ranks) are
checked the same way. A checksum proves nothing about bytes equal by chance: an unwritten
destination that already held the sender's values passes.

The digest is :mod:`xreshard.runtime.digest`'s keyed universal hash (NH per 64 KiB block,
then a polynomial mod 2**127 - 1), under a key every process derives from the world's
random instance nonce and the call's version (:func:`call_key`): for any two different
byte strings of at most ``n`` 64 KiB blocks, the chance that a transfer arriving wrong
passes is at most ``2**-32 + n / (2**127 - 1)``, whatever the change (a flipped sign, two
swapped words, a zeroed tile), with a fresh key each call. It is not a MAC: a peer that
wants to fool it can read the key.

Coverage: ``verify=True`` hashes every transfer. ``verify="sample"`` hashes every transfer
of at most ``SAMPLE_SMALL_BYTES`` and those whose key falls in this call's slot
(``crc32(key) % SAMPLE_PERIOD == version % SAMPLE_PERIOD``): about 1/16 of the bytes per
call, and over any ``SAMPLE_PERIOD`` consecutive refits of one plan every transfer once.

Usage (what ``Refit.__call__`` does; ``target`` is the version this call would commit)::

    from xreshard.runtime import verify

    stats = executor.run()
    mine = verify.digests(plan, executor, world.rank_ids, sample=config.verify == "sample",
                          version=target, key=verify.call_key(world, target))   # JSON
    outcomes = world.allgather_json({"errors": [], "digests": mine})      # the outcome
    messages, compared = verify.compare([o["digests"] for o in outcomes], world)
    if messages:
        raise VerificationError("; ".join(messages))    # the same list on every rank

The digests are small: one digest per (src rank, dst rank) pair, plus every transfer's
digest inline while this process has at most ``INLINE_TRANSFERS`` transfers (then the
messages name tensors and regions; above it, rank pairs and processes). Below that, the
pieces: :func:`digest_bindings` (a :class:`Digests` of any bindings, ``sides=`` to hash
the sources while the move runs), :func:`mismatches` (``details=`` takes a second exchange
of ``Digests.details(bad)`` to locate transfers in big plans), :func:`checksum`.
"""

from __future__ import annotations

import hashlib
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..dtypes import as_dtype, bits, numpy_dtype
from ..errors import RefitError
from . import digest, quantized
from .copies import copy_into, view_of
from ..ir.layout import Layout, Region

__all__ = ["Digests", "Mismatch", "call_key", "checksum", "compare",
           "digest_bindings", "digests", "key_of", "stage_digests",
           "message", "mismatches",
           "INLINE_TRANSFERS", "SAMPLE_PERIOD", "SAMPLE_SMALL_BYTES"]

#: a strided or cast region is copied into scratch at most this many bytes at a time
_SCRATCH_BYTES = 16 << 20
#: verify="sample": a transfer is hashed in one call out of this many ...
SAMPLE_PERIOD = 16
#: ... unless it is this small, then always
SAMPLE_SMALL_BYTES = 1 << 16
#: per-transfer digests travel in the summary while a process has at most this many
INLINE_TRANSFERS = 20000

def _bytes_of(arr: Any) -> Any:
    """A C-contiguous array's bytes as a flat uint8 array (zero-copy)."""
    return arr.reshape(-1).view(np.uint8)


def checksum(arr: Any, key: digest.Key | None = None) -> str:
    """The digest (32 hex digits, :mod:`xreshard.runtime.digest`) of ``arr``'s elements'
    bytes in row-major order, under ``key`` (default: this process's random key, for
    digests compared inside this process only).

    ``arr`` is a numpy array (any strides) or a CuPy array; the result depends only on the
    bytes, their order and the key, never on the strides or the device.
    """
    if not type(arr).__module__.startswith("cupy"):
        arr = np.asarray(arr)
        return digest.stream_hex(_host_pieces(arr, None, None, None), key)[0]
    return digest.device_digests([arr], key)[0]


def call_key(world: Any, version: int) -> digest.Key:
    """The key of one call's ``verify`` digests: every process of ``world`` derives the
    same one from the world's random instance nonce and the version the call would commit,
    and no earlier call used it."""
    return digest.Key.of("verify", getattr(world, "world_id", None) or "",
                         getattr(world, "nonce", None) or "", int(version))


def _host_pieces(view: np.ndarray, have: str | None, wire: str | None, want: str | None
                 ) -> Iterable[np.ndarray]:
    """The bytes of ``view`` (values of dtype ``have``) as the receiver holds them (dtype
    ``want``, through ``wire``), in row-major order, as uint8 pieces.

    Contiguous views with nothing to cast are yielded in place; anything else is copied
    (and cast) into scratch slab by slab along the outermost dim.
    """
    cast = have is not None and not (have == wire == want)
    if not cast and view.flags.c_contiguous:
        yield _bytes_of(view)
        return
    out_dtype = numpy_dtype(want) if cast else view.dtype
    if view.ndim == 0 or view.size == 0:
        yield _bytes_of(_cast_into(np.empty(view.shape, out_dtype), view, have, wire, want, cast))
        return
    row_bytes = math.prod(view.shape[1:]) * out_dtype.itemsize
    step = max(1, _SCRATCH_BYTES // max(row_bytes, 1))
    if step >= view.shape[0]:
        yield _bytes_of(_cast_into(np.empty(view.shape, out_dtype), view, have, wire, want, cast))
        return
    scratch = np.empty((step,) + view.shape[1:], out_dtype)
    for i in range(0, view.shape[0], step):
        part = view[i:i + step]
        out = scratch[:part.shape[0]]
        yield _bytes_of(_cast_into(out, part, have, wire, want, cast))


def _cast_into(out: np.ndarray, src: np.ndarray, have: str | None, wire: str | None,
               want: str | None, cast: bool) -> np.ndarray:
    """``out[...] = src`` as the executor would deliver it: bits, or cast through the wire."""
    if not cast:     # bits in row-major order (copy_into tiles transposed views)
        copy_into(np, bits(out), "same", bits(src), "same")
        return out
    assert have is not None and wire is not None and want is not None
    if have != wire and want != wire:
        # the sender's cast to the wire, then the receiver's (execute.Executor._local_copy)
        src, have = as_dtype(src, have).astype(numpy_dtype(wire)), wire
    copy_into(np, out, want, src, have)
    return out


# ---------------------------------------------------------------------------- GPU


def _device_receiver_view(view: Any, have: str, wire: str, want: str, cast: bool) -> Any:
    """A CuPy source region as the receiver must hold it (cast like the executor)."""
    import cupy
    from .devices import cupy_knows

    if not cast:
        return view
    for d in (have, wire, want):
        if not cupy_knows(d):
            raise RefitError(f"verify: cannot cast {have} -> {wire} -> {want} on the GPU to "
                             f"hash what the receiver holds; run with verify=False for this "
                             f"tensor's dtypes")
    src = as_dtype(view, have)
    if have != wire and want != wire:
        src, have = src.astype(numpy_dtype(wire)), wire
    out = cupy.empty(view.shape, numpy_dtype(want))
    copy_into(cupy, out, want, src, have)
    return out


# ---------------------------------------------------------------------------- digests


def key_of(name: str, region: Region, src: int, dst: int) -> str:
    """The key both sides file a transfer's digest under."""
    return f"{name}|{region}|{src}->{dst}"


def _parse_key(key: str) -> tuple[str, str, int, int]:
    name, region, pair = key.rsplit("|", 2)
    src, dst = pair.split("->")
    return name, region, int(src), int(dst)


def _sampled(key: str, nbytes: int, version: int) -> bool:
    if nbytes <= SAMPLE_SMALL_BYTES:
        return True
    return zlib.crc32(key.encode()) % SAMPLE_PERIOD == version % SAMPLE_PERIOD


def _wanted(mode: bool | str, key: str, nbytes: int, version: int) -> bool:
    return mode != "sample" or _sampled(key, nbytes, version)


def _pair_digest(entries: Iterable[tuple[str, str]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for key, d in sorted(entries):
        h.update(f"{key}={d}\n".encode())
    return h.hexdigest()


@dataclass
class Digests:
    """This process's digests of one refit (see :func:`digest_bindings`).

    Attributes:
        send: ``key -> digest`` of every transfer a local rank sent (hashed).
        recv: ``key -> digest`` of every transfer a local rank received (hashed).
        nbytes: bytes hashed.
        seconds: time spent hashing.
        mode: "full" or "sample" (or "off").
        version: the version the digests were taken for.
    """

    send: dict[str, str]
    recv: dict[str, str]
    nbytes: int = 0
    seconds: float = 0.0
    mode: str = "full"
    version: int = 0

    @property
    def summary(self) -> dict[str, Any]:
        """JSON for the outcome exchange: one digest and count per rank pair and side,
        plus every transfer's digest while there are at most ``INLINE_TRANSFERS``."""
        out: dict[str, Any] = {"mode": self.mode, "version": self.version,
                               "bytes": self.nbytes, "seconds": round(self.seconds, 6)}
        for side, table in (("send", self.send), ("recv", self.recv)):
            pairs: dict[str, list[tuple[str, str]]] = {}
            for key, d in table.items():
                _, _, src, dst = _parse_key(key)
                pairs.setdefault(f"{src}->{dst}", []).append((key, d))
            out[side] = {p: [_pair_digest(es), len(es)] for p, es in sorted(pairs.items())}
        if len(self.send) + len(self.recv) <= INLINE_TRANSFERS:
            out["detail"] = self.details(None)
        return out

    def merge(self, other: Digests) -> Digests:
        """This process's two halves (``sides="send"`` and ``"recv"``) as one."""
        return Digests({**self.send, **other.send}, {**self.recv, **other.recv},
                       self.nbytes + other.nbytes, self.seconds + other.seconds, self.mode,
                       self.version)

    def details(self, pairs: Iterable[Mismatch] | Iterable[str] | None) -> dict[str, Any]:
        """Per-transfer digests (JSON) of the rank pairs in ``pairs`` (``Mismatch`` objects
        or ``"src->dst"`` strings; None: all)."""
        want = None
        if pairs is not None:
            want = {p.pair if isinstance(p, Mismatch) else str(p) for p in pairs}
        def keep(key: str) -> bool:
            return want is None or key.rsplit("|", 1)[1] in want
        return {"send": {k: v for k, v in self.send.items() if keep(k)},
                "recv": {k: v for k, v in self.recv.items() if keep(k)}}


def digest_bindings(plan: Any, local_ranks: Iterable[int],
                    src_bindings: Mapping[tuple[int, str], Any],
                    dst_bindings: Mapping[tuple[int, str], Any], *, mode: bool | str = True,
                    version: int = 0, sides: str = "both", quant: Any = None,
                    key: digest.Key | None = None) -> Digests:
    """Digest every transfer (and local copy) of ``plan`` that ``local_ranks`` take part in.

    Call after the executor ran, with the bindings of the stage of ``plan`` it used
    (``metadata.stage_bindings``: ``(rank, name) -> array``, or a list for explicit layouts).

    Args:
        plan: the refit's :class:`xreshard.planner.plan.Plan` (the same in every process).
        local_ranks: this process's world ranks.
        src_bindings / dst_bindings: this process's bindings of each side.
        mode: ``True`` (every transfer), ``"sample"`` (see the module docstring) or
            ``False`` (nothing: empty digests, which compare equal).
        version: the version this refit would commit; picks the sample, and must be the
            same in every process.
        sides: "send", "recv" or "both". Sources do not change during a refit, so the
            "send" half may run in a thread while the executor moves bytes (numpy releases
            the GIL in the reductions) and be merged with the "recv" half afterwards
            (:meth:`Digests.merge`).
        quant: ``PreparedCall.formats.quant`` of the stage that quantizes on the way (see
            :func:`xreshard.runtime.quantized.digest_transfer`).
        key: the digest key (:func:`call_key`): the same in every process that compares.

    Returns:
        This process's :class:`Digests`.

    Raises:
        RefitError: an unknown ``mode``.
    """
    if mode not in (True, False, "sample"):
        raise RefitError(f"verify must be False, True or 'sample', got {mode!r}")
    if sides not in ("send", "recv", "both"):
        raise RefitError(f"sides must be 'send', 'recv' or 'both', got {sides!r}")
    src_bindings, dst_bindings = ({} if sides == "recv" else src_bindings,
                                  {} if sides == "send" else dst_bindings)
    t0 = time.perf_counter()
    out = Digests({}, {}, mode={False: "off", "sample": "sample"}.get(mode, "full"),
                  version=version)
    if mode is False:
        return out
    local = list(local_ranks)
    hash_key = key or digest.process_key()
    stream_hex = lambda pieces: digest.stream_hex(pieces, hash_key)
    src_cache: dict[tuple[str, Region, int], str] = {}
    # CuPy bindings: hashed together at the end (one host sync), by index into `arrays`
    arrays: list[Any] = []
    jobs: list[tuple[dict[str, str], str, int]] = []
    src_index: dict[tuple[str, Region, int], int] = {}
    for rank in local:
        for t in (*plan.transfers_for(rank), *plan.local_copies_for(rank)):
            tkey = key_of(t.name, t.region, t.src, t.dst)
            if mode == "sample" and not _sampled(tkey, t.nbytes, version):
                continue
            if quant is not None and t.name in quant.tensors:
                out.nbytes += quantized.digest_transfer(
                    out, quant, t, tkey, rank, src_bindings, dst_bindings,
                    plan.src_layouts[t.name], stream_hex)
                continue
            src_layout: Layout = plan.src_layouts[t.name]
            dst_layout: Layout = plan.dst_layouts[t.name]
            want = dst_layout.dtype
            if t.src == rank and (t.src, t.name) in src_bindings and tkey not in out.send:
                ck = (t.name, t.region, t.src)       # one region sent to several receivers
                if ck in src_cache:
                    out.send[tkey] = src_cache[ck]
                elif ck in src_index:
                    jobs.append((out.send, tkey, src_index[ck]))
                else:
                    view = view_of(src_bindings[(t.src, t.name)], src_layout, t.src, t.region)
                    have, wire = src_layout.dtype, plan.wire_dtypes[t.name]
                    out.nbytes += t.region.size * numpy_dtype(want).itemsize
                    if isinstance(view, np.ndarray):
                        out.send[tkey] = src_cache[ck] = stream_hex(
                            _host_pieces(view, have, wire, want))[0]
                    else:
                        src_index[ck] = len(arrays)
                        jobs.append((out.send, tkey, len(arrays)))
                        arrays.append(_device_receiver_view(view, have, wire, want,
                                                            not (have == wire == want)))
            if t.dst == rank and (t.dst, t.name) in dst_bindings and tkey not in out.recv:
                view = view_of(dst_bindings[(t.dst, t.name)], dst_layout, t.dst, t.region)
                out.nbytes += t.region.size * numpy_dtype(want).itemsize
                if isinstance(view, np.ndarray):
                    out.recv[tkey] = stream_hex(_host_pieces(view, None, None, None))[0]
                else:
                    jobs.append((out.recv, tkey, len(arrays)))
                    arrays.append(view)
    if quant is not None and dst_bindings:      # the split blocks receivers quantized
        out.nbytes += quantized.digest_finished(out, quant, local, dst_bindings, stream_hex,
                                                lambda k, n: _wanted(mode, k, n, version),
                                                key_of)
    if arrays:
        hexes = digest.device_digests(arrays, hash_key)
        for table, tkey, i in jobs:
            table[tkey] = hexes[i]
    out.seconds = time.perf_counter() - t0
    return out


@dataclass(frozen=True)
class Mismatch:
    """A transfer (or, when ``located`` is False, a rank pair) whose digests differ.

    Attributes:
        pair: ``"src->dst"`` world ranks.
        src / dst: the sender and receiver ranks.
        src_process / dst_process: positions of the processes that reported each side
            (None when that side reported nothing).
        name / region: the tensor and region (None for a pair-level mismatch).
        sent / received: the digests (None where missing).
        located: True when ``name``/``region`` name the transfer.
        count: transfers in the pair (pair-level mismatches).
    """

    pair: str
    src: int
    dst: int
    src_process: int | None
    dst_process: int | None
    name: str | None = None
    region: str | None = None
    sent: str | None = None
    received: str | None = None
    located: bool = True
    count: int = 0

    def describe(self, describe_process: Callable[[int], str] | None = None) -> str:
        def proc(p: int | None) -> str:
            if p is None:
                return "no process reported it"
            return describe_process(p) if describe_process else f"process {p}"

        who = (f"sender rank {self.src} ({proc(self.src_process)}) -> receiver rank "
               f"{self.dst} ({proc(self.dst_process)})")
        if not self.located:
            return (f"ranks {self.src}->{self.dst}: the digests of their {self.count} "
                    f"transfer(s) differ; {who}")
        if self.sent is None:
            what = f"the receiver hashed {self.received} but no sender digest arrived"
        elif self.received is None:
            what = f"the sender hashed {self.sent} but no receiver digest arrived"
        else:
            what = f"sent {self.sent}, received {self.received}"
        return f"tensor {self.name!r} region {self.region}: {what}; {who}"

    def __str__(self) -> str:
        return self.describe()


def mismatches(summaries: Sequence[Mapping[str, Any] | None],
               details: Sequence[Mapping[str, Any] | None] | None = None) -> list[Mismatch]:
    """The transfers whose sender and receiver digests differ, from every process's
    ``Digests.summary`` (in process order, as ``allgather_json`` returns them).

    Args:
        summaries: one summary per process (None for a process that hashed nothing).
        details: optionally, one ``Digests.details(...)`` per process (a second exchange
            for plans too big to inline); used for pairs whose summaries carry no detail.

    Returns:
        Mismatches sorted by (src, dst, name, region); empty when every digest agrees.
        Pairs without per-transfer digests on both sides come back with ``located=False``.
    """
    send: dict[str, tuple[int, str, int]] = {}
    recv: dict[str, tuple[int, str, int]] = {}
    for p, s in enumerate(summaries):
        if not s:
            continue
        for side, table in (("send", send), ("recv", recv)):
            for pair, (pair_hex, count) in (s.get(side) or {}).items():
                table[pair] = (p, pair_hex, count)
    bad_pairs = sorted((pair for pair in set(send) | set(recv)
                        if send.get(pair, (None, None))[1] != recv.get(pair, (None, None))[1]),
                       key=lambda x: tuple(map(int, x.split("->"))))
    if not bad_pairs:
        return []
    # per-transfer digests, from the inline details and the second exchange
    sent: dict[str, tuple[int, str]] = {}
    got: dict[str, tuple[int, str]] = {}
    have_detail: set[tuple[str, int]] = set()      # (side, process)
    sources = [(p, s.get("detail")) for p, s in enumerate(summaries) if s]
    if details is not None:
        sources += [(p, d) for p, d in enumerate(details) if d]
    for p, d in sources:
        if not d:
            continue
        have_detail.add(("send", p))
        have_detail.add(("recv", p))
        for key, v in d.get("send", {}).items():
            sent[key] = (p, v)
        for key, v in d.get("recv", {}).items():
            got[key] = (p, v)
    out = []
    for pair in bad_pairs:
        src, dst = map(int, pair.split("->"))
        sp = send.get(pair, (None, None, 0))
        rp = recv.get(pair, (None, None, 0))
        located = ((sp[0] is None or ("send", sp[0]) in have_detail)
                   and (rp[0] is None or ("recv", rp[0]) in have_detail))
        if not located:
            out.append(Mismatch(pair, src, dst, sp[0], rp[0], located=False,
                                count=max(sp[2], rp[2])))
            continue
        keys = {k for k in sent if k.endswith(f"|{pair}")} | {
            k for k in got if k.endswith(f"|{pair}")}
        found = []
        for key in keys:
            a, b = sent.get(key), got.get(key)
            if a is not None and b is not None and a[1] == b[1]:
                continue
            name, region, _, _ = _parse_key(key)
            found.append(Mismatch(pair, src, dst, sp[0], rp[0], name, region,
                                  a[1] if a else None, b[1] if b else None))
        if not found:   # the pair digests differ but no transfer does: a count or key differs
            found.append(Mismatch(pair, src, dst, sp[0], rp[0], located=False,
                                  count=max(sp[2], rp[2])))
        out.extend(sorted(found, key=lambda m: (m.name or "", m.region or "")))
    return out


def message(mismatches: Sequence[Mismatch], describe_process: Callable[[int], str] | None = None,
            limit: int = 20) -> str:
    """One ``VerificationError`` message for ``mismatches`` (the first ``limit`` listed)."""
    lines = [m.describe(describe_process) for m in mismatches[:limit]]
    more = f"\n  ... and {len(mismatches) - limit} more" if len(mismatches) > limit else ""
    return (f"verify: {len(mismatches)} transfer(s) arrived with other bytes than were sent "
            "(checksums differ); the destination is stale:\n  " + "\n  ".join(lines) + more)


# ---------------------------------------------------------------------------- what Refit calls


def digests(plan: Any, executor: Any, local_ranks: Iterable[int], *, sample: bool = False,
            version: int = 0, key: digest.Key | None = None) -> dict[str, Any]:
    """This process's digests after ``executor.run()``, as JSON for the outcome exchange.

    Args:
        plan: the refit's plan.
        executor: the :class:`xreshard.runtime.execute.Executor` that just ran (its bindings are
            what is hashed).
        local_ranks: this process's world ranks.
        sample: hash the sample (``verify="sample"``) instead of every transfer.
        version: the version this refit would commit (the same in every process).
        key: the digest key, the same in every process (:func:`call_key`).

    Returns:
        ``Digests.summary`` (see :func:`digest_bindings`).
    """
    return digest_bindings(plan, local_ranks, executor.src_bindings, executor.dst_bindings,
                           mode="sample" if sample else True, version=version,
                           key=key).summary


def stage_digests(prepared: Any, programs: dict, world: Any, mode: bool | str, target: int,
                  stage: int, src_bindings: Any, dst_bindings: Any, sides: str) -> Digests:
    """This process's digests of one stage of a prepared call (what ``Refit`` hashes with
    ``verify``): :func:`digest_bindings` under the call's key (:func:`call_key`), with the
    receivers' scratch of split FP8 blocks beside the destinations of the quantizing stage."""
    quant = prepared.formats.quant if stage == 0 else None
    if quant is not None and dst_bindings:     # split blocks' pieces landed there
        dst_bindings = {**dst_bindings, **quantized.scratch_bindings(quant, programs)}
    return digest_bindings(prepared.stages[stage].plan, world.rank_ids, src_bindings,
                           dst_bindings, mode=mode, version=target, sides=sides, quant=quant,
                           key=call_key(world, target))


def compare(outcomes: Sequence[Mapping[str, Any] | None], world: Any = None
            ) -> tuple[list[str], int]:
    """Compare every process's :func:`digests` (in process order).

    Args:
        outcomes: one digests dict per process (empty or None where a process hashed
            nothing).
        world: names the processes in messages (``world.describe_process``), if given.

    Returns:
        ``(messages, compared)``: one message per transfer whose sender and receiver
        digests differ, naming tensor, region, sender rank and process, receiver rank and
        process (rank pairs when a process had too many transfers to send each digest:
        see ``INLINE_TRANSFERS``); and how many transfers were compared.
    """
    found = mismatches(outcomes)
    describe = getattr(world, "describe_process", None)
    compared = 0
    for s in outcomes:
        for _, count in ((s or {}).get("recv") or {}).values():
            compared += int(count)
    return [m.describe(describe) for m in found], compared
