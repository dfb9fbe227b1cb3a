"""Phase 1 of the planner: templates, the pieces of one (source layout, destination layout) pair.

A template lists, in elements, every piece a destination rank needs and the source ranks
holding it (its *holders*). Tensors with the same pair of layouts share one template, so the
61 layers of a model cost a handful of templates, and a :class:`PlanCache` keeps them across
``plan()`` calls.

Pieces come from per-dim interval merging when both layouts are in product form (each
layout partitions every dim; a destination interval is cut at the source boundaries and the
Cartesian product over dims gives boxes), never from all (src rank, dst rank) pairs. When
either side is explicit, each destination region is refined on every boundary of the source
regions it meets.

Pure: layouts in, templates out (see docs/architecture.md).
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from ..dtypes import itemsize
from ..errors import PlanError
from ..ir.layout import Layout, Region

Holders = tuple[int, ...]

#: most names or problems one error message lists
MAX_LISTED = 20


@dataclass(frozen=True, slots=True)
class Template:
    """The pieces of one (source layout, destination layout) pair, in elements.

    Destination ranks holding the same intervals (replicas) share one group entry. Read-only
    once built (the lists are shared by every plan that reuses the template).
    """

    groups: list[tuple[Region, Holders, tuple[int, ...], int]]
    """(region, holders, receiving ranks, elements) per piece, receivers in rank order."""
    local: list[tuple[Region, tuple[int, ...], int]]
    """(region, ranks holding it on both sides, elements): copied within a rank, not sent."""
    min_elems: int
    """Elements the destination ranks hold but do not already own as sources."""
    num_dst_ranks: int
    """Destination ranks holding any element."""


class PlanCache:
    """Templates keyed on (source layout, destination layout); reuse across plan() calls.

    Attributes:
        tensors_reused / tensors_planned: tensors whose template came from the cache /
            was built, over every ``build_templates`` with this cache (cumulative; a
            refit's report shows its call's share: after an epoch change, the tensors the
            change did not touch are reused).
        carried: templates the last ``renumber`` carried into the new numbering.
    """

    def __init__(self) -> None:
        self.templates: dict[tuple[Layout, Layout], Template] = {}
        self.tensors_reused = 0
        self.tensors_planned = 0
        self.carried = 0

    def __len__(self) -> int:
        return len(self.templates)

    def renumber(self, ranks: Mapping[int, int]) -> None:
        """Carry the cache across a renumbering of ranks (old rank -> new rank of every
        rank that stays; ``xreshard.runtime.comm_epochs.renumbering``): templates whose
        layouts name only staying ranks are kept under the renamed layouts, the others
        dropped. A map that does not keep the ranks' order empties the cache."""
        from .renumber import increasing, renumbered_layout, renumbered_template
        if all(a == b for a, b in ranks.items()):
            # nobody moved: a template is valid whoever its ranks are; keep them all
            self.carried = len(self.templates)
            return
        carried: dict[tuple[Layout, Layout], Template] = {}
        if increasing(ranks):
            for (src, dst), tpl in self.templates.items():
                new_src, new_dst = renumbered_layout(src, ranks), renumbered_layout(dst, ranks)
                if new_src is not None and new_dst is not None:
                    carried[(new_src, new_dst)] = renumbered_template(tpl, ranks)
        self.templates, self.carried = carried, len(carried)


@dataclass(frozen=True, slots=True)
class TemplateUse:
    """Phase 1's result: the distinct templates and, per tensor, which one at which itemsize."""

    templates: tuple[Template, ...]
    per_tensor: tuple[tuple[int, int], ...]
    """(index into ``templates``, wire itemsize) per tensor, in plan order."""


def build_templates(names: Sequence[str], src_layouts: Mapping[str, Layout],
                    dst_layouts: Mapping[str, Layout], wire_dtypes: Mapping[str, str],
                    cache: PlanCache) -> TemplateUse:
    """One template per distinct layout pair of ``names`` (reused from ``cache`` when there).

    Raises:
        PlanError: a destination region no source rank holds (every one listed, up to
            ``MAX_LISTED``).
    """
    problems: list[str] = []
    index: dict[tuple[Layout, Layout], int] = {}
    templates: list[Template] = []
    per_tensor: list[tuple[int, int]] = []
    built: set[tuple[Layout, Layout]] = set()
    for name in names:
        key = (src_layouts[name], dst_layouts[name])
        i = index.get(key)
        if i is None:
            tpl = cache.templates.get(key)
            if tpl is None:
                before = len(problems)
                tpl = build_template(key[0], key[1], name, problems)
                built.add(key)
                if len(problems) == before:
                    cache.templates[key] = tpl
            i = index[key] = len(templates)
            templates.append(tpl)
        per_tensor.append((i, itemsize(wire_dtypes[name])))
    planned = sum((src_layouts[n], dst_layouts[n]) in built for n in names)
    cache.tensors_planned += planned
    cache.tensors_reused += len(names) - planned
    if problems:
        more = (f"\n  ... and {len(problems) - MAX_LISTED} more"
                if len(problems) > MAX_LISTED else "")
        raise PlanError("destination regions that no source rank holds:\n  "
                        + "\n  ".join(problems[:MAX_LISTED]) + more
                        + "\nthe source layouts must cover every element a destination holds")
    return TemplateUse(tuple(templates), tuple(per_tensor))


def build_template(src: Layout, dst: Layout, name: str, problems: list[str]) -> Template:
    """The template of one layout pair; uncovered regions are appended to ``problems``."""
    if src.is_product and dst.is_product:
        raw = _product_pieces(src, dst)
    else:
        raw = _general_pieces(src, dst, name, problems)
    src_ranks = src.rank_set
    colocated = not src_ranks.isdisjoint(dst.rank_set)
    groups, local = [], []
    for ranks, region, holders in raw:
        n = region.size
        if colocated and not src_ranks.isdisjoint(ranks):
            owners = tuple(r for r in ranks if r in holders)
            if owners:
                local.append((region, owners, n))
                ranks = tuple(r for r in ranks if r not in holders)
                if not ranks:
                    continue
        groups.append((region, holders, ranks, n))
    min_elems, num_dst = _min_elements(src, dst, colocated)
    return Template(groups, local, min_elems, num_dst)


def _min_elements(src: Layout, dst: Layout, colocated: bool) -> tuple[int, int]:
    """(elements destinations lack, destination ranks holding any), from the layouts alone:
    what each destination rank holds minus what it already owns as a source."""
    min_elems = num_dst = 0
    if dst.is_product:
        for _, ranks in dst.rank_groups():
            n = dst.num_elements(ranks[0])
            num_dst += len(ranks)
            min_elems += n * len(ranks)
    else:
        for rank in dst.ranks:
            n = dst.num_elements(rank)
            num_dst += n > 0
            min_elems += n
    if colocated:
        for rank in dst.rank_set & src.rank_set:
            owns = src.regions(rank)
            for w in dst.regions(rank):
                min_elems -= sum(x.size for o in owns if (x := w.intersect(o)) is not None)
    return min_elems, num_dst


def _overlaps(starts: list[int], segs: list[tuple[int, int, Any]],
              intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int, Any]]:
    """The parts of ``intervals`` over the sorted segments ``segs``: (lo, hi, segment key)."""
    out = []
    for a, b in intervals:
        i = max(bisect_right(starts, a) - 1, 0)
        while i < len(segs) and segs[i][0] < b:
            s, e, key = segs[i]
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                out.append((lo, hi, key))
            i += 1
    return out


def _product_pieces(src: Layout, dst: Layout
                    ) -> Iterator[tuple[tuple[int, ...], Region, Holders]]:
    """(receiving ranks, region, holders) for two product layouts, by per-dim merging."""
    ndim = src.ndim
    src_axes = [src.dim_axes(dim) for dim in range(ndim)]
    segs = []
    for dim in range(ndim):
        items = sorted((s, e, key) for key, ivs in src.dim_table(dim).items() for s, e in ivs)
        segs.append(([s for s, _, _ in items], items))
    holders_memo: dict[tuple[int, ...], Holders] = {}
    mesh = src.mesh
    assert mesh is not None                        # product form
    for per_dim, ranks in dst.rank_groups():
        dim_lists = [_overlaps(*segs[dim], per_dim[dim]) for dim in range(ndim)]
        for combo in itertools.product(*dim_lists):
            keys = tuple(k for _, _, k in combo)
            holders = holders_memo.get(keys)
            if holders is None:
                fixed = {a: c for dim in range(ndim) for a, c in zip(src_axes[dim], keys[dim])}
                coords = [[fixed[a]] if a in fixed else range(mesh.shape[a])
                          for a in range(mesh.ndim)]
                holders = tuple(sorted(mesh.rank_at(c) for c in itertools.product(*coords)))
                holders_memo[keys] = holders
            yield ranks, Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo)), holders


def _general_pieces(src: Layout, dst: Layout, name: str, problems: list[str]
                    ) -> Iterator[tuple[tuple[int, ...], Region, Holders]]:
    """Pieces when either side is explicit: refine each destination region on all boundaries."""
    # a holder is (rank, which of its local buffers): a rank holding two pieces of a cell in
    # two buffers must not be asked for the cell as one view
    src_held = [((r, i), reg) for r in src.ranks for i, reg in enumerate(src.regions(r))]
    for rank in sorted(dst.ranks):
        for want in dst.regions(rank):
            if want.is_empty:
                continue
            inter = [(r, x) for r, reg in src_held if (x := want.intersect(reg)) is not None]
            for cell, holders in _cells(want, inter, rank, name, problems):
                yield (rank,), cell, tuple(sorted({r for r, _ in holders}))


def _cells(want: Region, inter: list[tuple[tuple[int, int], Region]], rank: int, name: str,
           problems: list[str]) -> list[tuple[Region, tuple[tuple[int, int], ...]]]:
    """``want`` cut on every boundary of the source regions it meets, with the (rank,
    buffer) holders of each cell; runs along the last dim sharing holders are merged."""
    cuts = []
    for dim in range(want.ndim):
        seen = {want.starts[dim], want.stops[dim]}
        for _, x in inter:
            seen.update((x.starts[dim], x.stops[dim]))
        pts = sorted(seen)
        cuts.append(list(zip(pts, pts[1:])))
    cells: list[tuple[Region, tuple[tuple[int, int], ...]]] = []
    for combo in itertools.product(*cuts):
        cell = Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
        holders = tuple(sorted(h for h, x in inter if x.contains(cell)))
        if not holders:
            problems.append(f"tensor {name!r}: destination rank {rank} needs region "
                            f"{cell} but no source rank holds it")
            continue
        prev = cells[-1][0] if cells else None
        if prev is not None and cells[-1][1] == holders and want.ndim and \
                prev.starts[:-1] == cell.starts[:-1] and \
                prev.stops[:-1] == cell.stops[:-1] and prev.stops[-1] == cell.starts[-1]:
            # merge runs along the last dim that share holders (row-major order)
            cells[-1] = (Region(prev.starts, prev.stops[:-1] + cell.stops[-1:]), holders)
        else:
            cells.append((cell, holders))
    return cells
