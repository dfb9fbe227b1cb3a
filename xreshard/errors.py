"""Errors raised for user mistakes. Every message says what, where, and how to fix it."""

from __future__ import annotations


class XreshardError(ValueError):
    """Base class of every error xreshard raises for bad input."""


class LayoutError(XreshardError):
    """A layout cannot be built: bad mesh, bad placements, uneven JAX split, ..."""


class PlanError(XreshardError):
    """Source and destination layouts do not fit together."""


class RefitError(XreshardError):
    """A refit cannot start or failed on some rank."""
