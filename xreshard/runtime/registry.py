"""Adapters by name: which framework bridge binds a ``send=`` / ``receive=`` object.

The core never imports an adapter. It knows adapters as rows of a table, each a name, the
path of the module that implements it and the module the framework itself lives in (like
vLLM's ``register_engine(name, module, cls)``); a module is imported only when an object
is offered to it, and only once its framework is loaded (a torch tensor cannot exist in a
process that never imported torch). Built-in rows name xreshard's own bridges by module
path; a third party registers its own::

    xreshard.runtime.registry.register_adapter("mlx", "my_pkg.xreshard_mlx", requires="mlx")

An adapter module provides:

* ``accepts(obj) -> bool``: whether ``obj`` is one of its objects (cheap; must not import
  anything heavy);
* ``refit_bind(obj, side, context: BindContext) -> Bound``: the layouts and bindings of
  ``obj`` for ``side`` ("send" or "receive");

and optionally:

* ``identity(devices, ranks) -> [[framework id, world rank], ...]``: the ids its objects
  name this process's ranks by (a torch process-group rank, JAX device ids); the refit
  gathers them once and hands each adapter its own map in ``BindContext.ranks``;
* ``keep(obj, side) -> obj | None``: what a refit may keep of ``obj`` after a call (None:
  nothing, the caller passes it on every call; JAX drops sent arrays so they can be
  donated, and keeps received ones as ``ShapeDtypeStruct`` templates);
* ``write_snapshot(obj) -> written``: ``RefitConfig(check_writes=True)``: take what a
  write to ``obj``'s sent tensors would change (torch: content checksums and version
  counters) and return ``written() -> ["'name' (what changed)", ...]``, the tensors
  written since (see :mod:`xreshard.runtime.writes`; the older
  ``write_versions(obj) -> {name: int}``, counters alone, is still used when it is the
  only hook);
* ``LABEL``: how messages name its objects ("JAX arrays");
* ``capture_streams() -> (() -> context manager) | None``: the calling thread's current
  streams of its framework, to be made current in the thread of a refit started with
  ``Refit.start`` (torch's current CUDA stream is per thread; see ``runtime/handle.py``).

Rows are tried newest first, so a registration may shadow a built-in for the objects it
accepts.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Mapping

from ..errors import RefitError

logger = logging.getLogger(__name__)

__all__ = ["AdapterEntry", "BindContext", "adapter_for", "adapters", "identity",
           "register_adapter", "unregister_adapter", "warm"]


@dataclass(frozen=True)
class AdapterEntry:
    """One row of the adapter table.

    Attributes:
        name: the adapter's name ("torch", "jax"): keys its rank map and messages.
        module: import path of the module implementing it (imported on first use).
        requires: a module that must already be imported for an object to be one of its
            own (its framework); "" to always ask.
    """

    name: str
    module: str
    requires: str = ""

    def load(self) -> ModuleType:
        """The adapter module (imported now if it was not)."""
        try:
            return importlib.import_module(self.module)
        except ImportError as e:
            raise RefitError(f"adapter {self.name!r}: cannot import {self.module!r} ({e})"
                             ) from e

    def ready(self) -> bool:
        """Whether its framework is loaded, so its objects may exist in this process."""
        return not self.requires or self.requires in sys.modules


@dataclass
class BindContext:
    """What an adapter's ``bind`` gets from the refit besides the object.

    Attributes:
        ranks: this adapter's framework id -> world rank, for the processes of this
            process's world group (from its ``identity``); empty when none published any.
        local_ranks: this process's world ranks.
        names: default name -> canonical name, a mapping or a callable (or None).
        transpose: canonical names whose local tensors are ``[in, out]`` kernels of an
            ``[out, in]`` tensor.
        rules: naming rules (``xreshard.adapters.naming.NameMap`` or a sequence of rules),
            or None; adapters that cannot apply them refuse them.
        memo: the refit's layout memo (``xreshard.ir.layout.LayoutMemo``), so a refit called
            every step converts each sharding once; None: no memo.
        cache: a dict the adapter may keep per refit and side across calls (e.g. the names
            of a pytree structure); the refit empties it when the adapter changes.
    """

    ranks: Mapping[Any, int] = field(default_factory=dict)
    local_ranks: tuple[int, ...] = ()
    names: Any = None
    transpose: frozenset[str] = frozenset()
    rules: Any = None
    memo: Any = None
    cache: dict = field(default_factory=dict)


#: xreshard's own bridges, by module path (data: the core imports none of them)
_BUILTIN = (AdapterEntry("jax", "xreshard.adapters.jax", "jax"),
            AdapterEntry("torch", "xreshard.adapters.torch", "torch"))

_lock = threading.Lock()
_table: list[AdapterEntry] = list(_BUILTIN)


def register_adapter(name: str, module: str, *, requires: str = "") -> AdapterEntry:
    """Add (or replace, by name) an adapter: ``module`` is imported when an object is first
    offered to it. Returns its row.

    Raises:
        RefitError: ``name`` or ``module`` is not a non-empty str.
    """
    for what, value in (("name", name), ("module", module)):
        if not isinstance(value, str) or not value:
            raise RefitError(f"register_adapter: {what} must be a non-empty str, got "
                             f"{value!r}")
    entry = AdapterEntry(name, module, requires)
    with _lock:
        _table[:] = [e for e in _table if e.name != name] + [entry]
    return entry


def unregister_adapter(name: str) -> bool:
    """Remove the adapter ``name`` (a built-in too); whether there was one."""
    with _lock:
        before = len(_table)
        _table[:] = [e for e in _table if e.name != name]
        return len(_table) != before


def adapters() -> tuple[AdapterEntry, ...]:
    """Every row, newest first (the order objects are offered in)."""
    with _lock:
        return tuple(reversed(_table))


def adapter_for(obj: Any) -> tuple[AdapterEntry, ModuleType] | None:
    """The adapter that accepts ``obj`` (and its module), or None."""
    for entry in adapters():
        if entry.ready():
            module = entry.load()
            if module.accepts(obj):
                return entry, module
    return None


def identity(devices: Iterable[Any], ranks: Iterable[int]) -> dict[str, list]:
    """This process's framework ids per adapter: ``{name: [[id, world rank], ...]}``, from
    every loaded adapter that publishes ids (JSON-able, for the refit's identity
    exchange)."""
    devices, ranks = list(devices), list(ranks)
    out: dict[str, list] = {}
    for entry in adapters():
        if not entry.ready():
            continue
        fn = getattr(entry.load(), "identity", None)
        if fn is not None:
            ids = [[i, int(r)] for i, r in fn(devices, ranks)]
            if ids:
                out[entry.name] = ids
    return out


def warm() -> None:
    """Import now what binding needs, for every adapter whose framework is loaded: its
    module and its ``warm()`` (the torch adapter's imports ``torch.distributed.tensor``,
    seconds on a loaded machine). ``World.join`` and ``Refit`` call it before their
    first collective, so a refit's first call does not spend it between two collectives,
    where its peers wait for this process against the refit's timeout. Best effort: what
    fails here fails again at binding, where every process hears of it."""
    for entry in adapters():
        if not entry.ready():
            continue
        try:
            fn = getattr(entry.load(), "warm", None)
            if fn is not None:
                fn()
        except Exception:       # noqa: BLE001 - reported at binding instead
            logger.debug("warming adapter %r failed", entry.name, exc_info=True)
