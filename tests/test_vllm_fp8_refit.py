"""A JAX trainer refits block-FP8 vLLM engines in real processes (issue 20, phase 2).

The trainer (NamedSharding over 4 CPU devices, bf16 HF tensors) sends values; each vLLM
rank (a process building vLLM's model for its TP rank from a block-FP8 checkpoint config,
``fake_tp``) receives e4m3 codes and ``weight_scale_inv`` scales, quantized on the way
(whole blocks by the trainer, blocks split across its devices by the receiver), and hands
them to vLLM's layerwise reload (its loaders, then its own ``process_weights_after_
loading``). A -> B -> A: after each refit, every parameter of every rank equals, byte for
byte, what vLLM's own ``load_weights`` writes from a checkpoint of the same bf16 weights
quantized by vLLM's own ``per_block_cast_to_fp8``.

Stood in (no FP8 kernel on a CPU without AMX, see ``tests/test_vllm_fp8.py``): vLLM's FP8
kernel choice and the kernel's post-processing (``xreshard.adapters.vllm.KernelStandIn``).
"""

from __future__ import annotations

import pytest

from xreshard.tools.launch import Role, launch

from .vllm_cases import importorskip_vllm

importorskip_vllm()
pytestmark = pytest.mark.slow

TP = 2
CASES = {"llama-checkpoint-tp2": dict(tp=TP), "mixtral-checkpoint-ep2": dict(tp=TP, ep=True)}


def _setup(case):
    from . import test_vllm_fp8 as t
    make = t.llama if case.startswith("llama") else t.mixtral
    par = CASES[case]
    vllm_config = t.vllm_config_of(make, t.CKPT, None, par)
    bf16_specs = t.specs_of(make(t.CKPT))
    return t, vllm_config, bf16_specs, par


def trainer(ctx, case) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    t, _, bf16_specs, _ = _setup(case)
    world = ctx.join(groups=["trainer", "rollout"], timeout=240)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.local_devices())

    def params(seed):
        out = {}
        for name, w in t.bf16_weights(bf16_specs, seed).items():
            rows = w.shape[0] % 4 == 0
            spec = P("x", *([None] * (w.ndim - 1))) if rows else P()
            out[name] = jax.device_put(jnp.asarray(t.numpy_bf16(w)), NamedSharding(mesh, spec))
        return out

    refit = xr.Refit(world, send=params(2), config=xr.RefitConfig(timeout=120))
    reports = []
    for seed in (2, 1):                 # B, then A again
        r = refit(send=params(seed))
        reports.append(dict(r.quantized))
    world.close()
    return {"reports": reports}


def rollout(ctx, case) -> dict:
    import torch
    import xreshard as xr
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from xreshard.adapters import vllm as xv

    t, vllm_config, bf16_specs, par = _setup(case)
    tp_rank = ctx.role.index
    specs = t.full_checkpoint_specs(vllm_config, bf16_specs, t.ranks_of(par))
    recs = [xv.record_from_config(vllm_config, r, TP, specs) for r in range(TP)]
    recording = xv.EngineRecording(recs, tp_rank, specs)
    world = ctx.join(groups=["trainer", "rollout"], timeout=240)
    dest = xv.Destination.place(recording, world.group_ranks("rollout"))
    a = t.vllm_checkpoint(t.bf16_weights(bf16_specs, 1), recording.quantized.values())
    with xv.fake_tp(tp_rank, TP), set_current_vllm_config(vllm_config):
        model = xv.build_model(vllm_config, device="cpu")
        with xv.kernel_stand_ins(), torch.no_grad():
            model.load_weights(iter(a.items()))
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    names = recording.with_scales(recording.offered_groups(1 << 40)[0])
    assert sorted(names) == sorted(recording.names)
    buffers = dest.buffers(model, False, "cpu", names)
    refit = xr.Refit(world, receive=dest.bind(buffers, [], names),
                     config=xr.RefitConfig(timeout=120))
    out: dict = {"equal": [], "reports": []}
    for seed in (2, 1):
        r = refit(receive=dest.bind(buffers, [], names))
        out["reports"].append(dict(r.quantized))
        with xv.fake_tp(tp_rank, TP), set_current_vllm_config(vllm_config), \
                xv.kernel_stand_ins(), torch.no_grad():
            dest.load(model, vllm_config.model_config, buffers, False, names)
        want = t.vllm_loads(vllm_config, tp_rank, 0, par, t.vllm_checkpoint(
            t.bf16_weights(bf16_specs, seed), recording.quantized.values()))
        got = dict(model.named_parameters())
        touched = recording.touched()          # every parameter the refit writes
        fp8 = [p for p in touched if str(want[p].dtype) == "torch.float8_e4m3fn"]
        assert fp8, "the engine stores nothing in FP8"
        out["equal"].append({p: bool((t.as_bytes(got[p].detach()) == t.as_bytes(want[p]))
                                     .all()) for p in touched})
        out["fp8_params"] = fp8
    world.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_jax_trainer_refits_block_fp8_vllm_ranks_byte_for_byte(case):
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("plain", "rollout", i) for i in range(TP)]
    results = launch([trainer, rollout, rollout], roles, args=(case,), timeout=600)
    for res in results[1:]:
        for equal in res.value["equal"]:
            assert equal and all(equal.values()), [p for p, ok in equal.items() if not ok]
        assert res.value["fp8_params"]
    for report in results[0].value["reports"]:
        # whole 128-row blocks went as FP8 from the trainer; kv heads (64 rows a device)
        # and anything else split went bf16 to the receivers
        assert report["fp8_sent"] > 0 and report["fp8_world"] > 0
        assert report["fp8_sent"] + report["bf16_sent"] <= report["unquantized_world"]
