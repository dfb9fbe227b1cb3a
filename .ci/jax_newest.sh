#!/usr/bin/env bash
# CI, second leg: the fast tier's JAX tests with the newest JAX, on Python 3.12 (JAX >= 0.11
# needs it; the main leg's Python 3.11 stops at JAX 0.10.2). No torch here: on 3.12 PyPI's
# torch is a CUDA build of several GB, so this leg runs the test files that use JAX, and
# their tests that need torch (the rendezvous store is torch's TCPStore) skip.
# Cost on 2 cores: ~5 min to install (jax, jaxlib, optax, scipy: ~150 MB) plus the tests.
set -euo pipefail
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
"$PY" -m venv .venv312
. .venv312/bin/activate
pip install -q --upgrade pip
pip install -q -e '.[jax,dev]' 'jax>=0.11'
python -c 'import jax, sys; print(f"jax_newest: Python {sys.version.split()[0]}, jax {jax.__version__}")'
python -m pytest -q -p no:cacheprovider -m "not slow" $(grep -l jax tests/test_*.py)
