#!/usr/bin/env bash
# GPU checks for the nccl transport: every `pytest -m gpu` test and benchmarks/bench_gpu.py.
#
# Made for a machine with one GPU and NO network access. Run from anywhere:
#     OUT=/some/dir bash scripts/gpu_check.sh
# Results go to ${OUT:-./gpu-results}: pytest-gpu.xml (JUnit), pytest-gpu.txt, bench_gpu.txt,
# env.txt and gpu_check.log. The whole run stays under 5 minutes (each step has a `timeout`).
#
# Dependencies: if numpy, torch, cupy (with NCCL) and pytest are already importable, nothing
# is installed. Otherwise the wheels must travel with the checkout, because pip cannot reach
# an index there: put them in ./wheels/ (or set WHEELS=dir; ./.whl/ is also looked at), e.g.
#     pip download --only-binary=:all: --python-version 3.12 -d wheels cupy-cuda12x nvidia-nccl-cu12 ...
# They are installed with --no-index into a private target added to PYTHONPATH. jax is
# optional (its zero-copy test skips without a JAX GPU backend). xreshard itself is used
# from this checkout through PYTHONPATH; nothing is installed for it.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-./gpu-results}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false        # JAX must not grab 75% of the GPU
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}   # tests/conftest.py defaults JAX to cpu
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }

# Every step's `timeout` is its own cap, further cut to what is left of the whole budget.
BUDGET_S=${GPU_CHECK_BUDGET_S:-285}
cap() {  # cap SECONDS -> min(SECONDS, budget left), at least 1
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -lt "$1" ] && set -- "$left"
    [ "$1" -lt 1 ] && set -- 1
    echo "$1"
}

importable() {
    timeout "$(cap 60)" "$PY" - <<'EOF' >>"$LOG" 2>&1
import importlib, sys
missing = []
for name in ("numpy", "torch", "cupy", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as e:                       # noqa: BLE001 - report anything
        missing.append(f"{name} ({type(e).__name__}: {e})")
if not missing:
    from cupy.cuda import nccl
    if not nccl.available:
        missing.append("cupy.cuda.nccl (CuPy cannot load libnccl)")
print("missing:", missing or "nothing")
sys.exit(1 if missing else 0)
EOF
}

# ---------------------------------------------------------------- 1. dependencies
if importable; then
    log "dependencies already importable: installing nothing"
else
    WHEELS=${WHEELS:-}
    if [ -z "$WHEELS" ]; then
        for d in ./wheels ./.whl; do
            if compgen -G "$d/*.whl" >/dev/null; then WHEELS=$d; break; fi
        done
    fi
    if [ -z "$WHEELS" ]; then
        log "FATAL: dependencies missing and no wheels in ./wheels/ or ./.whl/ (no network here)"
        exit 2
    fi
    SITE=${SITE:-/tmp/xreshard-gpu-site}
    log "installing wheels from $WHEELS into $SITE (--no-index)"
    timeout "$(cap 90)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="$SITE:$PYTHONPATH"
    if ! importable; then
        log "FATAL: dependencies still missing after installing the wheels (see $LOG)"
        exit 2
    fi
fi

# ---------------------------------------------------------------- 2. environment
{
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    timeout "$(cap 20)" nvidia-smi -L 2>&1 || echo "nvidia-smi unavailable"
    timeout "$(cap 40)" "$PY" - <<'EOF' 2>&1
import platform, cupy, torch
from cupy.cuda import nccl
print("python", platform.python_version())
print("cupy", cupy.__version__, "| NCCL runtime", nccl.get_version(), "build", nccl.get_build_version())
print("cupy devices", cupy.cuda.runtime.getDeviceCount())
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available())
try:
    import jax
    print("jax", jax.__version__, jax.devices())
except Exception as e:                           # noqa: BLE001
    print("jax unavailable:", type(e).__name__, e)
EOF
} >"$OUT_DIR/env.txt"
cat "$OUT_DIR/env.txt" | tee -a "$LOG"

# ---------------------------------------------------------------- 3. GPU tests
log "pytest -m gpu"
timeout "$(cap 170)" "$PY" -m pytest -m gpu tests -v -rs -p no:cacheprovider \
    --continue-on-collection-errors --junitxml "$OUT_DIR/pytest-gpu.xml" \
    >"$OUT_DIR/pytest-gpu.txt" 2>&1
PYTEST_RC=$?
tail -n 30 "$OUT_DIR/pytest-gpu.txt" | tee -a "$LOG"
log "pytest exit code: $PYTEST_RC"
# A GPU check whose GPU tests all skipped checked nothing: count that as a failure.
PASSED=$("$PY" -c 'import sys, xml.etree.ElementTree as E
r = E.parse(sys.argv[1]).getroot(); s = r if r.tag == "testsuite" else r[0]
print(int(s.get("tests", 0)) - sum(int(s.get(k, 0)) for k in ("skipped", "failures", "errors")))' \
    "$OUT_DIR/pytest-gpu.xml" 2>/dev/null || echo 0)
log "GPU tests passed: $PASSED"
if [ "$PYTEST_RC" -eq 0 ] && [ "$PASSED" -eq 0 ]; then
    log "every GPU test skipped: no usable GPU (see the skip reasons above)"
    PYTEST_RC=3
fi

# ---------------------------------------------------------------- 4. benchmark
log "benchmarks/bench_gpu.py"
timeout "$(cap 80)" "$PY" benchmarks/bench_gpu.py --size-gib "${BENCH_GIB:-4}" --iters 5 \
    >"$OUT_DIR/bench_gpu.txt" 2>&1
BENCH_RC=$?
cat "$OUT_DIR/bench_gpu.txt" | tee -a "$LOG"
log "benchmark exit code: $BENCH_RC"

if [ "$PYTEST_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ]; then
    log "FAILED (pytest $PYTEST_RC, benchmark $BENCH_RC)"
    exit 1
fi
log "OK"
