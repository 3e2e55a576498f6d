"""Which backend runs an op: the capability table and the choice.

This module is the only place that says which backend runs what (tests/test_layers.py
refuses a list of backends anywhere else in the package): each op's declaration
(:mod:`frugal_kernels.ops._spec`) implements exactly the backends listed here, and the
optimizers and modules ask here (:func:`implements`, :func:`worth_calling`,
:func:`kernel_backend`) rather than list backends of their own.

``backend="auto"`` picks cuda > triton > torch for tensors on a GPU and
cpu > torch for tensors on the CPU; the ``FRUGAL_BACKEND`` environment
variable overrides the automatic choice. Asking for a backend that cannot run
here raises a ValueError that says why.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch

from frugal_kernels._extension import extension

BACKENDS = ("cpu", "cuda", "triton", "torch")
REFERENCE = "torch"  # the backend that is the readable ground truth, and runs anywhere
_AUTO_ORDER = {"cpu": ("cpu", "torch"), "cuda": ("cuda", "triton", "torch")}

# Which backends implement each op (the others fall through in "auto").
CAPABILITIES = {
    "frugal::adamw_": frozenset(BACKENDS),
    "frugal::adamw_int8_": frozenset(BACKENDS),
    "frugal::sign_sgd_": frozenset(BACKENDS),
    # No CUDA-C kernel yet: on GPU tensors "auto" picks triton.
    "frugal::sgd_": frozenset(("cpu", "triton", "torch")),
    "frugal::frugal_step_": frozenset(BACKENDS),
    "frugal::frugal_step_int8_": frozenset(BACKENDS),
    # The GEMMs run in torch (cpu) or in the Triton kernel; no CUDA-C version.
    "frugal::lowrank_step_": frozenset(("cpu", "triton", "torch")),
    # The whole low-rank step with its GEMMs as plain loops: for small matrices on the CPU.
    "frugal::lowrank_adamw_step_": frozenset(("cpu", "torch")),
    "frugal::dqt_update_": frozenset(BACKENDS),
    "frugal::dequantize": frozenset(("cpu", "triton", "torch")),
    # QuantLinear's CPU path is its own blocked dequantize-then-GEMM: no C++ kernel.
    "frugal::quant_matmul": frozenset(("triton", "torch")),
    # The chunked loss on torch's GEMM is the CPU path (no C++ kernel): it and Triton's
    # tiles; frugal::linear_cross_entropy_backward follows the same choice.
    "frugal::linear_cross_entropy": frozenset(("triton", "torch")),
    # The global gradient norm and non-finite flag (out of place).
    "frugal::grad_norm": frozenset(BACKENDS),
}

# Ops worth calling on tensors of a device type only up to a size, (op, device type) ->
# the largest size. lowrank_adamw_step_ on the CPU runs its GEMMs as plain loops: the
# size is rows * cols * rank (the multiply-adds of one of its three GEMMs) of a matrix,
# above which torch's GEMMs and the two-op path (~5 calls per tensor) cost less. Measured
# at 1 thread, 8 tensors a step, per tensor: 64x64 rank 16 (2^16) 92 us one call vs 109 us
# with torch's GEMMs; 128x128 rank 8 (2^17) 160 vs 172; 128x128 rank 32 568 vs 193. On
# other devices it has no kernel (auto picks the reference): never worth it there.
SIZE_LIMITS = {
    ("frugal::lowrank_adamw_step_", "cpu"): 1 << 16,
}


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(backend: str, device_type: str, op: Optional[str] = None) -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on tensors of ``device_type``; None if it can."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'"
    if op is not None and backend not in CAPABILITIES[op]:
        return f"{op} has no {backend} implementation"
    if backend == "torch":
        return None
    if backend == "triton":
        if not _triton_installed():
            return "triton is not installed"
        if device_type == "cpu" and not _triton_interpreting():
            return "Triton kernels run on CPU tensors only under TRITON_INTERPRET=1"
        if device_type not in ("cpu", "cuda"):
            return f"Triton kernels do not run on {device_type} tensors"
        return None
    ext = extension()
    if ext is None:
        return "the compiled extension frugal_kernels._C is not available"
    if backend == "cpu":
        return None if device_type == "cpu" else f"the cpu backend cannot run on {device_type} tensors"
    if device_type != "cuda":
        return f"the cuda backend cannot run on {device_type} tensors"
    if not hasattr(ext, "adamw_cuda"):
        return "frugal_kernels._C was built without CUDA kernels (no nvcc at build time)"
    return None


def usable_backends(device_type: str, op: Optional[str] = None) -> list:
    """Backends that can run (``op``, or every op) on ``device_type`` tensors now, best first."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return []
    order = _AUTO_ORDER.get(device_type, ("torch",))
    rest = [b for b in BACKENDS if b not in order]
    return [b for b in (*order, *rest) if unavailable_reason(b, device_type, op) is None]


def implements(op: str, backend: str) -> bool:
    """Whether a call of ``op`` with ``backend`` (``"auto"`` included) has an implementation
    to run (``"auto"`` always has: the reference at worst)."""
    return backend == "auto" or backend in CAPABILITIES[op]


def worth_calling(op: str, device: torch.device, size: int) -> bool:
    """Whether ``op`` is the fast way for a call of ``size`` on ``device`` tensors, for
    the ops that pay only up to a size (:data:`SIZE_LIMITS`)."""
    limit = SIZE_LIMITS.get((op, device.type))
    return limit is not None and size <= limit


def kernel_backend(op: str, device: torch.device) -> Optional[str]:
    """The backend ``"auto"`` picks for ``op`` on ``device`` tensors, or None where that is
    the reference: no kernel runs ``op`` there."""
    backend = resolve("auto", device, op)
    return None if backend == REFERENCE else backend


def resolve(backend: str, device: torch.device, op: str) -> str:
    """The backend a call of ``op`` runs on."""
    if backend == "auto":
        backend = os.environ.get("FRUGAL_BACKEND", "auto") or "auto"
        if backend != "auto" and unavailable_reason(backend, device.type, op) is not None:
            # An override names a preference; ops it cannot serve fall back to auto.
            backend = "auto"
    if backend == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ("torch",)):
            if unavailable_reason(candidate, device.type, op) is None:
                return candidate
        return "torch"
    reason = unavailable_reason(backend, device.type, op)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run here: {reason}")
    return backend
