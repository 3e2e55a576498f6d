"""The torch and Triton versions the package supports, checked once at import.

The oldest supported pair is the one the project's GPU machine runs (torch 2.11
with Triton 3.6); the newest tested is CI's (torch 2.13 with Triton 3.9).
``tools/test_matrix.sh`` runs the suite against the oldest pair.

An older version gets a warning, not an error: pip already refuses to install the
package beside a torch older than ``pyproject.toml`` asks for, so this check only
speaks where pip's resolver was bypassed (a source tree on the path, a preinstalled
torch on a machine that reaches no package registry, ``--no-deps``). There a user
may have no way to upgrade, and much of the package may still work; the warning
says it is untested rather than forbidding what might run.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata
from typing import List, Optional, Tuple

OLDEST_TORCH = (2, 11)
OLDEST_TRITON = (3, 6)


def major_minor(version: Optional[str]) -> Optional[Tuple[int, int]]:
    """(major, minor) of a version string such as "2.11.0+cu130" or "2.12.0a0+git1f2e";
    None when absent or unreadable. A pre-release counts as its release: a nightly of
    2.11 has what 2.11 has."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def unsupported(torch_version: Optional[str], triton_version: Optional[str]) -> List[str]:
    """One line per version older than the oldest supported; nothing is said of a
    version that is missing (Triton is optional) or unreadable."""
    lines = []
    for name, version, oldest in (("torch", torch_version, OLDEST_TORCH),
                                  ("triton", triton_version, OLDEST_TRITON)):
        found = major_minor(version)
        if found is not None and found < oldest:
            lines.append(f"frugal_kernels supports {name} >= {oldest[0]}.{oldest[1]}; found "
                         f"{name} {version}, which is untested and may fail or differ")
    return lines


def installed_triton() -> Optional[str]:
    """Triton's version from its package metadata: importing triton here would cost
    every import of the package, and the check must not touch a GPU."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def warn_if_unsupported() -> None:
    import torch

    for line in unsupported(torch.__version__, installed_triton()):
        warnings.warn(line, UserWarning, stacklevel=3)
