"""Quantizing to the formats of :mod:`xreshard.ir.formats`, byte for byte as the engine does.

One named reference per format, reproduced exactly (not "close"):

* :class:`~xreshard.ir.formats.BlockFP8`: vLLM's ``per_block_cast_to_fp8(x, block,
  use_ue8m0)`` (``vllm/utils/deep_gemm.py``, taken from DeepGEMM), run by vLLM's online
  ``fp8_per_block`` on each TP-local parameter and per local expert, and the function a
  DeepSeek-style checkpoint is made with (then vLLM's loaders shard it). In float32:
  ``amax = max(max|x| per block, 1e-4)``, ``scale = amax / fp8_max``, ``code = fp8(x *
  (1 / scale))`` with torch's round-to-nearest-even cast; ``x`` padded with zeros to whole
  blocks. Note ``x * (1 / scale)``, not ``x / scale`` nor ``x * (fp8_max / amax)``: those
  flip ~1e-4 of the codes (see ``shared/reference/fp8.md`` §1.3).
* :class:`~xreshard.ir.formats.MXFP8`: vLLM's ``_mxfp8_e4m3_quantize_torch``
  (``.../quantization/utils/mxfp8_utils.py``), the path of ``mxfp8_e4m3_quantize`` off
  SM100/ROCm and the function vLLM's online ``mxfp8`` runs: ``amax`` per 32 elements
  clamped to float32's tiny, ``scale = clamp(ceil(log2(amax / 448)) + 127, 0, 254)``
  (float32 ``log2``, correctly rounded), ``code = fp8(x / 2**(scale - 127))``.

torch's float32 -> e4m3 cast (c10 ``fp8e4m3fn_from_fp32_value``, torch 2.13) rounds to
nearest even and saturates finite overflow and infinities to +-448; e4m3fnuz has no
negative zero and turns >= 256 into NaN. NaN codes are *canonical* here (0x7F e4m3fn,
0x80 e4m3fnuz) whatever produced them: the sign a NaN carries through ``x * (1/scale)``
is the hardware's (x86 propagates operand NaNs and makes negative default NaNs, CUDA
makes 0x7FFFFFFF), so vLLM's own NaN codes differ between CPU and GPU. A NaN anywhere
in a block makes the whole block NaN (its scale is NaN) - as in vLLM. So "vLLM's bytes"
means: every byte of every block without a NaN code, and NaN codes as NaN of either sign
(what ``tests/test_quant.py`` checks).

Three implementations, identical bytes (``tests/test_quant.py`` checks them against each
other and against vLLM's functions): :mod:`.host` (numpy/ml_dtypes: host buffers, the
receiver of a block split across senders), :mod:`.jax_ops` (one jitted function per shape
on the arrays' own devices, no host round trip) and :mod:`.torch_ops` (torch ops on the
tensors' device). The framework modules are imported only when a framework array is
offered (:func:`quantize`).

Quantize the values the trainer exports: bf16 after any ``wire_dtype`` cast, never the
fp32 master (xtuner #2044: step-2 KL 23x). What vLLM's checkpoint path does *after*
loading (DeepGEMM E8M0 requantization, CPU VNNI prepacking, Marlin repacking) is not a
format: it stays vLLM's ``process_weights_after_loading`` (see
:mod:`xreshard.adapters.vllm.quantized`).
"""

from __future__ import annotations

import sys
from typing import Any

from ..ir.formats import (BlockFP8, Format, FormatError, MXFP8, QuantizedTensor,
                          format_from_dict)
from .host import dequantize, quantize_block_fp8, quantize_mxfp8

__all__ = ["BlockFP8", "MXFP8", "Format", "FormatError", "QuantizedTensor", "quantize",
           "dequantize", "quantize_block_fp8", "quantize_mxfp8", "format_from_dict"]


def quantize(x: Any, fmt: Format) -> tuple[Any, Any]:
    """``(codes, scales)`` of ``x`` in ``fmt``, computed where ``x`` lives.

    numpy arrays on the host (:mod:`.host`), ``jax.Array`` on its own devices with a jitted
    function (:mod:`.jax_ops`), ``torch.Tensor`` with torch ops on its device
    (:mod:`.torch_ops`). All give the same bytes.

    Args:
        x: bfloat16, float16 or float32 values, at least 2-D (leading dims are quantized
            one index at a time, like stacked experts).
        fmt: :class:`BlockFP8` or :class:`MXFP8`.

    Raises:
        FormatError: ``x``'s shape or dtype does not fit ``fmt``.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from . import torch_ops
        return torch_ops.quantize(x, fmt)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        from . import jax_ops
        return jax_ops.quantize(x, fmt)
    if isinstance(fmt, MXFP8):
        return quantize_mxfp8(x, fmt)
    if isinstance(fmt, BlockFP8):
        return quantize_block_fp8(x, fmt)
    raise FormatError(f"quantize: {fmt!r} is not a quantized format (BlockFP8 or MXFP8)")
