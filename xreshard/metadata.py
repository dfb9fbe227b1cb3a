"""What a refit learns from every process's metadata, before it plans.

- ``identity_of``: this process's framework ids (torch rank, JAX device ids) for the rank
  maps;
- ``framework_of``: which adapter a ``send=`` / ``receive=`` object belongs to;
- ``merge``: one layout per tensor from every process's description of its side (they
  must agree; plain tensors held whole are unioned, and must agree on shape and dtype);
- ``fit``: a process's bindings as the merged layouts want them.

Pure functions of JSON-able metadata, so every process computes the same result from the
same gathered descriptions.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .binding import Bound
from .errors import RefitError
from .layout import Layout, Mesh, Region

__all__ = ["fit", "framework_of", "identity_of", "merge"]


def identity_of(devices: list[Any], ranks: Iterable[int]) -> dict[str, Any]:
    """This process's torch rank (when torch.distributed is initialized) and the JAX
    device id of each of its JAX ranks."""
    import sys
    out: dict[str, Any] = {"torch_rank": None, "jax_ids": []}
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        out["torch_rank"] = int(dist.get_rank())
    jax = sys.modules.get("jax")
    if jax is not None:
        for device, rank in zip(devices, ranks):
            if isinstance(device, jax.Device):
                out["jax_ids"].append([int(device.id), int(rank)])
    return out


def framework_of(obj: Any) -> str:
    import sys
    if obj is None or isinstance(obj, Bound):
        return "none"
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.nn.Module):
            return "torch"
        from_torch = sys.modules.get("xreshard.adapters.torch")
        sharded = getattr(from_torch, "Sharded", ()) if from_torch else ()
        if isinstance(obj, Mapping) and obj and all(
                isinstance(v, torch.Tensor) or (sharded and isinstance(v, sharded))
                for v in obj.values()):
            return "torch"
    jax = sys.modules.get("jax")
    if jax is not None:
        leaves = jax.tree_util.tree_leaves(obj)
        if leaves and all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for x in leaves):
            return "jax"
    return "unknown"


def merge(per_process: list[dict[str, dict]], side: str, world: Any) -> dict[str, Layout]:
    """One layout per tensor from every process's description of its side.

    Global layouts (product form, or explicit) must agree between the processes that
    describe them. Layouts that each process gives over its own ranks only are unioned: a
    plain tensor each process holds whole (``local_only``), or a tensor each process of
    the side holds as its own whole copy, sharded over its own devices (a single-process
    JAX job per engine replica). They must agree on shape and dtype.
    """
    described: dict[str, list[tuple[int, dict]]] = {}
    problems = []
    num_ranks = world.num_ranks
    own = [set(info["ranks"]) for info in world.processes]
    for p, layouts in enumerate(per_process):
        for name, d in layouts.items():
            ranks = _ranks_of(d)
            outside = [r for r in ranks if not (isinstance(r, int) and 0 <= r < num_ranks)]
            if outside:
                problems.append(f"{name!r}: {world.describe_process(p)} describes its {side} "
                                f"layout over ranks {outside[:5]}, but world "
                                f"{world.world_id!r} has ranks 0..{num_ranks - 1}; check the "
                                f"rank map of its mesh")
                continue
            described.setdefault(name, []).append((p, d))
    out = {}
    for name, ds in described.items():
        try:
            out[name] = _one_layout(name, ds, own, world)
        except RefitError as e:
            problems.append(str(e))
    if problems:
        raise RefitError(f"the {side} side's processes disagree on layouts: "
                         + "; ".join(problems[:20]))
    return out


def _ranks_of(d: Mapping[str, Any]) -> list[Any]:
    return ([r for r, _ in d["explicit"]] if "explicit" in d
            else list(d.get("mesh", {}).get("ranks", [])))


def _one_layout(name: str, ds: list[tuple[int, dict]], own: list[set[int]],
                world: Any) -> Layout:
    """The layout of ``name`` from its descriptions ``[(process, description)]``."""
    first_p, first = ds[0]
    if all(d == first and not d.get("local_only") for _, d in ds):
        return Layout.from_dict(first)
    self_contained = all(d.get("local_only") or set(_ranks_of(d)) <= own[p] for p, d in ds)
    if not self_contained:
        for p, d in ds[1:]:
            if bool(d.get("local_only")) != bool(first.get("local_only")):
                raise RefitError(f"{name!r}: {world.describe_process(first_p)} and "
                                 f"{world.describe_process(p)} hold it differently (a plain "
                                 f"whole tensor on one, sharded on the other)")
        p = next(p for p, d in ds if d != first)
        raise RefitError(f"{name!r}: {world.describe_process(first_p)} and "
                         f"{world.describe_process(p)} describe different layouts")
    parts: dict[int, list] = {}
    for p, d in ds:
        for field_name in ("shape", "dtype"):
            if d.get(field_name) != first.get(field_name):
                raise RefitError(f"{name!r}: {world.describe_process(first_p)} holds it with "
                                 f"{field_name} {first.get(field_name)}, "
                                 f"{world.describe_process(p)} with {d.get(field_name)}")
        if "explicit" in d:
            for rank, regions in d["explicit"]:
                parts[int(rank)] = regions
        else:       # a product layout over this process's own ranks
            lay = Layout.from_dict(d)
            for rank in lay.ranks:
                parts[rank] = [[list(r.starts), list(r.stops)] for r in lay.regions(rank)]
    return union_layout(first, parts)


def fit(bound: Bound | None, layouts: Mapping[str, Layout]) -> dict:
    """The bindings as the merged layouts want them: one array for a product layout, a
    list (one array per region) for an explicit one, whichever way the process bound it
    (a union may turn a process's own product layout into an explicit one, and a plain
    tensor's one-region list into a replicated product layout)."""
    if bound is None:
        return {}
    out = {}
    for key, b in bound.bindings.items():
        lay = layouts.get(key[1])
        if lay is not None and lay.is_product and isinstance(b, list) and len(b) == 1:
            b = b[0]
        elif lay is not None and not lay.is_product and not isinstance(b, (list, tuple)):
            b = [b]
        out[key] = b
    return out


def union_layout(d: dict, parts: dict[int, list]) -> Layout:
    """Ranks that each hold a whole tensor -> a replicated product layout over them."""
    shape = tuple(d["shape"])
    full = [[0] * len(shape), list(shape)]
    ranks = sorted(parts)
    if all(regions == [full] for regions in parts.values()):
        return Layout.replicated(shape, d["dtype"], Mesh((len(ranks),), tuple(ranks)))
    return Layout.explicit_form(shape, d["dtype"], {
        r: [Region(tuple(a), tuple(b)) for a, b in parts[r]] for r in ranks})
