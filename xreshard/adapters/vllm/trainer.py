"""The trainer side of the ``"xreshard"`` weight-transfer backend.

Every trainer process builds :class:`XreshardTrainerWeightTransferEngine` with
:meth:`~XreshardTrainerWeightTransferEngine.trainer_init` and calls
:meth:`~XreshardTrainerWeightTransferEngine.send_weights` each round; rank 0 also drives the
engines' control plane (vLLM's ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``) through one client per engine
(:class:`LLMClient` for an in-process ``vllm.LLM``, or vLLM's HTTP and Ray clients), while its
:class:`WeightSender` runs this process's side of the streamed refits. See the decision
record in :mod:`xreshard.adapters.vllm.worker`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Sequence

try:
    import torch
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
except (ImportError, RuntimeError) as e:  # pragma: no cover - depends on the environment
    from .record import vllm_import_error
    raise vllm_import_error(e) from e

from xreshard.config import RefitConfig, RefitReport
from xreshard.errors import RefitError
from xreshard.runtime.world import World, serve

from .control import Watch, concurrently as _concurrently
from .draft import DraftError, client_problem, draft_verdict, share_groups
from .plugin import BACKEND
from .sender import LLMClient, WeightSender
from .stream import DEFAULT_WORLD_ID, GROUPS

logger = logging.getLogger(__name__)

__all__ = ["XreshardTrainerInitInfo", "XreshardTrainerWeightTransferEngine", "WeightSender",
           "LLMClient"]


def _default_devices() -> Any:
    jax = sys.modules.get("jax")
    if jax is not None:
        return jax.local_devices()
    if torch.cuda.is_available():
        return [f"cuda:{torch.cuda.current_device()}"]
    return 1


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
        wire_dtype, bucket_bytes, staging_bytes: :class:`~xreshard.runtime.refit.RefitConfig`
            fields (``wire_dtype="bfloat16"`` for an fp32 trainer and a bf16 engine).
        mode, specs, stream_bytes, measure_memory: passed to the workers (see
            :class:`XreshardInitInfo`).
        rules, rule_params, names, transpose: how trainer arrays become HF tensors
            (see :class:`WeightSender`).
        devices: this process's devices (default ``jax.local_devices()`` when JAX is
            loaded, else this process's CUDA device or one CPU rank).
        draft_specs, draft_rules, draft_rule_params: as ``specs`` / ``rules`` /
            ``rule_params``, for the engine's speculative draft
            (:meth:`XreshardTrainerWeightTransferEngine.send_draft_weights`); None: the
            draft's checkpoint headers, the policy's rules and sizes.
        elastic: engines may join and leave between updates
            (:meth:`XreshardTrainerWeightTransferEngine.add_engine`, ``remove_engine``;
            an engine that crashes is dropped, during an update: ``on_member_loss``;
            between updates: at the next one): the world is elastic
            (``World.join(elastic=True)``, :mod:`xreshard.adapters.vllm.members`); give it
            a ``world_id`` of its own on a shared store. No draft or LoRA rounds there yet.
        catch_up: (elastic) engines added with ``add_engine(client, catch_up=True)`` are
            filled from the live engines' workers instead of the trainer, so every live
            worker serves its shard between updates: the live parameters in mode
            ``"inplace"`` (no memory), else a kept copy of what it last received (memory:
            the worker's shard once more, on its receive buffers' device). Off by default.
        on_member_loss: (elastic) an engine lost in the middle of an update: "continue"
            (the default) finishes the update on the live engines, exact, with its
            version, names the lost (``RefitReport.lost``, ``lost_engines``) and drives
            them no more; "fail" fails it on every process with one
            :class:`~xreshard.adapters.vllm.members.EngineLost`. Either way the world moves
            on without it (:mod:`xreshard.adapters.vllm.control`).
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
    draft_specs: dict[str, Any] | None = None
    draft_rules: Sequence[Any] | None = None
    draft_rule_params: Mapping[str, int] | None = None
    elastic: bool = False
    catch_up: bool = False
    on_member_loss: str = RefitConfig.on_member_loss

    def refit_config(self) -> RefitConfig:
        return RefitConfig(bucket_bytes=self.bucket_bytes, staging_bytes=self.staging_bytes,
                           timeout=self.timeout, wire_dtype=self.wire_dtype,
                           on_member_loss=self.on_member_loss)


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
        self.rank = 0       # TrainerInitInfo.rank (vLLM 0.33's engines keep it as .rank)
        self.clients: list[Any] = [] if not is_sender else \
            list(client) if isinstance(client, (list, tuple)) else [client]
        self.world: World | None = None
        self.sender: WeightSender | None = None
        self.timeout = 300.0
        self._server: Any = None
        self._lora: Any = None      # LoRASender, built on the first send_loras
        self.draft_sender: WeightSender | None = None   # see send_draft_weights
        self._draft_refusal: str | None = "trainer_init did not complete"
        self.elastic = False
        self.engine_ids: list[int] = []     # rank 0: the engine id of each client
        self._adding: list[tuple[int, Any]] = []    # (id, client) joining at the next round
        self._caught: set[int] = set()      # of those, initialized and caught up already
        self._worker_info: dict[str, Any] = {}
        self._engine_world_size = 1
        #: rank 0: the engines the last update lost (they are driven no more)
        self.lost_engines: list[int] = []

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
            source: default weights for ``send_weights()`` without an argument: vLLM's
                standard trainer input, a ``WeightSource`` (``ModuleSource(model)``, or any
                source with ``metadata`` and ``iter_local`` / iteration: read shard to
                shard, never gathered; see :mod:`xreshard.adapters.vllm.source`), or a
                torch module or state dict whose tensors are updated in place.
        """
        info = init_info
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.rank = info.rank
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
            address = engine.serve_store(info.host, info.advertise_host, info.timeout)
        config = info.refit_config()
        worker_info: dict[str, Any]         # what every worker's init is given
        worker_info = {"address": address,
                       "num_processes": info.num_trainer_processes
                       + info.num_engines * info.engine_world_size,
                       "world_id": info.world_id, "timeout": info.timeout,
                       "config": config.to_dict(), "mode": info.mode, "specs": info.specs,
                       "num_engines": info.num_engines,
                       "engine_world_size": info.engine_world_size,
                       "stream_bytes": info.stream_bytes,
                       "measure_memory": info.measure_memory, "draft_specs": info.draft_specs,
                       "elastic": info.elastic, "serve_catch_up": info.catch_up}
        engine.elastic, engine._worker_info = info.elastic, worker_info
        engine._engine_world_size = info.engine_world_size
        engine.engine_ids = list(range(len(engine.clients)))
        devices = _default_devices() if info.devices is None else info.devices

        def join() -> tuple[World, WeightSender]:
            world = World.join(address, "trainer", devices,
                               num_processes=worker_info["num_processes"], index=info.rank,
                               groups=GROUPS, timeout=info.timeout, world_id=info.world_id,
                               elastic=info.elastic)
            engine.world = world
            # collective with the workers' init (their side of the stream)
            sender = WeightSender(world, rules=info.rules, rule_params=info.rule_params,
                                  names=info.names, transpose=info.transpose, config=config)
            engine._join_draft(info, config)
            return world, sender

        calls = [functools.partial(c.init_weight_transfer_engine, {**worker_info, "engine": e})
                 for e, c in enumerate(engine.clients)]
        try:
            engine.world, engine.sender = _concurrently(calls, join, info.timeout,
                                                        "init_weight_transfer_engine")
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _join_draft(self, info: XreshardTrainerInitInfo, config: RefitConfig) -> None:
        """Collective with the workers' init (``_place_draft``): every process's word on the
        draft; where a draft round can run, the draft's own sender (and stream)."""
        if info.elastic:    # the workers skip it too (XreshardWeightTransferEngine._join_fleet)
            self._draft_refusal = "the speculative draft is not refit in an elastic world " \
                "(not built yet)"
            return
        mine = {"client": client_problem(self.clients)} if info.is_sender else {}
        everyone = self._joined().allgather_json(mine, kind="xreshard-vllm/draft",
                                                 timeout=info.timeout)
        self._draft_refusal = draft_verdict(everyone, info.num_engines)
        if self._draft_refusal is None:
            self.draft_sender = WeightSender(
                self._joined(), rules=info.draft_rules if info.draft_rules is not None else
                info.rules, rule_params=info.draft_rule_params or info.rule_params,
                names=info.names, transpose=info.transpose, config=config, subset=True)
            share_groups(self.draft_sender.stream, info.timeout)

    def _joined(self) -> World:
        """The refit world; raises when ``trainer_init`` did not join one (or after shutdown)."""
        if self.world is None:
            raise RefitError("trainer_init did not complete (or the engine was shut down): "
                             "this trainer is in no refit world")
        return self.world

    def serve_store(self, host: str, advertise_host: str | None, timeout: float) -> str:
        """Serve the world's rendezvous store on a free port of ``host`` (closed by
        :meth:`shutdown`); returns the address the workers reach it at (through
        ``advertise_host`` when given)."""
        self._server = serve(host, 0, timeout=timeout)
        if advertise_host:
            return f"tcp://{advertise_host}:{self._server.port}"
        return self._server.address

    def send_weights(self, weights: Any = None) -> RefitReport:
        """One round: rank 0 starts, updates (while every trainer process sends its shards)
        and finishes the engine's update. Collective over the trainer processes.

        Args:
            weights: this round's weights (a JAX pytree, a torch state dict or module, a
                vLLM ``WeightSource``, or a :class:`~xreshard.runtime.refit.Bound`);
                default the ``source`` of ``trainer_init``.

        Returns:
            This process's :class:`~xreshard.runtime.refit.RefitReport`.
        """
        if self.sender is None:
            raise RefitError("trainer_init did not complete; nothing to send through")
        weights = self.source if weights is None else weights
        if weights is None:
            raise RefitError("send_weights needs the weights (or a source at trainer_init)")
        return self._round(self.sender, weights, draft=False)

    def send_draft_weights(self, weights: Any) -> RefitReport:
        """One round into the engines' speculative draft (a draft model, EAGLE or MTP head):
        rank 0 starts it with vLLM's ``start_draft_weight_update()``, so the workers load
        the draft, then updates and finishes as :meth:`send_weights` does. Collective over
        the trainer processes; call it after the policy's round, in the same pause.

        Args:
            weights: the draft's weights, in any form :meth:`send_weights` takes (named
                by ``draft_rules`` / ``draft_specs`` of the init info where given).

        Returns:
            This process's report; ``version`` counts the draft's rounds. The engine's
            weight version stays the policy's (``finish_weight_update`` gets none).

        Raises:
            DraftError: an engine has no draft to refit (no speculative decoding, a method
                without draft weights, pipeline parallelism) or a client cannot start a
                draft session: the same message on every trainer process, before any
                engine is asked. See :mod:`xreshard.adapters.vllm.draft`.
        """
        if self.draft_sender is None:
            raise DraftError(f"cannot refit the draft: {self._draft_refusal}")
        if weights is None:
            raise RefitError("send_draft_weights needs the draft's weights")
        return self._round(self.draft_sender, weights, draft=True)

    def _round(self, sender: WeightSender, weights: Any, *, draft: bool) -> RefitReport:
        """Rank 0: start the session (the draft's or the policy's), update every engine
        while this process sends, finish; the policy's rounds set the weight version."""
        version = sender.version + 1
        adding, failed, joined, crashed = self._before_round(sender) if self.elastic \
            else ([], {}, [], [])
        unreachable = crashed + self._each_client(
            lambda c: c.start_draft_weight_update() if draft else c.start_weight_update())
        if unreachable and sender.stream.engine_info:   # the round's sync expects them no more
            sender.stream.engine_info["expect"] = self.engine_ids + [e for e, _ in adding]
        info = {"version": version, "draft": True} if draft else {"version": version}
        calls = [functools.partial(c.update_weights, info) for c in self.clients]
        calls += [functools.partial(self._join_engine, e, c, info, failed, joined)
                  for e, c in adding]
        # the engines as the world holds them now: those it loses during the round are
        # neither waited for nor driven further (see .control)
        watch = Watch(self.world, self.engine_ids + [e for e, _ in adding]) \
            if self.elastic else None

        def work() -> RefitReport:
            if adding:      # into the round's membership sync only once they asked in
                self._await_joins([e for e, _ in adding], failed)
            return sender.send_weights(weights)

        try:
            report = _concurrently(calls, work, self.timeout, "update_weights",
                                   watch.lost if watch is not None else None)
        except BaseException:
            self._admit(adding, joined)
            self._drop_lost(watch, None, unreachable)
            # close the update session on the workers that did not raise (see
            # XreshardWeightTransferEngine.receive_weights), without a new version
            for c in self.clients:
                try:
                    c.finish_weight_update(None)
                except Exception:  # noqa: BLE001 - the rank that raised has no session
                    pass
            raise
        self._admit(adding, joined)
        report = self._drop_lost(watch, report, unreachable)
        late = self._each_client(lambda c: c.finish_weight_update(None if draft else str(version)))
        if late:
            self.lost_engines += late
            if watch is not None and report is not None:
                report = dataclasses.replace(report, lost=tuple(dict.fromkeys(
                    [*report.lost, *watch.labels(late)])))
        return report

    def _each_client(self, call: Any) -> list[int]:
        """``call(client)`` for every engine rank 0 drives, in order. In an elastic world an
        engine whose actor is unreachable (Ray's ``RayActorError``: ``ActorDiedError``, or
        ``ActorUnavailableError`` while Ray restarts it) is lost, as a member the world
        lost: it is driven no more, and the round's sync goes on without its workers (gone,
        or excluded at the timeout: nobody drives them into the round). Returns those
        engines; any other failure, or a fixed world, raises."""
        dropped = []
        for e, c in list(zip(self.engine_ids, self.clients)):
            try:
                call(c)
            except Exception as err:
                if not (self.elastic and _unreachable(err)):
                    raise
                logger.warning("xreshard: engine %d unreachable (%s: %s); going on without it",
                               e, type(err).__name__, err)
                i = self.engine_ids.index(e)
                del self.clients[i], self.engine_ids[i]
                dropped.append(e)
        return dropped

    def _drop_lost(self, watch: Watch | None, report: RefitReport | None = None,
                   unreachable: Sequence[int] = ()) -> Any:
        """After an update of an elastic world: stop driving the engines it lost
        (:class:`.control.Watch`), remember them and those found ``unreachable`` at its
        start (:attr:`lost_engines`), and name their workers in ``report.lost``; returns
        the report."""
        if watch is None:
            return report
        lost = [*unreachable, *watch.lost_engines()]
        self.lost_engines = lost
        for e in lost:
            if e in self.engine_ids:
                i = self.engine_ids.index(e)
                del self.clients[i], self.engine_ids[i]
        if lost:
            logger.warning("xreshard: engine(s) %s lost during the update; driving %s from "
                           "now on", lost, self.engine_ids)
        if report is None or not lost:
            return report
        labels = tuple(dict.fromkeys([*report.lost, *watch.labels(lost)]))
        return dataclasses.replace(report, lost=labels)

    # ------------------------------------------------------------ engines that come and go

    def add_engine(self, client: Any, engine: int | None = None, *,
                   catch_up: bool = False) -> int:
        """Rank 0, between updates (elastic only): refit one more engine from the next
        update on. Its ``init_weight_transfer_engine`` runs at the start of that update,
        its workers join the running world there and receive the current weights with the
        others (from the trainer). Returns its engine id.

        Args:
            client: the new engine's control plane (as for ``trainer_init``).
            engine: its id (default: the lowest not in use); a restarted engine may take its
                old id back.
            catch_up: initialize it now instead, filled with the live engines' current
                weights from their workers (the trainer sends nothing; see
                :mod:`.members`), so it serves before the next update, which admits it.

        Raises:
            RefitError: the world is not elastic, or ``engine`` is in use; with
                ``catch_up``, the engine's init or catch-up failed (it is not added).
        """
        self._need_elastic("add_engine")
        if catch_up and not self._worker_info.get("serve_catch_up"):
            raise RefitError("add_engine(catch_up=True): the live engines do not serve "
                             "catch-ups; pass XreshardTrainerInitInfo(elastic=True, "
                             "catch_up=True) (memory: see its docs)")
        used = set(self.engine_ids) | {e for e, _ in self._adding}
        if engine is None:
            engine = min(set(range(len(used) + 1)) - used)
        if engine in used or engine < 0:
            raise RefitError(f"engine id {engine} is in use (live: {self.engine_ids}, "
                             f"added: {[e for e, _ in self._adding]}); pick another id")
        if catch_up:
            client.init_weight_transfer_engine({**self._worker_info, "engine": engine,
                                                "catch_up": True})
            self._caught.add(engine)
        self._adding.append((engine, client))
        return engine

    def remove_engine(self, engine: int) -> None:
        """Rank 0, between updates (elastic only): shut the engine's backend down (vLLM's
        ``shutdown_weight_transfer_engine``: its workers leave the world, the engine keeps
        serving its weights) and stop driving it; the next update goes on without it."""
        self._need_elastic("remove_engine")
        if engine not in self.engine_ids:
            raise RefitError(f"no live engine {engine} (live: {self.engine_ids})")
        i = self.engine_ids.index(engine)
        client = self.clients.pop(i)
        self.engine_ids.pop(i)
        client.shutdown_weight_transfer_engine()

    def _need_elastic(self, what: str) -> None:
        if not self.elastic:
            raise RefitError(f"{what}: this trainer's world has a fixed set of engines; "
                             "pass XreshardTrainerInitInfo(elastic=True) to let engines come "
                             "and go between updates")
        if not self.is_sender:
            raise RefitError(f"{what}: only the trainer's rank 0 drives the engines")

    def _before_round(self, sender: WeightSender) -> tuple[list, dict, list, list[int]]:
        """Rank 0 of an elastic world: drop the engines whose processes are gone (crashed;
        returned last, lost like the unreachable), take the engines added since the last
        round, and say which engines it drives (the round's membership sync refuses any
        other, see :mod:`.members`)."""
        from xreshard.runtime.epochs import gone

        if not self.is_sender:
            return [], {}, [], []
        world, per = self._joined(), self._engine_world_size
        leaving = [r for r in world.pending() if r["kind"] == "leave"]
        crashed = []
        for e in list(self.engine_ids):
            procs = [p for p in world.processes
                     if p["group"] == "rollout" and int(p["index"]) // per == e]
            if procs and all(gone(p, leaving) for p in procs):
                i = self.engine_ids.index(e)
                del self.clients[i], self.engine_ids[i]
                crashed.append(e)
        adding, self._adding = self._adding, []
        failed: dict[str, str] = {}
        sender.stream.engine_info = {"expect": self.engine_ids + [e for e, _ in adding],
                                     "workers": per, "failed": failed}
        return adding, failed, [], crashed

    def _join_engine(self, engine: int, client: Any, info: dict[str, Any],
                     failed: dict[str, str], joined: list[int]) -> None:
        """A new engine's part of the round: join (admitted by the round's sync), then
        update like the others."""
        try:
            if engine not in self._caught:      # else initialized (caught up) already
                client.init_weight_transfer_engine({**self._worker_info, "engine": engine})
            self._caught.discard(engine)
        except BaseException as e:
            failed[str(engine)] = f"{type(e).__name__}: {e}"
            raise
        joined.append(engine)
        client.start_weight_update()
        client.update_weights(info)

    def _await_joins(self, engines: list[int], failed: dict[str, str]) -> None:
        """Until every worker of ``engines`` asked to join (or its init failed), at most
        half the timeout: the other members wait for this process in the sync meanwhile."""
        per = self._engine_world_size
        deadline = time.monotonic() + self.timeout / 2
        while time.monotonic() < deadline:
            asked: dict[int, int] = {}
            for r in self._joined().pending():
                if r["kind"] == "join" and r["info"].get("group") == "rollout":
                    e = int(r["info"]["index"]) // per
                    asked[e] = asked.get(e, 0) + 1
            if all(str(e) in failed or asked.get(e, 0) >= per for e in engines):
                return
            time.sleep(0.05)

    def _admit(self, adding: list[tuple[int, Any]], joined: list[int]) -> None:
        """The added engines whose init succeeded are driven from now on."""
        for e, c in adding:
            if e in joined:
                self.engine_ids.append(e)
                self.clients.append(c)

    def send_loras(self, adapters: Sequence[Any], *, bound: Any = None) -> RefitReport:
        """One LoRA round: this process's part of ``adapters``
        (:class:`~xreshard.adapters.lora.LoRAAdapter`, one per slot) into every engine's
        LoRA slots, in memory, each TP rank receiving exactly what its LoRA layers read.
        Collective over the trainer processes (a process holding none passes ``[]``); rank
        0 drives the engines. Serve them with
        :func:`~xreshard.adapters.vllm.lora.lora_request`. See
        :mod:`xreshard.adapters.vllm.lora`.

        Args:
            adapters: this process's adapters.
            bound: their factors already bound (``LoRASender.send``: views of the shards
                of factors that are not 2-D, e.g. Tunix's ``[r, N, H]``); default the
                adapters' own arrays.

        Raises:
            LoRAError: an adapter does not fit an engine (target modules, rank, shapes), on
                every process before any byte moves; the engines keep serving what they
                served.
        """
        from xreshard.adapters.lora import LoRAError

        from .lora_send import LoRASender

        if self.elastic:
            raise RefitError("LoRA rounds in an elastic world are not built yet; refit LoRA "
                             "adapters over a fixed world (elastic=False)")
        if self.sender is None:
            raise RefitError("trainer_init did not complete; nothing to send through")
        if self._lora is None:
            self._lora = LoRASender(self._joined(), self.sender.stream.config,
                                    self.sender.stream.jax_ranks)
        lora = self._lora
        for c in self.clients:
            c.start_weight_update()
        calls = [functools.partial(c.update_weights, {"lora": {"version": lora.version + 1}})
                 for c in self.clients]
        try:
            report = _concurrently(calls, lambda: lora.send(list(adapters), bound), self.timeout,
                                   "update_weights")
        except BaseException as e:
            for c in self.clients:      # as send_weights: close the sessions still open
                try:
                    c.finish_weight_update(None)
                except Exception:  # noqa: BLE001
                    pass
            if isinstance(e.__cause__, LoRAError) and not isinstance(e, LoRAError):
                raise e.__cause__ from None     # the same error as every other process
            raise
        for c in self.clients:
            c.finish_weight_update(None)        # the base weights' version is unchanged
        return report

    def shutdown(self) -> None:
        """Close the world and the store, after the engines' workers left the world: a
        store closed under their clients made each print C++ stack traces at exit."""
        for client in self.clients if self.world is not None else ():
            try:
                client.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - an engine gone already has let go
                logger.debug("engine shutdown_weight_transfer_engine failed", exc_info=True)
        if self.world is not None:
            self.world.close()
            self.world = None
        if self._server is not None:
            self._server.close()
            self._server = None


def _unreachable(err: BaseException) -> bool:
    """Whether ``err`` says an engine's actor is dead or restarting (Ray's
    ``RayActorError`` and its subclasses), not that the call failed inside a live engine
    (``RayTaskError``). Named, not imported: Ray is not a requirement here."""
    return any(c.__name__ == "RayActorError" and c.__module__.startswith("ray")
               for c in type(err).__mro__)
