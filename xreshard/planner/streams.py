"""Phases 2-4 of the planner: sender classes, streams and quotas (see plan.py's glossary).

2. *Sender classes*: a piece's candidate senders are its holders narrowed by locality (same
   process, else same host, else all); a template at one wire itemsize, its pieces cut by
   class, is a *view*.
3. *Streams*: each class's pieces over the whole model, in tensor order, laid end to end.
4. *Quotas*: each multi-holder stream cut into contiguous ranges, one per holder, from a
   max-flow (balance.py), so the most loaded sender carries the least possible.

Each phase is a pure function returning a read-only value; :class:`xreshard.planner.plan.Plan` is
built once from them and answers per-rank queries.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from .balance import balance
from ..ir.layout import Region
from .templates import Holders, Template, TemplateUse
from ..ir.topology import Topology


# ---------------------------------------------------------------------------- 2. sender classes

class Sub:
    """Receivers of one template group that share a sender class (locality may split a group)."""

    __slots__ = ("group", "cls", "slot", "ranks", "tid", "nbytes", "offset")

    def __init__(self, group: int, cls: int, slot: int, ranks: tuple[int, ...], tid: int,
                 nbytes: int, offset: int):
        self.group = group      # index into template.groups
        self.cls = cls          # sender class
        self.slot = slot        # index of cls among the view's multi-holder classes, or -1
        self.ranks = ranks      # receivers, stream order
        self.tid = tid          # interned id of `ranks`
        self.nbytes = nbytes    # bytes per receiver
        self.offset = offset    # byte offset of the first receiver in this view's class share


@dataclass(slots=True)
class View:
    """A template at one wire itemsize under one topology, its pieces cut by sender class."""

    template: Template
    itemsize: int
    subs: list[Sub]
    class_order: list[int]
    class_bytes: list[int]
    class_subs: dict[int, tuple[list[int], list[int]]]   # class -> (sub indices, offsets)
    multi_order: list[int]                               # classes with several holders
    multi_bytes: list[int]


@dataclass(frozen=True, slots=True)
class SenderClasses:
    """Phase 2's result. Read-only once built."""

    views: list[View]
    view_of: list[int]                      # per tensor: its view
    classes: list[Holders]                  # per class: its candidate senders, sorted
    rank_tuples: list[tuple[int, ...]]      # interned receiver tuples (``Sub.tid``)


def sender_classes(use: TemplateUse, topology: Topology | None) -> SenderClasses:
    """Phase 2: cut every template's pieces by sender class, once per (template, itemsize)."""
    classes: list[Holders] = []
    class_id: dict[Holders, int] = {}
    rank_tuples: list[tuple[int, ...]] = []
    tuple_id: dict[tuple[int, ...], int] = {}

    def intern(xs: tuple[int, ...], table: dict[Any, int], store: list[Any]) -> int:
        i = table.get(xs)
        if i is None:
            i = table[xs] = len(store)
            store.append(xs)
        return i

    narrow = None if topology is None else _narrower(topology)
    views: list[View] = []
    view_index: dict[tuple[int, int], int] = {}
    view_of: list[int] = []
    for key in use.per_tensor:
        v = view_index.get(key)
        if v is None:
            v = view_index[key] = len(views)
            views.append(_make_view(use.templates[key[0]], key[1], narrow, classes,
                                    lambda h: intern(h, class_id, classes),
                                    lambda rs: intern(rs, tuple_id, rank_tuples)))
        view_of.append(v)
    return SenderClasses(views, view_of, classes, rank_tuples)


def _narrower(topology: Topology) -> Callable[[Holders, int], Holders]:
    """holders, destination rank -> the holders in its process, else on its host, else all."""
    memo: dict[tuple[Holders, int], Holders] = {}

    def narrow(holders: Holders, dst_rank: int) -> Holders:
        key = (holders, dst_rank)
        got = memo.get(key)
        if got is None:
            proc, host = topology.process_of(dst_rank), topology.host_of(dst_rank)
            got = (tuple(h for h in holders if proc is not None and topology.process_of(h) == proc)
                   or tuple(h for h in holders if host is not None and topology.host_of(h) == host)
                   or holders)
            memo[key] = got
        return got

    return narrow


def _make_view(tpl: Template, size: int, narrow: Callable[[Holders, int], Holders] | None,
               classes: list[Holders], class_of: Callable[[Holders], int],
               tuple_of: Callable[[tuple[int, ...]], int]) -> View:
    """``tpl`` at wire itemsize ``size``: its groups cut by sender class, with each class's
    byte offsets within the view."""
    subs: list[Sub] = []
    order: list[int] = []
    cbytes: list[int] = []
    slot_of: dict[int, int] = {}
    for g, (_, holders, ranks, n) in enumerate(tpl.groups):
        if narrow is None or len(holders) == 1:
            split = [(holders, ranks)]
        else:
            by_cls: dict[Holders, list[int]] = {}
            for r in ranks:
                by_cls.setdefault(narrow(holders, r), []).append(r)
            split = [(h, tuple(rs)) for h, rs in by_cls.items()]
        for h, rs in split:
            c = class_of(h)
            slot = slot_of.get(c)
            if slot is None:
                slot = slot_of[c] = len(order)
                order.append(c)
                cbytes.append(0)
            subs.append(Sub(g, c, slot, rs, tuple_of(rs), n * size, cbytes[slot]))
            cbytes[slot] += n * size * len(rs)
    class_subs: dict[int, tuple[list[int], list[int]]] = {c: ([], []) for c in order}
    for i, sub in enumerate(subs):
        class_subs[sub.cls][0].append(i)
        class_subs[sub.cls][1].append(sub.offset)
    # only classes with several holders need stream offsets (quotas cut them); a single
    # holder sends its whole class
    multi = [k for k, c in enumerate(order) if len(classes[c]) > 1]
    mslot = {k: i for i, k in enumerate(multi)}
    for sub in subs:
        sub.slot = mslot.get(sub.slot, -1)
    return View(tpl, size, subs, order, cbytes, class_subs,
                 [order[k] for k in multi], [cbytes[k] for k in multi])


# ---------------------------------------------------------------------------- 3. streams

@dataclass(frozen=True, slots=True)
class Streams:
    """Phase 3's result: every class's bytes over the model. Read-only once built."""

    totals: list[int]                       # per class: bytes of its stream
    view_counts: dict[int, int]             # per view: tensors using it (first-use order)
    tensor_list: list[list[int]]            # per class: tensors in stream order (multi-holder)
    tensor_cum: list[list[int]]             # per class: stream offset of each of those tensors
    tensor_starts: list[tuple[int, ...]]    # per tensor: offset per multi-holder slot of its view
    class_views: dict[int, list[int]]       # single-holder class -> its views
    view_tensors: dict[int, list[int]]      # view -> its tensors, in order


def lay_streams(cls: SenderClasses) -> Streams:
    """Phase 3: lay each class's pieces end to end over the model, in tensor order."""
    views, classes = cls.views, cls.classes
    counts = dict(Counter(cls.view_of))
    totals = [0] * len(classes)
    class_views: dict[int, list[int]] = {}
    for v, cnt in counts.items():
        for c, b in zip(views[v].class_order, views[v].class_bytes):
            if len(classes[c]) == 1:
                totals[c] += cnt * b
                class_views.setdefault(c, []).append(v)
    tensor_list: list[list[int]] = [[] for _ in classes]
    tensor_cum: list[list[int]] = [[] for _ in classes]
    tensor_starts: list[tuple[int, ...]] = []
    view_tensors: dict[int, list[int]] = {}
    for t, v in enumerate(cls.view_of):
        view = views[v]
        view_tensors.setdefault(v, []).append(t)
        starts = []
        for c, b in zip(view.multi_order, view.multi_bytes):
            tensor_list[c].append(t)
            tensor_cum[c].append(totals[c])
            starts.append(totals[c])
            totals[c] += b
        tensor_starts.append(tuple(starts))
    return Streams(totals, counts, tensor_list, tensor_cum, tensor_starts, class_views,
                    view_tensors)


def piece_at(cls: SenderClasses, streams: Streams, c: int, x: int
              ) -> tuple[Region, int, int] | None:
    """The piece of class ``c``'s stream holding byte ``x``: (region, start, bytes)."""
    tcum = streams.tensor_cum[c]
    pos = bisect_right(tcum, x) - 1
    if pos < 0:
        return None
    view = cls.views[cls.view_of[streams.tensor_list[c][pos]]]
    idx, offs = view.class_subs[c]
    k = bisect_right(offs, x - tcum[pos]) - 1
    sub = view.subs[idx[k]]
    first = tcum[pos] + offs[k]
    p = (x - first) // sub.nbytes if sub.nbytes else 0
    return view.template.groups[sub.group][0], first + p * sub.nbytes, sub.nbytes


# ---------------------------------------------------------------------------- 4. quotas

@dataclass(frozen=True, slots=True)
class Quotas:
    """Phase 4's result. Read-only once built."""

    bounds: list[list[int]]                 # per class: holder j sends [bounds[j], bounds[j+1])
    sender_classes: dict[int, list[int]]    # rank -> the classes it is a holder of
    lower_bound: int                        # least possible max bytes sent by one rank


def cut_quotas(cls: SenderClasses, streams: Streams, topology: Topology | None) -> Quotas:
    """Phase 4: cut each multi-holder stream into contiguous quotas from a max-flow."""
    classes, totals = cls.classes, streams.totals
    fixed: dict[int, int] = {}
    demand: dict[Holders, int] = {}
    for c, h in enumerate(classes):
        if len(h) == 1:
            fixed[h[0]] = fixed.get(h[0], 0) + totals[c]
        else:
            demand[h] = totals[c]
    lower, flows = balance(demand, fixed)
    bounds: list[list[int]] = []
    sender_classes: dict[int, list[int]] = {}
    for c, h in enumerate(classes):
        acc, b = 0, [0]
        for r in h:
            acc += flows[h][r] if len(h) > 1 else totals[c]
            b.append(acc)
        bounds.append(b)
        for r in h:
            sender_classes.setdefault(r, []).append(c)
    if topology is not None:
        # the lower bound ignores locality (full holder sets): what any plan could reach
        lb_demand: dict[Holders, int] = {}
        lb_fixed: dict[int, int] = {}
        for v, cnt in streams.view_counts.items():
            view = cls.views[v]
            for _, holders, ranks, n in view.template.groups:
                nbytes = cnt * n * view.itemsize * len(ranks)
                if len(holders) == 1:
                    lb_fixed[holders[0]] = lb_fixed.get(holders[0], 0) + nbytes
                else:
                    lb_demand[holders] = lb_demand.get(holders, 0) + nbytes
        lower, _ = balance(lb_demand, lb_fixed)
    return Quotas(bounds, sender_classes, lower)
