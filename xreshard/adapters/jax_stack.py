"""The send side's small shards, read through one jitted stack per chunk of arrays instead
of one host view per shard.

Decision record (issue 35, the warm plain call):

* Binding a JAX array for sending makes a numpy view of each addressable shard
  (``np.asarray`` of each per-device array): ~2 µs to make and ~0.6 µs to free per shard,
  whatever its size. A trainer of 3,000 small tensors on 4 devices spends 25-30 ms of its
  warm call on the 12,000 views alone, and more after an optimizer step, when JAX first
  builds each new array's per-device arrays.
* Arrays of one geometry (sharding, shape, dtype) are instead stacked, ``K`` at a time, by
  one jitted ``jnp.stack`` whose output is sharded like its inputs along a new leading axis
  (``P(None, *spec)``): each device stacks its own blocks, nothing crosses devices, and
  the output's block on a device is the ``K`` shards one after another. One numpy view of
  that block per device, and a slice of it per shard (~0.2 µs), replace the per-shard
  views: 512 arrays on 4 devices cost one dispatch (~1 ms) and 4 views.
* The price is one device-side copy of those shards' bytes, so only shards of at most
  :data:`MAX_SHARD_BYTES` are stacked (a small shard is packed into a message by copying
  anyway; copying 8 KiB costs about what its view did). Larger shards keep their views,
  which the executor sends without copying.
* The stack reads the arrays when it runs, in JAX's order of computations, so the bytes
  sent are the arrays' values at bind time even if the caller donates them while a
  started refit moves (a view would have kept the memory alive instead).
* A geometry is stacked from the second call of a refit that binds it on (its send side's
  geometry cache says it was seen before): a one-shot bind (the public ``bind``, or a
  refit called once) compiles nothing.
* Compiles are bounded: ``K`` is a power of two from 16 to :data:`CHUNK` (512), chosen
  by the group's size alone (:func:`chunk_size`: a run of a stack program costs ~250 µs
  on top of ~1.9 µs an argument, so 3,000 arrays go in six runs of 512, 130 in one of
  256), a chunk short of ``K`` repeats its last array, and groups of fewer than
  :data:`MIN_GROUP` arrays keep their views: at most six programs per geometry,
  0.05-0.6 s each on this host's CPU, once per process (kept by ``jax.jit``'s cache of
  the one jitted function per output sharding held here). A receiving side's blocks hold
  at most :data:`RECEIVE_CHUNK` (128) arrays: the unstack's compile grows faster (1.2 s
  for 128 outputs, 5.1 s for 512).
* Only CPU arrays of a ``NamedSharding`` that this process addresses in full, of a whole-byte
  dtype, with neither ``unreduced`` nor ``reduced`` axes, are stacked; anything the stack
  refuses (it raises, or its output is not the shape expected) keeps its views, and the
  geometry is not tried again. On GPU the per-shard path stays (never run there yet).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SHARD_BYTES", "MIN_GROUP", "RECEIVE_CHUNK", "StackedReceive",
           "as_binding", "bind_received_stacks", "bind_stacks", "chunk_size", "put_views",
           "refused_count", "shard_views", "stack_blocks", "stack_of", "stack_refused", "stackable",
           "stacked_locals", "stacked_views", "unstacked"]

#: bytes: the largest shard read through a stack (larger ones are viewed, sent zero-copy)
MAX_SHARD_BYTES = 8 << 10
#: a geometry with fewer arrays in a call keeps its per-shard views (no compile for it)
MIN_GROUP = 8
#: the most arrays one stack takes (a program of 512 compiles in ~0.6 s, of 1,024 in 1.6)
CHUNK = 512
#: the most arrays one received block holds: an unstack into K arrays compiled in 1.2 s
#: for K = 128 and 5.1 s for 512 (a loaded host), so receiving stays at 128
RECEIVE_CHUNK = 128
#: what a stack costs on this host's CPU (4 devices, 3,072 float32 (16, 8) arrays, K from
#: 128 to 512: 24 runs took 12.4 ms of CPU, 6 runs 7.4 ms): µs per run of a program (its
#: per-device executions), µs per argument (dispatch, the copy)
_RUN_US, _ARG_US = 250.0, 1.9

#: dtypes a stack carries; a float travels as the unsigned int of its width (see _bits)
_STACKABLE_DTYPES = frozenset({
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
})

_lock = threading.Lock()
_programs: dict[Any, Any] = {}          # output sharding -> jitted stack (and unstacks)
_refused: set[Any] = set()              # geometries whose stack failed once


def stackable(leaf: Any, shard_bytes: int, cpu: bool) -> Any:
    """The output sharding a stack of arrays like ``leaf`` would have, or None when
    ``leaf`` keeps its per-shard views."""
    if not cpu or shard_bytes > MAX_SHARD_BYTES:
        return None
    sharding = leaf.sharding
    spec = getattr(sharding, "spec", None)
    if spec is None or type(sharding).__name__ != "NamedSharding" \
            or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None) \
            or getattr(sharding, "memory_kind", None) not in (None, "device", "unpinned_host") \
            or not sharding.is_fully_addressable or str(leaf.dtype) not in _STACKABLE_DTYPES:
        return None
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(sharding.mesh, PartitionSpec(None, *spec),
                         memory_kind=sharding.memory_kind)


def shard_views(leaf: Any, shard_ranks: list | None, per_device: dict,
                 rank_of: Callable[[Any], int]) -> tuple[list[tuple[int, Any]], bool]:
    """``[(world rank, host view)]`` of ``leaf``'s addressable shards (numpy on CPU, CuPy
    through DLPack on GPU), and whether they came from the per-device arrays in the
    geometry's order (False: cut from the shards' own list, checked per call)."""
    import numpy as np
    from xreshard.adapters.jax import host_view
    arrays = getattr(leaf, "_arrays", None) if shard_ranks is not None else None
    if arrays is not None and shard_ranks is not None \
            and len(arrays) == len(shard_ranks) and not leaf.is_deleted():
        # the per-device arrays, in the sharding's addressable device order (JAX keeps
        # them so: ArrayImpl._check_and_rearrange); no Shard objects built
        return [(rank, np.asarray(x) if cpu else host_view(x))
                for x, (rank, cpu) in zip(arrays, shard_ranks)], True
    views = []
    for shard in leaf.addressable_shards:
        device = shard.device
        known = per_device.get(device)
        if known is None:
            known = per_device[device] = (rank_of(device), device.platform == "cpu")
        # a CPU shard is a numpy view at once (no device set built per shard)
        views.append((known[0], np.asarray(shard.data) if known[1] else host_view(shard.data)))
    return views, False


def put_views(bindings: dict, name: str, views: list[tuple[int, Any]], flip: bool,
              product: bool) -> None:
    """Bind ``views`` (world rank, host view) of tensor ``name``: transposed back when its
    canonical layout is flipped, in a list when its layout is explicit."""
    for rank, arr in views:
        bindings[(rank, name)] = as_binding(arr, flip, product)


def as_binding(view: Any, flip: bool, product: bool) -> Any:
    """A host view of a shard as its binding: transposed back when the tensor's canonical
    layout is flipped, in a list when that layout is explicit."""
    view = view.T if flip else view
    return view if product else [view]


def stack_of(leaf: Any, key: Any, shard_ranks: list | None) -> tuple[Any, tuple] | None:
    """(the output sharding, the shard shape) of a stack that reads ``leaf``'s geometry
    ``key`` (``jax_stack.py``), or None: its shards keep their views."""
    if key is None or shard_ranks is None:
        return None
    shard_shape = tuple(leaf.sharding.shard_shape(tuple(leaf.shape)))
    nbytes = math.prod(shard_shape) * leaf.dtype.itemsize
    out = stackable(leaf, nbytes, all(cpu for _, cpu in shard_ranks))
    return None if out is None else (out, shard_shape)


def bind_stacks(stacks: dict, geometry: dict, bindings: dict, per_device: dict,
                rank_of: Callable[[Any], int], shard_ranks: Callable[[Any], list | None]
                ) -> bool:
    """Bind the arrays a call set aside for stacks: ``stacks`` geometry -> ``[(name,
    leaf, flip, product)]``, ``geometry`` geometry -> (layout, shard ranks, agrees,
    (output sharding, shard shape)). A geometry of fewer than :data:`MIN_GROUP` arrays, or
    whose stack is refused, is viewed shard by shard. Whether every view came in its
    geometry's order (as :func:`shard_views`); ``shard_ranks(sharding)``: ``[(world rank,
    on CPU?)]`` of its addressable devices in its arrays' per-device order."""
    ordered = True
    for key, members in stacks.items():
        out, shard_shape = geometry[key][3]
        stacked = None if len(members) < MIN_GROUP else stacked_views(
            key, out, [leaf for _, leaf, _, _ in members], shard_shape, shard_ranks)
        for i, (name, leaf, flip, product) in enumerate(members):
            if stacked is not None:
                put_views(bindings, name, stacked[i], flip, product)
                continue
            views, in_order = shard_views(leaf, geometry[key][1], per_device, rank_of)
            ordered = ordered and in_order
            put_views(bindings, name, views, flip, product)
    return ordered


def stacked_locals(flat: dict, cache: dict, shard_ranks: Callable[[Any], list | None]
                   ) -> dict[str, dict[int, Any]]:
    """For the naming-rules path (``bind_named``): name -> {world rank: view of its shard}
    for the arrays of ``flat`` (name -> array) read through stacks, those of a geometry
    this ``cache`` (kept across a refit's calls) saw in an earlier call; the rest are not
    in it (the caller views them shard by shard)."""
    seen = cache.get("stack_seen")
    if seen is None or len(seen) > 4096:
        seen = cache["stack_seen"] = {}
    refused = stack_refused()
    groups: dict[Any, list] = {}
    new: set = set()                # first seen by this call: stacked from the next one on
    for name, leaf in flat.items():
        try:
            key = (leaf.sharding, tuple(leaf.shape), leaf.dtype)
            known = seen.get(key, False)
        except (AttributeError, TypeError):     # not an array, or an unhashable sharding
            continue
        if known is False:
            try:
                ranks = shard_ranks(leaf.sharding)
                seen[key] = None if ranks is None else stack_of(leaf, key, ranks)
            except Exception:   # noqa: BLE001 - odd geometry: bind_named's views decide
                seen[key] = None
            new.add(key)
        elif known is not None and key not in refused and key not in new \
                and not leaf.is_deleted():
            groups.setdefault(key, []).append((name, leaf))
    out: dict[str, dict[int, Any]] = {}
    for key, members in groups.items():
        views = None if len(members) < MIN_GROUP else stacked_views(
            key, seen[key][0], [leaf for _, leaf in members], seen[key][1], shard_ranks)
        if views is not None:
            out.update((name, dict(v)) for (name, _), v in zip(members, views))
    return out


@dataclass
class StackedReceive:
    """K received leaves of one geometry landing in one block per device: the leaves'
    bindings are the blocks' rows; once the refit succeeded the blocks are adopted as one
    array sharded ``out`` and a jitted unstack makes the K arrays (``unstacked``)."""

    key: Any                # the geometry
    out: Any                # the stack's sharding: P(None, *spec)
    sharding: Any           # the leaves'
    shape: tuple            # (K, *the leaves' shape)
    blocks: list            # [(device, (K, *shard shape) host buffer)]
    at: list[int]           # the leaves' places in the bind's pending list


def bind_received_stacks(stacks: dict, geometry: dict, bindings: dict, new_buffer: Any,
                         rank_of: Callable[[Any], int], pending: list) -> list[StackedReceive]:
    """Bind the received leaves a call set aside for stacks (``stacks`` geometry ->
    ``[(place in pending, name, leaf, flip, product)]``): a geometry of fewer than
    :data:`MIN_GROUP` leaves, or whose devices JAX does not list, gets a buffer per shard
    (``pending`` filled in); the others land in blocks, ``K`` leaves per block."""
    import numpy as np
    from xreshard.adapters.jax_landing import shard_buffers
    from xreshard.dtypes import numpy_dtype
    out = []
    for key, members in stacks.items():
        stack, shard_shape = geometry[key][3]
        devices = getattr(stack, "_addressable_device_assignment", None)
        if len(members) < MIN_GROUP or devices is None:
            for at, name, leaf, flip, product in members:
                pending[at] = (leaf, shard_buffers(leaf, name, flip, product, new_buffer,
                                                   rank_of, bindings))
            continue
        leaf0 = members[0][2]
        dtype = numpy_dtype(str(np.dtype(leaf0.dtype)))
        ranks = [rank_of(d) for d in devices]
        k = chunk_size(len(members), RECEIVE_CHUNK)
        for start in range(0, len(members), k):
            part = members[start:start + k]
            blocks = [(d, new_buffer((k, *shard_shape), dtype)) for d in devices]
            for i, (_, name, _, flip, product) in enumerate(part):
                for rank, (_, block) in zip(ranks, blocks):
                    row = block[i, ...]        # a view, a 0-d one for scalars too
                    view = row.T if flip else row
                    bindings[(rank, name)] = view if product else [view]
            out.append(StackedReceive(key, stack, leaf0.sharding, (k, *leaf0.shape), blocks,
                                      [m[0] for m in part]))
    return out


def unstacked(jax: Any, chunk: StackedReceive) -> list[Any]:
    """The arrays of ``chunk``'s leaves: its blocks adopted as one stacked array, split by
    a jitted unstack (a copy on each device, bit for bit); if that fails, each leaf is
    assembled from copies of its rows (and the geometry is not stacked again)."""
    import numpy as np
    n = len(chunk.at)
    try:
        dtype = chunk.blocks[0][1].dtype
        wire = np.dtype(f"uint{8 * dtype.itemsize}") if dtype.itemsize < 4 and (
            dtype.kind == "V" or np.issubdtype(dtype, np.floating)) else dtype  # see _bits
        arrays = [jax.device_put(block.view(wire), device) for device, block in chunk.blocks]
        whole = jax.make_array_from_single_device_arrays(chunk.shape, chunk.out, arrays)
        got = list(_unstack_program(chunk.out, chunk.sharding, dtype)(whole))[:n]
        first = got[0]      # e.g. under jax.disable_jit() out_shardings may not hold
        if first.sharding != chunk.sharding or first.dtype != dtype \
                or tuple(first.shape) != chunk.shape[1:]:
            raise ValueError(f"the unstack made {first.dtype}{tuple(first.shape)} sharded "
                             f"{first.sharding}")
        return got
    except Exception:       # noqa: BLE001 - the rows hold the bytes either way
        with _lock:
            _refused.add(chunk.key)
    return [jax.make_array_from_single_device_arrays(
        chunk.shape[1:], chunk.sharding,
        [jax.device_put(np.array(block[i]), device) for device, block in chunk.blocks])
        for i in range(n)]


def _unstack_program(out: Any, sharding: Any, dtype: Any) -> Any:
    """The jitted split of a stack sharded ``out`` into arrays sharded ``sharding`` of
    ``dtype`` (the stack holds a float dtype's bits: each row is bitcast back, no convert)."""
    with _lock:
        key = ("unstack", out, sharding, dtype)
        program = _programs.get(key)
        if program is None:
            import jax
            if len(_programs) >= 256:
                _programs.clear()

            def split(s: Any) -> tuple:
                rows = (s[i] for i in range(s.shape[0]))
                if s.dtype == dtype:
                    return tuple(rows)
                return tuple(jax.lax.bitcast_convert_type(r, dtype) for r in rows)
            program = _programs[key] = jax.jit(split, out_shardings=sharding)
        return program


def stack_refused() -> frozenset:
    """The geometries whose stack failed (their arrays keep per-shard views)."""
    with _lock:
        return frozenset(_refused)


def _bits(x: Any) -> Any:
    """``x`` (traced) as the unsigned ints of its width when it is a float narrower than
    float32: XLA's CPU backend computes those in float32 (its bf16/f16 normalization), so a
    stack of bf16 came back with every NaN payload made canonical (0x7fde -> 0x7fc0); a
    bitcast moves bits and nothing else. float32 and float64 are stacked as they are (no
    normalization; the raw-bit tests check it): bitcasting them doubled the stack's cost."""
    import jax
    import jax.numpy as jnp
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _program(out: Any) -> Any:
    with _lock:
        program = _programs.get(out)
        if program is None:
            import jax
            import jax.numpy as jnp
            if len(_programs) >= 256:
                _programs.clear()
            program = _programs[out] = jax.jit(lambda *xs: jnp.stack([_bits(x) for x in xs]),
                                               out_shardings=out)
        return program


def chunk_size(n: int, limit: int = CHUNK) -> int:
    """K for a group of ``n`` arrays: the power of two from 16 to ``limit`` that makes
    its stacks cheapest, ``ceil(n / K)`` runs at :data:`_RUN_US` plus ``K`` arguments
    each at :data:`_ARG_US` (a short chunk repeats its last array); a function of ``n``
    alone, so a group keeps its programs from call to call."""
    best, k = (math.inf, 16), 16
    while k <= limit:
        runs = -(-n // k)
        best = min(best, (runs * (_RUN_US + k * _ARG_US), k))
        if k >= n:
            break
        k *= 2
    return best[1]


def stacked_views(key: Any, out: Any, leaves: Sequence[Any], shard_shape: tuple[int, ...],
                  shard_ranks: Callable[[Any], list | None]) -> list[list[tuple[int, Any]]] | None:
    """For each of ``leaves`` (arrays of geometry ``key``), ``[(world rank, numpy view of
    its shard on that rank's device)]``, read through stacks sharded as ``out``; None when
    the stack is refused (the geometry keeps per-shard views from then on).

    ``shard_ranks(sharding)`` gives ``[(world rank, on CPU?)]`` of a sharding's
    addressable devices in its arrays' per-device order."""
    blocks = stack_blocks(key, out, leaves, shard_shape, shard_ranks)
    if blocks is None:
        return None
    views: list[list[tuple[int, Any]]] = []
    for per_device, size in blocks:
        # host[i, ...]: a view (host[i] of a stack of scalars is a numpy scalar)
        views.extend([(rank, host[i, ...]) for rank, host in per_device] for i in range(size))
    return views


def stack_blocks(key: Any, out: Any, leaves: Sequence[Any], shard_shape: tuple[int, ...],
                 shard_ranks: Callable[[Any], list | None]
                 ) -> list[tuple[list[tuple[int, Any]], int]] | None:
    """The stacks of ``leaves`` (arrays of geometry ``key``), a chunk at a time: ``(
    [(world rank, host block (K, *shard_shape))] in the stack's per-device order, how many
    of the K rows are the chunk's)``; row ``i`` of a block is the shard of the chunk's
    ``i``-th leaf on that rank. None when the stack is refused (see :func:`stacked_views`)."""
    import numpy as np
    from xreshard.dtypes import numpy_dtype
    n = len(leaves)
    k = chunk_size(n)
    dtype = numpy_dtype(str(np.dtype(leaves[0].dtype)))
    blocks: list[tuple[list[tuple[int, Any]], int]] = []
    try:
        program = _program(out)
        outputs = []
        for start in range(0, n, k):
            chunk = list(leaves[start:start + k])
            size = len(chunk)
            chunk.extend(chunk[-1:] * (k - size))       # the same program for a short chunk
            outputs.append((program(*chunk), size))
        for stacked, size in outputs:
            ranks = shard_ranks(stacked.sharding)
            arrays = stacked._arrays
            if ranks is None or len(arrays) != len(ranks):
                raise ValueError("the stack's devices are not the sharding's")
            per_device = []
            for block, (rank, _) in zip(arrays, ranks):
                host = np.asarray(block).view(dtype)       # the floats' bits, as floats
                if host.shape != (k, *shard_shape):
                    raise ValueError(f"stacked block {host.shape}, expected {(k, *shard_shape)}")
                per_device.append((rank, host))
            blocks.append((per_device, size))
    except Exception:       # noqa: BLE001 - the per-shard views are always right
        if not any(leaf.is_deleted() for leaf in leaves):
            with _lock:         # a deleted array is the caller's error, not the stack's:
                _refused.add(key)   # the per-shard path reports it as it always did
        return None
    return blocks


def refused_count() -> int:
    """How many geometries' stacks have failed in this process (it only grows)."""
    return len(_refused)
