"""``RefitConfig(atomic=True)`` as an extension: the call moves into staging, copied into
the destinations only once every process confirmed it (:mod:`xreshard.runtime.atomic`)."""

from __future__ import annotations

from typing import Any

from . import Extension
from ..atomic import Staging

__all__ = ["Atomic"]


class Atomic(Extension):
    """Transactional destinations: shadows kept across calls (``staging.nbytes``)."""

    name = "atomic"
    keeps_destinations = True

    def __init__(self) -> None:
        self.staging: Staging | None = None

    def destinations(self, call: Any, dst: Any) -> Any:
        """``dst`` with its bindings replaced by staging (refreshed from the destinations).
        JAX destinations are new arrays (atomic already) and are not shadowed."""
        if dst is None or call.refit.receive_adapter == "jax":
            return dst
        if self.staging is None:
            self.staging = Staging()
        call.staged = True
        return self.staging.stage(dst)

    def commit(self, call: Any) -> None:
        if self.staging is not None:
            self.staging.commit()

    def abort(self) -> None:
        if self.staging is not None:
            self.staging.abandon()
