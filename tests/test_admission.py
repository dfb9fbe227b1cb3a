"""The admission handshake of an elastic world (``xreshard.runtime.admission``) over a real
store: a join request is admitted only when its process confirms the members' offer; a
request whose process is gone expires within the members' grace, one whose process gave
up is withdrawn, a refusal reaches the joiner at once, and a verdict written without the
world's token, or copied from another request, admits nobody."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

import xreshard as xr     # noqa: E402
from xreshard.runtime import admission, epochs     # noqa: E402
from xreshard.runtime.store import Seal, connect     # noqa: E402
from xreshard.transport.base import TransportTimeout     # noqa: E402

ME = {"group": "rollout", "index": 1, "host": "h", "pid": 1, "num_ranks": 1}


@pytest.fixture
def store():
    with xr.serve() as server:
        yield connect(server.address, 10)


class Joiner(threading.Thread):
    """``ask_in`` in a thread; the test plays the members."""

    def __init__(self, store, seal, seconds, record):
        super().__init__(daemon=True)
        self.args = (store, seal, seconds, record)
        self.rids: list[str] = []
        self.out: dict = {}

    def run(self):
        store, seal, seconds, record = self.args

        def ask():
            self.rids.append(epochs.request(store, seal, "join", ME))
            return self.rids[-1]

        try:
            self.out["record"], _ = admission.ask_in(
                store, seal, ME, time.monotonic() + seconds, seconds, "rollout[1]", ask,
                lambda: record.get("value"))
        except Exception as e:      # noqa: BLE001 - the test checks what it raised
            self.out["error"] = e

    def asked(self, n=1):
        deadline = time.monotonic() + 10
        while len(self.rids) < n:
            assert time.monotonic() < deadline, "the joiner never asked"
            time.sleep(0.01)
        return self.rids[n - 1]


@pytest.mark.parametrize("token", [b"secret", None])
def test_a_joiner_that_confirms_is_admitted(store, token):
    seal, record = Seal(token, "w"), {}
    joiner = Joiner(store, seal, 20, record)
    joiner.start()
    rid = joiner.asked()
    admission.offer(store, seal, rid, "3.7", 4)
    said = admission.Verdicts(store, seal, "3.7").collect([rid], time.monotonic() + 10)
    assert said == {rid: "confirmed"}
    record["value"] = {"epoch": 4, "members": ["a", "b"], "admitted": [rid]}
    joiner.join(10)
    assert joiner.out["record"]["admitted"] == [rid]


def test_a_request_whose_process_is_gone_expires_within_the_grace(store):
    seal = Seal(b"secret", "w")
    rid = epochs.request(store, seal, "join", ME)       # its process died right after
    admission.offer(store, seal, rid, "0.1", 1)
    t0 = time.monotonic()
    said = admission.Verdicts(store, seal, "0.1").collect([rid], time.monotonic() + 0.3)
    assert said == {rid: "expired"} and time.monotonic() - t0 < 5
    # a confirmation after the verdict changes nothing (first writer wins)
    assert admission.verdict(store, seal, rid, "0.1", "confirmed") == "expired"


def test_a_joiner_that_gives_up_withdraws(store):
    seal = Seal(b"secret", "w")
    joiner = Joiner(store, seal, 0.3, {})
    joiner.start()
    joiner.join(10)
    assert isinstance(joiner.out["error"], TransportTimeout)
    assert admission.withdrawn(store, seal, joiner.rids[0])


def test_a_refusal_reaches_the_joiner_at_once(store):
    seal = Seal(b"secret", "w")
    joiner = Joiner(store, seal, 30, {})
    joiner.start()
    rid = joiner.asked()
    admission.offer(store, seal, rid, "0.1", 1, refused="rollout[1] is a member already")
    joiner.join(10)
    assert isinstance(joiner.out["error"], xr.RefitError)
    assert "rollout[1] is a member already" in str(joiner.out["error"])


def test_a_slow_joiner_asks_again_and_is_admitted_next_round(store):
    seal, record = Seal(b"secret", "w"), {}
    joiner = Joiner(store, seal, 20, record)
    joiner.start()
    first = joiner.asked()
    # the members' grace ran out before the joiner confirmed round 0.1
    assert admission.verdict(store, seal, first, "0.1", "expired") == "expired"
    admission.offer(store, seal, first, "0.1", 1)
    second = joiner.asked(2)        # it saw the expired offer and asked again
    admission.offer(store, seal, second, "0.2", 1)
    said = admission.Verdicts(store, seal, "0.2").collect([second], time.monotonic() + 10)
    assert said == {second: "confirmed"}
    record["value"] = {"epoch": 1, "members": ["a"], "admitted": [second]}
    joiner.join(10)
    assert joiner.out["record"]["admitted"] == [second], joiner.out


def test_a_verdict_without_the_token_or_of_another_request_admits_nobody(store):
    seal = Seal(b"secret", "w")
    rid, other = (epochs.request(store, seal, "join", ME) for _ in range(2))
    forged = Seal(b"not-the-token", "w").seal("member/verdict", 0, -1, (
        f'{{"rid": "{rid}", "round": "0.1", "verdict": "confirmed", "why": ""}}'))
    store.set(f"xreshard/w/requests/{rid}/verdict/0.1", forged)
    copied = seal.seal("member/verdict", 0, -1, (
        f'{{"rid": "{other}", "round": "0.1", "verdict": "confirmed", "why": ""}}'))
    store.set(f"xreshard/w/requests/{other}/verdict/0.2", copied)       # another round's
    assert admission.verdict(store, seal, rid, "0.1", "expired") == "void"
    assert admission.verdict(store, seal, other, "0.2", "expired") == "void"
