"""vLLM's standard trainer input, ``source=``, read shard to shard.

vLLM's trainer engines take the weights as a ``WeightSource``: ``metadata`` (name, wire
dtype, full shape; in vLLM 0.33 also the trainer ranks that own each parameter, their mesh
shape and placements) plus iteration. Its built-in sources gather: ``ModuleSource``
iterates ``full_tensor()`` of every DTensor (0.33's ``iter_local`` still gathers any
placement that is not plain ``Shard`` / ``Replicate``, FSDP+TP's ``_StridedShard``
included). The xreshard backend never gathers:

* vLLM's module sources (``ModuleSource``, 0.32's ``DTensorModuleSource``): the wrapped
  module's parameters are read as they are, DTensors shard by shard through the torch
  adapter (any placement, ``_StridedShard`` too), plain tensors as each process's copy.
* any other source: through its ``ParamMeta`` ownership (0.33: ``owners``, ``mesh_shape``,
  ``placements``; 0.32 m2n: ``mesh()`` and placement codes), each rank's piece from
  ``iter_local()`` (0.32 m2n: iteration) bound where it lies; a source that only yields
  full tensors (0.33 ``iter_full``, 0.32's base ``WeightSource``) is read as each owner's
  whole copy, which it materialized itself.

Decision record: the module sources are recognized by class (vLLM's own, by module and
name) and read through their module, because their iteration is exactly the gather this
backend exists to avoid; the one private attribute read, ``_module``, is the module they
were built on. Rejected: iterating them (a collective all-gather per parameter).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from xreshard.errors import RefitError
from xreshard.ir.geometry import Mesh

__all__ = ["is_weight_source", "source_tensors"]

_VLLM_MODULE_SOURCES = ("ModuleSource", "DTensorModuleSource")
_REPLICATE = -1     # vLLM 0.32 m2n's placement code of a replicating mesh axis


def is_weight_source(obj: Any) -> bool:
    """Whether ``obj`` is a vLLM ``WeightSource`` (or quacks like one: ``metadata`` and
    iteration)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightSource
    except ImportError:     # pragma: no cover - the backend needs vLLM anyway
        WeightSource = ()
    if WeightSource and isinstance(obj, WeightSource):
        return True
    return hasattr(obj, "metadata") and (hasattr(obj, "iter_local") or hasattr(obj, "__iter__")) \
        and not isinstance(obj, Mapping)


def _wrapped_module(source: Any) -> Any:
    """The module of vLLM's own module sources, else None."""
    import torch
    cls = type(source)
    if cls.__name__ in _VLLM_MODULE_SOURCES and cls.__module__.startswith(
            "vllm.distributed.weight_transfer"):
        module = getattr(source, "_module", None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def source_tensors(source: Any, world: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """This process's tensors of ``source`` and every parameter's global shape.

    Args:
        source: a vLLM ``WeightSource``.
        world: the joined world; trainer rank r (``ParamMeta.owners``) is the process with
            index r of group ``"trainer"``.

    Returns:
        ``({name: DTensor | Sharded | tensor}, {name: shape})``: what the torch adapter binds
        (the first), and the whole model as the metadata declares it (the second).

    Raises:
        RefitError: metadata the backend cannot read, a trainer process with several world
            ranks, or iteration that disagrees with the metadata.
    """
    module = _wrapped_module(source)
    if module is not None:
        params = dict(module.named_parameters())
        return params, {n: tuple(int(x) for x in p.shape) for n, p in params.items()}
    metas = [_meta(m, source) for m in _metadata(source)]
    shapes = {m["name"]: m["shape"] for m in metas}
    me = world.process_index
    trainers = _trainer_ranks(world)
    my_index = world.processes[me]["index"]
    by_name = {m["name"]: m for m in metas}
    out: dict[str, Any] = {}
    for name, tensor in _local_pieces(source):
        if tensor is None:          # 0.32: a name this rank does not hold
            continue
        meta = by_name.get(name)
        if meta is None:
            raise RefitError(f"the weight source yielded {name!r}, which its metadata does "
                             "not declare; iteration must yield the metadata's names")
        owners = meta["owners"]
        if owners is not None and my_index not in owners:
            raise RefitError(f"the weight source of trainer rank {my_index} yielded {name!r}, "
                             f"owned by trainer ranks {list(owners)} only")
        if meta["placements"] is None or not meta["local"]:
            out[name] = tensor          # a whole copy: the refit unions the owners' copies
            continue
        if owners is None:          # _meta refuses placements without owners
            raise RefitError(f"parameter {name!r} declares placements without owners")
        from xreshard.adapters.torch import Sharded
        try:
            ranks = [trainers[r] for r in owners]
        except KeyError as e:
            raise RefitError(f"{name!r} is owned by trainer rank {e.args[0]}, but no trainer "
                             f"process of index {e.args[0]} joined the world (trainer ranks "
                             f"{sorted(trainers)} did)") from None
        out[name] = Sharded(tensor, Mesh(meta["mesh_shape"], ranks), meta["placements"],
                            meta["shape"])
    return out, shapes


def _metadata(source: Any) -> list[Any]:
    """``source.metadata``: a method in vLLM 0.32, a cached property in 0.33."""
    m = source.metadata
    return list(m() if callable(m) else m)


def _meta(meta: Any, source: Any) -> dict[str, Any]:
    """One ``ParamMeta`` (0.32, 0.32 m2n or 0.33) as ``name, shape, owners, mesh_shape,
    placements`` (``"S<dim>"`` / ``"R"``, or None: every owner holds it whole) and
    ``local`` (iteration yields pieces, not whole tensors)."""
    name, shape = meta.name, tuple(int(x) for x in meta.shape)
    placements = getattr(meta, "placements", None)
    owners = getattr(meta, "owners", None)
    mesh_shape = getattr(meta, "mesh_shape", None)
    local = _iterates_local(source)
    if owners is None and placements is not None and callable(getattr(source, "mesh", None)):
        mesh = source.mesh()        # vLLM 0.32 m2n: one mesh per side, codes per axis
        mesh_shape = tuple(mesh.dims)
        owners = tuple(range(mesh.start_rank, mesh.start_rank + mesh.size))
    if placements is not None:
        placements = [_placement(p, name) for p in placements]
        if all(p == "R" for p in placements):
            placements = None
    if placements is not None and (owners is None or mesh_shape is None):
        raise RefitError(f"parameter {name!r} declares placements {placements} without "
                         "owners and a mesh shape")
    return {"name": name, "shape": shape, "local": local,
            "owners": None if owners is None else tuple(int(r) for r in owners),
            "mesh_shape": None if mesh_shape is None else tuple(int(d) for d in mesh_shape),
            "placements": placements}


def _placement(p: Any, name: str) -> str:
    """vLLM's ``Shard(dim)`` / ``Replicate()`` (0.33) or m2n code (0.32) as ``"S<dim>"`` /
    ``"R"`` (both split like ``torch.chunk``)."""
    if isinstance(p, int) and not isinstance(p, bool):
        return "R" if p == _REPLICATE else f"S{p}"
    kind = type(p).__name__
    if kind == "Replicate":
        return "R"
    if kind == "Shard":
        return f"S{int(p.dim)}"
    raise RefitError(f"parameter {name!r}: placement {p!r} is neither Shard nor Replicate")


def _iterates_local(source: Any) -> bool:
    """Whether the source's iteration yields each rank's piece (0.33 ``iter_local``, 0.32
    m2n sources) rather than whole tensors."""
    implements = getattr(source, "implements_iter_local", None)
    if callable(implements):
        return bool(implements())
    return callable(getattr(source, "mesh", None))


def _local_pieces(source: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs: 0.33's ``iter_local`` (else ``iter_full``), or 0.32's
    iteration."""
    for method in ("iter_local", "iter_full"):
        implements = getattr(source, f"implements_{method}", None)
        if callable(implements) and implements():
            yield from getattr(source, method)()
            return
    yield from iter(source)


def _trainer_ranks(world: Any) -> dict[int, int]:
    """Trainer rank (the process's index in group ``"trainer"``) -> its one world rank."""
    out = {}
    for info in world.processes:
        if info["group"] != "trainer":
            continue
        if len(info["ranks"]) != 1:
            raise RefitError(f"trainer process {info['index']} holds {len(info['ranks'])} "
                             "world ranks; a vLLM WeightSource names one rank per trainer "
                             "process (pass devices=1, or send a JAX pytree with rules=)")
        out[int(info["index"])] = int(info["ranks"][0])
    return out
