"""Skips that the GPU check turns into failures.

Without the built extension the tests that need it skip, which is right on a machine
where it was never built. bench/gpu_check.sh sets FRUGAL_REQUIRE_CUDA=1 on a GPU
machine right after building it: there a missing or unloadable ``_C`` must fail the
run, not skip 164 GPU tests behind a summary that reads as a pass.
"""

import os

import pytest

__all__ = ["required", "skip_unless_required"]


def required() -> bool:
    """Whether this run was told that the built extension must be here."""
    return os.environ.get("FRUGAL_REQUIRE_CUDA") == "1"


def skip_unless_required(reason: str) -> None:
    """Skip the module (at import) or test with ``reason``, or fail it when :func:`required`."""
    if required():
        pytest.fail(f"{reason}, and FRUGAL_REQUIRE_CUDA=1 says it must be here", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
