"""Quantized formats of a destination tensor, as values: block FP8 and MXFP8.

A format says how a tensor's values are stored: 8-bit float codes of the same shape plus
one scale per *block* of elements. It is geometry and constants only; the arithmetic that
produces the bytes (numpy, JAX, torch, each matched byte for byte to the engine's own
function) lives in :mod:`xreshard.quant`.

* :class:`BlockFP8`: e4m3 codes plus a float32 *scale-inverse* per ``block`` (default
  128x128) tile of the last two dims: ``value = code * scale``. The scale tensor of a
  ``[rows, cols]`` tensor is ``[ceil(rows/128), ceil(cols/128)]``; a tail block past the
  tensor's end is partial (the quantizer pads it with zeros, so its amax covers real
  elements only). This is DeepSeek/Kimi checkpoints' ``weight`` + ``weight_scale_inv``
  and vLLM's online ``fp8_per_block``.
* :class:`MXFP8`: e4m3 codes plus one uint8 E8M0 scale (a biased power-of-two exponent)
  per 32 consecutive elements of the last dim: ``value = code * 2**(scale - 127)``. The
  last dim must be a multiple of 32 (vLLM asserts it).

Leading dims (stacked experts ``[E, N, K]``) are quantized one index at a time, as vLLM
does per expert: a block never spans two experts.

The block grid is anchored at the origin of *the tensor being quantized*. Which tensor
that is belongs to the destination, not to the format: for a checkpoint it is each HF
tensor (``q_proj.weight``, quantized globally, then sharded by vLLM's loaders, which
refuse shard edges off the grid); for vLLM's online methods it is the TP-local parameter
(``qkv_proj.weight`` of one rank, q, k and v rows together). :class:`QuantizedTensor`
names one such tensor and its scale tensor and checks layouts against the format.

Geometry helpers answer the questions a planner asks per region (all regions are in the
coordinates of the quantized tensor; ``shape`` is its full shape)::

    fmt = BlockFP8()                       # shape (300, 256): scales (3, 2)
    fmt.blocks(region, shape)              # [0:2, 0:1] for [0:200, 0:128]: blocks touched
    fmt.whole_blocks(region, shape)        # [0:1, 0:1]: blocks entirely inside (or None)
    fmt.is_aligned(region, shape)          # False: 200 is off the 128 grid (and not 300)
    fmt.scale_region(region, shape)        # the scales of an aligned region (else raises)
    fmt.data_region(blocks, shape)         # the elements of a block region, clipped

"A sender that holds a whole block quantizes it" is ``whole_blocks`` of what it sends;
the other blocks travel unquantized and are quantized by their receiver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

from ..dtypes import dtype_name, itemsize
from ..errors import LayoutError
from .geometry import Region

__all__ = ["BlockFP8", "MXFP8", "Format", "FormatError", "QuantizedTensor", "FP8_MAX",
           "format_from_dict"]


class FormatError(LayoutError):
    """A quantized format does not fit a tensor, its layout, its scales or what is
    offered to it (shape, dtype, block size, shard edges off the block grid)."""


#: the largest magnitude each fp8 code type is scaled to: vLLM's ``get_fp8_min_max``
#: (224 for e4m3fnuz on ROCm, deliberately below its finfo max of 240)
FP8_MAX: Mapping[str, float] = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 224.0}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Blocked:
    """Geometry shared by the formats: blocks tile the last ``len(block)`` dims.

    Subclasses define ``block`` (trailing block shape), ``dtype`` and ``scale_dtype``.
    """

    __slots__ = ()
    block: tuple[int, ...]
    dtype: str
    scale_dtype: str

    def block_shape(self, ndim: int) -> tuple[int, ...]:
        """The block over all ``ndim`` dims: 1 for every leading dim."""
        if ndim < len(self.block):
            raise FormatError(f"{self} quantizes tensors of at least {len(self.block)} dims, "
                              f"not {ndim}")
        return (1,) * (ndim - len(self.block)) + tuple(self.block)

    def check_shape(self, shape: Sequence[int], name: str = "tensor") -> tuple[int, ...]:
        """``shape`` as a tuple, or :class:`FormatError` when the format cannot hold it."""
        shape = tuple(int(n) for n in shape)
        if len(shape) < len(self.block):
            raise FormatError(f"{name!r} of shape {shape}: {self} quantizes tensors of at "
                              f"least {len(self.block)} dims")
        return shape

    def scale_shape(self, shape: Sequence[int], name: str = "tensor") -> tuple[int, ...]:
        """Shape of the scale tensor of a ``shape`` tensor: ceil-divided by the block."""
        shape = self.check_shape(shape, name)
        return tuple(_cdiv(n, b) for n, b in zip(shape, self.block_shape(len(shape))))

    def blocks(self, region: Region, shape: Sequence[int]) -> Region:
        """The block indices (scale coordinates) of every block ``region`` touches."""
        blk = self.block_shape(len(shape))
        return Region(tuple(a // b for a, b in zip(region.starts, blk)),
                      tuple(_cdiv(e, b) for e, b in zip(region.stops, blk)))

    def whole_blocks(self, region: Region, shape: Sequence[int]) -> Region | None:
        """The block indices of the blocks lying entirely inside ``region`` (a tail block
        counts whole when ``region`` reaches the tensor's end); None if there are none."""
        blk = self.block_shape(len(shape))
        starts = tuple(_cdiv(a, b) for a, b in zip(region.starts, blk))
        stops = tuple(_cdiv(e, b) if e == n else e // b
                      for e, b, n in zip(region.stops, blk, shape))
        if any(b <= a for a, b in zip(starts, stops)):
            return None
        return Region(starts, stops)

    def is_aligned(self, region: Region, shape: Sequence[int]) -> bool:
        """Whether every edge of ``region`` lies on the block grid or at the tensor's end:
        then ``region`` is made of whole blocks and its scales are its own."""
        blk = self.block_shape(len(shape))
        return all(a % b == 0 and (e % b == 0 or e == n)
                   for a, e, b, n in zip(region.starts, region.stops, blk, shape))

    def scale_region(self, region: Region, shape: Sequence[int], name: str = "tensor"
                     ) -> Region:
        """The scale tensor's region that belongs to an aligned ``region``.

        Raises:
            FormatError: ``region`` cuts a block (naming the dim and the edge).
        """
        if not self.is_aligned(region, shape):
            blk = self.block_shape(len(shape))
            d = next(d for d in range(len(shape)) if region.starts[d] % blk[d] or (
                region.stops[d] % blk[d] and region.stops[d] != shape[d]))
            raise FormatError(
                f"{name!r} of shape {tuple(shape)}: region {region} cuts a {blk[d]}-wide "
                f"block of dim {d} ({self}); a shard of a quantized tensor must start and "
                f"end on multiples of {blk[d]} (or at the tensor's end) so that its scales "
                "are its own - change the shard sizes or the block")
        return self.blocks(region, shape)

    def data_region(self, blocks: Region, shape: Sequence[int]) -> Region:
        """The elements of the blocks in ``blocks`` (scale coordinates), clipped to
        ``shape`` (a tail block is partial)."""
        blk = self.block_shape(len(shape))
        return Region(tuple(a * b for a, b in zip(blocks.starts, blk)),
                      tuple(min(e * b, n) for e, b, n in zip(blocks.stops, blk, shape)))

    def wire_bytes(self, shape: Sequence[int]) -> int:
        """Bytes of codes plus scales of a ``shape`` tensor (what crosses the wire)."""
        return (math.prod(shape) * itemsize(self.dtype)
                + math.prod(self.scale_shape(shape)) * itemsize(self.scale_dtype))


@dataclass(frozen=True, slots=True)
class BlockFP8(_Blocked):
    """Block-scaled FP8: codes of ``dtype`` plus float32 scale-inverses per ``block``.

    Reference (what the bytes must equal): vLLM's ``per_block_cast_to_fp8(x, block,
    use_ue8m0=ue8m0)`` (``vllm/utils/deep_gemm.py``) on the tensor being quantized:
    zero-pad to whole blocks, ``amax = max|x|`` per block clamped to 1e-4, ``scale =
    amax / fp8_max`` (448 for e4m3fn, 224 for e4m3fnuz), with ``ue8m0`` rounded up to a
    power of two, ``code = fp8(x * (1 / scale))``. DeepSeek-V3/Kimi-K2 checkpoints and
    vLLM's online ``fp8_per_block`` use the default ``BlockFP8()``.

    Args:
        block: block rows and columns (over the last two dims).
        dtype: ``"float8_e4m3fn"`` or ``"float8_e4m3fnuz"`` (ROCm MI300).
        ue8m0: scales rounded up to powers of two (still stored as float32): DeepGEMM's
            E8M0 scales, checkpoints whose config says ``"scale_fmt": "ue8m0"``.
    """

    block: tuple[int, int] = (128, 128)
    dtype: str = "float8_e4m3fn"
    ue8m0: bool = False

    kind = "block_fp8"          # class constants (not fields): the JSON tag and scale dtype
    scale_dtype = "float32"

    def __post_init__(self) -> None:
        block = tuple(self.block) if isinstance(self.block, (tuple, list)) else None
        if block is None or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise FormatError(f"BlockFP8 block {self.block!r} must be two positive ints "
                              "(rows, cols), e.g. (128, 128)")
        object.__setattr__(self, "block", block)
        dtype = _fp8_dtype(self.dtype, "BlockFP8")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.ue8m0, bool):
            raise FormatError(f"BlockFP8 ue8m0 must be a bool, not {self.ue8m0!r}")

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.kind, "block": list(self.block), "dtype": self.dtype,
                "ue8m0": self.ue8m0}

    def __str__(self) -> str:
        extra = ", ue8m0" if self.ue8m0 else ""
        short = "" if self.dtype == "float8_e4m3fn" else f", {self.dtype}"
        return f"block_fp8({self.block[0]}x{self.block[1]}{short}{extra})"


@dataclass(frozen=True, slots=True)
class MXFP8(_Blocked):
    """MXFP8: e4m3fn codes plus one uint8 E8M0 scale per 32 elements of the last dim.

    Reference: vLLM's ``_mxfp8_e4m3_quantize_torch``
    (``vllm/model_executor/layers/quantization/utils/mxfp8_utils.py``, the path
    ``mxfp8_e4m3_quantize`` takes without FlashInfer on SM100 or ROCm's Triton kernel):
    ``amax`` per group clamped to float32's tiny, ``scale = clamp(ceil(log2(amax / 448))
    + 127, 0, 254)`` as uint8, ``code = fp8(x / 2**(scale - 127))`` (saturating), scales
    row-major ``[..., K/32]`` (not swizzled). vLLM's online ``mxfp8`` method.
    """

    dtype: str = "float8_e4m3fn"

    kind = "mxfp8"
    scale_dtype = "uint8"
    group = 32
    block = (1, 32)

    def __post_init__(self) -> None:
        if _fp8_dtype(self.dtype, "MXFP8") != "float8_e4m3fn":
            raise FormatError(f"MXFP8 codes are float8_e4m3fn (vLLM's MXFP8_VALUE_DTYPE), "
                              f"not {self.dtype!r}")
        object.__setattr__(self, "dtype", "float8_e4m3fn")

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.dtype]

    def check_shape(self, shape: Sequence[int], name: str = "tensor") -> tuple[int, ...]:
        shape = _Blocked.check_shape(self, shape, name)
        if shape[-1] % self.group:
            raise FormatError(f"{name!r} of shape {shape}: MXFP8 groups 32 elements of the "
                              f"last dim, and {shape[-1]} % 32 != 0 (vLLM refuses it too) - "
                              "pad the tensor or quantize it as block_fp8")
        return shape

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.kind, "dtype": self.dtype}

    def __str__(self) -> str:
        return "mxfp8"


#: a quantized format
Format = BlockFP8 | MXFP8


def _fp8_dtype(dtype: Any, where: str) -> str:
    try:
        name = dtype_name(dtype)
    except LayoutError:
        name = str(dtype)
    if name not in FP8_MAX:
        raise FormatError(f"{where} codes must be one of {sorted(FP8_MAX)}, not {dtype!r}")
    return name


def format_from_dict(d: Mapping[str, Any]) -> Format:
    """A format from its :meth:`to_dict` (JSON): ``{"format": "block_fp8", ...}``."""
    kind = d.get("format") if isinstance(d, Mapping) else None
    if kind == BlockFP8.kind:
        block = cast("tuple[int, int]", tuple(int(b) for b in d.get("block", (128, 128))))
        return BlockFP8(block,                          # its length checked by BlockFP8
                        d.get("dtype", "float8_e4m3fn"), bool(d.get("ue8m0", False)))
    if kind == MXFP8.kind:
        return MXFP8(d.get("dtype", "float8_e4m3fn"))
    raise FormatError(f"unknown quantized format {d!r}; expected {{'format': 'block_fp8' | "
                      "'mxfp8', ...}")


# ---------------------------------------------------------------------------- one tensor

@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A destination tensor stored quantized: ``name`` holds the codes, ``scale`` the
    scales, in ``format``; ``shape`` is the codes' (= the unquantized tensor's) shape.

    JSON-serializable (:meth:`to_dict`): it crosses processes with the layouts.
    """

    name: str
    scale: str
    format: Format
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.format, (BlockFP8, MXFP8)):
            raise FormatError(f"{self.name!r}: format must be BlockFP8 or MXFP8, not "
                              f"{self.format!r}")
        if not self.name or not self.scale or self.name == self.scale:
            raise FormatError(f"quantized tensor {self.name!r} needs a scale tensor of its "
                              f"own name, got {self.scale!r}")
        object.__setattr__(self, "shape", self.format.check_shape(self.shape, self.name))

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.format.scale_shape(self.shape, self.name)

    def check_offer(self, dtype: Any) -> None:
        """Raise :class:`FormatError` unless unquantized ``dtype`` values can be quantized
        into this tensor: bfloat16, float16 or float32 (the values the trainer exports)."""
        name = dtype_name(dtype) if not isinstance(dtype, str) else dtype
        if name not in QUANTIZABLE:
            raise FormatError(f"{self.name!r} is stored as {self.format}: it can be filled "
                              f"from {', '.join(QUANTIZABLE)} values (quantized on the way), "
                              f"not from {name} - send the tensor in one of those dtypes")

    def check_request(self, fmt: Any) -> None:
        """Raise :class:`FormatError` unless ``fmt`` (what a sender offers or a caller asks
        for) is exactly this tensor's format: same kind, block size, codes and scales."""
        if fmt != self.format:
            raise FormatError(f"{self.name!r} is stored as {self.format} but {fmt} was "
                              f"requested; block sizes, code types and scale formats must "
                              f"match the destination's exactly - request {self.format}")

    def check_layouts(self, data: Any, scale: Any) -> None:
        """Check that the codes' and the scales' layouts fit each other and the format.

        Every rank holds whole blocks (its regions are :meth:`~_Blocked.is_aligned`) and
        exactly the scales of the blocks it holds; dtypes and shapes are the format's.

        Raises:
            FormatError: naming the tensor, the rank and the region.
        """
        fmt = self.format
        if tuple(data.shape) != self.shape or data.dtype != fmt.dtype:
            raise FormatError(f"{self.name!r}: its layout is {tuple(data.shape)} {data.dtype} "
                              f"but {fmt} stores it as {self.shape} {fmt.dtype}")
        if tuple(scale.shape) != self.scale_shape or scale.dtype != fmt.scale_dtype:
            raise FormatError(f"{self.scale!r} (the scales of {self.name!r}, {fmt}) has "
                              f"layout {tuple(scale.shape)} {scale.dtype}; expected "
                              f"{self.scale_shape} {fmt.scale_dtype}")
        for rank in sorted(data.rank_set | scale.rank_set):
            want = {fmt.scale_region(r, self.shape, self.name) for r in data.regions(rank)
                    if not r.is_empty}
            got = {r for r in scale.regions(rank) if not r.is_empty}
            if not _covers_exactly(got, want):
                raise FormatError(
                    f"{self.scale!r} on rank {rank} holds {sorted(map(str, got))} but the "
                    f"blocks of {self.name!r} there need scales "
                    f"{sorted(map(str, want))} ({fmt}); shard the scales like the codes")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scale": self.scale, "format": self.format.to_dict(),
                "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantizedTensor:
        return cls(d["name"], d["scale"], format_from_dict(d["format"]),
                   tuple(int(n) for n in d["shape"]))

    def __str__(self) -> str:
        return f"{self.name} {list(self.shape)} as {self.format} (scales {self.scale})"


#: dtypes a quantizer takes: the values a trainer exports (never quantize an fp32 master
#: when bf16 is what the engine would have loaded: the caller casts first)
QUANTIZABLE = ("bfloat16", "float16", "float32")


def _covers_exactly(got: set[Region], want: set[Region]) -> bool:
    """Whether the regions ``got`` hold exactly the elements of the regions ``want``
    (each set disjoint; a scale region may be split differently from the data's)."""
    if got == want:
        return True
    size = sum(r.size for r in got)
    if size != sum(r.size for r in want):
        return False
    return all(sum((g.intersect(w) or Region(w.starts, w.starts)).size for g in got) == w.size
               for w in want)
