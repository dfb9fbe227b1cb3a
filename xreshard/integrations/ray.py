"""xreshard worlds of Ray actors: trainer actors and vLLM engine actors in one refit world.

The smallest API a Ray user needs::

    world = RayWorld()                                   # the store, in the driver
    Engine = ray.remote(num_cpus=2)(VllmEngineActor)
    engine = Engine.options(**world.actor_options()).remote(model=model_dir, tensor_parallel_size=2)
    Trainer = ray.remote(num_cpus=1)(MyTrainer)          # any class of yours
    trainer = Trainer.options(**world.actor_options()).remote()
    ray.get(trainer.setup.remote(world.address, [engine]))   # trainer_init(address=...,
                                                         #   client=engine_client([engine]))

Decision record.

* The store is served by the driver (:class:`RayWorld`, or by any one actor: the store is
  :func:`xreshard.serve`); its address is an ordinary actor argument, and the world's token
  reaches every actor (and the vLLM workers an engine actor starts, which inherit its
  environment) as ``XRESHARD_TOKEN`` through ``runtime_env``: a process without it can
  neither join the world nor inject metadata. No port is opened beyond the store's; the
  refit's own connections are the transports xreshard picks from the published hosts.
* An engine is one actor that builds ``vllm.LLM`` with the ``mp`` executor inside (its TP
  workers are the actor's child processes): vLLM's CPU platform refuses
  ``distributed_executor_backend="ray"``, and the same shape is what verl and SkyRL run on
  GPU. :class:`VllmEngineActor` forwards vLLM's weight-transfer methods unchanged, so the
  trainer drives engines through vLLM's own ``RayVLLMWeightSyncClient``
  (:func:`engine_client`), the client xreshard's trainer engine already accepts.
* Ray pickles actor calls (its own control plane); xreshard's metadata still crosses
  processes as JSON inside the world, never through Ray.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Sequence

from xreshard.extras import require

__all__ = ["RayWorld", "VllmEngineActor", "engine_client", "WORKER_EXTENSION"]

from .worker import WORKER_EXTENSION


class RayWorld:
    """The rendezvous store of a world of Ray actors, served by this process (the driver).

    Args:
        host: the interface the store listens on ("127.0.0.1": actors on this node only;
            this node's address on an isolated network for a multi-node cluster).
        token: the world's secret (default a fresh random one).
        timeout: the store's own operations' timeout, in seconds.
    """

    def __init__(self, host: str = "127.0.0.1", token: str | None = None,
                 timeout: float = 300.0) -> None:
        from xreshard.runtime.store import serve

        self.token = token or secrets.token_hex(16)
        self.server = serve(host, timeout=timeout)

    @property
    def address(self) -> str:
        """``"tcp://host:port"``: hand it to every actor that joins."""
        return self.server.address

    def env_vars(self) -> dict[str, str]:
        """What an actor of this world needs in its environment (the token)."""
        return {"XRESHARD_TOKEN": self.token}

    def actor_options(self, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        """``ActorClass.options(**world.actor_options())``: the token (and ``env_vars``)
        in the actor's ``runtime_env``."""
        return {"runtime_env": {"env_vars": {**(env_vars or {}), **self.env_vars()}}}

    def close(self) -> None:
        self.server.close()


def engine_client(handles: Any) -> Any:
    """vLLM's ``RayVLLMWeightSyncClient`` over engine actor handles (one, or a list: they
    are driven as one unit). Pass it as ``client=`` to ``trainer_init`` on trainer rank 0."""
    clients = require("vllm.distributed.weight_transfer.clients", "vllm",
                      "xreshard.integrations.ray")
    return clients.RayVLLMWeightSyncClient(list(handles) if isinstance(handles, (list, tuple))
                                           else handles)


class VllmEngineActor:
    """A vLLM engine in a Ray actor (wrap it: ``ray.remote(num_cpus=tp)(VllmEngineActor)``).

    Builds ``vllm.LLM(**llm_kwargs)`` with ``distributed_executor_backend="mp"``,
    ``weight_transfer_config={"backend": "xreshard"}`` and the integrations' worker
    extension unless given; forwards vLLM's weight-transfer methods (what
    ``RayVLLMWeightSyncClient`` calls) and offers ``generate`` on token ids.
    """

    def __init__(self, **llm_kwargs: Any) -> None:
        from vllm import LLM

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")    # the mp executor needs it
        kwargs = {"distributed_executor_backend": "mp", "enforce_eager": True,
                  "skip_tokenizer_init": True,
                  "weight_transfer_config": {"backend": "xreshard"},
                  "worker_extension_cls": WORKER_EXTENSION, **llm_kwargs}
        self.llm = LLM(**kwargs)

    def ready(self) -> int:
        """The engine's worker count (pp x tp), once it is up."""
        c = self.llm.llm_engine.vllm_config.parallel_config
        return int(c.pipeline_parallel_size * c.tensor_parallel_size)

    def pid(self) -> int:
        return os.getpid()

    # vLLM's weight-transfer control plane (RayVLLMWeightSyncClient's calls), unchanged
    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """A worker method by name (the worker extension's reports and digests)."""
        return self.llm.collective_rpc(method, args=tuple(args), kwargs=kwargs or {})

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        """Sampled token ids per prompt (token ids in; the engine has no tokenizer)."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                            detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def shutdown(self) -> None:
        """Stop the engine core and its workers (before the actor is killed)."""
        self.llm.llm_engine.engine_core.shutdown()
