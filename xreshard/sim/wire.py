"""What a transfer puts on the wire: the plan's dtype, block FP8, or a delta encoding.

``xreshard simulate --wire fp8`` prices the FP8 refit of block-FP8 engines (DeepSeek-V3,
Kimi-K2: e4m3 data plus one float32 scale per 128 x 128 block, ``weight_scale_inv``; see
../shared/reference/fp8.md section 1.1):

* the tensors vLLM keeps in FP8 are the linear layers' weights (attention, dense MLP,
  routed and shared experts: every ``*_proj`` weight, stacked experts included), not the
  embedding, the head, the router gate, norms or biases (the checkpoints' float32 scales
  cover "every projection except eh_proj, router, embed and head": shared/models/README);
* a transfer's 128 x 128 blocks (over its tensor's last two dims, anchored at the
  tensor's origin; a tail block at the tensor's edge is whole when the transfer reaches
  the edge) that lie wholly inside it were held whole by its sender, which quantizes them
  and sends 1 byte per element plus a 4-byte scale per block; the others are split across
  senders and travel in the plan's dtype, to be quantized by the receiver once their
  pieces land.

``--delta FRACTION`` prices a delta refit (../shared/reference/delta_lora.md section 2):
FRACTION of the elements changed, spread at random; every bucket the direct schedule cuts
is sent in the smallest of three encodings - dense, a bitmask (1 bit per element) plus the
changed values, or index runs (a 4-byte start and a 4-byte length per run of changed
elements, ``f (1 - f) n`` runs expected) plus the changed values - plus a 16-byte header.
Buckets and rounds stay the dense schedule's (both peers derive them from the plan, as
today; only the bytes shrink), so per-message latency is still paid per round.

Pure functions of shapes and counts; nothing here touches a device.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..dtypes import itemsize

__all__ = ["Wire", "quantized", "fp8_bytes", "delta_bytes", "delta_ratio", "wire_parts",
           "wire_regions", "WIRES"]

#: the formats ``--wire`` takes: the plan's dtype, or block FP8
WIRES = ("dtype", "fp8")

#: tensors that block-FP8 engines hold in FP8: linear weights (``*_proj.weight``, MLA's
#: ``kv_a_proj_with_mqa.weight``, stacked ``experts.gate_up_proj`` / ``experts.down_proj``)
QUANTIZED = re.compile(r"_proj(_with_mqa)?(\.weight)?$")

#: bytes of a delta message's header (encoding, counts)
DELTA_HEADER = 16


def quantized(name: str, shape: Sequence[int]) -> bool:
    """Whether a block-FP8 engine holds tensor ``name`` in FP8."""
    return len(shape) in (2, 3) and bool(QUANTIZED.search(name))


def _whole(start: int, stop: int, n: int, block: int) -> tuple[int, int]:
    """(blocks, elements in them) of ``[start, stop)`` lying wholly inside it, for a dim of
    ``n`` elements cut in blocks of ``block`` from 0 (the last block may be short)."""
    first = -(-start // block)                  # first block starting at or after start
    last = stop // block if stop < n else -(-n // block)
    if last <= first:
        return 0, 0
    return last - first, min(last * block, n) - first * block


def fp8_bytes(starts: Sequence[int], stops: Sequence[int], shape: Sequence[int],
              isz: int, block: int = 128) -> int:
    """Wire bytes of the region ``[starts, stops)`` of a block-FP8 tensor of ``shape``:
    1 byte per element and 4 per block for whole blocks, ``isz`` per other element."""
    rb, re_ = _whole(starts[-2], stops[-2], shape[-2], block)
    cb, ce = _whole(starts[-1], stops[-1], shape[-1], block)
    lead = math.prod(b - a for a, b in zip(starts[:-2], stops[:-2]))
    total = math.prod(b - a for a, b in zip(starts, stops))
    whole = lead * re_ * ce
    return whole + 4 * lead * rb * cb + isz * (total - whole)


def delta_bytes(dense: np.ndarray, elements: np.ndarray, changed: float) -> np.ndarray:
    """Bytes of messages of ``dense`` bytes holding ``elements`` elements when a fraction
    ``changed`` of the elements changed: the smallest encoding, plus the header."""
    dense = np.asarray(dense, np.float64)
    n = np.asarray(elements, np.float64)
    values = changed * dense
    bitmask = np.ceil(n / 8) + values
    runs = 8 * np.ceil(changed * (1 - changed) * n) + values
    best = np.minimum(dense, np.minimum(bitmask, runs))
    return np.where(dense > 0, np.ceil(best) + DELTA_HEADER, 0).astype(np.int64)


def delta_ratio(changed: float, isz: int) -> float:
    """Delta bytes per dense byte of a large bucket (header aside): for lower bounds."""
    return min(1.0, 1 / (8 * isz) + changed, 8 * changed * (1 - changed) / isz + changed)


@dataclass(frozen=True)
class Wire:
    """How the simulated refit puts bytes on the wire.

    Attributes:
        fmt: "dtype" (each tensor in the plan's wire dtype) or "fp8" (block FP8 for the
            tensors :func:`quantized` names, see the module docstring).
        block: the FP8 block edge.
        delta: the changed fraction of elements (delta refit), or None (dense).
    """

    fmt: str = "dtype"
    block: int = 128
    delta: float | None = None

    def __post_init__(self) -> None:
        from .simulate import SimulationError
        if self.fmt not in WIRES:
            raise SimulationError(f"wire format {self.fmt!r} is not one of {', '.join(WIRES)}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise SimulationError(f"the FP8 block must be a positive int, got {self.block!r}")
        if self.delta is not None and not 0.0 <= self.delta <= 1.0:
            raise SimulationError(f"--delta is the changed fraction of elements, in [0, 1]; "
                                  f"got {self.delta!r}")
        if self.delta is not None and self.fmt == "fp8":
            raise SimulationError(
                "--delta with --wire fp8 is not priced: a changed element requantizes its "
                "whole 128x128 block, so at any useful fraction nearly every block changes; "
                "price the FP8 refit dense, or the delta in the plan's dtype")

    @property
    def plain(self) -> bool:
        return self.fmt == "dtype" and self.delta is None

    def classes(self, names: Sequence[str], dtypes: Mapping[str, str],
                layouts: Mapping[str, Any]) -> tuple[np.ndarray, list[Any]]:
        """Per tensor of ``names`` a small class id, and per class what :meth:`key`
        needs: the itemsize of its dtype in ``dtypes``, or (itemsize, tensor shape) when
        the tensor travels block-quantized."""
        spec: dict[Any, int] = {}
        out: Any = np.empty(len(names), np.int64)
        for t, name in enumerate(names):
            isz = itemsize(dtypes[name])
            shape = layouts[name].shape
            c = (isz, tuple(shape)) if self.fmt == "fp8" and quantized(name, shape) else isz
            out[t] = spec.setdefault(c, len(spec))
        return out, list(spec)

    def key(self, cls: Any, region: Any) -> tuple[tuple[int, ...], Any]:
        """``(region shape, wire)`` of a region of a tensor of class ``cls``: ``wire`` is
        the itemsize, or ``("fp8", bytes)`` for a block-quantized transfer."""
        if isinstance(cls, int):
            return region.shape, cls
        isz, shape = cls
        return region.shape, ("fp8", fp8_bytes(region.starts, region.stops, shape, isz,
                                               self.block))

    def encode(self, nbytes: np.ndarray, elements: np.ndarray) -> np.ndarray:
        """Wire bytes of messages of ``nbytes`` (dense) holding ``elements`` elements."""
        if self.delta is None:
            return nbytes
        return delta_bytes(nbytes, elements, self.delta)

    def describe(self) -> str:
        parts = [f"block FP8 (e4m3 + float32 scale per {self.block}x{self.block} block) for "
                 "linear weights" if self.fmt == "fp8" else "the plan's dtypes"]
        if self.delta is not None:
            parts.append(f"delta: {self.delta:g} of elements changed, smallest of dense / "
                         "bitmask / index runs per bucket")
        return "; ".join(parts)


def wire_parts(shape: tuple[int, ...], wire: Any, size: int) -> tuple[tuple[int, ...],
                                                                      tuple[int, ...]]:
    """``(bytes, elements)`` of the parts a region of ``shape`` is cut into for buckets of
    ``size`` bytes: ``split_region``'s cut at ``wire`` (an itemsize) bytes per element, or
    for ``("fp8", total)`` at the transfer's mean bytes per element."""
    from .traffic import split_sizes
    if isinstance(wire, int):
        nbytes = split_sizes(shape, wire, size)
        return nbytes, tuple(b // wire for b in nbytes)
    total = wire[1]
    n = math.prod(shape)
    if n == 0:
        return (0,), (0,)
    cap = max(1, (size * n) // max(total, 1))       # elements per part: <= size bytes
    elems = split_sizes(shape, 1, cap)
    cum = np.cumsum(elems)
    edges = (cum * total) // n
    return tuple(np.diff(np.concatenate([[0], edges])).tolist()), elems


def wire_regions(region: Any, wire: Any, size: int) -> list[Any]:
    """The boxes :func:`wire_parts` cuts ``region`` into (same order, same cut)."""
    from ..planner.schedule import split_region
    if isinstance(wire, int):
        return split_region(region, wire, size)
    n = region.size
    return split_region(region, 1, max(1, (size * n) // max(wire[1], 1))) if n else [region]
