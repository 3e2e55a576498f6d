"""Loading the compiled kernels (frugal_kernels._C) and describing the build.

The package works without them: when _C is missing or fails to load, a
warning is logged once and every op runs on its torch (reference) backend.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any, Optional

from frugal_kernels._version import __version__

logger = logging.getLogger("frugal_kernels")

_C: Optional[Any] = None
_C_ERROR: Optional[str] = None

try:
    from frugal_kernels import _C  # type: ignore[attr-defined,no-redef]
except Exception as exc:  # an ImportError, or a broken binary's OSError
    _C = None
    _C_ERROR = f"{type(exc).__name__}: {exc}"
    logger.warning(
        "frugal_kernels: the compiled kernels (_C) could not be loaded (%s); "
        "every op will use the torch backend. Reinstall with `pip install .` to build them.",
        _C_ERROR,
    )


def extension() -> Optional[Any]:
    """The compiled module, or None when it is not available."""
    return _C


def _select_cpu_isa_from_env() -> None:
    wanted = os.environ.get("FRUGAL_CPU_ISA")
    if _C is not None and wanted and not _C.cpu_select_isa(wanted):
        logger.warning("frugal_kernels: FRUGAL_CPU_ISA=%s is not built or not supported here; "
                       "using %s", wanted, _C.cpu_isa_active())


_select_cpu_isa_from_env()


def extension_info() -> dict:
    """What was built: the package version, whether the compiled extension
    loaded (and why not), the CPU ISA levels compiled and the one in use,
    OpenMP, whether CUDA kernels were built with their architectures and the
    nvcc version. ``frugal_kernels.build_info()`` adds the usable backends."""
    info: dict = {
        "version": __version__,
        "extension": _C is not None,
        "extension_error": _C_ERROR,
        "machine": platform.machine(),
        "cpu_isa_levels": [],
        "cpu_isa": None,
        "openmp": False,
        "cuda": False,
        "cuda_archs": None,
        "nvcc_version": None,
        "compiler": None,
    }
    if _C is not None:
        info.update(_C.build_info())
        info["cpu_isa"] = _C.cpu_isa_active()
    return info
