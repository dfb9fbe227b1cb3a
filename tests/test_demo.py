"""``xreshard demo``: run in-process through ``xreshard.tools.demo.main([...])``.

The end-to-end runs start real processes (a JAX trainer on 4 CPU devices, torch DTensor
ranks over gloo), so they are marked slow; the small settings keep each under ~20 s.
"""

from __future__ import annotations

import re

import pytest

from xreshard.tools.demo import CORRUPT_TENSOR, DemoConfig, chunk_bounds, main, tensor_specs

# one refit before training, one after: the second reuses the first's plan
# a generous bound on the whole launch: the suite runs on loaded 2-core machines
SMALL = ["--refits", "2", "--steps", "2", "--timeout", "300"]


def _verified_lines(out: str) -> list[str]:
    return re.findall(r"verified (\d+) tensors bit-exact on (\d+) ranks", out)


@pytest.mark.slow
def test_demo_float32_every_refit_bit_exact(capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    num_tensors = len(tensor_specs(DemoConfig()))
    assert _verified_lines(out) == [(str(num_tensors), "2")] * 2
    assert "refit 2 (v2, after 2 steps" in out
    assert "gather+broadcast would move" in out
    assert out.count("greedy tokens (torch TP=2)") == 2 and "steps follow the rule" in out
    assert re.search(r"trainer sent 2.01 MiB in [\d.]+ m?s moving \([\d.]+ [MG]B/s\); setup", out)
    assert "OK: 2 refit(s)" in out


@pytest.mark.slow
def test_demo_fp32_trainer_bf16_wire_and_receivers(capsys):
    assert main(SMALL + ["--wire-dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "float32, wire bfloat16" in out
    assert len(_verified_lines(out)) == 2
    # the wire carries bf16: the plan moves half the fp32 model (527,232 params + the
    # replicated norms on the second rank)
    moved = re.findall(r"plan moved ([\d.]+) MiB", out)
    assert moved and all(float(m) == pytest.approx(1.01, abs=0.01) for m in moved)


@pytest.mark.slow
def test_demo_corrupted_byte_fails_the_check(capsys):
    # bf16 on both sides here, so that path runs too
    code = main(SMALL + ["--corrupt", "--dtype", "bfloat16", "--gen-tokens", "0"])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    assert f"MISMATCH: 1 check(s) against the trainer's values: rank 5: {CORRUPT_TENSOR}" \
        in captured.out
    # the next refit rewrites every byte, so refit 2 verifies again; the run still fails
    assert len(_verified_lines(captured.out)) == 1
    assert "FAILED" in captured.out and "OK:" not in captured.out


def test_chunk_bounds_is_torch_chunk():
    torch = pytest.importorskip("torch")
    for n in (0, 1, 5, 7, 128, 513):
        for parts in (1, 2, 3, 4, 8):
            blocks = torch.arange(n).chunk(parts)
            for i in range(parts):
                start, stop = chunk_bounds(n, parts, i)
                want = blocks[i].tolist() if i < len(blocks) else []
                assert list(range(start, stop)) == want, (n, parts, i)


def test_jax_specs_split_evenly_and_torch_vocab_does_not():
    cfg = DemoConfig()
    sizes = {"fsdp": 2, "tp": 2}
    for s in tensor_specs(cfg):
        for dim, entry in enumerate(s.jax_spec):
            axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
            ways = 1
            for a in axes:
                ways *= sizes[a]
            assert s.stored_shape[dim] % ways == 0, s
    assert chunk_bounds(cfg.vocab, 2, 0) == (0, 257)        # the uneven torch shard


def test_bad_options_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dtype", "float16"])
    assert e.value.code == 2
    assert main(["--torch-procs", "0"]) == 2
    assert "torch_procs >= 1" in capsys.readouterr().err


def test_gpus_present_still_runs_on_cpu(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    import xreshard.tools.launch as launch_module

    seen = {}

    def fake_launch(fn, roles, **kwargs):
        seen.update(roles=roles, env=kwargs["env"])
        raise launch_module.LaunchError("stopped by the test", [])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch_module, "launch", fake_launch)
    assert main(["--refits", "1"]) == 1
    captured = capsys.readouterr()
    assert "GPU path (NCCL) is not wired into the demo yet; running on CPU" in captured.out
    assert "stopped by the test" in captured.err
    # every child on CPU: no GPUs pinned, CUDA hidden
    assert all(r.gpus is None for r in seen["roles"])
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""


def _record(refit: int, replanned: bool) -> dict:
    return {"refit": refit, "version": refit, "steps": 0, "loss": None, "seconds": 3.0,
            "move_seconds": 0.02, "setup_seconds": 2.98, "plan_seconds": 2.9,
            "replanned": replanned, "bytes_moved_world": 2107392, "bytes_sent": 2107392,
            "bytes_forwarded": 0, "bytes_gather_broadcast_world": 3 * 2107392,
            "num_tensors": 21, "num_ranks": 2, "rollout_ranks": [4, 5], "mismatches": [],
            "tokens": [1, 2, 3], "ref_tokens": [1, 2, 3], "follows": 1}


def test_progress_prints_each_refit_as_it_comes_and_setup_only_on_a_terminal(
        tmp_path, monkeypatch, capsys):
    import json
    import time

    from xreshard.tools.demo_report import Progress

    cfg = DemoConfig(gen_tokens=2)
    events = tmp_path / "events.jsonl"
    events.write_text("")
    t0 = time.time()

    def emit(**ev):
        with open(events, "a") as f:
            f.write(json.dumps({"t": t0 + 1.5, **ev}) + "\n")

    for tty in (True, False):
        monkeypatch.setattr("sys.stdout.isatty", lambda: tty)
        events.write_text("")
        with Progress(cfg, str(events), t0) as progress:
            emit(who="trainer", kind="ready", devices=4)
            emit(who="trainer", kind="refit-start", refit=1, steps=0)
            emit(who="trainer", kind="refit", record=_record(1, True))
            deadline = time.monotonic() + 10
            while 1 not in progress.printed and time.monotonic() < deadline:
                time.sleep(0.02)        # printed by the thread, before the launch returns
            assert 1 in progress.printed
            emit(who="trainer", kind="refit", record=_record(2, False))
        progress.record(_record(2, False))          # already printed: not twice
        out = capsys.readouterr().out
        assert out.count("refit 1 (v1") == 1 and out.count("refit 2 (v2") == 1
        assert ("[   1.5 s] trainer: JAX up on 4 CPU devices" in out) is tty, out
        assert ("refit 1: exchanging layouts" in out) is tty
    assert "trainer sent 2.01 MiB in 20.0 ms moving (0.11 GB/s); setup 2.98 s" in out
    assert "setup 2.98 s: checks, plan reused" in out
    assert "1/2 steps follow the rule" in out and progress.ok
