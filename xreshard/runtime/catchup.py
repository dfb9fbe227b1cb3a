"""Catch-up from a replica: a process that joins a running elastic world (a new engine, or
one restarted after a crash) fills its destinations with the members' current version
from destination ranks that already hold the same regions, without the trainer and
without pausing the members' refits; it then takes part in the next refit like the rest.

```python
world = xr.World.join(address, "rollout", 1, elastic=True, index=2, groups=GROUPS,
                      wait=False)                    # not admitted yet: no refit waits for it
refit = xr.Refit(world, receive=xr.Rebuilt(build))  # as the members' receivers are built
report = refit.catch_up()       # report.version: the version it now holds, bit for bit
...                             # serve requests with it
refit()                         # admitted at the members' next refit; takes part in it
```

Decision record.

- **Servers.** Every member whose Refit receives in place (a :class:`Bound`, torch
  tensors; not JAX destinations, which are new arrays per call) serves catch-ups from a
  daemon thread, started after its first successful call in an elastic world. After each
  call it announces itself (signed, ``<world_id>/replica/<refit>/<label>``: its Refit's
  identity and version; several Refits of one process, e.g. a policy and a reference
  model or the vLLM backend's layer groups, each serve their own). It never touches the
  members' world: a catch-up is a world of its own
  (``<world_id>/catchup/<id>``, fixed, the world's token and store) formed by the joining
  process and the announced replicas among the current members (the epoch record), and
  runs ordinary refits there, so planning, balancing among replicas, transports and
  signing are the refit's. The trainer is in no such world: it cannot send a byte of it.
- **One version, never a mix.** While a server serves, its Refit copies its destinations
  into a snapshot at the end of each call, under a lock it holds for the whole call
  (``Refit.writing``), and the server takes one at once between calls: each snapshot is
  one completed version, whole, and the server keeps its last ``KEPT`` (two). The members'
  calls are collective, so the servers' latest versions differ by at most one: they agree
  on the newest version all of them hold a snapshot of, and serve it while their own
  refits go on (which pay one local copy of their destination bytes per call meanwhile).
  The joiner ends with exactly one version, bit-exact, named in its report and in
  ``refit.version``.
- **"Current version"** is therefore the version of the members' last completed call when
  the servers took their snapshots. A refit that completes during the catch-up makes the
  joiner one version behind: it is admitted at the members' next refit, adopts their
  version there (``fleet.adopt_version``) and receives that call's whole version like
  every receiver, so after it every process holds the same version. The joiner asks to
  join only after its catch-up, so no member's refit waits for it.
- **Formed ahead, kept until admitted.** Forming the catch-up world (a join, its
  transports) and the catch-up Refit's first plan are a fixed cost, about a small
  world's first call, against a move that is a fraction of a refit from the trainer.
  So a Refit that receives, made in a process not admitted yet, requests its catch-up
  world at once (``ahead``) and forms it in a thread of its own while the process builds
  the rest (an engine loads its model meanwhile); ``catch_up()`` finds it formed, and a
  second ``catch_up()`` reuses it, transports and plan. The servers wait for the joiner's
  next operation (``serve`` or ``close``: a signed store key per operation,
  ``<world_id>/catchup-ops/<id>/<n>``) at most the timeout after the last one, and stay
  armed meanwhile; the joiner uses the world within half of that, else forms another.
  Its first refit call (``finish``, before it asks to join) closes it on both sides.
  Only the processes the request named join it (the world's token; each one's label is
  checked after the join); every wait is bounded by ``RefitConfig.timeout``; a formed-
  ahead world that failed is formed again once by ``catch_up()`` within its timeout.
- **Fences.** A caught-up receiver starts with no delta baseline (``Refit.delta_state`` is
  fresh): with ``RefitConfig(delta=True)`` its first call in the world is dense for its
  regions, as for any new receiver; ``stale`` is False.
- Costs: while it serves, each serving process keeps up to two snapshots of its
  destination bytes (memory: 2x them; on GPU, device memory) and copies them once per
  own call, from the request (the joiner's Refit made) until the joiner's admission; the
  catch-up world is formed per joining Refit, in the background.
- Rejected: catching up inside the members' next refit (a relay stage through the
  replicas): the joiner would wait for the trainer's next step, and every member's call
  would carry the forward stage; serving from the live destinations under a lock held for
  the whole catch-up (a member's refit that comes meanwhile would wait for it).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
import weakref
from typing import Any

from ..config import Tuning
from ..errors import AuthenticationError, RefitError
from ..ir.layout import Layout
from .atomic import Staging
from .binding import Bound
from .copies import view_of
from .epochs import read_entry
from .joining import KEY_ROOT, label
from .store import connect, wait_keys
from ..transport.base import TransportTimeout

__all__ = ["ahead", "catch_up", "finish", "restricted", "serve"]

logger = logging.getLogger(__name__)

#: versions of snapshots a server keeps while it serves
KEPT = 2
#: seconds a server waits for the next request before it looks whether its world closed
WAKE = 1.0
#: seconds between two rounds of the servers' version agreement
POLL = 0.02
#: seconds a server waits for a request whose number was taken but not written, when a
#: later one is (its writer died between the two store operations)
SKIP = 10.0


#: where the catch-up requests are numbered, each replica's announcement (Refit identity,
#: member label), and each catch-up world's operations (request id, number)
REQUESTS, REPLICA, OPS = "catchups", "replica/{}/{}", "catchup-ops/{}/{}"


def restricted(bound: Bound | None, ranks: Any, rank_of: dict[int, int] | None = None
               ) -> Bound | None:
    """``bound`` over ``ranks`` only (renumbered by ``rank_of``): every layout becomes the
    explicit form of those ranks' regions, unioned over processes (``local_only``), so a
    catch-up world plans from what each process says it holds or needs, not from global
    layouts whose other ranks are not in it."""
    if bound is None:
        return None
    rank_of = rank_of or {r: r for r in ranks}
    layouts = {n: Layout.explicit_form(lay.shape, lay.dtype,
                                       {rank_of[r]: lay.regions(r) for r in ranks})
               for n, lay in bound.layouts.items()}
    bindings = {}
    for (r, n), b in bound.bindings.items():
        lay = bound.layouts[n]
        if r in rank_of:        # explicit form: one array per region
            bindings[(rank_of[r], n)] = b if not lay.is_product else \
                [view_of(b, lay, r, region) for region in lay.regions(r)]
    return Bound(layouts, bindings, finish=bound.finish, errors=list(bound.errors),
                 local_only=set(layouts))


def _catch_up_world(world: Any, sub_id: str, members: list[str], timeout: float) -> Any:
    """Join the catch-up world ``sub_id`` of ``members`` (labels: the joiner first, then
    its servers), with the elastic world's token, store and groups.

    Raises:
        AuthenticationError: a process joined it under another label (only the processes
            the request named, all of them holders of the world's token, form it).
    """
    from .world import World
    me = world.processes[world.process_index]
    sub = World.join(world.address, me["group"], list(world.local_devices),
                     num_processes=len(members), index=me["index"],
                     groups=world.membership.groups, world_id=sub_id, timeout=timeout,
                     token=world.membership.base.token)
    found = sorted(label(p) for p in sub.processes)
    if found != sorted(members):
        sub.close()
        raise AuthenticationError(f"catch-up world {sub_id!r} was joined by {found}, not by "
                                  f"the processes its request named ({sorted(members)})")
    return sub


def _agreed_version(sub: Any, server: Any, timeout: float
                    ) -> tuple[int, tuple[Bound, tuple[int, ...]] | None]:
    """One version every server holds a snapshot of: the newest common to all (each keeps
    its last two while it serves, and the members' calls are collective, so their latest
    versions differ by at most one). The joiner passes ``server=None``. Returns the version
    and this server's snapshot of it (with the world ranks it was taken at).

    Raises:
        RefitError: none in common within ``timeout`` (a replica stopped refitting
            behind the others).
    """
    deadline = time.monotonic() + timeout
    while True:
        held = server.held() if server is not None else None
        got = sub.allgather_json({"versions": held}, timeout=timeout, kind="catchup/version")
        sets = [set(g["versions"]) for g in got if g["versions"] is not None]
        common = set.intersection(*sets) if sets else set()
        if common:
            version = max(common)
            return version, server.snapshot(version) if server is not None else None
        if time.monotonic() >= deadline:
            raise RefitError(f"catch-up: the replicas hold no version in common "
                             f"({[sorted(x) for x in sets]}) after {timeout:.0f} s")
        time.sleep(POLL)


def _inner(sub: Any, config: Any, transport: str, **side: Any) -> Any:
    """The catch-up's Refit: its extensions are an explicit list (it binds only this
    process's ranks, stages nothing, keeps no delta baseline: ``for_catch_up``), not a
    rewritten config."""
    from .extensions import for_catch_up
    from .refit import Refit
    tuning = Tuning.from_env()      # what a Refit made without one takes
    return Refit(sub, config=dataclasses.replace(config, transport=transport),
                 tuning=tuning, name="catch-up", extensions=for_catch_up(config, tuning),
                 **side)


def _op_key(world: Any, rid: str, n: int) -> str:
    return f"{KEY_ROOT}/{world.world_id}/{OPS.format(rid, n)}"


# ------------------------------------------------------------------ the joining process


def replicas(world: Any, refit_id: str, exclude: str) -> list[str]:
    """The current members (labels) that announced a replica of Refit ``refit_id``."""
    out = []
    for who in world.membership.current_members():
        if who == exclude:
            continue
        body = world.published(REPLICA.format(refit_id, who), "member/replica")
        if isinstance(body, dict) and body.get("refit") == refit_id:
            out.append(who)
    return out


class _Session:
    """The joining process's side of one catch-up world: formed in a thread of its own
    (ahead of ``catch_up()``), then kept, with its transports and the catch-up Refit's
    plan, for every catch-up of its Refit until the joiner is admitted (``finish``).
    The servers wait for its next operation (a signed store key) at most ``timeout``
    after the last one; the joiner uses it only within half of that."""

    def __init__(self, refit: Any, servers: list[str], rid: str):
        world = refit.world
        self.world, self.servers, self.rid = world, servers, rid
        self.timeout = refit.config.timeout
        self.transport = refit.config.transport
        self.sub: Any = None
        self.inner: Any = None
        self.error: BaseException | None = None
        self.ops = 0
        self.until = 0.0            # monotonic: the servers wait for the next op until then
        self.ended = False
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._form, daemon=True,
                                       name="xreshard-catch-up-form")
        self.thread.start()

    def _form(self) -> None:
        world, me = self.world, label(self.world.processes[self.world.process_index])
        sub = None
        try:
            sub = _catch_up_world(world, f"{world.world_id}/catchup/{self.rid}",
                                  [me, *self.servers], self.timeout)
            with sub.limited(self.timeout):     # collective: the servers make it too
                sub.transport(self.transport)
        except BaseException as e:  # noqa: BLE001 - raised by catch_up(), in the caller
            self.error = e
            if sub is not None:
                sub.close()
            sub = None
        with self.lock:
            self.sub, self.until = sub, time.monotonic() + self.timeout
            if self.ended and sub is not None:      # finished while forming
                self._close()
        self.ready.set()

    def usable(self) -> bool:
        """Formed (or forming) and within half of the servers' wait for the next op."""
        return not self.ended and (not self.ready.is_set() or (
            self.sub is not None and not self.sub.broken
            and time.monotonic() < self.until - self.timeout / 2))

    def post(self, op: str) -> None:
        """Write the next operation for the servers (signed with the world's token)."""
        self.ops += 1
        body = {"op": op, "id": self.rid, "n": self.ops}
        self.world.publish(OPS.format(self.rid, self.ops), "member/catchup-op", body)

    def run(self, receive: Any, naming: dict[str, Any], config: Any) -> Any:
        """One catch-up over the formed world: the version, then the catch-up Refit."""
        self.post("serve")
        version, _ = _agreed_version(self.sub, None, self.timeout)
        if self.inner is None:
            if isinstance(receive, Bound):  # numbered by the elastic world's ranks
                ranks = self.world.rank_ids
                receive = restricted(receive, ranks, dict(zip(ranks, self.sub.rank_ids)))
            self.inner = _inner(self.sub, config, self.transport, receive=receive, **naming)
        self.inner.version = version - 1        # the call makes it ``version``
        try:
            report = self.inner()
        finally:
            self.until = time.monotonic() + self.timeout
        if not report.bytes_received + report.bytes_local:
            raise RefitError(f"catch-up {self.rid}: no byte reached this process (its receive "
                             f"side names no region of its ranks {list(self.world.rank_ids)} "
                             f"in world {self.world.world_id!r}); nothing was caught up")
        return report

    def end(self) -> None:
        """Tell the servers (when formed) and close; a session still forming closes when
        formed."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            if self.sub is not None:
                self._close()

    def _close(self) -> None:
        sub, self.sub = self.sub, None
        try:
            if not sub.broken:
                self.post("close")
        except Exception:       # noqa: BLE001 - the servers stop at their wait's end
            logger.debug("catch-up %s: the close was not written", self.rid, exc_info=True)
        sub.close()


#: the joining side's session of each Refit (weakly: a dropped Refit drops its session)
_SESSIONS: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()


def _start(refit: Any) -> _Session | None:
    """Request a catch-up world of ``refit``'s announced replicas and start forming it;
    None when no member serves ``refit``."""
    world = refit.world
    me = label(world.processes[world.process_index])
    servers = replicas(world, refit.refit_id, me)
    if not servers:
        return None
    rid = secrets.token_hex(8)
    world.publish(REQUESTS, "member/catchup", {
        "id": rid, "world": f"{world.world_id}/catchup/{rid}", "joiner": me,
        "servers": servers, "refit": refit.refit_id, "transport": refit.config.transport,
        "until": time.time() + refit.config.timeout}, numbered=True)
    return _Session(refit, servers, rid)


def ahead(refit: Any) -> None:
    """Form ``refit``'s catch-up world in the background, as soon as a Refit receives in a
    process that joined a running elastic world with ``wait=False`` (while it builds its
    model, its catch-up world and transports form). Never raises: ``catch_up()`` forms
    it again, and raises, if this one fails."""
    world = refit.world
    if not world.elastic or world.admitted or refit in _SESSIONS:
        return
    try:
        session = _start(refit)
    except Exception:       # noqa: BLE001 - catch_up() tries again and raises
        logger.debug("catch-up: forming ahead failed", exc_info=True)
        return
    if session is not None:
        _SESSIONS[refit] = session


def finish(refit: Any) -> None:
    """The joiner's catch-ups are over (it is being admitted, or its Refit closes): end
    its catch-up world, and the servers' side of it."""
    session = _SESSIONS.pop(refit, None)
    if session is not None:
        session.end()


def catch_up(refit: Any, receive: Any, naming: dict[str, Any]) -> Any:
    """Fill ``refit``'s receive side (``receive``, bound with ``naming``: names, transpose,
    rules) with the members' current version from their replicas (see the module
    docstring); returns the catch-up's report.

    Raises:
        RefitError: not a joining process of an elastic world, or no member serves
            ``refit``.
        CommunicationError: forming the catch-up world or moving failed, within the
            configured timeout.
    """
    world = refit.world
    if not world.elastic or world.admitted:
        raise RefitError("catch_up() is for a process that joined a running elastic world "
                         "with World.join(..., elastic=True, wait=False) and has not been "
                         "admitted yet (its first refit call admits it); members hold the "
                         "version already")
    deadline = time.monotonic() + refit.config.timeout
    session = _SESSIONS.get(refit)
    if session is not None and session.usable():
        session.ready.wait(max(deadline - time.monotonic(), 0))
    if session is None or not session.usable() or session.sub is None:
        if session is not None:     # failed, expired or still forming past the timeout
            finish(refit)
        session = _start(refit)
        if session is None:
            raise RefitError(
                f"catch-up in world {world.world_id!r}: no member serves Refit "
                f"{refit.refit_id!r} (none received in place in this elastic world yet); "
                f"call refit() instead: the next refit sends this process the version "
                f"from the sources")
        _SESSIONS[refit] = session
        session.ready.wait(max(deadline - time.monotonic(), 0) + 5.0)
        if session.sub is None:
            finish(refit)
            raise session.error or TransportTimeout(
                f"catch-up world {session.rid} of {world.world_id!r} did not form within "
                f"{refit.config.timeout:.0f} s (servers {session.servers})")
    try:
        report = session.run(receive, naming, refit.config)
    except BaseException:
        finish(refit)       # its world is broken or out of step: form a new one next time
        raise
    return dataclasses.replace(report, epoch=world.epoch)


# ------------------------------------------------------------------ the serving members


class _Server:
    """One serving process's thread: reads the catch-up requests that name it, in log
    order, and serves each in a thread of its own (two joiners at once do not wait for
    each other, whatever order the servers read them in). While it serves, the Refit
    keeps a snapshot of each of its last ``KEPT`` versions (``keep``, at the end of each
    call, under ``Refit.writing``), with the world ranks it was taken at."""

    def __init__(self, refit: Any):
        world = refit.world
        self.refit = weakref.ref(refit)
        self.world = weakref.ref(world)
        self.lock = threading.Lock()
        self.users = 0
        self.snaps: dict[int, tuple[Bound, tuple[int, ...]]] = {}
        # requests numbered from now on (a joiner reads the announcement made after this)
        self.seal, self.root = world.membership.base, f"{KEY_ROOT}/{world.world_id}/{REQUESTS}"
        self.store = connect(world.address, world.timeout)
        self.following = int(self.store.add(f"{self.root}/count", 0)) + 1
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name="xreshard-catch-up")
        self.thread.start()

    def keep(self, refit: Any) -> None:
        """End of a call (``Refit.writing`` held): snapshot its version while serving."""
        with self.lock:
            if self.users and refit.served is not None and refit.version not in self.snaps:
                self.snaps[refit.version] = (Staging().stage(refit.served),
                                             tuple(refit.world.rank_ids))
                for v in [v for v in self.snaps if v <= refit.version - KEPT]:
                    del self.snaps[v]

    def held(self) -> list[int]:
        with self.lock:
            return sorted(self.snaps)

    def snapshot(self, version: int) -> tuple[Bound, tuple[int, ...]]:
        with self.lock:
            return self.snaps[version]

    def _arm(self, refit: Any, on: bool) -> None:
        with self.lock:
            self.users += 1 if on else -1
            if not self.users:
                self.snaps = {}
        # the version it holds now, when no call runs (else that call's end keeps its own)
        if on and refit.writing.acquire(blocking=False):
            try:
                self.keep(refit)
            finally:
                refit.writing.release()

    def _loop(self) -> None:
        """Wait for the next request key (a blocking store wait on a connection of its
        own: no polling), serve the requests that name this process."""
        store, seal, root, following = self.store, self.seal, self.root, self.following
        behind: float | None = None     # since when a later request is there, not this one
        while True:
            world, refit = self.world(), self.refit()
            if world is None or refit is None or world.closed:
                return
            key = f"{root}/{following}"
            try:
                wait_keys(store, [key], time.monotonic() + WAKE)
                timed_out = False
            except TransportTimeout:
                timed_out = True
            except Exception:   # noqa: BLE001 - a server never takes its process down
                logger.debug("catch-up server: the store failed", exc_info=True)
                return
            if timed_out:
                # a later request is written: this number was taken, and its write is late
                # (a loaded machine) or never comes (its writer died in between): skip it
                # only after SKIP seconds, so a late write is still read
                try:
                    next_written = store.check([f"{root}/{following + 1}"])
                except Exception:   # noqa: BLE001 - the store is gone (its host ended)
                    logger.debug("catch-up server: the store failed", exc_info=True)
                    return
                if next_written:
                    behind = behind or time.monotonic()
                    if time.monotonic() - behind > SKIP:
                        following, behind = following + 1, None
                continue
            following, behind = following + 1, None
            req = read_entry(store, seal, key, "member/catchup")
            me = label(world.processes[world.process_index])
            if isinstance(req, dict) and me in req.get("servers", ()) \
                    and req.get("refit") == refit.refit_id \
                    and float(req.get("until", 0)) > time.time():
                self._arm(refit, True)
                threading.Thread(target=self._serve, args=(req,), daemon=True,
                                 name="xreshard-catch-up-serve").start()
            del world, refit

    def _next_op(self, store: Any, req: dict[str, Any], n: int, timeout: float) -> str:
        """The joiner's ``n``-th operation ("serve" or "close"), or "close" when none came
        within ``timeout`` (or this process's world closed)."""
        world = self.world()
        if world is None:
            return "close"
        key = _op_key(world, req["id"], n)
        deadline = time.monotonic() + timeout
        while not world.closed and time.monotonic() < deadline:
            try:
                wait_keys(store, [key], min(deadline, time.monotonic() + WAKE))
            except TransportTimeout:
                continue
            body = read_entry(store, self.seal, key, "member/catchup-op")
            if isinstance(body, dict) and body.get("id") == req["id"] and body.get("n") == n:
                return str(body.get("op"))
            return "close"      # not the joiner's (not signed with the token, or replayed)
        return "close"

    def _serve(self, req: dict[str, Any]) -> None:
        """Form the catch-up world with the joiner, then serve each of its catch-ups
        until it says it is done (or goes silent for the timeout)."""
        refit, world = self.refit(), self.world()
        if refit is None or world is None:
            return
        timeout, kind = refit.config.timeout, str(req.get("transport") or "auto")
        store, inner, n = connect(world.address, timeout), None, 0
        try:
            with _catch_up_world(world, req["world"], [req["joiner"], *req["servers"]],
                                 timeout) as sub:
                with sub.limited(timeout):
                    sub.transport(kind)
                while True:
                    n += 1
                    if self._next_op(store, req, n, timeout) != "serve":
                        break
                    version, snap = _agreed_version(sub, self, timeout)
                    assert snap is not None     # a server always has its snapshot
                    bound, ranks = snap
                    send = restricted(bound, ranks, dict(zip(ranks, sub.rank_ids)))
                    if inner is None:
                        inner = _inner(sub, refit.config, kind, send=send)
                    inner.version = version - 1
                    report = inner(send=send)
                    logger.info("served catch-up %s to %s: v%d, %d bytes sent", req["id"],
                                req["joiner"], version, report.bytes_sent)
        except Exception:   # noqa: BLE001 - the joiner raises its own error
            logger.info("catch-up %s for %s failed here", req["id"], req["joiner"],
                        exc_info=True)
        finally:
            self._arm(refit, False)


def serve(refit: Any, server: Any) -> Any:
    """After a successful call of an elastic world's Refit that received in place:
    announce its version (signed) and make sure its server runs; returns the server."""
    world = refit.world
    if server is None or not server.thread.is_alive():
        server = _Server(refit)
    me = label(world.processes[world.process_index])
    world.publish(REPLICA.format(refit.refit_id, me), "member/replica",
                  {"refit": refit.refit_id, "version": refit.version})
    return server
