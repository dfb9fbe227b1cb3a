"""PyTorch bridge: DTensor / DeviceMesh + placements <-> neutral :class:`Layout`.

Only geometry: nothing here moves data or needs a process group (a ``DeviceMesh`` built
with ``_init_backend=False`` is enough).

DTensor semantics (docs/layouts.md §4): placements apply mesh dim 0 first; each
``Shard(d)`` re-chunks the current local extent of dim d with ``torch.chunk`` rules (so
uneven shards nest), and ``_StridedShard(d, split_factor=sf)`` first cuts that extent into
sf pieces and chunks each piece. That is exactly :class:`Layout`'s split rule, so a
placement list maps one to one onto ordered splits.

Since torch 2.10 ``_StridedShard`` no longer subclasses ``Shard``; it is tested for first,
so both class hierarchies work. torch >= 2.10 also lets a ``DTensorSpec`` carry an explicit
``shard_order`` (which mesh dims shard a tensor dim, in which order); a non-default one is
honoured by emitting the splits in that order.

torch is imported lazily so that ``import xreshard.adapters.torch`` stays cheap.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from xreshard.extras import require
from xreshard.dtypes import as_dtype, dtype_name
from xreshard.errors import LayoutError
from xreshard.ir.layout import Layout, LayoutMemo, Mesh, Split, splits_of_placements
from xreshard.runtime.binding import canonical_name, carried_over

__all__ = ["Quantized", "Sharded", "bind", "layout_of", "placements_of", "quantized_layouts",
           "tensor_view"]

#: how default-process-group ranks become world ranks: a mapping or a callable
RankMap = Mapping[int, int] | Callable[[int], int] | None


def _import_torch():
    require("torch.distributed.tensor", "torch", "xreshard.adapters.torch")
    return require("torch.distributed.tensor.placement_types", "torch",
                   "xreshard.adapters.torch")


def layout_of(dtensor_or_mesh: Any, placements: Sequence[Any] | None = None,
              shape: Sequence[int] | None = None, dtype: Any = None, *,
              ranks: RankMap = None, name: str | None = None) -> Layout:
    """The layout of a DTensor, or of a ``shape``/``dtype`` tensor placed on a DeviceMesh.

    Mesh ranks are the default-process-group ranks in ``device_mesh.mesh`` (row-major),
    mapped through ``ranks``. Example, 5 rows, mesh ``[[0,1],[2,3]]``, placements
    ``(Shard(0), Shard(0))`` (nested torch.chunk)::

        # rank | coord | region
        #    0 | (0,0) | [0:2]
        #    1 | (0,1) | [2:3]
        #    2 | (1,0) | [3:4]
        #    3 | (1,1) | [4:5]

    Args:
        dtensor_or_mesh: a ``DTensor`` (mesh, placements, shape, dtype and any explicit
            shard order are read from it) or a ``DeviceMesh``.
        placements: with a DeviceMesh, one placement per mesh dim: ``Replicate()``,
            ``Shard(d)`` or ``_StridedShard(d, split_factor=sf)``.
        shape: with a DeviceMesh, the global shape.
        dtype: with a DeviceMesh, the dtype (a ``torch.dtype`` or a name).
        ranks: default-process-group rank -> world rank, as a mapping or a callable;
            ``None`` keeps the process-group ranks.
        name: tensor name, used in error messages.

    Returns:
        A product-form layout.

    Raises:
        ImportError: torch is not installed.
        TypeError: neither a DTensor nor a DeviceMesh, or a bad ``ranks``.
        LayoutError: ``Partial`` placements (pending reduction), unknown placements, a
            shard dim out of range, missing or conflicting arguments, or a shard order that
            cannot be expressed.
    """
    pt = _import_torch()
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    where = f"tensor {name!r}: " if name else ""
    shard_order = None
    if isinstance(dtensor_or_mesh, DTensor):
        dt = dtensor_or_mesh
        if placements is not None or shape is not None or dtype is not None:
            raise LayoutError(f"{where}layout_of(dtensor) reads placements, shape and dtype "
                              "from the DTensor; pass only the DTensor")
        device_mesh, placements = dt.device_mesh, tuple(dt.placements)
        shape, dtype = tuple(dt.shape), dt.dtype
        shard_order = _explicit_shard_order(pt, dt._spec, placements)
    elif isinstance(dtensor_or_mesh, DeviceMesh):
        device_mesh = dtensor_or_mesh
        if placements is None or shape is None or dtype is None:
            raise LayoutError(f"{where}layout_of(device_mesh, placements, shape, dtype) needs "
                              "all four; or pass a DTensor")
    else:
        raise TypeError(f"layout_of expects a DTensor or a DeviceMesh, "
                        f"got {type(dtensor_or_mesh).__name__}")

    mesh = mesh_of(device_mesh, ranks=ranks, name=name)
    shape = tuple(int(s) for s in shape)
    splits = splits_of_placements(placements, mesh, shape, where)
    if shard_order is not None:
        splits = _apply_shard_order(shard_order, splits, mesh, placements, where)
    return Layout.product(shape, dtype, mesh, splits, name=name)


#: DeviceMesh -> (its rank grid, shape, dim names): torch rebuilds ``device_mesh.mesh`` on
#: every read (~40 us), and a model's DTensors share a handful of meshes
_MESH_CACHE: weakref.WeakKeyDictionary[Any, tuple[list[int], tuple[int, ...], Any]] = \
    weakref.WeakKeyDictionary()


def _mesh_facts(device_mesh: Any) -> tuple[list[int], tuple[int, ...], Any]:
    try:
        got = _MESH_CACHE.get(device_mesh)
    except TypeError:       # not weak-referenceable: no cache
        got = None
    if got is None:
        grid = device_mesh.mesh
        got = (grid.flatten().tolist(), tuple(grid.shape), device_mesh.mesh_dim_names)
        try:
            _MESH_CACHE[device_mesh] = got
        except TypeError:
            pass
    return got


def mesh_of(device_mesh: Any, *, ranks: RankMap = None, name: str | None = None) -> Mesh:
    """The xreshard :class:`Mesh` of a ``DeviceMesh``, its ranks mapped through ``ranks``.

    Raises:
        LayoutError: a rank of the mesh has no world rank in ``ranks``: its process did not
            join the refit's world (or joined another group); the message names it.
    """
    pg_ranks, shape, names = _mesh_facts(device_mesh)
    if ranks is None:
        world = pg_ranks
    elif isinstance(ranks, Mapping):
        missing = [r for r in pg_ranks if r not in ranks]
        if missing:
            where = f"DTensor {name!r}" if name else "a DTensor"
            joined = ", ".join(f"{r} -> world rank {w}" for r, w in sorted(ranks.items()))
            raise LayoutError(
                f"{where} lives on a DeviceMesh over torch ranks {pg_ranks} (shape {shape}), "
                + (f"but the process of torch rank {missing[0]} is" if len(missing) == 1 else
                   f"but the processes of torch ranks {missing} are")
                + f" not in this refit's world group (joined: {joined or 'none'}); "
                "every process of the mesh must call World.join with the same group, "
                "num_processes counting it, or shard the tensor over a mesh of the "
                "processes that joined")
        world = [ranks[r] for r in pg_ranks]
    elif callable(ranks):
        world = [ranks(r) for r in pg_ranks]
    else:
        raise TypeError("ranks must map default-process-group ranks to world ranks, as a "
                        f"mapping or a callable; got {type(ranks).__name__}")
    return Mesh(shape, tuple(world), None if names is None else tuple(names))


def placements_of(layout: Layout, *, name: str | None = None) -> list[Any]:
    """DTensor placements (one per mesh axis of ``layout.mesh``) with the same geometry.

    A dim split by mesh axes in increasing axis order maps onto ``Shard`` /
    ``_StridedShard`` directly. Any other order (JAX ``P(('tp', 'dp'))`` on mesh
    ``(dp, tp)``) is converted the way torch converts a shard order
    (``_convert_shard_order_to_StridedShard``): mesh axis m at position i of the order gets
    ``split_factor = prod(size(j) for j in order[:i] if j > m)``. That conversion is exact
    for even splits only, so the result is checked against ``layout`` and refused if it
    differs.

    Args:
        layout: a product-form layout.
        name: tensor name, used in error messages.

    Returns:
        A list of ``Replicate`` / ``Shard`` / ``_StridedShard``, one per mesh axis.

    Raises:
        LayoutError: an explicit-form layout, or geometry DTensor cannot express.
    """
    pt = _import_torch()
    where = f"tensor {name!r}: " if name else ""
    if not layout.is_product:
        raise LayoutError(f"{where}{layout} is explicit form (rank -> regions); DTensor "
                          "placements can only express product-form layouts")
    mesh = layout.mesh
    assert mesh is not None                     # product form
    out: list[Any] = [pt.Replicate() for _ in range(mesh.ndim)]
    converted = []
    for dim in range(layout.ndim):
        dim_splits = [sp for sp in layout.splits if sp.dim == dim]
        axes = [sp.axis for sp in dim_splits]
        if axes == sorted(axes):
            for sp in dim_splits:
                out[sp.axis] = _placement(pt, dim, sp.split_factor)
        elif all(sp.split_factor == 1 for sp in dim_splits):
            for i, m in enumerate(axes):
                sf = math.prod(mesh.shape[j] for j in axes[:i] if j > m)
                out[m] = _placement(pt, dim, sf)
            converted.append(dim)
        else:
            raise LayoutError(f"{where}{layout}: dim {dim} is split by mesh axes "
                              f"{[mesh.axis_label(a) for a in axes]} out of mesh order with "
                              "strided splits; DTensor placements cannot express that")
    if converted:
        splits = splits_of_placements(out, mesh, layout.shape, where)
        back = Layout.product(layout.shape, layout.dtype, mesh, splits)
        for rank in mesh.ranks:
            want, got = layout.dim_intervals(rank), back.dim_intervals(rank)
            assert want is not None and got is not None     # rank is one of the mesh's
            if any(want[d] != got[d] for d in converted):
                raise LayoutError(
                    f"{where}{layout}: dims {converted} are split out of mesh-axis order and "
                    f"unevenly (rank {rank} holds {want} but placements {out} would give "
                    f"{got}); _StridedShard reproduces out-of-order splits when they are even "
                    "but not this uneven one - pad the tensor or split in mesh-axis order")
    return out


# ---------------------------------------------------------------------------- helpers

def _placement(pt, dim: int, split_factor: int) -> Any:
    if split_factor == 1:
        return pt.Shard(dim)
    return pt._StridedShard(dim, split_factor=split_factor)


def _explicit_shard_order(pt, spec: Any, placements: tuple) -> tuple | None:
    """A DTensorSpec's ``shard_order`` when it is set and not the default, else None.

    torch < 2.10 has no such field. When ``use_strided_shard_as_shard_order`` is set the
    order is encoded by the ``_StridedShard`` placements themselves, which already carry
    the geometry, so there is nothing more to honour.
    """
    order = getattr(spec, "shard_order", None)
    if order is None or getattr(spec, "use_strided_shard_as_shard_order", False):
        return None
    # the default order: every tensor dim sharded by its mesh dims left to right
    default: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, (pt.Shard, pt._StridedShard)):
            default[int(p.dim)] = default.get(int(p.dim), ()) + (m,)
    if {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in order} == default:
        return None
    return tuple(order)


def _apply_shard_order(order: tuple, splits: list[Split], mesh: Mesh, placements: Sequence[Any],
                       where: str) -> list[Split]:
    """Reorder ``splits`` per dim to follow an explicit DTensorSpec shard order."""
    if any(sp.split_factor != 1 for sp in splits):
        raise LayoutError(f"{where}placements {list(placements)} mix _StridedShard with an "
                          f"explicit shard_order {order}; xreshard cannot tell which one the "
                          "local shards follow - redistribute to plain Shard placements first")
    have = {(sp.dim, sp.axis) for sp in splits}
    ordered = [Split(int(entry.tensor_dim), int(m), 1)
               for entry in order for m in entry.mesh_dims]
    if {(sp.dim, sp.axis) for sp in ordered} != have or len(ordered) != len(have):
        raise LayoutError(f"{where}DTensorSpec shard_order {order} does not list the same "
                          f"(tensor dim, mesh dim) pairs as placements {list(placements)}")
    return ordered


# ---------------------------------------------------------------------------- bindings

class Sharded:
    """A plain local tensor with declared placements (no DTensor needed).

    Args:
        local: this process's local tensor (what ``DTensor.to_local()`` would be).
        mesh: an xreshard :class:`Mesh` of world ranks, or a ``DeviceMesh`` (its ranks go
            through the refit's torch-rank map).
        placements: one per mesh axis, as for :meth:`Layout.from_placements`.
        shape: the global shape.
    """

    def __init__(self, local: Any, mesh: Any, placements: Sequence[Any], shape: Sequence[int]):
        self.local = local
        self.mesh = mesh
        self.placements = tuple(placements)
        self.shape = tuple(int(s) for s in shape)


class Quantized:
    """A destination tensor stored quantized: fp8 ``codes`` plus their ``scales`` in ``fmt``.

    Put it in a receive state dict in place of the tensor. ``codes`` and ``scales`` are
    each a DTensor, a :class:`Sharded` or a plain tensor, sharded alike: every rank holds
    whole blocks of the codes and exactly their scales (``fmt.scale_region`` of its
    regions), which is checked, naming the tensor, before anything moves. The codes are
    bound under the tensor's name, the scales under ``scale_name``.

    A sender offers either the values (bfloat16, float16 or float32 under the tensor's
    name, nothing under the scales' name): they are quantized on the way, byte for byte
    vLLM's function on the whole tensor (each block where it lives: by the sender that
    holds it whole, else by this receiver after its pieces land; see
    :mod:`xreshard.planner.quantize`); or codes and scales already quantized (under both
    names), which are moved as they are.

    Args:
        codes: ``fmt.dtype`` values (``torch.float8_e4m3fn``), the tensor's global shape.
        scales: ``fmt.scale_dtype`` values of shape ``fmt.scale_shape(shape)``.
        fmt: :class:`~xreshard.ir.formats.BlockFP8` (default ``BlockFP8()``) or ``MXFP8()``.
        scale_name: the scales' tensor name; default the tensor's name + ``"_scale_inv"``
            (block FP8, DeepSeek's name) or ``"_scale"`` (MXFP8, vLLM's).
    """

    def __init__(self, codes: Any, scales: Any, fmt: Any = None, *,
                 scale_name: str | None = None) -> None:
        from xreshard.ir.formats import BlockFP8
        self.codes, self.scales = codes, scales
        self.format = BlockFP8() if fmt is None else fmt
        self.scale_name = scale_name

    def scale_of(self, name: str) -> str:
        """The scales' tensor name for the tensor ``name``."""
        if self.scale_name:
            return self.scale_name
        return name + ("_scale" if self.format.kind == "mxfp8" else "_scale_inv")


def quantized_layouts(name: str, value: Quantized, *, ranks: RankMap = None, rank: int = 0
                      ) -> tuple[Any, Layout, Layout]:
    """(the :class:`~xreshard.ir.formats.QuantizedTensor`, the codes' layout, the scales'
    layout) of a :class:`Quantized` destination, checked against its format.

    Args:
        name: the tensor's name.
        value: the declaration.
        ranks: default-process-group rank -> world rank (for DTensors).
        rank: this process's world rank (a plain tensor is held whole by it).

    Raises:
        FormatError: codes or scales of the wrong dtype or shape, or shards that cut a block
            or hold other blocks' scales, naming the tensor.
    """
    from xreshard.ir.formats import QuantizedTensor

    codes = _layout_and_local(value.codes, name, ranks, rank, LayoutMemo(), None)[0]
    scale_name = value.scale_of(name)
    scales = _layout_and_local(value.scales, scale_name, ranks, rank, LayoutMemo(), None)[0]
    qt = QuantizedTensor(name, scale_name, value.format, codes.shape)
    qt.check_layouts(codes, scales)
    return qt, codes, scales


def _layout_and_local(value: Any, name: str, ranks: RankMap, me: int, memo: LayoutMemo,
                      rid: int | None) -> tuple[Layout, Any, bool]:
    """(layout, local tensor, whether only this process holds it) of a DTensor, a
    :class:`Sharded` or a plain tensor (this process's whole copy)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        layout = memo.get(None if rid is None else (value._spec, rid),
                          lambda: layout_of(value, ranks=ranks, name=name))
        return layout, _local_of(value), False
    if isinstance(value, Sharded):
        mesh = value.mesh if isinstance(value.mesh, Mesh) else mesh_of(value.mesh, ranks=ranks,
                                                                       name=name)
        return Layout.from_placements(value.shape, value.local.dtype, mesh, value.placements,
                                      name=name), value.local, False
    return Layout.explicit_form(tuple(value.shape), value.dtype,
                                {me: [[(0, n) for n in value.shape]]}), value, True


def tensor_view(t: Any) -> Any:
    """A zero-copy array over a torch tensor's memory: numpy on CPU, CuPy on CUDA.

    One path for both devices: a dtype numpy has no type for (bf16, float8) is exported as
    its same-size unsigned-int bits (what DLPack and ``.numpy()`` can carry), then viewed as
    the ml_dtypes type, still without a copy, so the array says which values it holds.
    The executor trusts the layout's dtype over the array's and copies equal dtypes as
    bits, so a raw view would move bit-exact too; the typed view is for everyone else.
    """
    from xreshard.dtypes import dtype_name
    return _view(t, dtype_name(t.dtype))


def _view(t: Any, name: str) -> Any:
    """:func:`tensor_view` of ``t`` whose dtype's canonical name is ``name``."""
    if t.requires_grad:     # numpy() refuses a tensor autograd tracks (detach: same memory)
        t = t.detach()
    if name in _FOREIGN:
        import torch
        t = t.view(_torch_bits(torch, t.element_size()))
    return as_dtype(_export(t), name)


def _local_of(dtensor: Any) -> Any:
    """A DTensor's local tensor (its own memory: writes land in the DTensor). The attribute
    skips ``to_local()``'s autograd function (~30 us a tensor); older torch: to_local()."""
    local = getattr(dtensor, "_local_tensor", None)
    return dtensor.to_local() if local is None else local


#: dtypes numpy has no type of its own for: they cross as bits and are viewed back
_FOREIGN = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                      "float8_e5m2fnuz", "float8_e8m0fnu"})


def _torch_bits(torch: Any, itemsize: int) -> Any:
    # int16, not uint16: every torch version exports it through DLPack and .numpy(); the
    # signedness of a bits view does not matter, it is viewed back at once
    return {1: torch.uint8, 2: torch.int16}[itemsize]


def _export(t: Any) -> Any:
    """numpy (CPU) or CuPy (CUDA) array over ``t``'s memory, zero-copy."""
    if t.is_cpu:
        return t.numpy()
    if t.device.type != "cuda":
        raise LayoutError(f"cannot bind a torch tensor on device {t.device}: xreshard moves "
                          "CPU and CUDA tensors")
    try:
        import cupy
    except ImportError as e:
        from xreshard.transport.nccl import install_hint
        raise ImportError(f"binding CUDA tensors needs CuPy: {install_hint()}") from e
    import torch
    # under the tensor's device, so DLPack's stream handshake orders that device's current
    # CuPy stream (the one the executor copies on) after torch's current stream there
    with cupy.cuda.Device(t.device.index if t.device.index is not None else
                          torch.cuda.current_device()):
        return cupy.from_dlpack(t)


# ---------------------------------------------------------------------------- the refit's hooks
# (xreshard.runtime.registry: the core finds this module by its path and calls these)

LABEL = "torch tensors"


def accepts(obj: Any) -> bool:
    """An ``nn.Module``, or a non-empty mapping of tensors / :class:`Sharded` (torch loaded)."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(obj, torch.nn.Module):
        return True
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(v, (torch.Tensor, Sharded, Quantized)) for v in obj.values())


def warm() -> None:
    """Import what binding needs now (``torch.distributed.tensor``: 2-7 s on a loaded
    machine), not in a refit's first call between two collectives, where its peers wait
    for this process against the refit's timeout (``registry.warm``)."""
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        _import_torch()


def identity(devices: Sequence[Any], ranks: Sequence[int]) -> list[list[int]]:
    """``[[torch default-group rank, world rank]]`` when torch.distributed is initialized
    (a torch process holds one world rank)."""
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or not ranks:
        return []
    return [[int(dist.get_rank()), int(ranks[0])]]


def keep(obj: Any, side: str) -> Any:
    """A refit keeps torch objects (they are written or read in place on every call)."""
    return obj


def capture_streams() -> Any:
    """This thread's current torch stream of every CUDA device, kept so that the thread of
    a refit started with ``Refit.start`` makes them current there (``with
    capture_streams()():``), or None when torch has no CUDA in use.

    torch's current stream is per thread (``c10::cuda::getCurrentCUDAStream``): a thread
    starts on the default stream. Binding a CUDA tensor makes CuPy's stream wait for torch's
    current stream (DLPack's handshake, ``__dlpack__(stream=...)``), so without this a
    refit started while the caller wrote its weights on a side stream would order after
    the background thread's default stream instead, and could read them half written.
    """
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    streams = [torch.cuda.current_stream(d) for d in range(torch.cuda.device_count())]

    def enter() -> Any:
        import contextlib
        stack = contextlib.ExitStack()
        for s in streams:
            stack.enter_context(torch.cuda.stream(s))
        return stack
    return enter


def _local_tensors(obj: Any) -> dict[str, Any]:
    import torch
    items = obj.state_dict(keep_vars=True).items() if isinstance(obj, torch.nn.Module) \
        else obj.items()
    out = {}
    for key, value in items:
        local = value.local if isinstance(value, Sharded) else value
        if hasattr(local, "to_local"):                              # DTensor
            local = local.to_local()
        if isinstance(local, torch.Tensor):
            out[key] = local
    return out


def write_snapshot(obj: Any) -> Callable[[], list[str]]:
    """``RefitConfig(check_writes=True)``: the content digests (on each tensor's device) and
    version counters of the local tensors of ``obj`` now; returns ``written()``, which lists
    those written since (:mod:`xreshard.adapters.torch_writes`)."""
    from . import torch_writes
    return torch_writes.snapshot(lambda: _local_tensors(obj))


def refit_bind(obj: Any, side: str, context: Any) -> Any:
    """:func:`bind` with what the refit knows (a ``xreshard.runtime.registry.BindContext``)."""
    if context.rules is not None:
        raise LayoutError("naming rules (Refit(rules=...)) map a JAX pytree being sent; "
                          "torch state dicts are named by their keys (use names= to rename "
                          "them)")
    known = context.cache.get("known")     # the last call's entries (a lookup: the same)
    return carried_over(bind(obj, side, ranks=dict(context.ranks) or None,
                             local_ranks=context.local_ranks, names=context.names,
                             transpose=context.transpose, memo=context.memo,
                             cache=context.cache), context.cache, known)


def bind(obj: Any, side: str, *, ranks: RankMap, local_ranks: Sequence[int], names: Any = None,
         transpose: frozenset[str] = frozenset(), memo: LayoutMemo | None = None,
         cache: dict | None = None) -> Any:
    """Bind a state dict / module of DTensors, :class:`Sharded` or plain tensors.

    DTensors and Sharded tensors are bound through their local tensor (written in place when
    receiving); a plain tensor is this process's whole copy (its rank holds everything; the
    refit unions the copies of all processes into a replicated layout).

    Args:
        obj: an ``nn.Module`` (its ``state_dict()``) or a mapping name -> tensor.
        side: "send" or "receive".
        ranks: torch default-process-group rank -> world rank (the refit all-gathers it).
        local_ranks: this process's world ranks (torch processes have one).
        names: state-dict key -> canonical name (mapping or callable).
        transpose: canonical names whose local tensors are stored transposed.
        memo: DTensor layouts remembered across calls by spec and rank map (a Refit passes
            its own); None converts every spec anew.
        cache: a dict kept by the caller across calls of one side (a Refit passes its own):
            an entry bound before whose tensor is unchanged is looked up, not bound anew
            (see ``_Known``).
    """
    from xreshard.runtime.gcpause import gc_paused
    with gc_paused():
        return _bind(obj, side, ranks=ranks, local_ranks=local_ranks, names=names,
                     transpose=transpose, memo=LayoutMemo() if memo is None else memo,
                     cache={} if cache is None else cache)


class _Known:
    """What an earlier call bound for one state-dict entry, and what it was bound from.

    A later call reuses it only when the entry is the same tensor object whose DTensor spec
    object, local tensor object and memory (address, shape, strides, dtype, device) are the
    same: everything the layout and the view were made of. A tensor resized, re-pointed
    (``set_``, ``.data =``), moved or retyped in place, or a DTensor given another spec or
    local tensor, is bound anew (and checked anew). Holding these entries keeps nothing
    alive that the Refit does not already keep (it keeps the torch objects it binds).
    """

    __slots__ = ("value", "spec", "local", "memory", "name", "layout", "binding", "only")

    def __init__(self, value: Any, spec: Any, local: Any, memory: tuple, name: str,
                 layout: Layout, binding: Any, only: bool):
        self.value, self.spec, self.local, self.memory = value, spec, local, memory
        self.name, self.layout, self.binding, self.only = name, layout, binding, only


def _memory(t: Any) -> tuple:
    """Where and how a tensor's elements lie: what a view of it was made from."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _bind(obj: Any, side: str, *, ranks: RankMap, local_ranks: Sequence[int], names: Any,
          transpose: frozenset[str], memo: LayoutMemo, cache: dict) -> Any:
    import torch
    from torch.distributed.tensor import DTensor
    from xreshard.runtime.binding import Bound

    items = obj.state_dict().items() if isinstance(obj, torch.nn.Module) else obj.items()
    if len(local_ranks) != 1:
        raise LayoutError(f"a torch process binds one world rank, this one has {list(local_ranks)}")
    me = local_ranks[0]
    layouts, bindings, errors, local_only = {}, {}, [], set()
    rid = memo.ranks_id(ranks)
    holds: dict[Layout, bool] = {}          # layout -> whether this rank holds elements
    dtypes: dict[Any, str] = {}             # torch dtype -> canonical name
    quantized: list[tuple[Any, str, str]] = []
    # entries of the last call, valid for the same rank map (by value: a memo's ranks_id
    # numbers restart when it is new or full), rank, names and transposes
    context = (dict(ranks) if rid is not None and isinstance(ranks, Mapping) else None, me,
               transpose,
               names if names is None or callable(names) else dict(names))
    known: dict[str, _Known] = cache.get("known", {}) \
        if rid is not None and cache.get("context") == context else {}
    now: dict[str, _Known] = {}
    for key, value, named in _expand_quantized(items, names, quantized):
        k = known.get(key) if not named else None
        if k is not None and k.value is value:
            if isinstance(value, DTensor):
                local = getattr(value, "_local_tensor", None)
                same = value._spec is k.spec and local is k.local
            else:
                local, same = value, True
            if same and _memory(local) == k.memory and k.name not in layouts:
                # the same tensor, the same memory: the same layout and view
                name = k.name
                layouts[name] = k.layout
                if k.only:
                    local_only.add(name)
                if k.binding is not None:
                    bindings[(me, name)] = k.binding
                now[key] = k
                continue
        name = key if named else canonical_name(key, names)
        if name in layouts:
            errors.append(f"two state-dict entries map to tensor {name!r}")
            continue
        try:
            layout, local, only = _layout_and_local(value, name, ranks, me, memo, rid)
        except LayoutError as e:
            errors.append(str(e))
            continue
        if only:
            local_only.add(name)
        if name in transpose:
            if layout.ndim != 2:
                errors.append(f"{name!r} is in transpose but has {layout.ndim} dims (need 2)")
                continue
            layout = layout.permuted((1, 0))
            local = local.t()
        layouts[name] = layout
        held = holds.get(layout)
        if held is None:
            held = holds[layout] = me in layout.rank_set and layout.num_elements(me) > 0
        binding = None
        if held:
            dtype = dtypes.get(local.dtype)
            if dtype is None:
                dtype = dtypes[local.dtype] = dtype_name(local.dtype)
            view = _view(local, dtype)
            binding = bindings[(me, name)] = view if layout.is_product else [view]
        elif local.numel():
            errors.append(f"{name!r}: this process (world rank {me}) holds a local tensor of "
                          f"shape {tuple(local.shape)} but is not in the tensor's mesh "
                          f"{layout.ranks}; check the torch-rank to world-rank map")
            continue
        if named or not isinstance(value, torch.Tensor):
            continue        # Quantized parts and Sharded entries are bound every call
        if isinstance(value, DTensor):
            spec, base = value._spec, getattr(value, "_local_tensor", None)
            if base is None:
                continue
        else:
            spec, base = None, value
        now[key] = _Known(value, spec, base, _memory(base), name, layout, binding, only)
    cache["context"], cache["known"] = context, now
    from xreshard.ir.formats import QuantizedTensor
    declared = {}
    for fmt, name, scale in quantized:
        if name in layouts and scale in layouts:
            try:
                qt = QuantizedTensor(name, scale, fmt, layouts[name].shape)
                qt.check_layouts(layouts[name], layouts[scale])
                declared[name] = qt
            except LayoutError as e:
                errors.append(str(e))
    return Bound(layouts, bindings, None, errors, local_only, declared)


def _expand_quantized(items: Any, names: Any, quantized: list) -> Any:
    """``(key, value, key is already the tensor's name)`` for the state-dict items, each
    :class:`Quantized` value as its codes (under its key) and its scales (under the scales'
    name); ``quantized`` collects (format, name, scale name)."""
    for key, value in items:
        if not isinstance(value, Quantized):
            yield key, value, False
            continue
        name = canonical_name(key, names)
        quantized.append((value.format, name, value.scale_of(name)))
        yield name, value.codes, True
        yield value.scale_of(name), value.scales, True
