"""The ``xreshard`` command line, run in-process through ``main([...])``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xreshard.cli import COMMANDS, main
from xreshard.catalog.models import MODELS_DIR, load_model
from xreshard.catalog.recipes import recipe_layouts

PLAN = ["plan", "--model", "qwen2_5_0_5b", "--src", "fsdp:dp=4", "--dst", "vllm:tp=2,dp=2"]


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1                      # one JSON object, one line
    return json.loads(out)


def test_plan_json(capsys):
    r = run_json(capsys, PLAN + ["--rank", "5"])
    for key in ("bytes_moved", "bytes_min", "bytes_gather_broadcast", "sender_balance",
                "plan_seconds", "num_transfers", "num_tensors", "rank_plan_seconds",
                "rank_num_transfers"):
        assert key in r, key
    model_bytes = 988_065_536                        # 494,032,768 bf16 params
    assert r["model_bytes"] == model_bytes and r["num_tensors"] == 290
    assert r["src"] == "fsdp:rep=1,dp=4,tp=1" and r["dst"] == "vllm:dp=2,tp=2"
    assert r["src_world_size"] == r["dst_world_size"] == 4
    # disjoint ranks: every destination rank receives all it holds, once
    dst = recipe_layouts(load_model("qwen2_5_0_5b"), "vllm:tp=2,dp=2", 4)
    held = {rank: sum(2 * reg.size for lay in dst.values() for reg in lay.regions(rank))
            for rank in range(4, 8)}
    assert r["bytes_moved"] == r["bytes_min"] == sum(held.values())
    assert 2 * model_bytes < r["bytes_moved"] < 2 * model_bytes * 1.001   # + replicated norms
    assert r["sender_balance"] >= 1.0 and r["plan_seconds"] > 0
    assert r["rank"] == 5 and r["rank_num_transfers"] > 0
    assert r["rank_bytes_received"] == held[5] and r["rank_bytes_sent"] == 0


def test_plan_table(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-0.5B (dense)" in out
    assert "destination        " in out and "(ranks 4..7)" in out
    assert "bytes moved" in out and "1.841 GiB" in out
    assert "sender balance (max / lower bound)" in out and "plan (whole world)" in out


def test_plan_moe_stacked_and_megatron(capsys):
    r = run_json(capsys, ["plan", "--model", "qwen3_30b_a3b", "--layout", "stacked",
                          "--src", "megatron:pp=2,ep=4,tp=2", "--dst", "vllm:tp=4,dp=2",
                          "--rank", "0"])
    assert r["layout"] == "stacked" and r["num_tensors"] == 531
    assert r["src_world_size"] == 16 and r["bytes_moved"] == r["bytes_min"]
    assert r["rank_bytes_received"] == 0 and r["rank_bytes_sent"] > 0


def test_plan_model_from_path(capsys, tmp_path):
    path = tmp_path / "m.json"
    path.write_text((MODELS_DIR / "qwen2_5_0_5b.json").read_text())
    r = run_json(capsys, ["plan", "--model", str(path), "--src", "jax:fsdp=2",
                          "--dst", "vllm:tp=2"])
    assert r["num_tensors"] == 290


@pytest.mark.parametrize("argv, message", [
    (["--src", "vllm:tp=8,pp=2"], r"xreshard plan: error: RecipeError: recipe 'vllm:tp=8,pp=2': "
                                  r"vllm has no axis 'pp'; its axes are dp, tp"),
    (["--src", "torch:tp=2"], r"RecipeError: recipe 'torch:tp=2': unknown framework 'torch'"),
    (["--dst", "vllm:tp=4"], r"num_attention_heads 14 % tp 4 != 0"),
    (["--model", "gpt5"], r"ModelError: unknown model 'gpt5'"),
    (["--rank", "8"], r"--rank 8 is outside the world: ranks 0..7 \(4 source, then 4 destination\)"),
])
def test_plan_errors(capsys, argv, message):
    import re
    args = dict(zip(PLAN[1::2], PLAN[2::2]))
    extra = []
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[flag] = value
        else:
            extra += [flag, value]
    assert main(["plan", *[x for kv in args.items() for x in kv], *extra]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_usage(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen2_5_0_5b"])    # --src and --dst are required
    assert "required" in capsys.readouterr().err
    assert {"plan", "demo"} <= set(COMMANDS)             # others (simulate) may register more


def test_python_dash_m():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "xreshard", *PLAN, "--json"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_tensors"] == 290


def test_plan_describe_rank(capsys):
    assert main(PLAN + ["--describe", "4", "--max-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "bytes moved" in out                                   # the summary still comes first
    assert "rank 4: receives " in out and "from 4 peers; sends 0 B in 0 regions" in out
    assert "peer | direction | regions |" in out
    assert "direction | peer | tensor" in out and "more regions (describe(rank" in out
    r = run_json(capsys, PLAN + ["--describe", "0", "--max-rows", "0"])
    assert r["describe"].startswith("rank 0: receives 0 B in 0 regions")
    assert "send to" in r["describe"] and "direction | peer | tensor" not in r["describe"]
    assert main(PLAN + ["--describe", "8"]) == 1
    assert "--describe 8 is outside the world" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a newcomer's CLI

SIM = ["simulate", "--model", "qwen2_5_0_5b", "--src", "fsdp:dp=2", "--dst", "vllm:tp=2",
       "--cluster", "dgx-h100"]


def test_version(capsys):
    import xreshard
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"xreshard {xreshard.__version__}"


@pytest.mark.parametrize("command", [PLAN, SIM])
def test_bad_flag_prints_the_subcommands_usage(capsys, command):
    with pytest.raises(SystemExit) as e:
        main(command + ["--bogus", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: xreshard {command[0]} " in err
    assert "unrecognized arguments: --bogus 1" in err


@pytest.mark.parametrize("command", [PLAN, SIM])
def test_bf16_suggests_bfloat16(capsys, command):
    # simulate checks its flags before any work (usage error: 2); plan fails planning (1)
    assert main(command + ["--wire-dtype", "bf16"]) == (2 if command is SIM else 1)
    err = capsys.readouterr().err
    assert "dtype 'bf16' is not supported (did you mean 'bfloat16'?)" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag, value, message", [
    ("--bucket-bytes", "0", "--bucket-bytes must be a positive number of bytes, as "
                            "RefitConfig.bucket_bytes"),
    ("--bucket-bytes", "-5", "--bucket-bytes must be a positive number of bytes"),
    ("--staging-bytes", "0", "--staging-bytes must be a positive number of bytes, as "
                             "RefitConfig.staging_bytes"),
    ("--staging-bytes", "lots", "--staging-bytes: 'lots' is not a number of bytes"),
    ("--gpus", "-4", "--gpus must be a positive number of GPUs"),
    ("--delta", "1.5", "--delta is the changed fraction of elements, in [0, 1]"),
])
def test_simulate_refuses_bad_numbers_in_one_line(capsys, monkeypatch, flag, value, message):
    # refused before any work: a model that does not exist is never looked up
    import xreshard.catalog.models as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(SIM + [flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xreshard simulate: error: ") and message in err
    assert err.count("\n") == 1


def test_simulate_sizes_take_units():
    import argparse
    from xreshard.sim.simulate import byte_size, check_arguments
    assert byte_size("64MiB") == byte_size("64M") == 64 << 20 and byte_size("1GB") == 10**9
    args = argparse.Namespace(bucket_bytes="2MiB", staging_bytes="8MiB", gpus=None,
                              delta=None, wire="dtype", plot=None, wire_dtype=None)
    assert check_arguments(args) is None and args.bucket_bytes == 2 << 20


@pytest.mark.parametrize("path, message", [
    ("{tmp}/missing/x.png", "folder '{tmp}/missing' does not exist"),
    ("{tmp}/x.gif", "the file type must be one of .png, .pdf, .svg (got .gif)"),
    ("{tmp}", "is a folder; give a file name"),
])
def test_simulate_refuses_a_bad_plot_path_first(capsys, monkeypatch, tmp_path, path, message):
    import xreshard.catalog.models as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    path = path.format(tmp=tmp_path)
    if path == str(tmp_path):
        path = str(tmp_path) + ".png"
        Path(path).mkdir()
    assert main(SIM + ["--plot", path]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.count("\n") == 1


def test_uneven_jax_recipe_says_it_replicates(capsys):
    assert main(["plan", "--model", "qwen2_5_0_5b", "--src", "jax:fsdp=3", "--dst",
                 "vllm:tp=2"]) == 0
    err = capsys.readouterr().err
    assert "xreshard plan: note: jax:dp=1,fsdp=3,tp=1: " in err
    assert "replicated instead" in err and "over fsdp=3" in err
    assert main(SIM[:4] + ["jax:fsdp=3"] + SIM[5:] + ["--json"]) == 0
    assert "xreshard simulate: note: jax:dp=1,fsdp=3,tp=1: " in capsys.readouterr().err


def test_progress_on_a_terminal_only(capsys, monkeypatch):
    from xreshard.sim.traffic import Progress
    Progress("plan")(1, 3, "layouts")            # stderr is captured: not a terminal
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    step = Progress("plan")
    step(1, 3, "layouts")
    step(3, 3, "done")
    err = capsys.readouterr().err
    assert "\rplan: layouts (1/3)" in err and err.endswith("\rplan: done (3/3)   \n")  # covers the longer line


def test_quiet_when_piped_and_no_traceback_when_cut():
    # a pipe: no progress lines on stderr; `| head` closing the pipe: no traceback
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "xreshard", *PLAN, "--describe", "4", "--max-rows", "-1"]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first.startswith(b"model") and "Traceback" not in err and "plan:" not in err
    assert proc.returncode in (0, 1)
