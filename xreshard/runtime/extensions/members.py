"""Elastic worlds' catch-ups as extensions (:mod:`xreshard.runtime.catchup`): the joining
process's side, the serving members' side, and the catch-up's inner Refit, which binds
only this process's ranks."""

from __future__ import annotations

from typing import Any

from . import Extension

__all__ = ["CatchUpServer", "Joiner", "OwnRanks"]


class Joiner(Extension):
    """A process that joined a running elastic world with ``wait=False``: its catch-up
    world forms while it builds the rest, and ends once it is admitted."""

    name = "joiner"

    def made(self, refit: Any) -> None:
        if refit.receive_obj is not None and refit.world.elastic \
                and not refit.world.admitted:
            from .. import catchup
            catchup.ahead(refit)

    def entered(self, refit: Any) -> None:
        if refit.world.elastic:
            from .. import catchup
            catchup.finish(refit)       # the catch-ups are over (if any): end their world


class CatchUpServer(Extension):
    """An elastic world's member that receives in place serves its version to joiners:
    a snapshot of each of its last versions while one catches up."""

    name = "serve"

    def __init__(self) -> None:
        self._server: Any = None

    def commit(self, call: Any) -> None:
        refit = call.refit
        refit.served = call.dst if call.world.elastic and refit.receive_adapter != "jax" \
            else None

    def finished(self, refit: Any) -> None:
        if self._server is not None:        # serving a catch-up: snapshot it
            self._server.keep(refit)

    def released(self, refit: Any) -> None:
        if refit.served is not None and refit.world.elastic:
            from .. import catchup
            self._server = catchup.serve(refit, self._server)


class OwnRanks(Extension):
    """A catch-up world's inner Refit: bind what this process needs, no more."""

    name = "own_ranks"

    def bound(self, call: Any) -> None:
        from ..catchup import restricted
        call.dst = restricted(call.dst, call.world.rank_ids)
