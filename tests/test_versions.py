"""The supported torch and Triton versions: the rule, and the warning at import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frugal_kernels import _versions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("torch_version, triton_version", [
    ("2.11.0+cu130", "3.6.0"),     # the GPU machine's pair, the oldest supported
    ("2.13.0+cpu", "3.9.0"),       # CI's
    ("2.13.0+cpu", None),          # no Triton: it is optional
    ("2.11.0a0+git1f2e3d", None),  # a nightly of 2.11 counts as 2.11
    ("3.0.0", "4.0.0"),
    ("unknown", "weird"),          # unreadable: nothing is claimed
])
def test_supported_versions_say_nothing(torch_version, triton_version):
    assert _versions.unsupported(torch_version, triton_version) == []


def test_older_versions_are_named_with_the_oldest_supported():
    lines = _versions.unsupported("2.10.2+cu126", "3.5.1")
    assert len(lines) == 2
    assert "torch >= 2.11" in lines[0] and "torch 2.10.2+cu126" in lines[0]
    assert "triton >= 3.6" in lines[1] and "triton 3.5.1" in lines[1]
    assert _versions.unsupported("1.13.1", None) == [
        "frugal_kernels supports torch >= 2.11; found torch 1.13.1, which is untested and "
        "may fail or differ"]


_IMPORT = """
import warnings
import torch
if {old}:
    torch.__version__ = "2.10.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import frugal_kernels
print([str(w.message) for w in caught if "frugal_kernels supports" in str(w.message)])
"""


@pytest.mark.parametrize("old", [False, True])
def test_import_warns_only_on_an_older_torch(old):
    """A fresh interpreter: the check runs once, when the package is first imported."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", _IMPORT.format(old=old)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    if old:
        assert said == ["frugal_kernels supports torch >= 2.11; found torch 2.10.0, which is "
                        "untested and may fail or differ"]
    else:
        assert said == []
