#!/usr/bin/env bash
# Run the test suite against the oldest torch and Triton the package supports, in a
# virtual environment of its own (CI runs only the newest pair; see README "Supported
# versions").
#
#   tools/test_matrix.sh                      # the whole suite
#   tools/test_matrix.sh tests/ops -x -q      # arguments go to pytest
#
# Environment:
#   TORCH=2.11.0 TRITON=3.6.0   the pair (default: the oldest supported)
#   VENV=path                   where the environment lives (default .venvs/torch-$TORCH-triton-$TRITON
#                               under the repository, an ignored path); made when missing,
#                               reused after
#   PYTHON=python3              the interpreter the environment is made from
#
# From PyPI torch is its CUDA build (about 3 GB with its NVIDIA wheels); it runs on the
# CPU all the same, with the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py).
# The package runs from this tree, put on the environment's path with a .pth file (what
# an editable install does): its _C is torch-free, so the one built here serves every
# torch; without one, the cpu backend's tests skip (build it first with
# `FRUGAL_CUDA=0 python setup.py build_ext --inplace`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
torch_version=${TORCH:-2.11.0}
triton_version=${TRITON:-3.6.0}
venv=${VENV:-$root/.venvs/torch-$torch_version-triton-$triton_version}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "test_matrix: making $venv (torch $torch_version, triton $triton_version)"
  "$python" -m venv "$venv"
  # The package's dependencies (pyproject.toml) and its test extra, the pair pinned.
  "$venv/bin/python" -m pip install "torch==$torch_version" "triton==$triton_version" \
    numpy tqdm matplotlib pytest pytest-benchmark hypothesis
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$root" > "$site/frugal_kernels_tree.pth"

# Refuse to report on another pair than asked (a reused environment may have drifted).
"$venv/bin/python" - "$torch_version" "$triton_version" "$root" <<'PY'
import sys
import torch, triton
import frugal_kernels
want_torch, want_triton, root = sys.argv[1:]
found = (torch.__version__.split("+")[0], triton.__version__)
if found != (want_torch, want_triton) or not frugal_kernels.__file__.startswith(root):
    sys.exit(f"test_matrix: the environment has torch {found[0]}, triton {found[1]}, "
             f"frugal_kernels from {frugal_kernels.__file__}; wanted torch {want_torch}, "
             f"triton {want_triton} and this tree")
info = frugal_kernels.build_info()
print(f"test_matrix: torch {torch.__version__}, triton {triton.__version__}, "
      f"_C {'loaded' if info['extension'] else 'missing: ' + str(info['extension_error'])}")
PY

cd "$root"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
