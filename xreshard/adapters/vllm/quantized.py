"""FP8 vLLM engines: which tensors they store quantized, in what format, and where.

vLLM 0.32 serves block FP8 three ways, each read here from the engine's own model (the
quant method vLLM chose for every layer, never a name pattern: a substring match once
left ``gate_up_proj`` in bf16, verl#7519):

========================  ==================================  ==================================
kind (``quant_method``)   what vLLM's loaders receive          the quantized tensors
========================  ==================================  ==================================
checkpoint: ``fp8`` with  ``X.weight`` e4m3 and               each HF ``X.weight``, its scales
``weight_block_size``     ``X.weight_scale_inv`` float32 per   ``X.weight_scale_inv``; block grid
(DeepSeek, Kimi)          HF tensor (``Fp8LinearMethod``,     anchored at the HF tensor (a
                          ``Fp8MoEMethod``)                    checkpoint is quantized globally)
online ``fp8_per_block``  bf16 ``X.weight``; vLLM quantizes   each *parameter* of each rank
                          the TP-local parameter after        (``qkv_proj.weight``: q, k, v rows
                          loading (``per_block_cast_to_fp8``)  together; ``w13_weight`` per
                                                               expert), scales ``*_scale_inv``
online ``mxfp8``          bf16; ``mxfp8_e4m3_quantize`` of    the same, scales ``*_weight_scale``
                          each TP-local parameter             (uint8, ``[..., K / 32]``)
========================  ==================================  ==================================

A refit sends every kind what it stores: codes and scales, quantized on the way. For the
online kinds the quantized unit is the TP-local parameter, not an HF tensor:
:class:`OnlineQuantization` turns each HF tensor whose pieces are whole blocks of the
parameter's grid into a :class:`QuantizedTensor` of its own (scales ``X.weight_scale_inv``
/ ``X.weight_scale`` placed in the parameter's scale rows) and sends the others bf16 into
a scratch copy, from which the worker quantizes the blocks they touch; codes and scales
are written into the live parameters in place (:func:`online_refusals` says where a
kernel forbids it).

The recorder (:mod:`.record`) learns where every HF tensor lands, scales included
(``weight_scale_inv`` is an HF tensor of a checkpoint like any other); :func:`quantized_of`
adds what is stored quantized (:class:`~xreshard.ir.formats.QuantizedTensor`), which
:class:`~.destination.EngineRecording` checks against the layouts (every rank holds whole
blocks and their own scales) before any byte moves.

After loading, vLLM's ``process_weights_after_loading`` turns checkpoint-format tensors
into what its kernels read (the hook a refit must run, not redo): on CUDA with DeepGEMM
and ``VLLM_USE_DEEP_GEMM_E8M0`` a requantization to power-of-two scales and a scale
layout transform (``deepgemm_post_process_fp8_weight_block``); CUTLASS/Triton keep the
tensors; on ROCm ``normalize_e4m3fn_to_e4m3fnuz``; on an AMX CPU VNNI prepacking
(``CPUFp8BlockScaledMMKernel``: ``convert_weight_packed``); MoE backends their own
shuffles (``convert_to_fp8_moe_kernel_format``). For the online methods the quantization
itself is part of that hook, then the kernel's (``quant_method.fp8_linear`` /
``.kernel``) ``process_weights_after_loading``.

Decision record: kernels this platform lacks. vLLM chooses a GEMM kernel while it
*builds* a quantized layer (``init_fp8_linear_kernel`` in ``create_weights``) and
refuses to build when none fits; on a CPU without AMX (``torch.cpu.
_is_amx_tile_supported()``) every FP8 layer is refused, so no FP8 model - and no engine -
can be built here at all: ``LLM(...)`` of a block-FP8 checkpoint, or with
``quantization="fp8_per_block"``, fails in the worker with "Failed to find a kernel that
can implement the ScaledMM linear layer" (``CPUFp8W8A8BlockScaledMMKernel`` and
``CPUFp8BlockScaledMMKernel`` "require AMX tile support"), with ``"mxfp8"`` "... the
MXFP8 linear layer"; MoE layers get the FP8 backend ``NONE`` (MXFP8 MoE: ``EMULATION``).
:func:`kernel_stand_ins` lets vLLM choose as usual and, only
where it finds no kernel, hands the layer :class:`KernelStandIn`: its post-processing
leaves the tensors as vLLM's loaders (and online quantization) wrote them, and its GEMM
raises. Parameters, loaders, online quantization and the block-shape checks stay vLLM's.
Recording needs no kernel (it never runs one), and a trainer must be able to record the
layout of a GPU engine from its config on any machine; tests use it to load FP8 models
through vLLM's own loaders on this CPU. Rejected: pretending AMX is present (vLLM would
then also pick AMX kernels for the unquantized layers and prepack them).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping, Sequence

from xreshard.ir.formats import BlockFP8, FormatError, MXFP8, QuantizedTensor

from .record import Piece, Recording, import_vllm

logger = logging.getLogger(__name__)

__all__ = ["KernelStandIn", "kernel_stand_ins", "engine_formats", "quantized_of",
           "checkpoint_specs_fp8", "refusal_as_format_error", "scale_fmt_ue8m0",
           "CHECKPOINT", "ONLINE", "OnlineQuantization", "online_quantization",
           "online_refusals", "SCRATCH"]

CHECKPOINT, ONLINE = "checkpoint", "online"

#: quant method class -> (kind, the weight params it quantizes -> their scale params)
_METHODS: dict[str, tuple[str, dict[str, str]]] = {
    "Fp8LinearMethod": (CHECKPOINT, {"weight": "weight_scale_inv"}),
    "Fp8MoEMethod": (CHECKPOINT, {"w13_weight": "w13_weight_scale_inv",
                                  "w2_weight": "w2_weight_scale_inv"}),
    "Fp8PerBlockOnlineLinearMethod": (ONLINE, {"weight": "weight_scale_inv"}),
    "Fp8PerBlockOnlineMoEMethod": (ONLINE, {"w13_weight": "w13_weight_scale_inv",
                                            "w2_weight": "w2_weight_scale_inv"}),
    "Mxfp8OnlineLinearMethod": (ONLINE, {"weight": "weight_scale"}),
    "Mxfp8OnlineMoEMethod": (ONLINE, {"w13_weight": "w13_weight_scale",
                                      "w2_weight": "w2_weight_scale"}),
}


# ---------------------------------------------------------------------------- kernels

class KernelStandIn:
    """Stands in for an FP8 GEMM kernel vLLM finds none of on this platform.

    Post-processing is the identity (the loaded checkpoint-format tensors stay as they
    are); running the layer raises. Only :func:`kernel_stand_ins` hands it out.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def process_weights_after_loading(self, layer: Any) -> None:
        """Leave the loaded tensors as they are (no kernel layout to convert to)."""

    def apply_weights(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{getattr(layer, 'prefix', type(layer).__name__)}: this "
                           "platform has no FP8 GEMM kernel (vLLM's CPU kernels need AMX); "
                           "xreshard stood in for it to load weights, not to run the model")


@contextlib.contextmanager
def kernel_stand_ins() -> Iterator[None]:
    """Let vLLM build and load FP8 layers where it has no FP8 kernel (module docstring).

    Wraps vLLM's linear kernel choosers (``choose_scaled_mm_linear_kernel``, the MXFP8
    ``init_mxfp8_linear_kernel``): the real choice when there is one, else
    :class:`KernelStandIn`. For MoE, where vLLM selects the backend ``NONE`` (no experts
    class), the experts class, the kernel format conversion
    (``convert_to_fp8_moe_kernel_format``: the tensors are kept) and the kernel
    (``make_fp8_moe_kernel``) are stood in for. Restores all on exit. Active while a model
    is built (:func:`~.build.build_model`) and must be while an online-quantized model
    loads (vLLM then runs the kernel's post-processing).
    """
    import_vllm()
    import vllm.model_executor.kernels.linear as linear_kernels
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
    from vllm.model_executor.layers.quantization import fp8 as checkpoint_fp8
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8
    from vllm.model_executor.layers.quantization.online import mxfp8 as online_mxfp8

    choose, init_mx = (linear_kernels.choose_scaled_mm_linear_kernel,
                       online_mxfp8.init_mxfp8_linear_kernel)
    convert, make = moe_oracle.convert_to_fp8_moe_kernel_format, moe_oracle.make_fp8_moe_kernel
    select = moe_oracle.select_fp8_moe_backend

    def choose_or_stand_in(*args: Any, **kwargs: Any) -> Any:
        try:
            return choose(*args, **kwargs)
        except ValueError as e:
            logger.info("xreshard: no FP8 kernel on this platform (%s); KernelStandIn "
                        "for building only", str(e).splitlines()[-1])
            return KernelStandIn

    def init_mx_or_stand_in(*args: Any, **kwargs: Any) -> Any:
        try:
            return init_mx(*args, **kwargs)
        except ValueError:
            return KernelStandIn()

    def no_backend(args: tuple, kwargs: dict) -> bool:
        backend = kwargs.get("fp8_backend", args[0] if args else None)
        return getattr(backend, "value", None) == "NONE"

    def convert_or_keep(*args: Any, **kwargs: Any) -> Any:
        if not no_backend(args, kwargs):
            return convert(*args, **kwargs)
        names = ("fp8_backend", "layer", "w13", "w2", "w13_scale", "w2_scale")
        got = {**dict(zip(names, args)), **kwargs}
        return got["w13"], got["w2"], got["w13_scale"], got["w2_scale"]

    def make_or_stand_in(*args: Any, **kwargs: Any) -> Any:
        return KernelStandIn() if no_backend(args[3:], kwargs) else make(*args, **kwargs)

    def select_or_stand_in(*args: Any, **kwargs: Any) -> Any:
        backend, experts = select(*args, **kwargs)
        return backend, (KernelStandIn if experts is None else experts)

    patches = [(linear_kernels, "choose_scaled_mm_linear_kernel", choose_or_stand_in),
               (online_mxfp8, "init_mxfp8_linear_kernel", init_mx_or_stand_in)]
    for module in (moe_oracle, checkpoint_fp8):
        patches += [(module, "convert_to_fp8_moe_kernel_format", convert_or_keep),
                    (module, "make_fp8_moe_kernel", make_or_stand_in)]
    patches += [(module, "select_fp8_moe_backend", select_or_stand_in)
                for module in (checkpoint_fp8, online_fp8)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, fn in patches:
        setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


_REFUSALS = ("is not divisible by weight quantization", "requires input_size_per_partition",
             "requires hidden/intermediate sizes divisible")


def refusal_as_format_error(e: BaseException) -> FormatError | None:
    """vLLM's refusal of a block shape while building a layer (a TP shard edge off the
    block grid), as a :class:`FormatError` naming the layer; None for other errors."""
    text = str(e)
    if not isinstance(e, ValueError) or not any(r in text for r in _REFUSALS):
        return None
    where = None
    tb = e.__traceback__
    while tb is not None:           # the innermost frame that knows its layer's name
        local = tb.tb_frame.f_locals
        for cand in (local.get("layer"), local.get("self")):
            name = getattr(cand, "prefix", None) or getattr(cand, "layer_name", None)
            if isinstance(name, str) and name:
                where = name
        tb = tb.tb_next
    return FormatError(f"layer {where or '<unknown>'}: vLLM refuses this block-quantized "
                       f"layout ({text}); a TP shard of a block-quantized weight must hold "
                       "whole blocks - change the tensor-parallel size or the block")


# ---------------------------------------------------------------------------- formats

def engine_formats(model: Any, *, ue8m0: bool = False
                   ) -> dict[str, tuple[str, Any, dict[str, str]]]:
    """Module name -> (kind, format, {weight param: scale param}) for every layer of a
    built vLLM model that stores weights block-FP8 or MXFP8 (see the module table).

    Args:
        ue8m0: the checkpoint's scales are powers of two (its config says ``"scale_fmt":
            "ue8m0"``, DeepSeek-V3.2); :func:`scale_fmt_ue8m0` reads it.

    Raises:
        FormatError: a layer quantized in a way xreshard cannot produce (per-tensor FP8,
            ue8m0 scales stored as float8_e8m0fnu), naming it.
    """
    out = {}
    for mod_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind_params = _METHODS.get(type(method).__name__)
        if kind_params is None or method is None:
            continue
        kind, params = kind_params
        if kind == CHECKPOINT and not getattr(method, "block_quant", False):
            raise FormatError(f"layer {mod_name!r}: per-tensor FP8 ({type(method).__name__} "
                              "without weight_block_size) is not supported; block FP8 "
                              "checkpoints, fp8_per_block and mxfp8 are")
        if kind == CHECKPOINT and getattr(module, "allow_fp8_block_shape_mismatch", False):
            raise FormatError(
                f"layer {mod_name!r}: its fused partitions {list(module.output_partition_sizes)}"
                f" are not multiples of the {method.weight_block_size[0]}-row block; vLLM "
                "skips its block-shape check for such merged layers "
                "(allow_fp8_block_shape_mismatch), but then one scale row spans two tensors "
                "and at TP > 1 its loader reads past the scale tensor - xreshard refuses it; "
                "change the tensor-parallel size")
        refine = getattr(method, "weight_scale_refine", None)
        if kind == CHECKPOINT and refine is not None:
            raise FormatError(
                f"layer {mod_name!r}: its TP shard is not a multiple of the "
                f"{method.weight_block_size} block, so vLLM refines the block grid by "
                f"{tuple(refine)} and upsamples the checkpoint's scales while loading (they "
                "are no longer the checkpoint's bytes) - xreshard refuses it; use a "
                "tensor-parallel size whose shards hold whole blocks")
        if getattr(method, "is_scale_e8m0", False):
            raise FormatError(f"layer {mod_name!r}: float8_e8m0fnu scale tensors are not "
                              "supported; ue8m0 scales stored as float32 are")
        out[mod_name] = (kind, _format_of(method, ue8m0 and kind == CHECKPOINT), dict(params))
    return out


def _format_of(method: Any, ue8m0: bool) -> Any:
    if "Mxfp8" in type(method).__name__:
        return MXFP8()
    from vllm.platforms import current_platform

    from xreshard.dtypes import dtype_name
    block = getattr(method, "weight_block_size", None) or [128, 128]
    rows, cols = block          # two entries: vLLM's Fp8Config refuses any other length
    return BlockFP8((int(rows), int(cols)), dtype_name(current_platform.fp8_dtype()), ue8m0)


def scale_fmt_ue8m0(vllm_config: Any) -> bool:
    """Whether the model's checkpoint config says its block scales are powers of two."""
    qc = getattr(vllm_config.model_config.hf_config, "quantization_config", None) or {}
    return isinstance(qc, Mapping) and qc.get("scale_fmt") == "ue8m0"


def quantized_of(model: Any, rec: Recording, specs: Mapping[str, tuple[Sequence[int], Any]],
                 *, ue8m0: bool = False) -> tuple[list[QuantizedTensor], list[QuantizedTensor]]:
    """What ``model`` (built for ``rec``'s rank) stores quantized, as
    :class:`QuantizedTensor`: (checkpoint, online). For a checkpoint, every HF weight its
    loaders write into a quantized parameter, with its ``*_scale_inv`` HF tensor and the
    HF tensor's shape (the grid is the HF tensor's); online, every quantized parameter of
    this rank, with its scale parameter and its local shape (the grid is the parameter's).
    """
    out: list[QuantizedTensor] = []
    online: list[QuantizedTensor] = []
    by_param: dict[str, list[str]] = {}
    for name, pieces in rec.pieces.items():
        for p in pieces:
            by_param.setdefault(p.param, []).append(name)
    for mod_name, (kind, fmt, params) in engine_formats(model, ue8m0=ue8m0).items():
        for weight, scale in params.items():
            param = f"{mod_name}.{weight}"
            if kind == ONLINE:
                if param in rec.param_shapes:
                    online.append(QuantizedTensor(param, f"{mod_name}.{scale}", fmt,
                                                  rec.param_shapes[param]))
                continue
            for hf in dict.fromkeys(by_param.get(param, ())):
                out.append(QuantizedTensor(hf, _scale_name(hf), fmt, tuple(specs[hf][0])))
    return out, online


def _scale_name(hf_weight: str) -> str:
    """The checkpoint name of an HF weight's block scales (DeepSeek's convention)."""
    return hf_weight + "_scale_inv"


def checkpoint_specs_fp8(specs: Mapping[str, tuple[Sequence[int], Any]],
                         quantized: Sequence[QuantizedTensor]
                         ) -> dict[str, tuple[tuple[int, ...], str]]:
    """``specs`` as a block-FP8 checkpoint holds them: each quantized HF weight in its
    code dtype, followed by its scale tensor (what a DeepSeek-style safetensors header
    lists; for a model without such a checkpoint on disk)."""
    q = {t.name: t for t in quantized}
    out = {}
    for name, (shape, dtype) in specs.items():
        t = q.get(name)
        if t is None:
            out[name] = (tuple(shape), str(dtype))
            continue
        out[name] = (t.shape, t.format.dtype)
        out[t.scale] = (t.scale_shape, t.format.scale_dtype)
    return out


# ---------------------------------------------------------------------------- online engines

#: suffix of the parameter name under which a worker gathers the bf16 values of an online
#: parameter's blocks that no sender could quantize (not a parameter of the model)
SCRATCH = "\0bf16"


class OnlineQuantization:
    """How a refit fills the parameters vLLM's online ``fp8_per_block`` / ``mxfp8`` quantize.

    vLLM quantizes each TP-local *parameter* (``qkv_proj.weight``: this rank's q, k and v
    rows together; ``w13_weight`` per local expert) with the grid anchored at the
    parameter's origin. Per HF tensor feeding such parameters, deterministically from
    every worker's recording:

    * **sent quantized** when on every worker each of its pieces covers whole blocks of
      the parameter and starts on the HF tensor's own grid (the parameter's blocks are
      then the HF tensor's blocks: ``is_aligned`` in both coordinates). It becomes a
      :class:`QuantizedTensor` of the HF tensor with a scale tensor of its own (``X.weight
      _scale_inv`` / ``X.weight_scale``, a name no checkpoint of this engine has) whose
      pieces go to the parameter's scale rows, so the planner quantizes whole blocks at the
      sender and the rest at the receiver (:mod:`xreshard.planner.quantize`), and codes and
      scales land in the live ``weight`` and scale parameters;
    * **sent bf16** otherwise (a block of the parameter straddles two HF tensors, e.g. k|v
      rows of 64-row heads, or a shard edge is off the HF tensor's grid): its pieces land
      in a bf16 scratch copy of the parameter (``param + SCRATCH``) and the worker quantizes
      the blocks they touch with the same function after they landed (:meth:`finish`).

    Attributes:
        recordings: every worker's recording rewritten for this (scale pieces added,
            scratch pieces renamed, codes and scale parameters in their stored dtypes).
        tensors: HF name -> :class:`QuantizedTensor` of the tensors sent quantized.
        shapes: the scale tensors' global shapes (added to the engine's tensors).
        params: per worker, online parameter -> its :class:`QuantizedTensor` (local shape).
    """

    def __init__(self, recordings: Sequence[Recording], shapes: Mapping[str, Sequence[int]]
                 ) -> None:
        import dataclasses

        self.params = [{q.name: q for q in rec.quantized_params} for rec in recordings]
        feeds: dict[str, list[tuple[int, Piece]]] = {}
        for w, rec in enumerate(recordings):
            for name, recorded in rec.pieces.items():
                for p in recorded:
                    feeds.setdefault(name, []).append((w, p))
        self.tensors: dict[str, QuantizedTensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, fed in feeds.items():
            found = [self.params[w].get(p.param) for w, p in fed]
            online = [q for q in found if q is not None]
            if not online:
                continue
            if len(online) != len(found):
                raise FormatError(f"HF tensor {name!r} loads into parameters vLLM quantizes "
                                  "online and into others; xreshard cannot send it both ways")
            fmts = {q.format for q in online}
            qt = _quantized_hf(name, tuple(shapes[name]), fmts.pop(), fed, online) \
                if len(fmts) == 1 else None
            if qt is not None:
                self.tensors[name], self.shapes[qt.scale] = qt, qt.scale_shape
        self.recordings = []
        for w, rec in enumerate(recordings):
            pieces = {n: list(ps) for n, ps in rec.pieces.items()}
            shapes_, dtypes = dict(rec.param_shapes), dict(rec.param_dtypes)
            for name, ps in rec.pieces.items():
                qt = self.tensors.get(name)
                for i, p in enumerate(ps):
                    q = self.params[w].get(p.param)
                    if q is None:
                        continue
                    if qt is None:          # bf16 into the scratch copy of the parameter
                        pieces[name][i] = Piece(name, p.region, p.param + SCRATCH, p.param_region)
                        shapes_[p.param + SCRATCH] = q.shape
                        dtypes[p.param + SCRATCH] = rec.param_dtypes[p.param]
                        continue
                    fmt = q.format
                    pieces.setdefault(qt.scale, []).append(Piece(
                        qt.scale, fmt.blocks(p.region, qt.shape), q.scale,
                        fmt.blocks(p.param_region, q.shape)))
            for q in self.params[w].values():
                shapes_[q.scale], dtypes[q.name] = q.scale_shape, q.format.dtype
                dtypes[q.scale] = q.format.scale_dtype
            for scale in self.shapes:
                pieces.setdefault(scale, [])
            self.recordings.append(dataclasses.replace(rec, pieces=pieces, param_shapes=shapes_,
                                                       param_dtypes=dtypes))

    def finish(self, worker: int, buffers: Mapping[str, Any], names: Sequence[str]) -> None:
        """Quantize into the live codes and scales (``buffers``) every block of this
        worker's online parameters that the bf16 pieces of ``names`` touch, from their
        scratch copies (:func:`xreshard.quant.torch_ops.quantize`: vLLM's formulas, byte for
        byte, on the parameter's device)."""
        from xreshard.quant import torch_ops

        rec = self.recordings[worker]
        blocks: dict[str, set[tuple[int, ...]]] = {}
        for name in names:
            for p in rec.pieces.get(name, ()):
                if p.param.endswith(SCRATCH):
                    param = p.param[:-len(SCRATCH)]
                    q = self.params[worker][param]
                    b = q.format.blocks(p.param_region, q.shape)
                    blocks.setdefault(param, set()).update(
                        tuple(s) for s in _indices(b))
        for param, todo in blocks.items():
            q = self.params[worker][param]
            fmt, scratch = q.format, buffers[param + SCRATCH]
            for band in _bands(todo):
                region = fmt.data_region(band, q.shape)
                codes, scales = torch_ops.quantize(scratch[region.slices()], fmt, name=param)
                buffers[param][region.slices()] = codes
                buffers[q.scale][band.slices()] = scales


def _quantized_hf(name: str, shape: tuple[int, ...], fmt: Any, fed: Sequence[tuple[int, Piece]],
                  online: Sequence[QuantizedTensor]) -> QuantizedTensor | None:
    """``name`` as a :class:`QuantizedTensor` when every piece of it covers whole blocks of
    its parameter on the HF tensor's own grid (see :class:`OnlineQuantization`), else None."""
    try:
        fmt.check_shape(shape, name)
    except FormatError:
        return None
    for (w, p), q in zip(fed, online):
        lead = len(q.shape) - len(shape)
        if lead < 0 or p.param_region.shape != (1,) * lead + p.region.shape or not (
                fmt.is_aligned(p.region, shape) and fmt.is_aligned(p.param_region, q.shape)):
            return None
    scale = name + ("_scale" if isinstance(fmt, MXFP8) else "_scale_inv")
    return QuantizedTensor(name, scale, fmt, shape)


def _indices(blocks: Any) -> Iterator[tuple[int, ...]]:
    import itertools
    return itertools.product(*(range(a, b) for a, b in zip(blocks.starts, blocks.stops)))


def _bands(blocks: set[tuple[int, ...]]) -> list[Any]:
    """The block indices as boxes: runs of consecutive last-dim blocks per leading index."""
    from xreshard.ir.geometry import Region

    out, run = [], None
    for b in sorted(blocks):
        if run is not None and b[:-1] == run[0][:-1] and b[-1] == run[1] + 1:
            run = (run[0], b[-1])
            continue
        if run is not None:
            out.append(run)
        run = (b, b[-1])
    if run is not None:
        out.append(run)
    return [Region(tuple(s), tuple(x + 1 for x in s[:-1]) + (e + 1,)) for s, e in out]


def online_quantization(recordings: Sequence[Recording], shapes: Mapping[str, Sequence[int]]
                        ) -> OnlineQuantization | None:
    """The :class:`OnlineQuantization` of an engine whose workers quantize online, or None."""
    if not any(rec.quantized_params for rec in recordings):
        return None
    return OnlineQuantization(recordings, shapes)


#: FP8 MoE backends whose ``convert_to_fp8_moe_kernel_format`` keeps the quantized tensors
#: as vLLM's online quantizer wrote them (vLLM 0.32: its final ``else`` branch, "no
#: load-time layout change"); NONE is the stand-in's (no kernel on this platform)
IDENTITY_MOE_BACKENDS = frozenset({"NONE", "TRITON", "BATCHED_TRITON", "VLLM_CUTLASS",
                                   "BATCHED_VLLM_CUTLASS", "HPC", "EMULATION", "TRITON_MXFP8"})


def online_refusals(model: Any) -> list[str]:
    """Why the online-quantized layers of ``model`` cannot take codes and scales written
    in place (empty: they can): a layer whose kernel post-processes the quantized tensors
    (DeepGEMM E8M0 requantization, scale swizzles, Marlin/FlashInfer/AITER MoE layouts, CPU
    prepacking) keeps a format xreshard does not produce. Linear layers: only
    :class:`KernelStandIn` (no kernel: the tensors stay as vLLM's quantizer wrote them);
    MoE layers: :data:`IDENTITY_MOE_BACKENDS`. TODO(issue 20): list the GPU linear kernels
    whose post-processing is the identity (CUTLASS block FP8 without E8M0) once checked on
    a GPU; until then such engines receive bf16 and quantize themselves.
    """
    out = []
    for mod_name, (kind, _, _) in engine_formats(model).items():
        if kind != ONLINE:
            continue
        method = model.get_submodule(mod_name).quant_method
        backend = getattr(getattr(method, "fp8_backend", None), "value", None)
        if backend is not None:
            if backend not in IDENTITY_MOE_BACKENDS:
                out.append(f"layer {mod_name!r}: MoE backend {backend} converts the "
                           "quantized weights to its own layout")
            continue
        kernel = getattr(method, "fp8_linear", None) or getattr(method, "kernel", None)
        if not (isinstance(kernel, KernelStandIn) or kernel is KernelStandIn):
            out.append(f"layer {mod_name!r}: kernel {type(kernel).__name__} post-processes "
                       "the quantized weights (not known to keep vLLM's quantizer's bytes)")
    return out
