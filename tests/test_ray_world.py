"""xreshard worlds of Ray actors: a JAX trainer actor refits a vLLM engine actor.

A local Ray cluster (4 logical CPUs on this 2-core machine, a 128 MiB object store, no
dashboard); the driver serves the store (:class:`xreshard.integrations.ray.RayWorld`) and
hands its address to the actors, its token through their ``runtime_env``. A JAX trainer
actor (4 CPU devices, mesh fsdp=2 x tp=2) drives a vLLM CPU engine actor (TP=2, the ``mp``
executor inside: CPU vLLM refuses the Ray executor) through vLLM's own
``RayVLLMWeightSyncClient``. After the refit every tensor the engine holds equals, byte for
byte, vLLM's own load of the same weights, and so do its greedy tokens; each engine rank
receives exactly its shard and nothing lands in the trainer. Then a fleet of two engine
actors (TP=1, an elastic world): one is killed between updates; the next update, started
at once (the killed actor's calls raise Ray's ActorUnavailableError / ActorDiedError),
goes on with the survivor (exact), Ray restarts the killed actor, it rejoins and catches
up from the survivor's workers, and the update after refits both, exact.

Ray or vLLM missing: skipped, unless XRESHARD_REQUIRE_RL=1 (the RL leg of CI): a failure.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import tempfile
import time

import pytest

REQUIRE = os.environ.get("XRESHARD_REQUIRE_RL") == "1"
if not REQUIRE and (importlib.util.find_spec("ray") is None
                    or importlib.util.find_spec("vllm") is None):
    pytest.skip("needs ray and vllm (the RL leg: .ci/rl_leg.sh)", allow_module_level=True)

from . import vllm_cases as cases  # noqa: E402

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)


@pytest.fixture
def ray_cluster():
    import ray

    tmp = tempfile.mkdtemp(prefix="xr-ray-", dir="/tmp")      # short: Ray's socket paths
    env = {"PYTHONPATH": os.pathsep.join([ROOT] + [p for p in os.environ.get(
               "PYTHONPATH", "").split(os.pathsep) if p]),
           "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    ray.init(num_cpus=4, object_store_memory=128 << 20, include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=tmp, runtime_env={"env_vars": env},
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_jax_trainer_actor_refits_a_vllm_engine_actor_exactly(ray_cluster, tmp_path):
    ray = ray_cluster
    from xreshard.integrations.ray import RayWorld, VllmEngineActor

    from .ray_cases import JaxTrainer

    model_dir = str(tmp_path / "model")
    cases.write_model_dir(model_dir, seed=0)
    world = RayWorld()
    try:
        Engine = ray.remote(num_cpus=2)(VllmEngineActor)
        engine = Engine.options(**world.actor_options()).remote(
            model=model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=64,
            max_num_seqs=4, seed=0, enable_prefix_caching=False)
        trainer = ray.remote(num_cpus=1)(JaxTrainer).options(**world.actor_options()).remote()
        assert ray.get(engine.ready.remote(), timeout=600) == 2
        before = ray.get(engine.generate.remote(cases.PROMPTS, cases.MAX_TOKENS))
        assert ray.get(trainer.setup.remote(world.address, [engine], 2), timeout=300) == 4
        ckpt = str(tmp_path / "step1")
        out = ray.get(trainer.refit.remote(1, ckpt), timeout=300)
        assert out["version"] == 1 and out["received_by_trainer"] == 0 and out["sent"] > 0
        reports = ray.get(engine.collective_rpc.remote("xreshard_transfer_report"))
        assert [r["bytes_received"] for r in reports] == [r["shard_bytes"] for r in reports]
        got = ray.get(engine.collective_rpc.remote("xreshard_weights_digest"))
        after = ray.get(engine.generate.remote(cases.PROMPTS, cases.MAX_TOKENS))
        ray.get(engine.collective_rpc.remote("xreshard_load_checkpoint", (ckpt,)))
        assert got == ray.get(engine.collective_rpc.remote("xreshard_weights_digest"))
        assert after == ray.get(engine.generate.remote(cases.PROMPTS, cases.MAX_TOKENS))
        assert after != before                 # the refit changed what the engine answers
        ray.get(trainer.shutdown.remote())
        ray.get(engine.shutdown.remote())
    finally:
        world.close()


def _exact(ray, engine, checkpoint: str) -> bool:
    """The engine's weights equal vLLM's own load of ``checkpoint``, tensor by tensor."""
    got = ray.get(engine.collective_rpc.remote("xreshard_weights_digest"))
    ray.get(engine.collective_rpc.remote("xreshard_load_checkpoint", (checkpoint,)))
    return got == ray.get(engine.collective_rpc.remote("xreshard_weights_digest"))


@pytest.mark.slow
def test_a_killed_engine_actor_is_dropped_and_its_restart_catches_up(ray_cluster, tmp_path):
    ray = ray_cluster
    from xreshard.integrations.ray import RayWorld, VllmEngineActor

    from .ray_cases import JaxTrainer

    model_dir = str(tmp_path / "model")
    cases.write_model_dir(model_dir, seed=0)
    world = RayWorld()
    try:
        Engine = ray.remote(num_cpus=1, max_restarts=1)(VllmEngineActor)
        engines = [Engine.options(**world.actor_options(
            {"VLLM_CPU_OMP_THREADS_BIND": str(e)})).remote(
            model=model_dir, tensor_parallel_size=1, dtype="float32", max_model_len=64,
            max_num_seqs=4, seed=0, enable_prefix_caching=False) for e in range(2)]
        trainer = ray.remote(num_cpus=1)(JaxTrainer).options(**world.actor_options()).remote()
        assert ray.get([e.ready.remote() for e in engines], timeout=600) == [1, 1]
        ray.get(trainer.setup.remote(world.address, engines, 1, True), timeout=300)
        ckpt = [str(tmp_path / f"w{i}") for i in range(3)]
        out = ray.get(trainer.refit.remote(1, ckpt[0]), timeout=300)
        assert out["lost"] == [] and all(_exact(ray, e, ckpt[0]) for e in engines)

        pid = ray.get(engines[0].pid.remote())
        ray.kill(engines[0], no_restart=False)         # Ray restarts it (max_restarts=1)
        # the next update at once: the killed actor answers its control calls with Ray's
        # ActorUnavailableError (restarting) or ActorDiedError while its vLLM worker may
        # still be a member; the trainer drops it as a lost member and goes on
        out = ray.get(trainer.refit.remote(2, ckpt[1]), timeout=600)
        assert out["engines"] == [1] and out["lost_engines"] == [0]
        assert _exact(ray, engines[1], ckpt[1])
        ray.get(trainer.wait_gone.remote(0), timeout=300)   # its vLLM worker exited too

        deadline = time.monotonic() + 600               # Ray restarts it: wait for it
        while True:
            try:
                assert ray.get(engines[0].ready.remote(), timeout=600) == 1
                break
            except ray.exceptions.ActorUnavailableError:    # still restarting
                assert time.monotonic() < deadline, "the killed engine actor never came back"
                time.sleep(2)
        assert ray.get(engines[0].pid.remote()) != pid
        ray.get(trainer.add_engine.remote(engines[0], 0), timeout=300)
        assert _exact(ray, engines[0], ckpt[1])        # caught up from the survivor
        out = ray.get(trainer.refit.remote(3, ckpt[2]), timeout=300)
        assert out["lost"] == [] and sorted(out["engines"]) == [0, 1]
        assert all(_exact(ray, e, ckpt[2]) for e in engines)
        ray.get(trainer.shutdown.remote())
        ray.get([e.shutdown.remote() for e in engines])
    finally:
        world.close()
