"""``RefitConfig(check_writes=True)`` sees the writes that torch's version counters miss
(issue 17, item 2): a fused optimizer step (``AdamW``/``Adam``/``SGD(fused=True)``), writes
through ``.data`` and through a numpy view, and ``torch.no_grad`` in-place ops, landing
after ``Refit.start()`` returned and before its last send, fail the refit with the same
``RefitError`` on every rank (real processes, gloo and shm); unwritten tensors and a
write that restores the bytes pass. The checksum the check runs with torch ops on a
tensor's device gives :func:`xreshard.runtime.verify.checksum`'s digest (on a GPU too:
``pytest -m gpu``, run by ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xreshard as xr
from xreshard.runtime import verify
from xreshard.tools.launch import Context, Role, launch

torch = pytest.importorskip("torch")

from xreshard.adapters.torch import tensor_view  # noqa: E402 - needs torch

#: every kind of write the check promises to see (README, "check_writes")
WRITES = ("fused_adamw", "fused_adam", "fused_sgd", "data", "numpy_view", "numpy_negate",
          "no_grad")


def _model(device: str) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _write(model: Any, kind: str) -> str:
    """Write ``model``'s parameters as ``kind`` does; returns a parameter it wrote."""
    params = list(model.parameters())
    if kind.startswith("fused_"):
        opt = {"fused_adamw": torch.optim.AdamW, "fused_adam": torch.optim.Adam,
               "fused_sgd": torch.optim.SGD}[kind](params, lr=0.01, fused=True)
        opt.step()
        return "0.weight"
    if kind == "data":
        model[0].weight.data.add_(1.0)
        return "0.weight"
    if kind == "numpy_view":
        model[1].bias.detach().numpy()[:] += 1.0     # a view of the tensor's memory
        return "1.bias"
    if kind == "numpy_negate":      # every odd column's sign: bit 63 of each 64-bit word
        model[1].weight.detach().numpy()[:, 1::2] *= -1
        return "1.weight"
    if kind == "no_grad":
        with torch.no_grad():
            model[1].weight.mul_(2.0)
        return "1.weight"
    raise AssertionError(kind)


# ---------------------------------------------------------------------------- one process


@pytest.mark.parametrize("case", ["f32", "bf16", "odd", "strided", "offset", "empty", "scalar",
                                  "bool", "fp8", "big"])
def test_torch_checksum_is_the_verify_checksum(case):
    """The torch-ops checksum (what runs on a CUDA tensor) gives the host checksum's digest
    for any dtype, size, stride and alignment (here on CPU tensors)."""
    g = torch.Generator().manual_seed(1)
    t = {"f32": lambda: torch.randn(64, 32, generator=g),
         "bf16": lambda: torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
         "odd": lambda: torch.randn(4096, 17, generator=g),
         "strided": lambda: torch.randn(100, 200, generator=g).t()[3:, ::2],
         "offset": lambda: torch.randn(1000, generator=g).to(torch.float16)[3:],
         "empty": lambda: torch.zeros(0, 5),
         "scalar": lambda: torch.tensor(3.5),
         "bool": lambda: torch.randn(33, generator=g) > 0,
         "fp8": lambda: torch.randn(2048 * 16 + 5, generator=g).to(torch.float8_e4m3fn),
         "big": lambda: torch.randn(1 << 20, generator=g)}[case]()
    from xreshard.adapters import torch_writes
    assert torch_writes.checksum(t) == verify.checksum(tensor_view(t))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow)   # torch.optim
                                  if k.startswith("fused") else k for k in WRITES])
def test_snapshot_sees_writes_counters_miss(kind):
    from xreshard.runtime import writes
    model = _model("cpu")
    snap = writes.take(model)
    assert snap is not None and snap.written() == []
    wrote = _write(model, kind)
    written = snap.written()
    assert any(w.startswith(f"{wrote!r} (bytes changed") for w in written), written
    with pytest.raises(xr.RefitError, match=rf"sent torch tensors were written while the "
                                            rf"refit read them: .*'{wrote}' \(bytes changed"):
        writes.check(snap)


def test_snapshot_of_unwritten_and_restored_tensors():
    """Reading, a write that restores the bytes without moving a counter (harmless and not
    seen), tied weights and a replaced tensor."""
    from xreshard.runtime import writes
    w = torch.randn(128, 64)
    state = {"w": w, "tied": w, "b": torch.randn(7)}
    snap = writes.take(state)
    _ = (w * 2).sum()
    w.data.mul_(2.0)
    w.data.div_(2.0)                      # exact (a power of two): the bytes are restored
    assert torch.equal(w, state["tied"]) and snap.written() == []
    state["b"] = torch.randn(7)           # the name now holds other bytes
    assert snap.written() == ["'b' (bytes changed)"]
    w.add_(0)                             # same bytes, but the counter moved
    assert snap.written() == ["'w' (version 0 -> 1)", "'tied' (version 0 -> 1)",
                              "'b' (bytes changed)"]


def test_no_snapshot_for_jax_or_bound_senders():
    """JAX arrays are immutable: nothing to check; a Bound is not checked."""
    from xreshard.runtime import writes
    lay = xr.Layout.replicated((4,), "float32", xr.Mesh((1,), (0,)))
    assert writes.take(xr.Bound({"w": lay}, {(0, "w"): np.zeros(4, np.float32)})) is None
    assert writes.take(None) is None


# ---------------------------------------------------------------------------- processes


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    """The trainer's signal that its write is done (so it lands inside the refit)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} from the trainer within {timeout} s")
        time.sleep(0.02)


def _digests(state: Any) -> dict[str, str]:
    """Digests compared across processes: under one key (the default is per process)."""
    from xreshard.runtime.digest import Key
    key = Key.of("test_writes")
    return {k: verify.checksum(tensor_view(v.detach().cpu()), key) for k, v in state.items()}


def overlapping(ctx: Context, tmp: str, device: str, transports: list[str],
                kinds: list[str]) -> dict:
    """Per transport and kind of write: the trainer starts a refit of its model, writes it
    (``kind``), signals; the rollout joins the refit once the write is done. Then a control
    (``check_writes=False``: the refit succeeds and delivers the written values, not those
    of ``start()``) and a clean refit (exact)."""
    trainer = ctx.role.group == "trainer"
    out: dict[str, Any] = {}
    model = _model(device)
    recv = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    with ctx.join(["cuda:0"] if device == "cuda" else 1, timeout=60) as world:
        for transport in transports:
            config = xr.RefitConfig(timeout=60, transport=transport, check_writes=True)
            refit = xr.Refit(world, **({"send": model} if trainer else {"receive": recv}),
                             config=config)
            for kind in kinds:
                flag = Path(tmp, f"{transport}-{kind}")
                got: dict[str, Any] = {}
                try:
                    if trainer:
                        handle = refit.start()
                        got["wrote"] = _write(model, kind)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        flag.touch()
                        handle.wait()
                    else:
                        _wait_for(flag)
                        refit()
                    got["error"] = None
                except xr.XreshardError as e:
                    got["error"] = [type(e).__name__, str(e)]
                got["version"], got["broken"] = refit.version, world.broken
                out[f"{transport}/{kind}"] = got
            # the control: the same write without the check passes, with the written values
            plain = xr.Refit(world, **({"send": model} if trainer else {"receive": recv}),
                             config=xr.RefitConfig(timeout=60, transport=transport))
            flag = Path(tmp, f"{transport}-control")
            if trainer:
                handle = plain.start()
                before = _digests(model.state_dict())
                _write(model, "fused_adamw")
                if device == "cuda":
                    torch.cuda.synchronize()
                flag.touch()
                report = handle.wait()
                out[f"{transport}/control"] = {"at_start": before,
                                               "after": _digests(model.state_dict())}
            else:
                _wait_for(flag)
                report = plain()
                out[f"{transport}/control"] = {"received": _digests(recv)}
            out[f"{transport}/control"]["version"] = report.version
            # the world still refits, exactly
            report = refit()
            out[f"{transport}/clean"] = {
                "version": report.version,
                "bytes": report.bytes_sent if trainer else report.bytes_received,
                "digests": _digests(model.state_dict() if trainer else recv)}
    return out


def _check(trainer: dict, rollout: dict, transports: list[str], kinds: list[str]) -> None:
    for transport in transports:
        for kind in kinds:
            t, r = trainer[f"{transport}/{kind}"], rollout[f"{transport}/{kind}"]
            assert t["error"] is not None, f"{transport}/{kind}: the write was not seen"
            assert t["error"] == r["error"], (transport, kind)      # one error everywhere
            cls, message = t["error"]
            assert cls == "RefitError"
            assert "sent torch tensors were written while the refit read them" in message
            assert f"'{t['wrote']}' (bytes changed" in message, message
            assert "handle.wait()" in message
            assert t["version"] == r["version"] == 0          # nothing committed
            assert t["broken"] is None and r["broken"] is None
        t, r = trainer[f"{transport}/control"], rollout[f"{transport}/control"]
        assert t["version"] == r["version"] == 1
        assert r["received"] == t["after"] != t["at_start"]   # without the check: silent
        t, r = trainer[f"{transport}/clean"], rollout[f"{transport}/clean"]
        assert t["version"] == r["version"] == 1
        assert t["digests"] == r["digests"]
        assert t["bytes"] == r["bytes"] > 0          # through the transport, not in place


@pytest.mark.slow
def test_check_writes_fails_every_rank_on_writes_counters_miss(tmp_path):
    """gloo and shm between two real torch processes: each kind of write after
    ``Refit.start()`` fails the refit with the same RefitError on both ranks."""
    transports = ["gloo", "shm"]
    roles = [Role("torch", "trainer", 0), Role("torch", "rollout", 0)]
    trainer, rollout = [r.value for r in launch(
        overlapping, roles, args=(str(tmp_path), "cpu", transports, list(WRITES)),
        timeout=240)]
    _check(trainer, rollout, transports, list(WRITES))


# ---------------------------------------------------------------------------- GPU


def _no_cuda() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401 - binding CUDA tensors needs it
    except ImportError:
        return "CuPy is not installed"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda() is not None, reason=str(_no_cuda()))
def test_device_checksum_matches_the_host_on_gpu():
    """On a CUDA tensor the checksum runs with torch ops there and gives the host digest."""
    from xreshard.adapters import torch_writes
    g = torch.Generator().manual_seed(2)
    for t in (torch.randn(4096, 17, generator=g), torch.randn(7, 300, generator=g).t(),
              torch.randn(1001, generator=g).to(torch.bfloat16)[1:],
              torch.randn(1 << 22, generator=g)):
        assert torch_writes.checksum(t.cuda()) == verify.checksum(tensor_view(t))


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda() is not None, reason=str(_no_cuda()))
def test_check_writes_sees_a_fused_step_on_gpu(tmp_path):
    """Two torch processes on GPU 0 ("auto": cuda_ipc): a fused AdamW step and a ``.data``
    write queued on the caller's stream after ``Refit.start()`` fail the refit on both."""
    kinds = ["fused_adamw", "data", "no_grad"]
    roles = [Role("torch", "trainer", 0, gpus=(0,)), Role("torch", "rollout", 0, gpus=(0,))]
    trainer, rollout = [r.value for r in launch(
        overlapping, roles, args=(str(tmp_path), "cuda", ["auto"], kinds), timeout=120,
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})]
    _check(trainer, rollout, ["auto"], kinds)

