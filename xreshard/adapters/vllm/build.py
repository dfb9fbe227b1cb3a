"""Building a vLLM model to record, offline or inside a worker, and recording it.

Offline (tests, planning without an engine): :func:`make_vllm_config` for a model
directory or HF config, :func:`fake_tp` to build as one TP rank in this process,
:func:`build_model` on the ``meta`` device, :func:`record_from_config` for all of it. In a
worker: :func:`record_in_worker` records this worker's rank with the real parallel state,
and :func:`record_workers` all-gathers every worker's recording (JSON over vLLM's gloo
group, :func:`allgather_json`). The HF tensors to feed come from the checkpoint's
safetensors headers (:func:`checkpoint_specs`) or the HF config (:func:`hf_tensor_specs`).
See the decision record in :mod:`xreshard.adapters.vllm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from typing import Any, Iterator, Mapping, Sequence

from xreshard.extras import require

from .quantized import (checkpoint_specs_fp8, engine_formats, kernel_stand_ins, quantized_of,
                        refusal_as_format_error, scale_fmt_ue8m0)
from .record import RecordError, Recording, dtype_str, import_torch, import_vllm, record_model

__all__ = ["fake_tp", "build_model", "make_vllm_config", "hf_tensor_specs", "checkpoint_specs",
           "record_from_config", "record_in_worker", "record_workers", "allgather_json",
           "record_quantized"]


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
def fake_tp(tp_rank: int, tp_size: int, *, pp_rank: int = 0, pp_size: int = 1
            ) -> Iterator[None]:
    """Make vLLM build layers as TP rank ``tp_rank`` of ``tp_size`` (in pipeline stage
    ``pp_rank`` of ``pp_size``), in this one process.

    Installs stand-ins in ``vllm.distributed.parallel_state``'s group slots (TP and PP at
    the given ranks and sizes; DP, EP, DCP, PCP of size 1) and restores the previous ones
    on exit. Only for constructing models to record; nothing can communicate through them.
    """
    if not 0 <= tp_rank < tp_size or not 0 <= pp_rank < pp_size:
        raise ValueError(f"tp_rank {tp_rank} / pp_rank {pp_rank} is outside [0, {tp_size}) / "
                         f"[0, {pp_size}); pass 0 <= rank < size")
    import_vllm()
    from vllm.distributed import parallel_state as ps

    saved = {slot: getattr(ps, slot, None) for slot in _GROUP_SLOTS}
    try:
        for slot in _GROUP_SLOTS:
            setattr(ps, slot, _StandInGroup(slot.strip("_"), 0, 1))
        # vLLM's group slots (module privates, no setter) are what every layer reads
        ps._TP = _StandInGroup("TP", tp_rank, tp_size)
        ps._PP = _StandInGroup("PP", pp_rank, pp_size)
        ps._WORLD = _StandInGroup("WORLD", pp_rank * tp_size + tp_rank, pp_size * tp_size)
        yield
    finally:
        for slot, value in saved.items():
            setattr(ps, slot, value)


@functools.cache
def _meta_weights_class() -> type:
    # torch.device("meta")'s own mode and its list of factory functions (no public alias)
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


def build_model(vllm_config: Any, *, device: str = "meta", model_config: Any = None) -> Any:
    """The vLLM model class of ``vllm_config``, built on ``device`` (default ``meta``).

    ``model_config``: build that model under ``vllm_config`` instead of
    ``vllm_config.model_config``'s, as vLLM builds an EAGLE/MTP draft
    (``get_model(vllm_config=..., model_config=draft_model_config)``).

    Uses vLLM's ``initialize_model`` under the config's dtype, exactly as its loaders do,
    so parameter names, shapes and weight loaders are those of the engine. The TP rank and
    size come from the current process groups (a worker's, or :func:`fake_tp`'s).
    Attention layers register themselves by name in the compilation config and rotary
    embeddings are cached process-wide; both are swapped out for the build, so a worker's
    live model and any later engine in this process are left untouched. FP8 layers get a
    :class:`~.quantized.KernelStandIn` where vLLM finds no FP8 kernel on this platform
    (:func:`~.quantized.kernel_stand_ins`).

    Raises:
        FormatError: vLLM refuses a block-quantized layer's TP shard (its edge is off the
            block grid), naming the layer.
    """
    torch = import_torch()
    import_vllm()
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm.model_executor.layers import rotary_embedding

    cc = vllm_config.compilation_config
    saved = cc.static_forward_context, cc.static_all_moe_layers
    # get_rope() caches modules by shape, not device: without the swap the meta model
    # would share a live model's rotary module, or leave a meta one for a later engine.
    # (vLLM's module-private cache: no public way to clear or restore it)
    saved_ropes = dict(rotary_embedding._ROPE_DICT)
    cc.static_forward_context, cc.static_all_moe_layers = {}, []
    rotary_embedding._ROPE_DICT.clear()
    place = _MetaWeights() if torch.device(device).type == "meta" else torch.device(device)
    try:
        with set_default_torch_dtype((model_config or vllm_config.model_config).dtype), place, \
                kernel_stand_ins():
            return initialize_model(vllm_config=vllm_config, model_config=model_config)
    except ValueError as e:
        refused = refusal_as_format_error(e)
        if refused is None:
            raise
        raise refused from e
    finally:
        cc.static_forward_context, cc.static_all_moe_layers = saved
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(saved_ropes)


def make_vllm_config(model: str | Any, *, dtype: str = "bfloat16", tp_size: int = 1,
                     enable_expert_parallel: bool = False, pp_size: int = 1,
                     quantization: str | None = None) -> Any:
    """A ``VllmConfig`` for a local model directory (config.json only) or a HF config object.

    A config object is written to a fresh temporary directory; nothing is downloaded.
    ``enable_expert_parallel`` is vLLM's flag: MoE experts are then split over the TP ranks
    whole (expert e on rank ``e // (num_experts / tp)`` by vLLM's default linear placement)
    instead of each expert being tensor-parallel. ``quantization`` is vLLM's
    ``--quantization`` (``"fp8_per_block"``, ``"mxfp8"``: online); a block-FP8 checkpoint
    says so in its config's ``quantization_config``.
    """
    import_vllm()
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    path = model
    if not isinstance(model, str):
        import tempfile
        path = tempfile.mkdtemp(prefix="xreshard-vllm-config-")
        model.save_pretrained(path)
    model_config = ModelConfig(model=path, skip_tokenizer_init=True, dtype=dtype,
                               quantization=quantization)
    config = VllmConfig(model_config=model_config,
                        parallel_config=ParallelConfig(
                            tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
                            enable_expert_parallel=enable_expert_parallel))
    if path is not model:       # the folder lives as long as the config (or the process)
        import shutil
        import weakref
        weakref.finalize(config, shutil.rmtree, path, True)
    return config


def hf_tensor_specs(hf_config: Any, dtype: Any = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) of ``hf_config``'s transformers model, built on meta.

    Tied parameters appear once (under their first name, as in a saved checkpoint), and
    persistent buffers are included. For dense Llama/Qwen2 these are the checkpoint names;
    transformers >= 5 stacks MoE experts in memory under names no checkpoint uses, so for
    MoE models read the checkpoint instead (:func:`checkpoint_specs`).
    """
    torch = import_torch()
    transformers = require("transformers", "vllm", "hf_tensor_specs")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    specs = {}
    for name, t in model.named_parameters():
        specs[name] = (tuple(t.shape), dtype_str(dtype or t.dtype))
    non_persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                      for b in getattr(mod, "_non_persistent_buffers_set", ())}
    for name, t in model.named_buffers():
        if name not in non_persistent:
            specs[name] = (tuple(t.shape), dtype_str(dtype or t.dtype))
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
                       specs: Mapping[str, tuple[Sequence[int], Any]] | None = None, *,
                       pp_rank: int = 0, pp_size: int = 1) -> Recording:
    """Record one rank without an engine: build on meta under :func:`fake_tp`, then record.

    Args:
        vllm_config: from :func:`make_vllm_config`.
        tp_rank, tp_size, pp_rank, pp_size: the rank to simulate.
        specs: HF name -> (shape, dtype); default :func:`hf_tensor_specs` of the model's HF
            config in the model dtype. A block-FP8 checkpoint's scale tensors are added
            when they are missing (:func:`~.quantized.checkpoint_specs_fp8`).
    """
    from vllm.config import set_current_vllm_config

    if specs is None:
        specs = hf_tensor_specs(vllm_config.model_config.hf_config, vllm_config.model_config.dtype)
    # loaders may ask the groups (and quantized layers the config) again while loading
    with fake_tp(tp_rank, tp_size, pp_rank=pp_rank, pp_size=pp_size), \
            set_current_vllm_config(vllm_config):
        model = build_model(vllm_config)
        return record_quantized(model, specs, scale_fmt_ue8m0(vllm_config), tp_rank=tp_rank,
                                tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)[0]


def record_quantized(model: Any, specs: Mapping[str, tuple[Sequence[int], Any]],
                     ue8m0: bool = False, **ranks: int) -> tuple[Recording, dict]:
    """:func:`record_model`, plus what the model stores quantized (``Recording.quantized``).

    A block-FP8 checkpoint model fed bf16 specs (a config without a checkpoint) is
    recorded again with the checkpoint's tensors: each quantized weight in e4m3 and its
    ``weight_scale_inv``, so the scales' places are recorded like any tensor's. Only the
    weights this rank loads are known to be quantized then (another rank's experts are
    not): record every rank with the same full specs - a checkpoint's safetensors headers
    (:func:`checkpoint_specs`), or :func:`~.quantized.checkpoint_specs_fp8` of every
    rank's quantized weights, as :func:`record_workers` does.

    Returns:
        the recording and the specs it fed.
    """
    engine_formats(model, ue8m0=ue8m0)     # refuse what cannot be recorded, naming the layer
    rec = record_model(model, specs, **ranks)
    quantized, params = quantized_of(model, rec, specs, ue8m0=ue8m0)
    if any(q.scale not in specs for q in quantized):
        specs = checkpoint_specs_fp8(specs, quantized)
        rec = record_model(model, specs, **ranks)
    return dataclasses.replace(rec, quantized=quantized, quantized_params=params), dict(specs)


# ---------------------------------------------------------------------------- inside a worker

def _default_specs(model_config: Any) -> dict:
    """HF tensor specs of a served model: its safetensors headers, else its config."""
    try:
        return checkpoint_specs(model_config.model)
    except FileNotFoundError:
        return hf_tensor_specs(model_config.hf_config, model_config.dtype)


def record_workers(vllm_config: Any, specs: Mapping[str, Any] | None, *,
                   model_config: Any = None) -> tuple[list[Recording], int, dict]:
    """(every worker's recording in worker order, this worker's index, the specs fed):
    record this worker on a meta copy of its model, then all-gather over the engine's
    workers (vLLM's world group, its gloo CPU group). Collective over the workers.

    Args:
        vllm_config: the worker's config.
        specs: HF name -> [shape, dtype]; default :func:`checkpoint_specs` of the model
            directory, else :func:`hf_tensor_specs` of its HF config.
        model_config: record this model instead of ``vllm_config.model_config``'s (a
            draft, see :func:`build_model`).
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if specs is None:
        specs = _default_specs(model_config or vllm_config.model_config)
    else:
        specs = {n: (tuple(s[0]), str(s[1])) for n, s in specs.items()}
    with set_current_vllm_config(vllm_config):
        model = build_model(vllm_config, model_config=model_config)
        rec, fed = _record_here(model, specs, vllm_config)
    if rec.num_workers > 1:     # the world group of an engine without DP: its workers
        group = ps.get_world_group()
        if group.world_size != rec.num_workers:
            raise RecordError(f"vLLM's world group has {group.world_size} workers but "
                              f"pp x tp = {rec.num_workers}; data parallelism is not supported")
        # a checkpoint engine fed specs without scales (no checkpoint on disk) derived
        # them from its own rank's weights only: the same test on every worker
        if type(vllm_config.quant_config).__name__ == "Fp8Config" and \
                not any(n.endswith("_scale_inv") for n in specs):
            from xreshard.ir.formats import QuantizedTensor
            every = [QuantizedTensor.from_dict(q) for qs in allgather_json(
                [q.to_dict() for q in rec.quantized], group.cpu_group) for q in qs]
            with set_current_vllm_config(vllm_config):
                rec, fed = _record_here(model, checkpoint_specs_fp8(specs, every), vllm_config)
        dicts = allgather_json(rec.to_dict(), group.cpu_group)
    else:
        dicts = [rec.to_dict()]
    recs = [Recording.from_dict(d) for d in dicts]
    if [r.worker for r in recs] != list(range(rec.num_workers)):
        raise RecordError("the all-gather of recordings returned workers "
                          f"{[r.worker for r in recs]}, not 0..{rec.num_workers - 1}")
    return recs, rec.worker, fed


def allgather_json(obj: Any, group: Any) -> list[Any]:
    """Every member's ``obj`` over a torch process group (vLLM's gloo CPU group), as JSON
    bytes in uint8 tensors - ``all_gather_object`` would pickle. Two all-gathers: the
    lengths, then the bytes padded to the longest."""
    torch = import_torch()
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


def _record_here(model: Any, specs: Mapping[str, Any], vllm_config: Any
                 ) -> tuple[Recording, dict]:
    """Record ``model`` as this process's TP rank and pipeline stage (and the specs fed)."""
    from vllm.distributed import parallel_state as ps

    return record_quantized(model, specs, scale_fmt_ue8m0(vllm_config),
                            tp_rank=ps.get_tensor_model_parallel_rank(),
                            tp_size=ps.get_tensor_model_parallel_world_size(),
                            pp_rank=ps.get_pp_group().rank_in_group,
                            pp_size=ps.get_pp_group().world_size)


def record_in_worker(worker: Any, specs: Mapping[str, tuple[Sequence[int], Any]] | None = None
                     ) -> Recording:
    """Record this worker's rank inside a running engine (real parallel state, real config).

    Builds a second, meta-device copy of the model from the worker's ``vllm_config`` and
    records on it; the live model is not touched. ``specs`` defaults to the safetensors
    headers of a local model directory, else :func:`hf_tensor_specs`.
    """
    import_vllm()
    vllm_config = worker.vllm_config
    if specs is None:
        specs = _default_specs(vllm_config.model_config)
    return _record_here(build_model(vllm_config), specs, vllm_config)[0]
