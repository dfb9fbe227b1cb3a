"""Every example under examples/ ends with one verdict line (``OK: ...`` or
``FAILED: ...``) and, after a success, a clean teardown: no traceback, no C++ stack trace of
a store closed under its clients, no leaked semaphore or shared-memory warning, and no
temporary folder of xreshard's left behind. Each starts vLLM engines on CPU (minutes): slow tier."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from .vllm_cases import requires_vllm

requires_vllm()

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = [["examples/jax_to_vllm.py"], ["examples/jax_to_vllm.py", "--fp8"],
            ["examples/jax_lora_to_vllm.py"]]
NOISE = ("Traceback", "terminate called", "Did the remote server shutdown or crash",
         "leaked semaphore", "leaked shared_memory")


@pytest.mark.parametrize("argv", EXAMPLES, ids=" ".join)
def test_an_example_ends_with_one_verdict_line_and_a_clean_teardown(argv, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    verdicts = [ln for ln in lines if ln.startswith(("OK: ", "FAILED: "))]
    said = f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert len(verdicts) == 1 and lines[-1] == verdicts[0], f"one verdict, last:\n{said}"
    assert proc.returncode == 0 and verdicts[0].startswith("OK: "), said
    for noise in NOISE:
        assert noise not in proc.stdout + proc.stderr, f"{noise!r} after a success:\n{said}"
    # ours only: vLLM leaves its IPC socket names (uuids) and torch its inductor cache
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("xreshard"))
    assert not left, f"left behind in TMPDIR: {left}"
