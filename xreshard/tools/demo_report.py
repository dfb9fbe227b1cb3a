"""What ``xreshard demo`` prints: the header, each refit's report, and the processes'
progress as it happens (:class:`Progress` reads the events the demo's processes append to
``DemoConfig.events``)."""

from __future__ import annotations

import json
import math
import sys
import threading
from typing import Any

from .demo import DemoConfig, chunk_bounds, tensor_specs

__all__ = ["Progress", "format_record", "header"]


def format_record(cfg: DemoConfig, rec: dict) -> tuple[list[str], bool]:
    """One refit's report lines, and whether its checks passed.

    The rate divides the bytes the trainer sent by the time the executor spent moving them;
    the rest of the call is setup, shown apart (on the first call: meeting the peers,
    exchanging layouts, planning, creating the gloo transport).
    """
    from xreshard.units import format_bytes, format_rate, format_seconds

    loss = "-" if rec["loss"] is None else f"{rec['loss']:.3f}"
    ratio = rec["bytes_gather_broadcast_world"] / max(rec["bytes_moved_world"], 1)
    setup = (f"setup {format_seconds(rec['setup_seconds'])}: meeting the peers, exchanging "
             "layouts, planning (first call only)" if rec["replanned"] else
             f"setup {format_seconds(rec['setup_seconds'])}: checks, plan reused")
    forwarded = (f", forwarded {format_bytes(rec['bytes_forwarded'])}"
                 if rec.get("bytes_forwarded") else "")
    lines = [
        f"refit {rec['refit']} (v{rec['version']}, after {rec['steps']} steps, loss {loss}): "
        f"trainer sent {format_bytes(rec['bytes_sent'])}{forwarded} in "
        f"{format_seconds(rec['move_seconds'])} moving "
        f"({format_rate(rec['bytes_sent'], rec['move_seconds'])}); {setup}",
        f"  plan moved {format_bytes(rec['bytes_moved_world'])}; gather+broadcast would move "
        f"{format_bytes(rec['bytes_gather_broadcast_world'])} ({ratio:.2f}x)"]
    ok = not rec["mismatches"]
    if not ok:
        lines.append(f"  MISMATCH: {len(rec['mismatches'])} check(s) against the "
                     f"trainer's values: " + "; ".join(rec["mismatches"][:8]))
    else:
        n = rec["num_ranks"]
        lines.append(f"  verified {rec['num_tensors']} tensors bit-exact on {n} "
                     f"rank{'s' if n != 1 else ''} (world ranks "
                     f"{', '.join(map(str, rec['rollout_ranks']))}), sha256 per local shard")
    if rec["tokens"] is not None:
        agree = ("same as the trainer's numpy forward" if rec["tokens"] == rec["ref_tokens"]
                 else f"trainer's numpy forward gives {rec['ref_tokens']} (float rounding "
                      "near a tie)")
        lines.append(f"  greedy tokens (torch TP={cfg.torch_procs}): "
                     f"{' '.join(map(str, rec['tokens']))}; {rec['follows']}/"
                     f"{cfg.gen_tokens} steps follow the rule; {agree}")
    return lines, ok


def header(cfg: DemoConfig) -> list[str]:
    """What runs where, printed before the launch."""
    specs = tensor_specs(cfg)
    num_params = sum(math.prod(s.shape) for s in specs)
    wire = f"{cfg.dtype}, wire {cfg.wire_dtype}" if cfg.wire_dtype else cfg.dtype

    def sizes(n: int) -> list[int]:
        return [b - a for a, b in (chunk_bounds(n, cfg.torch_procs, i)
                                   for i in range(cfg.torch_procs))]
    lines = [
        f"xreshard demo: JAX trainer (1 process, 4 CPU devices, mesh fsdp=2 x tp=2, optax "
        f"adam) -> {cfg.torch_procs} torch process(es) (DTensor TP={cfg.torch_procs}, gloo)",
        f"model: {cfg.num_layers}-layer decoder, vocab {cfg.vocab}, hidden {cfg.hidden}, "
        f"{cfg.num_heads} heads, mlp {cfg.intermediate}: {len(specs)} tensors, "
        f"{num_params:,} params, {wire}",
        f"torch.chunk shards per torch rank: vocab {sizes(cfg.vocab)}, hidden "
        f"{sizes(cfg.hidden)}, mlp {sizes(cfg.intermediate)}; the JAX side replicates the "
        "vocab dim (its splits must be even)"]
    if cfg.can_generate:
        lines.append(
            f"task: the training text follows one rule, token t -> successor[t] (a fixed "
            f"random permutation of the vocab); after each refit the torch side generates "
            f"{cfg.gen_tokens} tokens greedily from the received shards, and 'k/"
            f"{cfg.gen_tokens} steps follow the rule' counts the generated steps that obey "
            "it (about 0 untrained; rising as the trainer learns)")
    return lines


class Progress:
    """Prints the processes' events (``DemoConfig.events``) as they come, from a thread
    while the launch runs: each refit's report when it is verified, and on a terminal the
    setup steps before the first one (so the first call's minute is not silent). Quiet
    about setup when stdout is not a terminal (piped, logged)."""

    def __init__(self, cfg: DemoConfig, path: str, t0: float) -> None:
        self.cfg, self.path, self.t0 = cfg, path, t0
        self.setup = sys.stdout.isatty()
        self.printed: set[int] = set()
        self.ok = True
        self._offset = 0
        self._joined: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="xreshard-demo-progress",
                                        daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()                    # whatever arrived after the last look

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._poll()

    def _poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[:chunk.rfind("\n") + 1]     # a line still being written waits
        self._offset += len(complete.encode())
        for line in complete.splitlines():
            self._show(json.loads(line))
        sys.stdout.flush()

    def record(self, rec: dict) -> None:
        """Print one refit's report (once)."""
        if rec["refit"] in self.printed:
            return
        self.printed.add(rec["refit"])
        lines, ok = format_record(self.cfg, rec)
        self.ok &= ok
        print("\n".join(lines))

    def _show(self, ev: dict) -> None:
        if ev["kind"] == "refit":
            self.record(ev["record"])
            return
        if not self.setup:
            return
        who, kind = ev["who"], ev["kind"]
        text = None
        if kind == "ready" and who == "trainer":
            text = (f"trainer: JAX up on {ev['devices']} CPU devices; joining the world "
                    f"(waits for {self.cfg.torch_procs} torch process(es) to start)")
        elif kind == "ready":
            text = f"{who}: torch up; joining the world"
        elif kind == "joined":
            self._joined.add(who)
            if len(self._joined) == 1 + self.cfg.torch_procs:
                text = f"all {len(self._joined)} processes joined the world"
        elif kind == "refit-start" and ev["refit"] == 1:
            text = ("refit 1: exchanging layouts, planning and creating the transports "
                    "(first call only)")
        elif kind == "training" and ev["steps"]:
            text = (f"trainer: {ev['steps']} optimizer steps"
                    + (" (the first compiles the training step with jax.jit)"
                       if ev["first"] else ""))
        if text:
            print(f"  [{ev['t'] - self.t0:6.1f} s] {text}")
