"""Admitting a process into a running elastic world: a join request is admitted only if
its process is still there to confirm it (:mod:`xreshard.runtime.epochs`).

Decision record. A join request is a line in the world's request log; the process that
wrote it may give up (its timeout), die, or never have been a real joiner (a line replayed
from an older world on the same store). Admitting such a request makes every member wait
for a ghost while forming the next epoch, until the timeout, then the world is broken.
So admission is a handshake, decided once for everyone:

1. The members, at a collective they agree on (a refit's ``refit/check``, a vLLM round's
   sync), pick the join requests they all saw and **offer** each one a round (named by the
   epoch and the collective step: the same on every member) at
   ``<world>/requests/<id>/offer``. A request under a member's label, one superseded by a
   later request for the same label, one withdrawn, or one whose process is gone (same
   host) gets a refusal or nothing instead, at once.
2. The joining process, polling while it waits, **confirms** the offer: it writes its
   verdict for that round with ``compare_set`` (first writer wins). The members wait a
   short grace (:data:`CONFIRM_GRACE`, at most half the call's timeout) for the verdicts,
   then write ``expired`` the same way for those not there. Every member reads the same
   verdicts, so every member admits the same processes; an unconfirmed request is dropped
   (never offered again) without moving the epoch.
3. A joining process that gives up writes ``withdrawn`` (its request key and the verdict
   of any offer it sees), so the members skip it; one whose offer expired (too slow) asks
   again with a new request while its timeout lasts. Once it confirmed, it waits one more
   timeout for the epoch that admits it: the members are forming it and would otherwise
   wait for it.

Every value is sealed with the world's token and names its request id and round (the seal
does not bind the key, the body does), so a process without the token can neither confirm
for a dead joiner nor move a verdict to another request. What remains: a process that
confirms and dies in the instant before forming the epoch still makes the members wait
for it until their timeout (the world is then broken, as before); a request line replayed
from an older world instance with the same token costs the members one grace, once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..errors import RefitError
from ..transport.base import TransportTimeout
from .joining import KEY_ROOT

__all__ = ["CONFIRM_GRACE", "Verdicts", "ask_in", "offer", "verdict"]

logger = logging.getLogger("xreshard.runtime.world")

#: seconds members wait at most for joining processes to confirm their offers
CONFIRM_GRACE = 5.0


def _key(seal: Any, rid: str, what: str) -> str:
    return f"{KEY_ROOT}/{seal.world_id}/requests/{rid}/{what}"


def _sealed(seal: Any, kind: str, body: dict[str, Any]) -> str:
    return seal.seal(kind, 0, -1, json.dumps(body))


def _open(store: Any, seal: Any, raw: Any, key: str, kind: str, rid: str) -> dict | None:
    """A sealed value of request ``rid``, or None (not this world's, or another request's)."""
    try:
        value = seal.open(raw, key=key, kind=kind, op=0, process=-1)
    except Exception:       # noqa: BLE001 - garbage or another token's: worth nothing
        logger.debug("skipped the value at %s", key, exc_info=True)
        return None
    return value if isinstance(value, dict) and value.get("rid") == rid else None


def _read(store: Any, seal: Any, rid: str, what: str, kind: str) -> dict | None:
    key = _key(seal, rid, what)
    if not store.check([key]):
        return None
    return _open(store, seal, store.get(key), key, kind, rid)


def verdict(store: Any, seal: Any, rid: str, round_id: str, value: str, why: str = ""
            ) -> str:
    """Write ``value`` as the verdict of request ``rid`` in ``round_id`` unless one is there
    (first writer wins); returns the verdict that holds ("confirmed", "expired",
    "withdrawn", or "void": not a value of this world's)."""
    key = _key(seal, rid, f"verdict/{round_id}")
    mine = _sealed(seal, "member/verdict", {"rid": rid, "round": round_id, "verdict": value,
                                            "why": why})
    got = _open(store, seal, store.compare_set(key, "", mine), key, "member/verdict", rid)
    return got["verdict"] if got is not None and got.get("round") == round_id else "void"


def offer(store: Any, seal: Any, rid: str, round_id: str, epoch: int,
          refused: str | None = None) -> None:
    """Offer request ``rid`` a place in ``epoch`` (round ``round_id``), or refuse it."""
    store.set(_key(seal, rid, "offer"), _sealed(seal, "member/offer", {
        "rid": rid, "round": round_id, "epoch": epoch, "refused": refused}))


def withdrawn(store: Any, seal: Any, rid: str) -> bool:
    """Whether the process of request ``rid`` gave up on it."""
    return _read(store, seal, rid, "withdrawn", "member/withdrawn") is not None


class Verdicts:
    """The members' side of one round: offers made, then verdicts collected."""

    def __init__(self, store: Any, seal: Any, round_id: str):
        self.store, self.seal, self.round_id = store, seal, round_id

    def collect(self, rids: list[str], deadline: float) -> dict[str, str]:
        """Wait until every request of ``rids`` has a verdict for this round, at most until
        ``deadline``; then expire the rest. The same result on every member."""
        keys = [_key(self.seal, rid, f"verdict/{self.round_id}") for rid in rids]
        pause = 0.005
        while keys and time.monotonic() < deadline:
            if all(self.store.check([k]) for k in keys):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return {rid: verdict(self.store, self.seal, rid, self.round_id, "expired",
                             "not confirmed within the members' grace")
                for rid in rids}


def ask_in(store: Any, seal: Any, me: dict[str, Any], deadline: float, timeout: float,
           where: str, request: Callable[[], str],
           read_epoch: Callable[[], dict[str, Any] | None]) -> tuple[dict[str, Any], float]:
    """The joining process's side: ask to join (``request()`` appends a request, returns its
    id), confirm the members' offer, and wait for the epoch record that admits it. Returns
    that record and the deadline left for forming the epoch (one more ``timeout`` from the
    confirmation: the members form it with this process now).

    Raises:
        RefitError: the members refused the request (a member has this label).
        TransportTimeout: no member round admitted it by ``deadline`` (it withdraws).
    """
    rid, confirmed = request(), None
    latest = deadline + timeout         # confirming again (a later round) extends no further
    pause = 0.01
    while True:
        record = read_epoch()
        if record is not None and rid in record.get("admitted", ()):
            return record, deadline
        got = _read(store, seal, rid, "offer", "member/offer")
        if got is not None and got.get("refused"):
            raise RefitError(f"{where}: the members refused this process: {got['refused']}")
        if got is not None and got.get("round") != confirmed:
            said = verdict(store, seal, rid, str(got["round"]), "confirmed")
            if said == "confirmed":
                confirmed = got.get("round")
                deadline = max(deadline, min(time.monotonic() + timeout, latest))
            elif time.monotonic() < deadline:       # too slow this round: ask again
                logger.info("%s: the members' offer expired before this process confirmed "
                            "it; asking again", where)
                rid, confirmed = request(), None
                continue
        if time.monotonic() >= deadline:
            _withdraw(store, seal, rid, confirmed)
            raise TransportTimeout(f"{where}: asked to join the running world, but no "
                                   f"epoch admitted it in time (members act on join "
                                   f"requests at their next refit call)")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _withdraw(store: Any, seal: Any, rid: str, confirmed: Any) -> None:
    """Give up request ``rid``: mark it, and take the verdict of an offer not confirmed yet
    (a member offering it after the mark sees it; one that offered before finds the
    verdict taken)."""
    store.set(_key(seal, rid, "withdrawn"), _sealed(seal, "member/withdrawn", {"rid": rid}))
    got = _read(store, seal, rid, "offer", "member/offer")
    if got is not None and got.get("round") != confirmed:
        verdict(store, seal, rid, str(got["round"]), "withdrawn")
