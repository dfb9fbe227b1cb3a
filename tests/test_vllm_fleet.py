"""Engines that come and go between updates (issue 21): the "xreshard" backend over an
elastic world, with real vLLM CPU engines (TP=1, in-process, the tiny Qwen2 of
tests/vllm_cases.py) and a torch trainer holding a plain HF state dict.

One launch, seven updates, every live engine checked after each against vLLM's own load of
the same weights (greedy tokens and the full-vocab prompt logprobs, bit for bit):

1. A into engines 0 and 1;
2. engine 1 shut down (its backend's shutdown: ``World.leave``), engine 2 added: B into 0, 2;
3. engine 0 SIGKILLed: A into 2 (the survivors go on; the report names the lost);
4. engine 3 added, recording another model: ``EngineMismatch`` naming it, on the trainer,
   on engine 2 and on engine 3 itself, before any byte moves (engine 2 keeps A);
5. B into 2 (engine 3 left);
6. engine 0 added again, though its process is dead (its init fails before joining):
   ``HalfJoined`` naming it, on the trainer and on engine 2, which keeps B;
7. engine 1 added again (it left cleanly at step 2): C into 1 and 2.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import Any

import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

#: engine 3's model: another MLP width, so another recording than the others'
ODD_CONFIG = dict(cases.CONFIG, intermediate_size=128)
NUM_ENGINES = 4
#: seconds the trainer waits for an answer of the dead engine 0 when it adds it again
DEAD_TIMEOUT = 5.0


def _log() -> None:
    """xreshard's INFO lines (epochs, joins) into the child's output, shown on a failure."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("xreshard").addHandler(handler)
    logging.getLogger("xreshard").setLevel(logging.INFO)


def fleet_engine(ctx: Any, tmp: str) -> dict:
    """An in-process TP=1 engine answering the trainer (tests/vllm_cases.py's control plane);
    every failed control call is kept, to show each process raised the same error."""
    _log()
    from xreshard.adapters.vllm import LLMClient

    e = ctx.role.index
    control = cases._store(ctx.address, cases.ENGINE_START_TIMEOUT)
    model_dir = os.path.join(tmp, f"engine{e}")
    cases.write_model_dir(model_dir, c=ODD_CONFIG if e == 3 else cases.CONFIG)
    llm = cases.xreshard_llm(model_dir)
    client, errors = LLMClient(llm), []

    def kept(method: str) -> Any:
        def call(**kwargs: Any) -> Any:
            try:
                return getattr(client, method)(**kwargs)
            except Exception as x:
                errors.append(f"{method}: {type(x).__name__}: {x}")
                raise
        return call

    def check(weights_path: str) -> dict:
        return cases.check_against_reload(llm, weights_path)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    handlers = {m: kept(m) for m in ("init_weight_transfer_engine", "start_weight_update",
                                     "update_weights", "finish_weight_update",
                                     "shutdown_weight_transfer_engine")}
    handlers.update(check=check, die=die, stop=lambda: None)
    try:
        cases.serve_requests(ctx, llm, control, handlers)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"errors": errors}


class Client(cases.StoreClient):
    """The test's control plane, plus a request that is never answered (``die``)."""

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def kill(self) -> None:
        n, self.n = self.n, self.n + 1
        self.store.set(f"{self.prefix}rpc/{n}", json.dumps({"method": "die", "kwargs": {}}))


def fleet_trainer(ctx: Any, tmp: str) -> dict:
    """Drive the seven updates of the module docstring; returns what each did."""
    import torch
    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)
    from xreshard.runtime.epochs import gone

    _log()
    weights = {n: cases.init_params(seed) for n, seed in (("A", 1), ("B", 2), ("C", 3))}
    for n, w in weights.items():
        cases.save_checkpoint(w, os.path.join(tmp, n))
    clients = [Client(ctx.address, engine=e) for e in range(NUM_ENGINES)]
    info = XreshardTrainerInitInfo(rank=0, engine_world_size=1, num_engines=2, devices=1,
                                   timeout=cases.REFIT_TIMEOUT, elastic=True,
                                   world_id=f"fleet-{uuid.uuid4().hex[:8]}")
    engine = XreshardTrainerWeightTransferEngine.trainer_init(info, client=clients[:2])
    rounds: list[dict] = []

    def update(name: str, held: str) -> None:
        """Send ``name``; then every live engine must hold ``held`` (``name`` unless the
        update is refused) as vLLM loads it."""
        tensors = {n: torch.from_numpy(a) for n, a in cases.hf_tensors(weights[name]).items()}
        try:
            r = engine.send_weights(tensors)
            out = {"error": None, "version": r.version, "lost": list(r.lost),
                   "epoch": r.epoch, "bytes_sent": r.bytes_sent}
        except Exception as x:  # noqa: BLE001 - the test checks the message
            out = {"error": f"{type(x).__name__}: {x}", "version": engine.sender.version}
        out.update(name=name, held=held, ids=list(engine.engine_ids),
                   engines={e: clients[e].call("check", weights_path=os.path.join(tmp, held))
                            for e in engine.engine_ids})
        rounds.append(out)

    try:
        update("A", "A")
        engine.remove_engine(1)
        engine.add_engine(clients[2], engine=2)
        update("B", "B")
        (info0,) = [p for p in engine.world.processes if p["group"] == "rollout"
                    and p["index"] == 0]
        clients[0].kill()
        deadline = time.monotonic() + 60
        while not gone(info0, ()):
            assert time.monotonic() < deadline, "engine 0 did not die"
            time.sleep(0.05)
        update("A", "A")
        engine.add_engine(clients[3], engine=3)
        update("B", "A")
        update("B", "B")
        clients[0].timeout = DEAD_TIMEOUT
        engine.add_engine(clients[0], engine=0)
        update("C", "B")
        engine.add_engine(clients[1], engine=1)
        update("C", "C")
    finally:
        engine.shutdown()       # the attached engines' workers leave the world first
        for e in range(1, NUM_ENGINES):
            clients[e].call("stop")
    return {"rounds": rounds}


def _engine_role(e: int) -> Role:
    # one unbound OpenMP thread each: four idle engines must not starve the busy one
    return Role("plain", "engine", e, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                           "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                           "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_engines_leave_die_and_join_between_updates(tmp_path):
    roles = [Role("torch", "trainer", 0)] + [_engine_role(e) for e in range(NUM_ENGINES)]
    results = launch([fleet_trainer] + [fleet_engine] * NUM_ENGINES, roles,
                     args=(str(tmp_path),), timeout=900, check=False, fail_fast=False)
    trainer, engines = results[0], results[1:]
    assert trainer.ok, trainer.describe()
    assert engines[0].returncode == -signal.SIGKILL
    for res in engines[1:]:
        assert res.ok, res.describe()
    rounds = trainer.value["rounds"]
    assert [r["ids"] for r in rounds] == [[0, 1], [0, 2], [2], [2], [2], [2], [2, 1]]
    assert [r["version"] for r in rounds] == [1, 2, 3, 3, 4, 4, 5]
    ok = [r for r in rounds if r["error"] is None]
    assert [r["lost"] for r in ok] == [[], ["rollout[1]"], ["rollout[0]"], ["rollout[3]"], []]
    assert [r["epoch"] for r in ok] == sorted({r["epoch"] for r in ok}) and ok[0]["epoch"] == 0
    model = _model_bytes()
    for r in rounds:
        for e, got in r["engines"].items():
            where = (r["name"], r["held"], e)
            assert got["tokens"] == got["ref_tokens"], where
            assert got["logprobs_bit_equal"], where
            assert got["report"]["version"] == r["version"], where
            assert got["weight_version"] == str(r["version"]), where
            if r["error"] is None:      # every engine got its whole shard, once
                assert got["report"]["bytes_received"] == got["report"]["shard_bytes"] == \
                    model, where
        if r["error"] is None:
            assert r["bytes_sent"] == model * len(r["ids"])
    # the checks can fail: the weights changed the engines' answers
    assert rounds[0]["engines"]["0"]["tokens"] != rounds[1]["engines"]["0"]["tokens"]
    assert rounds[6]["engines"]["1"]["tokens"] != rounds[0]["engines"]["1"]["tokens"]
    # refused updates: one typed error naming the engine, on every process, nothing moved
    mismatch, half = rounds[3]["error"], rounds[5]["error"]
    assert mismatch.startswith("EngineMismatch: engine(s) [3] record another model"), mismatch
    assert half.startswith("HalfJoined: half-joined engine(s): engine 0 was added on the "
                           "trainer but has not joined the world"), half
    e2, e3 = (engines[e].value["errors"] for e in (2, 3))
    assert any("EngineMismatch: engine(s) [3]" in x for x in e2 if x.startswith("update"))
    assert any("EngineMismatch: engine(s) [3]" in x for x in e3 if x.startswith("init"))
    assert any("HalfJoined: half-joined engine(s): engine 0" in x for x in e2)
    assert not engines[1].value["errors"]


def _model_bytes() -> int:
    """The tiny Qwen2's bytes in fp32 at TP=1, by vLLM's formulas (as in test_vllm_engine)."""
    from .test_vllm_engine import _expected_shard_bytes
    return _expected_shard_bytes(1, 0, 4)


def test_half_joined_and_mismatch_verdicts():
    """The pure verdicts (no engine): what is half-joined, which engine is the odd one."""
    from xreshard.adapters.vllm.members import engine_problem, joining_problem

    def infos(*indices: int) -> list[dict]:
        return [{"group": "trainer", "index": 0}] + [{"group": "rollout", "index": i}
                                                     for i in indices]

    # two workers per engine: rollout[0], rollout[1] are engine 0; rollout[2], [3] engine 1
    assert joining_problem(infos(0, 1), infos(2, 3)[1:], 2, [0, 1]) is None
    assert "engine 1 asked to join the world but the trainer has no client" in \
        joining_problem(infos(0, 1), infos(2, 3)[1:], 2, [0])
    half = joining_problem(infos(0, 1), infos(2)[1:], 2, [0, 1])
    assert "engine 1: worker(s) [1] of 2 have not asked to join" in half
    late = joining_problem(infos(0, 1), [], 2, [0, 1], {"1": "RuntimeError: no"})
    assert "engine 1 was added on the trainer but has not joined" in late and "no)" in late
    assert "engine 0 is a member but the trainer does not drive it" in joining_problem(
        infos(0, 1), [], 2, [])
    assert joining_problem(infos(0, 1), [], 2, None) is None      # no trainer said
    same = [{"engine": {"engine": e, "model": "m"}} for e in (0, 1)]
    assert engine_problem(same + [{"engine": None}]) is None
    odd = engine_problem(same + [{"engine": {"engine": 2, "model": "x"}}])
    assert odd[1] == [2] and "than engine 0" in odd[0]
    # a new engine 0 with another model than the engines already there: engine 0 is odd
    new = [{"engine": {"engine": 0, "model": "x"}, "fresh": True},
           {"engine": {"engine": 2, "model": "m"}, "fresh": False}]
    assert engine_problem(new)[1] == [0]
