"""Transports: grouped point-to-point moves of byte buffers between world ranks.

``base`` defines the protocol; ``local`` copies inside a process (numpy only);
``gloo`` moves CPU buffers between processes and imports torch, so it is loaded on first
use of ``GlooTransport`` / ``create_gloo_group`` rather than here. ``shm`` moves CPU
buffers between processes of one host through POSIX shared memory, ``cuda_ipc`` device
buffers between ranks on one GPU (CuPy, imported on use); ``select`` chooses per pair.
"""

from __future__ import annotations

from typing import Any

from .base import RecordingTransport, Transport, TransportError, TransportTimeout
from .local import LocalTransport

__all__ = ["Transport", "TransportError", "TransportTimeout", "RecordingTransport",
           "LocalTransport", "GlooTransport", "create_gloo_group", "ShmTransport",
           "CudaIpcTransport"]

_LAZY = {"GlooTransport": "gloo", "create_gloo_group": "gloo", "ShmTransport": "shm",
         "CudaIpcTransport": "cuda_ipc"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
