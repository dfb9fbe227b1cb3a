"""How vLLM finds xreshard: the ``"xreshard"`` weight-transfer backend's registration (a
``vllm.general_plugins`` entry point) and the worker extension whose methods a trainer or a
test calls by name through ``collective_rpc`` (a method name crosses a multiprocess
engine's RPC; a callable would be pickled).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .build import record_in_worker
from .record import import_torch, import_vllm
from .reload import reload_from_shards, reprocess_tied, weights_digest

__all__ = ["BACKEND", "register_backend", "WorkerExtension", "worker_record"]

BACKEND = "xreshard"


def register_backend() -> None:
    """vLLM general plugin: register the ``"xreshard"`` weight-transfer backend.

    The entry point ``[project.entry-points."vllm.general_plugins"] xreshard =
    "xreshard.adapters.vllm:register_backend"`` makes vLLM call it in every process it
    starts (front end, engine core, workers). It registers the worker and trainer engines
    (:mod:`xreshard.adapters.vllm.worker`, :mod:`xreshard.adapters.vllm.trainer`) by module
    path, so nothing is imported until a backend is created; calling it twice is harmless.
    A trainer process that never
    builds a vLLM engine calls it itself before ``WeightTransferTrainerFactory.trainer_init``
    (or uses ``XreshardTrainerWeightTransferEngine.trainer_init`` directly).
    """
    import_vllm()
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    for factory, module, cls in (
            (WeightTransferEngineFactory, "xreshard.adapters.vllm.worker",
             "XreshardWeightTransferEngine"),
            (WeightTransferTrainerFactory, "xreshard.adapters.vllm.trainer",
             "XreshardTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:      # already registered (plugins may load more than once)
            pass


# ---------------------------------------------------------------------------- the worker extension

def worker_record(worker: Any, specs: Mapping[str, Sequence] | None = None) -> dict:
    """What ``WorkerExtension.xreshard_record`` runs: ``llm.collective_rpc("xreshard_record",
    args=(specs,))``. (Passing this function itself to ``collective_rpc`` works only in an
    in-process engine: a multiprocess one would pickle it.)

    ``specs`` is JSON-like (``{name: [shape, dtype_name]}``) since tensors do not survive
    the RPC; returns ``Recording.to_dict()`` plus ``"rank"``, the worker's global rank.
    """
    torch = import_torch()
    parsed = None if specs is None else {n: (tuple(s[0]), str(s[1])) for n, s in specs.items()}
    out = record_in_worker(worker, parsed).to_dict()
    out["rank"] = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return out


class WorkerExtension:
    """vLLM worker extension: ``LLM(..., worker_extension_cls=
    "xreshard.adapters.vllm.WorkerExtension")`` then
    ``llm.collective_rpc("xreshard_record", args=(specs,))``.

    A method name, unlike a callable, crosses a multiprocess engine's RPC without
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """

    # vLLM's worker, which this class is mixed into, sets these (annotations only: no default)
    model_runner: Any
    speculative_config: Any

    def init_worker_extension(self) -> None:
        """vLLM >= 0.33 calls this on every worker once its device is up: register the
        ``"xreshard"`` backend there too, so a worker finds it even where xreshard's
        ``vllm.general_plugins`` entry point is not installed (xreshard on ``PYTHONPATH``)."""
        register_backend()

    def destroy_worker_extension(self) -> None:
        """vLLM >= 0.33 calls this on every worker before it shuts down: leave the refit
        world first (its store connection, shared-memory segments, gloo groups), whatever
        the engine's own shutdown does afterwards. (vLLM 0.32 has neither hook; there the
        worker's shutdown closes the backend.)"""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and getattr(engine, "world", None) is not None:
            engine.shutdown()

    def xreshard_record(self, specs: Mapping[str, Sequence] | None = None) -> dict:
        return worker_record(self, specs)

    def xreshard_transfer_report(self, target: str | None = None) -> dict:
        """The ``"xreshard"`` weight-transfer backend's last round on this worker: bytes
        received, this rank's shard bytes, version (see ``XreshardWeightTransferEngine``);
        ``target="draft"``: the speculative draft's last round."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "report"):
            raise RuntimeError("this engine does not run the 'xreshard' weight-transfer backend; "
                               "pass weight_transfer_config={'backend': 'xreshard'}")
        return engine.report(target)

    def xreshard_lora_report(self) -> dict:
        """The last LoRA round on this worker (adapters and their versions, bytes received,
        this rank's share of the factors); see :mod:`xreshard.adapters.vllm.lora`."""
        engine = getattr(self, "weight_transfer_engine", None)
        receiver = getattr(engine, "lora", None)
        if receiver is None:
            return {"lora_version": 0, "last_error": None}
        return receiver.report()

    def xreshard_weights_digest(self, target: str = "policy") -> dict[str, str]:
        """sha256 of every tensor in the live model's state dict (parameters and persistent
        buffers, as processed after loading; a linear weight as its prepacked CPU kernel
        holds it, see :func:`weights_digest`), by name: compare two engines' weights, or one
        engine's weights after a refit and after ``reload_weights``, bit for bit.
        ``target="draft"``: the speculative draft model's."""
        return weights_digest(self._xreshard_model(target))

    def xreshard_reload_draft(self, weights_path: str) -> None:
        """Load the safetensors checkpoint in ``weights_path`` into the speculative draft
        through vLLM's own loaders (layerwise reload, as ``reload_weights`` does for the
        target, which vLLM 0.32 offers for the target only)."""
        import glob
        import os

        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(glob.glob(os.path.join(weights_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {weights_path!r}")
        reload_from_shards(self._xreshard_model("draft"),
                           self.speculative_config.draft_model_config,
                           safetensors_weights_iterator(files, use_tqdm_on_load=False))

    def _xreshard_model(self, target: str) -> Any:
        if target == "policy":
            return self.model_runner.get_model()
        model = self.model_runner.get_draft_model() if target == "draft" else None
        if model is None:
            raise ValueError(f"target {target!r}: this engine has no such model (targets: "
                             "'policy', and 'draft' with a draft model, EAGLE or MTP head)")
        return model

    def xreshard_reprocess_tied(self) -> list[str]:
        """Re-process tied modules after vLLM's own ``reload_weights`` (see
        :func:`reprocess_tied`); returns the modules re-processed."""
        return reprocess_tied(self.model_runner.get_model())
