#!/usr/bin/env bash
# The GPU check in one call: build the extension with the CUDA kernels, run the
# GPU tests, run the benchmark sweep, and leave everything in $OUT, all inside
# one overall deadline, so that a short GPU slot is never spent without results.
#
#   OUT=/tmp/out bash bench/gpu_check.sh            # on a GPU machine
#   DEV=cpu OUT=/tmp/out bash bench/gpu_check.sh    # a dry run of every step on a CPU
#
# Settings (environment):
#   GPU_CHECK_DEADLINE=450   seconds for the whole script; every step gets at most
#                            what is left, so the files are written before a caller's
#                            own limit (give it ~100 s more than this)
#   GPU_CHECK_BUILD_TIMEOUT=240, GPU_CHECK_BENCH_RESERVE (seconds kept for the bench
#                            when the tests start: 150 on cuda, 60 on cpu)
#   GPU_CHECK_WORKERS=8      pytest-xdist workers for the tests, where it is installed
#   GPU_CHECK_TESTS, GPU_CHECK_BENCH_ARGS   override the test selection / bench options
#   FRUGAL_CUDA_ARCHS=90, FRUGAL_BUILD_JOBS=$(nproc), PYTHON=python3
#
# $OUT receives at most 7 files, none in a folder: gpu_check.log (everything
# printed), junit.xml (the tests), bench-<dev>.json/.md/.png (rewritten after
# each bench section) and extras.tar.gz (build log, build_info, versions,
# nvidia-smi). Exit status 0 only when the build has the backend, no test
# failed or was cut short, no GPU test skipped on a GPU machine and the bench
# finished; each failure is one line starting with "FAIL:" in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${GPU_CHECK_DEADLINE:-450}
DEV=${DEV:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
# Kept for the bench when the tests start, and for the summary at the end.
if [ "$DEV" = cuda ]; then BENCH_RESERVE=${GPU_CHECK_BENCH_RESERVE:-150}
else BENCH_RESERVE=${GPU_CHECK_BENCH_RESERVE:-60}; fi
FINAL_RESERVE=10
# A command that ignores SIGINT is killed this many seconds after it.
GRACE=15

exec 3>&1 4>&2
exec > >(tee "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

FAILS=()
fail() { FAILS+=("$*"); echo "FAIL: $*"; }
left() { echo $((DEADLINE - (SECONDS - START))); }
log() { echo "== $(date +%H:%M:%S) +$((SECONDS - START))s (${1}; $(left) s left)"; }
# limited SECONDS CAP CMD...: CMD with SIGINT at min(CAP, time left - reserve) seconds.
limited() {
  local cap=$1; shift
  local t=$(( $(left) - RESERVE - GRACE ))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 5 ]; then echo "not run, ${t} s is too little for: $*"; return 124; fi
  echo "(limit ${t}s) $*"
  timeout -s INT -k $GRACE "$t" "$@"
}
finish() {
  log "summary"
  tar czf "$OUT/extras.tar.gz" -C "$WORK" . 2>/dev/null || echo "could not write extras.tar.gz"
  echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  echo "wall time $((SECONDS - START)) s of a ${DEADLINE} s deadline (DEV=$DEV)"
  local status=0
  if [ ${#FAILS[@]} -gt 0 ]; then
    status=1
    for f in "${FAILS[@]}"; do echo "FAIL: $f"; done
    echo "GPU CHECK FAILED (${#FAILS[@]} problems above)"
  else
    echo "GPU CHECK PASSED"
  fi
  rm -rf "$WORK"
  exec 1>&3 2>&4
  wait "$TEE_PID" 2>/dev/null
  exit $status
}
trap 'fail "interrupted by a signal"; finish' INT TERM

log "machine (DEV=$DEV, deadline ${DEADLINE}s)"
if [ "$DEV" = cuda ]; then
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv \
    || echo "nvidia-smi failed"
  timeout 20 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
fi
timeout 60 $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'cuda available', torch.cuda.is_available())" \
  || fail "python3 cannot import torch and triton"
timeout 30 $PY -m pip list >"$WORK/pip-list.txt" 2>&1
echo "cores $(nproc); nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo none)"

# ---------------------------------------------------------------- build
log "build (FRUGAL_CUDA=$([ "$DEV" = cuda ] && echo 1 || echo 0))"
# A stale _C from an earlier build must not stand in for a failed one.
rm -f frugal_kernels/_C*.so
if [ "$DEV" = cuda ]; then
  export FRUGAL_CUDA=1 FRUGAL_CUDA_ARCHS=${FRUGAL_CUDA_ARCHS:-90}
else
  export FRUGAL_CUDA=0
fi
export FRUGAL_BUILD_JOBS=${FRUGAL_BUILD_JOBS:-$(nproc)}
RESERVE=$((BENCH_RESERVE + FINAL_RESERVE + 30))
build_started=$SECONDS
limited "${GPU_CHECK_BUILD_TIMEOUT:-240}" $PY setup.py build_ext --inplace >"$WORK/build.log" 2>&1
rc=$?
echo "build: exit $rc after $((SECONDS - build_started)) s (log in extras.tar.gz: build.log)"
if [ $rc -ne 0 ]; then
  tail -30 "$WORK/build.log"
  fail "build: setup.py build_ext --inplace exited $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
fi

# ---------------------------------------------------------------- build_info
log "build_info"
timeout 60 $PY - "$DEV" "$WORK/build_info.json" <<'EOF'
import json, sys
import frugal_kernels
dev, path = sys.argv[1], sys.argv[2]
info = frugal_kernels.build_info()
open(path, "w").write(json.dumps(info, indent=1))
print(json.dumps({k: info.get(k) for k in ("version", "extension", "extension_error", "cpu_isa",
                                           "cuda", "cuda_archs", "backends")}, indent=1))
backend = "cuda" if dev == "cuda" else "cpu"
if backend not in info["backends"][dev]:
    print(f"NO {backend.upper()} BACKEND: build_info()['backends'][{dev!r}] is "
          f"{info['backends'][dev]} (extension loaded: {info['extension']}; "
          f"error: {info['extension_error']})")
    sys.exit(3)
EOF
rc=$?
[ $rc -ne 0 ] && fail "build_info() shows no $([ "$DEV" = cuda ] && echo cuda || echo cpu) backend (exit $rc)"

# ---------------------------------------------------------------- tests
log "tests"
# After the build a missing _C is a failure, not 164 skips (tests/required.py).
export FRUGAL_REQUIRE_CUDA=1
if [ "$DEV" = cuda ]; then
  TESTS=(-m "gpu and not benchmark" tests)
  [ -n "${GPU_CHECK_TESTS:-}" ] && read -r -a TESTS <<<"$GPU_CHECK_TESTS"
else
  # The dry run: the GPU test files (which skip here) and the bindings' CPU tests.
  read -r -a TESTS <<<"${GPU_CHECK_TESTS:-tests/cuda_backend/test_binding.py tests/cuda_backend/test_gpu.py tests/triton_backend/test_gpu.py}"
fi
PYTEST_OPTS=(-q -rfEs -p no:cacheprovider --junitxml="$OUT/junit.xml" --durations=40)
if $PY -c "import xdist" 2>/dev/null; then
  PYTEST_OPTS+=(-n "${GPU_CHECK_WORKERS:-8}")
else
  echo "pytest-xdist is not installed: the tests run in one process"
fi
# One hung test must not take the whole slot.
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_OPTS+=(--timeout=180)
RESERVE=$((BENCH_RESERVE + FINAL_RESERVE))
tests_started=$SECONDS
limited 100000 $PY -m pytest "${PYTEST_OPTS[@]}" "${TESTS[@]}"
rc=$?
echo "tests: exit $rc after $((SECONDS - tests_started)) s"
case $rc in
  0) ;;
  124|130|137) fail "tests cut short at the deadline (exit $rc): see junit.xml for those that ran" ;;
  *) fail "tests: pytest exited $rc" ;;
esac
timeout 60 $PY - "$OUT/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

import torch

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"NO JUNIT REPORT: {exc}")
    sys.exit(3)
cases = list(root.iter("testcase"))
skipped = [(c.get("classname", "") + "::" + c.get("name", ""), s.get("message", ""))
           for c in cases for s in c.findall("skipped")]
failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
print(f"junit: {len(cases)} tests, {len(failed)} failed or errors, {len(skipped)} skipped")
slow = sorted(cases, key=lambda c: -float(c.get("time") or 0))[:10]
print("slowest: " + "; ".join(f"{c.get('name')} {float(c.get('time') or 0):.1f}s" for c in slow))
if skipped and torch.cuda.is_available():
    for name, why in skipped[:20]:
        print(f"  skipped: {name}: {why}")
    print(f"GPU TESTS SKIPPED ON A GPU MACHINE: {len(skipped)}")
    sys.exit(4)
EOF
rc=$?
[ $rc -eq 3 ] && fail "no junit report from the tests"
[ $rc -eq 4 ] && fail "gpu-marked tests were skipped although torch.cuda.is_available()"

# ---------------------------------------------------------------- bench
log "bench"
if [ "$DEV" = cuda ]; then
  read -r -a BENCH <<<"${GPU_CHECK_BENCH_ARGS:-}"
else
  # The dry run: small, every section that runs on a GPU, in this process.
  read -r -a BENCH <<<"${GPU_CHECK_BENCH_ARGS:---quick --ops sign_sgd_ adamw_ grad_norm --rounds 1 --preset tiny --in-process --no-overhead}"
fi
RESERVE=$FINAL_RESERVE
bench_started=$SECONDS
# The tables go to bench-$DEV.md; the log gets each section's time as it ends, the
# progress bars and the full output go to the archive.
limited 100000 $PY -m frugal_kernels bench --device "$DEV" --out "$OUT" --stem "bench-$DEV" \
  "${BENCH[@]}" 2>"$WORK/bench-stderr.txt" | tee "$WORK/bench-output.txt" \
  | grep --line-buffered -E "^bench: |^\(limit|^no time left|skipped|^wrote"
rc=${PIPESTATUS[0]}
echo "bench: exit $rc after $((SECONDS - bench_started)) s"
case $rc in
  0) ;;
  124|130|137) fail "bench cut short at the deadline (exit $rc): bench-$DEV.json holds the sections that finished" ;;
  *) tail -30 "$WORK/bench-stderr.txt"; fail "bench exited $rc" ;;
esac

finish
