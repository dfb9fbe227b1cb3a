"""Loading received shards into a live vLLM model, and reading back what it computes with.

:func:`reload_from_shards` hands a model new weights through vLLM's layerwise reload (its
own loaders and ``process_weights_after_loading``, per module) and re-processes tied
modules (:func:`reprocess_tied`). :func:`weights_digest` hashes the weights a model
computes with, through its CPU kernels where vLLM prepacked them (:func:`gemm_weight`), so
two engines, or one engine before and after a refit, compare bit for bit.

FP8 engines (see :mod:`.quantized`). A block-FP8 *checkpoint* engine reloads through the
same path: the shards are the checkpoint's own tensors (``X.weight`` e4m3 and
``X.weight_scale_inv`` float32, each an HF name of the recording), vLLM's loaders write
them where they wrote the checkpoint, and ``finalize_layerwise_reload`` runs the layer's
``Fp8LinearMethod`` / ``Fp8MoEMethod.process_weights_after_loading`` - DeepGEMM's E8M0
requantization and scale layout, CPU (AMX) VNNI prepacking, MoE kernel formats stay
vLLM's (``tests/test_vllm_fp8.py`` reloads FP8 shards this way and gets a fresh load's
bytes). An *online* engine (``fp8_per_block``, ``mxfp8``) quantizes the TP-local parameter in
``process_weights_after_loading`` (``per_block_cast_to_fp8`` / ``mxfp8_e4m3_quantize``,
then the kernel's own hook). A refit does not reload its quantized modules: it writes
codes and scales into the live ``weight`` and scale parameters in place
(:class:`~.quantized.OnlineQuantization`, where the kernel's hook leaves vLLM's
quantizer's bytes as they are: :func:`~.quantized.online_refusals`); only where a kernel
post-processes them does the engine reload bf16 through this path and quantize itself.
"""

from __future__ import annotations

from typing import Any, Iterable

from .record import RecordError, import_torch, import_vllm

__all__ = ["reload_from_shards", "reprocess_tied", "weights_digest", "gemm_weight"]


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
    import_vllm()
    torch = import_torch()
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


# ---------------------------------------------------------------------------- reading weights back

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

    torch = import_torch()
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
    torch = import_torch()
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def gemm_weight(module: Any, *, rows: int = 1024) -> Any:
    """The ``[out, in]`` weight a CPU-dispatched vLLM layer multiplies with, read back
    through its own kernel: ``cpu_linear(I, weight, None)`` is ``W.T`` (each output is one
    weight times 1 plus zeros, exact in fp32/bf16/fp16). Works whether the kernel holds a
    prepacked copy (oneDNN, sgl, zentorch: the parameter is then empty) or multiplies the
    parameter itself. ``rows`` bounds the identity block fed at once.
    """
    torch = import_torch()
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
                              "(input_size_per_partition, embedding_dim, input_size) to read it "
                              "back")
    cols = []
    for a in range(0, int(k), rows):
        b = min(int(k), a + rows)
        eye = torch.zeros(b - a, int(k), dtype=weight.dtype, device=weight.device)
        eye[:, a:b] = torch.eye(b - a, dtype=weight.dtype, device=weight.device)
        cols.append(module.cpu_linear(eye, weight, None))
    return torch.cat(cols).t().contiguous()
