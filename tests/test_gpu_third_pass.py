"""Issue 33 (the third review of the GPU paths, shared/reference/gpu_review.md), on CPU:
each point tested with the smallest fake of the CUDA or NCCL rule it breaks. The GPU runs
of the same paths are scripts/gpu_check.sh's probes (``a1_shrink``, ``a3_fp8_stage``,
``b1_slow_producer``, ``b2_split_blocks``)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from xreshard.runtime import comm_epochs, world_links
from xreshard.runtime.comm_epochs import Abilities

from . import fake_cupy


# ---------------------------------------------------------------------------- A4

class _Parked:
    usable = True

    def close(self):
        pass


class _Epochs:
    """The few members ``WorldLinks._nccl_epoch`` reads, over a world of 3 processes (one
    rank each) whose process c died; the other process's NCCL is ``theirs``."""

    def __init__(self, theirs):
        self.theirs = theirs
        self.num_ranks = 2
        self._rank_ids = (0,)
        self._store = None
        self._world_id = "w"
        self._parked_nccl = (_Parked(), ("a/0", "b/0", "c/0"))

    def allgather_json(self, payload, timeout, kind):
        other = {**payload, "can": self.theirs} if "can" in payload else dict(payload)
        return [payload, other]

    def _wait_seconds(self):
        return 5.0

    def _rank_members(self, ranks):
        return tuple(("a/0", "b/0")[r] for r in ranks)


@pytest.mark.parametrize("theirs, action", [
    ({"shrink": True, "grow": True, "split": True}, "shrink"),
    ({"shrink": False, "grow": False, "split": True}, "recreate"),   # an NCCL < 2.27 there
])
def test_nccl_epoch_abilities_are_agreed_over_the_processes(monkeypatch, theirs, action):
    """A4: this process's NCCL can shrink, the other's cannot: both must take the same step
    (recreate), not shrink here while the other makes a fresh communicator."""
    from xreshard.transport import nccl as nccl_module
    from xreshard.transport import routed
    monkeypatch.setattr(world_links, "_nccl_abilities",
                        lambda: Abilities(shrink=True, grow=True, split=True, name="nccl"))
    seen = []
    real = comm_epochs.decide

    def decide(*args):
        step = real(*args)
        seen.append(step.action)
        return step
    monkeypatch.setattr(comm_epochs, "decide", decide)
    monkeypatch.setattr(world_links, "_resize", lambda *a: "resized")
    monkeypatch.setattr(nccl_module, "NcclTransport", lambda *a, **k: "made")
    monkeypatch.setattr(routed, "RenumberedTransport", lambda inner, index, kind: inner)
    got = world_links.WorldLinks._nccl_epoch(_Epochs(theirs), "w/e1", (0, 1), {0: 0})
    assert seen == [action]
    assert got == ("resized" if action == "shrink" else "made")


def test_common_abilities_count_a_missing_answer_as_unable():
    mine = Abilities(shrink=True, grow=True, split=True, name="nccl")
    got = world_links._common_abilities(mine, [{"shrink": True, "grow": True, "split": True},
                                               None, ])
    assert (got.shrink, got.grow, got.split, got.name) == (False, False, False, "nccl")
    got = world_links._common_abilities(mine, [{"shrink": True, "grow": False, "split": True}])
    assert (got.shrink, got.grow, got.split) == (True, False, True)
