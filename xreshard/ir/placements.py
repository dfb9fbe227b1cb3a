"""Placements (DTensor's ``Shard``/``Replicate``/``_StridedShard``, or the neutral strings
``"R"``, ``"S0"``, ``"SS1/2"``) read as the product form's splits, without importing torch.
Re-exported by :mod:`xreshard.ir.layout`, where ``Layout.from_placements`` uses them."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import LayoutError
from .geometry import Mesh, Split

__all__ = ["PLACEMENT_HELP", "is_unconstrained", "parse_placement", "splits_of_placements"]

#: what a placement may be, for error messages
PLACEMENT_HELP = ('placements are one entry per mesh axis: "R" (Replicate), "S<dim>" (Shard), '
                  '"SS<dim>/<split_factor>" (_StridedShard), or torch placement objects')


def is_unconstrained(entry: Any) -> bool:
    return type(entry).__name__ == "UnconstrainedSingleton" or repr(entry) == "UNCONSTRAINED"


def splits_of_placements(placements: Sequence[Any], mesh: Mesh, shape: tuple[int, ...],
                         where: str = "") -> list[Split]:
    """One Split per shard placement, in mesh-axis order (the order DTensor applies them);
    ``where`` prefixes error messages (``"tensor 'w': "``)."""
    if len(placements) != mesh.ndim:
        raise LayoutError(f"{where}{len(placements)} placements for a {mesh.ndim}-d mesh "
                          f"{mesh}: {list(placements)}; {PLACEMENT_HELP}")
    ndim = len(shape)
    splits = []
    for axis, p in enumerate(placements):
        parsed = parse_placement(p, where, mesh.axis_label(axis))
        if parsed is None:
            continue
        dim, sf = parsed
        if not -ndim <= dim < ndim:
            raise LayoutError(f"{where}placement {p!r} on mesh axis {mesh.axis_label(axis)!r} "
                              f"shards dim {dim} of a {ndim}-d tensor of shape {shape}")
        splits.append(Split(dim % ndim, axis, sf))
    return splits


def parse_placement(p: Any, where: str = "", axis: str | None = None) -> tuple[int, int] | None:
    """(dim, split_factor) of a shard placement, None for Replicate.

    Takes the neutral strings (``"R"``, ``"S0"``, ``"SS1/2"``) or torch placement objects,
    recognised by class name along the MRO (so subclasses work, and ``_StridedShard`` is
    tested first: before torch 2.10 it subclassed ``Shard``) without importing torch.

    Raises:
        LayoutError: Partial (a pending reduction) or anything not understood.
    """
    shown = repr(p) if isinstance(p, str) else str(p)
    on = f" on mesh axis {axis!r}" if axis is not None else ""
    partial = (f"{where}placement {shown}{on} is Partial (a pending reduction); xreshard does "
               "not reduce yet - redistribute to Replicate/Shard first (e.g. "
               "dt.redistribute(placements=[Replicate()]))")
    if isinstance(p, str):
        s = p.strip()
        if s in ("R", "Replicate", "Replicate()"):
            return None
        try:
            if s.startswith("SS") and "/" in s:
                dim_s, sf_s = s[2:].split("/", 1)
                return int(dim_s), int(sf_s)
            if s.startswith("S"):
                return int(s[1:]), 1
        except ValueError:
            pass
        if s.startswith("P"):
            raise LayoutError(partial)
        raise LayoutError(f"{where}placement {shown}{on} is not understood; {PLACEMENT_HELP}")
    kinds = [c.__name__ for c in type(p).__mro__]
    if "_StridedShard" in kinds:
        dim, sf = int(p.dim), int(p.split_factor)
        if sf < 1:
            raise LayoutError(f"{where}placement {shown}{on} needs split_factor >= 1")
        return dim, sf
    if "Shard" in kinds:
        return int(p.dim), 1
    if "Replicate" in kinds:
        return None
    if any("Partial" in k for k in kinds):
        raise LayoutError(partial)
    raise LayoutError(f"{where}placement {p!r} (type {kinds[0]}){on} is not understood; "
                      f"{PLACEMENT_HELP}")
