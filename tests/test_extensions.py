"""Call-level features as extensions (issue 32 item 3, issue 35 item 2): ``Refit`` names
no feature and imports no feature module; a call pays only for the extensions in its
list; every extension's state moves only at the outcome (delta baselines are
transactional with or without ``atomic``)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import xreshard as xr

ROOT = Path(__file__).resolve().parent.parent
#: runtime modules that implement a call feature or a wire format (refit.py reaches them
#: only through the extensions package and the executor)
FEATURES = {"atomic", "catchup", "verify", "writes", "quantize_ahead", "quantized",
            "quantize_device", "delta_wire", "delta_exec", "delta_device", "delta_encode",
            "delta_land", "delta_fence", "codecs", "delta", "quant"}


def _imported(path: Path) -> set[str]:
    """The last component of every module ``path`` imports (``from . import x`` counts x)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.rsplit(".", 1)[-1] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                out.add(node.module.rsplit(".", 1)[-1])
            if not node.module or node.level:
                out |= {a.name for a in node.names}
    return out


def test_refit_imports_no_feature_module_and_reads_no_feature_switch():
    path = ROOT / "xreshard" / "runtime" / "refit.py"
    assert not _imported(path) & FEATURES, sorted(_imported(path) & FEATURES)
    text = path.read_text()
    for switch in ("atomic", "delta", "verify", "check_writes", "own_only"):
        assert f"config.{switch}" not in text and f"self.{switch}" not in text, switch


def test_the_list_holds_only_what_the_config_switches_on():
    """A plain config: only the extensions whose hooks return at once on a call that does
    not use them (FP8: the planner decides per tensor; serving: elastic worlds only)."""
    from xreshard.runtime.extensions import for_catch_up, for_config

    names = [e.name for e in for_config(xr.RefitConfig(), xr.Tuning())]
    assert names == ["joiner", "fp8", "serve"]
    for switch, name in (("atomic", "atomic"), ("delta", "delta"), ("verify", "verify"),
                         ("check_writes", "check_writes")):
        got = [e.name for e in for_config(xr.RefitConfig(**{switch: True}), xr.Tuning())]
        assert sorted(got) == sorted(names + [name]), switch
    everything = xr.RefitConfig(atomic=True, delta=True, verify=True, check_writes=True)
    caught = [e.name for e in for_catch_up(everything, xr.Tuning())]
    assert caught == ["own_ranks", "fp8", "verify"]     # no staging, no baselines
    fp8 = [e for e in for_config(everything, xr.Tuning(fp8_ahead=False)) if e.name == "fp8"]
    assert len(fp8) == 1 and fp8[0].ahead.enabled is False     # Tuning.fp8_ahead reaches it


def test_fp8_ahead_is_a_tuning_field_read_from_the_environment_once():
    assert xr.Tuning().fp8_ahead is True
    assert xr.Tuning.from_env({"XRESHARD_FP8_AHEAD": "0"}).fp8_ahead is False
    assert xr.Tuning.from_env({}).fp8_ahead is True
    with pytest.raises(xr.RefitError, match="fp8_ahead must be a bool"):
        xr.Tuning(fp8_ahead="no")  # type: ignore[arg-type]
    text = (ROOT / "xreshard" / "runtime" / "quantize_ahead.py").read_text()
    assert "os.environ" not in text and "import os" not in text


def test_a_plain_call_runs_no_feature_code(monkeypatch):
    """With delta, atomic, verify, check_writes and FP8 off, no feature's code runs: each
    is replaced by one that raises, and two calls (the second warm) move exact bytes."""
    from xreshard.runtime import atomic, delta_wire, quantize_ahead, verify, writes

    def boom(*a, **k):
        raise AssertionError("a feature that is off did work")

    monkeypatch.setattr(delta_wire.DeltaState, "__init__", boom)
    monkeypatch.setattr(atomic.Staging, "stage", boom)
    monkeypatch.setattr(writes, "take", boom)
    monkeypatch.setattr(verify, "stage_digests", boom)
    monkeypatch.setattr(quantize_ahead.QuantAhead, "start", boom)
    shape = (16, 8)
    with xr.serve() as server, xr.World.join(server.address, "plain", 2, num_processes=1,
                                             index=0, timeout=20) as world:
        src = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        dest = np.zeros(shape, np.float32)
        send = xr.Bound({"w": xr.Layout.replicated(shape, "float32", xr.Mesh((1,), (0,)))},
                        {(0, "w"): src})
        receive = xr.Bound({"w": xr.Layout.replicated(shape, "float32", xr.Mesh((1,), (1,)))},
                           {(1, "w"): dest})
        refit = xr.Refit(world, send=send, receive=receive)
        for step in (1, 2):
            src += step
            report = refit()
            assert dest.tobytes() == src.tobytes() and report.version == step
        assert refit.delta_state is None and refit._staging is None


def _bucket(tag: int = 7):
    return SimpleNamespace(src=0, dst=1, tag=tag, stage=0)


def test_a_failed_call_leaves_the_baselines_as_they_were_without_atomic():
    """A sender's baseline and its claim survive a call that failed (no ``atomic``): the
    new bytes of a dense bucket and a delta's message are held by the call, applied only
    at the commit; a receiver whose destinations were written in place drops its bases."""
    from xreshard.runtime.delta_wire import DeltaState, _Baseline

    state = DeltaState()
    old = np.arange(16, dtype=np.uint8)
    state.sent[(0, 1)] = _Baseline(call="c1", digest="d1", buffers={7: old.copy(),
                                                                    8: old.copy()})
    state.base[1] = ("c1", {0: "d1"})
    prepared = SimpleNamespace(schedule=SimpleNamespace(rounds=[]), stages=[])
    call = state.begin([state.claims(None, None)[0]], prepared)
    call.target(_bucket(7), 16)[...] = 99             # a dense bucket's new bytes

    def advance(enc, base):
        base[...] = enc

    call.applied(_bucket(8), np.full(16, 5, np.uint8), advance)      # a delta
    state.abort()
    held = state.sent[(0, 1)]
    assert held.call == "c1" and held.digest == "d1"
    assert held.buffers[7].tobytes() == old.tobytes()
    assert held.buffers[8].tobytes() == old.tobytes()
    assert state.base == {}             # written in place: the receiver's base is gone

    call = state.begin([state.claims(None, None)[0]], prepared)
    call.target(_bucket(7), 16)[...] = 99
    call.applied(_bucket(8), np.full(16, 5, np.uint8), advance)
    call.sent_pairs.add((0, 1))
    call.digests[(0, 1)] = "d1"
    state.commit(call, None, None)      # confirmed: now they move
    held = state.sent[(0, 1)]
    assert held.call == call.call_id
    assert set(held.buffers[7].tolist()) == {99} and set(held.buffers[8].tolist()) == {5}
