"""The rendezvous store: a stand-alone ``TCPStore``, bounded waits, and signed payloads.

Decision record. Processes meet through ``torch.distributed.TCPStore`` used stand-alone
(it never touches torch's default process group). Everything written to it is JSON.

Threat model (what the world's token protects, and what it does not):

- The store has no access control: any process that can reach its address can read and
  write every key. ``serve()`` therefore listens on loopback by default (and on exactly
  the interface it is given, never every interface behind the caller's back).
- With a token (``World.join(..., token=...)`` or ``XRESHARD_TOKEN``), every join record
  and every metadata payload is signed with HMAC-SHA256, bound to the world (its id and a
  nonce drawn by its members at join), the operation (kind and step) and the writing
  process. A process without the token cannot join, cannot learn which ranks it would
  get, and cannot make members accept metadata it wrote: members raise
  ``AuthenticationError`` naming the key. A forged or garbage join record is ignored.
- Not protected: denial of service (a process that reaches the store can delete keys or
  write garbage, and the refit fails within its timeout, never succeeds with wrong
  bytes), and the payload bytes on gloo/NCCL/shared memory, which are not encrypted or
  signed, as in torch.distributed: run refits on an isolated network.
- Without a token, payloads are still checked for shape, step, kind and writer, so
  garbage and out-of-step collectives raise a typed error, but a process on the network
  can impersonate a member.

Rejected: pickle anywhere (a store writer could run code in every reader); signing only
the join (members would accept forged metadata later); a challenge-response handshake
(needs a server of our own; the store cannot run code).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import socket
import time
from typing import Any, Sequence

from ..extras import require
from ..errors import (AuthenticationError, CollectiveMismatch, RefitError, TransportError,
                     TransportTimeout)

__all__ = ["Seal", "StoreServer", "connect", "parse_address", "serve", "token_from"]


def _tcp_store_class() -> Any:
    return require("torch.distributed", "torch", "the refit world rendezvous").TCPStore


def parse_address(address: str) -> tuple[str, int]:
    """``"tcp://host:port"``, ``"host:port"`` or ``"tcp://[::1]:port"`` -> ``(host, port)``."""
    if not isinstance(address, str):
        raise RefitError(f"store address must be a string 'tcp://host:port', got {address!r}")
    rest = address[len("tcp://"):] if address.startswith("tcp://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise RefitError(f"store address {address!r} is not 'tcp://host:port'")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class StoreServer:
    """Holds the master ``TCPStore`` every process of a world joins through.

    It listens on ``host`` only: torch's ``TCPStore`` master binds every interface when it
    opens its own socket, so the server binds the socket itself and hands it over
    (``master_listen_fd``). Keep it alive (and its process running) until every process has
    closed its world.

    Attributes:
        host: the interface it listens on.
        port: the port it got (the OS picks one when asked for port 0).
        address: ``"tcp://host:port"``, what to pass to ``World.join``.
        store: the master ``TCPStore`` itself.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 300.0):
        if not isinstance(host, str) or not host:
            raise RefitError(f"serve(host=...) needs an interface address such as "
                             f"'127.0.0.1', got {host!r}")
        tcp_store = _tcp_store_class()
        sock = _listen(host, port)
        try:
            self.store = tcp_store(host, sock.getsockname()[1], None, True,
                                   datetime.timedelta(seconds=timeout), wait_for_workers=False,
                                   master_listen_fd=sock.fileno(), use_libuv=True)
        except BaseException:
            sock.close()
            raise
        sock.detach()       # the store owns the descriptor now and closes it with itself
        self.host = host
        self.port = int(self.store.port)
        self.address = format_address(host, self.port)

    def close(self) -> None:
        """Stop serving (drops the store; clients still connected then fail)."""
        self.store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreServer(address={self.address!r})"


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (``"0.0.0.0"`` / ``"::"``: every
    interface, when asked for explicitly)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RefitError(f"cannot listen on {host!r}: {e}; pass an interface address such as "
                         f"'127.0.0.1'") from e
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise RefitError(f"cannot listen on {host}:{port}: {e}") from e
    sock.set_inheritable(False)
    return sock


def serve(host: str = "127.0.0.1", port: int = 0, *, timeout: float = 300.0) -> StoreServer:
    """Start a rendezvous store server; ``port=0`` (the default) lets the OS pick a free port.

    Args:
        host: the one interface to listen on. The default, loopback, admits processes of
            this host only; pass this host's address on an isolated network for other hosts
            (or "0.0.0.0" for every interface), and give the world a token
            (``World.join(..., token=...)``).
        port: the port; 0 for a free one (read it back from ``.port`` / ``.address``).
        timeout: default timeout of the server's own store operations, in seconds.

    Returns:
        The running ``StoreServer``.
    """
    return StoreServer(host, port, timeout=timeout)


def connect(address: str, timeout: float) -> Any:
    """A ``TCPStore`` client of the store at ``address``, within ``timeout`` seconds.

    TCPStore's own connect loop can outlast its timeout several times against a closed
    port, so reachability is probed first with plain sockets, each attempt bounded by the
    time left.

    Raises:
        TransportTimeout: nothing accepted a connection at ``address`` in time.
    """
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"could not reach the rendezvous store at {address} within "
                                   f"{timeout} s: {last}; is the store served (xreshard.serve) "
                                   f"and the address right?")
        try:
            socket.create_connection((host, port), timeout=min(left, 2.0)).close()
            break
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
    try:
        return _tcp_store_class()(host, port, None, False,
                                  datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
                                  wait_for_workers=False)
    except (RuntimeError, TimeoutError) as e:
        raise TransportTimeout(f"could not reach the rendezvous store at {address} within "
                               f"{timeout} s: {e}") from e


def wait_keys(store: Any, keys: Sequence[str], deadline: float) -> None:
    """``store.wait(keys)`` until ``deadline``; TransportTimeout on timeout, TransportError
    when the store itself fails."""
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        store.wait(list(keys), datetime.timedelta(seconds=remaining))
    except RuntimeError as e:   # torch's DistStoreError / DistNetworkError derive from it
        if time.monotonic() >= deadline - 0.01 or "timeout" in str(e).lower():
            raise TransportTimeout(str(e)) from e
        raise TransportError(f"the rendezvous store failed: {e}") from e


def token_from(token: str | bytes | None) -> bytes | None:
    """The token as bytes: the argument, else ``XRESHARD_TOKEN``, else None (unsigned)."""
    if token is None:
        token = os.environ.get("XRESHARD_TOKEN") or None
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes) or len(token) < 8:
        raise RefitError("a world token must be a str or bytes of at least 8 characters "
                         "(e.g. secrets.token_hex(16)), shared by every process of the world")
    return token


class Seal:
    """Signs and checks what one process writes into the store for one world.

    A sealed payload is a JSON object ``{"kind", "op", "process", "body", "mac"}`` where
    ``body`` is the JSON text of the value and ``mac`` the HMAC-SHA256 of the world, its
    nonce, kind, op, process and body under the token (empty without a token).

    Args:
        token: the shared secret, or None for unsigned payloads (still checked for shape,
            step, kind and writer).
        world_id: the world the payloads belong to.
        nonce: drawn by the members at join; binds payloads to this instance of the world.
    """

    def __init__(self, token: bytes | None, world_id: str, nonce: str = ""):
        self.token = token
        self.world_id = world_id
        self.nonce = nonce

    @property
    def signed(self) -> bool:
        return self.token is not None

    def _mac(self, kind: str, op: int, process: int, body: str) -> str:
        if self.token is None:
            return ""
        msg = json.dumps([self.world_id, self.nonce, kind, op, process, body])
        return hmac.new(self.token, msg.encode(), hashlib.sha256).hexdigest()

    def seal(self, kind: str, op: int, process: int, body: str) -> str:
        """The payload that process ``process`` writes for step ``op`` (``body``: JSON text)."""
        return json.dumps({"kind": kind, "op": op, "process": process, "body": body,
                           "mac": self._mac(kind, op, process, body)})

    def open(self, raw: bytes | str, *, key: str, kind: str, op: int, process: int,
             what: str = "") -> Any:
        """The value of a payload read at ``key``, after every check.

        Raises:
            AuthenticationError: (signed worlds) not signed with this world's token, or
                signed for another world, step or process.
            CollectiveMismatch: the writer was in another collective (``kind``) at this step,
                or (unsigned worlds) the payload is not one of this world's.
        """
        where = f"store key {key!r}{f' ({what})' if what else ''}"
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
            env = json.loads(text)
            fields = (env["kind"], env["op"], env["process"], env["body"], env["mac"])
            if not (isinstance(fields[0], str) and isinstance(fields[1], int)
                    and isinstance(fields[2], int) and isinstance(fields[3], str)
                    and isinstance(fields[4], str)):
                raise TypeError("fields of the wrong type")
        except (UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
            cls = AuthenticationError if self.signed else CollectiveMismatch
            raise cls(f"{where} does not hold an xreshard payload ({type(e).__name__}: {e}); "
                      f"something other than a member wrote it") from None
        env_kind, env_op, env_process, body, mac = fields
        if not self.signed and mac:
            raise AuthenticationError(f"{where} is signed with a token this process does not "
                                      f"have; pass the world's token (token= or "
                                      f"XRESHARD_TOKEN)")
        if self.signed and not hmac.compare_digest(
                mac, self._mac(env_kind, env_op, env_process, body)):
            raise AuthenticationError(f"{where} is not signed with this world's token; a "
                                      f"process without the token wrote it, or the members' "
                                      f"tokens differ")
        if env_op != op or env_process != process:
            cls = AuthenticationError if self.signed else CollectiveMismatch
            raise cls(f"{where} was written for step {env_op} by process {env_process}, "
                      f"expected step {op} by process {process}: a replayed or misplaced "
                      f"payload")
        if env_kind != kind:
            raise CollectiveMismatch(f"out of step at collective #{op}: process {process} "
                                     f"entered {env_kind!r} while this process entered "
                                     f"{kind!r} (an exception, a late, extra or concurrent "
                                     f"call on one side); the world is broken, join a new one")
        try:
            return json.loads(body)
        except ValueError as e:
            raise CollectiveMismatch(f"{where}: body is not JSON ({e})") from None
