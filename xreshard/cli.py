"""The ``xreshard`` command line: ``xreshard plan | demo | simulate``.

(Benchmarks are scripts in ``benchmarks/``, not shipped with the package.)

Each subcommand lives in a module with ``add_arguments(parser)`` and ``run(args) -> int``,
listed in ``COMMANDS`` and imported only when that subcommand runs, so ``xreshard plan``
never imports torch or jax.

    xreshard plan --model deepseek_v3 --src "megatron:pp=4,ep=16,dp=2" --dst "vllm:tp=8,dp=16"
    xreshard plan --model qwen2_5_0_5b --src fsdp:dp=4 --dst vllm:tp=2 --json --rank 4
    xreshard plan --model qwen2_5_0_5b --src fsdp:dp=4 --dst vllm:tp=2 --describe 4
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any, Sequence

#: subcommand -> (module with add_arguments(parser) and run(args), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("xreshard.cli", "plan a refit between two recipes of a model and print its "
                             "statistics"),
    "demo": ("xreshard.tools.demo", "train a small transformer in JAX and refit it shard to shard "
                              "into torch DTensors, verifying every byte"),
    "simulate": ("xreshard.sim.simulate", "predict a refit's time on a cluster model (GB200 NVL72, "
                                      "DGX H100, ...) by replaying its schedule"),
}

#: what ``plan`` prints; (key in the result, label, unit) - unit "GiB" divides bytes
_TABLE = (
    ("num_tensors", "tensors", ""),
    ("src_world_size", "source ranks", ""),
    ("dst_world_size", "destination ranks", ""),
    ("model_bytes", "model size", "GiB"),
    ("bytes_moved", "bytes moved", "GiB"),
    ("bytes_min", "minimum", "GiB"),
    ("moved_over_min", "moved / minimum", "x"),
    ("bytes_gather_broadcast", "gather+broadcast", "GiB"),
    ("gather_broadcast_over_moved", "gather+broadcast / moved", "x"),
    ("bytes_local", "local copies", "GiB"),
    ("max_bytes_sent", "max sent by a rank", "GiB"),
    ("max_bytes_received", "max received by a rank", "GiB"),
    ("sender_balance", "sender balance (max / lower bound)", "x"),
    ("sender_balance_mean", "sender balance (max / mean)", "x"),
    ("num_transfers", "transfers", ""),
    ("layout_seconds", "layouts (both sides)", "s"),
    ("plan_seconds", "plan (whole world)", "s"),
    ("rank", "rank", ""),
    ("rank_num_transfers", "rank's transfers", ""),
    ("rank_plan_seconds", "rank's transfers_for()", "s"),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xreshard`` script and ``python -m xreshard``; returns the exit code.

    A bad flag prints the usage of the subcommand it was given to; output cut short by a
    closed pipe (``xreshard plan ... | head``) ends quietly.
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop writing, say nothing (Python's advice:
        # point stdout at devnull so the interpreter's final flush does not raise again)
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    from . import __version__
    parser = argparse.ArgumentParser(
        prog="xreshard", description="Weight refit between differently sharded jobs.")
    parser.add_argument("--version", action="version", version=f"xreshard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parsers = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                parser.error(f"subcommand {name!r} is not available: {e}")
            module.add_arguments(p)
            p.set_defaults(run=module.run)
    args, extra = parser.parse_known_args(argv)
    if extra:       # report it against the subcommand's usage, not the top-level one
        (parsers.get(args.command) or parser).error(f"unrecognized arguments: "
                                                    f"{' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    from .errors import XreshardError
    try:
        return int(args.run(args) or 0)
    except XreshardError as e:
        print(f"xreshard {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------- plan

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``xreshard plan``."""
    from .catalog.recipes import FRAMEWORKS
    examples = "; ".join(f.example for f in FRAMEWORKS.values())
    parser.add_argument("--model", required=True,
                        help="packaged model name (deepseek_v3, kimi_k2, qwen3_235b_a22b, "
                             "qwen3_30b_a3b, llama3_1_70b, llama3_1_8b, qwen2_5_0_5b) or the "
                             "path of a JSON inventory")
    parser.add_argument("--src", required=True, help=f"source recipe, e.g. {examples}")
    parser.add_argument("--dst", required=True, help="destination recipe; its ranks follow "
                                                     "the source's")
    parser.add_argument("--layout", choices=("per_expert", "stacked"), default="per_expert",
                        help="how routed experts are listed (default per_expert)")
    parser.add_argument("--wire-dtype", default=None,
                        help="cast on the sender to this dtype (default: no cast)")
    parser.add_argument("--rank", type=int, default=None,
                        help="also time plan.transfers_for(RANK), one rank's share")
    parser.add_argument("--describe", type=int, default=None, metavar="RANK",
                        help="also print RANK's share of the plan as a table: bytes per peer, "
                             "then every region it receives, sends or copies locally")
    parser.add_argument("--max-rows", type=int, default=100, metavar="N",
                        help="with --describe, list at most N regions (default 100; 0: none, "
                             "-1: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    result = plan_summary(args.model, args.src, args.dst, layout=args.layout,
                          rank=args.rank, wire_dtype=args.wire_dtype, describe=args.describe,
                          max_rows=None if args.max_rows < 0 else args.max_rows, notes=notes,
                          progress=None)
    for note in notes:
        print(f"xreshard plan: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(format_summary(result))
        if "describe" in result:
            print()
            print(result["describe"])
    return 0


def plan_summary(model: str, src: str, dst: str, *, layout: str = "per_expert",
                 rank: int | None = None, wire_dtype: str | None = None,
                 describe: int | None = None, max_rows: int | None = 100,
                 notes: list[str] | None = None,
                 progress: bool | None = False) -> dict[str, Any]:
    """Plan ``model`` from recipe ``src`` (ranks 0..) to ``dst`` (ranks after the source's)
    and return the statistics as a JSON-able dict.

    Args:
        rank: also time ``plan.transfers_for(rank)`` and count its bytes.
        describe: also return ``plan.describe(describe, max_rows)`` under ``"describe"``.
        notes: receives what the recipes changed (``recipe_layouts(notes=)``).
        progress: show the steps on stderr (None: when stderr is a terminal).

    Raises:
        XreshardError: unknown model, bad recipe, or a plan error; ``rank`` or ``describe``
            outside the world.
    """
    from .catalog.models import load_model
    from .planner.plan import plan
    from .catalog.recipes import RecipeError, parse_recipe, recipe_layouts
    from .sim.traffic import Progress

    step = Progress("plan", progress)
    step(0, 3, "model")
    m = load_model(model, layout)
    src_recipe, dst_recipe = parse_recipe(src), parse_recipe(dst)
    world = src_recipe.world_size + dst_recipe.world_size
    for flag, value in (("--rank", rank), ("--describe", describe)):
        if value is not None and not 0 <= value < world:
            raise RecipeError(f"{flag} {value} is outside the world: ranks 0..{world - 1} "
                              f"({src_recipe.world_size} source, then {dst_recipe.world_size} "
                              "destination)")
    step(1, 3, "layouts")
    t0 = time.perf_counter()
    src_layouts = recipe_layouts(m, src_recipe, 0, notes=notes)
    dst_layouts = recipe_layouts(m, dst_recipe, src_recipe.world_size, notes=notes)
    t1 = time.perf_counter()
    step(2, 3, "plan")
    p = plan(src_layouts, dst_layouts, wire_dtype=wire_dtype)
    t2 = time.perf_counter()
    step(3, 3, "done")
    stats = p.stats
    out: dict[str, Any] = stats.to_dict()
    out.update(
        model=m.name, layout=m.layout, src=str(src_recipe), dst=str(dst_recipe),
        src_world_size=src_recipe.world_size, dst_world_size=dst_recipe.world_size,
        model_bytes=m.total_bytes, layout_seconds=t1 - t0, plan_wall_seconds=t2 - t1,
        moved_over_min=stats.bytes_moved / stats.bytes_min if stats.bytes_min else 1.0,
        gather_broadcast_over_moved=(stats.bytes_gather_broadcast / stats.bytes_moved
                                     if stats.bytes_moved else 0.0))
    if rank is not None:
        t3 = time.perf_counter()
        transfers = p.transfers_for(rank)
        out.update(rank=rank, rank_plan_seconds=time.perf_counter() - t3,
                   rank_num_transfers=len(transfers),
                   rank_bytes_sent=sum(t.nbytes for t in transfers if t.src == rank),
                   rank_bytes_received=sum(t.nbytes for t in transfers if t.dst == rank))
    if describe is not None:
        out.update(describe=p.describe(describe, max_rows=max_rows))
    return out


def format_summary(result: dict[str, Any]) -> str:
    """``plan_summary``'s dict as a two-column table."""
    rows = [("model", f"{result['model']} ({result['layout']})"),
            ("source", f"{result['src']} (ranks 0..{result['src_world_size'] - 1})"),
            ("destination", f"{result['dst']} (ranks {result['src_world_size']}.."
                            f"{result['src_world_size'] + result['dst_world_size'] - 1})")]
    for key, label, unit in _TABLE:
        if key not in result:
            continue
        v = result[key]
        if unit == "GiB":
            text = f"{v / 2**30:,.3f} GiB"
        elif unit == "x":
            text = f"{v:.4f}"
        elif unit == "s":
            text = f"{v:.3f} s"
        else:
            text = f"{v:,}" if isinstance(v, int) else str(v)
        rows.append((label, text))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
