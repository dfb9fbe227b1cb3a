"""``xreshard demo``: train in JAX, refit into torch DTensors, check every byte.

One launch (:func:`xreshard.tools.launch.launch`) starts a small RL-style pair of jobs on CPU:

* a JAX trainer: one process with 4 CPU devices on a ``(fsdp=2, tp=2)`` mesh, holding a
  small decoder-only transformer written directly in JAX (Flax-style ``[in, out]``
  kernels) and training it for real with optax Adam on a next-token loss;
* an inference side: ``--torch-procs`` torch processes (default 2) holding the same weights
  as DTensors on a TP mesh over a gloo default group, under HF names.

After the initial refit and after every ``--steps`` optimizer steps the trainer refits the
weights shard to shard. Each time, for every torch rank and tensor, the trainer hashes the
bytes that rank must hold (from its own global values, cast like the wire) and each torch
process hashes what it does hold; the hashes meet through ``World.allgather_json`` and any
difference fails the demo. The torch side also runs a tensor-parallel greedy generation
from the received shards, so the tokens change as training proceeds.

Layouts (canonical HF shapes are ``[out, in]``; ``V=513`` so the vocab dim splits unevenly
on torch, and the JAX side replicates it because JAX needs even splits)::

    # tensor                   | JAX stored, PartitionSpec      | torch (TP=2)
    # model.embed_tokens       | [V, H]  P(None, (fsdp, tp))    | Shard(0): 257 + 256 rows
    # self_attn.{q,k,v}_proj   | [H, H]^T P(fsdp, tp)           | Shard(0) (column parallel)
    # self_attn.o_proj         | [H, H]^T P(tp, fsdp)           | Shard(1) (row parallel)
    # mlp.{gate,up}_proj       | [H, I]^T P(fsdp, tp)           | Shard(0)
    # mlp.down_proj            | [I, H]^T P(tp, fsdp)           | Shard(1)
    # *_layernorm              | [H]     P()                    | Replicate()
    # model.norm               | [H]     P(tp)                  | Replicate()
    # lm_head                  | [H, V]^T P(fsdp, None)         | Shard(0): 257 + 256 rows

(``^T``: a Flax kernel, refit through ``transpose=``.)

Run it as ``xreshard demo`` or ``python -m xreshard.tools.demo``; ``main(argv)`` returns the exit
code (0: every tensor bit-exact on every rank after every refit).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["DemoConfig", "TensorSpec", "add_arguments", "chunk_bounds", "forward", "main",
           "nest", "run", "run_demo", "tensor_specs", "torch_local"]

#: world group order: trainer ranks first (0..3), then one rank per torch process
GROUPS = ("trainer", "rollout")
#: the tensor a ``--corrupt`` run damages on the last torch rank, after the first refit
CORRUPT_TENSOR = "model.layers.0.mlp.down_proj.weight"
_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo's processes need; crosses to them as JSON."""

    vocab: int = 513
    """Vocabulary size; odd, so torch's vocab-parallel shards are uneven."""
    hidden: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (no positional encoding: a causal mask is enough for the toy task)."""
    intermediate: int = 344
    """MLP width."""
    steps: int = 10
    """Optimizer steps between two refits."""
    refits: int = 3
    """Refits in all: the initial one, then one after every ``steps`` steps."""
    torch_procs: int = 2
    """Torch processes, one rank each; the torch TP degree."""
    dtype: str = "float32"
    """Parameter dtype on the trainer."""
    wire_dtype: str | None = None
    """Cast to this dtype on the sender; the torch DTensors hold it. None: ``dtype``."""
    batch: int = 16
    """Sequences per training batch."""
    seq_len: int = 32
    """Tokens per training sequence."""
    learning_rate: float = 1e-2
    """Adam's learning rate."""
    gen_tokens: int = 8
    """Tokens the torch side generates greedily after each refit (0: none)."""
    seed: int = 0
    """Seeds the weights, the toy language and the batches."""
    timeout: float = 120.0
    """Seconds for the whole launch, and for any single wait inside a refit."""
    corrupt: bool = False
    """Test hook: flip one received byte on the last torch rank after the first refit."""
    events: str | None = None
    """A file every process appends its progress to, one JSON line per event (set by
    :func:`run_demo`, which prints them as they come); None: no events."""

    def __post_init__(self) -> None:
        for dtype in (self.dtype, self.wire_dtype):
            if dtype is not None and dtype not in _DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {_DTYPES}")
        if self.hidden % 4 or self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} must divide by num_heads {self.num_heads} "
                             "and by 4 (the JAX mesh shards it 4 ways)")
        if self.intermediate % 2 or self.batch % 2:
            raise ValueError(f"intermediate ({self.intermediate}) and batch ({self.batch}) must "
                             "be even: the JAX mesh splits them 2 ways")
        if self.torch_procs < 1 or self.refits < 1 or self.steps < 0:
            raise ValueError("need torch_procs >= 1, refits >= 1 and steps >= 0, got "
                             f"{self.torch_procs}, {self.refits}, {self.steps}")

    @property
    def dst_dtype(self) -> str:
        """The dtype the torch side holds (what crosses the wire)."""
        return self.wire_dtype or self.dtype

    @property
    def can_generate(self) -> bool:
        """Whether the torch TP forward works: each rank must hold whole attention heads."""
        return self.gen_tokens > 0 and self.num_heads % self.torch_procs == 0


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the demo model, on both sides.

    Attributes:
        path: its JAX pytree path (Flax-style names).
        name: its canonical (HF) name, also the torch state-dict key.
        shape: canonical shape, ``[out, in]`` for weights.
        jax_spec: PartitionSpec entries of the stored JAX array on mesh ("fsdp", "tp").
        transpose: the JAX side stores the ``[in, out]`` kernel.
        torch: the torch placement in canonical dims: "S0", "S1" or "R".
    """

    path: str
    name: str
    shape: tuple[int, ...]
    jax_spec: tuple
    transpose: bool
    torch: str

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def tensor_specs(cfg: DemoConfig) -> list[TensorSpec]:
    """Every tensor of the model: JAX path, HF name, shapes and both sides' shardings."""
    V, H, I = cfg.vocab, cfg.hidden, cfg.intermediate
    col, row = ("fsdp", "tp"), ("tp", "fsdp")     # specs of [in, out] kernels
    specs = [TensorSpec("embed/embedding", "model.embed_tokens.weight", (V, H),
                        (None, ("fsdp", "tp")), False, "S0")]
    for i in range(cfg.num_layers):
        jp, hf = f"layers_{i}", f"model.layers.{i}"
        for n in "qkv":
            specs.append(TensorSpec(f"{jp}/attn/{n}_proj/kernel", f"{hf}.self_attn.{n}_proj.weight",
                                    (H, H), col, True, "S0"))
        specs += [
            TensorSpec(f"{jp}/attn/o_proj/kernel", f"{hf}.self_attn.o_proj.weight", (H, H), row,
                       True, "S1"),
            TensorSpec(f"{jp}/mlp/gate_proj/kernel", f"{hf}.mlp.gate_proj.weight", (I, H), col,
                       True, "S0"),
            TensorSpec(f"{jp}/mlp/up_proj/kernel", f"{hf}.mlp.up_proj.weight", (I, H), col,
                       True, "S0"),
            TensorSpec(f"{jp}/mlp/down_proj/kernel", f"{hf}.mlp.down_proj.weight", (H, I), row,
                       True, "S1"),
            TensorSpec(f"{jp}/input_norm/scale", f"{hf}.input_layernorm.weight", (H,), (),
                       False, "R"),
            TensorSpec(f"{jp}/post_attn_norm/scale", f"{hf}.post_attention_layernorm.weight",
                       (H,), (), False, "R"),
        ]
    specs += [TensorSpec("final_norm/scale", "model.norm.weight", (H,), ("tp",), False, "R"),
              # the vocab dim (513) cannot split evenly: JAX replicates it, torch chunks it
              TensorSpec("lm_head/kernel", "lm_head.weight", (V, H), ("fsdp", None), True, "S0")]
    return specs


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of ``torch.chunk``'s block ``index`` of ``n`` rows in ``parts``.

    Written out here, not taken from xreshard's layouts, so the trainer's expected bytes do
    not depend on the code under demonstration. ``n=513, parts=2``::

        # index | rows
        #     0 | [0, 257)
        #     1 | [257, 513)
    """
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def torch_local(value: np.ndarray, placement: str, parts: int, index: int) -> np.ndarray:
    """What torch rank ``index`` of ``parts`` holds of the canonical ``value``."""
    if placement == "R":
        return value
    dim = int(placement[1:])
    start, stop = chunk_bounds(value.shape[dim], parts, index)
    return value[start:stop] if dim == 0 else value[:, start:stop]


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _event(cfg: DemoConfig, who: str, kind: str, **data: Any) -> None:
    """Append one progress event to ``cfg.events`` (one short JSON line: an O_APPEND
    write, so the processes' lines never interleave)."""
    if cfg.events is None:
        return
    line = json.dumps({"t": time.time(), "who": who, "kind": kind, **data}) + "\n"
    with open(cfg.events, "a") as f:
        f.write(line)


# ---------------------------------------------------------------------------- the model

def _rms(x: Any, w: Any, xp: Any) -> Any:
    return x / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * w


def forward(params: dict, tokens: Any, cfg: DemoConfig, xp: Any) -> Any:
    """Logits ``[B, T, V]`` of the decoder, for ``xp`` = ``jax.numpy`` or ``numpy``.

    One definition serves training (jnp) and the trainer's reference generation (numpy).
    It computes in float32 whatever the parameter dtype (bf16 weights, fp32 math).
    """
    def f32(a: Any) -> Any:
        return a.astype(xp.float32)

    B, T = tokens.shape
    nh, hd = cfg.num_heads, cfg.hidden // cfg.num_heads
    causal = xp.tril(xp.ones((T, T), dtype=bool))
    x = f32(params["embed"]["embedding"])[tokens]
    for i in range(cfg.num_layers):
        layer = params[f"layers_{i}"]
        attn, mlp = layer["attn"], layer["mlp"]
        h = _rms(x, f32(layer["input_norm"]["scale"]), xp)
        q, k, v = ((h @ f32(attn[f"{n}_proj"]["kernel"])).reshape(B, T, nh, hd) for n in "qkv")
        s = xp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        s = xp.where(causal, s, -1e9)
        p = xp.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        o = xp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, T, cfg.hidden)
        x = x + o @ f32(attn["o_proj"]["kernel"])
        h = _rms(x, f32(layer["post_attn_norm"]["scale"]), xp)
        g = h @ f32(mlp["gate_proj"]["kernel"])
        x = x + (g / (1 + xp.exp(-g)) * (h @ f32(mlp["up_proj"]["kernel"]))) @ f32(
            mlp["down_proj"]["kernel"])
    return _rms(x, f32(params["final_norm"]["scale"]), xp) @ f32(params["lm_head"]["kernel"])


def _toy_language(cfg: DemoConfig) -> tuple[np.ndarray, int]:
    """The training data's rule (token t is followed by ``successor[t]``) and a prompt.

    A fixed successor map makes the loss fall within a few steps and shows in the greedy
    tokens, so a refit visibly changes what the torch side generates.
    """
    rng = np.random.default_rng(cfg.seed + 1)
    return rng.permutation(cfg.vocab), int(rng.integers(cfg.vocab))


def _batch(cfg: DemoConfig, successor: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    seq: np.ndarray = np.empty((cfg.batch, cfg.seq_len + 1), np.int32)
    seq[:, 0] = rng.integers(cfg.vocab, size=cfg.batch)
    for t in range(cfg.seq_len):
        seq[:, t + 1] = successor[seq[:, t]]
    return seq


def _init_params(cfg: DemoConfig, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Host values of every stored JAX array, by path (norm scales start at one)."""
    rng = np.random.default_rng(cfg.seed)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        if s.path.endswith("/scale"):
            out[s.path] = np.ones(s.stored_shape, np.float32)
        else:
            out[s.path] = (rng.standard_normal(s.stored_shape) * 0.05).astype(np.float32)
    return out


def nest(flat: dict[str, Any]) -> dict:
    """The model's pytree from ``{"a/b/c": value}`` paths (what :func:`forward` takes)."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _greedy(next_token: Any, prompt: int, num: int) -> list[int]:
    """``prompt`` and ``num`` tokens after it, each ``next_token(tokens so far)``."""
    tokens = [prompt]
    for _ in range(num):
        tokens.append(int(next_token(tokens)))
    return tokens


# ---------------------------------------------------------------------------- trainer

def _trainer(ctx: Any, cfg: DemoConfig) -> dict:
    """The JAX process: train, refit, compute the expected hashes, compare."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import xreshard as xr
    from xreshard.adapters.jax import tree_names
    from xreshard.dtypes import numpy_dtype

    _event(cfg, "trainer", "ready", devices=len(jax.local_devices()))
    world = ctx.join(groups=GROUPS, timeout=cfg.timeout)
    rollout_ranks = world.group_ranks("rollout")
    _event(cfg, "trainer", "joined", processes=len(world.processes))
    # Auto axes: jit's sharding propagation partitions the model, as in a usual trainer.
    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), (AxisType.Auto,) * 2,
                         devices=jax.local_devices())
    specs = tensor_specs(cfg)
    by_path = {s.path: s for s in specs}
    dtype = numpy_dtype(cfg.dtype)
    dst_dtype = numpy_dtype(cfg.dst_dtype)
    shardings = nest({s.path: NamedSharding(mesh, P(*s.jax_spec)) for s in specs})
    host_params: dict[str, np.ndarray] = {p: v.astype(dtype)
                                          for p, v in _init_params(cfg, specs).items()}
    params = jax.device_put(nest(host_params), shardings)

    optimizer = optax.adam(cfg.learning_rate)
    replicated = NamedSharding(mesh, P())
    # Left alone, optax puts its state on one device; FSDP-style, Adam's moments are
    # sharded like their params (a leaf whose path ends with a param's path) and the
    # step count is replicated.
    param_sharding = {tuple(path): sh for path, sh
                      in jax.tree_util.tree_flatten_with_path(shardings)[0]}

    def state_sharding(path: tuple, _: Any) -> Any:
        return next((param_sharding[path[i:]] for i in range(len(path))
                     if path[i:] in param_sharding), replicated)
    opt_shardings = jax.tree_util.tree_map_with_path(
        state_sharding, jax.eval_shape(optimizer.init, params))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    data_sharding = NamedSharding(mesh, P("fsdp"))

    def loss_fn(p: dict, batch: Any) -> Any:
        logits = forward(p, batch[:, :-1], cfg, jnp)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def _step(p: dict, state: Any, batch: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    # Pinned output shardings keep every refit's layouts equal to the first one's, so the
    # refit plans once and reuses the plan.
    step = jax.jit(_step, out_shardings=(shardings, opt_shardings, replicated))

    successor, prompt = _toy_language(cfg)
    data_rng = np.random.default_rng(cfg.seed + 2)
    refit = xr.Refit(world, send=params, names={s.path: s.name for s in specs},
                     transpose={s.name for s in specs if s.transpose},
                     config=xr.RefitConfig(wire_dtype=cfg.wire_dtype, timeout=cfg.timeout))
    records = []
    steps_done, loss = 0, None
    for r in range(cfg.refits):
        if r > 0:
            _event(cfg, "trainer", "training", steps=cfg.steps, first=r == 1)
            for _ in range(cfg.steps):
                batch = jax.device_put(_batch(cfg, successor, data_rng), data_sharding)
                params, opt_state, loss_arr = step(params, opt_state, batch)
                steps_done += 1
            loss = float(loss_arr) if cfg.steps else loss
        _event(cfg, "trainer", "refit-start", refit=r + 1, steps=steps_done)
        report = refit(send=params)

        # Verification only: the trainer's own global values, cast like the wire.
        host = {path: np.asarray(arr).astype(dst_dtype) for path, arr in tree_names(params)}
        canonical = {by_path[path].name: value.T if by_path[path].transpose else value
                     for path, value in host.items()}
        expected = {str(rank): {s.name: _sha(torch_local(canonical[s.name], s.torch,
                                                         cfg.torch_procs, i))
                                for s in specs}
                    for i, rank in enumerate(rollout_ranks)}
        ref_tokens = None
        if cfg.can_generate:
            # what the received weights should generate: the same bytes, upcast, in numpy
            ref = nest({path: value.astype(np.float32) for path, value in host.items()})
            ref_tokens = _greedy(lambda toks: forward(ref, np.array([toks]), cfg, np)[0, -1]
                                 .argmax(), prompt, cfg.gen_tokens)

        gathered = world.allgather_json({"group": "trainer"}, timeout=cfg.timeout)
        mismatches, tokens, received = [], None, 0
        for got in gathered:
            if got["group"] != "rollout":
                continue
            rank = str(got["rank"])
            received += got["bytes_received"]
            if got["version"] != report.version:
                mismatches.append(f"rank {rank}: at version v{got['version']}, "
                                  f"trainer at v{report.version}")
            for name, digest in expected[rank].items():
                if got["hashes"].get(name) != digest:
                    mismatches.append(f"rank {rank}: {name}")
            if got["tokens"] is not None and tokens is None:
                tokens = got["tokens"]
        if received != report.bytes_moved_world:
            # bytes are conserved: the torch side received exactly what the plan moves
            mismatches.append(f"the torch ranks received {received} bytes, the plan moves "
                              f"{report.bytes_moved_world}")
        follows = (sum(int(successor[a] == b) for a, b in zip(tokens, tokens[1:]))
                   if tokens else None)
        records.append({
            "refit": r + 1, "version": report.version, "steps": steps_done, "loss": loss,
            "seconds": report.seconds, "move_seconds": report.move_seconds,
            "setup_seconds": report.setup_seconds,
            "plan_seconds": report.plan_seconds, "replanned": report.replanned,
            "bytes_moved_world": report.bytes_moved_world, "bytes_sent": report.bytes_sent,
            "bytes_forwarded": report.bytes_forwarded,
            "bytes_gather_broadcast_world": report.bytes_gather_broadcast_world,
            "num_tensors": len(specs), "num_ranks": len(rollout_ranks),
            "rollout_ranks": list(rollout_ranks),
            "mismatches": mismatches, "tokens": tokens, "ref_tokens": ref_tokens,
            "follows": follows})
        _event(cfg, "trainer", "refit", record=records[-1])
    world.close()
    return {"records": records, "rollout_ranks": list(rollout_ranks), "prompt": prompt}


# ---------------------------------------------------------------------------- torch side

def _torch_group(ctx: Any, cfg: DemoConfig) -> None:
    """The torch job's default process group (gloo) over the launch's store.

    A prefix keeps its keys apart from the refit world's, which shares the store.
    """
    import datetime

    import torch.distributed as dist
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    timeout = datetime.timedelta(seconds=cfg.timeout)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("xreshard-demo/rollout/", store),
                            rank=ctx.role.index, world_size=cfg.torch_procs, timeout=timeout)


def _torch_greedy(local: dict[str, Any], cfg: DemoConfig, prompt: int) -> list[int]:
    """Greedy tokens from a tensor-parallel forward over this rank's shards (collective).

    Column-parallel q/k/v/gate/up give each rank whole heads and an MLP slice; row-parallel
    o/down give partial sums that are all-reduced; the uneven vocab-parallel embedding and
    lm_head are combined with an all-reduce and an all-gather of each rank's best token.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    tp, me = dist.get_world_size(), dist.get_rank()
    w = {name: t.float() for name, t in local.items()}
    v0, v1 = chunk_bounds(cfg.vocab, tp, me)
    hd = cfg.hidden // cfg.num_heads

    def rms(x: Any, weight: Any) -> Any:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight

    def next_token(tokens: list[int]) -> int:
        ids = torch.tensor([tokens])
        T = ids.shape[1]
        mine = (ids >= v0) & (ids < v1)
        x = torch.zeros(1, T, cfg.hidden)
        if v1 > v0:
            x = w["model.embed_tokens.weight"][(ids - v0).clamp(0, v1 - v0 - 1)] * mine[..., None]
        dist.all_reduce(x)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])
            q, k, v = ((h @ w[f"{p}self_attn.{n}_proj.weight"].T).reshape(1, T, -1, hd)
                       for n in "qkv")
            s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            a = torch.softmax(s.masked_fill(~causal, -1e9), dim=-1)
            o = torch.einsum("bhqk,bkhd->bqhd", a, v).reshape(1, T, -1)
            o = o @ w[p + "self_attn.o_proj.weight"].T
            dist.all_reduce(o)
            x = x + o
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            y = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            y = y @ w[p + "mlp.down_proj.weight"].T
            dist.all_reduce(y)
            x = x + y
        x = rms(x[0, -1], w["model.norm.weight"])
        best = torch.tensor([-math.inf, -1.0], dtype=torch.float64)
        if v1 > v0:
            logits = w["lm_head.weight"] @ x
            best = torch.tensor([logits.max().item(), v0 + logits.argmax().item()],
                                dtype=torch.float64)
        every = [torch.empty(2, dtype=torch.float64) for _ in range(tp)]
        dist.all_gather(every, best)
        # the highest logit wins; a tie goes to the lowest token id, as argmax does
        return int(min(every, key=lambda b: (-b[0].item(), b[1].item()))[1].item())

    return _greedy(next_token, prompt, cfg.gen_tokens)


def _rollout(ctx: Any, cfg: DemoConfig) -> dict:
    """A torch process: receive into DTensors, hash every local shard, generate."""
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import xreshard as xr
    from xreshard.adapters.torch import tensor_view

    # one core per process at most: the trainer shares this machine
    torch.set_num_threads(1)
    who = f"rollout[{ctx.role.index}]"
    _event(cfg, who, "ready")
    _torch_group(ctx, cfg)
    world = ctx.join(groups=GROUPS, timeout=cfg.timeout)
    _event(cfg, who, "joined")
    mesh = init_device_mesh("cpu", (cfg.torch_procs,), mesh_dim_names=("tp",))
    placements = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    specs = tensor_specs(cfg)
    state = {s.name: dtensor.zeros(s.shape, dtype=getattr(torch, cfg.dst_dtype),
                                   device_mesh=mesh, placements=[placements[s.torch]])
             for s in specs}
    refit = xr.Refit(world, receive=state,
                     config=xr.RefitConfig(wire_dtype=cfg.wire_dtype, timeout=cfg.timeout))
    _, prompt = _toy_language(cfg)
    me = world.rank_ids[0]
    for r in range(cfg.refits):
        report = refit()
        local = {name: t.to_local() for name, t in state.items()}
        if cfg.corrupt and r == 0 and ctx.role.index == cfg.torch_procs - 1:
            # damage the received bytes themselves, as a faulty transfer would
            tensor_view(local[CORRUPT_TENSOR]).reshape(-1).view(np.uint8)[0] ^= 0x5A
        hashes = {name: _sha(tensor_view(t.contiguous())) for name, t in local.items()}
        tokens = _torch_greedy(local, cfg, prompt) if cfg.can_generate else None
        world.allgather_json({"group": "rollout", "rank": me, "version": refit.version,
                              "hashes": hashes, "tokens": tokens,
                              "bytes_received": report.bytes_received}, timeout=cfg.timeout)
    world.close()
    dist.destroy_process_group()
    return {"rank": me, "version": refit.version}


def _child(ctx: Any, cfg_dict: dict) -> dict:
    """What every launched process runs (children import it as ``xreshard.tools.demo:_child``)."""
    cfg = DemoConfig(**cfg_dict)
    return _trainer(ctx, cfg) if ctx.role.group == "trainer" else _rollout(ctx, cfg)


# ---------------------------------------------------------------------------- the command

def run_demo(cfg: DemoConfig) -> int:
    """Launch the trainer and the torch processes and print the report as it happens.

    Returns:
        0 when every tensor was bit-exact on every torch rank after every refit; 1 when a
        check failed or a process failed; 2 when jax, optax or torch is missing.
    """
    missing = [m for m in ("jax", "optax", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"xreshard demo: error: it needs {', '.join(missing)}: pip install "
              "'xreshard[jax,torch]' optax", file=sys.stderr)
        return 2
    import tempfile

    import torch

    from .demo_report import Progress, header
    from .launch import LaunchError, Role, launch

    print("\n".join(header(cfg)))
    if torch.cuda.is_available():
        print("note: GPUs found, but the GPU path (NCCL) is not wired into the demo yet; "
              "running on CPU")
    if cfg.corrupt:
        print(f"(--corrupt: the last torch rank flips a byte of {CORRUPT_TENSOR} after "
              "refit 1; verification must fail)")
    if not cfg.can_generate and cfg.gen_tokens:
        print(f"(no generation: {cfg.num_heads} heads do not split over "
              f"{cfg.torch_procs} torch ranks)")
    if sys.stdout.isatty():
        print("starting the processes (importing JAX and torch takes a while)")
    sys.stdout.flush()     # before the children start, so the report reads in order
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(cfg.torch_procs)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xreshard-demo-") as tmp:
        events = os.path.join(tmp, "events.jsonl")
        open(events, "w").close()
        cfg = DemoConfig(**{**asdict(cfg), "events": events})
        try:
            with Progress(cfg, events, time.time()) as progress:
                # CUDA hidden from the children: this demo moves CPU memory only.
                results = launch("xreshard.tools.demo:_child", roles, args=(asdict(cfg),),
                                 timeout=cfg.timeout, env={"CUDA_VISIBLE_DEVICES": ""})
        except LaunchError as e:
            print(f"xreshard demo: FAILED: {e}", file=sys.stderr)
            return 1
    for rec in results[0].value["records"]:      # any the events did not bring
        progress.record(rec)
    total = time.perf_counter() - t0
    if progress.ok:
        print(f"OK: {cfg.refits} refit(s), every tensor bit-exact on every rank "
              f"({total:.1f} s in all)")
        return 0
    print(f"FAILED: received bytes differ from the trainer's ({total:.1f} s in all)")
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xreshard demo``."""
    d = DemoConfig()
    parser.add_argument("--steps", type=int, default=d.steps,
                        help=f"optimizer steps between refits (default {d.steps})")
    parser.add_argument("--refits", type=int, default=d.refits,
                        help=f"refits in all, the first before training (default {d.refits})")
    parser.add_argument("--torch-procs", type=int, default=d.torch_procs,
                        help=f"torch processes = torch TP degree (default {d.torch_procs})")
    parser.add_argument("--timeout", type=float, default=d.timeout,
                        help=f"seconds for the whole run (default {d.timeout:g})")
    parser.add_argument("--dtype", choices=_DTYPES, default=d.dtype,
                        help="parameter dtype on both sides (default float32)")
    parser.add_argument("--wire-dtype", choices=_DTYPES, default=None,
                        help="cast on the trainer to this dtype; the torch side holds it "
                             "(default: no cast)")
    parser.add_argument("--gen-tokens", type=int, default=d.gen_tokens,
                        help=f"greedy tokens generated on the torch side after each refit "
                             f"(default {d.gen_tokens}; 0: none)")
    # test hook: proves the bit-exact check can fail
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run ``xreshard demo`` with parsed ``args``; returns the exit code."""
    try:
        cfg = DemoConfig(steps=args.steps, refits=args.refits, torch_procs=args.torch_procs,
                         timeout=args.timeout, dtype=args.dtype, wire_dtype=args.wire_dtype,
                         gen_tokens=args.gen_tokens, corrupt=args.corrupt)
    except ValueError as e:
        print(f"xreshard demo: error: {e}", file=sys.stderr)
        return 2
    return run_demo(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """``xreshard demo [options]``: returns 0 when every refit verified bit-exact."""
    parser = argparse.ArgumentParser(
        prog="xreshard demo", description="Train a small transformer in JAX and refit it "
        "shard to shard into torch DTensors, verifying every byte.")
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
