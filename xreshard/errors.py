"""Every error xreshard raises, in three kinds that callers can tell apart.

- **Bad input** (``XreshardError``, a ``ValueError``): a layout, binding, name, shape,
  dtype or config that cannot work. Raised before any byte moves, identically on every
  rank of a refit; fix the input and call again (the world stays usable).
- **Communication failure** (``CommunicationError``, a ``RuntimeError``, never a
  ``ValueError``, so ``except ValueError`` around input handling does not swallow a dead
  peer): a timeout, a dead or silent peer, a transport error, a collective that another
  process entered out of step, a checksum mismatch. Bounded by ``RefitConfig.timeout``.
- **Authentication / tampering** (``AuthenticationError``, a ``CommunicationError`` and a
  ``PermissionError``): a join record or metadata payload that is not signed with the
  world's token, or signed for another world, collective or process.

Every message says what, where, and how to fix it. Errors that cross processes travel as
``(class name, message)`` and are raised again as the same class (``error_from``): every
subclass of ``XreshardError`` or ``CommunicationError``, wherever it is defined
(``NamingError`` in the adapters, ``ClusterError`` in the simulator, a third party's),
registers itself when its class is created. A class defined outside this module travels
under its full dotted name, and a process that never imported its module imports it
(only modules of the ``xreshard`` package) to raise it as itself.

An exception that is not xreshard's is classified by the *phase* of the call it happened
in (``error_name(exc, phase)``):

- ``"check"`` (binding, naming, adapters, checks, planning): ``RefitError``, bad input,
  refused on every rank; the world stays usable.
- ``"move"`` (the executor, transports, checksums): ``RemoteError``, a
  ``CommunicationError``: the transports are in an unknown state, the world breaks on every
  rank; a ``TimeoutError`` becomes ``TransportTimeout``.

Its message keeps the original class name (``"IndexError: ..."``).
"""

from __future__ import annotations

import importlib
from typing import Any

#: classes that may be raised again from a name that crossed processes: this module's
#: under their own name, every other module's under ``module.ClassName``
_BY_NAME: dict[str, type[Exception]] = {}


def _key(cls: type) -> str:
    return cls.__name__ if cls.__module__ == __name__ else f"{cls.__module__}.{cls.__qualname__}"


def _register(cls: type[Exception]) -> None:
    _BY_NAME[_key(cls)] = cls


class XreshardError(ValueError):
    """Base class of every error xreshard raises for bad input."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)


class LayoutError(XreshardError):
    """A layout cannot be built: bad mesh, bad placements, uneven JAX split, ..."""


class PlanError(XreshardError):
    """Source and destination layouts do not fit together."""


class RefitError(XreshardError):
    """A refit cannot start: bindings, names, configs or calls that do not fit together."""


class BindingError(RefitError):
    """A binding (local memory of a held region) does not match its layout: wrong shape,
    dtype, aliased, read-only, or missing where the layout says a rank holds a region."""


class WorldMismatch(RefitError):
    """The processes of one world joined with different ``num_processes`` or ``groups``,
    or one of them passed arguments it cannot join with (``num_processes=0``, a group not
    in ``groups``): raised by every one of them (the members that formed first learn it at
    their next collective within the join timeout), naming who passed what."""


class CommunicationError(RuntimeError):
    """Moving bytes or metadata between processes failed; not the caller's input."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)


class TransportError(CommunicationError):
    """The transport failed (a peer closed its connection, NCCL reported an error, ...)."""


class TransportTimeout(TransportError, TimeoutError):
    """A bounded wait ran out: a peer never posted its side, or died."""


class CollectiveMismatch(CommunicationError):
    """Processes entered different collectives at the same step (an exception, a late,
    extra or concurrent call on one side): the world is out of step and is marked broken."""


class VerificationError(CommunicationError):
    """``RefitConfig(verify=...)``: the checksum of a region differs between its sender
    and its receiver. The version does not advance."""


class WorldBroken(CommunicationError):
    """The world cannot run further collectives (an earlier one timed out or went out of
    step); join a new world to continue. The message names the first cause."""


class AuthenticationError(CommunicationError, PermissionError):
    """A join record or metadata payload failed authentication (no token, wrong token,
    or signed for another world, operation or process)."""


class RemoteError(CommunicationError):
    """An exception that is not xreshard's, raised while moving bytes (in any process of
    the call: a bug or a resource failure in the executor, a transport, a framework). The
    transports are in an unknown state: the world is broken on every rank."""


_register(XreshardError)
_register(CommunicationError)

#: what an exception that is not xreshard's becomes, by the phase it happened in
PHASES = ("check", "move")


def error_name(exc: BaseException, phase: str = "check") -> str:
    """The name under which ``exc`` crosses processes: its own class when xreshard's (or
    registered), else what ``phase`` makes of it (see the module docstring)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    for cls in type(exc).__mro__:
        if _BY_NAME.get(_key(cls)) is cls:
            return _key(cls)
    if phase == "check":
        return "RefitError"     # a framework or adapter rejecting the caller's objects
    if isinstance(exc, TimeoutError):
        return "TransportTimeout"
    return "RemoteError"


def error_message(exc: BaseException) -> str:
    """``exc``'s message as it crosses processes: a foreign exception keeps its class name."""
    text = str(exc)
    if any(_BY_NAME.get(_key(cls)) is cls for cls in type(exc).__mro__):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def short_name(name: str) -> str:
    """The class name of a crossing name (``"pkg.mod.NamingError"`` -> ``"NamingError"``)."""
    return name.rpartition(".")[2]


def error_from(name: str, message: str) -> Exception:
    """The exception ``name`` (from ``error_name``) with ``message``. A class of another
    module of the package is imported when this process has not yet; unknown names (a
    tampered payload, another version) become ``RemoteError``."""
    cls = _BY_NAME.get(name)
    if cls is None and name.startswith("xreshard.") and "." in name[len("xreshard."):]:
        try:
            importlib.import_module(name.rpartition(".")[0])
        except Exception:       # noqa: BLE001 - an unknown name is a RemoteError below
            pass
        cls = _BY_NAME.get(name)
    if cls is None:
        return RemoteError(f"{short_name(name)}: {message}")
    return cls(message)
