"""Plans across a change of members: layouts and templates under a rank renumbering.

An elastic world renumbers its ranks at each epoch (``xreshard.runtime.epochs``): group
order, then index, so the ranks of the processes that stay keep their relative order and
shift down (a member left before them) or up (one joined before them). A tensor whose
source and destination layouts name only staying ranks has, in the new epoch, the same
layouts with every rank renamed; its template is then the old one with every rank
renamed too (a template is geometry labelled by ranks, and the renaming keeps their
order, which is all the template's construction compares). ``PlanCache.renumber`` moves a
cache across the change this way: tensors the change does not touch reuse their
templates, the others are planned again.

Pure: a mapping and metadata in, metadata out.
"""

from __future__ import annotations

from typing import Mapping

from ..ir.geometry import Mesh
from ..ir.layout import Layout
from .templates import Template

__all__ = ["renumbered_layout", "renumbered_template"]


def renumbered_layout(layout: Layout, ranks: Mapping[int, int]) -> Layout | None:
    """``layout`` with every rank ``r`` renamed ``ranks[r]``, or None when it names a rank
    the mapping lacks (a member that left or died)."""
    try:
        if layout.explicit is not None:
            return Layout(layout.shape, layout.dtype, None, (), tuple(
                (ranks[rank], regions) for rank, regions in layout.explicit))
        mesh = layout.mesh
        assert mesh is not None
        return Layout(layout.shape, layout.dtype,
                      Mesh(mesh.shape, tuple(ranks[r] for r in mesh.ranks), mesh.axis_names),
                      layout.splits)
    except KeyError:
        return None


def renumbered_template(tpl: Template, ranks: Mapping[int, int]) -> Template:
    """``tpl`` with every rank renamed (the caller checked that the map covers them and
    keeps their order)."""
    groups = [(region, tuple(ranks[r] for r in holders), tuple(ranks[r] for r in receivers), n)
              for region, holders, receivers, n in tpl.groups]
    local = [(region, tuple(ranks[r] for r in owners), n) for region, owners, n in tpl.local]
    return Template(groups, local, tpl.min_elems, tpl.num_dst_ranks)


def increasing(ranks: Mapping[int, int]) -> bool:
    """Whether the renaming keeps the ranks' order (what a renumbering by group order and
    index does to the ranks that stay)."""
    pairs = sorted(ranks.items())
    return all(a[1] < b[1] for a, b in zip(pairs, pairs[1:]))
