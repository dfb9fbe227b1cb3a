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
``(class name, message)`` and are raised again as the same class (``error_from``).
"""

from __future__ import annotations


class XreshardError(ValueError):
    """Base class of every error xreshard raises for bad input."""


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
    """The processes of one world joined with different ``num_processes`` or ``groups``:
    raised by every one of them (the members that formed first learn it at their next
    collective within the join timeout), naming who passed what."""


class CommunicationError(RuntimeError):
    """Moving bytes or metadata between processes failed; not the caller's input."""


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
    """An error raised on another process whose class is not one of xreshard's."""


#: classes that may be raised again from a name that crossed processes
_BY_NAME: dict[str, type[Exception]] = {c.__name__: c for c in (
    XreshardError, LayoutError, PlanError, RefitError, BindingError, WorldMismatch,
    CommunicationError,
    TransportError, TransportTimeout, CollectiveMismatch, VerificationError, WorldBroken,
    AuthenticationError, RemoteError)}


def error_name(exc: BaseException) -> str:
    """The name under which ``exc`` crosses processes: its class when it is one of
    xreshard's, else its nearest xreshard base, else the kind it belongs to."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _BY_NAME and _BY_NAME[cls.__name__] is cls:
            return cls.__name__
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
        return "RefitError"     # a framework rejecting the caller's objects: bad input
    if isinstance(exc, TimeoutError):
        return "TransportTimeout"
    return "RemoteError"


def error_from(name: str, message: str) -> Exception:
    """The exception ``name`` (from ``error_name``) with ``message``; unknown names (a
    tampered payload) become ``RemoteError``."""
    cls = _BY_NAME.get(name, RemoteError)
    return cls(message)
