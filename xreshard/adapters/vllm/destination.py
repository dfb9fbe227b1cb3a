"""One vLLM engine as a refit destination: its workers' recordings as global layouts.

:class:`EngineRecording` is what every worker of an engine recorded (identical on every
worker); it decides what a worker can know before it joins a world: which HF tensors some
rank loads, whether the live parameters may be written in place
(:meth:`~EngineRecording.inplace_refusals`, from :data:`INPLACE_ALLOWED`) and the groups
of a streamed refit (:meth:`~EngineRecording.groups`). :meth:`Destination.place` puts it on
the world ranks of one or more identical engines: the resulting :class:`Destination` has
every tensor's layout (:func:`layouts_from_pieces`, :func:`replicate_layout`) and its
worker's world rank, binds receive buffers and loads them into the model.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping, Sequence

from xreshard.errors import LayoutError
from xreshard.ir.formats import FormatError
from xreshard.ir.layout import Layout, Mesh, Region, Split
from xreshard.runtime.binding import Bound

from .build import record_workers
from .quantized import SCRATCH, online_quantization
from .record import Piece, RecordError, Recording, dtype_str, import_torch, shard_weight
from .reload import reload_from_shards

logger = logging.getLogger(__name__)

__all__ = ["layouts_from_pieces", "replicate_layout", "EngineRecording", "Destination",
           "INPLACE_ALLOWED", "INPLACE_MOE_BACKENDS", "inplace_refusal"]


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
    explicit = layout.explicit
    if explicit is None:
        mesh = layout.mesh
        assert mesh is not None                     # product form
        ranks = tuple(per[r] for per in rank_lists for r in mesh.ranks)
        if len(rank_lists) == 1:
            return Layout.product(layout.shape, layout.dtype,
                                  Mesh(mesh.shape, ranks, mesh.axis_names), layout.splits)
        names = None if mesh.axis_names is None else ("engine",) + mesh.axis_names
        return Layout.product(layout.shape, layout.dtype,
                              Mesh((len(rank_lists),) + mesh.shape, ranks, names),
                              [Split(sp.dim, sp.axis + 1, sp.split_factor) for sp in layout.splits])
    return Layout.explicit_form(layout.shape, layout.dtype, {
        per[r]: regions for per in rank_lists for r, regions in explicit})


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

# ---------------------------------------------------------------------------- an engine's recording

class EngineRecording:
    """What every worker of one vLLM engine recorded, seen from one worker.

    Deterministic from the recordings, so identical on every worker of every identical
    engine; all a worker needs before it knows its world rank.

    Args:
        recordings: every worker's :class:`Recording`, in vLLM's rank order (stage-major,
            then TP rank: ``Recording.worker``).
        worker: this worker's index in ``recordings``.
        specs: HF name -> (shape, dtype) fed to the recorder.
        quantize_online: an online-FP8 engine (``fp8_per_block``, ``mxfp8``) receives codes
            and scales quantized on the way, written into its live parameters
            (:class:`~.quantized.OnlineQuantization`); False: bf16, and vLLM's reload
            quantizes them itself.

    Attributes:
        rec: this worker's recording (as rewritten by ``online``); ``recorded``: the
            workers' recordings as recorded.
        online: the engine's :class:`~.quantized.OnlineQuantization`, or None.
        names: the HF tensors some worker loads; ``unused``: those none does.
        shapes, dtypes: HF name -> global shape, and the dtype its parameter loads.
        quantized: HF name -> :class:`~xreshard.ir.formats.QuantizedTensor` for the HF
            weights a block-FP8 checkpoint engine stores quantized (each with its scale
            tensor, itself an HF tensor of ``names``), and for an online engine the HF
            weights sent quantized on its parameters' grids (their scale tensors added to
            ``names``); checked against the layouts here.
        quantized_params: this worker's parameters vLLM's online ``fp8_per_block`` or
            ``mxfp8`` quantizes after loading (their grid is the local parameter's).

    Raises:
        FormatError: a worker holds part of a block of a quantized tensor, or scales that
            are not those of the blocks it holds (vLLM's mismatch allowance for merged
            layers), naming the tensor - on every worker alike, before any byte moves.
    """

    def __init__(self, recordings: Sequence[Recording], worker: int,
                 specs: Mapping[str, tuple[Sequence[int], Any]], *,
                 quantize_online: bool = True) -> None:
        self.recorded, self.specs = list(recordings), dict(specs)
        if not 0 <= worker < len(self.recorded):
            raise RecordError(f"worker {worker} is not among the {len(self.recorded)} "
                              "recordings")
        self.worker = worker
        self.shapes = {n: tuple(int(s) for s in shape) for n, (shape, _) in specs.items()}
        self.online = online_quantization(self.recorded, self.shapes) if quantize_online \
            else None
        self.recordings = self.recorded if self.online is None else self.online.recordings
        if self.online is not None:
            self.shapes.update(self.online.shapes)
        self.rec = self.recordings[worker]
        self.dtypes: dict[str, str] = {}
        for rec in self.recordings:
            for name, pieces in rec.pieces.items():
                if pieces and name not in self.dtypes:
                    self.dtypes[name] = rec.param_dtypes[pieces[0].param]
        self.names = [n for n in self.shapes if n in self.dtypes]
        self.unused = [n for n in self.shapes if n not in self.dtypes]
        self.quantized = {q.name: q for rec in self.recordings for q in rec.quantized}
        if self.online is not None:
            self.quantized.update(self.online.tensors)
        self.quantized_params = list(self.rec.quantized_params)
        self._check_quantized()

    def without_online(self) -> EngineRecording:
        """This recording with the online-quantized parameters filled in bf16 (vLLM's
        layerwise reload quantizes them itself): for engines whose FP8 kernels
        post-process the quantized weights (:func:`~.quantized.online_refusals`)."""
        return EngineRecording(self.recorded, self.worker, self.specs, quantize_online=False)

    def online_modules(self) -> set[str]:
        """This worker's modules whose online-quantized weights the refit writes in place
        (codes and scales, and anything else of theirs the trainer sends, e.g. a bias)."""
        if self.online is None:
            return set()
        return {q.name.rpartition(".")[0] for q in self.online.params[self.worker].values()}

    def is_online(self, param: str) -> bool:
        """Whether ``param`` (or a scratch copy, :data:`~.quantized.SCRATCH`) belongs to one
        of :meth:`online_modules`."""
        return self.online is not None and \
            param.removesuffix(SCRATCH).rpartition(".")[0] in self.online_modules()

    def _check_quantized(self) -> None:
        """Every worker holds whole blocks of each quantized tensor and their own scales."""
        if not self.quantized:
            return
        names = {n for q in self.quantized.values() for n in (q.name, q.scale)}
        missing = sorted(n for n in names if n not in self.dtypes)
        if missing:
            raise FormatError(f"quantized tensors {missing[:4]} are loaded by no worker; the "
                              "recording needs each quantized weight and its scale tensor")
        layouts = layouts_from_pieces(
            {w: {n: rec.pieces.get(n, []) for n in names} for w, rec in enumerate(self.recordings)},
            {n: self.shapes[n] for n in names}, {n: self.dtypes[n] for n in names})
        for q in self.quantized.values():
            q.check_layouts(layouts[q.name], layouts[q.scale])

    @classmethod
    def record_in_engine(cls, vllm_config: Any, specs: Mapping[str, Any] | None = None
                         ) -> EngineRecording:
        """Record this worker's rank on a meta copy of the model and all-gather the
        recordings over the engine's workers (:func:`~.build.record_workers`), so every
        worker sees the same. Collective over the workers."""
        return cls(*record_workers(vllm_config, specs))

    def scale_names(self) -> set[str]:
        """The scale tensors of the quantized HF weights: a trainer offering the weights'
        values has them quantized on the way, and never offers these."""
        return {q.scale for q in self.quantized.values()}

    def with_scales(self, names: Iterable[str]) -> list[str]:
        """``names`` plus the scale tensor of each quantized one among them."""
        names = list(names)
        return names + [self.quantized[n].scale for n in names if n in self.quantized
                        and self.quantized[n].scale not in names]

    def offered_groups(self, budget_bytes: int) -> list[list[str]]:
        """:meth:`groups` as a trainer offers them: without the scale tensors."""
        scales = self.scale_names()
        groups = [[n for n in g if n not in scales] for g in self.groups(budget_bytes)]
        return [g for g in groups if g]

    def touched(self, names: Iterable[str] | None = None) -> list[str]:
        """Parameters the pieces of ``names`` (default: every tensor) write on this worker."""
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
        online = self.online_modules()
        for name in self.touched():
            if self.is_online(name):
                continue            # written in place by design (Destination.buffers)
            t = live.get(name)
            if t is None:
                out.append(f"parameter {name!r} is not a live parameter (vLLM replaced it "
                           "after loading)")
            elif tuple(t.shape) != tuple(self.rec.param_shapes[name]) or \
                    dtype_str(t.dtype) != self.rec.param_dtypes[name] or not t.is_contiguous():
                out.append(f"parameter {name!r} is live as {tuple(t.shape)} {t.dtype} but "
                           f"loaded as {tuple(self.rec.param_shapes[name])} "
                           f"{self.rec.param_dtypes[name]} (processing changed it)")
        for mod_name, module in model.named_modules():
            why = None if mod_name in online else inplace_refusal(module, device_type)
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


# ---------------------------------------------------------------------------- destination

class Destination:
    """One vLLM worker as a refit destination: the engine's recording placed on world ranks
    (every tensor's layout, this worker's rank); binds receive buffers and loads them into
    the model. Build it with :meth:`place`.

    Args:
        recording: the engine's :class:`EngineRecording`.
        layouts: HF name -> layout over world ranks, for every name of ``recording``.
        rank: this worker's world rank.
    """

    def __init__(self, recording: EngineRecording, layouts: Mapping[str, Layout],
                 rank: int) -> None:
        missing = [n for n in recording.names if n not in layouts]
        if missing:
            raise RecordError(f"no layout for {missing[:5]} ({len(missing)} tensors) that "
                              "the recording loads; build a Destination with place()")
        self.recording, self.layouts, self.rank = recording, dict(layouts), int(rank)
        self.rec, self.names, self.shapes = recording.rec, recording.names, recording.shapes

    @classmethod
    def place(cls, recording: EngineRecording, ranks: Sequence[int], engine: int = 0
              ) -> Destination:
        """The destination of ``recording``'s worker in engine ``engine``, with layouts keyed
        by world rank: ``ranks[e * W + w]`` is worker w of engine e (W workers per engine).

        Several engines are identical replicas (same model, same parallel config), so a
        tensor's layout over all of them is one engine's layout with a major ``engine``
        mesh axis: the planner then sends each byte once per engine, from balanced senders.
        An engine whose config differs describes different layouts, which the refit refuses.

        Raises:
            RecordError: ``ranks`` are not whole engines, or ``engine`` is not among them.
        """
        n = len(recording.recordings)
        if len(ranks) % n or not 0 <= engine < len(ranks) // n:
            raise RecordError(f"{len(ranks)} rollout ranks are not whole engines of {n} "
                              f"workers with engine {engine} among them")
        per_engine = [list(ranks[e * n:(e + 1) * n]) for e in range(len(ranks) // n)]
        one = layouts_from_pieces(
            dict(enumerate(recording.recordings)),
            {m: recording.shapes[m] for m in recording.names}, recording.dtypes)
        return cls(recording, {m: replicate_layout(lay, per_engine) for m, lay in one.items()},
                   per_engine[engine][recording.worker])

    def with_scales(self, names: Iterable[str]) -> list[str]:
        """``names`` plus the scale tensors of the quantized ones among them (a group's
        receive side: the trainer offers the weights' values, never their scales)."""
        return self.recording.with_scales(names)

    def shard_bytes(self) -> int:
        """Bytes this rank's shards hold: what it must receive (padding excluded)."""
        from xreshard.dtypes import itemsize
        return sum(r.size * itemsize(lay.dtype) for lay in self.layouts.values()
                   for r in lay.regions(self.rank))

    # ------------------------------------------------------------ receiving

    def buffers(self, model: Any, inplace: bool, device: Any,
                names: Iterable[str] | None = None) -> dict[str, Any]:
        """Parameter name -> the tensor the pieces of ``names`` (default all) are written
        into: views of the live parameters in place, else fresh buffers; the parameters of
        online-quantized modules always in place (codes and scales as vLLM's online method
        keeps them), their scratch copies always fresh.

        Raises:
            RecordError: a live online-quantized parameter is not what the recording says
                (vLLM's post-processing changed its shape or dtype), naming it.
        """
        torch = import_torch()
        live = dict(model.named_parameters())
        out = {}
        for name in self.recording.touched(names):
            if (inplace or self.recording.is_online(name)) and not name.endswith(SCRATCH):
                t = live.get(name)
                shape, dtype = tuple(self.rec.param_shapes[name]), self.rec.param_dtypes[name]
                if t is not None and t.is_meta:
                    raise RecordError(
                        f"parameter {name!r} is still on the meta device: vLLM never "
                        "materialized and quantized its layer (seen with vLLM 0.32's online "
                        "methods when a fused layer's bias loads before its weights); load "
                        "the engine's weights so that vLLM quantizes every layer first")
                if t is None or tuple(t.shape) != shape or dtype_str(t.dtype) != dtype:
                    raise RecordError(
                        f"parameter {name!r} is live as "
                        f"{None if t is None else (tuple(t.shape), dtype_str(t.dtype))} but "
                        f"the recording writes {shape} {dtype} there in place")
                out[name] = t.data
                continue
            out[name] = torch.zeros(self.rec.param_shapes[name],
                                    dtype=getattr(torch, self.rec.param_dtypes[name]),
                                    device=device)
        return out

    def _copy_twice_held(self, buffers: Mapping[str, Any], names: Iterable[str],
                         which: Any) -> None:
        """In place: copy the received region into every other parameter slice of this
        rank that holds it too (parameters ``which(param)`` says)."""
        for name in names:
            first: dict[Any, Piece] = {}
            for p in self.rec.pieces.get(name, ()):
                if not which(p.param):
                    continue
                if p.region in first:
                    self._view(buffers, p).copy_(self._view(buffers, first[p.region]))
                first.setdefault(p.region, p)

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
        quantized = {n: self.recording.quantized[n] for n in names
                     if n in self.recording.quantized}
        return Bound({n: self.layouts[n] for n in names}, bindings, errors=errors,
                     quantized=quantized)

    def load(self, model: Any, model_config: Any, buffers: Mapping[str, Any], inplace: bool,
             names: Iterable[str] | None = None) -> None:
        """Hand the received shards of ``names`` (default all) to vLLM (in place: copy the
        regions a rank holds twice)."""
        names = self.names if names is None else list(names)
        if self.recording.online is not None:
            # online-quantized modules: written in place, their split blocks quantized here
            self._copy_twice_held(buffers, names, self.recording.is_online)
            self.recording.online.finish(self.recording.worker, buffers, names)
            names = [n for n in names if not all(
                self.recording.is_online(p.param) for p in self.rec.pieces.get(n, ()))]
        if inplace:
            self._copy_twice_held(buffers, names, lambda param: True)
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
        modules = sorted({param.rpartition(".")[0] for param in self.recording.touched(names)})
        reload_from_shards(model, model_config, weights, modules=modules)


# ---------------------------------------------------------------------------- in place or not

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
