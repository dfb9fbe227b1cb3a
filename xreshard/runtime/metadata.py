"""What a refit learns from every process's metadata, before it plans.

- ``merge``: one layout per tensor from every process's description of its side (they
  must agree; plain tensors held whole are unioned, and must agree on shape and dtype);
- ``fit``: a process's bindings as the merged layouts want them;
- ``merged_layouts``: both sides' merged layouts, from every process's description, after
  checking what only the merged layouts can tell (the planner then prepares the call);
- ``stage_bindings``: the bindings of every stage of a prepared call, cut from a
  process's bindings of the two sides.

(Which adapter binds an object, and the framework ids of a process's ranks, are the
adapters' business: :mod:`xreshard.runtime.registry`.)

Pure functions of JSON-able metadata (and, for bindings, views of this process's arrays),
so every process computes the same result from the same gathered descriptions.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, NamedTuple

from .binding import Bindings, Bound, RowBindings, binding_problems
from ..errors import BindingError, RefitError
from ..ir.layout import Layout, Mesh, Region
from ..planner.prepare import DESTINATIONS, SOURCES, PreparedCall

__all__ = ["StageBindings", "fit", "merge", "merged_layouts", "merged_quantized",
           "stage_bindings", "stage_views", "stored_claims", "union_layout"]


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


_UNSEEN: Any = object()


def fit(bound: Bound | None, layouts: Mapping[str, Layout]) -> dict:
    """The bindings as the merged layouts want them: one array for a product layout, a
    list (one array per region) for an explicit one, whichever way the process bound it
    (a union may turn a process's own product layout into an explicit one, and a plain
    tensor's one-region list into a replicated product layout)."""
    if bound is None:
        return {}
    if all(lay.is_product for lay in layouts.values()) and not any(
            issubclass(t, list) for t in set(map(type, bound.bindings.values()))):
        given = bound.bindings          # the common case: nothing to unwrap or wrap
        return given.same() if isinstance(given, RowBindings) else dict(given)
    out = {}
    product: dict[str, bool | None] = {}      # name -> merged layout is product form
    for key, b in bound.bindings.items():
        name = key[1]
        form = product.get(name, _UNSEEN)
        if form is _UNSEEN:
            lay = layouts.get(name)
            form = product[name] = None if lay is None else lay.is_product
        if form:
            if isinstance(b, list) and len(b) == 1:
                b = b[0]
        elif form is False and not isinstance(b, (list, tuple)):
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


def merged_layouts(metas: list[dict], src: Bound | None, dst: Bound | None, world: Any
                   ) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """Both sides' layouts from every process's description of its sides (identical in
    every process), after checking what only the merged layouts can tell: equal configs,
    ranks inside the world, and this process's bindings covering what the merged layouts
    give its ranks.

    Args:
        metas: every process's ``{"send": ..., "receive": ..., "config": ...}``.
        src / dst: this process's sides.
        world: the world (ranks, processes).

    Returns:
        ``(source layouts, destination layouts)``, ``{name: Layout}`` each.
    """
    configs = {json.dumps(m["config"], sort_keys=True) for m in metas}
    if len(configs) > 1:
        raise RefitError(f"processes pass different RefitConfigs: {sorted(configs)}; "
                         f"every process must use the same config")
    src_layouts = merge([m["send"] for m in metas], "send", world)
    dst_layouts = merge([m["receive"] for m in metas], "receive", world)
    num_ranks = world.num_ranks
    for side, layouts in (("send", src_layouts), ("receive", dst_layouts)):
        for name, lay in layouts.items():
            outside = [r for r in lay.ranks if not 0 <= r < num_ranks]
            if outside:
                raise RefitError(f"{side} layout of {name!r} places ranks {outside[:5]}, "
                                 f"but world {world.world_id!r} has ranks "
                                 f"0..{num_ranks - 1}; check the rank map of its mesh")
    problems = []
    for side, layouts, bound in (("send", src_layouts, src), ("receive", dst_layouts, dst)):
        problems += binding_problems(layouts, fit(bound, layouts), side, world.rank_ids)
    if problems:
        raise BindingError("bindings do not cover what the merged layouts give this "
                           "process's ranks: " + "; ".join(problems[:20]))
    return src_layouts, dst_layouts


def merged_quantized(metas: list[dict], world: Any) -> dict[str, Any]:
    """The receiving side's quantized tensors from every process's ``"quantized"``
    description (the same in every process).

    Raises:
        FormatError: two processes declare one tensor in different formats.
    """
    from ..ir.formats import FormatError, QuantizedTensor
    seen: dict[str, tuple[int, dict]] = {}
    for p, m in enumerate(metas):
        for name, d in (m.get("quantized") or {}).items():
            first = seen.setdefault(name, (p, d))
            if first[1] != d:
                raise FormatError(f"{name!r}: {world.describe_process(first[0])} stores it as "
                                  f"{first[1]} but {world.describe_process(p)} as {d}; every "
                                  "process of an engine must declare the same format")
    return {name: QuantizedTensor.from_dict(d) for name, (_, d) in sorted(seen.items())}


def stored_claims(metas: list[dict], world: Any) -> dict[str, list[int]]:
    """name -> the sending ranks whose process says it holds the tensor transposed
    (``Bound.stored_transposed``, every process's ``"transposed"``): the same in every
    process, for ``prepare(stored_transposed=)``."""
    out: dict[str, list[int]] = {}
    for p, m in enumerate(metas):
        names = m.get("transposed") or ()
        if names:
            ranks = list(world.processes[p]["ranks"])
            for name in names:
                out.setdefault(name, []).extend(ranks)
    return out


class StageBindings(NamedTuple):
    """This process's bindings of every stage of one call (index = stage)."""

    src: tuple[Bindings, ...]
    dst: tuple[Bindings, ...]


def stage_views(real_layouts: Mapping[str, Layout], real_bindings: Bindings,
                stage_layouts: Mapping[str, Layout], ranks: Iterable[int]) -> dict:
    """Bindings of a stage layout for ``ranks``: per region, a view of the real binding
    (``(rank, name) -> [view, ...]`` in ``stage_layouts[name].regions(rank)`` order)."""
    out = {}
    ranks = list(ranks)
    for name, lay in stage_layouts.items():
        real = real_layouts[name]
        for r in ranks:
            regions = lay.regions(r)
            if not regions:
                continue
            b = real_bindings[(r, name)]
            views = []
            for region in regions:
                i, slices = real.locate(r, region)
                views.append((b if real.is_product else b[i])[slices + (Ellipsis,)])
            out[(r, name)] = views
    return out


def stage_bindings(prepared: PreparedCall, src: Bindings, dst: Bindings) -> StageBindings:
    """Each stage's bindings from this process's bindings of the call's two sides (fitted
    to ``prepared.direct``'s layouts), as each stage says (``Stage.src_from`` /
    ``dst_from``): the sides themselves, or views of the destination memory."""
    given = {SOURCES: src, DESTINATIONS: dst}
    real, whole = prepared.direct.dst_layouts, {}
    quant = prepared.formats.quant
    if quant is not None and len(prepared.stages) > 1:
        # a relayed call forwards codes and scales (views of their own layouts); stage 0
        # quantizes into them whole: its FP8 steps locate regions in those layouts
        scales = {qt.scale: quant.scales[n] for n, qt in quant.tensors.items()}
        real = {**real, **quant.codes, **scales}
        whole = {k: b for k, b in dst.items() if k[1] in quant.tensors or k[1] in scales}
    srcs: list[Bindings] = []
    dsts: list[Bindings] = []
    for st in prepared.stages:
        for origin, layouts, out in ((st.src_from, st.src_layouts, srcs),
                                     (st.dst_from, st.dst_layouts, dsts)):
            out.append(given[origin] if origin in given else stage_views(
                real, dst, layouts, prepared.ranks))
    if whole and prepared.stages[0].dst_from not in given:
        dsts[0] = {**dsts[0], **whole}
    return StageBindings(tuple(srcs), tuple(dsts))
