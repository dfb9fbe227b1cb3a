"""Delta kernels in torch ops, on the tensors' own device (a torch sender's side of a
delta refit, and a torch receiver applying one). Same format and same bytes as
:mod:`xreshard.delta.codec`'s numpy kernels.

Bits are compared through signed-integer views of the same width (torch implements
comparison for ``int16``/``int32``/``int64`` everywhere, not for every unsigned type);
equality of bits does not care about the sign. The mask is packed with a shift-and-sum
(torch has no ``packbits``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .codec import (BITMASK, DENSE, RUNS, DeltaFormatError, Encoded, Header, choose,
                    dense_wins_without_runs, parse)

__all__ = ["encode_torch", "apply_torch"]


def _torch() -> Any:
    from ..extras import require
    return require("torch", "torch", "the torch delta kernels")


def _words(t: Any, what: str) -> Any:
    """``t``'s elements as signed-int words: ``(n,)``, or ``(n, 2)`` int64 for 16 bytes."""
    torch = _torch()
    if not t.is_contiguous():
        raise ValueError(f"{what}: the delta kernels read contiguous buffers (a bucket); got "
                         "a strided view")
    isz = t.element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
    if isz not in word:
        raise DeltaFormatError(f"{what}: elements of {isz} bytes; the delta format takes 1-16")
    if t.numel() == 0:
        return t.new_empty((0, 2) if isz == 16 else (0,), dtype=word[isz])
    flat = t.reshape(-1)
    flat = flat.view(torch.uint8) if t.dtype == torch.bool else flat.view(word[isz])
    return flat.view(-1, 2) if isz == 16 else flat


def _packbits(mask: Any) -> Any:
    torch = _torch()
    n = mask.numel()
    pad = (-n) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits << shifts).sum(dim=1, dtype=torch.uint8)


def encode_torch(old: Any, new: Any) -> Encoded:
    """Encode ``new`` against the baseline ``old`` (same shape and dtype, same device);
    sections stay on the device."""
    torch = _torch()
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"baseline {tuple(old.shape)} {old.dtype} and new "
                         f"{tuple(new.shape)} {new.dtype}: a delta compares two versions of "
                         "the same region")
    o, w = _words(old, "baseline"), _words(new, "new")
    isz, n = new.element_size(), w.shape[0]
    diff = o != w
    if diff.dim() == 2:
        diff = diff.any(dim=1)
    count = int(torch.count_nonzero(diff)) if n else 0
    if count and dense_wins_without_runs(n, count, isz):
        return Encoded(Header(DENSE, isz, n, n, 0), (w,))
    idx = torch.nonzero(diff).reshape(-1)
    breaks = torch.nonzero(idx.diff() != 1).reshape(-1)
    nruns = breaks.numel() + 1 if count else 0
    kind = choose(n, count, nruns, isz)
    header = Header(kind, isz, n, count if kind != DENSE else n, nruns if kind == RUNS else 0)
    if kind == DENSE:
        return Encoded(header, (w,))
    values = w[idx]
    if kind == BITMASK:
        return Encoded(header, (_packbits(diff), values))
    ix = torch.int32 if header.width == 4 else torch.int64
    if count:
        first = torch.cat([breaks.new_zeros(1), breaks + 1])
        last = torch.cat([breaks, breaks.new_full((1,), count - 1)])
        starts = idx[first]
        table = torch.cat([starts, idx[last] + 1 - starts]).to(ix)
    else:
        table = idx.to(ix)
    return Encoded(header, (table, values))


def apply_torch(message: Any, target: Any) -> Any:
    """Overwrite ``target``'s changed elements with ``message``'s, in place (on its
    device); returns it. Validates on the host before writing anything."""
    torch = _torch()
    tw = _words(target, "target")
    msg = parse(message, target.element_size(), tw.shape[0])
    vals = np.asarray(msg.values)
    values = torch.from_numpy(vals.view({1: np.uint8, 2: np.int16, 4: np.int32}.get(
        vals.dtype.itemsize, np.int64)).copy()).to(tw.device).view((-1,) + tuple(tw.shape[1:]))
    if msg.header.kind == DENSE:
        tw.copy_(values.view(tw.shape))
    elif msg.header.count:
        idx = msg.mask().nonzero()[0] if msg.header.kind == BITMASK else msg.indices()
        tw[torch.from_numpy(idx).to(tw.device)] = values
    return target
