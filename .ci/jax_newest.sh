#!/usr/bin/env bash
# CI, second leg: the fast tier's JAX tests with the newest JAX, on Python 3.12 (JAX >= 0.11
# needs it; the main leg's Python 3.11 stops at JAX 0.10.2). No torch here: on 3.12 PyPI's
# torch is a CUDA build of several GB, so this leg runs the test files that use JAX, and
# their tests that need torch (the rendezvous store is torch's TCPStore) skip.
# Cost on 2 cores: ~5 min to install (jax, jaxlib, optax, scipy: ~150 MB) plus the tests
# (~1 min). `jax_newest.sh install` only installs, `jax_newest.sh test` only runs the tests
# (.ci/run installs beside the main leg); no argument: both.
set -euo pipefail
what="${1:-all}"
cd "$(dirname "$0")/.."
PY=""
for cand in python3.12 "$(command -v pyenv >/dev/null && PYENV_VERSION=3.12 pyenv which python3.12 2>/dev/null || true)" \
            /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY="$cand"; break
    fi
done
if [ -z "$PY" ]; then
    echo "jax_newest: no Python 3.12 found; this leg needs one" >&2
    exit 1
fi
if [ "$what" != "test" ]; then
    "$PY" -m venv .venv312
    . .venv312/bin/activate
    pip install -q --upgrade pip
    # the requirements of '.[jax,dev]' read from pyproject.toml, not the project itself: its
    # editable install writes xreshard.egg-info in the tree, which the main leg's install
    # may be writing at the same time (.ci/run runs this phase beside it)
    python - <<'PYEOF' > .venv312/requirements.txt
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["jax"] + extras["dev"] + ["jax>=0.11"]))
PYEOF
    pip install -q -r .venv312/requirements.txt
    [ "$what" = "install" ] && exit 0
fi
. .venv312/bin/activate
pip install -q --no-deps -e .
python -c 'import jax, sys; print(f"jax_newest: Python {sys.version.split()[0]}, jax {jax.__version__}")'
python -m pytest -q -p no:cacheprovider -m "not slow" $(grep -l jax tests/test_*.py)
