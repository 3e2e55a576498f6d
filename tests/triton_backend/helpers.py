"""What the Triton tests share: interpreted kernels and bit-level comparisons."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Sequence

import pytest
import torch

from frugal_kernels import ops


def interpreted(names: Sequence[str]) -> Iterator[Dict[str, object]]:
    """Body of a module fixture: the kernel modules ``names`` (of
    frugal_kernels.kernels.triton) imported under TRITON_INTERPRET=1 for the
    module's tests, and imported again without it afterwards, for GPU tests
    that may follow in the same session. triton.jit decides between compiling
    and interpreting when a module is imported; the kernels call no function
    of triton.language itself, whose mode was fixed when triton was imported."""
    importlib.import_module("triton")

    def load() -> Dict[str, object]:
        modules = {}
        for name in names:
            full = f"frugal_kernels.kernels.triton.{name}"
            loaded = sys.modules.get(full)
            modules[name] = importlib.reload(loaded) if loaded else importlib.import_module(full)
        return modules

    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    yield load()
    patch.undo()
    load()


def cpu_backend_available() -> bool:
    return "cpu" in ops.usable_backends("cpu")


needs_cpu = pytest.mark.skipif(not cpu_backend_available(),
                               reason="frugal_kernels._C is not built (the cpu backend)")


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Bits of floats as integers that are ordered as the floats are."""
    ints = {4: torch.int32, 2: torch.int16}[t.element_size()]
    bits = t.contiguous().view(ints).to(torch.int64)
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def assert_same_bits(actual, expected, what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        differ = int((ulps(a, e) != 0).sum())
        assert differ == 0, (f"{what}[{i}]: {differ} of {a.numel()} values differ from the cpu "
                             f"backend (max {int(ulps(a, e).max()) if a.numel() else 0} ulp)")


def assert_near_reference(actual, expected, what: str) -> None:
    """fp32: max |a - e| <= 1e-6 * max |e|; 16-bit: at most one ulp apart."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.numel() == 0:
            continue
        if a.dtype == torch.float32:
            rel = float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))
            assert rel <= 1e-6, f"{what}[{i}]: relative difference {rel:.3g} from the reference"
        else:
            worst = int(ulps(a, e).max())
            assert worst <= 1, f"{what}[{i}]: {worst} ulp from the reference"


ROOT = Path(__file__).resolve().parents[2]  # the repository root


def compile_for_h200(script: str) -> str:
    """Run ``script`` in a fresh interpreter, without TRITON_INTERPRET, from the
    repository root (a tests/ folder on the path could shadow packages), so that
    it compiles kernels for sm_90 with Triton's bundled ptxas: no GPU needed.
    Returns its stdout; skips without Triton's NVIDIA backend."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
