"""Shared memory among users and containers (issue "Trust, second pass" items 4, 5, 6, 12):
another user's names in /dev/shm cannot stop a refit, a name it owns never hides the real
error, peers in another pid namespace are never declared dead by pid, and a process whose
memory cannot be read in place falls back to segments. Each runs real processes; the
isolation (a second uid, a private /dev/shm, dropped capabilities, pid namespaces) comes
from ``tests/isolated.py`` and skips, with the reason, where the host cannot provide it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from xreshard.tools.launch import Role, launch

from . import isolated

pytestmark = pytest.mark.slow


def test_another_user_creating_derived_names_cannot_stop_an_shm_refit():
    """Another uid watches /dev/shm and creates every segment name derivable from what it
    sees (today's names came from the probe's); the refit over shm segments is exact."""
    got = isolated.run_isolated("squat", 3)
    trainer, receiver = got["values"]
    assert trainer["error"] is None, trainer
    assert receiver["error"] is None and receiver["exact"] == [True] * 3, receiver
    assert receiver["copied_in"] == 0 and trainer["copied_in"] > 0      # segments moved it
    assert got["names"]["foreign"], "the squatter created nothing: the test saw no probe"
    assert got["names"]["ours"] == []       # nothing of ours left; theirs left alone


def test_a_taken_name_is_drawn_again_and_cleanup_reports_the_first_cause():
    got = isolated.run_isolated("foreign_names")
    assert got["ok"] == [None, None] and got["exact"], got          # drew another name
    sender, receiver = got["bad"]
    assert receiver[0] == "TransportError", receiver                # not PermissionError
    assert "sender posted 100 bytes" in receiver[1] and "receive buffer has 99" in receiver[1]
    assert sender is not None
    foreign = sorted(got["names"]["foreign"])
    assert foreign == sorted(["xr" + "f00d" * 4 + "_0_p1_" + "ab" * 8,
                              "xr" + "f00d" * 4 + "_1_zz", "xr" + "f00d" * 4 + "_0_zz"])
    assert got["names"]["ours"] == []


def _pidns_available() -> str | None:
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else f"unshare --pid fails here: {proc.stderr[-200:]}"


@pytest.mark.parametrize("mount_proc", [True, False], ids=["own-proc", "host-proc"])
def test_a_peer_in_another_pid_namespace_is_not_watched_by_pid(mount_proc):
    """The receiver runs in its own pid namespace, sharing /dev/shm (docker --ipc=host
    without --pid=host); the trainer is a second late to every call, so the receiver
    waits past the dead-peer watcher's quarter second. The pair must not use shm's
    pid-based watcher: it takes gloo, and every refit is exact."""
    reason = _pidns_available()
    if reason:
        pytest.skip(reason)
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    results = launch([isolated.slow_trainer, isolated.pidns_receiver], roles,
                     args=(3, mount_proc), timeout=240)
    trainer, receiver = (r.value for r in results)
    assert receiver.get("error") is None, receiver
    assert trainer["error"] is None, trainer
    assert receiver["exact"] == [True] * 3
    assert receiver["route"] == trainer["route"] == "gloo"


def test_a_process_others_cannot_read_falls_back_to_segments():
    """ptrace_scope=1 (Yama) forbids process_vm_readv between siblings; here the sender is
    not dumpable and no process holds CAP_SYS_PTRACE, which the kernel refuses the same
    way. The pull probe fails, the pair moves through segments, the refit is exact."""
    control = [r.value for r in launch(isolated.refit_pair,
                                       [Role("plain", "trainer", 0), Role("plain", "rollout", 0)],
                                       args=(2, "shm", False), timeout=120)]
    assert control[1]["pulled"] > 0         # without the restriction it reads in place
    got = isolated.run_isolated("pull_refused", 2, drop="sys_ptrace")
    trainer, receiver = got["values"]
    assert trainer["error"] is None and receiver["error"] is None, got
    assert receiver["exact"] == [True, True]
    assert receiver["pulled"] == 0 and trainer["copied_in"] > 0
