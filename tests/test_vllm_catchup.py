"""An engine added between updates catches up from a live engine (issue 21 item 3, the
vLLM backend): real vLLM CPU engines (TP=1, in-process, the tiny Qwen2 of
tests/vllm_cases.py), a torch trainer holding a plain HF state dict, an elastic world.

1. A into engine 0;
2. ``add_engine(client 1, catch_up=True)``: engine 1's worker joins with ``wait=False`` and
   fills every layer group from engine 0's worker (a catch-up world the trainer is not
   in), then vLLM loads it: engine 1 serves A before any update. Counted on both sides:
   the trainer sends nothing meanwhile, engine 0's process sends engine 1's whole shard,
   and engine 1's report receives it;
3. B into engines 0 and 1: the update admits engine 1, which takes part like engine 0.

Every live engine is checked after steps 1-3 against vLLM's own load of the same weights
(greedy tokens and the full-vocab prompt logprobs, bit for bit).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

from .test_vllm_fleet import _engine_role, _log, _model_bytes  # noqa: E402


def catchup_engine(ctx: Any, tmp: str) -> dict:
    """An in-process TP=1 engine answering the trainer, with ``count_on``/``count_off``:
    what this process's transports move in between (``xr.count_comm``)."""
    _log()
    import xreshard as xr

    e = ctx.role.index
    control = cases._store(ctx.address, cases.ENGINE_START_TIMEOUT)
    model_dir = os.path.join(tmp, f"engine{e}")
    cases.write_model_dir(model_dir)
    llm = cases.xreshard_llm(model_dir)
    counting: dict[str, Any] = {}

    def check(weights_path: str) -> dict:
        return cases.check_against_reload(llm, weights_path)

    def count_on() -> None:
        counting["cm"] = xr.count_comm()
        counting["counts"] = counting["cm"].__enter__()

    def count_off() -> dict:
        counting.pop("cm").__exit__(None, None, None)
        c = counting.pop("counts")
        return {"sent": c.total_sent, "received": c.total_received}

    try:
        cases.serve_requests(ctx, llm, control, {"check": check, "count_on": count_on,
                                                 "count_off": count_off,
                                                 "stop": lambda: None})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {}


def catchup_trainer(ctx: Any, tmp: str) -> dict:
    """Steps 1-3 of the module docstring; returns what each did."""
    import torch
    import xreshard as xr
    from xreshard.adapters.vllm import (XreshardTrainerInitInfo,
                                        XreshardTrainerWeightTransferEngine)

    _log()
    weights = {n: cases.init_params(seed) for n, seed in (("A", 1), ("B", 2))}
    for n, w in weights.items():
        cases.save_checkpoint(w, os.path.join(tmp, n))
    clients = [cases.StoreClient(ctx.address, engine=e) for e in range(2)]
    info = XreshardTrainerInitInfo(rank=0, engine_world_size=1, num_engines=1, devices=1,
                                   timeout=cases.REFIT_TIMEOUT, elastic=True, catch_up=True,
                                   world_id=f"catchup-{uuid.uuid4().hex[:8]}")
    engine = XreshardTrainerWeightTransferEngine.trainer_init(info, client=clients[:1])

    def send(name: str) -> dict:
        tensors = {n: torch.from_numpy(a) for n, a in cases.hf_tensors(weights[name]).items()}
        r = engine.send_weights(tensors)
        return {"version": r.version, "bytes_sent": r.bytes_sent, "ids": list(engine.engine_ids)}

    def check(name: str) -> dict:
        return {e: clients[e].call("check", weights_path=os.path.join(tmp, name))
                for e in (0, 1)}

    out: dict[str, Any] = {}
    try:
        out["first"] = send("A")
        out["first_engines"] = {0: clients[0].call("check",
                                                   weights_path=os.path.join(tmp, "A"))}
        clients[0].call("count_on")
        with xr.count_comm() as counts:
            engine.add_engine(clients[1], engine=1, catch_up=True)
        out["serving"] = clients[0].call("count_off")
        out["trainer_during_catch_up"] = {"sent": counts.total_sent,
                                          "received": counts.total_received}
        out["caught"] = check("A")
        out["second"] = send("B")
        out["second_engines"] = check("B")
    finally:
        for c in clients:
            c.call("stop")
        engine.shutdown()
    return out


@pytest.mark.slow
def test_an_added_engine_catches_up_from_a_live_engine(tmp_path):
    roles = [Role("torch", "trainer", 0)] + [_engine_role(e) for e in range(2)]
    results = launch([catchup_trainer, catchup_engine, catchup_engine], roles,
                     args=(str(tmp_path),), timeout=600, check=False, fail_fast=True)
    for res in results:
        assert res.ok, res.describe()
    out = results[0].value
    model = _model_bytes()
    assert out["first"]["version"] == 1 and out["first"]["bytes_sent"] == model
    # the catch-up: engine 1's whole shard, sent by engine 0's process, none by the trainer
    assert out["trainer_during_catch_up"] == {"sent": 0, "received": 0}
    assert out["serving"]["sent"] == model, out["serving"]
    caught = out["caught"]["1"]["report"]
    assert caught["version"] == 1 and caught["bytes_received"] == caught["shard_bytes"] == \
        model, caught
    # then the next update admits engine 1: both engines receive B from the trainer
    assert out["second"]["version"] == 2 and out["second"]["ids"] == [0, 1]
    assert out["second"]["bytes_sent"] == 2 * model
    for step in ("first_engines", "caught", "second_engines"):
        for e, got in out[step].items():
            where = (step, e)
            assert got["tokens"] == got["ref_tokens"], where
            assert got["logprobs_bit_equal"], where
    second = out["second_engines"]
    assert second["1"]["report"]["version"] == second["0"]["report"]["version"] == 2
    assert second["1"]["report"]["bytes_received"] == model
    # the checks can fail: B changed the engines' answers
    assert out["caught"]["1"]["tokens"] != second["1"]["tokens"]
