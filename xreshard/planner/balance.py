"""Sender balancing: the exact least max load by max-flow, and cutting streams at quotas.

Pure integer arithmetic on byte counts; the planner calls it with per-class totals.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Mapping, Sequence

from ..ir.layout import Region

Holders = tuple[int, ...]


def max_flow(num_nodes: int, edges: list[tuple[int, int, int]], s: int, t: int
             ) -> tuple[int, list[int], list[list[int]], list[int], list[int]]:
    """Dinic's max-flow on integer capacities.

    Returns:
        (flow, residual capacity per edge (edge 2i is ``edges[i]``, 2i+1 its reverse),
        adjacency, edge heads, BFS level per node in the final residual graph (-1 when
        unreachable from ``s``: the source side of a min cut is the reachable nodes)).
    """
    to: list[int] = []
    cap: list[int] = []
    adj: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v, c in edges:
        adj[u].append(len(to)); to.append(v); cap.append(c)
        adj[v].append(len(to)); to.append(u); cap.append(0)
    flow = 0
    while True:
        level = [-1] * num_nodes
        level[s] = 0
        queue = [s]
        for u in queue:
            for e in adj[u]:
                if cap[e] > 0 and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    queue.append(to[e])
        if level[t] < 0:
            return flow, cap, adj, to, level
        it = [0] * num_nodes

        def push(u: int, f: int) -> int:
            if u == t:
                return f
            while it[u] < len(adj[u]):
                e = adj[u][it[u]]
                v = to[e]
                if cap[e] > 0 and level[v] == level[u] + 1:
                    got = push(v, min(f, cap[e]))
                    if got:
                        cap[e] -= got
                        cap[e ^ 1] += got
                        return got
                it[u] += 1
            return 0

        while True:
            f = push(s, 1 << 62)
            if not f:
                break
            flow += f


def balance(demand: Mapping[Holders, int], fixed: Mapping[int, int]
            ) -> tuple[int, dict[Holders, dict[int, int]]]:
    """Least possible max load, and a flow reaching it.

    ``demand[holders]`` bytes must be sent by the ranks in ``holders`` (splittable among
    them); ``fixed[rank]`` bytes a rank must send anyway. Returns (max load L, per class the
    bytes each holder sends). L is found by Dinkelbach steps on min cuts: a cut that blocks
    the flow names a set of ranks whose demand/size exceeds L, and that ratio is the next L.
    """
    multi = sorted(h for h, b in demand.items() if b > 0)
    senders = sorted({r for h in multi for r in h})
    top_fixed = max(fixed.values(), default=0)
    if not multi:
        return top_fixed, {}
    total = sum(demand[h] for h in multi)
    load = max(max((fixed.get(r, 0) for r in senders), default=0),
               -(-(total + sum(fixed.get(r, 0) for r in senders)) // len(senders)))
    cls_node = {h: 2 + i for i, h in enumerate(multi)}
    rank_node = {r: 2 + len(multi) + i for i, r in enumerate(senders)}
    num_nodes = 2 + len(multi) + len(senders)
    while True:
        edges = [(0, cls_node[h], demand[h]) for h in multi]
        edges += [(cls_node[h], rank_node[r], total) for h in multi for r in h]
        edges += [(rank_node[r], 1, load - fixed.get(r, 0)) for r in senders]
        flow, cap, adj, to, level = max_flow(num_nodes, edges, 0, 1)
        if flow == total:
            break
        cut_ranks = [r for r in senders if level[rank_node[r]] >= 0]
        cut_demand = sum(demand[h] for h in multi if level[cls_node[h]] >= 0)
        new_load = -(-(cut_demand + sum(fixed.get(r, 0) for r in cut_ranks)) // len(cut_ranks))
        assert new_load > load, (new_load, load)
        load = new_load
    flows: dict[Holders, dict[int, int]] = {}
    e = 2 * len(multi)
    for h in multi:
        out = {}
        for r in h:
            out[r] = cap[e + 1]      # reverse residual = flow on the class -> rank edge
            e += 2
        flows[h] = out
    return max(load, top_fixed), flows


def split_piece(region: Region, nbytes: int, start: int, bounds: Sequence[int]
                ) -> list[tuple[int, Region, int]]:
    """Cut one piece of a class stream at the quota ``bounds``: [(holder index, region, bytes)].

    The piece occupies ``[start, start + nbytes)`` of the stream; holder j owns
    ``[bounds[j], bounds[j+1])``. Cuts fall on whole rows of the outermost dim longer than
    one; a piece that cannot be cut goes whole to the holder owning its first byte.
    """
    j = bisect_right(bounds, start) - 1
    end = start + nbytes
    if bounds[j + 1] >= end:
        return [(j, region, nbytes)]
    shape = region.shape
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None:
        return [(j, region, nbytes)]
    rows = shape[d]
    row_bytes = nbytes // rows
    out = []
    row, owner, k = 0, j, j + 1
    while k < len(bounds) - 1 and bounds[k] < end:
        cut = min(rows, max(row, round((bounds[k] - start) / row_bytes)))
        if cut > row:
            out.append((owner, row, cut))
            row = cut
        owner = k
        k += 1
    if row < rows:
        out.append((owner, row, rows))
    a = region.starts[d]
    return [(o, Region(region.starts[:d] + (a + r0,) + region.starts[d + 1:],
                       region.stops[:d] + (a + r1,) + region.stops[d + 1:]),
             (r1 - r0) * row_bytes) for o, r0, r1 in out]


