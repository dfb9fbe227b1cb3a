"""vLLM's own trainer API into the xreshard backend: ``source=ModuleSource(model)``.

A torch trainer of two processes holds a Qwen2-style model as DTensors on a gloo mesh:
column-parallel weights ``Shard(0)``, row-parallel ``Shard(1)``, norms replicated, and the
embedding as FSDP-over-TP leaves it, ``_StridedShard(0, split_factor=2)``. Each trainer
process calls vLLM's ``WeightTransferTrainerFactory.trainer_init(..., source=
ModuleSource(model))`` (vLLM's own source, whose iteration all-gathers every DTensor) and
then ``send_weights()``. The engine (TP=1, CPU) must answer token for token, logprob for
logprob, as vLLM does after loading the same weights from a checkpoint; ``full_tensor`` is
made to raise in the trainers and ``count_comm`` shows each trainer sent at most its own
shards, together the model once: nothing was gathered.
"""

from __future__ import annotations

import os

import pytest

from . import vllm_cases as cases

cases.requires_vllm()

from xreshard.tools.launch import Role, launch  # noqa: E402

STRIDED = "model.embed_tokens.weight"


def _placement(name: str, ndim: int) -> object:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if name == STRIDED:
        return _StridedShard(0, split_factor=2)
    if ndim == 2:
        return Shard(1) if ("o_proj" in name or "down_proj" in name) else Shard(0)
    return Shard(0) if name.endswith("_proj.bias") else Replicate()


def _local(full, placement, rank: int, size: int):
    """What torch rank ``rank`` holds of ``full``, by torch's own per-placement math."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import (_StridedShard,
                                                          _StridedShardOffsetMode)
    if isinstance(placement, _StridedShard):
        n, offsets = placement.local_shard_size_and_offset(
            full.shape[placement.dim], size, rank, offset_mode=_StridedShardOffsetMode.ALL)
        return full[list(offsets)].contiguous()
    if isinstance(placement, Shard):
        n, offset = Shard.local_shard_size_and_offset(full.shape[placement.dim], size, rank)
        return full.narrow(placement.dim, int(offset), int(n)).contiguous()
    return full.clone()


def _module(tensors: dict):
    """An ``nn.Module`` whose ``named_parameters()`` are ``tensors`` under their HF names."""
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def module_source_trainer(ctx, tp: int, dtype: str, tmp: str) -> dict:
    """One of two torch trainer processes: DTensors, vLLM's ModuleSource, vLLM's factory."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from xreshard import count_comm
    from xreshard.adapters.vllm import XreshardTrainerInitInfo, register_backend

    from .refit_cases import _torch_group

    rank, size = ctx.role.index, 2
    _torch_group(ctx, size, rank, "trainer-pg")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("fsdp",))
    flat = cases.init_params(1, cases.tree_shapes())
    if rank == 0:
        cases.save_checkpoint(flat, os.path.join(tmp, "A"))
    placements, params = {}, {}
    for name, array in cases.hf_tensors(flat).items():
        full = torch.from_numpy(array)
        p = placements[name] = _placement(name, full.ndim)
        params[name] = DTensor.from_local(_local(full, p, rank, size), mesh, [p],
                                          run_check=False, shape=full.shape,
                                          stride=full.stride())
    local_bytes = sum(t.to_local().nbytes for t in params.values())

    def no_gather(self, *args, **kwargs):
        raise AssertionError("a DTensor was gathered (full_tensor) on the trainer")
    DTensor.full_tensor = no_gather             # vLLM's ModuleSource iteration would call it

    register_backend()              # a trainer that builds no engine registers it itself
    client = cases.StoreClient(ctx.address) if rank == 0 else None
    info = XreshardTrainerInitInfo(rank=rank, engine_world_size=1, num_trainer_processes=size,
                                   address=ctx.address, world_id="module-source",
                                   timeout=cases.REFIT_TIMEOUT, devices=1)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                       source=ModuleSource(_module(params)))
    try:
        with count_comm() as counts:
            report = engine.send_weights()
        out = {"rank": engine.rank, "version": report.version, "sent": counts.total_sent,
               "received": counts.total_received, "local_bytes": local_bytes,
               "strided": type(placements[STRIDED]).__name__, "table": str(counts)}
        dist.barrier()
        if rank == 0:
            out["check"] = client.call("check", weights_path=os.path.join(tmp, "A"))
    finally:
        if rank == 0:
            client.call("stop")
        engine.shutdown()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_vllm_module_source_from_an_fsdp_tp_trainer_loads_like_a_checkpoint(tmp_path):
    roles = [Role("torch", "trainer", 0), Role("torch", "trainer", 1),
             Role("plain", "engine", 0, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})]
    results = launch([module_source_trainer, module_source_trainer, cases.engine], roles,
                     args=(1, "float32", str(tmp_path)), timeout=420)
    t0, t1 = results[0].value, results[1].value
    assert [t0["rank"], t1["rank"]] == [0, 1] and t0["version"] == t1["version"] == 1
    assert t0["strided"] == "_StridedShard"
    check = t0["check"]
    assert check["tokens"] == check["ref_tokens"]
    assert check["logprobs_bit_equal"], check["logprobs_max_abs_diff"]
    report, = check["reports"]
    # every byte of the model crossed once, each from a trainer that held it: no trainer sent
    # more than its own shards, and none received anything (no gather on the trainer side)
    assert t0["sent"] + t1["sent"] == report["bytes_received"] == report["shard_bytes"]
    assert 0 < t0["sent"] <= t0["local_bytes"] and 0 < t1["sent"] <= t1["local_bytes"]
    assert t0["received"] == t1["received"] == 0
    assert "src -> dst" in t0["table"]


class _World:
    """The two facts source_tensors reads of a world: its processes and which one is us."""

    def __init__(self, index: int):
        self.processes = [{"group": "rollout", "index": 0, "ranks": [0]},
                          {"group": "trainer", "index": 0, "ranks": [1]},
                          {"group": "trainer", "index": 1, "ranks": [2]}]
        self.process_index = 1 + index


def test_a_source_with_vllm_033_ownership_is_bound_by_its_placements_not_gathered():
    """vLLM 0.33's contract (read from its base.py): ParamMeta owners / mesh_shape /
    placements of Shard / Replicate, iter_local() yielding each owner's piece."""
    import types

    import torch
    from xreshard.adapters.torch import Sharded
    from xreshard.adapters.vllm.source import is_weight_source, source_tensors
    from xreshard.ir.layout import Layout

    Shard = type("Shard", (), {"__init__": lambda self, dim: setattr(self, "dim", dim)})
    Replicate = type("Replicate", (), {})
    full = torch.arange(24.0).reshape(6, 4)

    class Source:
        metadata = [types.SimpleNamespace(name="w", dtype=torch.float32, shape=(6, 4),
                                          owners=(0, 1), mesh_shape=(2,), placements=(Shard(1),)),
                    types.SimpleNamespace(name="norm", dtype=torch.float32, shape=(4,),
                                          owners=(0, 1), mesh_shape=(2,),
                                          placements=(Replicate(),))]

        def __init__(self, rank):
            self.rank = rank

        def implements_iter_local(self):
            return True

        def iter_local(self):
            yield "w", full[:, 2 * self.rank:2 * self.rank + 2]
            yield "norm", torch.ones(4)

    assert is_weight_source(Source(0))
    for rank in (0, 1):
        tensors, shapes = source_tensors(Source(rank), _World(rank))
        assert shapes == {"w": (6, 4), "norm": (4,)}
        w = tensors["w"]
        assert isinstance(w, Sharded) and w.placements == ("S1",) and w.mesh.ranks == (1, 2)
        layout = Layout.from_placements(w.shape, "float32", w.mesh, w.placements)
        assert layout.local_shape(1 + rank) == tuple(w.local.shape) == (6, 2)
        assert torch.equal(tensors["norm"], torch.ones(4))      # replicated: a whole copy


def test_a_source_yielding_a_name_it_does_not_own_is_refused():
    import types

    import torch
    from xreshard.adapters.vllm.source import source_tensors
    from xreshard.errors import RefitError

    class Source:
        metadata = [types.SimpleNamespace(name="w", dtype=torch.float32, shape=(2,),
                                          owners=(1,), mesh_shape=None, placements=None)]

        def implements_iter_local(self):
            return True

        def iter_local(self):
            yield "w", torch.zeros(2)

    with pytest.raises(RefitError, match=r"trainer rank 0 yielded 'w', owned by trainer ranks \[1\]"):
        source_tensors(Source(), _World(0))
