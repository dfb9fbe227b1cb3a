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
  disturb live buffers. Weights are meta; small integer tensors a layer computes while
  it is built (the expert map of expert parallelism, which the MoE loaders consult to
  skip other ranks' experts) are made on the CPU, so they hold their real values.
  Pieces are therefore in the coordinates of the *loader-visible*
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
* No pickle anywhere: in an engine, call by method name through :class:`WorkerExtension`
  (vLLM pickles a *callable* passed to a multiprocess engine's ``collective_rpc``, and
  refuses to unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: don't); the workers exchange
  their recordings as JSON bytes (:func:`_allgather_json`), never ``all_gather_object``.
* :class:`Destination` is one worker as a refit destination (global layouts from every TP
  rank's recording, bindings into receive buffers, loading through layerwise reload);
  :mod:`xreshard.adapters.vllm_backend` wraps it as vLLM's weight-transfer backend
  ``"xreshard"``, which :func:`register_backend` (a ``vllm.general_plugins`` entry point)
  registers. The probe machinery lives in :mod:`xreshard.adapters.vllm_record`.

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
from typing import Any, Iterable, Iterator, Mapping, Sequence

from xreshard.errors import LayoutError
from xreshard.layout import Layout, Mesh, Region, Split
from xreshard.refit import Bound

# _view_box stays importable from here (tests); the recorder lives in vllm_record
from .vllm_record import (Piece, Recording, RecordError, _dtype_str, _import_torch,  # noqa: F401
                          _import_vllm, _view_box, parts_from_full, record_model, shard_weight)

logger = logging.getLogger(__name__)

__all__ = [
    "Piece", "Recording", "RecordError", "layouts_from_pieces", "record_model",
    "record_from_config", "record_in_worker", "worker_record", "fake_tp", "build_model",
    "hf_tensor_specs", "make_vllm_config", "shard_weight", "parts_from_full",
    "reload_from_shards", "reprocess_tied", "WorkerExtension", "checkpoint_specs",
    "register_backend", "Destination", "weights_digest", "gemm_weight", "inplace_refusal",
    "INPLACE_ALLOWED",
]


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


def replicate_layout(layout: Layout, rank_lists: Sequence[Sequence[int]]) -> Layout:
    """``layout`` (over ranks 0..W-1 of one engine) held by every engine: rank r of engine
    e is ``rank_lists[e][r]``. Product form gains a major ``engine`` axis (kept as is for
    one engine); explicit form is the union of the engines' relabelled regions."""
    if layout.is_product:
        mesh = layout.mesh
        ranks = tuple(per[r] for per in rank_lists for r in mesh.ranks)
        if len(rank_lists) == 1:
            return Layout.product(layout.shape, layout.dtype,
                                  Mesh(mesh.shape, ranks, mesh.axis_names), layout.splits)
        names = None if mesh.axis_names is None else ("engine",) + mesh.axis_names
        return Layout.product(layout.shape, layout.dtype,
                              Mesh((len(rank_lists),) + mesh.shape, ranks, names),
                              [Split(sp.dim, sp.axis + 1, sp.split_factor) for sp in layout.splits])
    return Layout.explicit_form(layout.shape, layout.dtype, {
        per[r]: regions for per in rank_lists for r, regions in layout.explicit})


def _product_layout(shape: tuple[int, ...], dtype: Any, ranks: tuple[int, ...],
                    held: Mapping[int, tuple[Region, ...]]) -> Layout | None:
    """The product layout whose regions equal ``held`` exactly, or None.

    Ranks that hold nothing stay off the mesh (an expert under expert parallelism lives on
    one rank), so the layout is over the ranks that hold something.
    """
    ranks = tuple(r for r in ranks if held[r])
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


# ---------------------------------------------------------------------------- a worker as a destination

class Destination:
    """One vLLM worker as a refit destination: every worker's recording, the global
    layouts, and how to bind receive buffers and load them into the model.

    Built inside a worker by :meth:`record_in_engine` (the ``"xreshard"`` backend does); the
    layouts are keyed by world rank once :meth:`place` knows the workers' world ranks.

    Args:
        recordings: every worker's :class:`Recording`, in vLLM's rank order (stage-major,
            then TP rank: ``Recording.worker``).
        worker: this worker's index in ``recordings``.
        specs: HF name -> (shape, dtype) fed to the recorder.
    """

    def __init__(self, recordings: Sequence[Recording], worker: int,
                 specs: Mapping[str, tuple[Sequence[int], Any]]) -> None:
        self.recordings = list(recordings)
        self.rec = self.recordings[worker]
        self.shapes = {n: tuple(int(s) for s in shape) for n, (shape, _) in specs.items()}
        self.dtypes: dict[str, str] = {}
        for rec in self.recordings:
            for name, pieces in rec.pieces.items():
                if pieces and name not in self.dtypes:
                    self.dtypes[name] = rec.param_dtypes[pieces[0].param]
        self.names = [n for n in self.shapes if n in self.dtypes]
        self.unused = [n for n in self.shapes if n not in self.dtypes]
        self.layouts: dict[str, Layout] = {}
        self.rank = -1

    @classmethod
    def record_in_engine(cls, vllm_config: Any, specs: Mapping[str, Any] | None = None
                         ) -> Destination:
        """Record this worker's rank on a meta copy of the model and all-gather the
        recordings over the engine's workers (vLLM's world group, its gloo CPU group), so
        every worker builds the same global layouts. Collective over the workers.

        Args:
            vllm_config: the worker's config.
            specs: HF name -> [shape, dtype]; default :func:`checkpoint_specs` of the model
                directory, else :func:`hf_tensor_specs` of its HF config.
        """
        return cls(*_record_workers(vllm_config, specs))

    def place(self, ranks: Sequence[int], engine: int = 0) -> None:
        """Key the layouts by world rank: ``ranks[e * W + w]`` is worker w of engine e's
        world rank (W workers per engine; this worker belongs to engine ``engine``).

        Several engines are identical replicas (same model, same parallel config), so a
        tensor's layout over all of them is one engine's layout with a major ``engine``
        mesh axis: the planner then sends each byte once per engine, from balanced senders.
        An engine whose config differs describes different layouts, which the refit refuses.
        """
        n = len(self.recordings)
        if len(ranks) % n or not 0 <= engine < len(ranks) // n:
            raise RecordError(f"{len(ranks)} rollout ranks are not whole engines of {n} "
                              f"workers with engine {engine} among them")
        per_engine = [list(ranks[e * n:(e + 1) * n]) for e in range(len(ranks) // n)]
        one = layouts_from_pieces(
            dict(enumerate(self.recordings)), {m: self.shapes[m] for m in self.names},
            self.dtypes)
        self.layouts = {m: replicate_layout(lay, per_engine) for m, lay in one.items()}
        self.rank = per_engine[engine][self.rec.worker]

    def shard_bytes(self) -> int:
        """Bytes this rank's shards hold: what it must receive (padding excluded)."""
        from xreshard.dtypes import itemsize
        return sum(r.size * itemsize(lay.dtype) for lay in self.layouts.values()
                   for r in lay.regions(self.rank))

    def _touched(self, names: Iterable[str] | None = None) -> list[str]:
        """Parameters the pieces of ``names`` (default: every tensor) write on this rank."""
        names = self.names if names is None else names
        return sorted({p.param for n in names for p in self.rec.pieces.get(n, ())})

    # ------------------------------------------------------------ in place or reload

    def inplace_refusals(self, model: Any, device_type: str) -> list[str]:
        """Why the live parameters may not be written in place (empty: they may).

        An in-place write is right only where vLLM's ``process_weights_after_loading`` left
        the loader-visible parameters as the tensors the kernels read. That is decided per
        module from an allow-list (:data:`INPLACE_ALLOWED`), for every module of the model
        that processes weights after loading - not only those the refit writes: an MLA
        attention derives ``W_UK``/``W_UV`` from another module's ``kv_b_proj`` weight.
        Anything not on the list (FP8 and other quantized methods, whose block scales or
        transforms are derived at load time; FlashInfer/AITER MoE backends, which permute or
        shuffle ``w13``; CPU kernels, which prepack) is refused, naming the module.

        Args:
            model: the live (or a meta-built) vLLM model of this rank.
            device_type: ``"cuda"``, ``"cpu"``, ...: the platform the model runs on.
        """
        live = dict(model.named_parameters())
        out = []
        for name in self._touched():
            t = live.get(name)
            if t is None:
                out.append(f"parameter {name!r} is not a live parameter (vLLM replaced it "
                           "after loading)")
            elif tuple(t.shape) != tuple(self.rec.param_shapes[name]) or \
                    _dtype_str(t.dtype) != self.rec.param_dtypes[name] or not t.is_contiguous():
                out.append(f"parameter {name!r} is live as {tuple(t.shape)} {t.dtype} but "
                           f"loaded as {tuple(self.rec.param_shapes[name])} "
                           f"{self.rec.param_dtypes[name]} (processing changed it)")
        for mod_name, module in model.named_modules():
            why = inplace_refusal(module, device_type)
            if why:
                out.append(f"module {mod_name!r} ({type(module).__name__}): {why}")
        return out

    def fits_inplace(self, model: Any, device_type: str = "cuda") -> bool:
        """No :meth:`inplace_refusals`."""
        return not self.inplace_refusals(model, device_type)

    # ------------------------------------------------------------ groups

    def groups(self, budget_bytes: int) -> list[list[str]]:
        """The tensors in groups whose receive buffers (plus vLLM's processing of them) fit
        ``budget_bytes`` on every worker; one collective refit and one reload per group.

        Deterministic from the recordings (identical on every worker of every identical
        engine): tensors that write one vLLM module (q/k/v into ``qkv_proj``) are never
        split, since vLLM processes a module once all its parameters are loaded; modules
        come in vLLM's layerwise order (embeddings, layers, head). On a worker, a group
        costs the bytes of the loader-visible parameters it writes (its receive buffers)
        plus twice its largest module (vLLM materializes a module and builds its processed
        copy, e.g. a oneDNN-packed weight, next to it); the worst worker decides, and each
        group may cost half the budget: the other half is for the refit's staging, which
        holds at most one group's bytes and is kept from group to group. So a worker's
        extra memory stays under the budget. A module costing more is a group of its own
        (the budget cannot be kept; logged).
        """
        from vllm.distributed.weight_transfer.base import layerwise_groups

        from xreshard.dtypes import itemsize

        parent = {n: n for n in self.names}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        owner: dict[str, str] = {}
        for rec in self.recordings:
            for name in self.names:
                for p in rec.pieces.get(name, ()):
                    mod = p.param.rpartition(".")[0]
                    if mod in owner:
                        parent[find(name)] = find(owner[mod])
                    else:
                        owner[mod] = name
        order = [n for g in layerwise_groups(list(self.names)) for n in g]
        components: dict[str, list[str]] = {}
        for name in order:
            components.setdefault(find(name), []).append(name)

        def cost(names: Sequence[str]) -> int:
            worst = 0
            for rec in self.recordings:
                mods: dict[str, int] = {}
                params = {p.param for n in names for p in rec.pieces.get(n, ())}
                for param in params:
                    nbytes = math.prod(rec.param_shapes[param]) * itemsize(rec.param_dtypes[param])
                    mod = param.rpartition(".")[0]
                    mods[mod] = mods.get(mod, 0) + nbytes
                worst = max(worst, sum(mods.values()) + 2 * max(mods.values(), default=0))
            return worst

        cap = budget_bytes // 2
        out: list[list[str]] = []
        for comp in components.values():
            if out and cost(out[-1] + comp) <= cap:
                out[-1] = out[-1] + comp
                continue
            if cost(comp) > cap:
                logger.warning("xreshard: tensors %s need %d bytes to receive and process, over "
                               "half the streaming budget of %d bytes; they go as one group",
                               comp, cost(comp), budget_bytes)
            out.append(list(comp))
        return out

    # ------------------------------------------------------------ receiving

    def buffers(self, model: Any, inplace: bool, device: Any,
                names: Iterable[str] | None = None) -> dict[str, Any]:
        """Parameter name -> the tensor the pieces of ``names`` (default all) are written into."""
        if inplace:
            live = dict(model.named_parameters())
            return {name: live[name].data for name in self._touched(names)}
        torch = _import_torch()
        return {name: torch.zeros(self.rec.param_shapes[name],
                                  dtype=getattr(torch, self.rec.param_dtypes[name]),
                                  device=device) for name in self._touched(names)}

    @staticmethod
    def _view(buffers: Mapping[str, Any], piece: Piece) -> Any:
        t = buffers[piece.param][piece.param_slices]
        if tuple(t.shape) != piece.region.shape:
            try:
                t = t.view(piece.region.shape)
            except RuntimeError as e:
                raise RecordError(f"{piece}: the parameter slice cannot be viewed as the "
                                  f"region's shape {piece.region.shape} without a copy") from e
        return t

    def bind(self, buffers: Mapping[str, Any], errors: list[str],
             names: Iterable[str] | None = None) -> Bound:
        """The receive side of a refit of ``names`` (default all): every held region bound
        to its parameter slice."""
        from xreshard.adapters.torch import tensor_view

        names = self.names if names is None else list(names)
        bindings: dict[tuple[int, str], Any] = {}
        for name in names:
            lay = self.layouts[name]
            regions = lay.regions(self.rank)
            if not regions:
                continue
            first: dict[Any, Piece] = {}
            for p in self.rec.pieces[name]:
                first.setdefault(p.region, p)
            views = [tensor_view(self._view(buffers, first[r])) for r in regions]
            bindings[(self.rank, name)] = views[0] if lay.is_product else views
        return Bound({n: self.layouts[n] for n in names}, bindings, errors=errors)

    def load(self, model: Any, model_config: Any, buffers: Mapping[str, Any], inplace: bool,
             names: Iterable[str] | None = None) -> None:
        """Hand the received shards of ``names`` (default all) to vLLM (in place: copy the
        regions a rank holds twice)."""
        names = self.names if names is None else list(names)
        if inplace:
            for name in names:
                first: dict[Any, Piece] = {}
                for p in self.rec.pieces.get(name, ()):
                    if p.region in first:           # a region held twice: copy the received one
                        self._view(buffers, p).copy_(self._view(buffers, first[p.region]))
                    first.setdefault(p.region, p)
            return
        from vllm.distributed.weight_transfer.base import layerwise_groups

        weights = []
        for group in layerwise_groups(names):       # layer by layer bounds vLLM's buffering
            for name in group:
                parts, seen = [], set()
                for p in self.rec.pieces.get(name, ()):
                    if p.region not in seen:
                        seen.add(p.region)
                        parts.append((p.region, self._view(buffers, p)))
                if parts:
                    weights.append((name, shard_weight(name, self.shapes[name], parts)))
        modules = sorted({param.rpartition(".")[0] for param in self._touched(names)})
        reload_from_shards(model, model_config, weights, modules=modules)


#: (quant method or module class name) -> platforms where its processing after loading leaves
#: the loader-visible parameters as the tensors its kernels read (so an in-place write is
#: all a refit needs). Exact class names: a subclass may process differently.
INPLACE_ALLOWED: dict[str, frozenset[str]] = {
    # process_weights_after_loading is a no-op on CUDA (CPU prepacks, XPU may re-stride)
    "UnquantizedLinearMethod": frozenset({"cuda"}),
    "UnquantizedEmbeddingMethod": frozenset({"cuda"}),
    # plain attention processes only its kv-cache scales, which no checkpoint tensor of a
    # refit writes; MLA attention (refused) derives W_UK/W_UV from kv_b_proj
    "Attention": frozenset({"cuda", "cpu"}),
}

#: unquantized fused-MoE backends that use w13/w2 as loaded (vLLM's
#: convert_to_unquantized_kernel_format returns them unchanged)
INPLACE_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def inplace_refusal(module: Any, device_type: str) -> str | None:
    """Why writing ``module``'s loader-visible parameters in place would leave what its
    kernels read stale on ``device_type``; None when it would not (or it processes nothing).
    """
    quant_method = getattr(module, "quant_method", None)
    kind = type(quant_method).__name__ if quant_method is not None else None
    if kind == "UnquantizedFusedMoEMethod":
        backend = getattr(getattr(quant_method, "unquantized_backend", None), "name", None)
        if backend in INPLACE_MOE_BACKENDS and device_type == "cuda":
            return None
        return (f"UnquantizedFusedMoEMethod with backend {backend}: its processing converts "
                "w13/w2 to a kernel format (FlashInfer swaps or permutes w13, AITER shuffles, "
                "the CPU kernel prepacks) that an in-place write of loaded weights would break")
    if kind is not None:
        if device_type in INPLACE_ALLOWED.get(kind, ()):
            return None
        return (f"quant method {kind} is not known to leave loaded weights as its kernels "
                f"read them on {device_type} (quantized scales, prepacking or other tensors "
                "derived at load time would stay stale)")
    cls = type(module).__name__
    if callable(getattr(module, "process_weights_after_loading", None)) and \
            device_type not in INPLACE_ALLOWED.get(cls, ()):
        if "MLA" in cls:
            return ("MLA attention derives W_UK/W_UV from kv_b_proj's weight after loading; "
                    "an in-place write of kv_b_proj would leave them stale")
        return (f"{cls}.process_weights_after_loading is not known to leave the loaded "
                "weights as its kernels read them")
    return None


def _default_specs(vllm_config: Any) -> dict:
    """HF tensor specs of the served model: its safetensors headers, else its config."""
    try:
        return checkpoint_specs(vllm_config.model_config.model)
    except FileNotFoundError:
        return hf_tensor_specs(vllm_config.model_config.hf_config,
                               vllm_config.model_config.dtype)


def _record_workers(vllm_config: Any, specs: Mapping[str, Any] | None
                    ) -> tuple[list, int, dict]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if specs is None:
        specs = _default_specs(vllm_config)
    else:
        specs = {n: (tuple(s[0]), str(s[1])) for n, s in specs.items()}
    with set_current_vllm_config(vllm_config):
        rec = _record_here(build_model(vllm_config), specs)
    if rec.num_workers > 1:     # the world group of an engine without DP: its workers
        group = ps.get_world_group()
        if group.world_size != rec.num_workers:
            raise RecordError(f"vLLM's world group has {group.world_size} workers but "
                              f"pp x tp = {rec.num_workers}; data parallelism is not supported")
        dicts = _allgather_json(rec.to_dict(), group.cpu_group)
    else:
        dicts = [rec.to_dict()]
    recs = [Recording.from_dict(d) for d in dicts]
    if [r.worker for r in recs] != list(range(rec.num_workers)):
        raise RecordError("the all-gather of recordings returned workers "
                          f"{[r.worker for r in recs]}, not 0..{rec.num_workers - 1}")
    return recs, rec.worker, specs


def _allgather_json(obj: Any, group: Any) -> list[Any]:
    """Every member's ``obj`` over a torch process group (vLLM's gloo CPU group), as JSON
    bytes in uint8 tensors - ``all_gather_object`` would pickle. Two all-gathers: the
    lengths, then the bytes padded to the longest."""
    torch = _import_torch()
    dist = torch.distributed
    data = torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()),
                            dtype=torch.uint8)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(b[:int(s)].numpy())) for b, s in zip(out, sizes)]


def _record_here(model: Any, specs: Mapping[str, Any]) -> Recording:
    """Record ``model`` as this process's TP rank and pipeline stage."""
    from vllm.distributed import parallel_state as ps

    return record_model(model, specs, tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(),
                        pp_rank=ps.get_pp_group().rank_in_group,
                        pp_size=ps.get_pp_group().world_size)


# ---------------------------------------------------------------------------- reloading

def reload_from_shards(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]], *,
                       modules: Iterable[str] | None = None) -> None:
    """Replace a live model's weights through vLLM's layerwise reload.

    ``initialize_layerwise_reload`` -> ``model.load_weights(weights)`` ->
    ``finalize_layerwise_reload``: vLLM re-runs its loaders and
    ``process_weights_after_loading`` per layer and copies the result into the existing
    kernel tensors (CUDA graphs stay valid), then :func:`reprocess_tied`. ``weights`` may
    mix full tensors and :func:`shard_weight` stand-ins; feed them layer by layer to bound
    vLLM's buffering.

    Args:
        modules: reload only these modules (names in ``model``), which ``weights`` load
            completely: the others keep their tensors untouched (a streamed refit reloads a
            group at a time; reloading the whole model per group would put every other
            layer back with a warning). None: the whole model.
    """
    _import_vllm()
    torch = _import_torch()
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    scope = model
    if modules is not None:
        modules = list(modules)
        scope = torch.nn.ModuleList([model.get_submodule(m) for m in modules])
    initialize_layerwise_reload(scope)
    model.load_weights(weights)
    finalize_layerwise_reload(scope, model_config)
    reprocess_tied(model, modules)


def reprocess_tied(model: Any, modules: Iterable[str] | None = None) -> list[str]:
    """Re-run ``process_weights_after_loading`` on modules that share a tied parameter.

    Layerwise reload processes a tied parameter only through the first module that owns it
    (vLLM's documented limitation 2); on CPU the tied ``lm_head`` keeps a prepacked copy of
    the old embedding and keeps producing the old logits. Returns the modules re-processed.

    Args:
        modules: only parameters owned by these modules were reloaded (default: all).
    """
    only = None if modules is None else set(modules)
    owners: dict[int, list[tuple[str, Any]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, module))
    done = []
    for mods in owners.values():
        if only is not None and mods[0][0] not in only:
            continue
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


@functools.cache
def _meta_weights_class() -> type:
    from torch.utils._device import DeviceContext, _device_constructors

    class MetaWeights(DeviceContext):
        """``torch.device("meta")``, except small integer tensors are made on the CPU.

        Weights stay storage-less; index tables a layer computes from its configuration
        (the expert map of expert parallelism: which global expert lives where) get real
        values, so the loaders that consult them run as in the engine.
        """

        def __init__(self) -> None:
            super().__init__("meta")

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in _device_constructors() or kwargs.get("device") is not None:
                return func(*args, **kwargs)
            out = func(*args, **{**kwargs, "device": self.device})
            if not out.dtype.is_floating_point and not out.dtype.is_complex \
                    and out.numel() <= _INDEX_TABLE_LIMIT:
                out = func(*args, **{**kwargs, "device": "cpu"})
            return out

    return MetaWeights


_INDEX_TABLE_LIMIT = 1 << 20    # elements: larger integer tensors are weights (packed, quantized)


def _MetaWeights() -> Any:
    return _meta_weights_class()()


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
    place = _MetaWeights() if torch.device(device).type == "meta" else torch.device(device)
    try:
        with set_default_torch_dtype(vllm_config.model_config.dtype), place:
            return initialize_model(vllm_config=vllm_config)
    finally:
        cc.static_forward_context, cc.static_all_moe_layers = saved
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(saved_ropes)


def make_vllm_config(model: str | Any, *, dtype: str = "bfloat16", tp_size: int = 1,
                     enable_expert_parallel: bool = False) -> Any:
    """A ``VllmConfig`` for a local model directory (config.json only) or a HF config object.

    A config object is written to a fresh temporary directory; nothing is downloaded.
    ``enable_expert_parallel`` is vLLM's flag: MoE experts are then split over the TP ranks
    whole (expert e on rank ``e // (num_experts / tp)`` by vLLM's default linear placement)
    instead of each expert being tensor-parallel.
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
                      parallel_config=ParallelConfig(
                          tensor_parallel_size=tp_size,
                          enable_expert_parallel=enable_expert_parallel))


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
    vllm_config = worker.vllm_config
    if specs is None:
        specs = _default_specs(vllm_config)
    return _record_here(build_model(vllm_config), specs)


def worker_record(worker: Any, specs: Mapping[str, Sequence] | None = None) -> dict:
    """What ``WorkerExtension.xreshard_record`` runs: ``llm.collective_rpc("xreshard_record",
    args=(specs,))``. (Passing this function itself to ``collective_rpc`` works only in an
    in-process engine: a multiprocess one would pickle it.)

    ``specs`` is JSON-like (``{name: [shape, dtype_name]}``) since tensors do not survive
    the RPC; returns ``Recording.to_dict()`` plus ``"rank"``, the worker's global rank.
    """
    torch = _import_torch()
    parsed = None if specs is None else {n: (tuple(s[0]), str(s[1])) for n, s in specs.items()}
    out = record_in_worker(worker, parsed).to_dict()
    out["rank"] = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return out


def weights_digest(model: Any) -> dict[str, str]:
    """Name -> sha256 of each tensor of ``model.state_dict()`` *as the model computes with it*.

    On CPU, vLLM's ``process_weights_after_loading`` may hand a linear layer's weight to a
    prepacked kernel and leave the parameter empty or stale; hashing the state dict then
    says nothing about the weights in use. Which path a layer takes depends on the CPU
    (vLLM 0.32, ``dispatch_cpu_unquantized_gemm``):

    ==========================  ====================================  ==================
    CPU / dtype                 kernel (``layer.cpu_linear``)          ``layer.weight``
    ==========================  ====================================  ==================
    AMX, bf16/fp16, small       sgl ``weight_packed_linear`` (copy)   ``empty(0)``
    x86 with oneDNN (AVX-512,   ``onednn_mm`` on a oneDNN-packed      ``empty(0)``
    or AVX2 where oneDNN
    accepts the dtype)          copy
    oneDNN refuses (e.g. bf16   ``F.linear`` on the parameter         kept
    on AVX2), other arches
    zen CPUs (zentorch)         ``zentorch_linear_unary``             ``empty(0)``
    embeddings / LM head        as above, ``remove_weight=False``     kept (lookup)
    MoE ``w13``/``w2``          ``cpu_fused_moe`` on the parameter,   replaced by its
                                repacked by ``prepack_moe_weight``    prepacked bytes
    ==========================  ====================================  ==================

    So for every ``weight`` of a module that has ``cpu_linear``, the weight the kernel
    multiplies with is read back through the kernel itself (:func:`gemm_weight`: the
    layer applied to the identity, exact in every dtype); the digest is that of those
    bytes when the parameter is empty or holds the same bytes, and of both otherwise (a
    lookup table and a stale prepacked copy - a tied head reload forgot - differ). It is
    therefore the same on every CPU path: ``sha256`` of the loaded weight. Other tensors
    (norms, biases, MoE weights, whose replacement *is* what the kernel reads) are hashed
    as they are.
    """
    import hashlib

    torch = _import_torch()
    modules = dict(model.named_modules(remove_duplicate=False))
    out = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            mod_name, _, leaf = name.rpartition(".")
            module = modules.get(mod_name)
            raw = _bytes_of(t)
            if leaf == "weight" and callable(getattr(module, "cpu_linear", None)):
                used = _bytes_of(gemm_weight(module))
                raw = used if t.numel() == 0 or raw == used else raw + b"|gemm|" + used
            out[name] = hashlib.sha256(raw).hexdigest()
    return out


def _bytes_of(t: Any) -> bytes:
    torch = _import_torch()
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def gemm_weight(module: Any, *, rows: int = 1024) -> Any:
    """The ``[out, in]`` weight a CPU-dispatched vLLM layer multiplies with, read back
    through its own kernel: ``cpu_linear(I, weight, None)`` is ``W.T`` (each output is one
    weight times 1 plus zeros, exact in fp32/bf16/fp16). Works whether the kernel holds a
    prepacked copy (oneDNN, sgl, zentorch: the parameter is then empty) or multiplies the
    parameter itself. ``rows`` bounds the identity block fed at once.
    """
    torch = _import_torch()
    weight = module.weight
    if weight.ndim == 2 and weight.numel():
        k = weight.shape[1]
    else:
        # the input size on this rank (a row-parallel layer's input_size is the global one)
        k = next((getattr(module, a) for a in ("input_size_per_partition", "embedding_dim",
                                                "input_size") if getattr(module, a, None)), None)
        if not k:
            raise RecordError(f"{type(module).__name__}: its weight was replaced by a prepacked "
                              "kernel and the module names no input size "
                              "(input_size_per_partition, embedding_dim, input_size) to read it back")
    cols = []
    for a in range(0, int(k), rows):
        b = min(int(k), a + rows)
        eye = torch.zeros(b - a, int(k), dtype=weight.dtype, device=weight.device)
        eye[:, a:b] = torch.eye(b - a, dtype=weight.dtype, device=weight.device)
        cols.append(module.cpu_linear(eye, weight, None))
    return torch.cat(cols).t().contiguous()


class WorkerExtension:
    """vLLM worker extension: ``LLM(..., worker_extension_cls=
    "xreshard.adapters.vllm.WorkerExtension")`` then
    ``llm.collective_rpc("xreshard_record", args=(specs,))``.

    A method name, unlike a callable, crosses a multiprocess engine's RPC without
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """

    def xreshard_record(self, specs: Mapping[str, Sequence] | None = None) -> dict:
        return worker_record(self, specs)

    def xreshard_transfer_report(self) -> dict:
        """The ``"xreshard"`` weight-transfer backend's last round on this worker: bytes
        received, this rank's shard bytes, version (see ``XreshardWeightTransferEngine``)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "report"):
            raise RuntimeError("this engine does not run the 'xreshard' weight-transfer backend; "
                               "pass weight_transfer_config={'backend': 'xreshard'}")
        return engine.report()

    def xreshard_weights_digest(self) -> dict[str, str]:
        """sha256 of every tensor in the live model's state dict (parameters and persistent
        buffers, as processed after loading; a linear weight as its prepacked CPU kernel
        holds it, see :func:`weights_digest`), by name: compare two engines' weights, or one
        engine's weights after a refit and after ``reload_weights``, bit for bit."""
        return weights_digest(self.model_runner.get_model())

    def xreshard_reprocess_tied(self) -> list[str]:
        """Re-process tied modules after vLLM's own ``reload_weights`` (see
        :func:`reprocess_tied`); returns the modules re-processed."""
        return reprocess_tied(self.model_runner.get_model())


# ---------------------------------------------------------------------------- the plugin

BACKEND = "xreshard"


def register_backend() -> None:
    """vLLM general plugin: register the ``"xreshard"`` weight-transfer backend.

    The entry point ``[project.entry-points."vllm.general_plugins"] xreshard =
    "xreshard.adapters.vllm:register_backend"`` makes vLLM call it in every process it
    starts (front end, engine core, workers). It registers the worker and trainer engines
    of :mod:`xreshard.adapters.vllm_backend` by module path, so nothing is imported until
    a backend is created; calling it twice is harmless. A trainer process that never
    builds a vLLM engine calls it itself before ``WeightTransferTrainerFactory.trainer_init``
    (or uses ``XreshardTrainerWeightTransferEngine.trainer_init`` directly).
    """
    _import_vllm()
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    module = "xreshard.adapters.vllm_backend"
    for factory, cls in ((WeightTransferEngineFactory, "XreshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "XreshardTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:      # already registered (plugins may load more than once)
            pass
