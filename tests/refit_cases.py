"""Functions the multi-process refit tests launch (module level, so children import them).

Every tensor's global value is a deterministic pattern of its name, so each process can
check the bytes it holds without ever assembling a global array across processes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from xreshard.tools.testing import numpy_dtype

#: name -> (shape, jax spec on mesh ("a", "b"), torch placements on a 1-d mesh, flags)
#: flags: "T" = the JAX side holds an [in, out] kernel of this [out, in] tensor
JAX_TORCH_TENSORS = {
    "replicated": ((6, 5), (), ["R"], ""),
    "shard_dim0": ((8, 6), ("a",), ["S0"], ""),
    "shard_dim1": ((8, 6), (None, "b"), ["S1"], ""),
    "two_axes_one_dim": ((16, 4), (("a", "b"),), ["S0"], ""),
    "uneven_chunk": ((7, 3), (), ["S0"], ""),
    "uneven_dim1": ((4, 10), (None, "b"), ["S1"], ""),
    "strided": ((12, 4), ("b",), ["SS0/2"], ""),
    "kernel": ((8, 6), ("a", "b"), ["S0"], "T"),
    "bias": ((8,), ("b",), ["R"], ""),
}


def pattern(name: str, shape: tuple[int, ...], dtype: str, step: int = 0) -> np.ndarray:
    """The global value of tensor ``name`` at refit ``step`` (exact in bf16 too)."""
    seed = int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:4], "little")
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(dtype))


def _torch_group(ctx: Any, members: int, rank: int, prefix: str) -> None:
    """A default process group among this group's torch processes, over the launch store."""
    import torch.distributed as dist
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    # under the world id too: a process that runs several worlds in a row (``series``)
    # forms a fresh group for each
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{ctx.world_id}/{prefix}/", store),
                            rank=rank, world_size=members)


def series(ctx: Any, programs: list) -> dict:
    """Run several cases one after another in this process, each in its own world (world
    id = the case's name), so one launch serves them all: ``programs`` holds ``[name,
    trainer function, rollout function, args]`` (functions of this module by name). Returns
    name -> ``{"value": ...}`` or ``{"error": traceback}``; a failed case does not stop the
    next (its world times out on the other processes, bounded by its refit timeout)."""
    return run_series(ctx, programs, globals())


def run_series(ctx: Any, programs: list, functions: dict) -> dict:
    """:func:`series` over the functions of another case module (its ``globals()``)."""
    import dataclasses
    import traceback

    out: dict = {}
    for name, trainer_fn, rollout_fn, args in programs:
        fn = functions[trainer_fn if ctx.role.group == "trainer" else rollout_fn]
        try:
            out[name] = {"value": fn(dataclasses.replace(ctx, world_id=name), *args)}
        except Exception:   # noqa: BLE001 - the test reports it under the case's name
            out[name] = {"error": traceback.format_exc()}
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return out


def _jax_params(names: dict, dtype: str, step: int, mesh_shape=(2, 2)) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh(mesh_shape, ("a", "b"), devices=jax.local_devices())
    params = {}
    for name, (shape, spec, _, flags) in names.items():
        value = pattern(name, shape, dtype, step)
        if "T" in flags:
            value = np.ascontiguousarray(value.T)          # the [in, out] kernel
            spec = tuple(reversed(spec + (None,) * (2 - len(spec))))
        params[name] = jax.device_put(value, NamedSharding(mesh, P(*spec)))
    return params


def _dtensors(names: dict, dtype: str, world_size: int, step: int | None) -> dict:
    """DTensors on a 1-d mesh of this torch group: the pattern (step given) or zeros."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from xreshard.adapters.torch import placements_of
    from xreshard.ir.layout import Layout, Mesh
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (world_size,))
    me = dist.get_rank()
    out = {}
    for name, (shape, _, placements, _) in names.items():
        layout = Layout.from_placements(shape, dtype, Mesh((world_size,)), placements)
        local_shape = layout.local_shape(me)
        if step is None:
            local = torch.zeros(local_shape, dtype=getattr(torch, dtype))
        else:
            from xreshard.tools.testing import local_arrays_from_global
            arr = local_arrays_from_global(layout, me, pattern(name, shape, dtype, step))
            local = _to_torch(arr, dtype)
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        out[name] = DTensor.from_local(local, mesh, placements_of(layout), shape=torch.Size(shape),
                                       stride=stride, run_check=False)
    return out


def _to_torch(arr: np.ndarray, dtype: str) -> Any:
    import torch
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _check_dtensors(state: dict, names: dict, dtype: str, step: int, src_dtype: str) -> int:
    """Bit-compare every local shard with the pattern (cast from the source dtype)."""
    import torch
    from xreshard.adapters.torch import tensor_view
    from xreshard.ir.layout import Layout, Mesh
    import torch.distributed as dist

    me, n = dist.get_rank(), dist.get_world_size()
    checked = 0
    for name, (shape, _, placements, _) in names.items():
        layout = Layout.from_placements(shape, dtype, Mesh((n,)), placements)
        from xreshard.tools.testing import local_arrays_from_global
        want = local_arrays_from_global(
            layout, me, pattern(name, shape, src_dtype, step).astype(numpy_dtype(dtype)))
        got = tensor_view(state[name].to_local())
        if got.tobytes() != np.ascontiguousarray(want).tobytes():
            raise AssertionError(f"{name}: rank {me} holds wrong bytes")
        checked += got.size
    return checked


# ---------------------------------------------------------------------------- JAX -> torch

def jax_sender(ctx: Any, src_dtype: str, dst_dtype: str, steps: int, wire: Any = None,
               config: dict | None = None) -> dict:
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, send=_jax_params(JAX_TORCH_TENSORS, src_dtype, 0),
                     transpose={n for n, t in JAX_TORCH_TENSORS.items() if "T" in t[3]},
                     config=xr.RefitConfig(wire_dtype=wire, timeout=60, **(config or {})))
    reports = []
    for step in range(steps):
        with xr.count_comm() as counts:
            report = refit(send=_jax_params(JAX_TORCH_TENSORS, src_dtype, step))
        reports.append({"sent": report.bytes_sent, "world": report.bytes_moved_world,
                        "replanned": report.replanned, "counted": counts.as_json()})
    stats = refit.plan.stats
    world.close()
    return {"reports": reports, "bytes_moved": stats.bytes_moved, "bytes_min": stats.bytes_min}


def torch_receiver(ctx: Any, src_dtype: str, dst_dtype: str, steps: int, wire: Any = None,
                   config: dict | None = None) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    members = sum(r.group == "rollout" for r in ctx.roles)
    _torch_group(ctx, members, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    state = _dtensors(JAX_TORCH_TENSORS, dst_dtype, members, None)
    refit = xr.Refit(world, receive=state,
                     config=xr.RefitConfig(wire_dtype=wire, timeout=60, **(config or {})))
    checked = 0
    for step in range(steps):
        with xr.count_comm() as counts:
            report = refit()
        checked += _check_dtensors(state, JAX_TORCH_TENSORS, dst_dtype, step, src_dtype)
        assert refit.version == step + 1
    world.close()
    dist.destroy_process_group()
    return {"checked": checked, "received": report.bytes_received, "version": refit.version,
            "counted": counts.as_json()}


# ---------------------------------------------------------------------------- naming rules

#: trainer path -> (JAX shape, spec on mesh ("a", "b")); HF name -> (shape, from the JAX value)
RULES_TREE = {"layers/0/attn/q/kernel": ((8, 4, 2), (None, "b")),     # [D, H, hd]
              "layers/0/mlp/up/kernel": ((8, 6), ("a",)),               # [D, I]
              "final_norm/scale": ((8,), ())}
RULES_HF = {"model.layers.0.self_attn.q_proj.weight":
            ((8, 8), "layers/0/attn/q/kernel", lambda x: x.reshape(8, 8).T),
            "model.layers.0.mlp.up_proj.weight": ((6, 8), "layers/0/mlp/up/kernel", lambda x: x.T),
            "model.norm.weight": ((8,), "final_norm/scale", lambda x: x)}


def _rules() -> Any:
    from xreshard.adapters.naming import NameMap, Reshape, Rule, Transpose
    return NameMap([Rule("layers/{l}/attn/q/kernel", "model.layers.{l}.self_attn.q_proj.weight",
                         (Reshape(("@0", -1)), Transpose())),
                    Rule("layers/{l}/mlp/up/kernel", "model.layers.{l}.mlp.up_proj.weight",
                         (Transpose(),)),
                    Rule("final_norm/scale", "model.norm.weight")])


def jax_rules_sender(ctx: Any, steps: int) -> dict:
    """A JAX tree under trainer paths, mapped onto HF tensors by ``Refit(rules=...)``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def tree(step: int) -> dict:
        out: dict = {}
        for path, (shape, spec) in RULES_TREE.items():
            node = out
            *parents, leaf = path.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = jax.device_put(pattern(path, shape, "float32", step),
                                        NamedSharding(mesh, P(*spec)))
        out["layers"] = [out["layers"]["0"]]
        return out
    refit = xr.Refit(world, send=tree(0), rules=_rules(), config=xr.RefitConfig(timeout=60))
    reports = [refit(send=tree(step)) for step in range(steps)]
    world.close()
    return {"replanned": [r.replanned for r in reports], "names": sorted(refit.plan.src_layouts)}


def torch_rules_receiver(ctx: Any, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xreshard as xr
    from xreshard.adapters.torch import tensor_view

    members = sum(r.group == "rollout" for r in ctx.roles)
    _torch_group(ctx, members, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    mesh = init_device_mesh("cpu", (members,))
    me = dist.get_rank()
    state = {}
    for name, (shape, _, _) in RULES_HF.items():
        rows = shape[0] // members
        state[name] = DTensor.from_local(torch.zeros((rows,) + shape[1:]), mesh, [Shard(0)],
                                         run_check=False)
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60))
    for step in range(steps):
        refit()
        for name, (shape, path, hf) in RULES_HF.items():
            full = hf(pattern(path, RULES_TREE[path][0], "float32", step))
            rows = shape[0] // members
            want = np.ascontiguousarray(full[me * rows:(me + 1) * rows])
            got = tensor_view(state[name].to_local())
            assert got.tobytes() == want.tobytes(), (name, step)
    world.close()
    dist.destroy_process_group()
    return {"version": refit.version}


# ---------------------------------------------------------------------------- torch -> JAX

def torch_sender(ctx: Any, steps: int) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    members = sum(r.group == "rollout" for r in ctx.roles)
    _torch_group(ctx, members, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"])
    refit = xr.Refit(world, config=xr.RefitConfig(timeout=60))
    for step in range(steps):
        refit(send=_dtensors(JAX_TORCH_TENSORS, "float32", members, step))
    world.close()
    dist.destroy_process_group()
    return {"version": refit.version}


def jax_receiver(ctx: Any, steps: int) -> dict:
    import jax
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    template = _jax_params(JAX_TORCH_TENSORS, "float32", 99)
    refit = xr.Refit(world, receive=template,
                     transpose={n for n, t in JAX_TORCH_TENSORS.items() if "T" in t[3]},
                     config=xr.RefitConfig(timeout=60))
    for step in range(steps):
        refit()
        got = refit.received
        for name, (shape, spec, _, flags) in JAX_TORCH_TENSORS.items():
            want = pattern(name, shape, "float32", step)
            arr = got[name]
            assert arr.sharding == template[name].sharding
            value = np.asarray(arr)
            if "T" in flags:
                value = value.T
            assert value.tobytes() == np.ascontiguousarray(want).tobytes(), name
        # the template (a live JAX array) was never written
        assert not np.array_equal(np.asarray(template["shard_dim0"]),
                                  pattern("shard_dim0", (8, 6), "float32", step))
    world.close()
    return {"version": refit.version, "devices": len(jax.local_devices())}


# ---------------------------------------------------------------------------- JAX -> JAX, torch -> torch

JAX_JAX_TENSORS = {
    "w": ((8, 12), ("a", "b"), None, ""),
    "v": ((12,), (("b", "a"),), None, ""),
    "r": ((3, 4), (), None, ""),
}


def jax_to_jax(ctx: Any) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(timeout=60)
    if ctx.role.group == "trainer":
        refit = xr.Refit(world, send=_jax_params(JAX_JAX_TENSORS, "bfloat16", 3, (1, 2)),
                         config=config)
        refit()
        return {"version": refit.version}
    mesh = jax.make_mesh((2, 1), ("a", "b"), devices=jax.local_devices())
    template = {
        "w": jax.ShapeDtypeStruct((8, 12), jax.numpy.bfloat16,
                                  sharding=NamedSharding(mesh, P(None, "a"))),
        "v": jax.ShapeDtypeStruct((12,), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P("a"))),
        "r": jax.ShapeDtypeStruct((3, 4), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P())),
    }
    refit = xr.Refit(world, receive=template, config=config)
    refit()
    for name, (shape, _, _, _) in JAX_JAX_TENSORS.items():
        got = np.asarray(refit.received[name])
        assert got.tobytes() == pattern(name, shape, "bfloat16", 3).tobytes(), name
    return {"version": refit.version}


TORCH_TORCH_TENSORS = {
    "w": ((10, 6), None, ["S0"], ""),
    "u": ((5, 7), None, ["S1"], ""),
    "r": ((4,), None, ["R"], ""),
}
TORCH_TORCH_DST = {
    "w": ((10, 6), None, ["S1"], ""),
    "u": ((5, 7), None, ["SS1/2"], ""),
    "r": ((4,), None, ["S0"], ""),
}


def torch_to_torch(ctx: Any) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    group = ctx.role.group
    members = sum(r.group == group for r in ctx.roles)
    _torch_group(ctx, members, ctx.role.index, group)
    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(timeout=60)
    if group == "trainer":
        refit = xr.Refit(world, send=_dtensors(TORCH_TORCH_TENSORS, "float32", members, 5),
                         config=config)
        refit()
    else:
        state = _dtensors(TORCH_TORCH_DST, "float32", members, None)
        refit = xr.Refit(world, receive=state, config=config)
        refit()
        _check_dtensors(state, TORCH_TORCH_DST, "float32", 5, "float32")
    world.close()
    dist.destroy_process_group()
    return {"version": refit.version}


# ---------------------------------------------------------------------------- bad input, dead peers

BAD_SRC = {"a": ((4, 4), (), ["S0"], ""), "b": ((6,), (), ["R"], ""), "c": ((2, 2), (), ["R"], "")}


def _attempt(refit: Any) -> str:
    try:
        refit()
    except Exception as e:   # every rank must raise, and the same error
        return f"{type(e).__name__}: {e}"
    return "no error"


def bad_inputs(ctx: Any) -> dict:
    """Several refused refits in a row; returns each one's error as this process saw it."""
    import torch
    import torch.distributed as dist
    import xreshard as xr
    from xreshard.ir.layout import Layout

    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(timeout=30)
    trainer = ctx.role.group == "trainer"
    out = {}
    if not trainer:
        _torch_group(ctx, sum(r.group == "rollout" for r in ctx.roles), ctx.role.index, "rollout")
    good = _jax_params(BAD_SRC, "float32", 0) if trainer else None

    def receiver(**changes):
        state = _dtensors(BAD_SRC, "float32", dist.get_world_size(), None)
        for name, value in changes.items():
            if value is None:
                del state[name]
            else:
                state[name] = value
        return state

    # 1. names missing on either side
    if trainer:
        refit = xr.Refit(world, send={k: v for k, v in good.items() if k != "c"}, config=config)
    else:
        refit = xr.Refit(world, receive=receiver(b=None), config=config)
    out["names"] = _attempt(refit)
    # 2. shape mismatch
    if trainer:
        refit = xr.Refit(world, send=good, config=config)
    else:
        mesh = _dtensors({"x": ((5, 4), (), ["S0"], "")}, "float32", dist.get_world_size(), None)
        refit = xr.Refit(world, receive=receiver(a=mesh["x"]), config=config)
    out["shape"] = _attempt(refit)
    # 3. dtype mismatch without a cast
    if trainer:
        refit = xr.Refit(world, send=good, config=config)
    else:
        half = _dtensors({"c": ((2, 2), (), ["R"], "")}, "bfloat16", dist.get_world_size(), None)
        refit = xr.Refit(world, receive=receiver(c=half["c"]), config=config)
    out["dtype"] = _attempt(refit)
    # 4. a destination region no source holds: the trainer describes only half of 'a'
    if trainer:
        half = Layout.explicit_form((4, 4), "float32", {0: [[(0, 2), (0, 4)]]})
        bound = xr.Bound({"a": half}, {(0, "a"): [np.zeros((2, 4), np.float32)]})
        refit = xr.Refit(world, send=bound, config=config)
    else:
        state = receiver()
        refit = xr.Refit(world, receive={"a": state["a"]}, config=config)
    out["uncovered"] = _attempt(refit)
    # 5. after all that, a good refit still works in the same world
    if trainer:
        refit = xr.Refit(world, send=good, config=config)
    else:
        state = receiver()
        refit = xr.Refit(world, receive=state, config=config)
    out["good"] = _attempt(refit)
    if not trainer:
        _check_dtensors(state, BAD_SRC, "float32", 0, "float32")
        dist.destroy_process_group()
    world.close()
    return out


def die_after_first_unpack(kill: bool = False) -> None:
    """Patch this process's executor to exit hard (code 3, or SIGKILL) at its second
    unpack: some bytes moved, the rest never will."""
    import os
    import signal
    from xreshard.runtime import execute

    unpack = execute.Executor._unpack
    calls = []

    def die_after_first(self, b, buf):
        calls.append(b)
        if len(calls) > 1:
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        return unpack(self, b, buf)

    execute.Executor._unpack = die_after_first
    execute.Executor._zero_copy_recv = lambda self, b: None   # make it unpack


def dies_mid_refit(ctx: Any, timeout: float) -> dict:
    """rollout[1] exits hard after its first round; the others must raise within the timeout."""
    import time
    import torch.distributed as dist
    import xreshard as xr

    tensors = {"big": ((512, 256), ("a", "b"), ["S1"], "")}
    world = ctx.join(groups=["trainer", "rollout"])
    # a first refit with a generous timeout: slow starts on a loaded machine are not the test
    warm = dict(bucket_bytes=1 << 16, staging_bytes=1 << 17)
    config = xr.RefitConfig(timeout=timeout, **warm)
    if ctx.role.group == "trainer":
        params = _jax_params(tensors, "float32", 0)
        xr.Refit(world, send=params, config=xr.RefitConfig(timeout=120, **warm))()
        refit = xr.Refit(world, send=params, config=config)
    else:
        _torch_group(ctx, sum(r.group == "rollout" for r in ctx.roles), ctx.role.index, "rollout")
        state = _dtensors(tensors, "float32", dist.get_world_size(), None)
        xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=120, **warm))()
        refit = xr.Refit(world, receive=state, config=config)
        if ctx.role.index == 1:
            die_after_first_unpack()
    t0 = time.monotonic()
    error = _attempt(refit)
    return {"error": error, "seconds": time.monotonic() - t0, "version": refit.version,
            "stale": refit.stale}


def gpu_jax_to_torch(ctx: Any) -> dict:
    """One GPU per process: JAX (1 device) sends a sharded tensor to torch on the other GPU."""
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    value = pattern("g", (256, 128), "float32", 0)
    if ctx.role.group == "trainer":
        import jax
        refit = xr.Refit(world, send={"g": jax.device_put(value, jax.devices("gpu")[0])})
        refit()
        return {"ok": True}
    import torch
    from xreshard.adapters.torch import tensor_view
    out = torch.zeros((256, 128), device="cuda:0")
    layout = xr.Layout.replicated((256, 128), "float32", xr.Mesh((1,), (world.rank_ids[0],)))
    refit = xr.Refit(world, receive=xr.Bound({"g": layout},
                                             {(world.rank_ids[0], "g"): tensor_view(out)}))
    refit()
    torch.cuda.synchronize()
    return {"ok": bool(np.array_equal(out.cpu().numpy(), value))}


# ---------------------------------------------------------------------------- a third-party adapter
# (registered by module path in test_adapters_layout.py: this module is the adapter)

class Boxed:
    """A framework of one's own: a numpy array held by one world rank, whole."""

    def __init__(self, array: np.ndarray, rank: int):
        self.array, self.rank = array, rank


LABEL = "boxed arrays"


def accepts(obj: Any) -> bool:
    return isinstance(obj, Boxed)


def refit_bind(obj: Boxed, side: str, context: Any) -> Any:
    import xreshard as xr
    layout = xr.Layout.replicated(obj.array.shape, str(obj.array.dtype),
                                  xr.Mesh((1,), (obj.rank,)))
    seen.append((side, context.memo is not None, tuple(context.local_ranks)))
    return xr.Bound({"boxed": layout}, {(obj.rank, "boxed"): obj.array})


#: (side, got a memo, local ranks) per refit_bind call
seen: list = []
