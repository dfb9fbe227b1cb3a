"""``RefitConfig(check_writes=True)``: a refit whose sender wrote its sent tensors while the
refit read them fails, with the same ``RefitError`` on every rank, and the version stays.

The sending process takes a :class:`Snapshot` of its send object when the call begins
(``Refit.start()``: before it returns, in the caller's thread) through its adapter's
``write_snapshot(obj)`` hook, and asks it once the executor returned (every source read)
which tensors were written since (:func:`check`). A written tensor is a ``RefitError``
raised while moving; the outcome exchange (``refit/outcome``) hands it to every rank, the
version does not advance and the world stays usable.

What is seen depends on the adapter: torch compares content checksums, on each tensor's
device, and version counters (:mod:`xreshard.adapters.torch_writes`); an adapter with only
the older ``write_versions(obj) -> {name: int}`` hook is checked by those counters. JAX
arrays are immutable, so a JAX sender has nothing to check; a :class:`Bound` is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import registry
from .binding import Bound
from ..errors import RefitError

__all__ = ["Snapshot", "check", "take"]

#: tensors a message names at most
_NAMED = 10


@dataclass(frozen=True)
class Snapshot:
    """What a send object held when a call began.

    Attributes:
        label: how messages name the adapter's objects ("torch tensors").
        written: lists the tensors written since, as ``"'name' (what changed)"``.
        error: why the snapshot could not be taken (reported before any byte moves).
    """

    label: str
    written: Callable[[], list[str]]
    error: BaseException | None = None


def take(obj: Any) -> Snapshot | None:
    """A snapshot of ``obj``'s sent tensors, or None when its adapter cannot see writes (no
    hook: JAX arrays are immutable) or ``obj`` is None or a ``Bound``. Never raises: a
    failure is kept in ``Snapshot.error``."""
    if obj is None or isinstance(obj, Bound):
        return None
    try:
        found = registry.adapter_for(obj)
        if found is None:
            return None         # binding says that no adapter takes it
        module = found[1]
        label = getattr(module, "LABEL", "tensors")
        hook = getattr(module, "write_snapshot", None)
        if hook is not None:
            return Snapshot(label, hook(obj))
        counters = getattr(module, "write_versions", None)
        return Snapshot(label, _counters(counters, obj)) if counters is not None else None
    except Exception as e:      # noqa: BLE001 - reported by the refit on every rank
        return Snapshot("tensors", list, RefitError(
            f"check_writes: could not take the digests of the sent tensors: "
            f"{type(e).__name__}: {e}"))


def check(snapshot: Snapshot | None) -> None:
    """Raise when a tensor of ``snapshot`` was written since it was taken.

    Raises:
        RefitError: naming the written tensors (at most ten) and what changed.
    """
    if snapshot is None or snapshot.error is not None:
        return
    written = snapshot.written()
    if written:
        more = f" and {len(written) - _NAMED} more" if len(written) > _NAMED else ""
        raise RefitError(f"sent {snapshot.label} were written while the refit read them: "
                         f"{', '.join(written[:_NAMED])}{more}; do not write sent tensors "
                         f"before handle.wait() (or the call) returns")


def _counters(versions: Callable[[Any], Mapping[str, int]], obj: Any
              ) -> Callable[[], list[str]]:
    """``written()`` from an adapter's version counters alone."""
    before = dict(versions(obj))

    def written() -> list[str]:
        now = versions(obj)
        return [f"{k!r} (version {v} -> {now[k]})" for k, v in before.items()
                if k in now and now[k] != v]
    return written
