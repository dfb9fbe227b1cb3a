"""The actors of tests/test_ray_world.py (a module Ray's workers import by name)."""

from __future__ import annotations

import uuid
from typing import Any

from . import vllm_cases as cases


class JaxTrainer:
    """A JAX trainer actor on 4 CPU devices (mesh fsdp=2 x tp=2; ``JAX_NUM_CPU_DEVICES``
    comes with its runtime_env) that refits vLLM engine actors through xreshard."""

    def setup(self, address: str, engines: list, tp: int, elastic: bool = False) -> int:
        import jax
        import numpy as np

        from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                            XreshardTrainerWeightTransferEngine)
        from xreshard.integrations.ray import engine_client

        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
        # one client per engine: an elastic world drives (and drops) them one by one
        self.engine = XreshardTrainerWeightTransferEngine.trainer_init(
            XreshardTrainerInitInfo(rank=0, engine_world_size=tp, num_engines=len(engines),
                                    address=address, rules=cases.rules(),
                                    timeout=cases.REFIT_TIMEOUT, elastic=elastic,
                                    catch_up=elastic, world_id=f"ray-{uuid.uuid4().hex[:8]}"),
            client=[engine_client(e) for e in engines])
        return len(jax.devices())

    def wait_gone(self, engine: int, timeout: float = 120.0) -> float:
        """Until every worker process of ``engine`` is gone (a killed actor's vLLM workers
        exit a moment after it); returns the seconds waited."""
        import time

        from xreshard.runtime.epochs import gone

        procs = [p for p in self.engine.world.processes
                 if p["group"] == "rollout" and int(p["index"]) == engine]
        t0 = time.monotonic()
        while not all(gone(p, ()) for p in procs):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"engine {engine}'s workers still run after {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def add_engine(self, handle: Any, engine: int) -> int:
        """A restarted engine actor back into the world, filled from the live engines."""
        from xreshard.integrations.ray import engine_client
        return self.engine.add_engine(engine_client(handle), engine, catch_up=True)

    def refit(self, seed: int, checkpoint: str) -> dict[str, Any]:
        """New weights (``seed``) to every engine; their checkpoint for vLLM's own load."""
        from xreshard.runtime.commcount import count_comm

        flat = cases.init_params(seed)
        with count_comm() as counts:
            report = self.engine.send_weights(cases.shard(flat, self.mesh))
        cases.save_checkpoint(flat, checkpoint)
        return {"version": report.version, "received_by_trainer": counts.total_received,
                "sent": counts.total_sent, "lost": sorted(report.lost),
                "engines": list(self.engine.engine_ids),
                "lost_engines": list(self.engine.lost_engines)}

    def shutdown(self) -> None:
        self.engine.shutdown()
