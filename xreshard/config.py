"""How a refit moves bytes (``RefitConfig``), how this process runs it (``Tuning``) and
what one call moved (``RefitReport``).

All are plain values. The config crosses processes as JSON (every process must pass the
same); the tuning is this process's (the processes agree on the parts that shape the
schedule, see ``Tuning``); the report is what ``Refit.__call__`` returns.

A leaf module (it imports only ``dtypes`` and ``errors``), so the planner may take a
config's values without importing the runtime.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .dtypes import dtype_name
from .errors import RefitError

__all__ = ["EXECUTORS", "RefitConfig", "RefitReport", "Tuning", "env_token"]

#: the executors a refit may run (``Tuning.executor``)
EXECUTORS = ("pipelined", "rounds")


@dataclass(frozen=True)
class RefitConfig:
    """How a refit moves bytes. Every process of a world must pass the same values
    (checked: a difference is refused before any byte moves)."""

    bucket_bytes: int = 64 << 20
    """The most bytes in one message between two ranks (> 0)."""
    staging_bytes: int = 256 << 20
    """The most bytes one rank has in flight in one round, staging included (> 0)."""
    timeout: float = 300.0
    """Seconds any wait may take (a round, a metadata exchange) before raising (> 0)."""
    wire_dtype: str | Mapping[str, str] | None = None
    """Cast to this dtype on the sender (e.g. "bfloat16" for fp32 master weights), for every
    tensor or, as a mapping, per tensor name; None requires equal dtypes on both sides."""
    transport: str = "auto"
    """"auto" (per pair: local copies inside a process, shared memory or CUDA IPC on one
    host or GPU, gloo or nccl across), or a kind the world knows."""
    verify: bool | str = False
    """Compare a checksum of every region on its sender and its receiver after moving
    (True), of a rotating subset ("sample"), or not (False). A mismatch raises
    ``VerificationError`` on every rank and the version does not advance."""

    relay: str = "off"
    """Relay through destination replicas (see :mod:`xreshard.planner.relay`): "off" (the direct
    plan: every destination rank receives its bytes from a source rank), "on" (two stages:
    bytes needed by several destination ranks of one domain - a host - cross to that
    domain once, then its ranks forward them to each other), or "auto" ("on" when some
    region is needed by two or more destination ranks of a domain that holds none of its
    sources, else "off")."""

    delta: bool = False
    """Send, per bucket, only the elements whose bits changed since the last confirmed call
    (``xreshard.runtime.delta_wire``): each sending rank keeps the last bytes it sent in
    host memory (as many bytes as it sends per call; ``RefitReport.delta``; device memory
    with ``Tuning(delta_baseline="device")``) and encodes each bucket as the smallest of
    dense, bitmask + values and runs + values; receivers overwrite in place. A receiver
    that is new, restarted, failed or missed a call gets a dense refit of its regions in
    the same call. Composes with ``wire_dtype`` (the baseline is the cast bytes), with
    ``atomic`` (a failed call keeps every claim: the next call is a delta again; the
    senders hold a dense bucket's new bytes until the outcome), with FP8 destinations
    quantized on the way (codes and scales diffed as sent; a changed block requantizes
    whole; pieces of blocks split across senders diffed against what their receiver kept
    of them), and with ``relay`` (a forwarding rank keeps a baseline of what it forwards
    and sends its forwards as deltas under the same per-pair fences; see
    :mod:`xreshard.planner.relay`), all of them together too. Device bindings diff,
    quantize and apply on their device with JAX or torch ops
    (``xreshard.runtime.delta_device``); refused by name at ``refit/check``, before any
    byte moves, where neither is installed."""

    check_writes: bool = False
    """Fail the refit (the same ``RefitError`` on every rank; the version stays) when a sent
    torch tensor was written while the refit read it, e.g. an optimizer step before
    ``handle.wait()`` of a started refit: its bytes (a checksum on its device, taken before
    ``start()`` returns and after the last send) or its version counter changed. Sees fused
    optimizers, ``.data`` and numpy-view writes; costs two reads of the sent bytes on the
    sender (see :mod:`xreshard.runtime.writes`). JAX arrays are immutable: not checked."""

    atomic: bool = False
    """Transactional destinations: in-place destinations (torch tensors and DTensors, a
    :class:`~xreshard.runtime.binding.Bound`) receive into staging that is copied into
    them only after every process agreed the call succeeded, so a call that fails leaves
    every destination at its previous version, bit for bit (and ``stale`` unset). Costs
    one extra buffer of this process's destination bytes (kept across calls) and two
    local copies of them per call (:mod:`xreshard.runtime.atomic`). JAX destinations are
    new arrays, atomic either way. False: a failed call may leave a mix (``stale``). With
    ``delta``, deltas apply to the staging (refreshed from the destinations) and a failed
    call leaves the delta bases valid (:mod:`xreshard.runtime.delta_wire`)."""

    on_member_loss: str = "continue"
    """What a call of an elastic world (``World.join(elastic=True)``) does when members
    die or stop answering while it moves: "continue" (the default a fleet wants: when no
    lost member held a source region, the survivors move to a new epoch and finish the
    call there, every surviving destination exact; ``RefitReport.lost`` names the lost)
    or "fail" (the call fails on every survivor with one typed error). A lost source
    fails the call either way; the world moves on without the lost instead of being
    broken. A fixed world (the default) fails and is broken, as it always was."""

    def __post_init__(self) -> None:
        for name in ("bucket_bytes", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RefitError(f"RefitConfig.{name} must be a positive int of bytes, "
                                 f"got {value!r}")
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t <= 0:
            raise RefitError(f"RefitConfig.timeout must be a positive finite number of "
                             f"seconds, got {t!r}")
        if isinstance(self.wire_dtype, Mapping):
            for k, v in self.wire_dtype.items():
                if not isinstance(k, str):
                    raise RefitError(f"RefitConfig.wire_dtype maps tensor names (str) to "
                                     f"dtypes, got key {k!r}")
                dtype_name(v)
        elif self.wire_dtype is not None:
            dtype_name(self.wire_dtype)
        if not isinstance(self.transport, str):
            raise RefitError(f"RefitConfig.transport must be a str, got {self.transport!r}")
        if self.verify not in (False, True, "sample") or (
                not isinstance(self.verify, (bool, str))):
            raise RefitError(f"RefitConfig.verify must be False, True or 'sample', got "
                             f"{self.verify!r}")
        if self.on_member_loss not in ("continue", "fail"):
            raise RefitError(f"RefitConfig.on_member_loss must be 'continue' or 'fail', got "
                             f"{self.on_member_loss!r}")
        for flag in ("atomic", "delta", "check_writes"):      # "yes" is truthy, not True
            if not isinstance(getattr(self, flag), bool):
                raise RefitError(f"RefitConfig.{flag} must be a bool, got "
                                 f"{getattr(self, flag)!r}")
        if self.relay not in ("off", "on", "auto"):
            raise RefitError(f"RefitConfig.relay must be 'off', 'on' or 'auto', got "
                             f"{self.relay!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if isinstance(self.wire_dtype, Mapping):
            d["wire_dtype"] = {k: dtype_name(v) for k, v in sorted(self.wire_dtype.items())}
        elif self.wire_dtype is not None:
            d["wire_dtype"] = dtype_name(self.wire_dtype)
        return d


@dataclass(frozen=True)
class Tuning:
    """How this process runs refits: switches that change how fast bytes move, never which
    bytes. Pass one to ``Refit(..., tuning=)``; without one, a ``Refit`` takes
    :meth:`from_env` once, when it is built.

    ``executor`` and ``relay_overlap`` shape the schedule, so the processes of a refit
    must agree on them (checked at ``refit/check``: a difference is refused before any
    byte moves); ``pause_gc`` and ``layout_memo`` are this process's alone.
    """

    executor: str = "pipelined"
    """"pipelined" (pack, wire and unpack overlap, rounds of half of ``staging_bytes``; host
    bindings only: a process with device bindings runs full rounds one after another) or
    "rounds" (round after round, full rounds). Environment: ``XRESHARD_EXECUTOR``."""
    relay_overlap: bool = True
    """``RefitConfig(relay=...)``: forwards overlap the arrival of later chunks (False: each
    forward waits for its sender's whole stage 1, as two stages back to back; for
    measuring what overlap saves)."""
    pause_gc: bool = True
    """Pause Python's cyclic garbage collector during a call (see
    ``xreshard.runtime.execute.gc_paused``); False only to measure what it saves."""
    layout_memo: bool = True
    """Remember the layouts the adapters built across calls (``Refit.layout_memo``);
    False builds every layout anew on every call (to measure what the memo saves)."""

    delta_baseline: str = "host"
    """``RefitConfig(delta=True)`` with device bindings: where a sender keeps the bytes it
    last sent. "host" (as many bytes of host memory as it sends; each diff uploads them)
    or "device" (as many bytes of the device's memory, no transfer; reported as
    ``RefitReport.delta["baseline_device_bytes"]``). Host bindings keep them on the host."""
    device_kernels: str = "auto"
    """Which framework's ops run a refit's work on device memory (the delta diff and apply,
    FP8 quantizing): "jax", "torch" or "auto" (a sender: JAX in a process that loaded JAX,
    else torch; a receiver: torch where installed, else JAX)."""
    host_device_ops: str | None = None
    """Tests without a GPU: "jax" or "torch" runs host bindings through the device path
    (delta diff and apply, FP8 quantizing) with that framework's CPU ops, the code a GPU
    runs; None (the default): host bindings take the host path. Environment:
    ``XRESHARD_TEST_DEVICE_OPS``."""
    quant_threads: int | None = None
    """Threads of the host FP8 quantizer (None: the CPUs this process may run on).
    Environment: ``XRESHARD_QUANT_THREADS``."""

    shm: bool = True
    """Offer shared memory to the processes of this host (``transport("auto")`` routes
    same-host CPU pairs through it). False keeps this process off it: its pairs take gloo.
    Read by the world this tuning is given to (``World.join(tuning=)``) when it first
    makes its transports: they are the world's, shared by its refits, so a ``Refit``'s
    own tuning does not change them. Environment: ``XRESHARD_SHM=0``."""
    shm_pull: bool = True
    """With ``shm``: let peers read this process's send buffers in place
    (``process_vm_readv``); False moves every shared-memory message through shared
    segments (a copy in and a copy out). Read as ``shm``. Environment:
    ``XRESHARD_SHM_PULL=0``."""
    fp8_ahead: bool = True
    """Quantize a sender's FP8 items on worker threads while the call checks and plans
    (:mod:`xreshard.runtime.quantize_ahead`); False packs them in the call (to measure
    what working ahead saves). Environment: ``XRESHARD_FP8_AHEAD`` ("0" turns it off)."""
    send_stored: bool = False
    """Offer the tensors this process sends from transposed storage (JAX ``[in, out]``
    kernels bound with ``transpose=``) in that order: where every sender of a tensor
    offers it and its receivers spread the work, whole shards are posted as they are and
    the receivers transpose while unpacking (``xreshard.planner.formats.wire_orders``);
    the bytes that land are the same either way. Off by default: on a 2-core host it
    moved 0.03 s of the trainer's CPU per 128 MiB refit to the receivers but did not make
    the refit faster (benchmarks/RESULTS.md, "fifth: rxt"). This process's alone."""

    def __post_init__(self) -> None:
        if self.delta_baseline not in ("host", "device"):
            raise RefitError(f"Tuning.delta_baseline must be 'host' or 'device', got "
                             f"{self.delta_baseline!r}")
        if self.device_kernels not in ("auto", "jax", "torch"):
            raise RefitError(f"Tuning.device_kernels must be 'auto', 'jax' or 'torch', got "
                             f"{self.device_kernels!r}")
        if self.host_device_ops not in (None, "jax", "torch"):
            raise RefitError(f"Tuning.host_device_ops must be None, 'jax' or 'torch', got "
                             f"{self.host_device_ops!r}")
        if self.quant_threads is not None and (
                isinstance(self.quant_threads, bool) or not isinstance(self.quant_threads, int)
                or self.quant_threads < 1):
            raise RefitError(f"Tuning.quant_threads must be None or a positive int, got "
                             f"{self.quant_threads!r}")
        if self.executor not in EXECUTORS:
            raise RefitError(f"Tuning.executor must be one of {EXECUTORS}, got "
                             f"{self.executor!r}")
        for name in ("relay_overlap", "pause_gc", "layout_memo", "shm", "shm_pull",
                     "fp8_ahead", "send_stored"):
            if not isinstance(getattr(self, name), bool):
                raise RefitError(f"Tuning.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tuning:
        """The default tuning, from ``XRESHARD_EXECUTOR`` (``pipelined``, the default, or
        ``rounds``), ``XRESHARD_DELTA_BASELINE`` (``host`` or ``device``),
        ``XRESHARD_DEVICE_KERNELS`` (``auto``, ``jax`` or ``torch``), ``XRESHARD_SHM`` and
        ``XRESHARD_SHM_PULL`` (``0``, ``false`` or ``off`` turn ``shm`` / ``shm_pull``
        off; anything else, or unset, leaves them on), ``XRESHARD_TEST_DEVICE_OPS``
        (``jax`` or ``torch``: :attr:`host_device_ops`, tests only),
        ``XRESHARD_QUANT_THREADS`` (a positive int: :attr:`quant_threads`) and
        ``XRESHARD_FP8_AHEAD`` (``0``, ``false``, ``no`` or ``off``: no FP8 work ahead); the
        table of variables is in docs/extending.md (``XRESHARD_TOKEN``, the world's secret,
        is :func:`env_token`).

        Raises:
            RefitError: an unknown value of one of them.
        """
        env = os.environ if environ is None else environ
        kind = env.get("XRESHARD_EXECUTOR", "pipelined").strip().lower()
        if kind not in EXECUTORS:
            raise RefitError(f"XRESHARD_EXECUTOR={kind!r}: expected 'pipelined' or 'rounds'")
        baseline = env.get("XRESHARD_DELTA_BASELINE", "host").strip().lower()
        kernels = env.get("XRESHARD_DEVICE_KERNELS", "auto").strip().lower()
        off = ("0", "false", "off")
        shm = env.get("XRESHARD_SHM", "1").strip().lower() not in off
        shm_pull = env.get("XRESHARD_SHM_PULL", "1").strip().lower() not in off
        host_ops = env.get("XRESHARD_TEST_DEVICE_OPS", "").strip().lower() or None
        if host_ops not in (None, "jax", "torch"):
            raise RefitError(f"XRESHARD_TEST_DEVICE_OPS={host_ops!r}: expected 'jax' or "
                             "'torch' (or unset)")
        threads = env.get("XRESHARD_QUANT_THREADS", "").strip()
        try:
            quant_threads = max(1, int(threads)) if threads else None
        except ValueError:
            raise RefitError(f"XRESHARD_QUANT_THREADS={threads!r}: expected a positive "
                             "int") from None
        ahead = env.get("XRESHARD_FP8_AHEAD", "1").strip().lower() not in (
            "0", "false", "no", "off")
        return cls(executor=kind, delta_baseline=baseline, device_kernels=kernels,
                   host_device_ops=host_ops, quant_threads=quant_threads, shm=shm,
                   shm_pull=shm_pull, fp8_ahead=ahead)


def env_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The world token from ``XRESHARD_TOKEN`` (None when unset or empty): what
    ``World.join`` signs with when it is given no ``token=`` (:mod:`xreshard.runtime.store`
    says what a token protects). Read here, with the other variables, at each join."""
    env = os.environ if environ is None else environ
    return env.get("XRESHARD_TOKEN") or None


@dataclass(frozen=True)
class RefitReport:
    """What one call moved, seen from this process.

    Time is split so rates are honest: ``move_seconds`` is the executor moving bytes
    (staging, rounds, local copies); everything else in ``seconds`` is setup
    (``setup_seconds``): binding, the checks' and the outcome's metadata exchanges,
    planning (``plan_seconds``, large on a first call), creating transports (first call)
    and checksums (``verify``).
    """

    version: int
    seconds: float
    """The whole call."""
    plan_seconds: float
    """From the call's start until the plan was ready: binding, the checks' metadata
    exchange (waiting for every process to arrive) and, on a first call or after a layout
    changed, exchanging layouts and planning. A process's first call also imports what
    its bindings need, and every process waits for the slowest: ``torch.distributed.tensor``
    (it imports sympy) and, for bf16/float8 tensors in a torch process, ``ml_dtypes``
    (its extension registers its dtypes with numpy); measured 2-4 s each on 2 loaded
    cores, the "3-5 s planning" of a first bf16 call (a JAX process has both loaded)."""
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    bytes_moved_world: int
    bytes_gather_broadcast_world: int
    num_rounds: int
    num_messages: int
    num_zero_copy: int
    staging_bytes: int
    replanned: bool
    bytes_by_transport: Mapping[str, int] | None = None
    """Bytes this process sent and received in this call through each transport kind
    ("local", "shm", "gloo", ...), when the transport counts them."""
    verified: int = 0
    """Regions whose checksums this process compared (``RefitConfig.verify``)."""
    bytes_forwarded: int = 0
    """Bytes this process's destination ranks forwarded to others of their domain
    (``RefitConfig(relay=...)``); ``bytes_sent`` counts only what its sources sent."""
    move_seconds: float = 0.0
    """The executor moving bytes: staging, every round, local copies (0: not measured,
    then rates fall back to ``seconds``)."""
    quantized: Mapping[str, int] | None = None
    """Destinations quantized on the way (FP8, issue 20), None when none is: bytes this
    process sent and received as FP8 items (``fp8_sent``, ``fp8_received``: codes plus
    scales, quantized by their sender, part of ``bytes_sent``/``bytes_received``) and as
    values of blocks split across senders (``bf16_sent``, ``bf16_received``: in the wire
    dtype, quantized by their receiver); and over the whole world ``fp8_world``,
    ``bf16_world`` and ``unquantized_world`` (all of it in the wire dtype); a relayed call
    adds ``fp8_forwarded_world``: the codes and scales replicas forwarded to each other
    (part of ``bytes_forwarded``)."""
    lost: tuple[str, ...] = ()
    """Members of an elastic world lost during this call (``"rollout[1]"``): the survivors
    finished it without them (``RefitConfig.on_member_loss``)."""
    epoch: int = 0
    """The membership epoch the call completed in (``World.epoch``)."""
    tensors_planned: int = 0
    """Tensors this call planned (built their template); 0 when it reused the prepared
    call whole (``replanned`` False)."""
    tensors_reused: int = 0
    """Tensors this call planned again but whose template it reused: after an epoch
    change, those whose source and destination layouts are the same after the ranks'
    renumbering (:mod:`xreshard.planner.renumber`)."""
    delta: Mapping[str, Any] | None = None
    """``RefitConfig(delta=True)``: this process's ``pairs`` (sending pairs that went as
    deltas), ``bytes_dense`` (what its buckets take dense), ``bytes_wire`` (what its
    senders put on the wire, headers included; also ``bytes_sent``), ``num_delta``
    (buckets sent encoded), ``encode_seconds`` (finding and encoding the changes: wall
    time of the encoder, which may start before the move), ``encode_threads`` and
    ``baseline_bytes`` (memory its baselines hold), ``baseline_device_bytes`` (of it, device
    memory: ``Tuning(delta_baseline="device")``). None without delta."""

    @property
    def setup_seconds(self) -> float:
        """Everything but moving: ``seconds - move_seconds``."""
        return max(self.seconds - self.move_seconds, 0.0)

    @property
    def gbps(self) -> float:
        """GB/s through this process (sent + received + forwarded) while moving."""
        moved = self.bytes_sent + self.bytes_received + self.bytes_forwarded
        return moved / max(self.move_seconds or self.seconds, 1e-9) / 1e9

    def __str__(self) -> str:
        from .units import format_bytes as size, format_rate, format_seconds as time
        moved = self.bytes_sent + self.bytes_received + self.bytes_forwarded
        forwarded = f", forwarded {size(self.bytes_forwarded)}" if self.bytes_forwarded else ""
        return (f"refit v{self.version}: sent {size(self.bytes_sent)}, received "
                f"{size(self.bytes_received)}{forwarded} in {time(self.move_seconds)} moving "
                f"({format_rate(moved, self.move_seconds or self.seconds)}); setup "
                f"{time(self.setup_seconds)} ({self._setup_label()} "
                f"{time(self.plan_seconds)}); {self._world_bytes(size)} vs "
                f"{size(self.bytes_gather_broadcast_world)} gather+broadcast"
                + ("; " + ", ".join(f"{k} {size(v)}" for k, v in
                                    sorted(self.bytes_by_transport.items()))
                   if self.bytes_by_transport else ""))

    def _setup_label(self) -> str:
        # a process's first call also imports what its bindings need (torch's DTensor
        # module pulls sympy; a torch process's first bf16/float8 tensor loads ml_dtypes,
        # whose extension registers its dtypes with numpy): 1-5 s on 2 loaded cores
        if self.version == 1:
            return "first call: planning and first-use imports"
        return "planning" if self.replanned else "checks"

    def _world_bytes(self, size: Any) -> str:
        """What the world put on the wire, and the feature that shaped it: FP8 and delta
        calls move fewer bytes than the dense plan (``bytes_moved_world``)."""
        dense = size(self.bytes_moved_world)
        if self.delta is not None:      # the world's wire bytes are not gathered: this process's
            return (f"delta: this process's senders put {size(self.delta.get('bytes_wire', 0))} "
                    f"on the wire for {size(self.delta.get('bytes_dense', 0))} dense "
                    f"(buckets encoded: {self.delta.get('num_delta', 0)}); world planned {dense} "
                    f"dense")
        if self.quantized:
            q = self.quantized      # the quantized tensors' part, as FP8 + split blocks
            wire = (self.bytes_moved_world - q.get("unquantized_world", 0)
                    + q.get("fp8_world", 0) + q.get("bf16_world", 0))
            return f"world moved {size(wire)} (FP8 destinations; {dense} in the wire dtype)"
        return f"world moved {dense}"
