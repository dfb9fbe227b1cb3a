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
registers both classes with vLLM's factories in every vLLM process. This module is the
worker side; the trainer side is :mod:`xreshard.adapters.vllm.trainer`, and both run the
collectives of :class:`~xreshard.adapters.vllm.stream.Stream`.

Worker side, per round, streamed in groups of layers (:class:`Stream`): per group, one
collective :class:`~xreshard.runtime.refit.Refit` into receive buffers shaped like that group's
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
  JSON bytes, never pickle), so every worker describes the same global layouts (product form
  where vLLM's sharding is one, explicit for the padded vocab). Rejected: marking per-rank
  layouts ``local_only`` and letting the refit union them (explicit form only, so the
  planner loses the per-dim intersection), and an extra all-gather over the xreshard world
  (the trainer would need to know about it). The trainer's protocol is "join, then :class:`Stream`".
* Everything happens in ``update_weights``; ``start_weight_update`` and
  ``finish_weight_update`` do nothing.
* The speculative draft is a second target with its own recording, destination, stream
  and version, swapped in by vLLM's ``set_weight_update_target`` (its
  ``start_draft_weight_update`` session) and out by ``reset_weight_update_target``; see
  :mod:`xreshard.adapters.vllm.draft`.
* Streaming: the groups come from the recordings (:meth:`EngineRecording.groups
  <xreshard.adapters.vllm.EngineRecording.groups>`: modules never split, layerwise order, each
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
from dataclasses import dataclass, field
from typing import Any

try:
    import torch
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
except (ImportError, RuntimeError) as e:  # pragma: no cover - depends on the environment
    from .record import vllm_import_error
    raise vllm_import_error(e) from e

from xreshard.errors import RefitError
from xreshard.runtime.binding import Bound
from xreshard.config import RefitConfig, RefitReport
from xreshard.runtime.world import World

from .destination import Destination, EngineRecording
from .draft import (TARGET_STATE, DraftError, draft_problem, draft_verdict, record_draft,
                    share_groups, shared_with_policy)
from . import members
from .lora import LoRAReceiver
from .quantized import online_refusals
from .stream import DEFAULT_WORLD_ID, GROUPS, Placed, Stream

logger = logging.getLogger(__name__)

__all__ = ["XreshardInitInfo", "XreshardUpdateInfo", "XreshardWeightTransferEngine"]

_MODES = ("auto", "reload", "inplace")


@dataclass
class XreshardInitInfo(WeightTransferInitInfo):
    """What every worker gets at ``init_weight_transfer_engine`` (JSON, from the trainer).

    Attributes:
        address: the rendezvous store, ``"tcp://host:port"``.
        num_processes: trainer processes + vLLM workers.
        world_id: the world's id on that store.
        timeout: seconds for joining and for every wait of a refit.
        config: the :class:`~xreshard.runtime.refit.RefitConfig` fields, as the trainer uses them.
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
        draft_specs: as ``specs``, for the speculative draft (default its model
            directory's safetensors headers, else its HF config); see
            :mod:`xreshard.adapters.vllm.draft`.
        elastic: join an elastic world (engines join and leave between updates; see
            :mod:`xreshard.adapters.vllm.members`): ``engine`` is then this engine's id
            (any id >= 0 not live in the world), ``num_engines`` is not checked, and a
            world already running admits this engine at the trainer's next round.
        catch_up: (elastic, a running world) fill this engine from the live engines'
            workers that hold the same regions, at once, without the trainer
            (:meth:`Stream.catch_up <xreshard.adapters.vllm.stream.Stream.catch_up>`); the
            trainer's next round admits it (``add_engine(..., catch_up=True)``).
        serve_catch_up: (elastic) serve engines catching up between rounds
            (``XreshardTrainerInitInfo.catch_up``; in mode ``"reload"`` a kept copy of
            the worker's shard).
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
    draft_specs: dict[str, Any] | None = None
    elastic: bool = False
    catch_up: bool = False
    serve_catch_up: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {_MODES}")
        if self.num_processes < 2:
            raise ValueError(f"num_processes={self.num_processes}: a refit world needs the "
                             "trainer processes and the vLLM workers")
        if self.engine < 0 or (not self.elastic and self.engine >= self.num_engines):
            raise ValueError(f"engine={self.engine} is not in [0, num_engines="
                             f"{self.num_engines})")


@dataclass
class XreshardUpdateInfo(WeightTransferUpdateInfo):
    """Per round: the version this round makes (checked against the worker's own count);
    ``lora`` set: a LoRA round instead (``{"version": n}``; the adapters travel in the
    round's own exchange, see :mod:`xreshard.adapters.vllm.lora`); ``draft``: the trainer
    sends the speculative draft's weights (checked against the session vLLM started:
    ``start_draft_weight_update``, see :mod:`xreshard.adapters.vllm.draft`)."""

    version: int | None = None
    lora: dict[str, Any] | None = None
    draft: bool = False


_NOT_INITIALIZED = ("the xreshard backend is not initialized: call "
                    "init_weight_transfer_engine first")


class XreshardWeightTransferEngine(WeightTransferEngine[XreshardInitInfo, XreshardUpdateInfo]):
    """vLLM worker side of the ``"xreshard"`` backend (see the module docstring)."""

    init_info_cls = XreshardInitInfo
    update_info_cls = XreshardUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.world: World | None = None
        self.stream: Stream | None = None
        self.last_report: RefitReport | None = None
        self.last_error: str | None = None
        self.peak_rss_growth: int | None = None
        self.budget: int | None = None
        self._recording: EngineRecording | None = None
        self._dest: Destination | None = None
        self._specs_key: Any = None
        self._inplace = False
        self._measure = False
        self._init_errors: list[str] = []
        self.lora: LoRAReceiver | None = None    # built on the first LoRA round
        # the speculative draft (see .draft): which target this session loads, the other
        # target's TARGET_STATE while swapped out, why a draft round cannot run
        self.target = "policy"
        self._other: dict[str, Any] | None = None
        self._draft_refusal: str | None = None
        self._draft_cache: tuple[Any, Any] = (None, None)
        self._draft_mode: str | None = None
        self._mode = "auto"
        self._engine = 0        # this engine's id (an elastic world's engines come and go)
        self._placed = 0        # the epoch self._dest was placed at (elastic)

    def init_transfer_engine(self, init_info: XreshardInitInfo) -> None:
        """Record (once per ``specs``), then join the trainer's world as ``rollout[worker]``
        (vLLM's rank order: pipeline stage major, TP rank minor) and place the recording on
        the world's rollout ranks."""
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
        if self._recording is None or key != self._specs_key:
            self._recording = EngineRecording.record_in_engine(self.vllm_config, init_info.specs)
            self._specs_key = key
            if self._recording.unused:
                logger.info("xreshard: no rank loads %s; the trainer must not send them",
                            self._recording.unused)
        recording = self._recording
        if recording.online is not None and online_refusals(self.model):
            # FP8 kernels that post-process the quantized weights: vLLM quantizes bf16 itself
            logger.info("xreshard: online FP8 layers receive bf16: %s",
                        online_refusals(self.model)[0])
            recording = recording.without_online()
        draft, problem = self._record_draft(init_info)
        self._mode = init_info.mode
        mode = self._choose_mode(recording, init_info.mode)
        self._inplace = mode == "inplace"
        device = "cpu" if self.device.type == "cpu" else self.device
        workers = recording.rec.num_workers
        if init_info.engine_world_size not in (None, workers):
            raise RefitError(f"engine {init_info.engine} has {workers} workers (pp x tp) but the "
                             f"trainer expects engine_world_size={init_info.engine_world_size}; "
                             "refit engines together only when they share one parallel config")
        self.world = World.join(init_info.address, "rollout", [device],
                                num_processes=init_info.num_processes,
                                index=init_info.engine * workers + recording.worker,
                                groups=GROUPS, timeout=init_info.timeout,
                                world_id=init_info.world_id, elastic=init_info.elastic,
                                wait=not init_info.catch_up,
                                unit=members.unit(init_info.engine) if init_info.elastic
                                else None)
        if init_info.elastic:
            self._join_fleet(init_info, recording, mode)
            return
        ranks = self.world.group_ranks("rollout")
        if len(ranks) != init_info.num_engines * workers:
            self.shutdown()
            raise RefitError(f"the world has {len(ranks)} rollout processes but "
                             f"{init_info.num_engines} engine(s) of {workers} workers (pp x tp) "
                             "each; pass num_processes = trainer processes + all engines' "
                             "workers, and give every engine the same parallel config")
        dest = self._dest = Destination.place(recording, ranks, init_info.engine)
        config = dict(init_info.config)
        config.setdefault("timeout", init_info.timeout)
        refit_config = RefitConfig(**config)
        self.budget = init_info.stream_bytes or refit_config.staging_bytes
        self._measure = init_info.measure_memory
        self.stream = Stream(self.world, "receive", config=refit_config)
        self.stream.set_groups(recording.offered_groups(self.budget))
        self._place_draft(init_info, draft, problem, ranks, refit_config)
        logger.info("xreshard: worker %d (pp %d, tp %d) joined %r as world rank %d (%s, %d "
                    "shard bytes in %d group(s) of at most %d bytes)", dest.rec.worker,
                    dest.rec.pp_rank, dest.rec.tp_rank, self.world, dest.rank, mode,
                    dest.shard_bytes(), len(self.stream.groups), self.budget)

    def _join_fleet(self, init_info: XreshardInitInfo, recording: EngineRecording,
                    mode: str) -> None:
        """The rest of ``init_transfer_engine`` in an elastic world: the stream (whose
        epoch setup places the destination on the world's live engines, and refuses an
        engine recording another model: then this engine leaves), no draft rounds."""
        config = dict(init_info.config)
        config.setdefault("timeout", init_info.timeout)
        self.budget = init_info.stream_bytes or config.get("staging_bytes") or \
            RefitConfig.staging_bytes
        self._measure = init_info.measure_memory
        self._engine = init_info.engine
        info = {"engine": init_info.engine, "worker": recording.worker,
                "workers": recording.rec.num_workers, "model": members.model_digest(recording)}
        try:
            self.stream = Stream(self._joined(), "receive", config=RefitConfig(**config),
                                 engine_info=info, on_epoch=self._place,
                                 serve=self._served if init_info.serve_catch_up else None)
            self.stream.set_groups(recording.offered_groups(self.budget))
            if init_info.catch_up:
                self._place()
                self.last_report = members.catch_up(self)
        except BaseException:
            self.shutdown()     # World.leave: the members go on without this engine
            raise
        self._other, self.target, self._draft_mode = None, "policy", None
        self._draft_refusal = ("the speculative draft is not refit in an elastic world "
                               "(not built yet)")
        logger.info("xreshard: engine %d worker %d joined %r at epoch %d as world rank %d "
                    "(%s, version %d)", init_info.engine, recording.worker, self.world,
                    self._joined().epoch, self._destination().rank, mode, self.stream.version)

    def _place(self) -> None:
        """Place this worker's destination on the live engines of the world's epoch
        (ranks are renumbered per epoch; this engine's position among the live ones)."""
        recording, world = self._recorded(), self._joined()
        workers = recording.rec.num_workers
        live = sorted({int(p["index"]) // workers for p in world.processes
                       if p["group"] == "rollout"})
        self._dest = Destination.place(recording, world.group_ranks("rollout"),
                                       live.index(self._engine))
        self._placed = world.epoch

    def _served(self, g: int, names: list[str], received: Bound) -> Bound:
        """What this worker serves engines catching up between rounds (members.served)."""
        return members.served(self, g, received)

    # the state init_weight_transfer_engine sets (shutdown clears the world again)
    def _joined(self) -> World:
        if self.world is None:
            raise RefitError(_NOT_INITIALIZED)
        return self.world

    def _destination(self) -> Destination:
        if self._dest is None:
            raise RefitError(_NOT_INITIALIZED)
        return self._dest

    def _recorded(self) -> EngineRecording:
        if self._recording is None:
            raise RefitError(_NOT_INITIALIZED)
        return self._recording

    def _choose_mode(self, recording: EngineRecording, mode: str) -> str:
        """``"inplace"`` or ``"reload"`` for the requested ``mode``. A refused
        ``"inplace"`` becomes an error of every round (:attr:`_init_errors`), refused
        through the refit's error gather on every rank: raising here on one worker would
        leave the trainer waiting for it to join."""
        self._init_errors = []
        refusals = recording.inplace_refusals(self.model, self.device.type) \
            if mode != "reload" else []
        if mode == "auto":
            mode = "inplace" if self.device.type == "cuda" and not refusals else "reload"
            if self.device.type == "cuda" and refusals:
                logger.info("xreshard: reloading through vLLM, not writing in place: %s "
                            "(%d more)", refusals[0], len(refusals) - 1)
        elif mode == "inplace" and refusals:
            self._init_errors.append(
                f"mode 'inplace' refused on worker {recording.worker}: "
                + "; ".join(refusals[:5]) + (f"; and {len(refusals) - 5} more" if
                                             len(refusals) > 5 else "")
                + " - use mode 'reload' (or 'auto')")
        return mode

    # ------------------------------------------------------------ the speculative draft

    def _record_draft(self, init_info: XreshardInitInfo) -> tuple[EngineRecording | None,
                                                                   str | None]:
        """(the draft's recording, None) or (None, why there is no draft to refit). Records
        once per ``draft_specs``; collective over the engine's workers, as the policy's."""
        problem = draft_problem(self.vllm_config)
        if problem is not None:
            return None, problem
        key = repr(sorted((init_info.draft_specs or {}).items()))
        if self._draft_cache[0] != key:
            self._draft_cache = (key, record_draft(self.vllm_config, init_info.draft_specs))
        return self._draft_cache[1], None

    def _place_draft(self, init_info: XreshardInitInfo, draft: EngineRecording | None,
                     problem: str | None, ranks: Any, config: RefitConfig) -> None:
        """Collective with every process (the trainer's ``trainer_init``): every process's
        word on the draft, then, where every engine has one and the trainer can start a
        draft session, the draft's destination and its own stream."""
        everyone = self._joined().allgather_json(
            {"engine": init_info.engine, "problem": problem}, kind="xreshard-vllm/draft",
            timeout=init_info.timeout)
        self._draft_refusal = draft_verdict(everyone, init_info.num_engines)
        self._other, self.target, self._draft_mode = None, "policy", None
        if self._draft_refusal is not None:
            return
        # no refusal: every engine recorded its draft (problem None); init set the budget
        assert draft is not None and self.budget is not None
        stream = Stream(self._joined(), "receive", config=config)
        stream.set_groups(draft.offered_groups(self.budget))
        share_groups(stream, init_info.timeout)
        self._other = {"_recording": draft, "_dest": Destination.place(draft, ranks,
                                                                      init_info.engine),
                       "stream": stream, "_inplace": False, "_init_errors": [],
                       "last_report": None, "last_error": None, "peak_rss_growth": None}
        logger.info("xreshard: the draft streams %d shard bytes in %d group(s) to this worker",
                    self._other["_dest"].shard_bytes(), len(stream.groups))

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        """vLLM's ``start_draft_weight_update``: this session loads ``model`` (the draft),
        with the draft's recording, destination and stream."""
        super().set_weight_update_target(model, model_config)
        if model is not self._default_model and self.target == "policy":
            self._swap_target()
            if self._other is not None and self._draft_mode is None:
                # the live draft is known only now: decide in place or reload for it
                self._draft_mode = self._choose_mode(self._recorded(), self._mode)
                self._inplace = self._draft_mode == "inplace"
                shared = shared_with_policy(model, self._default_model,
                                            self._recorded().touched())
                if shared:
                    self._init_errors.append(shared)

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self.target == "draft":
            self._swap_target()

    def _swap_target(self) -> None:
        """Exchange the per-target state (:data:`~.draft.TARGET_STATE`) with the other
        target's; without a draft to refit only the label changes (its rounds refuse)."""
        self.target = "draft" if self.target == "policy" else "policy"
        if self._other is None:
            return
        mine = {k: getattr(self, k) for k in TARGET_STATE}
        for k in TARGET_STATE:
            setattr(self, k, self._other[k])
        self._other = mine

    def _target_errors(self, info: XreshardUpdateInfo) -> list[str]:
        """Why this round must not load into the session's target (refused on every rank)."""
        if info.draft != (self.target == "draft"):
            return [f"the trainer sends the {'draft' if info.draft else 'policy'}'s weights "
                    f"but vLLM's update session loads the {self.target} (start_weight_update "
                    "for the policy, start_draft_weight_update for the draft)"]
        return []

    def start_weight_update(self) -> None:
        """Nothing: the round is received and loaded in ``update_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing: ``update_weights`` loaded the round after every rank committed it."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        if self.target == "draft" and self._other is None:
            # the trainer refuses such a round itself (same verdict), so no rank waits here
            raise DraftError(f"no draft round: {self._draft_refusal or 'not initialized'}")
        if info.lora is not None:
            if self.stream is None or self._dest is None:
                raise RefitError(_NOT_INITIALIZED)
            self.lora = self.lora or LoRAReceiver(self)
            self.lora.receive(info.lora)
        else:
            self.receive_weights(info)
        if self.device.type != "cpu":   # torch.accelerator.synchronize raises without one
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: XreshardUpdateInfo) -> None:
        """One streamed round: per group of layers, a collective refit into receive buffers
        for that group only (in place: views of the live parameters), then vLLM loads them;
        so the extra memory stays within the budget, not the whole shard."""
        if self.stream is None or self._dest is None:
            raise RefitError(_NOT_INITIALIZED)
        dest, stream = self._dest, self.stream
        errors = list(self._init_errors) + self._target_errors(update_info)
        if update_info.version is not None and update_info.version != stream.version + 1 \
                and self._joined().admitted:    # caught up: it takes the members' version
            errors.append(f"the trainer sends version {update_info.version} but this worker "
                          f"holds version {stream.version}; a round was missed")
        held: dict[int, Any] = {}
        if self._inplace:
            # views of the live parameters cost nothing: bind every group now, so a binding
            # error (GPU only: DLPack, strides) refuses the round before anything is written
            for g, names in enumerate(stream.groups):
                held[g] = self._bind_group(names, errors)

        def part(g: int, names: list[str], errs: list[str]) -> Any:
            if g not in held:
                held[g] = self._bind_group(names, errs)
            buffers, bound = held[g]
            bound.errors = errs + bound.errors
            elastic = self._joined().elastic
            return self._placed_side(buffers, bound, names) if elastic else bound

        def done(g: int, names: list[str]) -> None:
            buffers, _ = held.pop(g)
            self._destination().load(self.model, self.model_config, buffers, self._inplace,
                                     dest.with_scales(names))
            if not self._inplace:
                del buffers
                _trim_heap()

        rss0 = _reset_peak_rss() if self._measure else None
        try:
            scales = dest.recording.scale_names()      # quantized on the way, never offered
            report = stream.run({n: dest.shapes[n] for n in dest.names if n not in scales},
                                errors, part, done)
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

    def _placed_side(self, buffers: Any, bound: Bound, names: list[str]) -> Placed:
        """An elastic world's receive side of one group: ``bound``, or the same buffers
        bound again where the world moved to another epoch since the destination was
        placed (a member lost during the call or after the last round: the ranks are
        renumbered and the lost engine's axis is gone)."""
        def rebind(world: Any) -> Bound:
            if self._placed != world.epoch:
                self._place()
            dest = self._destination()      # (placed again at the new epoch)
            errors = list(bound.errors)
            try:
                return dest.bind(buffers, errors, dest.with_scales(names))
            except Exception as e:  # noqa: BLE001 - reported to every rank
                errors.append(f"worker {dest.rec.worker} could not bind its receive "
                              f"buffers again at epoch {world.epoch}: {type(e).__name__}: {e}")
                return Bound({n: dest.layouts[n] for n in bound.layouts}, {},
                             errors=errors)
        return Placed(bound, self._placed, rebind)

    def _bind_group(self, names: list[str], errors: list[str]) -> tuple[Any, Bound]:
        """(buffers, receive side) of one group; any failure becomes an error of the refit,
        raised on every rank by its error gather, never here on this rank alone."""
        dest = self._dest
        if dest is None:
            raise RefitError(_NOT_INITIALIZED)
        names = dest.with_scales(names)
        try:
            buffers = dest.buffers(self.model, self._inplace, self.device, names)
            return buffers, dest.bind(buffers, [], names)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            errors.append(f"worker {dest.rec.worker} could not bind its receive buffers: "
                          f"{type(e).__name__}: {e}")
            return {}, Bound({n: dest.layouts[n] for n in names}, {})

    def report(self, target: str | None = None) -> dict[str, Any]:
        """The last round of ``target`` (``"policy"``, ``"draft"``; default the session's)
        as seen by this worker (JSON)."""
        if target not in (None, self.target):
            if target not in ("policy", "draft"):
                raise ValueError(f"target {target!r} is not 'policy' or 'draft'")
            if self._other is None:
                return {"target": target, "version": 0, "last_error": self._draft_refusal}
            self._swap_target()
            try:
                return self.report()
            finally:
                self._swap_target()
        r, rec = self.last_report, self._dest
        return {"target": self.target,
                "tp_rank": rec.rec.tp_rank if rec else None,
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
            # an elastic world's members go on without this worker (World.leave)
            self.world.leave() if getattr(self.world, "elastic", False) else self.world.close()
        # committed adapters stay served (they live with vLLM's LoRA manager); a new world
        # gets a new LoRA receiver
        if self.target == "draft":
            self._swap_target()
        self.world = self.stream = self.lora = self._other = None



# ---------------------------------------------------------------------------- memory

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
