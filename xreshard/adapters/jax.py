"""JAX bridge: describe a ``jax.Array`` or a ``Sharding`` as a neutral :class:`Layout`.

Only geometry: nothing here moves data or touches device memory.

Two ways in (docs/layouts.md §1.6, "the ingestion rule"):

* ``NamedSharding`` over a concrete (or abstract) ``Mesh`` is parsed symbolically with
  :meth:`Layout.from_spec`. The product form is compact and lets the planner intersect per
  dim instead of per rank.
* Every other sharding (``SingleDeviceSharding``, ``GSPMDSharding``, a ``NamedSharding``
  with a private ``_logical_device_ids`` permutation, unknown subclasses) goes through
  ``sharding.devices_indices_map(shape)``, which already encodes any device permutation,
  and becomes an explicit-form layout.

Layouts are keyed by world rank, never by JAX device id: CPU device ids jump by 2048 per
process and ``jax.make_mesh`` may reorder devices, so ids are only ever looked up, never
computed with.

jax is imported lazily so that ``import xreshard.adapters.jax`` stays cheap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from xreshard.adapters.jax_landing import Landing, adopted, aligned_empty, shard_buffers
from xreshard.adapters.jax_replay import View, geometry_agrees, record, replayed
from xreshard.adapters.jax_stack import (
    bind_received_stacks, bind_stacks, put_views, refused_count, shard_views, stack_of,
    stack_refused, stacked_locals)
from xreshard.errors import LayoutError
from xreshard.extras import require
from xreshard.ir.layout import Layout, LayoutMemo, Mesh, Region
from xreshard.runtime.binding import canonical_name

if TYPE_CHECKING:       # naming imports this module: at run time NameMap is imported lazily
    from xreshard.adapters.naming import NameMap

__all__ = ["array_layout", "bind", "bind_named", "bind_rules", "host_view", "layout_of",
           "pinned_pointer", "tree_names"]

#: what ``ranks`` may be: a map from device (or device id) to world rank, a sequence aligned
#: with the default device order, or a callable device -> world rank
RankSpec = Mapping[Any, int] | Sequence[int] | Callable[[Any], int] | None


def _import_jax():
    jax = require("jax", "jax", "xreshard.adapters.jax")
    require("jax.sharding", "jax", "xreshard.adapters.jax")    # the submodule we use
    return jax


def layout_of(x_or_sharding: Any, shape: Sequence[int] | None = None, dtype: Any = None,
              ranks: RankSpec = None, *, name: str | None = None) -> Layout:
    """The layout of a JAX array, or of a tensor of ``shape``/``dtype`` under a sharding.

    Default rank numbering (``ranks=None``):

    * ``NamedSharding``: a device's position in ``mesh.devices.flat`` (C order), i.e. its
      row-major mesh coordinate. On mesh ``(dp=2, tp=2)`` built from devices ``[d5, d4, d7,
      d6]`` the ranks are ``d5 -> 0, d4 -> 1, d7 -> 2, d6 -> 3``. Two tensors on the same
      mesh get the same numbering.
    * any other sharding: a device's position among the sharding's devices sorted by
      device id (a ``SingleDeviceSharding`` is always rank 0).

    Pass ``ranks`` whenever the layout must line up with ranks numbered elsewhere (the
    other side of a refit, other meshes).

    Example, ``P('tp')`` on 8 rows, mesh ``(dp=2, tp=2)``::

        # rank | coord (dp,tp) | region
        #    0 | (0,0)         | [0:4]
        #    1 | (0,1)         | [4:8]
        #    2 | (1,0)         | [0:4]
        #    3 | (1,1)         | [4:8]

    Args:
        x_or_sharding: a ``jax.Array`` or ``jax.ShapeDtypeStruct`` with a sharding (shape
            and dtype are read from it), or a ``jax.sharding.Sharding``.
        shape: global shape; required with a bare sharding, must match an array's if given.
        dtype: dtype; required with a bare sharding, must match an array's if given.
        ranks: world rank of each device. ``None`` (see above); a mapping
            ``{device or device id: rank}``; a sequence aligned with the default order
            (``mesh.devices.flat`` for ``NamedSharding``, else devices sorted by id); or a
            callable ``device -> rank``. Device ids are only used as lookup keys.
        name: tensor name, used in error messages.

    Returns:
        A product-form layout for ``NamedSharding``, an explicit-form one otherwise.

    Raises:
        ImportError: JAX is not installed.
        TypeError: ``x_or_sharding`` is neither an array nor a sharding.
        LayoutError: missing or mismatched shape/dtype, an unreduced (pending reduction)
            spec, an uneven split, or a ``ranks`` that misses a device or repeats a rank.
    """
    jax = _import_jax()
    shape, dtype, sharding = _unpack(jax, x_or_sharding, shape, dtype, name)

    named = jax.sharding.NamedSharding
    if isinstance(sharding, named):
        spec = sharding.spec
        # devices_indices_map raises NotImplementedError on unreduced specs; say why instead.
        if getattr(spec, "unreduced", None):
            where = _where(name)
            raise LayoutError(f"{where}PartitionSpec {spec} has unreduced axes "
                              f"{sorted(spec.unreduced)} (a pending reduction); xreshard does "
                              "not reduce yet - reduce (e.g. jax.lax.psum) before refitting")
        mesh = sharding.mesh
        if not isinstance(mesh, jax.sharding.Mesh):
            return _from_abstract_mesh(mesh, spec, shape, dtype, ranks, name)
        devices = list(mesh.devices.flat)
        if getattr(sharding, "_logical_device_ids", None) is None:
            world = _world_ranks(devices, ranks, "mesh.devices.flat", name)
            xmesh = Mesh(tuple(mesh.devices.shape), tuple(world), tuple(mesh.axis_names))
            return Layout.from_spec(shape, dtype, xmesh, spec, name=name)
        # A private device permutation: the index map already encodes it. Keep mesh-order
        # rank numbering so the default agrees with other tensors on this mesh.
        return _from_index_map(sharding, shape, dtype, devices, ranks, "mesh.devices.flat", name)

    index_devices = sorted(sharding.device_set, key=lambda d: d.id)
    return _from_index_map(sharding, shape, dtype, index_devices, ranks,
                           "the sharding's devices sorted by id", name)


# ---------------------------------------------------------------------------- helpers

def _where(name: str | None) -> str:
    return f"tensor {name!r}: " if name else ""


def _unpack(jax, x: Any, shape, dtype, name) -> tuple[tuple[int, ...], Any, Any]:
    """(shape, dtype, sharding) from an array, a ShapeDtypeStruct or a bare sharding."""
    where = _where(name)
    if isinstance(x, jax.sharding.Sharding):
        if shape is None or dtype is None:
            raise LayoutError(f"{where}layout_of(sharding) needs the global shape and dtype: "
                              "layout_of(sharding, shape, dtype), or pass the jax.Array itself")
        return tuple(int(s) for s in shape), _dtype(jax, dtype), x
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            raise LayoutError(f"{where}{type(x).__name__} has no sharding; give it one "
                              "(jax.ShapeDtypeStruct(shape, dtype, sharding=...))")
        own_shape = tuple(int(s) for s in x.shape)
        if shape is not None and tuple(int(s) for s in shape) != own_shape:
            raise LayoutError(f"{where}shape {tuple(shape)} was passed but the array has shape "
                              f"{own_shape}; omit shape for arrays")
        if dtype is not None and jax.numpy.dtype(dtype) != x.dtype:
            raise LayoutError(f"{where}dtype {dtype} was passed but the array has dtype "
                              f"{x.dtype}; omit dtype for arrays (casts are a refit option)")
        return own_shape, x.dtype, sharding
    raise TypeError(f"layout_of expects a jax.Array, a jax.ShapeDtypeStruct or a "
                    f"jax.sharding.Sharding, got {type(x).__name__}")


def _dtype(jax, dtype: Any) -> Any:
    """``jnp.float32`` and friends are scalar *types*; their dtype is what has a name."""
    if isinstance(dtype, str):
        return dtype
    try:
        return jax.numpy.dtype(dtype)
    except TypeError:
        return dtype  # not a numpy-like dtype: let Layout report it


def _world_ranks(devices: Sequence[Any], ranks: RankSpec, order: str,
                 name: str | None) -> list[int]:
    """World rank of each device in ``devices`` (the default order, see layout_of)."""
    where = _where(name)
    if ranks is None:
        return list(range(len(devices)))
    if isinstance(ranks, Mapping):
        out = []
        for d in devices:
            # A device is its own best key; the id is a fallback key for JSON-ish configs.
            if d in ranks:
                out.append(ranks[d])
            elif d.id in ranks:
                out.append(ranks[d.id])
            else:
                raise LayoutError(f"{where}ranks has no entry for device {d} (id {d.id}); map "
                                  "every device of the sharding, by device or by device id")
    elif callable(ranks):
        out = [ranks(d) for d in devices]
    elif isinstance(ranks, (str, bytes)):
        raise TypeError(f"ranks must be a mapping, a sequence of ints or a callable, got {ranks!r}")
    else:
        # a numpy array may come shaped like the mesh; its row-major flattening is aligned
        seq = _flatten(ranks.tolist()) if hasattr(ranks, "tolist") else list(ranks)
        if len(seq) != len(devices):
            raise LayoutError(f"{where}ranks has {len(seq)} entries but the sharding has "
                              f"{len(devices)} devices; list one world rank per device in the "
                              f"order of {order}")
        out = seq
    try:
        out = [int(r) for r in out]
    except (TypeError, ValueError) as e:
        raise LayoutError(f"{where}ranks must give an int world rank per device: {e}") from e
    if len(set(out)) != len(out) or any(r < 0 for r in out):
        raise LayoutError(f"{where}ranks gives world ranks {out} for devices {list(devices)}; "
                          "each device needs its own world rank >= 0")
    return out


def _flatten(xs: Any) -> list:
    if isinstance(xs, list):
        return [y for x in xs for y in _flatten(x)]
    return [xs]


def _from_abstract_mesh(mesh, spec, shape, dtype, ranks, name) -> Layout:
    """NamedSharding over an AbstractMesh: no devices, so ranks follow mesh positions."""
    where = _where(name)
    if ranks is not None and (isinstance(ranks, Mapping) or callable(ranks)):
        raise LayoutError(f"{where}the sharding's mesh is an AbstractMesh (no devices), so "
                          "ranks cannot map devices; pass a sequence of world ranks in "
                          "row-major mesh order, or None for 0..n-1")
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    positions = [None] * math.prod(sizes)
    world = (list(range(len(positions))) if ranks is None
             else _world_ranks(positions, ranks, "row-major mesh positions", name))
    xmesh = Mesh(sizes, tuple(world), tuple(mesh.axis_names))
    return Layout.from_spec(shape, dtype, xmesh, spec, name=name)


def _from_index_map(sharding, shape, dtype, devices, ranks, order, name) -> Layout:
    """Explicit form from ``devices_indices_map``, keyed by world rank."""
    index_map = sharding.devices_indices_map(tuple(shape))
    world = _world_ranks(devices, ranks, order, name)
    regions = {}
    for d, rank in zip(devices, world):
        if d in index_map:
            regions[rank] = [_region_of(index_map[d], shape, name)]
    return Layout.explicit_form(shape, dtype, regions)


def _region_of(index: Sequence[slice], shape: Sequence[int], name: str | None) -> Region:
    """A devices_indices_map index (``slice(None)`` for whole dims) as a Region."""
    bounds = []
    for dim, (s, n) in enumerate(zip(index, shape)):
        start, stop, step = s.indices(n)
        if step != 1:
            where = _where(name)
            raise LayoutError(f"{where}dim {dim} index {s} has step {step}; only contiguous "
                              "shards can be described")
        bounds.append((start, max(start, stop)))
    # devices_indices_map gives one slice per dim; trailing dims, if any, are whole.
    bounds += [(0, n) for n in shape[len(bounds):]]
    return Region.of(bounds)


# ---------------------------------------------------------------------------- bindings

def tree_names(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf: names are ``/``-joined pytree paths,
    ``{"layers": [{"attn": {"q": {"kernel": x}}}]}`` -> ``"layers/0/attn/q/kernel"``."""
    jax = _import_jax()
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_str(k) for k in path), leaf) for path, leaf in flat]


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key).strip(".[]'\"")


def host_view(x: Any) -> Any:
    """A zero-copy array over a single-device jax.Array's buffer: numpy on CPU, CuPy on GPU.

    Typed on both (bf16 and float8 as their ml_dtypes types). On GPU, DLPack carries the
    types CuPy knows (bf16 only with CuPy >= 14, ml_dtypes and numpy >= 2.1.2), and its
    stream handshake orders CuPy's current stream after JAX's producer. Any other dtype
    (float8, or bf16 under an older CuPy) is wrapped from the buffer's address, read from a
    DLPack capsule that the CuPy array keeps unconsumed (see :func:`pinned_pointer`): JAX
    orders the current stream after the producer for it too, and the buffer cannot be
    donated away while the array lives.
    """
    import numpy as np
    device = next(iter(x.devices()))
    if device.platform == "cpu":
        return np.asarray(x)
    cupy = require("cupy", "gpu", "binding GPU JAX arrays")
    from xreshard.dtypes import as_dtype, bits_dtype, dtype_name
    from xreshard.runtime.devices import cupy_knows

    name = dtype_name(x.dtype)
    with cupy.cuda.Device(device.local_hardware_id):
        if cupy_knows(name):
            return cupy.from_dlpack(x)
        stream = cupy.cuda.get_current_stream().ptr or 1    # DLPack: 1 is the legacy stream
        ptr, owner = pinned_pointer(x, stream)
        nbytes = x.dtype.itemsize * math.prod(x.shape)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device.local_hardware_id)
        raw = cupy.ndarray(tuple(x.shape), bits_dtype(x.dtype.itemsize),
                           cupy.cuda.MemoryPointer(mem, 0))
        return as_dtype(raw, name)


def pinned_pointer(x: Any, stream: int | None = None) -> tuple[int, Any]:
    """(address of the buffer, owner) of a single-device ``jax.Array``, the owner holding a
    reference on the buffer that JAX honours.

    The owner is ``x.__dlpack__()``'s capsule, kept unconsumed: while it lives JAX holds an
    external reference on the buffer, and a jitted step that donates ``x`` gets a copy
    instead of reusing (or freeing) the memory under a reader (PjRt refuses to donate a
    buffer with external references). ``x.unsafe_buffer_pointer()`` holds nothing: a
    donating step may free the buffer while ``Refit.start`` still reads it. ``stream``:
    the consumer's CUDA stream, which JAX orders after the buffer's producer (DLPack's
    handshake); None on CPU.

    Raises:
        LayoutError: JAX cannot export the array through DLPack.
    """
    try:
        capsule = x.__dlpack__() if stream is None else x.__dlpack__(stream=stream)
    except Exception as e:      # noqa: BLE001 - said with what to do
        raise LayoutError(f"cannot hold a reference on a {x.dtype} JAX array's buffer "
                          f"(its DLPack export failed: {type(e).__name__}: {e}); send it "
                          f"cast to a dtype CuPy knows (wire_dtype), or upgrade JAX") from e
    return _capsule_data(capsule), capsule


def _capsule_data(capsule: Any) -> int:
    """The data address (``data + byte_offset``) of the DLTensor an unconsumed DLPack capsule
    holds: ``DLManagedTensor`` ("dltensor", the tensor first) or ``DLManagedTensorVersioned``
    ("dltensor_versioned": version, manager_ctx, deleter, flags, then the tensor)."""
    import ctypes
    api = ctypes.pythonapi
    get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
        ("PyCapsule_GetName", api))
    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", api))
    name = get_name(capsule)
    if name not in (b"dltensor", b"dltensor_versioned"):
        raise LayoutError(f"a DLPack capsule named {name!r} was already consumed")
    tensor = get_pointer(capsule, name) + (32 if name == b"dltensor_versioned" else 0)
    data = ctypes.c_void_p.from_address(tensor).value or 0
    return data + ctypes.c_uint64.from_address(tensor + 40).value        # + byte_offset


def _rank_of(ranks: Mapping[int, int]) -> Callable[[Any], int]:
    def rank_of(device: Any) -> int:
        try:
            return ranks[int(device.id)]
        except KeyError:
            raise LayoutError(f"JAX device {device} is not a rank of the refit world; pass "
                              f"jax.local_devices() (or the devices you use) to "
                              f"World.join") from None
    return rank_of


def array_layout(arr: Any, ranks: Mapping[int, int], name: str = "", *,
                 memo: LayoutMemo | None = None) -> Layout:
    """The :class:`Layout` of a ``jax.Array`` (or a ``ShapeDtypeStruct`` with a sharding),
    with JAX device ids mapped to world ranks by ``ranks``; remembered in ``memo`` (when
    given) by sharding, shape, dtype and rank map, so a refit every step converts each
    sharding once."""
    if memo is None:
        return layout_of(arr, ranks=_rank_of(ranks), name=name)
    rid = memo.ranks_id(ranks)
    return memo.get(None if rid is None else (arr.sharding, tuple(arr.shape), arr.dtype, rid),
                    lambda: layout_of(arr, ranks=_rank_of(ranks), name=name))


# ---------------------------------------------------------------------------- the refit's hooks
# (xreshard.runtime.registry: the core finds this module by its path and calls these)

LABEL = "JAX arrays"


def accepts(obj: Any) -> bool:
    """A pytree whose leaves are all ``jax.Array`` / ``ShapeDtypeStruct`` (jax loaded)."""
    import sys
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    leaves = jax.tree_util.tree_leaves(obj)
    # one leaf of each type asked, not every leaf (isinstance on jax.Array runs Python)
    return bool(leaves) and all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
                                for x in dict(zip(map(type, leaves), leaves)).values())


def identity(devices: Sequence[Any], ranks: Sequence[int]) -> list[list[int]]:
    """``[[JAX device id, world rank]]`` for this process's ranks held by JAX devices."""
    import sys
    jax = sys.modules.get("jax")
    if jax is None:
        return []
    return [[int(d.id), int(r)] for d, r in zip(devices, ranks) if isinstance(d, jax.Device)]


def keep(tree: Any, side: str) -> Any:
    """What a refit keeps of ``tree`` after a call: nothing of sent arrays (the trainer may
    donate them; pass ``send=`` on every call), received ones as ``ShapeDtypeStruct``
    templates (live arrays are never written)."""
    if side == "send":
        return None
    jax = _import_jax()
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def refit_bind(tree: Any, side: str, context: Any) -> Any:
    """:func:`bind` with what the refit knows (a ``xreshard.runtime.registry.BindContext``)."""
    if context.rules is not None:
        if side != "send":
            raise LayoutError("naming rules (Refit(rules=...)) map a JAX pytree being sent "
                              "onto canonical tensors; a receiving JAX tree is bound by its "
                              "own paths (use names= to rename them)")
        return bind_rules(tree, context.rules, context.ranks, memo=context.memo,
                          cache=context.cache)
    landing = context.cache.setdefault("landing", Landing()) if side == "receive" else None
    return _bind_paused(tree, side, ranks=context.ranks, names=context.names,
                        transpose=context.transpose, memo=context.memo, cache=context.cache,
                        local_ranks=frozenset(context.local_ranks), landing=landing)


def bind_rules(tree: Any, rules: Any, ranks: Mapping[int, int], *,
               memo: LayoutMemo | None = None, cache: dict | None = None) -> Any:
    """The send side of a JAX pytree mapped onto canonical (HF) tensors by naming rules
    (``xreshard.adapters.naming``): each canonical tensor is bound as views of the trainer
    arrays' shards (:func:`bind_named`).

    Args:
        tree: a pytree of ``jax.Array``; its ``/``-joined paths are what the rules match.
        rules: a ``NameMap``, or a sequence of ``Rule`` / ``ConcatRule``.
        ranks: JAX device id -> world rank.
        memo: where the arrays' layouts are remembered across calls (None: nowhere).
        cache: a dict the caller keeps across calls (a refit's): small shards of a geometry
            bound before are read through stacks (``jax_stack.py``); None: never.
    """
    from xreshard.adapters.naming import NameMap
    namemap = rules if isinstance(rules, NameMap) else NameMap(tuple(rules))
    return bind_named(tree, namemap, ranks, memo=memo, cache=cache)


def bind_named(tree: Any, namemap: NameMap, ranks: Mapping[int, int], *, memo: Any = None,
               cache: dict | None = None) -> Any:
    """The send side of a JAX pytree whose HF tensors the naming rules describe.

    Each array becomes a :class:`ShardedView` (its layout, and its addressable shards as
    zero-copy host views) and goes through its rule's transforms (:meth:`NameMap.expand`),
    so each HF tensor's layout is product form over the trainer's mesh and its bindings are
    views of the shards (a reshape that cannot be a view copies; sending never writes them).

    Args:
        tree: a pytree of ``jax.Array`` (``/``-joined paths are the trainer names).
        namemap: the rules.
        ranks: JAX device id -> world rank, for every device of the arrays.
        memo: the ``LayoutMemo`` the arrays' layouts are remembered in (default a fresh
            one).
        cache: as :func:`bind_rules`'.

    Returns:
        A :class:`~xreshard.runtime.binding.Bound`: HF name -> layout, (rank, HF name) -> view.
        The views of the shards come from ``xreshard.adapters.naming`` (``ShardedView``).

    Raises:
        NamingError: names no rule maps (or several do), ConcatRules, or a transform the
            sharding does not allow (naming the tensor and the mesh axes).
    """
    from xreshard.adapters.naming import ShardedView
    from xreshard.adapters.naming_rules import ConcatRule, NamingError
    from xreshard.runtime.binding import Bound

    flat = dict(tree_names(tree))
    namemap.check({n: tuple(a.shape) for n, a in flat.items()})
    memo_kw = {} if memo is None else {"memo": memo}
    layouts: dict[str, Layout] = {}
    bindings: dict[tuple[int, str], Any] = {}
    rank_of = _rank_of(ranks)
    stacked = {} if cache is None else stacked_locals(
        flat, cache, lambda s: _shard_ranks(s, rank_of))
    for name, arr in flat.items():
        rule, fields = next((r, m) for r in namemap.rules if (m := r.match(name)) is not None)
        if isinstance(rule, ConcatRule):
            # TODO(explicit layouts per source): a ConcatRule's HF tensor is several arrays
            raise NamingError(f"{name!r}: ConcatRule {rule.dst!r} cannot send sharded arrays: "
                              f"its HF tensor is made of several trainer arrays; map each "
                              f"part with a Rule of its own, or concatenate them in the "
                              f"trainer")
        assert isinstance(fields, dict)         # a Rule's match (a ConcatRule's is refused)
        layout = _as_product(array_layout(arr, ranks, name, **memo_kw), name)
        local = stacked.get(name) or {
            ranks[int(s.device.id)]: host_view(s.data) for s in arr.addressable_shards}
        for view, f in namemap.expand(ShardedView(layout, local), dict(fields), rule.transforms,
                                      name):
            hf = rule.dst.format(**f)
            layouts[hf] = view.layout
            bindings.update(((r, hf), a) for r, a in view.arrays.items())
    return Bound(layouts, bindings)


def _as_product(layout: Layout, name: str) -> Layout:
    """``layout`` in product form (what the naming rules' view algebra needs)."""
    from xreshard.adapters.naming_rules import NamingError
    explicit = layout.explicit
    if explicit is None:                # product form
        if any(sp.split_factor != 1 for sp in layout.splits):
            raise NamingError(f"{name!r}: strided splits cannot go through naming rules")
        return layout
    full = (tuple(0 for _ in layout.shape), layout.shape)
    if all(len(rs) == 1 and (rs[0].starts, rs[0].stops) == full for _, rs in explicit):
        ranks = tuple(r for r, _ in explicit)
        return Layout.replicated(layout.shape, layout.dtype, Mesh((len(ranks),), ranks))
    raise NamingError(f"{name!r}: only NamedSharding (or fully replicated) arrays can go "
                      "through naming rules")


def bind(tree: Any, side: str, *, ranks: Mapping[int, int], names: Any = None,
         transpose: frozenset[str] = frozenset(), memo: LayoutMemo | None = None,
         cache: dict | None = None) -> Any:
    """Bind a pytree of ``jax.Array`` (send) or of arrays / ``ShapeDtypeStruct`` with
    shardings (receive) to world ranks.

    Sending exports each addressable shard without copying (a read-only numpy view on CPU,
    CuPy through DLPack on GPU); a refit that binds small CPU shards of one geometry again
    reads them through jitted per-device stacks instead (``jax_stack.py``). Receiving
    allocates one buffer per addressable shard and, once the refit succeeded, builds new
    arrays with ``jax.make_array_from_single_device_arrays`` (JAX arrays are immutable: a
    live array is never written). The result is the refit's ``received`` pytree.

    Args:
        tree: the pytree.
        side: "send" or "receive".
        ranks: JAX device id -> world rank (the refit all-gathers it).
        names: default path name -> canonical name (mapping or callable).
        transpose: canonical names stored as ``[in, out]`` kernels of ``[out, in]`` tensors.
        memo: layouts remembered across calls (a Refit passes its own); None converts
            every sharding anew.
        cache: a dict kept by the caller across calls of one side: the tree's names are
            computed once per tree structure.
    """
    bound = _bind_paused(tree, side, ranks=ranks, names=names, transpose=transpose,
                         memo=memo, cache=cache)
    # a Bound handed to the caller may be changed before a refit gets it: walked in full
    bound.checked = bound.fresh = False
    return bound


def _bind_paused(tree: Any, side: str, *, ranks: Mapping[int, int], names: Any,
                 transpose: frozenset[str], memo: LayoutMemo | None, cache: dict | None,
                 local_ranks: frozenset[int] = frozenset(), landing: Landing | None = None
                 ) -> Any:
    """:func:`bind`, collector paused; ``Bound.checked`` needs this process's ranks;
    ``landing``: where received shards land (None: new buffers)."""
    from xreshard.runtime.gcpause import gc_paused
    with gc_paused():
        return _bind(tree, side, ranks=ranks, names=names, transpose=transpose,
                     memo=LayoutMemo() if memo is None else memo,
                     cache={} if cache is None else cache, local_ranks=local_ranks,
                     landing=landing)


def _shard_ranks(sharding: Any, rank_of: Callable[[Any], int]) -> list[tuple[int, bool]] | None:
    """``[(world rank, on CPU?)]`` of ``sharding``'s addressable devices in the order an
    array of it keeps its per-device arrays, or None when this JAX does not say (the
    caller then walks ``addressable_shards``)."""
    devices = getattr(sharding, "_addressable_device_assignment", None)
    if devices is None:
        return None
    return [(rank_of(d), d.platform == "cpu") for d in devices]


def _leaf_names(jax: Any, tree: Any, names: Any, cache: dict) -> tuple[list[str], list, Any]:
    """(canonical names, leaves, treedef); the names of a tree structure are computed once
    per ``cache``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    key = dict(names) if isinstance(names, Mapping) else names
    got = cache.get("names")
    if got is not None and got[0] == treedef and (got[1] is key or got[1] == key):
        return got[2], leaves, treedef
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = [canonical_name("/".join(_key_str(k) for k in path), names) for path, _ in flat]
    cache["names"] = (treedef, key, out)
    return out, leaves, treedef


def _geometry_cache(cache: dict, ranks: Mapping[int, int]) -> dict:
    """The geometry cache ``_bind`` keeps in ``cache`` for rank map ``ranks``."""
    rank_map = dict(ranks)
    kept = cache.get("geometry")
    if kept is None or kept[0] != rank_map or len(kept[1]) > 4096:
        kept = cache["geometry"] = (rank_map, {})
    return kept[1]


def _bind(tree: Any, side: str, *, ranks: Mapping[int, int], names: Any, transpose: frozenset[str],
          memo: LayoutMemo, cache: dict, local_ranks: frozenset[int] = frozenset(),
          landing: Landing | None = None) -> Any:
    jax = _import_jax()
    from xreshard.runtime.binding import Bound

    rank_of = _rank_of(ranks)
    leaf_names, leaves, treedef = _leaf_names(jax, tree, names, cache)
    layouts: dict[str, Layout] = {}
    bindings: dict[tuple[int, str], Any] = {}
    errors: list[str] = []
    rid = memo.ranks_id(ranks)
    pending: list = []      # receive: (leaf, [(device, buffer)] or None: in a stack)
    per_device: dict[Any, tuple[int, bool]] = {}    # device -> (world rank, on CPU?)
    # (sharding, shape, dtype) -> (layout, [(world rank, on CPU?)] of the shards in the
    # array's own order, or None; whether the layout agrees; a send stack's (output
    # sharding, shard shape) or None: jax_stack.py): what every array of that geometry
    # shares, looked up per array instead of walked per shard; kept across calls (an
    # optimizer step's new arrays have new, equal shardings) for the same rank map
    # (compared by value: a memo's ranks_id numbers restart when it is new or full),
    # bounded like the memo
    geometry = {} if rid is None else _geometry_cache(cache, ranks)
    # every binding from a geometry compared with its layout: Bound.checked (no walk)
    checked = bool(local_ranks)
    new_buffer = aligned_empty if landing is None else landing.begin()    # jax_landing.py
    stacks: dict[Any, list] = {}     # geometry -> its leaves read or landed through stacks
    refused, refused_n = stack_refused(), refused_count()
    new_keys: set = set()           # geometries first seen by this call
    shard_ranks_of = functools.partial(_shard_ranks, rank_of=rank_of)
    if side == "send" and rid is not None:      # a lookup when nothing changed (jax_replay.py)
        got = replayed(cache.get("replay"), geometry=geometry, memo=memo, names=leaf_names,
                       transpose=transpose, local_ranks=local_ranks, leaves=leaves,
                       per_device=per_device, rank_of=rank_of, shard_ranks=shard_ranks_of)
        if got is not None:
            return Bound(got[0], got[1], None, [], checked=got[2], fresh=False)
    viewed: list[View] = []         # the send side's leaves viewed shard by shard
    for i, (name, leaf) in enumerate(zip(leaf_names, leaves)):
        if name in layouts:
            errors.append(f"two leaves map to tensor {name!r}")
            continue
        key = None if rid is None else (leaf.sharding, tuple(leaf.shape), leaf.dtype)
        try:
            known_geo = geometry.get(key) if key is not None else None
        except TypeError:       # an unhashable sharding: converted every call
            key = known_geo = None
        if known_geo is None:
            layout = memo.get(None if key is None else key + (rid,),
                              lambda: layout_of(leaf, ranks=rank_of, name=name))
            shard_ranks = _shard_ranks(leaf.sharding, rank_of)
            agrees = geometry_agrees(leaf, layout, shard_ranks, local_ranks)
            known_geo = (layout, shard_ranks, agrees,
                         stack_of(leaf, key, shard_ranks) if agrees else None)
            if key is not None:
                geometry[key] = known_geo
                new_keys.add(key)       # stacked from its next call on: one-shot binds
                                        # (and a first refit) compile nothing
        layout = known_geo[0]
        flip = name in transpose
        checked = checked and known_geo[2] and not flip
        if flip:
            if layout.ndim != 2:
                errors.append(f"{name!r} is in transpose but has {layout.ndim} dims (need 2)")
                continue
            layout = layout.permuted((1, 0))
        layouts[name] = layout
        if side == "send":
            if known_geo[3] is not None and key not in refused and key not in new_keys \
                    and not leaf.is_deleted():
                stacks.setdefault(key, []).append((name, leaf, flip, layout.is_product))
                continue            # read through a stack below (jax_stack.py)
            views, ordered = shard_views(leaf, known_geo[1], per_device, rank_of)
            checked = checked and ordered
            put_views(bindings, name, views, flip, layout.is_product)
            if rid is not None:         # what a replay's record needs (refit binds)
                viewed.append(View(i, name, flip, layout.is_product, known_geo[1]))
        elif known_geo[3] is not None and key not in refused and key not in new_keys:
            stacks.setdefault(key, []).append((len(pending), name, leaf, flip, layout.is_product))
            pending.append((leaf, None))    # lands in a stack's blocks (jax_stack.py)
        else:
            pending.append((leaf, shard_buffers(leaf, name, flip, layout.is_product,
                                                new_buffer, rank_of, bindings)))

    if side == "send":
        checked = bind_stacks(stacks, geometry, bindings, per_device, rank_of,
                              shard_ranks_of) and checked
        if rid is not None and not errors and not new_keys and refused_count() == refused_n:
            cache["replay"] = record(
                geometry=geometry, memo=memo, names=leaf_names, transpose=transpose,
                local_ranks=local_ranks, refused=refused_n, leaves=leaves, layouts=layouts,
                views=viewed, stacks=stacks, checked=checked,
                shard_ranks=shard_ranks_of, previous=cache.get("replay"))
    received = [] if side == "send" else bind_received_stacks(
        stacks, geometry, bindings, new_buffer, rank_of, pending)

    def finish() -> Any:
        return jax.tree_util.tree_unflatten(treedef, adopted(jax, pending, landing, received))

    return Bound(layouts, bindings, finish if side == "receive" else None, errors,
                 checked=checked and not errors, fresh=side == "receive")
