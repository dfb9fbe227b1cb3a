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
  runs one ordinary refit there, so planning, balancing among replicas, transports and
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
- **Fences.** A caught-up receiver starts with no delta baseline (``Refit.delta_state`` is
  fresh): with ``RefitConfig(delta=True)`` its first call in the world is dense for its
  regions, as for any new receiver; ``stale`` is False.
- Costs: while it serves, each serving process keeps up to two snapshots of its
  destination bytes (memory: 2x them; on GPU, device memory) and copies them once per
  own call; the catch-up world is formed per joining process (a join and a transport
  setup: about the first call of a small world).
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

from ..errors import RefitError
from ..ir.layout import Layout
from .atomic import Staging
from .binding import Bound
from .copies import view_of
from .epochs import read_entry
from .joining import KEY_ROOT, label
from .store import connect, wait_keys
from ..transport.base import TransportTimeout

__all__ = ["catch_up", "restricted", "serve"]

logger = logging.getLogger(__name__)

#: versions of snapshots a server keeps while it serves
KEPT = 2
#: seconds a server waits for the next request before it looks whether its world closed
WAKE = 1.0
#: seconds between two rounds of the servers' version agreement
POLL = 0.02


#: where the catch-up requests are numbered, and each replica's announcement
REQUESTS, REPLICA = "catchups", "replica/{}/{}"       # Refit identity, member label


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


def _catch_up_world(world: Any, sub_id: str, num: int, timeout: float) -> Any:
    from .world import World
    me = world.processes[world.process_index]
    return World.join(world.address, me["group"], list(world.local_devices),
                      num_processes=num, index=me["index"], groups=world.membership.groups,
                      world_id=sub_id, timeout=timeout, token=world.membership.base.token)


def _agreed_version(sub: Any, server: Any, timeout: float) -> tuple[int, Bound | None]:
    """One version every server holds a snapshot of: the newest common to all (each keeps
    its last two while it serves, and the members' calls are collective, so their latest
    versions differ by at most one). The joiner passes ``server=None``. Returns the version
    and this server's snapshot of it.

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


def _inner(sub: Any, config: Any, version: int, **side: Any) -> Any:
    from .refit import Refit
    inner = Refit(sub, config=dataclasses.replace(config, atomic=False, delta=False),
                  name="catch-up", **side)
    inner.version = version - 1         # the call makes it ``version``
    inner.own_only = True
    return inner


# ------------------------------------------------------------------ the joining process


def replicas(world: Any, refit_id: str, exclude: str) -> list[str]:
    """The current members (labels) that announced a replica of Refit ``refit_id``."""
    out = []
    for who in world.current_members():
        if who == exclude:
            continue
        body = world.published(REPLICA.format(refit_id, who), "member/replica")
        if isinstance(body, dict) and body.get("refit") == refit_id:
            out.append(who)
    return out


def catch_up(refit: Any, receive: Any, naming: dict[str, Any]) -> Any:
    """Fill ``refit``'s receive side (``receive``, bound with ``naming``: names, transpose,
    rules) with the members' current version from their replicas (see the module
    docstring); returns the catch-up's report."""
    world = refit.world
    if not world.elastic or world.admitted:
        raise RefitError("catch_up() is for a process that joined a running elastic world "
                         "with World.join(..., elastic=True, wait=False) and has not been "
                         "admitted yet (its first refit call admits it); members hold the "
                         "version already")
    me = label(world.processes[world.process_index])
    servers = replicas(world, refit.refit_id, me)
    if not servers:
        raise RefitError(f"catch-up in world {world.world_id!r}: no member serves Refit "
                         f"{refit.refit_id!r} (none received in place in this elastic world "
                         f"yet); call refit() instead: the next refit sends this process "
                         f"the version from the sources")
    timeout = refit.config.timeout
    rid = secrets.token_hex(8)
    sub_id = f"{world.world_id}/catchup/{rid}"
    world.publish(REQUESTS, "member/catchup", {
        "id": rid, "world": sub_id, "joiner": me, "servers": servers,
        "refit": refit.refit_id, "until": time.time() + timeout}, numbered=True)
    with _catch_up_world(world, sub_id, len(servers) + 1, timeout) as sub:
        version, _ = _agreed_version(sub, None, timeout)
        report = _inner(sub, refit.config, version, receive=receive, **naming)()
    return dataclasses.replace(report, epoch=world.epoch)


# ------------------------------------------------------------------ the serving members


class _Server:
    """One serving process's thread: reads the catch-up requests that name it, in log
    order, and serves each in a thread of its own (two joiners at once do not wait for
    each other, whatever order the servers read them in). While it serves, the Refit
    keeps a snapshot of each of its last ``KEPT`` versions (``keep``, at the end of each
    call, under ``Refit.writing``)."""

    def __init__(self, refit: Any):
        world = refit.world
        self.refit = weakref.ref(refit)
        self.world = weakref.ref(world)
        self.lock = threading.Lock()
        self.users = 0
        self.snaps: dict[int, Bound] = {}
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
                self.snaps[refit.version] = Staging().stage(refit.served)
                for v in [v for v in self.snaps if v <= refit.version - KEPT]:
                    del self.snaps[v]

    def held(self) -> list[int]:
        with self.lock:
            return sorted(self.snaps)

    def snapshot(self, version: int) -> Bound:
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
        while True:
            world, refit = self.world(), self.refit()
            if world is None or refit is None or world.closed:
                return
            key = f"{root}/{following}"
            try:
                wait_keys(store, [key], time.monotonic() + WAKE)
            except TransportTimeout:        # a number taken but never written: skip it
                if store.check([f"{root}/{following + 1}"]):
                    following += 1
                continue
            except Exception:   # noqa: BLE001 - a server never takes its process down
                logger.debug("catch-up server: the store failed", exc_info=True)
                return
            following += 1
            req = read_entry(store, seal, key, "member/catchup")
            me = label(world.processes[world.process_index])
            if isinstance(req, dict) and me in req.get("servers", ()) \
                    and req.get("refit") == refit.refit_id \
                    and float(req.get("until", 0)) > time.time():
                self._arm(refit, True)
                threading.Thread(target=self._serve, args=(req,), daemon=True,
                                 name="xreshard-catch-up-serve").start()
            del world, refit

    def _serve(self, req: dict[str, Any]) -> None:
        refit, world = self.refit(), self.world()
        if refit is None or world is None:
            return
        timeout = refit.config.timeout
        try:
            with _catch_up_world(world, req["world"], len(req["servers"]) + 1,
                                 timeout) as sub:
                version, bound = _agreed_version(sub, self, timeout)
                send = restricted(bound, world.rank_ids,
                                  dict(zip(world.rank_ids, sub.rank_ids)))
                report = _inner(sub, refit.config, version, send=send)()
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
