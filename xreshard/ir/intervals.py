"""Interval arithmetic of the layout IR: torch.chunk blocks of lists of ``[start, stop)``.

Pure integers; layout.py builds every product layout's per-dim interval lists from these,
and pairs the dims of a reshape (``dim_runs``, ``run_boxes``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

Interval = tuple[int, int]


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk: (offset, length) of block ``i`` of ``n`` elements split ``k`` ways."""
    c = -(-n // k)
    start = min(c * i, n)
    return start, max(0, min(c * (i + 1), n) - start)


def _take(intervals: Sequence[Interval], offset: int, length: int) -> list[Interval]:
    """Positions ``[offset, offset+length)`` of the concatenation of ``intervals``."""
    out: list[Interval] = []
    pos, end = 0, offset + length
    for s, e in intervals:
        n = e - s
        lo, hi = max(offset - pos, 0), min(end - pos, n)
        if lo < hi:
            out.append((s + lo, s + hi))
        pos += n
        if pos >= end:
            break
    return out


def _merge(intervals: list[Interval]) -> tuple[Interval, ...]:
    out: list[Interval] = []
    for s, e in intervals:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return tuple(out)


def split_intervals(intervals: Sequence[Interval], num: int, index: int,
                    split_factor: int = 1) -> tuple[Interval, ...]:
    """Block ``index`` of ``num`` of the current extent ``intervals``.

    With ``split_factor`` sf > 1 (DTensor ``_StridedShard``) the extent is first chunked
    into sf pieces and each piece is chunked ``num`` ways; the result concatenates block
    ``index`` of every piece.
    """
    total = sum(e - s for s, e in intervals)
    if split_factor == 1:
        return _merge(_take(intervals, *chunk(total, num, index)))
    out: list[Interval] = []
    for j in range(split_factor):
        o1, l1 = chunk(total, split_factor, j)
        piece = _take(intervals, o1, l1)
        out += _take(piece, *chunk(l1, num, index))
    return _merge(out)


def dim_runs(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The dims of ``old`` and ``new`` paired in runs of equal products (a reshape merges or
    splits within each run); trailing size-1 dims join the last run."""
    runs: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) and j < len(new):
        od, nd, po, pn = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                po, i = po * old[i], i + 1
                od.append(i - 1)
            else:
                pn, j = pn * new[j], j + 1
                nd.append(j - 1)
        runs.append((od, nd))
    if runs:
        runs[-1][0].extend(range(i, len(old)))
        runs[-1][1].extend(range(j, len(new)))
    return runs


def run_boxes(old: list[int], held: list[tuple[Interval, ...]], new: list[int]
              ) -> list[tuple[tuple[Any, ...], tuple[Interval, ...]]] | None:
    """The boxes one block (``held``: per old dim its intervals, stored in that order) makes
    of one run's ``new`` dims, each with its local index on the ``old`` dims; None where a
    box form needs more than merging (a split dim split into several new dims).

    The dims after the last partly held one are whole, so each index of the dims before it
    and each of its intervals is one interval of the merged dim."""
    whole = [ivs == ((0, n),) for ivs, n in zip(held, old)]
    if all(whole):
        return [((slice(None),) * len(old), tuple((0, n) for n in new))]
    big = [k for k, n in enumerate(new) if n > 1]
    if len(big) > 1:
        return None
    j = max(k for k in range(len(old)) if not whole[k])

    def local(ivs: tuple[Interval, ...]) -> list[tuple[int, int, int]]:
        return [(a, b, sum(e - s for s, e in ivs[:i])) for i, (a, b) in enumerate(ivs)]

    prefix = [[(g, off + g - a) for a, b, off in local(held[k]) for g in range(a, b)]
              for k in range(j)]
    stride = math.prod(old[j + 1:])
    out = []
    for combo in itertools.product(*prefix):
        base = sum(g * math.prod(old[k + 1:]) for k, (g, _) in enumerate(combo))
        for a, b, off in local(held[j]):
            ix = (*(pos for _, pos in combo), slice(off, off + b - a),
                  *(slice(None),) * (len(old) - j - 1))
            out.append((ix, tuple((base + a * stride, base + b * stride) if k in big else
                                  (0, 1) for k in range(len(new)))))
    return out
