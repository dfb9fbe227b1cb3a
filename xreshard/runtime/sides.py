"""A refit's two sides in this process: which objects it sends and receives, which adapter
binds each, and what it keeps of them between calls (see :class:`xreshard.runtime.refit.Refit`).

Binding is local: an adapter (:mod:`xreshard.runtime.registry`) turns a framework object
into a :class:`~xreshard.runtime.binding.Bound` given the framework ids -> world ranks map
that the refit's first call gathered (``refit/identity``). Nothing here is collective.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from . import registry
from .binding import Bound, Rebuilt
from ..errors import RefitError

__all__ = ["Side", "Sides", "on_device"]


class Side:
    """One side (send or receive) of this process, as the last call bound it."""

    def __init__(self, name: str):
        self.name = name
        self.obj: Any = None            # what the next argument-less call binds
        self.adapter: str | None = None  # the adapter of the last bound object
        self.cache: dict = {}           # that adapter's BindContext.cache
        self.module: Any = None         # that adapter's module, this call
        self.dropped: str | None = None  # LABEL of an object the adapter would not keep


class Sides:
    """The send and receive sides of one refit in this process.

    Args:
        send / receive: the objects given to the ``Refit``.
        names / transpose / rules: as for ``Refit`` (handed to the adapters).
    """

    def __init__(self, send: Any, receive: Any, names: Any, transpose: Iterable[str],
                 rules: Any, world: Any):
        if isinstance(world, (str, bytes)) or not hasattr(world, "allgather_json"):
            raise RefitError(
                f"Refit's first argument is the World every process joined, got "
                f"{type(world).__name__} {world!r:.80}: join one first, world = xreshard.World"
                f".join(address, group, devices, num_processes=N, index=i), with the address "
                f"of xreshard.serve() (docs: README 'Use')")
        self.send, self.receive = Side("send"), Side("receive")
        self.send.obj, self.receive.obj = send, receive
        self._names = names
        self._transpose = frozenset(transpose)
        self._rules = rules
        self._world = world     # what a Rebuilt side is built from

    def __iter__(self) -> Any:
        return iter((self.send, self.receive))

    def take(self, send: Any, receive: Any) -> list[list[str]]:
        """Adopt this call's objects (None: keep the last); returns the problems found so
        far (as ``[class name, message]``)."""
        if send is not None:
            self.send.obj = send
        if receive is not None:
            self.receive.obj = receive
        for state in self:
            state.module = None
        dropped = self.send.dropped
        if send is None and dropped:
            return [["RefitError", f"this process sent {dropped} before and passed no send= "
                     f"now: a Refit keeps no reference to sent {dropped} (so the trainer can "
                     f"donate them); pass send=params on every call"]]
        return []

    def bind(self, side: Side, maps: Mapping[str, Any], memo: Any) -> Bound | None:
        """Bind ``side``'s object with the adapter that accepts it."""
        obj = side.obj
        if isinstance(obj, Rebuilt):
            obj = obj.build(self._world)
        if obj is None:
            return None
        if isinstance(obj, Bound):
            return obj
        found = registry.adapter_for(obj)
        if found is None:
            raise RefitError(f"cannot tell which framework {side.name}={type(obj).__name__} "
                             "belongs to; pass a JAX pytree, a torch state dict or module, or "
                             "an xreshard Bound (or register an adapter for it: "
                             "xreshard.runtime.registry.register_adapter)")
        entry, module = found
        side.module = module
        if side.adapter != entry.name:
            side.adapter, side.cache = entry.name, {}
        context = registry.BindContext(
            ranks=maps.get(entry.name, {}), local_ranks=tuple(maps["local"]),
            names=self._names, transpose=self._transpose,
            rules=self._rules if side.name == "send" else None, memo=memo,
            cache=side.cache)
        return module.refit_bind(obj, side.name, context)

    def forget(self) -> None:
        """Keep of each side's object only what its adapter allows: no sent JAX arrays (pass
        ``send=`` again), received JAX templates as ``ShapeDtypeStruct``s."""
        for state in self:
            obj, module = state.obj, state.module
            if obj is None or isinstance(obj, (Bound, Rebuilt)):
                continue
            if module is None:      # binding failed before finding it
                try:
                    found = registry.adapter_for(obj)
                except Exception:       # noqa: BLE001 - already reported by binding
                    found = None
                module = found[1] if found else None
            keep = getattr(module, "keep", None)
            if keep is None:
                continue
            state.obj = keep(obj, state.name)
            state.dropped = getattr(module, "LABEL", "arrays") if state.obj is None else None


def on_device(*bounds: Bound | None) -> bool:
    """Whether any binding of ``bounds`` is device memory (anything but a numpy array)."""
    for bound in bounds:
        if bound is None:
            continue
        values = bound.bindings.values()
        kinds = set(map(type, values))
        if kinds <= {np.ndarray}:
            continue
        for b in values:
            for arr in (b if isinstance(b, (list, tuple)) else (b,)):
                if not isinstance(arr, np.ndarray):
                    return True
    return False
