"""The rendezvous store: a stand-alone ``TCPStore``, bounded waits, and signed payloads.

Decision record. Processes meet through ``torch.distributed.TCPStore`` used stand-alone
(it never touches torch's default process group). Everything written to it is JSON.

Threat model: what the world's token protects, from whom, and what each option costs.

- **Who can reach the store can write every key.** The store has no access control and
  its protocol is plaintext: any process that reaches its address can read, overwrite and
  delete every key. ``serve()`` therefore listens on loopback by default (and on exactly
  the interface it is given, never every interface behind the caller's back).
- **With a token** (``World.join(..., token=...)`` or ``XRESHARD_TOKEN``), everything a
  member writes is signed with HMAC-SHA256 under the token, and the MAC binds exactly:
  the ``world_id``; the world's instance nonce (below); the kind of write (join record,
  collective name, transport record); its step (collective number, transport round); and
  the writing process (its position, -1 for join records). Metadata payloads are
  additionally bound to the member set (a hash of every member's join record nonce), so a
  payload of one world instance never opens in another. Cost: one HMAC per payload
  (microseconds), and the token must reach every process out of band.
- **Instances.** Whoever starts the store (``StoreServer``: ``serve()``, ``launch``, an
  ``is_server`` joiner) draws a store nonce and writes it at ``xreshard/store`` before
  handing out the address. The first joiner of a world draws the world's instance nonce
  and publishes it once (``compare_set``) at ``xreshard/<world_id>/instance/<key id>``,
  signed with its token and bound to the store nonce it read (``<key id>`` is an HMAC of
  the token, so worlds with other tokens never share it; "open" without one). Join records
  carry and are signed with that nonce; records of another instance (an earlier world with
  the same token and ``world_id`` on this store, or a record copied from an old store) are
  refused by name and never take a member's slot. ``World.close`` retires the instance, so
  the next world with that ``world_id`` draws a fresh one. On a store xreshard did not
  start (no store nonce), the instance is bound to the world's key only.
- **What members refuse, at once.** A process without the token cannot join (members skip
  its records; it is refused as soon as ``num_processes`` records it cannot open exist),
  cannot learn which ranks it would get, and cannot make members accept metadata or
  transport records it wrote: members raise ``AuthenticationError`` naming the key.
  Members that disagree on ``num_processes`` or ``groups`` all raise ``WorldMismatch``
  (a signed marker tells members that already formed; cost: one store round trip, about
  50 us on loopback, per collective during the join timeout after joining).
- **Not protected:** denial of service. A process that reaches the store can delete or
  overwrite keys (the instance keys included: one that pins a stale instance before the
  first joiner, or rewrites it between joiners, makes the join fail), and then the join or
  refit fails within its timeout; it never succeeds with another member or wrong metadata.
  The payload bytes on gloo, NCCL and shared memory are neither signed nor encrypted (as
  in torch.distributed): run refits on an isolated network, and count every process of
  the user on the host inside the trust boundary (docs/security.md).
- **Without a token**, payloads are still checked for shape, step, kind, writer and
  instance, so garbage, out-of-step and stale writes raise a typed error, but any process
  that reaches the store can join or impersonate a member.

Rejected: pickle anywhere (a store writer could run code in every reader); signing only
the join (members would accept forged metadata later); a challenge-response handshake
(needs a server of our own; the store cannot run code); a store-wide instance nonce
signed by the server (``serve()`` does not know the worlds' tokens, and an old signed
nonce replays as well as an old record: freshness comes from the nonce drawn per world
and retired on close).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from typing import Any, Sequence

from ..config import env_token
from ..extras import require
from ..errors import (AuthenticationError, CollectiveMismatch, RefitError, TransportError,
                     TransportTimeout)
from ..transport.base import format_seconds

__all__ = ["Seal", "StoreServer", "connect", "parse_address", "serve", "token_from",
           "STORE_NONCE_KEY", "store_nonce"]

#: where the process that started the store publishes the store's nonce
STORE_NONCE_KEY = "xreshard/store"

#: seconds between two lines of a wait that lasts (see :mod:`xreshard.runtime.waiting`)
REPORT_SECONDS = 15.0

logger = logging.getLogger("xreshard.runtime.world")


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

    At start it draws a nonce and writes it at ``STORE_NONCE_KEY`` before anyone knows the
    address: every world joined through this store binds its instance to it, so records
    copied from another store never open here (``xreshard.runtime.store``).

    Attributes:
        host: the interface it listens on.
        port: the port it got (the OS picks one when asked for port 0).
        address: ``"tcp://host:port"``, what to pass to ``World.join``.
        store: the master ``TCPStore`` itself.
        nonce: this store instance's nonce (32 hex digits).
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
        self.nonce = secrets.token_hex(16)
        self.store.set(STORE_NONCE_KEY, json.dumps({"nonce": self.nonce}))
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
        # the machine's state, not the caller's input: an OSError (EADDRINUSE, EACCES, ...)
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
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
    begun = time.monotonic()
    deadline, report = begun + timeout, begun + REPORT_SECONDS
    last: Exception | None = None
    while True:
        if time.monotonic() >= report:      # a wrong address says so, not only at the end
            report = time.monotonic() + REPORT_SECONDS
            logger.warning("waiting for the rendezvous store at %s, for %s so far: %s; is it "
                           "served (xreshard.serve) and the address right?", address,
                           format_seconds(time.monotonic() - begun), last)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"could not reach the rendezvous store at {address} within "
                                   f"{format_seconds(timeout)}: {last}; is the store served "
                                   f"(xreshard.serve) and the address right?")
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
                               f"{format_seconds(timeout)}: {e}") from e


def store_nonce(store: Any) -> str:
    """The text the store's starter wrote at ``STORE_NONCE_KEY``; "" on a store xreshard
    did not start. Used only as binding material, so whatever is there counts."""
    try:
        if not store.check([STORE_NONCE_KEY]):
            return ""
        return store.get(STORE_NONCE_KEY).decode(errors="replace")
    except RuntimeError as e:
        raise TransportError(f"the rendezvous store failed: {e}") from e


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
    """The token as bytes: the argument, else ``XRESHARD_TOKEN`` (``config.env_token``),
    else None (unsigned)."""
    if token is None:
        token = env_token()
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
        nonce: binds payloads to one instance of the world: the world's instance nonce for
            join records, that and the member set for everything written after the join.
    """

    def __init__(self, token: bytes | None, world_id: str, nonce: str = "", epoch: int = 0):
        self.token = token
        self.world_id = world_id
        self.nonce = nonce
        self.epoch = epoch      # an elastic world's membership epoch (0: not written)

    @property
    def signed(self) -> bool:
        return self.token is not None

    def key_id(self) -> str:
        """Names this token in store keys without revealing it ("open" without one): worlds
        with other tokens never share a key named with it."""
        if self.token is None:
            return "open"
        return hmac.new(self.token, b"xreshard key id", hashlib.sha256).hexdigest()[:16]

    def with_nonce(self, nonce: str) -> Seal:
        """This seal for another instance of the world."""
        return Seal(self.token, self.world_id, nonce, self.epoch)

    def at_epoch(self, epoch: int, nonce: str) -> Seal:
        """This seal for membership epoch ``epoch`` of an elastic world (its own nonce)."""
        return Seal(self.token, self.world_id, nonce, epoch)

    def _mac(self, kind: str, op: int, process: int, body: str) -> str:
        if self.token is None:
            return ""
        msg = json.dumps([self.world_id, self.nonce, kind, op, process, body]
                         + ([self.epoch] if self.epoch else []))
        return hmac.new(self.token, msg.encode(), hashlib.sha256).hexdigest()

    def seal(self, kind: str, op: int, process: int, body: str) -> str:
        """The payload that process ``process`` writes for step ``op`` (``body``: JSON text)."""
        env = {"kind": kind, "op": op, "process": process, "body": body,
               "mac": self._mac(kind, op, process, body)}
        if self.epoch:
            env["epoch"] = self.epoch
        return json.dumps(env)

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
        if env.get("epoch", 0) != self.epoch:
            raise CollectiveMismatch(f"{where} was written in membership epoch "
                                     f"{env.get('epoch', 0)!r}, this process is in epoch "
                                     f"{self.epoch}: a member that missed an epoch change "
                                     f"(or a replay); it must join the running world again")
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
