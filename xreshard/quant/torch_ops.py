"""Quantizing torch tensors with torch ops, on the tensors' own device.

The reference formulas themselves, op for op: vLLM's ``per_block_cast_to_fp8`` (which vLLM
runs through ``torch.compile``; Inductor keeps its ``amax / fp8_max`` and ``1 / scale``
true divisions on CPU, checked byte for byte in ``tests/test_quant.py``) and
``_mxfp8_e4m3_quantize_torch``, in eager mode, in column chunks so the float32
temporaries stay bounded; then NaN codes and scales made canonical (see
:mod:`xreshard.quant`). A torch sender or a vLLM receiver quantizes with these; on a GPU
they run at memory speed, on a CPU :mod:`.host` is faster for the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

from ..dtypes import dtype_name, numpy_dtype
from ..ir.formats import QUANTIZABLE, BlockFP8, FormatError, MXFP8

__all__ = ["quantize", "quantize_block_fp8", "quantize_mxfp8"]

_CHUNK_ELEMENTS = 1 << 22          # float32 temporaries per chunk: 16 MiB


def _import_torch() -> Any:
    from ..extras import require
    return require("torch", "torch", "quantizing torch tensors")


def quantize(x: Any, fmt: Any, *, name: str = "tensor", ops: str = "auto") -> tuple[Any, Any]:
    """``(codes, scales)`` of the tensor ``x`` in ``fmt``, on ``x``'s device, as tensors.

    Args:
        ops: "torch" runs the torch formulas below; "auto" (default) does too, except for
            a CPU tensor, which :mod:`.host` quantizes in place of them (same bytes, over
            the tensor's own memory, ~5x faster than torch's eager CPU ops).
    """
    if ops == "auto" and x.device.type == "cpu":
        return _on_host(x, fmt, name)
    if isinstance(fmt, MXFP8):
        return quantize_mxfp8(x, fmt, name=name)
    if isinstance(fmt, BlockFP8):
        return quantize_block_fp8(x, fmt, name=name)
    raise FormatError(f"{name!r}: {fmt!r} is not a quantized format (BlockFP8 or MXFP8)")


def _on_host(x: Any, fmt: Any, name: str) -> tuple[Any, Any]:
    """:mod:`.host` over a CPU tensor's memory; the results wrapped as tensors (no copy)."""
    torch = _import_torch()
    from . import host
    _check(x, fmt, name)
    x = x.detach().contiguous()
    arr = x.view(torch.int16).numpy().view(numpy_dtype("bfloat16")) \
        if x.dtype == torch.bfloat16 else x.numpy()          # numpy has no bf16: its bits
    fn = host.quantize_mxfp8 if isinstance(fmt, MXFP8) else host.quantize_block_fp8
    codes, scales = fn(arr, fmt, name=name)
    return (torch.from_numpy(codes.view("uint8")).view(getattr(torch, fmt.dtype)),
            torch.from_numpy(scales))


def _check(x: Any, fmt: Any, name: str) -> None:
    dtype = dtype_name(x.dtype)
    if dtype not in QUANTIZABLE:
        raise FormatError(f"{name!r}: {fmt} quantizes {', '.join(QUANTIZABLE)} values, not "
                          f"{dtype} - cast first (to the dtype the trainer exports)")
    fmt.check_shape(tuple(x.shape), name)


def _canonical_nan(torch: Any, codes: Any, dtype: str) -> Any:
    """e4m3fn NaN codes (0x7F or 0xFF) as 0x7F; e4m3fnuz has one NaN (0x80) already."""
    if dtype == "float8_e4m3fn":
        bits = codes.view(torch.uint8)
        bits[bits == 0xFF] = 0x7F
    return codes


def quantize_block_fp8(x: Any, fmt: BlockFP8 = BlockFP8(), *, name: str = "tensor"
                       ) -> tuple[Any, Any]:
    """Block FP8 of ``x``: vLLM's ``per_block_cast_to_fp8(x, fmt.block, fmt.ue8m0)`` per
    matrix of the last two dims; codes of ``fmt.dtype``, float32 scale-inverses."""
    torch = _import_torch()
    _check(x, fmt, name)
    fp8 = getattr(torch, fmt.dtype)
    b0, b1 = fmt.block
    *lead, m, n = x.shape
    rows, cols = -(-m // b0), -(-n // b1)
    codes = torch.empty(x.shape, dtype=fp8, device=x.device)
    scales = torch.empty((*lead, rows, cols), dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // (math.prod(lead) * rows * b0 * b1))
    with torch.no_grad():
        for c in range(0, cols, step):
            c1 = min(cols, c + step)
            part = x[..., c * b1:min(n, c1 * b1)]
            padded = torch.zeros((*lead, rows * b0, (c1 - c) * b1), dtype=x.dtype,
                                 device=x.device)
            padded[..., :m, :part.shape[-1]] = part
            view = padded.view(*lead, rows, b0, c1 - c, b1)
            amax = view.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(1e-4)
            sf = amax / fmt.fp8_max
            if fmt.ue8m0:
                sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
            q = (view * (1.0 / sf)).to(fp8).view_as(padded)[..., :m, :part.shape[-1]]
            codes[..., c * b1:min(n, c1 * b1)] = q
            scales[..., c:c1] = sf.view(*lead, rows, c1 - c)
    scales[torch.isnan(scales)] = float("nan")
    return _canonical_nan(torch, codes, fmt.dtype), scales


def quantize_mxfp8(x: Any, fmt: MXFP8 = MXFP8(), *, name: str = "tensor") -> tuple[Any, Any]:
    """MXFP8 of ``x``: vLLM's ``_mxfp8_e4m3_quantize_torch(x)`` (row-major scales)."""
    torch = _import_torch()
    _check(x, fmt, name)
    group, k = MXFP8.group, x.shape[-1]
    flat = x.reshape(-1, k)
    codes = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((flat.shape[0], k // group), dtype=torch.uint8, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // k)
    with torch.no_grad():
        for r in range(0, flat.shape[0], step):
            blocked = flat[r:r + step].to(torch.float32).view(-1, k // group, group)
            amax = blocked.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
            biased = (torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max))
                      + 127.0).clamp(0, 254)
            # a NaN group's byte: 0, what torch's cast gives on x86 and CUDA (C++ leaves it
            # undefined)
            scales[r:r + step] = torch.where(torch.isnan(biased), 0, biased).to(torch.uint8)
            descale = torch.exp2(biased - 127.0)
            codes[r:r + step] = (blocked / descale.unsqueeze(-1)).view(-1, k).to(
                torch.float8_e4m3fn)
    return (_canonical_nan(torch, codes.view(x.shape), "float8_e4m3fn"),
            scales.view(*x.shape[:-1], k // group))
