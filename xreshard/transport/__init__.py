"""Transports: grouped point-to-point moves of byte buffers between world ranks.

``base`` defines the protocol; ``local`` copies inside a process (numpy only);
``gloo`` moves CPU buffers between processes and imports torch, so it is loaded on first
use of ``GlooTransport`` / ``create_gloo_group`` rather than here.
"""

from __future__ import annotations

from typing import Any

from .base import RecordingTransport, Transport, TransportError, TransportTimeout
from .local import LocalTransport

__all__ = ["Transport", "TransportError", "TransportTimeout", "RecordingTransport",
           "LocalTransport", "GlooTransport", "create_gloo_group"]


def __getattr__(name: str) -> Any:
    if name in ("GlooTransport", "create_gloo_group"):
        from . import gloo
        return getattr(gloo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
