"""JAX -> torch refit on CPU over gloo and shm: xreshard vs the gloo and memcpy bounds vs
gather-and-broadcast.

One JAX process (4 CPU devices, TP=4) sends a Llama-like bf16 model to two torch processes
holding DTensors (TP=2). The three ways of moving it run in the same processes, interleaved,
``--reps`` times each; the table reports medians:

a. **xreshard**: ``Refit(...)()`` after a warm-up call (the warm-up's planning time is
   reported on its own line).
b. **gloo bound**: the bytes through the busiest process (sent + received, what its gloo
   context serializes) divided by the point-to-point bandwidth of the same ``GlooTransport``
   between the trainer and one torch process (one large buffer, trainer -> torch, the
   direction the refit uses). ``fraction of bound`` = bound time / refit time.
c. **gather-and-broadcast**: the baseline every RL framework starts with, on the same
   transport: per tensor, the trainer gathers the full tensor (a local concat of its 4
   shards, timed) and sends it whole to each torch process, which slices its shard out.

Tensors are in canonical ``[out, in]`` coordinates on both sides (``--kernels out_in``, the
default): column-parallel weights (q, k, v, gate, up, embed, lm_head, qkv biases) are
``P("tp", None)`` in JAX and ``Shard(0)`` in torch, row-parallel ones (o, down) are
``P(None, "tp")`` / ``Shard(1)``, norms are replicated. ``--kernels in_out`` stores the
linear weights as Flax ``[in, out]`` kernels instead (same canonical layouts; the JAX side
binds transposed views, so the trainer packs them through staging; with ``--send-stored``
it posts them as they are and the receivers transpose, ``Tuning.send_stored``).

``--transport both`` (the default) runs two refits of the same model in the same
processes, interleaved: one with ``transport="auto"`` (all processes share a host, so every
pair takes the ``shm`` transport) and one with ``transport="gloo"``. Against them:

d. **memcpy bound**: the bytes through the busiest process (sent + received) divided by
   the bandwidth of one ``np.copyto`` of a ``--p2p-mib`` buffer in that process (median
   over the repetitions; in each one the processes copy in turn while the others wait at
   a barrier): what one copy of every byte it moves costs it alone.
   ``fraction of memcpy bound`` = bound time / refit time.

The shm table also shows each process's shared memory (pair segments + staging from the
transport) beside the executor's staging, against ``staging_bytes`` x its ranks.
``--transport shm`` / ``gloo`` runs only that refit (the tables then compare it alone).

Each timed phase starts after a world barrier; its time is the slowest process's. Every
destination byte is checked once after each warm-up refit and once after a baseline run.

    python benchmarks/bench_refit.py [--quick] [--gib 1.0] [--reps 7] [--kernels out_in]
                                     [--transport both|shm|gloo]
                                     [--executor both|pipelined|rounds] [--json]
                                     [--dst-format bf16|fp8-block]

``--dst-format fp8-block`` runs ``bench_fp8_refit.py`` instead: the same refit into
block-FP8 destinations beside bf16, and the trainer's quantizer alone (issue 20).

``--executor both`` (the default) adds, for each transport, a refit with the old
round-by-round executor (``Refit(tuning=Tuning(executor="rounds"))``) in the same processes,
interleaved: the side-by-side column "rounds / pipelined" is its time over the
pipelined one's.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
GiB = 2 ** 30
TRAINER_TP = 4
ROLLOUT_TP = 2
TIMEOUT = 600.0

# ---------------------------------------------------------------------------- the model


def model_specs(gib: float, num_layers: int = 4) -> list[tuple[str, tuple[int, ...], str]]:
    """Llama-like tensors ``(name, canonical shape, kind)`` totalling about ``gib`` GiB in bf16.

    kind: "col" = split on dim 0 (column-parallel / vocab-parallel), "row" = split on dim 1
    (row-parallel), "rep" = replicated. Hidden size H scales with ``gib``; kv = H/8,
    intermediate = 2.75 H, vocab = 16 H; every split dim divides by 4.
    """
    elems = gib * GiB / 2
    coef = num_layers * (2 + 2 / 8 + 3 * 2.75) + 2 * 16
    hidden = max(64, int(math.sqrt(elems / coef)) // 64 * 64)
    kv = max(64, hidden // 8 // 64 * 64)
    inter = round(2.75 * hidden / 64) * 64
    vocab = 16 * hidden
    specs = [("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,), "rep"),
            (p + "self_attn.q_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.q_proj.bias", (hidden,), "col"),
            (p + "self_attn.k_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.k_proj.bias", (kv,), "col"),
            (p + "self_attn.v_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.v_proj.bias", (kv,), "col"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "row"),
            (p + "post_attention_layernorm.weight", (hidden,), "rep"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "col"),
            (p + "mlp.up_proj.weight", (inter, hidden), "col"),
            (p + "mlp.down_proj.weight", (hidden, inter), "row"),
        ]
    specs += [("model.norm.weight", (hidden,), "rep"),
              ("lm_head.weight", (vocab, hidden), "col")]
    return specs


def split_dim(kind: str) -> int | None:
    return {"col": 0, "row": 1, "rep": None}[kind]


def np_dtype(name: str) -> np.dtype:
    from xreshard.dtypes import numpy_dtype
    return numpy_dtype(name)


def bits(a: np.ndarray) -> np.ndarray:
    """The same memory as unsigned ints of the same width (fast, dtype-free copies)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def pattern(k: int, starts: tuple[int, ...], stops: tuple[int, ...], dtype: str) -> np.ndarray:
    """Block ``[starts, stops)`` of tensor ``k``'s global value: small integers, exact in bf16."""
    table = np.arange(-200, 201, dtype=np.float32).astype(np_dtype(dtype))
    if len(starts) == 1:
        idx = (np.arange(starts[0], stops[0], dtype=np.int32) * 7 + k) % 401
        return table[idx]
    rows = ((np.arange(starts[0], stops[0], dtype=np.int32) * 7 + k) % 201).astype(np.int16)
    cols = ((np.arange(starts[1], stops[1], dtype=np.int32) * 13) % 201).astype(np.int16)
    return table[rows[:, None] + cols[None, :]]


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    step = n // parts
    return i * step, (i + 1) * step


def local_box(shape: tuple[int, ...], kind: str, parts: int, i: int) -> tuple[tuple, tuple]:
    d = split_dim(kind)
    starts, stops = [0] * len(shape), list(shape)
    if d is not None and d < len(shape):
        starts[d], stops[d] = chunk(shape[d], parts, i)
    return tuple(starts), tuple(stops)


def is_kernel(name: str, shape: tuple[int, ...], kinds: str) -> bool:
    """Linear weights stored as Flax [in, out] kernels under ``--kernels in_out``."""
    return kinds == "in_out" and len(shape) == 2 and "proj" in name


# ---------------------------------------------------------------------------- trainer side


def jax_params(specs, dtype: str, kernels: str) -> dict[str, Any]:
    """The model as jax.Arrays on a 1-d ("tp",) mesh of the 4 local CPU devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((TRAINER_TP,), ("tp",), devices=jax.local_devices())
    params = {}
    for k, (name, shape, kind) in enumerate(specs):
        d = split_dim(kind)
        flip = is_kernel(name, shape, kernels)
        spec = [None] * len(shape)
        if d is not None:
            spec[(1 - d) if flip else d] = "tp"
        jshape = tuple(reversed(shape)) if flip else shape
        sharding = NamedSharding(mesh, P(*spec))
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(jshape).items():
            starts = [s.start or 0 for s in index]
            stops = [n if s.stop is None else s.stop for s, n in zip(index, jshape)]
            if flip:
                starts, stops = starts[::-1], stops[::-1]
            block = pattern(k, tuple(starts), tuple(stops), dtype)
            if flip:
                block = np.ascontiguousarray(block.T)
            arrays.append(jax.device_put(block, device))
        params[name] = jax.make_array_from_single_device_arrays(jshape, sharding, arrays)
    return params


def gather_full(arr: Any, shape: tuple[int, ...], flip: bool, out: np.ndarray) -> np.ndarray:
    """The full canonical tensor from the trainer's 4 shards (the baseline's local gather)."""
    shards = arr.addressable_shards
    index0 = shards[0].index
    if all((s.start or 0) == 0 and s.stop is None for s in index0):   # replicated: no copy
        data = np.asarray(shards[0].data)
        return bits(np.ascontiguousarray(data.T) if flip else data).reshape(-1).view(np.uint8)
    nbytes = math.prod(shape) * 2
    full = bits(out[:nbytes].view(np.uint16)).reshape(shape)
    for s in shards:
        data = bits(np.asarray(s.data))
        index = s.index
        if flip:
            index, data = index[::-1], data.T
        np.copyto(full[index], data)
    return full.reshape(-1).view(np.uint8)


# ---------------------------------------------------------------------------- rollout side


def torch_group(ctx: Any, members: int, rank: int, prefix: str) -> None:
    """A default process group among the torch processes, over the launch's store."""
    import torch.distributed as dist
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/", store),
                            rank=rank, world_size=members)


def dtensors(specs, dtype: str, fill: float = 0.0) -> dict[str, Any]:
    """Destination DTensors (TP=2), filled with ``fill`` so their pages are resident."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (ROLLOUT_TP,))
    me = torch.distributed.get_rank()
    out = {}
    for name, shape, kind in specs:
        starts, stops = local_box(shape, kind, ROLLOUT_TP, me)
        local = torch.full(tuple(b - a for a, b in zip(starts, stops)), fill,
                           dtype=getattr(torch, dtype))
        d = split_dim(kind)
        placement = Replicate() if d is None else Shard(d)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        out[name] = DTensor.from_local(local, mesh, [placement], shape=torch.Size(shape),
                                       stride=stride, run_check=False)
    return out


def local_views(state: dict[str, Any]) -> dict[str, np.ndarray]:
    from xreshard.adapters.torch import tensor_view
    return {name: tensor_view(t.to_local()) for name, t in state.items()}


def check_rollout(views: dict[str, np.ndarray], specs, dtype: str, me: int, what: str) -> int:
    for k, (name, shape, kind) in enumerate(specs):
        starts, stops = local_box(shape, kind, ROLLOUT_TP, me)
        want = pattern(k, starts, stops, dtype)
        if not np.array_equal(bits(views[name]), bits(want)):
            raise AssertionError(f"{what}: {name} on rollout[{me}] holds wrong bytes")
    return len(specs)


def zero(views: dict[str, np.ndarray]) -> None:
    for v in views.values():
        bits(v)[...] = 0


# ---------------------------------------------------------------------------- phases


def p2p(gloo: Any, buf: np.ndarray, src: int, dsts: list[int], me: set[int], tag: int) -> None:
    """``buf`` from world rank ``src`` to each of ``dsts`` in one transport group."""
    with gloo.group(TIMEOUT):
        for d in dsts:
            if src in me:
                gloo.send(buf, src, d, tag)
            elif d in me:
                gloo.recv(buf, src, d, tag)


def baseline_trainer(gloo: Any, params: dict, specs, kernels: str, out: np.ndarray,
                     src: int, dsts: list[int]) -> None:
    """Gather-and-broadcast, trainer side: per tensor, a local gather, then one send per
    torch process, both posted in one group."""
    for k, (name, shape, _) in enumerate(specs):
        full = gather_full(params[name], shape, is_kernel(name, shape, kernels), out)
        with gloo.group(TIMEOUT):
            for d in dsts:
                gloo.send(full, src, d, k)


def baseline_rollout(gloo: Any, views: dict[str, np.ndarray], specs, buf: np.ndarray,
                     src: int, rank: int, me: int) -> None:
    """Gather-and-broadcast, rollout side: receive each full tensor, slice this shard out."""
    for k, (name, shape, kind) in enumerate(specs):
        nbytes = math.prod(shape) * 2
        full = buf[:nbytes]
        with gloo.group(TIMEOUT):
            gloo.recv(full, src, rank, k)
        starts, stops = local_box(shape, kind, ROLLOUT_TP, me)
        box = tuple(slice(a, b) for a, b in zip(starts, stops))
        np.copyto(bits(views[name]), full.view(np.uint16).reshape(shape)[box])


def timed(world: Any, fn) -> float:
    world.barrier(timeout=TIMEOUT)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


#: functions whose cumulative time the profile reports, by (file suffix, function name)
PROFILED = [
    ("refit.py", "__call__", "Refit.__call__ (all)"),
    ("sides.py", "bind", "  bind (adapters)"),
    ("refit.py", "_prepare", "  metadata exchange + digest"),
    ("refit.py", "_commit", "  commit (outcome all-gather)"),
    ("execute.py", "run", "  execute.run / Executor.run"),
    ("execute.py", "_staging_needed", "    staging sizing"),
    ("execute.py", "_pack", "    pack (sender copies)"),
    ("execute.py", "_unpack", "    unpack (receiver copies)"),
    ("gloo.py", "_run", "    gloo post + wait"),
    ("shm.py", "_place", "    shm copy into segments (sender)"),
    ("shm.py", "_receive", "    shm copy out (receiver)"),
    ("shm.py", "_wait", "    shm waits (store)"),
]


def pack_census(refit: Any) -> dict[str, int]:
    """Bytes this process copies through staging, and how many of them sit in regions that
    are one contiguous run on this side (packed only because they share a bucket)."""
    out = {"pack": 0, "pack_contig": 0, "unpack": 0, "unpack_contig": 0}
    ex, sched = getattr(refit, "_executor", None), getattr(refit, "_schedule", None)
    if ex is None or sched is None:     # internals moved: no census
        return out
    src_ranks = {r for r, _ in ex.src_bindings}
    dst_ranks = {r for r, _ in ex.dst_bindings}

    def contiguous(view: Any, name: str) -> bool:
        return view.flags.c_contiguous and view.dtype == ex.wire[name]

    for buckets in sched.rounds:
        for b in buckets:
            if b.src in src_ranks and ex._zero_copy_send(b) is None:
                out["pack"] += b.nbytes
                out["pack_contig"] += sum(it.nbytes for it in b.items
                                          if contiguous(ex._src(b.src, it.name, it.region), it.name))
            if b.dst in dst_ranks and ex._zero_copy_recv(b) is None:
                out["unpack"] += b.nbytes
                out["unpack_contig"] += sum(it.nbytes for it in b.items
                                            if contiguous(ex._dst(b.dst, it.name, it.region), it.name))
    return out


def per_call_overheads(refit: Any, is_trainer: bool, obj: Any,
                       reps: int = 5) -> dict[str, float]:
    """Unprofiled medians of the per-call local work that is not moving bytes: binding the
    framework objects, and describing + hashing the layouts for the digest exchange."""
    import hashlib
    import json
    side = "send" if is_trainer else "receive"
    maps = refit._rank_maps()
    (refit._sides.send if is_trainer else refit._sides.receive).obj = obj
    bind_s, digest_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sides = refit._sides
        bound = sides.bind(sides.send if is_trainer else sides.receive, maps, refit.layout_memo)
        t1 = time.perf_counter()
        meta = {side: bound.describe(), "config": refit.config.to_dict()}
        hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
        digest_s.append(time.perf_counter() - t1)
        bind_s.append(t1 - t0)
    return {"bind, unprofiled": statistics.median(bind_s),
            "describe + digest, unprofiled": statistics.median(digest_s)}


def profile_top(prof: cProfile.Profile, n: int) -> list[tuple[str, float, float]]:
    """The ``n`` functions with the most cumulative time: (where, cumulative, own)."""
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [(f"{Path(f).name}:{line}:{fn}", v[3], v[2]) for (f, line, fn), v in rows]


def profile_rows(prof: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(prof).stats   # (file, line, fn) -> (cc, nc, tt, ct, callers)
    out = {}
    for suffix, fn, label in PROFILED:
        out[label] = sum(v[3] for (f, _, n), v in stats.items()
                         if n == fn and f.endswith(suffix))
    return out


def arena_bytes(arena: Any) -> int:
    """Bytes of the executor's staging (one array, or one per device)."""
    if arena is None:
        return 0
    arrays = arena.values() if isinstance(arena, dict) else [arena]
    return sum(int(a.nbytes) for a in arrays if a is not None)


class Memcpy:
    """This process's ``np.copyto`` bandwidth, measured once per repetition (interleaved
    with the refits, so both see the same machine load) while every other process waits
    at a barrier: the processes take turns."""

    def __init__(self, nbytes: int):
        self.src = np.ones(nbytes, np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        np.copyto(self.dst, self.src)
        self.seconds: list[float] = []

    def turn(self, world: Any) -> None:
        for p in range(world.num_processes):
            world.barrier(timeout=TIMEOUT)
            if p == world.process_index:
                t0 = time.perf_counter()
                np.copyto(self.dst, self.src)
                self.seconds.append(time.perf_counter() - t0)
        world.barrier(timeout=TIMEOUT)

    @property
    def bandwidth(self) -> float:
        return self.src.nbytes / statistics.median(self.seconds)


# ---------------------------------------------------------------------------- child


def child(ctx: Any, cfg: dict) -> dict:
    import xreshard as xr

    is_trainer = ctx.role.group == "trainer"
    specs = model_specs(cfg["gib"])
    dtype = "bfloat16"
    rollout_rank = ctx.role.index
    if not is_trainer:
        import torch
        torch.set_num_threads(1)
        torch_group(ctx, ROLLOUT_TP, rollout_rank, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], timeout=TIMEOUT)
    me = set(world.rank_ids)
    trainer_rank = world.group_ranks("trainer")[0]
    rollout_ranks = list(world.group_ranks("rollout"))
    transports = ["shm", "gloo"] if cfg["transport"] == "both" else [cfg["transport"]]
    executors = (["pipelined", "rounds"] if cfg["executor"] == "both"
                 else [cfg["executor"]])
    # a key per (transport, executor): "shm", "gloo" pipelined, "shm+rounds" the old one
    kinds = [t if e == "pipelined" else f"{t}+rounds" for e in executors for t in transports]
    configs = {k: xr.RefitConfig(bucket_bytes=cfg["bucket_mib"] * MiB,
                                 staging_bytes=cfg["staging_mib"] * MiB, timeout=TIMEOUT,
                                 transport="auto" if k.startswith("shm") else "gloo")
               for k in kinds}
    tunings = {k: xr.Tuning(executor="rounds" if k.endswith("+rounds") else "pipelined",
                            **({"send_stored": True} if cfg.get("send_stored") else {}))
               for k in kinds}
    t_setup = time.perf_counter()
    refits = {}
    if is_trainer:
        params = jax_params(specs, dtype, cfg["kernels"])
        transpose = {n for n, s, _ in specs if is_kernel(n, s, cfg["kernels"])}
        for k in kinds:
            refits[k] = xr.Refit(world, send=params, transpose=transpose, config=configs[k],
                                 tuning=tunings[k], name=k)
        max_bytes = max(math.prod(s) for _, s, _ in specs) * 2
        gather_buf = np.empty(max_bytes, np.uint8)
        gather_buf[:] = 1                                       # resident, like a real buffer
    else:
        state = dtensors(specs, dtype)
        views = local_views(state)
        for k in kinds:
            refits[k] = xr.Refit(world, receive=state, config=configs[k], tuning=tunings[k],
                                 name=k)
        max_bytes = max(math.prod(s) for _, s, _ in specs) * 2
        recv_buf = np.ones(max_bytes, np.uint8)
    setup_s = time.perf_counter() - t_setup
    refit = refits[kinds[0]]

    def call(r: Any) -> Any:
        """One refit; the trainer passes its arrays on every call (a Refit keeps none)."""
        return r(send=params) if is_trainer else r()

    # warm-up: plans, creates the transports; then check every byte
    firsts = {}
    for k in kinds:
        world.barrier(timeout=TIMEOUT)
        t0 = time.perf_counter()
        firsts[k] = (call(refits[k]), time.perf_counter() - t0)
        if not is_trainer:
            check_rollout(views, specs, dtype, rollout_rank, f"xreshard refit over {k}")
            zero(views)
    first, first_s = firsts[kinds[0]]
    auto = world.transport("auto")
    if "shm" in transports and "gloo" in auto.parts:
        raise RuntimeError(f"'auto' built {auto.name}: some pair of this one-host world did "
                           f"not get shared memory (XRESHARD_SHM=0 set?)")
    gloo = world.transport("gloo")
    memcpy = Memcpy(cfg["p2p_mib"] * MiB)

    def baseline() -> None:
        if is_trainer:
            baseline_trainer(gloo, params, specs, cfg["kernels"], gather_buf, trainer_rank,
                             rollout_ranks)
        else:
            baseline_rollout(gloo, views, specs, recv_buf, trainer_rank,
                             world.rank_ids[0], rollout_rank)

    baseline()
    if not is_trainer:
        check_rollout(views, specs, dtype, rollout_rank, "gather-and-broadcast")
    p2p_buf = np.ones(cfg["p2p_mib"] * MiB, np.uint8)
    fwd = lambda: p2p(gloo, p2p_buf, trainer_rank, rollout_ranks[:1], me, 0)   # noqa: E731
    rev = lambda: p2p(gloo, p2p_buf, rollout_ranks[0], [trainer_rank], me, 0)  # noqa: E731
    fan = lambda: p2p(gloo, p2p_buf, trainer_rank, rollout_ranks, me, 0)       # noqa: E731
    fwd()

    times: dict[str, list[float]] = {k: [] for k in ("p2p", "p2p_rev", "fanout", "refit",
                                                      "baseline", *(f"refit:{k}" for k in kinds))}
    reports = []
    cpu: dict[str, list[float]] = {k: [] for k in kinds}     # CPU s of this process per refit
    by_kind_before = dict(auto.bytes_by_transport)
    for _ in range(cfg["reps"]):
        times["p2p"].append(timed(world, fwd))
        times["p2p_rev"].append(timed(world, rev))
        times["fanout"].append(timed(world, fan))
        for k in kinds:
            box: list = []
            cpu0 = time.process_time()
            times[f"refit:{k}"].append(timed(world, lambda: box.append(call(refits[k]))))
            cpu[k].append(time.process_time() - cpu0)
            if k == kinds[0]:
                times["refit"].append(times[f"refit:{k}"][-1])
                reports.append(box[0])
        times["baseline"].append(timed(world, baseline))
        memcpy.turn(world)
    by_kind = {k: (v - by_kind_before.get(k, 0)) // cfg["reps"]
               for k, v in auto.bytes_by_transport.items()}
    shm = auto.parts.get("shm")
    shm_info = {"segment_bytes": shm.segment_bytes if shm is not None else 0,
                "copied_in": shm.bytes_copied_in if shm is not None else 0,
                "in_place": shm.bytes_in_place if shm is not None else 0}
    staging = {k: arena_bytes(getattr(refits[k], "_arena", None)
                              if hasattr(refits[k], "_arena")
                              else getattr(getattr(refits[k], "_executor", None), "_arena", None))
               for k in kinds}

    # one more refit under cProfile: where the time goes (not part of the medians)
    prof = cProfile.Profile()
    world.barrier(timeout=TIMEOUT)
    prof.enable()
    t0 = time.perf_counter()
    call(refit)
    prof_wall = time.perf_counter() - t0
    prof.disable()
    profile = profile_rows(prof)
    profile["wall (profiled call)"] = prof_wall
    census = pack_census(refit)
    try:
        profile.update(per_call_overheads(refit, is_trainer, params if is_trainer else state))
    except (AttributeError, TypeError):     # refit internals moved: skip those two rows
        pass
    top = profile_top(prof, cfg["profile_top"]) if cfg["profile_top"] else []

    last = reports[-1]
    mine = {
        "label": world.describe_process(world.process_index).split(" (")[0],
        "times": times,
        "first_s": first_s, "plan_s": first.plan_seconds, "replanned_first": first.replanned,
        "replanned_later": any(r.replanned for r in reports),
        "sent": last.bytes_sent, "received": last.bytes_received, "local": last.bytes_local,
        "messages": last.num_messages, "zero_copy": last.num_zero_copy,
        "rounds": last.num_rounds, "staging": last.staging_bytes,
        "report_seconds": [r.seconds for r in reports],
        "setup_s": setup_s, "profile": profile, "census": census, "top": top,
        "world_moved": last.bytes_moved_world, "world_gb": last.bytes_gather_broadcast_world,
        "kinds": kinds, "memcpy_bw": memcpy.bandwidth, "by_kind": by_kind, "shm": shm_info,
        "arena": staging, "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "num_ranks": len(world.rank_ids), "auto": auto.name,
    }
    everyone = world.allgather_json(mine, timeout=TIMEOUT)
    world.close()
    if not is_trainer:
        import torch.distributed as dist
        dist.destroy_process_group()
    return {"processes": everyone}


# ---------------------------------------------------------------------------- parent


def summarize(res: dict, cfg: dict, command: str) -> str:
    procs = res["processes"]
    specs = model_specs(cfg["gib"])
    model_bytes = sum(math.prod(s) for _, s, _ in specs) * 2
    reps = cfg["reps"]

    def slowest(key: str) -> list[float]:
        return [max(p["times"][key][i] for p in procs) for i in range(reps)]

    med = {k: statistics.median(slowest(k)) for k in procs[0]["times"]}
    spread = {k: (min(slowest(k)), max(slowest(k))) for k in procs[0]["times"]}
    p2p_bw = cfg["p2p_mib"] * MiB / med["p2p"]
    rev_bw = cfg["p2p_mib"] * MiB / med["p2p_rev"]
    fan_bw = 2 * cfg["p2p_mib"] * MiB / med["fanout"]
    busiest = max(procs, key=lambda p: p["sent"] + p["received"])
    busiest_bytes = busiest["sent"] + busiest["received"]
    bound = busiest_bytes / p2p_bw
    gb_bytes = model_bytes * ROLLOUT_TP
    lines = []
    w = lines.append
    w(f"Model: {len(specs)} bf16 tensors, {model_bytes / GiB:.3f} GiB "
      f"(hidden {specs[1][1][0]}, layers 4, `--kernels {cfg['kernels']}`); JAX TP={TRAINER_TP} "
      f"(1 process, 4 CPU devices) -> torch DTensor TP={ROLLOUT_TP} (2 processes); "
      f"bucket_bytes={cfg['bucket_mib']} MiB, staging_bytes={cfg['staging_mib']} MiB; "
      f"{reps} interleaved repetitions, medians (min-max), each phase timed by its slowest "
      f"process.")
    w("")
    w("| what | time (s) | bytes through busiest process | GB/s (busiest) | ratio |")
    w("|---|---|---|---|---|")
    w(f"| xreshard refit | {med['refit']:.3f} ({spread['refit'][0]:.3f}-{spread['refit'][1]:.3f}) "
      f"| {busiest_bytes / MiB:.0f} MiB ({busiest['label']}) | {busiest_bytes / med['refit'] / 1e9:.2f} "
      f"| fraction of bound **{bound / med['refit']:.2f}** |")
    w(f"| gloo p2p bound for those bytes | {bound:.3f} | {busiest_bytes / MiB:.0f} MiB "
      f"| {p2p_bw / 1e9:.2f} (p2p, {cfg['p2p_mib']} MiB buffer) | 1.00 |")
    w(f"| gather-and-broadcast (same gloo) | {med['baseline']:.3f} "
      f"({spread['baseline'][0]:.3f}-{spread['baseline'][1]:.3f}) | {gb_bytes / MiB:.0f} MiB "
      f"(trainer) | {gb_bytes / med['baseline'] / 1e9:.2f} "
      f"| baseline / xreshard **{med['baseline'] / med['refit']:.2f}x** |")
    w("")
    kinds = procs[0]["kinds"]
    memcpy_bw = busiest["memcpy_bw"]
    memcpy_bound = busiest_bytes / memcpy_bw
    w(f"Side by side, same model and processes ({', '.join(kinds)}; `auto` built "
      f"`{procs[0]['auto']}`): memcpy bound = {busiest_bytes / MiB:.0f} MiB through "
      f"{busiest['label']} / its `np.copyto` bandwidth {memcpy_bw / 1e9:.2f} GB/s = "
      f"{memcpy_bound:.3f} s.")
    w("")
    w("| refit over (executor) | time (s) | GB/s (busiest) | fraction of gloo bound "
      "| fraction of memcpy bound | vs gloo refit | rounds / pipelined |")
    w("|---|---|---|---|---|---|---|")
    for k in kinds:
        t = med[f"refit:{k}"]
        lo, hi = spread[f"refit:{k}"]
        vs = (f"**{med['refit:gloo'] / t:.2f}x**" if "refit:gloo" in med else "-")
        old = f"refit:{k}+rounds"
        speedup = f"**{med[old] / t:.2f}x**" if old in med else "-"
        name = (f"{k.split('+')[0]} (rounds: the old executor)" if k.endswith("+rounds")
                else f"{k} (pipelined)")
        w(f"| {name} | {t:.3f} ({lo:.3f}-{hi:.3f}) | {busiest_bytes / t / 1e9:.2f} "
          f"| {bound / t:.2f} | **{memcpy_bound / t:.2f}** | {vs} | {speedup} |")
    w("")
    w("CPU seconds of each process per refit (medians; `time.process_time()`, all threads; "
      "less sensitive to a loaded host than the wall times above):")
    w("")
    w("| refit over | " + " | ".join(p["label"] for p in procs) + " | all processes |")
    w("|---|" + "---|" * (len(procs) + 1))
    for k in kinds:
        row = [p.get("cpu", {}).get(k, float("nan")) for p in procs]
        w(f"| {k} | " + " | ".join(f"{c:.4f}" for c in row) + f" | {sum(row):.4f} |")
    w("")
    w("| process | bytes per refit by transport | shm segments MiB | shm staging copies "
      "(copied in / in place, MiB, all calls) | executor staging MiB | staging_bytes x ranks MiB |")
    w("|---|---|---|---|---|---|")
    for p in procs:
        kb = ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in p["by_kind"].items() if v)
        arena = " / ".join(f"{k} {v / MiB:.1f}" for k, v in p["arena"].items())
        w(f"| {p['label']} | {kb or '-'} | {p['shm']['segment_bytes'] / MiB:.1f} "
          f"| {p['shm']['copied_in'] / MiB:.0f} / {p['shm']['in_place'] / MiB:.0f} "
          f"| {arena} | {cfg['staging_mib'] * p['num_ranks']} |")
    w("")
    first = next(p for p in procs if p["label"].startswith("trainer"))
    w(f"Planning (first call, excluded above): first `refit()` took "
      f"{max(p['first_s'] for p in procs):.3f} s, of which metadata exchange + plan + schedule "
      f"{max(p['plan_s'] for p in procs):.3f} s (slowest process); later calls replanned: "
      f"{any(p['replanned_later'] for p in procs)}.")
    w(f"Gloo bandwidth (same transport, medians): trainer->torch {p2p_bw / 1e9:.2f} GB/s, "
      f"torch->trainer {rev_bw / 1e9:.2f} GB/s, trainer->both torch at once "
      f"{fan_bw / 1e9:.2f} GB/s aggregate (against that fan-out bandwidth the refit is at "
      f"{busiest_bytes / fan_bw / med['refit']:.2f} of bound).")
    w(f"Ceiling of baseline / xreshard on this topology: the trainer is the only sender and "
      f"sends {gb_bytes / busiest_bytes:.2f}x the bytes under gather-and-broadcast, so a ratio "
      f"above that needs the baseline to be slower than its own wire time.")
    w(f"World bytes: xreshard {first['world_moved'] / MiB:.0f} MiB, gather-and-broadcast "
      f"{first['world_gb'] / MiB:.0f} MiB (plan statistic); the baseline above sends "
      f"{gb_bytes / MiB:.0f} MiB.")
    w("")
    w("| process | sent MiB | received MiB | sends | zero-copy posts | rounds | staging MiB "
      "| packed MiB (contiguous) | unpacked MiB (contiguous) |")
    w("|---|---|---|---|---|---|---|---|---|")
    for p in procs:
        c = p["census"]
        w(f"| {p['label']} | {p['sent'] / MiB:.1f} | {p['received'] / MiB:.1f} | {p['messages']} "
          f"| {p['zero_copy']} | {p['rounds']} | {p['staging'] / MiB:.1f} "
          f"| {c['pack'] / MiB:.1f} ({c['pack_contig'] / MiB:.1f}) "
          f"| {c['unpack'] / MiB:.1f} ({c['unpack_contig'] / MiB:.1f}) |")
    w("")
    w("packed/unpacked: bytes copied through staging per refit; (contiguous): those whose "
      "region is one contiguous run on that side, copied only because they share a bucket "
      "with other regions.")
    w("")
    w("Where one refit's time goes (cProfile of one extra call, cumulative ms per process; "
      "gloo wait includes waiting for the peer; the two *unprofiled* rows are medians of 5 "
      "direct calls):")
    w("")
    w("| | " + " | ".join(p["label"] for p in procs) + " |")
    w("|---|" + "---|" * len(procs))
    for label in procs[0]["profile"]:
        depth = (len(label) - len(label.lstrip())) // 2
        w(f"| {'. ' * depth}{label.strip()} | "
          + " | ".join(f"{p['profile'][label] * 1e3:.1f}" for p in procs) + " |")
    for p in procs:
        if p["top"]:
            w("")
            w(f"Top cumulative functions, {p['label']}:")
            w("")
            w("| function | cumulative s | own s |")
            w("|---|---|---|")
            for where, ct, tt in p["top"]:
                w(f"| `{where}` | {ct:.3f} | {tt:.3f} |")
    w("")
    w(f"Command: `{command}`")
    return "\n".join(lines)


def figures(res: dict, cfg: dict) -> dict[str, Any]:
    """The headline numbers as JSON: times and fractions of the gloo and memcpy bounds per
    (transport, executor); ``fraction_of_bound`` is the first refit's (the table's top
    row: pipelined, shm when both transports run) against the gloo bound."""
    procs = res["processes"]
    reps = cfg["reps"]
    med = {k: statistics.median([max(p["times"][k][i] for p in procs) for i in range(reps)])
           for k in procs[0]["times"]}
    busiest = max(procs, key=lambda p: p["sent"] + p["received"])
    nbytes = busiest["sent"] + busiest["received"]
    bound = nbytes / (cfg["p2p_mib"] * MiB / med["p2p"])
    memcpy_bound = nbytes / busiest["memcpy_bw"]
    kinds = procs[0]["kinds"]
    out: dict[str, Any] = {
        "kernels": cfg["kernels"], "gib": cfg["gib"], "reps": reps,
        "busiest_bytes": nbytes, "gloo_bound_s": bound, "memcpy_bound_s": memcpy_bound,
        "refit_s": med["refit"], "fraction_of_bound": bound / med["refit"],
        "baseline_s": med["baseline"], "refits": {}}
    for k in kinds:
        t = med[f"refit:{k}"]
        out["refits"][k] = {"transport": k.split("+")[0],
                            "executor": "rounds" if k.endswith("+rounds") else "pipelined",
                            "seconds": t, "fraction_of_bound": bound / t,
                            "fraction_of_memcpy_bound": memcpy_bound / t}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dst-format" in argv:          # FP8 destinations: their own side-by-side script
        i = argv.index("--dst-format")
        fmt = argv[i + 1] if i + 1 < len(argv) else ""
        if fmt == "fp8-block":
            import bench_fp8_refit
            return bench_fp8_refit.main(argv[:i] + argv[i + 2:])
        if fmt != "bf16":
            raise SystemExit(f"--dst-format must be bf16 or fp8-block, not {fmt!r}")
        argv = argv[:i] + argv[i + 2:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB (bf16)")
    ap.add_argument("--quick", action="store_true", help="a ~0.1 GiB model, 3 repetitions")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kernels", choices=("out_in", "in_out"), default="out_in",
                    help="JAX holds canonical [out, in] weights, or Flax [in, out] kernels")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--p2p-mib", type=int, default=256, help="p2p bandwidth buffer size")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--transport", choices=("both", "shm", "gloo"), default="both",
                    help="refit over shm ('auto' on one host), gloo, or both side by side")
    ap.add_argument("--executor", choices=("both", "pipelined", "rounds"), default="both",
                    help="the pipelined executor, the old round-by-round one (rounds), or "
                         "both side by side in the same processes")
    ap.add_argument("--send-stored", action="store_true",
                    help="Tuning(send_stored=True): the trainer offers its [in, out] kernels "
                         "in storage order (the receivers transpose; with --kernels in_out)")
    ap.add_argument("--json", action="store_true",
                    help="print the headline numbers as one JSON object (after the tables)")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="also list the N most expensive functions of the profiled call")
    args = ap.parse_args(argv)
    if args.quick:
        args.gib = 0.1
        args.reps = min(args.reps, 3)
        args.p2p_mib = min(args.p2p_mib, 64)
    cfg = {"gib": args.gib, "reps": args.reps, "kernels": args.kernels,
           "bucket_mib": args.bucket_mib, "staging_mib": args.staging_mib,
           "p2p_mib": args.p2p_mib, "profile_top": args.profile_top,
           "transport": args.transport, "executor": args.executor,
           "send_stored": args.send_stored}
    command = "python " + " ".join(["benchmarks/bench_refit.py", *argv])
    from xreshard.tools.launch import Role, launch

    roles = [Role("jax", "trainer", 0, num_devices=TRAINER_TP)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT_TP)]
    t0 = time.perf_counter()
    results = launch("bench_refit:child", roles, args=(cfg,), timeout=args.timeout)
    res = results[0].value
    print(summarize(res, cfg, command))
    if args.json:
        import json
        print(json.dumps(figures(res, cfg)))
    print(f"\nMachine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, {__import__('os').cpu_count()} CPUs; whole run "
          f"{time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
