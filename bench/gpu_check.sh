#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and torch, triton, pybind11,
# cmake and ninja installed, build the extension, run the GPU tests and the
# benchmark sweep, and leave the logs and results in $OUT (bench/results when
# unset). Sized to finish in a few minutes on one H200:
#   OUT=/tmp/out bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

exec > >(tee "$OUT/gpu_check.log") 2>&1
log() { echo "== $(date +%H:%M:%S) $*"; }
status=0

log "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

log "build (nvcc, sm_90 + PTX)"
FRUGAL_CUDA=1 FRUGAL_CUDA_ARCHS="${FRUGAL_CUDA_ARCHS:-90}" FRUGAL_BUILD_JOBS=16 \
  $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { status=1; tail -40 "$OUT/build.log"; }
$PY -c "import frugal_kernels, json; print(json.dumps(frugal_kernels.build_info(), indent=1))"

log "GPU tests"
timeout 240 $PY -m pytest -q -m gpu tests || status=1

log "op and optimizer benchmarks on cuda"
timeout 300 $PY -m frugal_kernels bench --device cuda --out "$OUT" || status=1
log "done (status $status)"
exit $status
