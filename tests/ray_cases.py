"""The actors of tests/test_ray_world.py (a module Ray's workers import by name)."""

from __future__ import annotations

from typing import Any

from . import vllm_cases as cases


class JaxTrainer:
    """A JAX trainer actor on 4 CPU devices (mesh fsdp=2 x tp=2; ``JAX_NUM_CPU_DEVICES``
    comes with its runtime_env) that refits vLLM engine actors through xreshard."""

    def setup(self, address: str, engines: list, tp: int) -> int:
        import jax
        import numpy as np

        from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                            XreshardTrainerWeightTransferEngine)
        from xreshard.integrations.ray import engine_client

        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
        self.engine = XreshardTrainerWeightTransferEngine.trainer_init(
            XreshardTrainerInitInfo(rank=0, engine_world_size=tp, num_engines=len(engines),
                                    address=address, rules=cases.rules(),
                                    timeout=cases.REFIT_TIMEOUT),
            client=engine_client(engines))
        return len(jax.devices())

    def refit(self, seed: int, checkpoint: str) -> dict[str, Any]:
        """New weights (``seed``) to every engine; their checkpoint for vLLM's own load."""
        from xreshard.runtime.commcount import count_comm

        flat = cases.init_params(seed)
        with count_comm() as counts:
            report = self.engine.send_weights(cases.shard(flat, self.mesh))
        cases.save_checkpoint(flat, checkpoint)
        return {"version": report.version, "received_by_trainer": counts.total_received,
                "sent": counts.total_sent}

    def shutdown(self) -> None:
        self.engine.shutdown()
