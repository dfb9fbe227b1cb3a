"""Interval arithmetic of the layout IR: torch.chunk blocks of lists of ``[start, stop)``.

Pure integers; layout.py builds every product layout's per-dim interval lists from these.
"""

from __future__ import annotations

from typing import Sequence

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
