"""Which message codec a call runs (:mod:`.framing`): plain messages, or a delta call's on
host or device memory. The one place that chooses; the executor runs what it is given."""

from __future__ import annotations

from typing import Any

from ...config import Tuning
from ..delta_device import DeviceDeltaCodec
from .delta import DeltaCodec
from .framing import FIXED
from .kernels import Kernels

__all__ = ["message_codec"]


def message_codec(delta: Any, bindings: Any, tuning: Tuning,
                  kernels: Kernels | None = None) -> Any:
    """The message codec of a call: ``FIXED`` without ``delta`` (a ``DeltaCall``), else the
    delta codec of host memory, or of the device path where a binding is device memory or
    ``Tuning.host_device_ops`` asks for it (``bindings``: the call's ``StageBindings``)."""
    if delta is None:
        return FIXED
    kernels = Kernels.of(tuning) if kernels is None else kernels
    if kernels.device_path(*bindings.src, *bindings.dst):
        return DeviceDeltaCodec(delta, tuning, kernels)
    return DeltaCodec(delta)
