"""vLLM destination layouts, recorded from vLLM's own weight loaders.

vLLM shards a checkpoint inside ``model.load_weights``: every rank receives each full HF
tensor and its parameter's ``weight_loader`` narrows out the rank's slice and copies it
into a slice of a (possibly fused) parameter. Rather than re-deriving those formulas per
layer class (``QKVParallelLinear``, ``MergedColumnParallelLinear``, vocab padding, ...),
this module runs ``load_weights`` once on *probes*: zero-storage stand-ins for the full
HF tensors that record where each ``copy_`` lands. The result, per TP rank, is a list of
:class:`Piece` per HF tensor: which region (global HF coordinates) goes into which
parameter at which slices. :func:`layouts_from_pieces` turns the pieces of all ranks into
one :class:`~xreshard.ir.layout.Layout` per HF tensor.

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
  their recordings as JSON bytes (:func:`allgather_json`), never ``all_gather_object``.
* :class:`EngineRecording` is every worker's recording of one engine; placed on world
  ranks it is a :class:`Destination`, one worker as a refit destination (global layouts
  from every TP rank's recording, bindings into receive buffers, loading through layerwise
  reload). :mod:`~xreshard.adapters.vllm.worker` wraps it as vLLM's weight-transfer backend
  ``"xreshard"``, which :func:`register_backend` (a ``vllm.general_plugins`` entry point)
  registers.

The package, by concern::

    record.py       probes: recording vLLM's loaders (Piece, Recording), shard_weight
    build.py        building a model to record (fake_tp, build_model, specs), in a worker too
    destination.py  layouts from recordings; EngineRecording, Destination, in-place rules
    reload.py       loading shards through vLLM's layerwise reload; weights_digest
    quantized.py    FP8 engines: formats, quantized tensors, kernel stand-ins
    plugin.py       register_backend (the entry point), WorkerExtension (RPC by method name)
    stream.py       Stream: one process's side of streamed refits (both sides)
    worker.py       the backend's worker engine (XreshardWeightTransferEngine), its decisions
    trainer.py      the backend's trainer engine
    sender.py       WeightSender (a trainer process's rounds), LLMClient
    lora.py         in-memory LoRA refits: the engine side (regions, the vLLM hook, commits)
    lora_send.py    in-memory LoRA refits: the trainer side (LoRASender)
    draft.py        the speculative draft as a second target: how vLLM builds it, DraftError

``worker`` and ``trainer`` import vLLM's weight-transfer base classes (``sender``
imports torch), so they load on first use of one of their names
(``from xreshard.adapters.vllm import LLMClient``); the rest imports neither torch nor
vLLM until called.

Rank table, Qwen2 ``k_proj`` (2 kv heads of 32, 4 q heads, hidden 128) at TP=4, where
each kv head is replicated on two consecutive ranks::

    # tp rank | k_proj region  | qkv_proj.weight slices
    #       0 | [0:32, 0:128]  | [32:64, 0:128]
    #       1 | [0:32, 0:128]  | [32:64, 0:128]
    #       2 | [32:64, 0:128] | [32:64, 0:128]
    #       3 | [32:64, 0:128] | [32:64, 0:128]
"""

from __future__ import annotations

import importlib
from typing import Any

from .build import (allgather_json, build_model, checkpoint_specs, fake_tp, hf_tensor_specs,
                    make_vllm_config, record_from_config, record_in_worker, record_quantized,
                    record_workers)
from xreshard.adapters.lora import LoRAAdapter, LoRAError, write_peft_dir

from .destination import (INPLACE_ALLOWED, INPLACE_MOE_BACKENDS, Destination, EngineRecording,
                          inplace_refusal, layouts_from_pieces, replicate_layout)
from .draft import DraftError
from .members import EngineLost, EngineMismatch, FleetError, HalfJoined
from .lora import LORA_SCHEME, LoRAReceiver, install_hook, lora_request, read_regions
from .plugin import BACKEND, WorkerExtension, register_backend, worker_record
from .quantized import (SCRATCH, KernelStandIn, OnlineQuantization, checkpoint_specs_fp8,
                        engine_formats, kernel_stand_ins, online_refusals, quantized_of)
from .record import (Piece, RecordError, Recording, parts_from_full, record_model,
                     shard_weight, view_box)
from .reload import gemm_weight, reload_from_shards, reprocess_tied, weights_digest

__all__ = [
    "Piece", "Recording", "RecordError", "layouts_from_pieces", "replicate_layout",
    "record_model", "record_from_config", "record_in_worker", "record_workers", "worker_record",
    "fake_tp", "build_model", "hf_tensor_specs", "make_vllm_config", "shard_weight",
    "parts_from_full", "view_box", "allgather_json", "reload_from_shards", "reprocess_tied",
    "WorkerExtension", "checkpoint_specs", "register_backend", "BACKEND", "EngineRecording",
    "Destination", "weights_digest", "gemm_weight", "inplace_refusal", "INPLACE_ALLOWED",
    "INPLACE_MOE_BACKENDS", "LoRAAdapter", "LoRAError", "write_peft_dir", "lora_request",
    "LORA_SCHEME", "LoRAReceiver", "install_hook", "read_regions",
    "KernelStandIn", "kernel_stand_ins", "engine_formats",
    "quantized_of", "checkpoint_specs_fp8", "record_quantized", "OnlineQuantization",
    "online_refusals", "SCRATCH", "DraftError", "FleetError", "EngineMismatch", "HalfJoined",
    "EngineLost",
]

#: names of the backend modules, loaded on first use (they import vLLM's base classes)
_LAZY = {
    "XreshardInitInfo": "worker", "XreshardUpdateInfo": "worker",
    "XreshardWeightTransferEngine": "worker", "XreshardTrainerInitInfo": "trainer",
    "XreshardTrainerWeightTransferEngine": "trainer", "WeightSender": "sender",
    "LLMClient": "sender", "Stream": "stream", "GROUPS": "stream",
    "DEFAULT_WORLD_ID": "stream", "LoRASender": "lora_send",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
