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
    describe them; explicit layouts that each process gives for its own ranks only are
    unioned, and must agree on shape and dtype.
    """
    seen: dict[str, tuple[int, dict]] = {}
    explicit_parts: dict[str, dict[int, list]] = {}
    problems = []
    num_ranks = world.num_ranks
    for p, layouts in enumerate(per_process):
        for name, d in layouts.items():
            ranks = ([r for r, _ in d["explicit"]] if "explicit" in d
                     else d.get("mesh", {}).get("ranks", []))
            outside = [r for r in ranks if not (isinstance(r, int) and 0 <= r < num_ranks)]
            if outside:
                problems.append(f"{name!r}: {world.describe_process(p)} describes its {side} "
                                f"layout over ranks {outside[:5]}, but world "
                                f"{world.world_id!r} has ranks 0..{num_ranks - 1}; check the "
                                f"rank map of its mesh")
                continue
            if name in seen:
                first_p, first = seen[name]
                if bool(d.get("local_only")) != bool(first.get("local_only")):
                    problems.append(f"{name!r}: {world.describe_process(first_p)} and "
                                    f"{world.describe_process(p)} hold it differently (a plain "
                                    f"whole tensor on one, sharded on the other)")
                    continue
                if d.get("local_only"):
                    for field_name in ("shape", "dtype"):
                        if d.get(field_name) != first.get(field_name):
                            problems.append(
                                f"{name!r}: {world.describe_process(first_p)} holds it with "
                                f"{field_name} {first.get(field_name)}, "
                                f"{world.describe_process(p)} with {d.get(field_name)}")
                elif d != first:
                    problems.append(f"{name!r}: {world.describe_process(first_p)} and "
                                    f"{world.describe_process(p)} describe different layouts")
            else:
                seen[name] = (p, d)
            if d.get("local_only"):
                part = explicit_parts.setdefault(name, {})
                for rank, regions in d["explicit"]:
                    part[int(rank)] = regions
    if problems:
        raise RefitError(f"the {side} side's processes disagree on layouts: "
                         + "; ".join(problems[:20]))
    out = {}
    for name, (_, d) in seen.items():
        if name in explicit_parts:
            out[name] = union_layout(d, explicit_parts[name])
        else:
            out[name] = Layout.from_dict(d)
    return out


def fit(bound: Bound | None, layouts: Mapping[str, Layout]) -> dict:
    """The bindings as the merged layouts want them: a ``local_only`` name is bound as a
    one-array list (explicit form), and ``_union_layout`` may have made it product form."""
    if bound is None:
        return {}
    return {key: b[0] if isinstance(b, list) and len(b) == 1 and key[1] in layouts
            and layouts[key[1]].is_product else b
            for key, b in bound.bindings.items()}


def union_layout(d: dict, parts: dict[int, list]) -> Layout:
    """Ranks that each hold a whole tensor -> a replicated product layout over them."""
    shape = tuple(d["shape"])
    full = [[0] * len(shape), list(shape)]
    ranks = sorted(parts)
    if all(regions == [full] for regions in parts.values()):
        return Layout.replicated(shape, d["dtype"], Mesh((len(ranks),), tuple(ranks)))
    return Layout.explicit_form(shape, d["dtype"], {
        r: [Region(tuple(a), tuple(b)) for a, b in parts[r]] for r in ranks})
