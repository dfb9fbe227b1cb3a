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


# ---------------------------------------------------------------------------- A3

class _Dev:
    """A device of the fake below: a context manager (allocations land on the current
    device), synchronizable, hashable by id."""

    current = [0]

    def __init__(self, i):
        self.id = i

    def __enter__(self):
        self.current.append(self.id)
        return self

    def __exit__(self, *exc):
        self.current.pop()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _Dev) and other.id == self.id

    def __hash__(self):
        return self.id


def _supported(dtype):
    """CuPy 14 ``_dtype.pyx`` ``check_supported_dtype``: only dtypes with a C type name
    (no float8; ml_dtypes' types are kind "V") can be allocated or run through a kernel."""
    if np.dtype(dtype).kind not in "biufc?":
        raise ValueError(f"Unsupported dtype {np.dtype(dtype)}")


class _CupyArray:
    """A CuPy array (not a numpy one): views of any dtype, but allocation and elementwise
    copies only of supported ones."""

    def __init__(self, a, device=0):
        self._a, self.device = a, _Dev(device)

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    nbytes = property(lambda self: self._a.nbytes)

    def view(self, dtype):
        return _CupyArray(self._a.view(dtype), self.device.id)

    def __setitem__(self, key, value):
        _supported(self.dtype)
        _supported(value.dtype)
        self._a[key] = value._a


def _empty(shape, dtype):
    _supported(dtype)
    return _CupyArray(np.zeros(shape, dtype), _Dev.current[-1])


def test_float8_device_bindings_are_staged_as_bits(monkeypatch):
    """A3: ``atomic=True`` (and elastic FP8 engines in reload mode, catch-up snapshots)
    stage float8 CUDA destinations: allocated and copied as unsigned ints, bit-exact."""
    import ml_dtypes

    from xreshard.runtime.atomic import Staging
    from xreshard.runtime.binding import Bound
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=_empty))
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 255, (4, 6), dtype=np.uint8)
    codes[codes == 0x7F] = 0                      # no NaN codes: compare bits anyway
    real = _CupyArray(codes.view(ml_dtypes.float8_e4m3fn).copy(), device=1)
    scales = _CupyArray(rng.standard_normal(3).astype(np.float32), device=1)
    bound = Bound({}, {(0, "w"): real, (0, "w.scale"): scales})
    staging = Staging()
    staged = staging.stage(bound)
    shadow = staged.bindings[(0, "w")]
    assert shadow is not real and shadow.dtype == real.dtype
    assert shadow._a.view(np.uint8).tobytes() == codes.tobytes()
    new = rng.integers(0, 0x70, (4, 6), dtype=np.uint8)
    shadow._a.view(np.uint8)[...] = new
    staging.commit()
    assert real._a.view(np.uint8).tobytes() == new.tobytes()
    again = staging.stage(bound)                  # kept across calls, refreshed
    assert again.bindings[(0, "w")] is shadow and staging.nbytes == 24 + 12
