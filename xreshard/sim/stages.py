"""The shipped relay's stage decisions for a whole world, fast enough for 256 ranks.

``xreshard.planner.relay.relay_layouts`` is what a relayed refit runs: per tensor (in name
order) and per destination domain that relays it, the domain's needs are cut into grid
cells, each cell needed by ``m`` ranks is cut into ``m`` row blocks (*parts*), and the
least loaded needers take the parts (load: bytes taken so far in that domain), largest
part first; every other needer of a cell receives each part from its taker in stage 2.

:func:`relay_stages` makes the same decisions and returns the same stage-1 layouts, but
for DeepSeek-V3 on 256 ranks (45,395 tensors) in seconds rather than a minute: the cells
are found once per (destination layout, source domains), as there; the takers of every
cell of a tensor are chosen at once in numpy (cells whose needers are disjoint do not
affect each other's choice); and the explicit layouts are built once per distinct choice,
never per tensor. Stage 2 is returned as its forwards (taker, part, targets), which is
all a simulator needs; ``tests/test_simulate.py`` pins both against ``relay_layouts``.

Pure: layouts and the domain of every rank in, decisions out.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..dtypes import itemsize
from ..ir.geometry import Region
from ..ir.intervals import chunk
from ..ir.layout import Layout

__all__ = ["Forward", "RelayStages", "relay_stages"]


@dataclass(frozen=True, slots=True)
class Forward:
    """A part that rank ``taker`` receives in stage 1 and forwards to ``targets`` (its
    domain's other needers) in stage 2; it is region ``index`` of the taker's stage-1
    layout. ``pieces``: the stage-2 plan's transfers of it (the part, cut where parts
    of other domains overlap it, as the planner refines explicit layouts)."""

    taker: int
    index: int
    region: Region
    targets: tuple[int, ...]
    pieces: tuple[Region, ...]


@dataclass(frozen=True)
class RelayStages:
    """The stages of a relayed refit, as :func:`relay_stages` found them.

    ``choice[t]`` names the decision of tensor ``names[t]`` (sorted names): its stage-1
    layout is ``stage1_dst[names[t]]`` and its forwards ``forwards[choice[t]]``."""

    names: list[str]
    stage1_dst: dict[str, Layout]
    choice: np.ndarray
    layouts: list[Layout]
    """The stage-1 layout of each decision."""
    forwards: list[tuple[Forward, ...]]
    bytes_relayed: int

    @property
    def forwarding(self) -> bool:
        return any(self.forwards[c] for c in set(self.choice.tolist()))


@dataclass
class _Cells:
    """One (destination layout, source domains): the ranks of each domain, and for a
    relayed domain its cells ``(box, needers, parts)`` in grid order."""

    domains: list[tuple[int, list[int], list | None]]
    waves: list[tuple[np.ndarray, np.ndarray, list[int]]]
    """Cells of relayed domains grouped so the cells of one wave have disjoint needers
    and as many needers each: (needers matrix, part bytes matrix, cell numbers)."""
    cells: list[tuple[Region, list[int], list[Region]]]


def _parts(box: Region, k: int) -> list[Region]:
    """``box`` cut into ``k`` row blocks (torch.chunk) along its first dim longer than 1,
    empty blocks dropped; the box itself when it cannot be cut."""
    dim = next((d for d, n in enumerate(box.shape) if n > 1), None)
    if dim is None or k <= 1:
        return [box]
    n = box.shape[dim]
    ways = min(k, n)
    out = []
    for i in range(ways):
        off, length = chunk(n, ways, i)
        if length:
            lo = box.starts[dim] + off
            out.append(Region(box.starts[:dim] + (lo,) + box.starts[dim + 1:],
                              box.stops[:dim] + (lo + length,) + box.stops[dim + 1:]))
    return out


def _grid(dst: Layout, ranks: list[int]) -> list[tuple[Region, list[int]]]:
    """The grid cells of ``ranks``' regions (every boundary of every region, per dim), in
    grid order, each with the ranks that hold it (in ``ranks`` order)."""
    held = [(r, reg) for r in ranks for reg in dst.regions(r)]
    cuts = [sorted({x for _, reg in held for x in (reg.starts[d], reg.stops[d])})
            for d in range(dst.ndim)]
    needers: dict[tuple[int, ...], list[int]] = {}
    for r, reg in held:
        spans = [range(bisect_left(cuts[d], reg.starts[d]), bisect_left(cuts[d], reg.stops[d]))
                 for d in range(dst.ndim)]
        for cell in itertools.product(*spans):
            needers.setdefault(cell, []).append(r)
    return [(Region(tuple(cuts[d][i] for d, i in enumerate(cell)),
                    tuple(cuts[d][i + 1] for d, i in enumerate(cell))), needers[cell])
            for cell in sorted(needers)]


def _cells(dst: Layout, src_domains: frozenset | None, domain: Sequence[int]) -> _Cells:
    by_domain: dict[int, list[int]] = {}
    for r in dst.ranks:
        if dst.num_elements(r):
            by_domain.setdefault(domain[r], []).append(r)
    isz = itemsize(dst.dtype)
    domains: list[tuple[int, list[int], list | None]] = []
    cells: list[tuple[Region, list[int], list[Region]]] = []
    for dom, ranks in by_domain.items():
        found = None
        if src_domains is not None and dom not in src_domains and len(ranks) > 1:
            grid = _grid(dst, ranks)
            if any(len(needers) > 1 for _, needers in grid):
                found = list(range(len(cells), len(cells) + len(grid)))
                cells.extend((box, needers, _parts(box, len(needers))) for box, needers in grid)
        domains.append((dom, ranks, found))
    # waves: consecutive cells with pairwise disjoint needers, then by needer count
    waves: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
    run: list[int] = []
    taken: set[int] = set()

    def flush() -> None:
        by_m: dict[int, list[int]] = {}
        for c in run:
            by_m.setdefault(len(cells[c][1]), []).append(c)
        for m, cs in by_m.items():
            needers = np.array([cells[c][1] for c in cs], np.int64).reshape(len(cs), m)
            nbytes: Any = np.zeros((len(cs), m), np.int64)
            for i, c in enumerate(cs):
                sizes = [p.size * isz for p in cells[c][2]]
                nbytes[i, :len(sizes)] = sizes
            waves.append((needers, nbytes, cs))

    for c, (_, needers, _) in enumerate(cells):
        if taken.intersection(needers):
            flush()
            run, taken = [], set()
        run.append(c)
        taken.update(needers)
    if run:
        flush()
    return _Cells(domains, waves, cells)


def relay_stages(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                 domain: Sequence[int]) -> RelayStages:
    """``relay_layouts(src_layouts, dst_layouts, topology)``'s decisions, where rank ``r``
    lives on host (domain) ``domain[r]``.

    Returns:
        A :class:`RelayStages`; its ``stage1_dst`` equals ``relay_layouts``'
        ``stage1_dst``, and its forwards are exactly ``stage2_src`` -> ``stage2_dst``.
    """
    names = sorted(dst_layouts)
    n = len(domain)
    load: Any = np.zeros(n, np.int64)        # bytes each rank took so far (its domain's counter)
    src_memo: dict[int, frozenset | None] = {}
    cells_memo: dict[tuple, tuple[int, _Cells]] = {}
    made: dict[tuple, int] = {}
    stage1: dict[str, Layout] = {}
    choice: Any = np.empty(len(names), np.int32)
    forwards: list[tuple[Forward, ...]] = []
    layouts: list[Layout] = []
    relayed_of: list[int] = []
    relayed = 0
    for t, name in enumerate(names):
        dst = dst_layouts[name]
        src = src_layouts.get(name)
        src_domains = None
        if src is not None:
            src_domains = src_memo.get(id(src))
            if src_domains is None:
                src_domains = src_memo[id(src)] = frozenset(
                    domain[r] for r in src.ranks if src.num_elements(r))
        key = (dst, src_domains)
        got = cells_memo.get(key)
        if got is None:
            got = cells_memo[key] = (len(cells_memo), _cells(dst, src_domains, domain))
        cid, cells = got
        takers = []
        for needers, nbytes, _ in cells.waves:
            order = np.argsort(load[needers] * n + needers, axis=1)
            chosen = np.take_along_axis(needers, order, axis=1)
            load[chosen] += nbytes       # distinct ranks in a wave: no index repeats
            takers.append(chosen)
        sig = (cid, b"".join(c.tobytes() for c in takers))
        k = made.get(sig)
        if k is None:
            k = made[sig] = len(layouts)
            lay, fwd, nb = _decided(dst, cells, takers)
            layouts.append(lay)
            forwards.append(fwd)
            relayed_of.append(nb)
        stage1[name] = layouts[k]
        choice[t] = k
        relayed += relayed_of[k]
    return RelayStages(names, stage1, choice, layouts, forwards, relayed)


def _decided(dst: Layout, cells: _Cells, takers: list[np.ndarray]
             ) -> tuple[Layout, tuple[Forward, ...], int]:
    """Stage-1 layout, forwards and relayed bytes of one tensor given its cells' takers."""
    taker_of: dict[int, list[int]] = {}
    for (_, _, cs), chosen in zip(cells.waves, takers):
        for c, row in zip(cs, chosen.tolist()):
            taker_of[c] = row
    isz = itemsize(dst.dtype)
    one: dict[int, list[Region]] = {}
    fwd: list[Forward] = []
    relayed = 0
    for _, ranks, found in cells.domains:
        if found is None:
            for r in ranks:
                one[r] = list(dst.regions(r))
            continue
        for r in ranks:
            one.setdefault(r, [])
        for c in found:
            _, needers, parts = cells.cells[c]
            for part, taker in zip(parts, taker_of[c]):
                others = tuple(r for r in needers if r != taker)
                if others:
                    fwd.append(Forward(taker, len(one[taker]), part, others, ()))
                    relayed += part.size * isz * len(others)
                one[taker].append(part)
    return Layout.explicit_form(dst.shape, dst.dtype, one), _cut_pieces(fwd), relayed


def _cut_pieces(fwd: list[Forward]) -> tuple[Forward, ...]:
    """``fwd`` with their stage-2 pieces: what ``plan(stage2_src, stage2_dst)`` transfers.

    The planner refines each wanted region (a part, in a target's stage-2 layout) on every
    boundary of the held regions (all takers' parts, each a buffer ``(taker, i)``) it
    meets, and merges runs along the last dim held by the same buffers. Parts of one
    domain never overlap; parts of two domains that cut a tensor differently do.
    """
    if not fwd:
        return ()
    lo = np.array([f.region.starts for f in fwd], np.int64)
    hi = np.array([f.region.stops for f in fwd], np.int64)
    meets = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(axis=2)
    buffer: list[tuple[int, int]] = []
    count: dict[int, int] = {}
    for f in fwd:
        buffer.append((f.taker, count.get(f.taker, 0)))
        count[f.taker] = count.get(f.taker, 0) + 1
    out = []
    for i, f in enumerate(fwd):
        others = np.flatnonzero(meets[i]).tolist()
        if len(others) == 1:
            out.append(Forward(f.taker, f.index, f.region, f.targets, (f.region,)))
            continue
        want = f.region
        inter = [(buffer[j], box) for j in others
                 if (box := want.intersect(fwd[j].region)) is not None]
        cuts = []
        for d in range(want.ndim):
            pts = sorted({x for _, box in inter for x in (box.starts[d], box.stops[d])})
            cuts.append(list(zip(pts, pts[1:])))
        cells: list[tuple[Region, tuple]] = []
        for combo in itertools.product(*cuts):
            cell = Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
            holders = tuple(sorted(h for h, box in inter if box.contains(cell)))
            last = cells[-1] if cells else None
            if last is not None and last[1] == holders and \
                    last[0].starts[:-1] == cell.starts[:-1] and \
                    last[0].stops[:-1] == cell.stops[:-1] and last[0].stops[-1] == cell.starts[-1]:
                cells[-1] = (Region(last[0].starts, last[0].stops[:-1] + cell.stops[-1:]),
                             holders)
            else:
                cells.append((cell, holders))
        out.append(Forward(f.taker, f.index, f.region, f.targets, tuple(c for c, _ in cells)))
    return tuple(out)


def stage2_layouts(stages: RelayStages, dst_layouts: Mapping[str, Any]
                   ) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """``(stage2_src, stage2_dst)`` as ``relay_layouts`` returns them (tests compare)."""
    src2: dict[str, Layout] = {}
    dst2: dict[str, Layout] = {}
    for t, name in enumerate(stages.names):
        fwd = stages.forwards[int(stages.choice[t])]
        if not fwd:
            continue
        held: dict[int, list[Region]] = {}
        wanted: dict[int, list[Region]] = {}
        for f in fwd:
            held.setdefault(f.taker, []).append(f.region)
            for r in f.targets:
                wanted.setdefault(r, []).append(f.region)
        like = dst_layouts[name]
        src2[name] = Layout.explicit_form(like.shape, like.dtype, held)
        dst2[name] = Layout.explicit_form(like.shape, like.dtype, wanted)
    return src2, dst2
