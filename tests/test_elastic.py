"""Elastic worlds: membership epochs, members that leave or die between refits, processes
that join a running world (real processes, plain numpy bindings)."""

from __future__ import annotations

import json
import os

import pytest

import xreshard as xr
from xreshard.errors import CollectiveMismatch
from xreshard.runtime.store import Seal
from xreshard.tools.launch import Role, launch

from . import elastic_cases as cases


def test_a_payload_from_another_epoch_is_a_collective_mismatch():
    for token in (None, b"secret"):
        old = Seal(token, "w").at_epoch(1, "n1")
        new = Seal(token, "w").at_epoch(2, "n2")
        raw = old.seal("refit/check", 3, 0, json.dumps({"x": 1}))
        with pytest.raises(CollectiveMismatch, match="written in membership epoch 1, this "
                                                     "process is in epoch 2"):
            new.open(raw, key="k", kind="refit/check", op=3, process=0)
        assert old.open(raw, key="k", kind="refit/check", op=3, process=0) == {"x": 1}


def test_on_member_loss_is_validated():
    with pytest.raises(xr.RefitError, match="on_member_loss must be 'continue' or 'fail'"):
        xr.RefitConfig(on_member_loss="ignore")
    assert xr.RefitConfig().on_member_loss == "continue"


def test_leave_is_refused_on_a_fixed_world():
    pytest.importorskip("torch")
    with xr.serve() as server, xr.World.join(server.address, "solo", 1, num_processes=1,
                                             index=0, timeout=20) as world:
        assert world.epoch == 0 and not world.elastic and world.members == ("solo[0]",)
        with pytest.raises(xr.RefitError, match="not elastic"):
            world.leave()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["leave", "kill"])
def test_members_leave_or_die_and_join_between_refits(tmp_path, how):
    roles = [Role("plain", "trainer", 0, num_devices=2), Role("plain", "rollout", 0),
             Role("plain", "rollout", 1), Role("plain", "rollout", 2)]
    results = launch(cases.fleet_member, roles, args=(str(tmp_path / "flag"), how),
                     timeout=240, check=False, fail_fast=False)
    trainer, r0, r1, r2 = results
    for res in (trainer, r0, r2):
        assert res.ok, res.describe()
    if how == "kill":
        assert r1.returncode == -9
    else:
        assert r1.ok and r1.value == {"left": True}
    for res in (trainer, r0):
        v = res.value
        assert v["versions"] == [1, 2, 3]
        # rollout[1] is lost in call 2 (between calls: at its refit/check), never again
        assert v["lost"] == [[], ["rollout[1]"], []]
        assert v["epochs"][0] == 0 and v["epochs"][2] >= 1
        assert v["members"] == ["trainer[0]", "rollout[0]", "rollout[2]"]
    assert r2.value["versions"][-1] == 3 and r2.value["epoch"] >= 1
    assert r2.value["members"] == trainer.value["members"]


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine", "trainer"])
def test_a_process_killed_mid_refit(victim):
    """One trial of ``kill_peers.py --victim engine|trainer``: a killed engine process is
    lost and the survivors finish the call exact, refit without it, and the restarted
    process joins; a killed trainer (sole holder of its rows) fails every survivor with
    one typed error within the timeout + 5 s, and the restarted trainer refits exact."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import kill_engines

    args = argparse.Namespace(seed=3, timeout=10.0, transport="auto", victim=victim)
    summary = kill_engines.summarize([kill_engines.run_trial(0, args)], args.timeout)
    assert summary["hangs"] == 0, summary
    if victim == "engine":
        assert summary["survivors_completed"] == summary["next_refit_ok"] == 1, summary
        assert summary["rejoin_ok"] == 1 and summary["max_seconds"] <= 15, summary
    else:
        assert summary["one_typed_error"] == summary["restarted_trainer_ok"] == 1, summary
