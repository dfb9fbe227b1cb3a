#!/usr/bin/env bash
# The GPU check on ONE GPU (issues 13, 18 and 33), for a fresh machine with no network and
# nothing to install: the checkout runs from PYTHONPATH under the machine's python3. Two
# runs, each under 300 s:
#
#     OUT=/some/dir bash scripts/gpu_check.sh           # correctness (the parts below)
#     OUT=/some/dir bash scripts/gpu_check.sh bench     # bandwidth and FP8/delta benchmarks
#     XRESHARD_GPU_CHECK_DRY=1 OUT=/tmp/x bash scripts/gpu_check.sh [bench]   # no GPU: walk
#     GPU_CHECK_PARTS="d_cases a1_shrink" OUT=... bash scripts/gpu_check.sh   # a rerun of some
#
# What comes back from a lent GPU machine is at most 8 files from $OUT and the end of the
# output, so every part works in a scratch folder and $OUT receives exactly two files:
#   summary.json   every part with its status (ok / failed / timed out / not run), its
#                  figure, its bar (what "ok" compares), its seconds and cap; "ok" (every
#                  part that ran passed) apart from "complete" (every part ran to its end)
#   gpu_check.tgz  the scratch folder: each part's log and detail JSON, the children's logs
# and the output prints two or three lines per part, the verdict last.
#
# Budget: GPU_CHECK_BUDGET_S (default 292 s) for the whole run. The parts' caps sum to at
# most the budget less RESERVE_S (the summary, the archive, the kill-afters), so the budget
# never cuts a part: one that needs more than its cap times out on its own, and the others
# still run. The JAX children share one compilation cache (a scratch folder, not archived).
# A dry run runs no part and marks each "not run" with its cap.
#
# Correctness parts (`gpu_check.sh`), the most valuable first:
#   env                versions, CuPy's NCCL against torch's, the executor's CUDA preflight
#   a_executor         the executor over a 1-rank NCCL communicator: bf16 JAX -> torch in
#                      place, fused qkv, a transposed kernel, an fp32 -> bf16 cast, staging
#                      rounds, a side-stream consumer without a device sync and its control
#   d_cases            DLPack: verify=True on strided bf16 / fp8 device regions; the aliasing
#                      refusal on device memory; donating the sent JAX arrays after a refit
#                      and after Refit.start (bit-exact or the typed refusal, nothing else)
#   b_nccl_processes   a JAX and a torch process refit 96 tensors over NCCL on one GPU
#   h_delta_device     delta=True from JAX GPU arrays to torch CUDA tensors over NCCL: the diff
#                      with jitted JAX on the GPU (baselines on the GPU), applied with torch
#                      ops, bit-exact call after call (issue 22; tests/test_gpu_device_path.py)
#   b1_slow_producer   (issue 33 B1) delta=True, verify=False, packed buckets, from arrays a
#                      ~0.4 s jitted step still computes when the refit starts: bit-exact
#   i_fp8_device       FP8 quantized on the way on the GPU: JAX quantizes whole blocks there,
#                      codes + scales cross NCCL, bytes equal vLLM's (issues 20, 33 A2)
#   i_fp8_delta        delta=True into FP8 CUDA destinations: scales and codes diffed on the
#                      GPU, applied there, split blocks requantized (issues 20 + 22)
#   b2_split_blocks    (issue 33 B2) FP8 CUDA destinations whose blocks straddle the senders,
#                      several block groups per scratch: codes and scales equal the host's
#   a3_fp8_stage       (issue 33 A3) atomic staging of float8 and bf16 CUDA bindings
#   pytest_gpu         `pytest -m gpu` of check_writes (a fused AdamW step on CUDA after
#                      Refit.start, the checksum on the device), the raw NCCL transport
#                      suite and the NCCL epoch tests; fails if every test skipped
#   a1_shrink          (issue 33 A1) 3 processes on GPU 0 (an NCCL_HOSTID each before NCCL
#                      2.30): rank 2 leaves, the others ncclCommShrink it away with the abort
#                      flag and move 1 MiB over the shrunk communicator bit-exact
#   g_relay            relay="on" between processes declaring two hosts, over cuda_ipc
#   g_relay_delta      relay="on" with delta=True over cuda_ipc: the forwarders diff what
#                      landed on their GPU and forward deltas (issue 22)
#   f_ipc_torch        two torch processes over cuda_ipc: expandable-segment memory staged,
#                      staging on both ends, verify=True; Refit.start on a side stream and
#                      its control
#
# Benchmark parts (`gpu_check.sh bench`):
#   env                as above
#   c_bandwidth        pack/unpack (back-to-back calls between CUDA events) and NCCL
#                      send/recv to self against a D2D copy
#   e_cuda_ipc         JAX -> torch process through cuda_ipc, 4 GiB, against a device copy
#   j_delta_bench      bench_delta.py --device cuda: dense vs delta refit side by side on one
#                      GPU; bar time_ratio <= 0.15 at 1% changed (issue 22's GPU target)
#   k_fp8_bench        FP8 refit vs bf16 refit side by side on one GPU; bar <= 0.6x (issue 20)
set -uo pipefail

MODE=${1:-check}
case "$MODE" in
    check|bench) ;;
    *) echo "usage: gpu_check.sh [check|bench]" >&2; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
DRY=${XRESHARD_GPU_CHECK_DRY:-0}
OUT_DIR=$(mkdir -p "${OUT:-./gpu-results}" && cd "${OUT:-./gpu-results}" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/xreshard-gpu-check.XXXXXX")
JAX_CACHE=$(mktemp -d "${TMPDIR:-/tmp}/xreshard-jax-cache.XXXXXX")   # shared, not archived
mkdir -p "$WORK/parts"
LOG="$WORK/gpu_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false        # JAX must not grab 75% of the GPU
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}   # tests/conftest.py defaults JAX to cpu
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# every JAX child compiles into one cache: the later ones load what the first compiled
export JAX_COMPILATION_CACHE_DIR="$JAX_CACHE"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1

BUDGET_S=${GPU_CHECK_BUDGET_S:-292}
RESERVE_S=12                                      # the summary, the archive, kill-afters
KILL_AFTER_S=2
ORDER=0
CAPS_S=0
say() { echo "$*" | tee -a "$LOG"; }

# A one-line JSON string of $1 (for the part records), without a python per call.
json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}

# A one-line JSON string of $1 (for the part records), without a python per call.
json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}

# The files a part's command names (python -m MODULE, a .py path): a dry run checks they
# exist, so the parts it walks are the ones a GPU run would run.
missing_files() {
    local prev="" arg missing=""
    for arg in "$@"; do
        if [ "$prev" = "-m" ] && [ "$arg" != "pytest" ]; then
            [ -f "$REPO/${arg//.//}.py" ] || missing="$missing ${arg//.//}.py"
        elif [[ "$arg" == *.py ]] && [ "$prev" != "-m" ]; then
            [ -f "$REPO/$arg" ] || missing="$missing $arg"
        fi
        prev=$arg
    done
    echo "$missing"
}

# part NAME SECONDS BAR COMMAND...: run COMMAND under `timeout` (at most what the budget has
# left), output in $WORK/NAME.log; its details are in $WORK/NAME.json when it writes them.
# Records the part in $WORK/parts/NAME.json and prints two or three lines. Never fails.
part() {
    local name=$1 secs=$2 bar=$3
    shift 3
    ORDER=$((ORDER + 1))
    CAPS_S=$((CAPS_S + secs))
    local left=$((BUDGET_S - RESERVE_S - SECONDS)) start=$SECONDS rc=0 timed_out=false
    local why="" limit=$secs
    [ "$left" -lt "$limit" ] && limit=$left
    if [ -n "${GPU_CHECK_PARTS:-}" ] && [[ " $GPU_CHECK_PARTS " != *" $name "* ]]; then
        why="not selected (GPU_CHECK_PARTS)"
        : >"$WORK/$name.log"
    elif [ "$DRY" = "1" ]; then
        why="dry run; cap ${secs}s"
        local missing
        missing=$(missing_files "$@")
        [ -n "$missing" ] && why="dry run; cap ${secs}s; MISSING:$missing"
        echo "dry run: would run (timeout ${limit}s): $*" >"$WORK/$name.log"
    elif [ "$limit" -lt 5 ]; then
        why="out of time (budget ${BUDGET_S}s)"
        : >"$WORK/$name.log"
    else
        timeout --kill-after=$KILL_AFTER_S "$limit" "$@" >"$WORK/$name.log" 2>&1
        rc=$?
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
    fi
    printf '{"name": "%s", "order": %d, "rc": %d, "seconds": %d, "cap_s": %d, "timeout_s": %d, "timed_out": %s, "not_run": %s, "bar": %s}\n' \
        "$name" "$ORDER" "$rc" $((SECONDS - start)) "$secs" "$limit" "$timed_out" \
        "$(json_str "$why")" "$(json_str "$bar")" >"$WORK/parts/$name.json"
    "$PY" - "$WORK" "$name" <<'EOF' 2>>"$LOG" | tee -a "$LOG" || say "[$name] (no status line)"
import json, sys
from pathlib import Path
work, name = Path(sys.argv[1]), sys.argv[2]
rec = json.loads((work / "parts" / f"{name}.json").read_text())
try:
    detail = json.loads((work / f"{name}.json").read_text())
except Exception:
    detail = {}
if rec["not_run"]:
    print(f"[{name}] not run ({rec['not_run']})")
    sys.exit(0)
status = ("timed out" if rec["timed_out"] else
          "ok" if rec["rc"] == 0 and detail.get("ok") is True else "FAILED")
figure = detail.get("figure") or detail.get("error") or "no figure (see its log)"
print(f"[{name}] {status} in {rec['seconds']}s: {str(figure)[:300]}")
if status != "ok":
    tail = (work / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
    for line in tail:
        print(f"    | {line[:200]}")
EOF
    return 0
}

# summary.json and gpu_check.tgz into $OUT, on exit whatever happened; the verdict is the
# last line printed; the exit status says whether every part ran and passed (never after a
# dry run).
finish() {
    "$PY" - "$WORK" "$OUT_DIR" "$DRY" "$BUDGET_S" "$SECONDS" "$MODE" "$CAPS_S" "$RESERVE_S" <<'EOF' 2>>"$LOG" || echo '{"ok": false, "complete": false, "error": "summary failed: see gpu_check.log in gpu_check.tgz"}' >"$OUT_DIR/summary.json"
import json, sys
from pathlib import Path
work, out, dry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
budget, seconds, mode, caps, reserve = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], \
    int(sys.argv[7]), int(sys.argv[8])

def load(path):
    try:
        return json.loads(Path(path).read_text())
    except Exception as e:          # missing or cut short: say so
        return {"missing": f"{Path(path).name}: {type(e).__name__}: {e}"}

parts = []
for rec in sorted((load(p) for p in (work / "parts").glob("*.json")),
                  key=lambda r: r.get("order", 0)):
    detail = load(work / f"{rec.get('name')}.json")
    if rec.get("not_run"):
        status = "not run"
    elif rec.get("timed_out"):
        status = "timed out"
    elif rec.get("rc") == 0 and detail.get("ok") is True:
        status = "ok"
    else:
        status = "failed"
    parts.append({"name": rec.get("name"), "status": status,
                  "figure": detail.get("figure", detail.get("error")),
                  "bar": detail.get("bar") or rec.get("bar"), "seconds": rec.get("seconds"),
                  "cap_s": rec.get("cap_s"), "timeout_s": rec.get("timeout_s"),
                  "rc": rec.get("rc"), "why_not_run": rec.get("not_run") or None,
                  "detail": {k: v for k, v in detail.items()
                             if k not in ("figure", "bar", "traceback")}
                  if "missing" not in detail else None})
counts = {s: sum(p["status"] == s for p in parts)
          for s in ("ok", "failed", "timed out", "not run")}
ran = [p for p in parts if p["status"] != "not run"]
# ok: every part that ran passed (a timed-out part ran and did not pass); complete: every
# part ran to its end. A dry run is neither.
ok = bool(ran) and not dry and all(p["status"] == "ok" for p in ran)
complete = bool(parts) and not dry and counts["not run"] == 0 and counts["timed out"] == 0
summary = {"mode": mode, "ok": ok, "complete": complete, "dry": dry, "seconds": seconds,
           "budget_s": budget, "reserve_s": reserve, "caps_s": caps,
           "caps_fit": caps <= budget - reserve, "counts": counts, "parts": parts}
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
bad = [f"{p['name']} ({p['status']})" for p in parts if p["status"] in ("failed", "timed out")]
verdict = (f"VERDICT gpu_check {mode}: ok={ok} complete={complete}: "
           + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
           + f" in {seconds}s (caps {caps}s of {budget - reserve}s, budget {budget}s)"
           + (f"; not ok: {', '.join(bad)}" if bad else "") + (" [dry run]" if dry else ""))
(work / "verdict.txt").write_text(verdict + "\n")
EOF
    tar czf "$OUT_DIR/gpu_check.tgz" -C "$WORK" . 2>/dev/null || say "could not archive $WORK"
    local ok verdict
    ok=$("$PY" -c 'import json, sys; s = json.load(open(sys.argv[1]))
print(s.get("ok") is True and s.get("complete") is True)' "$OUT_DIR/summary.json" 2>/dev/null)
    verdict=$(cat "$WORK/verdict.txt" 2>/dev/null ||
              echo "VERDICT gpu_check $MODE: no summary (see gpu_check.log in gpu_check.tgz)")
    rm -rf "$WORK" "$JAX_CACHE"
    echo "$verdict"
    [ "$ok" = "True" ]
}
trap 'finish; exit $?' EXIT

say "gpu_check $MODE: $(date -u +%FT%TZ) repo $REPO, budget ${BUDGET_S}s (parts $((BUDGET_S - RESERVE_S))s)$([ "$DRY" = "1" ] && echo ', DRY RUN: no part runs')"

# ---------------------------------------------------------------- env (both runs)
part env 15 "CuPy's preflight (NVRTC copy and bf16 kernels) runs; CuPy uses torch's NCCL; no NCCL wheel of another CUDA major" \
    "$PY" - "$WORK/env.json" <<'EOF'
import json, platform, subprocess, sys, time
facts = {"python": platform.python_version()}
def note(key, fn):
    try:
        facts[key] = fn()
    except Exception as e:      # report anything, go on
        facts[key] = f"{type(e).__name__}: {e}"
note("nvidia_smi", lambda: subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                          timeout=15).stdout.strip())
import numpy
facts["numpy"] = numpy.__version__
note("ml_dtypes", lambda: __import__("ml_dtypes").__version__)
import torch
facts["torch"] = f"{torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()}"
from xreshard.transport.nccl_setup import (cuda_major, format_version, import_cupy,
                                           nccl_wheel_clash, torch_nccl)
note("torch_nccl", lambda: format_version(torch_nccl()[0]) if torch_nccl() else None)
note("nccl_wheel_clash", lambda: nccl_wheel_clash(torch.version.cuda))
cupy, nccl = import_cupy()
facts["cupy"] = cupy.__version__
note("cuda_runtime", lambda: cupy.cuda.runtime.runtimeGetVersion())
note("cuda_driver", lambda: cupy.cuda.runtime.driverGetVersion())
note("nccl", lambda: format_version(int(nccl.get_version())))
note("devices", lambda: cupy.cuda.runtime.getDeviceCount())
note("jax", lambda: f"{__import__('jax').__version__} {__import__('jax').devices()}")
from xreshard.runtime.execute import cuda_preflight, cupy_knows
from xreshard.transport.cuda_ipc import CupyCuda
note("device_uuid", lambda: CupyCuda().device_uuid(0))
note("cupy_uuid_prefix", lambda: bytes(cupy.cuda.runtime.getDeviceProperties(0)["uuid"]).hex())
facts["cupy_cuda_major"] = cuda_major()
facts["cupy_bf16_kernels"] = cupy_knows("bfloat16")
t = time.perf_counter()
note("preflight", lambda: cuda_preflight(0) or "ok")
facts["preflight_seconds"] = round(time.perf_counter() - t, 2)
same_nccl = facts.get("torch_nccl") in (None, facts.get("nccl"))
facts["ok"] = facts["preflight"] == "ok" and same_nccl and not facts.get("nccl_wheel_clash")
facts["figure"] = (f"{facts.get('nvidia_smi', '?')[:60]}; CuPy {facts['cupy']} (CUDA "
                   f"{facts['cupy_cuda_major']}), NCCL {facts.get('nccl')} (torch's "
                   f"{facts.get('torch_nccl')}), torch {torch.__version__}, preflight "
                   f"{facts['preflight']} in {facts['preflight_seconds']}s")
json.dump(facts, open(sys.argv[1], "w"), indent=1)
print(json.dumps(facts, indent=1))
sys.exit(0 if facts["ok"] else 1)
EOF

if [ "$MODE" = "check" ]; then
# ---------------------------------------------------------------- the executor, DLPack
part a_executor 22 "every case bit-exact; the side-stream control without the final wait reads stale bytes" \
    "$PY" -m tests.test_gpu_refit executor --json "$WORK/a_executor.json"

part d_cases 20 "verify on strided bf16/fp8 device regions; aliasing refused; donation after refit and Refit.start bit-exact or the typed refusal, the bf16 array copied not donated" \
    "$PY" -m tests.test_gpu_check cases --json "$WORK/d_cases.json"

# ---------------------------------------------------------------- NCCL between processes
part b_nccl_processes 22 "JAX -> torch process over NCCL on one GPU, 96 tensors bit-exact; any error fails" \
    "$PY" -m tests.test_gpu_refit two-processes --timeout 18 \
    --json "$WORK/b_nccl_processes.json" --logs "$WORK/b_logs"

# ---------------------------------------------------------------- device delta (issue 22)
part h_delta_device 22 "JAX GPU -> torch CUDA over NCCL, delta=True, baselines on the GPU: bit-exact after every call, calls 2-4 deltas of <= 0.08x the dense bytes" \
    "$PY" -m tests.test_gpu_device_path delta --baseline device --timeout 18 \
    --json "$WORK/h_delta_device.json" --logs "$WORK/h_logs"

part b1_slow_producer 20 "delta=True, verify=False, packed buckets from arrays a ~0.4 s jitted step still computes when the refit starts: bit-exact every call" \
    "$PY" -m tests.test_gpu_device_path slow-producer --baseline device --timeout 16 \
    --json "$WORK/b1_slow_producer.json" --logs "$WORK/b1_logs"

# ---------------------------------------------------------------- device FP8 (issue 20)
part i_fp8_device 18 "JAX GPU -> torch CUDA FP8 (block + MXFP8) quantized on the GPU: codes and scales equal vLLM's quantizer's bytes; wire <= 0.52x bf16" \
    "$PY" -m tests.test_gpu_device_path fp8 --timeout 14 \
    --json "$WORK/i_fp8_device.json" --logs "$WORK/i_logs"

part i_fp8_delta 18 "JAX GPU -> torch CUDA FP8, delta=True: codes and scales equal the host quantizer's after every call; 1% steps deltas of <= 0.5x the dense bytes, the all-changed step dense" \
    "$PY" -m tests.test_gpu_device_path fp8-delta --baseline device --timeout 14 \
    --json "$WORK/i_fp8_delta.json" --logs "$WORK/i_delta_logs"

part b2_split_blocks 12 "FP8 CUDA destinations with blocks split across senders (several block groups per scratch): codes and scales equal the host quantizer's" \
    "$PY" -m tests.test_gpu_probes split-blocks --json "$WORK/b2_split_blocks.json"

part a3_fp8_stage 8 "atomic staging of float8 codes, e8m0 scales and bf16 CUDA bindings: shadows hold the old bytes, the commit the new ones" \
    "$PY" -m tests.test_gpu_probes stage --json "$WORK/a3_fp8_stage.json"

# ---------------------------------------------------------------- pytest -m gpu: check_writes, NCCL
part pytest_gpu 35 "no failure or error, and at least one GPU test ran (all skipped fails)" \
    bash -c '"$0" -m pytest -m gpu tests/test_writes.py tests/test_gpu.py \
        tests/test_nccl_epochs.py -q -rs -p no:cacheprovider --junitxml "$1/pytest_gpu.xml"; \
        "$0" - "$1" <<"PYEOF"
import json, sys
import xml.etree.ElementTree as ET
work = sys.argv[1]
try:
    root = ET.parse(f"{work}/pytest_gpu.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except Exception as e:
    n = {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "parse_error": str(e)}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
ok = passed >= 1 and n["failures"] == 0 and n["errors"] == 0
json.dump({**n, "passed": passed, "ok": ok,
           "figure": f"{passed} passed, {n['skipped']} skipped, {n['failures']} failed, "
                     f"{n['errors']} errors"}, open(f"{work}/pytest_gpu.json", "w"))
sys.exit(0 if ok else 1)
PYEOF' "$PY" "$WORK"

part a1_shrink 20 "3 processes on GPU 0; rank 2 leaves, ranks 0 and 1 ncclCommShrink it away (abort) and move 1 MiB bit-exact over the shrunk communicator" \
    "$PY" -m tests.test_gpu_probes shrink --timeout 15 --json "$WORK/a1_shrink.json" \
    --logs "$WORK/a1_logs"

# ---------------------------------------------------------------- relay, cuda_ipc
part g_relay 15 "relay over cuda_ipc between two declared hosts: one copy sent, one forwarded, bit-exact" \
    "$PY" -m tests.test_gpu_check relay --timeout 12 --json "$WORK/g_relay.json"

part g_relay_delta 15 "relay + delta=True over cuda_ipc: the second call (1% changed) sends and forwards deltas diffed on the GPU (< 0.1x the model each), bit-exact and verified" \
    "$PY" -m tests.test_gpu_check relay-delta --timeout 12 --json "$WORK/g_relay_delta.json"

part f_ipc_torch 15 "torch -> torch over cuda_ipc: staged expandable segments, staging both ends, verified; Refit.start on a side stream exact, its control stale" \
    "$PY" -m tests.test_gpu_check ipc-torch --timeout 12 --json "$WORK/f_ipc_torch.json"
fi

if [ "$MODE" = "bench" ]; then
# ---------------------------------------------------------------- bandwidth
part c_bandwidth 40 "pack/unpack >= 0.70 and NCCL self >= 0.30 of a D2D copy (CUDA events, back-to-back calls)" \
    "$PY" benchmarks/bench_gpu.py --size-gib "${BENCH_GIB:-2}" --iters 5 \
    --json "$WORK/c_bandwidth.json"

part e_cuda_ipc 60 "JAX -> torch process through cuda_ipc, the whole refit >= 0.70 of a device copy" \
    "$PY" -m tests.test_cuda_ipc bench --gib "${CUDA_IPC_GIB:-4}" --reps 3 --timeout 50 \
    --json "$WORK/e_cuda_ipc.json"

# ---------------------------------------------------------------- device-path benchmarks
part j_delta_bench 85 "bench_delta --device cuda: time_ratio <= 0.15 and bytes_ratio <= 0.08 at 1% changed, time_ratio <= 1.10 at 100%" \
    bash -c '"$0" benchmarks/bench_delta.py --device cuda --baseline device \
        --model-mib "${DELTA_BENCH_MIB:-256}" --tensor-mib 64 --changed 1.0,0.01 --reps 2 --json \
        >"$1/j_delta_bench.out"; rc=$?; cat "$1/j_delta_bench.out"; \
        "$0" - "$1" "$rc" <<"PYEOF"
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
lines = [ln for ln in open(f"{work}/j_delta_bench.out").read().splitlines() if ln.startswith("{")]
try:
    rows = json.loads(lines[-1])["refit"]
    figure = "; ".join(f"changed {r['changed']}: time_ratio {r['time_ratio']:.3f}, bytes_ratio "
                       f"{r['bytes_ratio']:.4f}, dense {r['dense_seconds']:.3f} s, delta "
                       f"{r['delta_seconds']:.3f} s, diff {r['diff_seconds']:.3f} s" for r in rows)
    out = {"ok": rc == 0, "figure": figure, "rows": rows}
except Exception as e:
    out = {"ok": False, "error": f"no JSON from bench_delta ({type(e).__name__}: {e}), rc {rc}"}
json.dump(out, open(f"{work}/j_delta_bench.json", "w"))
sys.exit(0 if out["ok"] else 1)
PYEOF' "$PY" "$WORK"

part k_fp8_bench 80 "FP8 refit <= 0.6x the bf16 refit (JAX GPU -> torch CUDA over NCCL, ~1 GiB bf16, medians of 5)" \
    "$PY" -m tests.test_gpu_device_path fp8-bench --timeout 70 \
    --json "$WORK/k_fp8_bench.json" --logs "$WORK/k_logs"
fi

if [ "$CAPS_S" -gt $((BUDGET_S - RESERVE_S)) ]; then
    say "WARNING: the parts' caps sum to ${CAPS_S}s, more than the ${BUDGET_S}s budget less ${RESERVE_S}s"
fi
