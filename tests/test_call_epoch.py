"""A prepared call carries the membership epoch of the world it was prepared for, and
``run`` refuses it in a world at another epoch, before any byte moves (issue 32 item 1:
the epoch field of the prepared call itself, not only the ``Refit`` that holds it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import xreshard as xr
from xreshard.planner.prepare import CallOptions, EpochMismatch, prepare


def _layouts():
    shape = (8, 4)
    src = {"w": xr.Layout.from_placements(shape, "float32", xr.Mesh((2,), (0, 1)), ["S0"])}
    dst = {"w": xr.Layout.from_placements(shape, "float32", xr.Mesh((2,), (2, 3)), ["S1"])}
    return src, dst


class _Untouchable:
    """A transport that fails the test if anything is posted."""

    def __getattr__(self, name):
        raise AssertionError(f"the transport was used ({name}) by a refused call")


def test_run_refuses_a_call_prepared_for_another_epoch():
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import StageBindings

    src, dst = _layouts()
    prepared = prepare(src, dst, None, CallOptions(), ranks=range(4), epoch=3)
    assert prepared.epoch == 3
    assert prepare(src, dst, None, CallOptions(), ranks=range(4)).epoch is None
    bindings = StageBindings(({},), ({},))
    with pytest.raises(EpochMismatch, match="prepared for membership epoch 3 of its world, "
                                            "which is now at epoch 4"):
        run(prepared, bindings, _Untouchable(), timeout=5, epoch=4)
    assert issubclass(EpochMismatch, xr.RefitError)


def test_a_refit_refuses_its_prepared_call_after_the_epoch_moved():
    """A Refit's prepared call carries its world's epoch; a call held for another epoch is
    refused (typed, before any byte moves: the destinations keep their bytes, the version
    does not advance)."""
    torch = pytest.importorskip("torch")
    from xreshard.adapters.torch import Sharded

    server = xr.serve()
    world = xr.World.join(server.address, "epoch", 1, num_processes=1, index=0, timeout=30)
    try:
        shape = (16, 8)
        lay = xr.Layout.from_placements(shape, "float32", xr.Mesh((1,), (0,)), ["R"])
        source = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        target = torch.zeros(shape)
        refit = xr.Refit(world, send=xr.Bound({"w": lay}, {(0, "w"): source}),
                         receive={"w": Sharded(target, lay.mesh, ["R"], shape)},
                         config=xr.RefitConfig(timeout=30))
        refit()
        assert refit._prepared.epoch == world.epoch == 0
        assert np.array_equal(target.numpy(), source)
        # the same call, as if prepared for other members
        refit._prepared = dataclasses.replace(refit._prepared, epoch=world.epoch + 1)
        source += 1
        with pytest.raises(EpochMismatch, match="prepared for membership epoch 1"):
            refit()
        assert refit.version == 1
        assert np.array_equal(target.numpy(), source - 1)      # nothing moved
    finally:
        world.close()
        server.close()
