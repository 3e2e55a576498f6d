"""``frugal_kernels.build_info()``: what was built and what can run now.

It sits above ``ops``: the facts of the build come from ``_extension`` (below
``ops``), the backends that can run from ``ops._dispatch``.
"""

from __future__ import annotations

from frugal_kernels._extension import extension_info
from frugal_kernels.ops import _dispatch


def build_info() -> dict:
    """What was built and what can run now.

    Returns a dict with the package version, whether the compiled extension
    loaded (and why not), the CPU ISA levels compiled and the one in use,
    OpenMP, whether CUDA kernels were built with their architectures and the
    nvcc version, and the backends usable right now on CPU and CUDA tensors.
    """
    info = extension_info()
    info["backends"] = {
        "cpu": _dispatch.usable_backends("cpu"),
        "cuda": _dispatch.usable_backends("cuda"),
    }
    return info
