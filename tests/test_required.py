"""FRUGAL_REQUIRE_CUDA=1 (set by bench/gpu_check.sh on a GPU machine) turns the skips
for a missing compiled extension into failures."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pytest in a fresh process where importing frugal_kernels._C fails, as with a broken build.
WITHOUT_C = ("import sys; sys.modules['frugal_kernels._C'] = None; import pytest; "
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', "
             "'tests/cuda_backend/test_gpu.py']))")


def _collect(require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FRUGAL_REQUIRE_CUDA"}
    if require:
        env["FRUGAL_REQUIRE_CUDA"] = "1"
    return subprocess.run([sys.executable, "-c", WITHOUT_C], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_missing_extension_skips_by_default_and_fails_when_required():
    skipped = _collect(require=False)
    assert skipped.returncode in (0, 5), skipped.stdout + skipped.stderr  # 5: none collected
    assert "error" not in skipped.stdout.lower()
    failed = _collect(require=True)
    assert failed.returncode not in (0, 5), failed.stdout + failed.stderr
    assert "FRUGAL_REQUIRE_CUDA=1 says it must be here" in failed.stdout
