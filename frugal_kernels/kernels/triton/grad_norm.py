"""``grad_norm`` on Triton: the global norm of a list of gradients, one launch per dtype.

Each program reads one tile of ``BLOCK`` values of one tensor (the launch table of
``_common``; a record is ``(g, numel)``) and writes one partial result: the tile's
sum of squares in fp64 (no finite fp32 value overflows it, so the sum is non-finite
exactly when an element is), or for the max norm its largest magnitude, with a NaN
kept. The partials are combined by torch on the
device: no host sync.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, aligned, check_device, field_ptr, find_tile, launch_table, load_tile)

# Not tuned on hardware yet: a read-only pass, so larger tiles than the update kernels'.
BLOCK = 8192
NUM_WARPS = 8
_RECORD = tl.constexpr(2)  # table fields per tensor: g, numel


@triton.jit
def _partial(g_ptr, count, MAX: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    x = load_tile(g_ptr, lane, count, MASKED).to(tl.float64)
    if MAX:
        a = tl.abs(x)
        nan = a != a
        # The sum of the NaNs alone is NaN when there is one and 0 otherwise: added to the
        # largest of the other magnitudes, it keeps a NaN that a max would drop, and an
        # infinity stays one.
        return tl.max(tl.where(nan, 0.0, a), axis=0) + tl.sum(tl.where(nan, a, 0.0), axis=0)
    return tl.sum(x * x, axis=0)


@triton.jit(do_not_specialize=["n_tensors"])
def _grad_norm_kernel(table, n_tensors, partials, G_DTYPE: tl.constexpr, MAX: tl.constexpr,
                      ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    start = tile * BLOCK
    g_ptr = field_ptr(record, 0, G_DTYPE) + start
    if ALIGNED:
        g_ptr = tl.multiple_of(g_ptr, 16)
    count = tl.minimum(tl.load(record + 1) - start, BLOCK)
    if count == BLOCK:
        value = _partial(g_ptr, count, MAX, False, BLOCK)
    else:
        value = _partial(g_ptr, count, MAX, True, BLOCK)
    tl.store(partials + tl.program_id(0), value)


def grad_norm_parts(grads: Sequence[Tensor], max_norm: bool) -> List[Tensor]:
    """One fp64 tensor of partial results per dtype of ``grads`` (non-empty ones only):
    sums of squares, or largest magnitudes with ``max_norm``."""
    device = grads[0].device
    check_device(device)
    by_dtype = {}
    for g in grads:
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(g.contiguous())
    parts = []
    for dtype, group in by_dtype.items():
        records = [[g.data_ptr(), g.numel()] for g in group]
        table, grid = launch_table(device, [g.numel() for g in group], records, BLOCK)
        partials = torch.empty(grid, dtype=torch.float64, device=device)
        _grad_norm_kernel[(grid,)](table, len(group), partials, G_DTYPE=TL_DTYPES[dtype],
                                   MAX=max_norm, ALIGNED=aligned(group), BLOCK=BLOCK,
                                   num_warps=NUM_WARPS)
        parts.append(partials)
    return parts


def grad_norm(grads: Sequence[Tensor], max_norm: bool) -> Tuple[Tensor, Tensor]:
    """(total norm as 0-dim float32, found_inf as [1] float32) on the gradients' device."""
    device = grads[0].device
    parts = grad_norm_parts(grads, max_norm)
    if not parts:
        return (torch.zeros((), dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.float32, device=device))
    values = torch.cat(parts)
    if max_norm:
        # amax propagates NaN, as the tiles did.
        total = values.amax()
    else:
        total = values.sum().sqrt()
    return total.float(), (~total.isfinite()).float().reshape(1)
