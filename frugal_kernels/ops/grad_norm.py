"""``frugal::grad_norm``: the global norm of a list of gradients and their non-finite
flag, in one read of each.

A training loop that clips by the global norm reads every gradient for the norm;
``torch.nn.utils.clip_grad_norm_`` then reads and writes them all again to scale
them, and an optimizer step that skips non-finite gradients reads them a third time
for its check. The norm pass can serve all three: a finite global norm says every
gradient is finite, and the clip factor can be applied by the fused update ops as
they read the gradients (their ``grad_scale``). This op is that pass; the
optimizers' ``clip_grad_norm_`` and their non-finite check are built on it.

Out of place: it reads the gradients and returns two new tensors on their device,
with no host sync.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import DTYPE_CODES, PARAM_DTYPES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._spec import Implementations

OP = "frugal::grad_norm"
_IMPLS = Implementations(OP)  # its backends, declared below each


def _check(grads: List[Tensor], norm_type: float, backend: str) -> None:
    if not (norm_type == 2.0 or math.isinf(norm_type) and norm_type > 0):
        raise ValueError(f"{OP}: norm_type must be 2.0 or inf, got {norm_type}")
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"{OP}: grads[{i}] is a {type(g).__name__}, not a torch.Tensor")
        if g.dtype not in PARAM_DTYPES:
            raise TypeError(f"{OP}: grads[{i}] is {g.dtype}; float32, bfloat16 and float16 "
                            "are supported")
        if g.is_sparse:
            raise TypeError(f"{OP}: grads[{i}] is sparse; only dense gradients are supported")
        if g.device != grads[0].device:
            raise ValueError(f"{OP}: grads[{i}] is on {g.device} but grads[0] on "
                             f"{grads[0].device}; call once per device")


def _fake(grads: List[Tensor], norm_type: float, backend: str) -> Tuple[Tensor, Tensor]:
    _check(grads, norm_type, backend)
    device = grads[0].device if grads else torch.device("cpu")
    return (torch.empty((), dtype=torch.float32, device=device),
            torch.empty((1,), dtype=torch.float32, device=device))


@torch.library.custom_op(OP, mutates_args=())
def _grad_norm_op(grads: List[Tensor], norm_type: float, backend: str) -> Tuple[Tensor, Tensor]:
    _check(grads, norm_type, backend)
    if not grads:
        return torch.zeros((), dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    return _IMPLS[_dispatch.resolve(backend, grads[0].device, OP)](grads, norm_type)


_grad_norm_op.register_fake(_fake)


@_IMPLS.backend("cpu")
def _cpu(grads: List[Tensor], norm_type: float) -> Tuple[Tensor, Tensor]:
    ext, max_norm = extension(), math.isinf(norm_type)
    by_dtype = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g.contiguous())
    total = 0.0
    for dtype, group in by_dtype.items():
        part = ext.grad_norm_cpu([g.data_ptr() for g in group], [g.numel() for g in group],
                                 DTYPE_CODES[dtype], max_norm, torch.get_num_threads())
        # A NaN must survive the max of the dtype groups (max(NaN, x) is x in Python).
        total = (part if part > total or part != part else total) if max_norm else total + part
    norm = total if max_norm else math.sqrt(total)
    return (torch.tensor(norm, dtype=torch.float32),
            torch.tensor([0.0 if math.isfinite(norm) else 1.0], dtype=torch.float32))


@functools.lru_cache(maxsize=None)
def _cuda_chunk(ext) -> int:
    """The elements of one partial result of the CUDA kernel (csrc/cuda/grad_norm.cuh)."""
    return ext.cuda_limits()["grad_norm"]["chunk"]


@_IMPLS.backend("cuda")
def _cuda(grads: List[Tensor], norm_type: float) -> Tuple[Tensor, Tensor]:
    ext, max_norm, device = extension(), math.isinf(norm_type), grads[0].device
    chunk = _cuda_chunk(ext)
    by_dtype = defaultdict(list)
    for g in grads:
        if g.numel():
            by_dtype[g.dtype].append(g.contiguous())
    # One partial result per chunk of every gradient, all dtypes in one buffer that the
    # last launch reads: each call writes its part at its own offset.
    counts = {dtype: sum(-(-g.numel() // chunk) for g in group)
              for dtype, group in by_dtype.items()}
    total = sum(counts.values())
    partials = torch.empty(max(total, 1), dtype=torch.float64, device=device)
    norm = torch.empty((), dtype=torch.float32, device=device)
    found_inf = torch.empty(1, dtype=torch.float32, device=device)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        offset = 0
        for dtype, group in by_dtype.items():
            ext.grad_norm_cuda([g.data_ptr() for g in group], [g.numel() for g in group],
                               DTYPE_CODES[dtype], max_norm,
                               partials.data_ptr() + offset * partials.element_size(),
                               counts[dtype], stream)
            offset += counts[dtype]
        ext.grad_norm_finish_cuda(partials.data_ptr(), total, max_norm, norm.data_ptr(),
                                  found_inf.data_ptr(), stream)
    return norm, found_inf


@_IMPLS.backend("triton")
def _triton(grads: List[Tensor], norm_type: float) -> Tuple[Tensor, Tensor]:
    from frugal_kernels.kernels.triton.grad_norm import grad_norm as kernel
    return kernel(grads, math.isinf(norm_type))


@_IMPLS.backend("torch")
def _torch(grads: List[Tensor], norm_type: float) -> Tuple[Tensor, Tensor]:
    return reference.grad_norm(grads, norm_type=norm_type)


_IMPLS.complete()


def grad_norm(grads: Sequence[Tensor], *, norm_type: float = 2.0,
              backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The norm of all of ``grads`` taken as one vector, and a flag for NaN or inf.

    Reads each gradient once (mixed float32 / bfloat16 / float16 lists are fine; every
    tensor on one device). The 2-norm sums the squares in double, so it overflows for no
    finite gradient and is non-finite exactly when an element is NaN or infinite; the max
    norm (``norm_type=float("inf")``) is the largest magnitude.

    Returns:
        ``(total_norm, found_inf)``: a 0-dim float32 tensor, the value
        ``torch.nn.utils.clip_grad_norm_`` returns (within fp32 rounding: torch sums in
        fp32), and a one-element float32 tensor, 1.0 when an element is NaN or infinite,
        else 0.0 (GradScaler's ``found_inf`` convention). Both on the gradients' device,
        computed there without a host sync. An empty list gives a norm of 0.
    """
    grads = list(grads)
    # The schema's own cast would name no entry: check them first.
    _check(grads, float(norm_type), backend)
    return _grad_norm_op(grads, float(norm_type), backend)
