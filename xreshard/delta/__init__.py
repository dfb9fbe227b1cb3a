"""Delta encoding of a bucket: send only the elements that changed since the last refit.

Per bucket (a contiguous region the refit moves), given the bytes last sent (the
baseline) and the new bytes of the same region: find the changed elements by comparing
bits, and encode them as whichever of three is smallest (the wire format and the choice:
:mod:`xreshard.delta.codec`)::

    dense            every element                       (most elements changed)
    bitmask + values 1 bit per element, changed values   (many scattered changes)
    runs + values    [start, length) runs, their values  (few changes, or long runs)

The receiver validates a message completely, then overwrites the changed elements: applying
twice is applying once (never XOR), and a malformed or truncated message raises
:class:`DeltaFormatError` with nothing written.

Three backends, one format, the same bytes::

    from xreshard import delta
    msg = delta.encode(old, new)     # numpy arrays, jax.Arrays (jitted, on their
                                     # devices) or torch tensors (on theirs)
    msg.kind, msg.nbytes             # "runs", 4216
    delta.apply(msg.to_bytes(), baseline_copy)     # in place (a new array for JAX)

Importing this package imports numpy only; the JAX and torch kernels load on first use.
Phase 2 of issue 22 wires these kernels into the executor's buckets, with the version
fences of a delta refit (see docs/delta.md).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .codec import (BITMASK, DENSE, HEADER_BYTES, KINDS, RUNS, DeltaFormatError, Encoded,
                    Header, choose, parse, payload_sizes)
from .host import apply_numpy, changed_mask, encode_numpy

__all__ = ["encode", "apply", "backend_of", "host_view", "DeltaFormatError", "Encoded", "Header",
           "choose",
           "payload_sizes", "parse", "HEADER_BYTES", "DENSE", "BITMASK", "RUNS", "KINDS",
           "changed_fraction"]


def backend_of(x: Any) -> str:
    """``"numpy"``, ``"jax"`` or ``"torch"``: which kernels take ``x``."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    raise TypeError(f"delta kernels take numpy arrays, jax.Arrays or torch tensors, got "
                    f"{type(x).__name__}")


def _on_host(x: Any, kind: str) -> bool:
    if kind == "jax":
        return all(d.platform == "cpu" for d in x.sharding.device_set)
    return x.device.type == "cpu"


def host_view(x: Any) -> np.ndarray:
    """A zero-copy numpy view of a CPU-resident JAX array or torch tensor (dtypes numpy
    lacks, such as torch's bf16 and fp8, as same-size integers: the kernels read bits)."""
    kind = backend_of(x)
    if kind == "numpy":
        return x
    if kind == "jax":
        return np.asarray(x)
    try:
        return x.detach().numpy()
    except TypeError:
        import torch
        same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return x.detach().view(same[x.element_size()]).numpy()


def encode(old: Any, new: Any, *, kernels: str = "auto") -> Encoded:
    """Encode ``new`` against the baseline ``old`` (two versions of one region, same
    backend, shape and dtype).

    Args:
        kernels: ``"auto"``: the numpy kernels for buffers in host memory (numpy arrays, and
            JAX arrays and torch tensors on the CPU, read in place: XLA's and torch's CPU
            stream compaction is many times slower), the backend's own kernels on an
            accelerator; ``"device"``: the backend's kernels wherever the buffers are.
    """
    kind = backend_of(new)
    if backend_of(old) != kind:
        raise TypeError(f"baseline is a {backend_of(old)} array, new a {kind} one")
    if kernels not in ("auto", "device"):
        raise ValueError(f"kernels={kernels!r}: pass 'auto' or 'device'")
    if kind == "numpy" or (kernels == "auto" and _on_host(new, kind) and _on_host(old, kind)):
        return encode_numpy(host_view(old), host_view(new))
    if kind == "jax":
        from .jax_kernels import encode_jax
        return encode_jax(old, new)
    from .torch_kernels import encode_torch
    return encode_torch(old, new)


def apply(message: Any, target: Any, *, kernels: str = "auto") -> Any:
    """Apply an encoded message (bytes or a host uint8 array) to ``target``: numpy and
    torch in place (returned), JAX as a new array on ``target``'s device. ``kernels`` as
    for :func:`encode`."""
    kind = backend_of(target)
    host = kind == "numpy" or (kernels == "auto" and _on_host(target, kind))
    if kind == "numpy" or (host and kind == "torch"):
        apply_numpy(message, host_view(target))
        return target
    if kind == "jax":
        from .jax_kernels import apply_jax
        return apply_jax(message, target, on_host=host)
    from .torch_kernels import apply_torch
    return apply_torch(message, target)


def changed_fraction(old: np.ndarray, new: np.ndarray) -> float:
    """Fraction of elements whose bits differ between two host versions of a tensor."""
    o, n = np.ascontiguousarray(old), np.ascontiguousarray(new)
    return float(np.count_nonzero(changed_mask(o, n)) / o.size) if o.size else 0.0
