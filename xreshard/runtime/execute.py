"""The executor: the only stage that touches memory and the network.

For each round of a schedule it packs buckets from source bindings into staging (or sends
the bound view itself when a bucket is one contiguous run), posts every send and receive
of the round in one transport group, then unpacks received staging into destination
bindings. Casting happens on the sender at pack time, so the wire carries the smaller
dtype.

Pipelined (the default for host bindings): one thread, the *wire*, runs the transport
groups one after another, while the calling thread packs and unpacks around it:

```
 calling thread  pack 0 | pack 1 | local copies  | unpack 0 | pack 2 | unpack 1 | pack 3 ...
 wire thread          group 0 ........ | group 1 ............... | group 2 .........
```

Each send goes to the wire as soon as it is packed (gloo or shm move message i while i+1
packs). Staging is double-buffered (round k at the arena's bottom when k is even, at its
top when odd): the arena, the largest sum of two consecutive rounds' staging, must fit
``staging_bytes`` x the ranks sharing it (rounds of half the budget), else rounds run one
after another. Only the wire thread touches the transport (NCCL's groupStart/End hold).
Device (CUDA) bindings run round after round: their copies and NCCL calls are queued
asynchronously on xreshard's own stream of each device already.

Stages (:mod:`xreshard.planner.prepare`): every bucket and same-rank copy names its stage,
each with its own layouts, wire dtypes and bindings (:class:`Tables`): a tensor is keyed by
``(name, stage)``. Forwards (a relay, :mod:`xreshard.planner.relay`) may read what an
earlier round received: the pipelined path waits for (and unpacks) those rounds before
packing them. The scratch stage's copies (split FP8 blocks) run after every round.

Codecs (:mod:`.codecs`): the executor has ONE round loop (:meth:`Executor._rounds`) and
ONE pipelined loop (:meth:`Executor._pipelined`), whatever changes the bytes. A message
codec frames each group (``Fixed``: group k is round k; a delta call's ``Sized``: headers
one group ahead of their payloads); the kernels of every codec (FP8 quantizers, delta
diff) are one value from ``Tuning`` (:class:`.codecs.kernels.Kernels`). :func:`run` runs a
whole prepared call (each stage's bindings cut by ``metadata.stage_bindings``). The wire
thread is ``wire.py``, the programs ``programs.py``, devices ``devices.py``, copies
``copies.py``, the host pack of runs and unpack ``hostcopy.py`` (import their names from
there: nothing is re-exported here).

A *binding* is what a rank holds of a tensor, in the tensor's canonical coordinates: an
array (numpy on CPU, CuPy on GPU) for product layouts, a list of arrays (one per region)
for explicit ones. Bindings may be strided views (a transposed Flax kernel, one row range
of vLLM's fused qkv); ``layout.locate(rank, region)`` says where a region sits in them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .copies import array_module, copy_into
# the device hooks are looked up here at call time (tests replace them on this module)
from .devices import (Bindings, binding_devices, cast_problems, cuda_preflight, cupy_knows,
                      device_of)
from .devices import device_alloc as _device_alloc
from .devices import device_ctx as _device_ctx
from .devices import host_alloc as _host_alloc
from .devices import order_after_current as _order_after_current
from .devices import wait_devices as _wait_devices
from ..config import Tuning
from ..dtypes import as_dtype, numpy_dtype
from ..errors import RefitError
from ..ir.layout import Layout
from ..planner.prepare import PreparedCall
from ..planner.schedule import Bucket, Copy, Schedule
from ..transport.base import Transport, takes_view
from .metadata import StageBindings
from . import quantized
from .programs import Programs, Tables, packed
from .wire import Wire
from .gcpause import gc_paused
from .hostcopy import pack_runs, unpack_host
from .codecs.framing import FIXED
from .codecs.items import ItemCodecs
from .codecs.items import item as _item
from .codecs.kernels import HOST, Kernels
from .codecs.messages import message_codec

logger = logging.getLogger(__name__)

__all__ = ["ExecStats", "Executor", "run"]


@dataclass
class ExecStats:
    """What one process moved in one run."""

    bytes_sent: int = 0
    """Bytes sent of this process's own sources (forwards are ``bytes_forwarded``)."""
    bytes_forwarded: int = 0
    """Bytes sent of ``forwarded`` tensors: what this run received and passed on."""
    bytes_received: int = 0
    bytes_local: int = 0
    num_messages: int = 0
    num_zero_copy: int = 0
    num_rounds: int = 0
    staging_bytes: int = 0
    pipelined: bool = False
    quantized: dict[str, int] = field(default_factory=dict)
    """Quantized destinations' bytes by ``fp8_sent``, ``bf16_sent``, ... (quantized.count)."""
    seconds: float = 0.0
    per_round_seconds: list[float] = field(default_factory=list)


class Executor:
    """Runs a schedule between bindings over a transport.

    Device bindings (CuPy arrays over torch / JAX GPU memory) are packed, unpacked and
    copied on xreshard's own non-blocking stream of the device holding them, after what
    the calling thread's current stream there holds (``devices.py``; one staging arena
    per device). Before the first run on a device, :func:`cuda_preflight` compiles and
    runs the copy kernels once, so a missing NVRTC or header fails clearly, not mid-refit.

    Contract: when :meth:`run` returns, every byte of every destination has landed and
    every read of every source is done, for any stream: the executor waits (on the host,
    within ``timeout``) for an event recorded after its last copy on each device. So the
    caller may read destinations on its current stream (torch, vLLM, a side stream) and
    overwrite or donate sources without a device synchronize.

    Args:
        schedule: this process's buckets (see :mod:`xreshard.planner.schedule`).
        src_layouts / dst_layouts: stage 0's layouts of every tensor on each side. Their
            dtypes are the truth: a binding may be a raw-bits view of its tensor (see
            copy_into).
        wire_dtypes: stage 0's dtype on the wire per tensor.
        src_bindings / dst_bindings: stage 0's ``(rank, name) -> binding`` for this
            process's ranks.
        transport: moves the buckets (routes same-process pairs to a local copy).
        timeout: seconds each round may take.
        alloc: ``alloc(nbytes)`` -> a 1-D uint8 staging array; called under the rank's
            CUDA device for device bindings. Default: numpy for host bindings, CuPy for
            device ones.
        pipeline: overlap packing, the wire and unpacking (see the module docstring).
            Every process of a refit runs rounds of the same size; the pipelined path
            holds two rounds, so a refit that pipelines schedules rounds of half the
            budget (``CallOptions.halved``).
        staging_bytes: the most staging one rank may hold; the pipelined arena (two
            rounds) stays within it times the ranks sharing the arena, else rounds run one
            after another. None: no cap.
        forwarded: the ``(name, stage)`` whose source bindings are this run's own
            destination memory (a relay forwards what it received, see
            :mod:`xreshard.planner.relay`). The schedule puts each of their sends in a
            round after the one that writes its bytes; the executor sends them only once
            the earlier rounds landed (the pipelined path waits for them instead of
            packing ahead), runs their same-rank copies after every round, and counts them
            in ``ExecStats.bytes_forwarded``.
        arena: staging to reuse (another executor's :attr:`arena`), or None.
        later_stages: the :class:`Tables` of stages 1, 2, ... of a prepared call (the
            buckets and copies of ``schedule`` name their stage).
        programs: a dict that keeps the pack/unpack programs across runs of this
            schedule and these layouts (its owner resets it when they change), or None.
        pause_gc: pause the cyclic garbage collector while running (``gc_paused``).
        quant: ``PreparedCall.formats.quant`` (its scratch buffers among ``dst_bindings``).
        kernels: which kernels the codecs run (:class:`.codecs.kernels.Kernels`, from the
            call's ``Tuning``).
        codec: the message codec (:mod:`.codecs.framing`): ``FIXED`` (plain messages), or
            a delta call's (:class:`.codecs.delta.DeltaCodec`, ``Sized`` framing).
        scratch_stage: ``PreparedCall.scratch_stage``'s index, or None: its copies read
            the receivers' scratch, so they run after every round, like forwards'.
        transposed: the ``(name, stage)`` whose 2-D items travel in their senders' storage
            order, ``region.T`` row-major (``Formats.transposed``): a sender posts such a
            whole ``[in, out]`` shard as it is, the receivers transpose while unpacking.
    """

    def __init__(self, schedule: Schedule, src_layouts: Mapping[str, Layout],
                 dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str],
                 src_bindings: Bindings, dst_bindings: Bindings, transport: Transport,
                 timeout: float, alloc: Callable[[int], Any] | None = None,
                 pipeline: bool = True, staging_bytes: int | None = None,
                 forwarded: frozenset[tuple[str, int]] = frozenset(), arena: Any = None, *,
                 later_stages: Sequence[Tables] = (), programs: dict | None = None,
                 pause_gc: bool = True, quant: Any = None, kernels: Kernels = HOST,
                 codec: Any = FIXED, scratch_stage: int | None = None,
                 transposed: frozenset[tuple[str, int]] = frozenset()):
        self.schedule = schedule
        self.tables = (Tables(src_layouts, dst_layouts, wire_dtypes, src_bindings,
                              dst_bindings),) + tuple(later_stages)
        self.transport = transport
        self.timeout = timeout
        self._alloc = alloc
        self.pipeline = bool(pipeline)
        self.programs = Programs(self.tables, programs, quant, transposed)
        self.quant = quant
        self.kernels = kernels
        self.codec = codec
        self.items = ItemCodecs(kernels)
        self.staging_bytes = staging_bytes
        #: staging per CUDA device ordinal (None: host memory), reused across runs
        self._arena: dict[int | None, Any] = {} if arena is None else arena
        self.forwarded = frozenset(forwarded)
        self.scratch_stage = scratch_stage
        self.pause_gc = pause_gc

    @property
    def src_bindings(self) -> Bindings:
        """Stage 0's source bindings."""
        return self.tables[0].src_bindings

    @property
    def dst_bindings(self) -> Bindings:
        """Stage 0's destination bindings."""
        return self.tables[0].dst_bindings

    @property
    def wire(self) -> Mapping[str, str]:
        """Stage 0's wire dtype per tensor, by canonical name."""
        return self.programs.wire(0)

    @property
    def arena(self) -> dict[int | None, Any]:
        """Staging per CUDA device (None: host), for the next executor's ``arena=``."""
        if self._arena is None:
            self._arena = {}
        return self._arena

    # ------------------------------------------------------------ views

    def _is_forward(self, b: Bucket) -> bool:
        # a bucket holds one stage's tensors only (see relay.overlapped_schedule)
        return bool(self.forwarded) and (b.items[0].name, b.stage) in self.forwarded

    def _zero_copy(self, b: Bucket, side: int) -> Any:
        """The bound view itself as the message (a bucket of one item, no cast, one
        contiguous run in the message's order: row-major, or for a transposed step its
        transpose; writeable to receive into), or None."""
        if len(b.items) != 1:
            return None
        step = self.programs.program(b, side)[0]
        if step.dtype != step.wire or step.quant is not None:
            return None
        tables = self.tables[b.stage]
        arr = (tables.src_bindings if side == 0 else tables.dst_bindings)[step.key]
        view = _item(arr, step.index, step.slices)
        if step.transposed:     # the message holds region.T row-major
            view = view.T
        if view.flags.c_contiguous and (side == 0 or getattr(view.flags, "writeable", True)):
            return view.reshape(-1).view(np.uint8)
        lands = (side == 1 and not step.transposed and self.codec is FIXED
                 and takes_view(self.transport, b, view))
        return view if lands else None      # the strided region itself (transport/local.py)

    def _zero_copy_send(self, b: Bucket) -> Any:
        return self._zero_copy(b, 0)

    def _zero_copy_recv(self, b: Bucket) -> Any:
        return self._zero_copy(b, 1)

    def _message(self, b: Bucket, offsets: dict[int | None, int], stats: ExecStats) -> Any:
        """Send bucket ``b``'s message: the bound view itself, or packed into staging taken
        at ``offsets``."""
        buf = self._zero_copy_send(b)
        if buf is None:
            buf = self._take(offsets, b.src, b.nbytes)
            self._pack(b, buf)
        else:
            stats.num_zero_copy += 1
        return buf

    # ------------------------------------------------------------ pack / unpack

    def _packed(self, b: Bucket) -> list[tuple[Any, int]]:
        """Bucket ``b``'s items with their byte offsets in its message (``programs.packed``)."""
        return packed(b, self.programs.wire(b.stage))

    def _pack(self, b: Bucket, buf: Any) -> None:
        bindings = self.tables[b.stage].src_bindings
        xp = array_module(buf)
        if xp is np and len(b.items) > 1:
            return self._pack_runs(b, buf)
        codecs = self.items
        for e in self.programs.program(b, 0):
            codecs.of(e).pack(e, buf, bindings)

    def _pack_runs(self, b: Bucket, buf: np.ndarray) -> None:
        """Host packing of a bucket of many items (:func:`.hostcopy.pack_runs`)."""
        pack_runs(self.programs, self.items, self.tables[b.stage].src_bindings, b, buf)

    def _unpack(self, b: Bucket, buf: Any) -> None:
        if isinstance(buf, np.ndarray):
            return self._unpack_host(b, buf)
        bindings = self.tables[b.stage].dst_bindings
        codecs = self.items
        for e in self.programs.program(b, 1):
            codecs.of(e).unpack(e, buf, bindings)

    def _unpack_host(self, b: Bucket, buf: np.ndarray) -> None:
        """Unpacking from host staging (:func:`.hostcopy.unpack_host`)."""
        unpack_host(self.programs, self.items, self.tables[b.stage].dst_bindings, b, buf)

    def _local_copy(self, c: Copy) -> int:
        tables = self.tables[c.stage]
        if c.stage == self.scratch_stage:
            return quantized.finish_copy(c, self.quant, tables, self.kernels)
        if quantized.copies(self.quant, c):
            return quantized.copy_local(c, self.quant, tables, self.kernels)
        src_layout, dst_layout = tables.src_layouts[c.name], tables.dst_layouts[c.name]
        si, src_slices, di, dst_slices = self.programs.local(c)
        src = tables.src_bindings[(c.rank, c.name)]
        src = (src if si is None else src[si])[src_slices]
        dst = tables.dst_bindings[(c.rank, c.name)]
        dst = (dst if di is None else dst[di])[dst_slices]
        wire = self.programs.wire(c.stage)[c.name]
        src_dtype, dst_dtype = src_layout.dtype, dst_layout.dtype
        xp = array_module(dst)
        if src_dtype != wire and dst_dtype != wire:
            # the cast the wire would have made, then the receiver's
            src, src_dtype = as_dtype(src, src_dtype).astype(numpy_dtype(wire)), wire
        copy_into(xp, dst, dst_dtype, src, src_dtype)
        return c.nbytes

    # ------------------------------------------------------------ devices

    def _devices(self) -> dict[int, int | None]:
        """CUDA device ordinal of each local rank's bindings (None: host memory)."""
        sides = [b for t in self.tables for b in (t.src_bindings, t.dst_bindings)]
        if all(set(map(type, b.values())) <= {np.ndarray} for b in sides):
            # host arrays only (the common case on CPU): no device, checked in C
            return {rank: None for b in sides for rank, _ in b}
        return binding_devices(*sides, of=device_of)

    def _on(self, rank: int) -> Any:
        """Context for work on ``rank``'s device: ``cupy.cuda.Device`` or nothing."""
        return _device_ctx(self._device.get(rank))

    def _cast_problems(self) -> list[str]:
        """Casts this process would run on a GPU that CuPy cannot compute."""
        problems = []
        for k, t in enumerate(self.tables):
            wire = self.programs.wire(k)
            for side, bindings, layouts in (("send", t.src_bindings, t.src_layouts),
                                            ("receive", t.dst_bindings, t.dst_layouts)):
                problems += cast_problems(bindings, layouts, wire.__getitem__, self._device,
                                          side, knows=cupy_knows)
        return sorted(set(problems))

    # ------------------------------------------------------------ run

    def _round_needs(self) -> list[dict[int | None, int]]:
        """Staging bytes each round takes, per device (None: host memory)."""
        needs = []
        for buckets in self.schedule.rounds:
            total: dict[int | None, int] = {}
            for b in buckets:
                if b.src in self._local_src and self._zero_copy_send(b) is None:
                    dev = self._device.get(b.src)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
                if b.dst in self._local_dst and self._zero_copy_recv(b) is None:
                    dev = self._device.get(b.dst)
                    total[dev] = total.get(dev, 0) + _aligned(b.nbytes)
            needs.append(total)
        return needs

    def _staging_needed(self) -> dict[int | None, int]:
        need: dict[int | None, int] = {}
        for total in self._round_needs():
            for dev, n in total.items():
                need[dev] = max(need.get(dev, 0), n)
        return need

    def _double_buffered(self, needs: list[dict[int | None, int]]
                         ) -> dict[int | None, int] | None:
        """Arena bytes per device that hold any two consecutive rounds side by side, or
        None when that exceeds ``staging_bytes`` x the local ranks on the device."""
        arena: dict[int | None, int] = {}
        for k, total in enumerate(needs):
            nxt = needs[k + 1] if k + 1 < len(needs) else {}
            for dev in set(total) | set(nxt):
                arena[dev] = max(arena.get(dev, 0), total.get(dev, 0) + nxt.get(dev, 0))
        if self.staging_bytes is not None:
            ranks: dict[int | None, int] = {}
            for r in self._local_src | self._local_dst:
                dev = self._device.get(r)
                ranks[dev] = ranks.get(dev, 0) + 1
            for dev, n in arena.items():
                if n > self.staging_bytes * max(ranks.get(dev, 1), 1):
                    return None
        return arena

    def _staging(self, need: dict[int | None, int]) -> None:
        if self._arena is None:         # a caller reset it
            self._arena = {}
        for dev, n in need.items():
            have = self._arena.get(dev)
            if have is not None and len(have) >= n:
                continue
            self._arena[dev] = None     # free the old one first
            with _device_ctx(dev):
                alloc = self._alloc or (_host_alloc if dev is None else _device_alloc)
                self._arena[dev] = alloc(n)

    def _take(self, offsets: dict[int | None, int], rank: int, nbytes: int) -> Any:
        dev = self._device.get(rank)
        off = offsets.get(dev, 0)
        offsets[dev] = off + _aligned(nbytes)
        return self._arena[dev][off:off + nbytes]

    def run(self) -> ExecStats:
        """Move everything; raises RefitError (TransportTimeout on a silent peer).

        When it returns, destinations are written and sources read, on every stream (see
        the class docstring).
        """
        self.codec.start(self)
        try:
            with gc_paused(self.pause_gc):
                return self._run()
        finally:            # a codec's threads (a delta's encoders) end with the run
            self.codec.stop(self)

    def _run(self) -> ExecStats:
        stats = ExecStats()
        t0 = time.perf_counter()
        self._local_src = {r for t in self.tables for r, _ in t.src_bindings}
        self._local_dst = {r for t in self.tables for r, _ in t.dst_bindings}
        self._device = self._devices()
        gpus = sorted({d for d in self._device.values() if d is not None})
        if gpus:
            problems = self._cast_problems()
            if problems:
                raise RefitError("casts this refit needs cannot run on the GPU: "
                                 + "; ".join(problems[:10]) + " - send the tensor in its "
                                 "own dtype (wire_dtype), or cast it in the framework first")
            # FP8 quantizes on the devices (quantize_device); refused only without a
            # framework to run the quantizers there
            quantized.refuse_devices(self.quant, any(self._device.get(r) is not None
                                                     for r in self._local_src),
                                     any(self._device.get(r) is not None
                                         for r in self._local_dst), self.kernels)
            for dev in gpus:
                cuda_preflight(dev)
            _order_after_current(gpus)      # own streams after the bindings' producers
        ok = False
        try:
            arena = None
            if self.pipeline and not gpus and len(self.schedule.rounds) > 0 \
                    and self.codec.pipelines(self):
                needs = self._round_needs()
                arena = self._double_buffered(needs)
            if arena is not None:
                self._staging(arena)
                stats.staging_bytes = sum(arena.values())
                stats.pipelined = True
                self._pipelined(needs, arena, stats)
            else:
                self._local_copies(stats, forwarded=False)
                need = self._staging_needed()
                self._staging(need)
                stats.staging_bytes = sum(need.values())
                self._rounds(stats)
                self._local_copies(stats, forwarded=True)
            ok = True
        finally:
            if gpus:    # also after a failure: no copy may still read or write afterwards
                try:
                    _wait_devices(gpus, time.monotonic() + self.timeout, self.timeout)
                except Exception as e:
                    if ok:
                        raise
                    logger.warning("after a failed refit, waiting for its copies failed "
                                   "too: %s", e)
        stats.num_rounds = len(self.schedule.rounds)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _recv_buffers(self, buckets: Sequence[Bucket], offsets: dict[int | None, int],
                      stats: ExecStats) -> tuple[list[tuple[Any, Bucket]],
                                                 list[tuple[Bucket, Any]]]:
        """Where each of this process's receives in ``buckets`` lands: the destination view
        itself (zero-copy) or staging taken at ``offsets``. Returns ``(buffer, bucket)``
        for every receive and ``(bucket, staging)`` for those to unpack."""
        recvs: list[tuple[Any, Bucket]] = []
        unpack: list[tuple[Bucket, Any]] = []
        for b in buckets:
            if b.dst in self._local_dst:
                buf = self._zero_copy_recv(b)
                if buf is None:
                    buf = self._take(offsets, b.dst, b.nbytes)
                    unpack.append((b, buf))
                else:
                    stats.num_zero_copy += 1
                recvs.append((buf, b))
                stats.bytes_received += b.nbytes
                quantized.count(self.quant, b, stats, "received")
        return recvs, unpack

    def _local_copies(self, stats: ExecStats, forwarded: bool) -> None:
        """Same-rank copies: those of ``forwarded`` tensors and of the scratch stage read
        what the rounds wrote, so they run after every round (``forwarded=True``); the
        others before or beside."""
        for c in self.schedule.local_copies:
            late = (c.name, c.stage) in self.forwarded or c.stage == self.scratch_stage
            if late == forwarded:
                with self._on(c.rank):
                    stats.bytes_local += self._local_copy(c)
        if forwarded and self.scratch_stage is not None:    # a device quantizer's stream
            quantized.settle(self.tables[self.scratch_stage].dst_bindings)

    def _count_send(self, b: Bucket, stats: ExecStats) -> None:
        if self._is_forward(b):
            stats.bytes_forwarded += b.nbytes
        else:
            stats.bytes_sent += b.nbytes
        stats.num_messages += 1
        quantized.count(self.quant, b, stats, "sent")

    def _post(self, buf: Any, b: Bucket) -> None:
        self.transport.send(buf, b.src, b.dst, b.tag)

    def _rounds(self, stats: ExecStats) -> None:
        """The round loop: group after group on the calling thread (device bindings, the
        ``rounds`` executor, and what does not fit two rounds of staging). Group ``k``
        (the message codec's, :mod:`.codecs.framing`) is round ``k``, or for ``Sized``
        framing round ``k - 1``'s payloads and round ``k``'s headers."""
        rounds = self.schedule.rounds
        for k in range(len(rounds) + (self.codec.lag if rounds else 0)):
            self._group(k, rounds[k] if k < len(rounds) else (), stats)
            if k < len(rounds):
                self.codec.after_group(self, k)

    def _group(self, k: int, buckets: Sequence[Bucket], stats: ExecStats) -> None:
        tr = time.perf_counter()
        offsets: dict[int | None, int] = {}
        group = self.codec.open(self, k, buckets, offsets, stats)
        if group.idle:
            return
        if group.moves:
            with self.transport.group(self.timeout):
                # receives first, so peers' sends can start while this process packs;
                # posted on the rank's device and stream: transports order after what is
                # queued there
                for buf, b in group.recvs:
                    with self._on(b.dst):
                        self.transport.recv(buf, b.src, b.dst, b.tag)
                # transports that start posts at once (gloo) move message i while i+1 packs
                self.codec.post(self, group, self._post, offsets, stats)
        self.codec.land(self, group.landing)
        stats.per_round_seconds.append(time.perf_counter() - tr)

    # ------------------------------------------------------------ pipelined run

    def _pipelined(self, needs: list[dict[int | None, int]], arena: dict[int | None, int],
                   stats: ExecStats) -> None:
        """Groups overlapped: the wire thread runs group k while this thread packs group
        k+1 and lands group k-1 (host bindings only). Round ``j``'s staging half is free
        once round ``j - 2`` landed. A ``Sized`` codec's group ``k`` opens once group
        ``k - 1`` moved (its headers size group ``k``'s receives) and group ``k - 1`` lands
        while group ``k`` moves. Forwards wait for earlier rounds (``Fixed.post``)."""
        rounds = self.schedule.rounds
        codec, lag = self.codec, self.codec.lag
        pending: dict[int, list] = {}
        started: dict[int, float] = {}

        def finish(j: int) -> None:
            if j not in pending:
                return          # already landed (for a forward, or a sized group)
            wire.wait(j)
            landing = pending.pop(j)
            if landing or not codec.sized:
                codec.land(self, landing)
                stats.per_round_seconds.append(time.perf_counter() - started.pop(j))

        with Wire(self.transport, self.timeout) as wire:
            groups = len(rounds) + (lag if rounds else 0)
            for k in range(groups):
                finish(k - 2)           # frees round k's half of the arena
                if codec.sized and k:
                    wire.wait(k - 1)    # its headers size this group's receives
                started[k] = time.perf_counter()
                j = k - lag             # the round whose staging this group takes
                offsets = {} if j < 0 else {
                    dev: 0 if j % 2 == 0 else arena[dev] - needs[j].get(dev, 0)
                    for dev in arena}
                group = codec.open(self, k, rounds[k] if k < len(rounds) else (), offsets,
                                   stats)
                pending[k] = group.landing
                wire.open(k, group.recvs)

                def landed(k: int = k) -> None:
                    for i in sorted(pending):
                        if i < k:
                            finish(i)
                codec.post(self, group, wire.send, offsets, stats, landed)
                wire.close(k)
                if k == 0:      # same-rank copies overlap the first group's wire
                    self._local_copies(stats, forwarded=False)
                if codec.sized and k:
                    finish(k - 1)       # moved already (waited above): lands while k moves
            if not groups:
                self._local_copies(stats, forwarded=False)
            for k in sorted(pending):
                finish(k)
            self._local_copies(stats, forwarded=True)


_ALIGN = 256    # staging offsets: what cudaMalloc guarantees, enough for any element


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# ---------------------------------------------------------------------------- a prepared call


def run(prepared: PreparedCall, bindings: StageBindings, transport: Transport, *,
        timeout: float, arena: dict | None = None, programs: dict | None = None,
        tuning: Tuning = Tuning(), delta: Any = None, epoch: int | None = None
        ) -> tuple[ExecStats, dict]:
    """Run a prepared call: every stage, in one executor, over ``transport``.

    Args:
        prepared: the call (:func:`xreshard.planner.prepare.prepare`, for this process's
            ranks).
        bindings: its stage bindings (``metadata.stage_bindings``).
        transport: moves the buckets.
        timeout: seconds each round may take.
        arena: staging kept from earlier runs (per device), or None.
        programs: the pack/unpack program cache of ``prepared`` (its owner keeps one per
            prepared call), or None.
        tuning: the executor kind and the GC pause (``Tuning``); the schedule's round size
            was decided when the call was prepared (``CallOptions.halved``).
        delta: a ``delta_wire.DeltaCall`` (``RefitConfig(delta=True)``): the delta message
            codec sends each bucket encoded against its baseline (host or device memory:
            :func:`.codecs.messages.message_codec`); None: plain messages.
        epoch: the world's membership epoch (``World.epoch``); None: not checked.

    Returns:
        ``(stats, arena)``: what this process moved, and the staging to keep.

    Raises:
        EpochMismatch: ``prepared`` is for another membership epoch (before any byte moves).
        What the executor raises (see :meth:`Executor.run`).
    """
    prepared.check_epoch(epoch)
    tables = [Tables(st.src_layouts, st.dst_layouts, st.wire_dtypes, bindings.src[k],
                     bindings.dst[k]) for k, st in enumerate(prepared.stages)]
    st = prepared.scratch_stage
    if st is not None:
        # sources: the receivers' scratch (in the program cache), where stage 0's pieces land
        scratch = quantized.scratch_bindings(prepared.formats.quant, programs, bindings.dst[0])
        dst0 = tables[0].dst_bindings
        tables[0] = tables[0]._replace(dst_bindings={**dst0, **scratch})
        tables.append(Tables(st.src_layouts, st.dst_layouts, st.wire_dtypes, scratch, dst0))
    kernels = Kernels.of(tuning)
    executor = Executor(prepared.schedule, *tables[0], transport, timeout,
                    pipeline=tuning.executor == "pipelined", arena=arena,
                    staging_bytes=prepared.options.staging_bytes, forwarded=prepared.forwarded,
                    later_stages=tables[1:], programs=programs, pause_gc=tuning.pause_gc,
                    quant=prepared.formats.quant, kernels=kernels,
                    codec=message_codec(delta, bindings, tuning, kernels),
                    scratch_stage=None if st is None else st.index,
                    transposed=prepared.formats.transposed)
    stats = executor.run()
    return stats, executor.arena
