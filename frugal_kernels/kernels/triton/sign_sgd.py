"""``sign_sgd_`` on Triton: SignSGD with decoupled decay over a list of tensors in one launch.

Each program updates one tile of ``BLOCK`` coordinates of one tensor: it reads
p and g and writes p, nothing more. The table record of a tensor is
``(p, g, numel)``; the tail, when lr lives on the device, is
``(&lr, weight_decay, scale)`` (see ``_common``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, aligned, amp_in_kernel, amp_scalars, device_scalars, f64_bits, field_ptr,
    find_tile, launch_table, load_tile,
    sign_scalars, start, store_tile, tail_f64, tail_scalar)

# Not tuned on hardware yet; as for adamw: two streams of 16 values per thread.
BLOCK = 4096
NUM_WARPS = 8
_RECORD = tl.constexpr(3)  # table fields per tensor: p, g, numel

# update_rules.h StateFree codes.
SIGN = tl.constexpr(0)
SGD = tl.constexpr(1)
NONE = tl.constexpr(2)


@triton.jit
def state_free_update(p, g, decay, step, MODE: tl.constexpr):
    """update_rules.h ``state_free_update``: decay, then a step along -sign(g), -g or none.

    The sign comes from two comparisons, as ``sign_of`` there: 0 for 0 and NaN.
    """
    p = p * decay
    if MODE == SIGN:
        p = p - step * tl.where(g > 0.0, 1.0, tl.where(g < 0.0, -1.0, 0.0))
    elif MODE == SGD:
        p = p - step * g
    return p


@triton.jit
def _sign_sgd_tile(p_ptr, g_ptr, count, decay, step, inv, MASKED: tl.constexpr,
                   BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    p = load_tile(p_ptr, lane, count, MASKED)
    g = load_tile(g_ptr, lane, count, MASKED) * inv
    store_tile(p_ptr, lane, count, state_free_update(p, g, decay, step, SIGN), MASKED)


@triton.jit(do_not_specialize=["n_tensors"])
def _sign_sgd_kernel(table, n_tensors, decay, step, amp, P_DTYPE: tl.constexpr,
                     AMP: tl.constexpr, SCALARS_IN_KERNEL: tl.constexpr, ALIGNED: tl.constexpr,
                     BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        lr = tail_scalar(tail, 0)
        decay = (1.0 - lr * tail_f64(tail, 1)).to(tl.float32)
        step = (lr * tail_f64(tail, 2)).to(tl.float32)
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    start = tile * BLOCK
    p_ptr = field_ptr(record, 0, P_DTYPE) + start
    g_ptr = field_ptr(record, 1, P_DTYPE) + start
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    count = tl.minimum(tl.load(record + 2) - start, BLOCK)  # positions in this tile
    inv, count = amp_in_kernel(amp, count, AMP)
    if count == BLOCK:
        _sign_sgd_tile(p_ptr, g_ptr, count, decay, step, inv, False, BLOCK)
    elif count > 0:
        _sign_sgd_tile(p_ptr, g_ptr, count, decay, step, inv, True, BLOCK)


def sign_sgd_(params: Sequence[Tensor], grads: Sequence[Tensor], *, lr: Tensor,
              weight_decay: float, scale: float, grad_scale: Optional[Tensor] = None,
              found_inf: Optional[Tensor] = None, scalars_in_kernel: Optional[bool] = None) -> None:
    """SignSGD in place, as ``frugal_kernels.ops.sign_sgd_`` (inputs already checked).

    ``lr`` is a 0-dim tensor; ``scalars_in_kernel`` as for ``adamw_``.
    """
    items, device, scalars_in_kernel = start(params, (lr,), scalars_in_kernel)
    if not items:
        return
    tail, alive = [], []
    if scalars_in_kernel:
        alive = device_scalars((lr,), device)
        tail = [alive[0].data_ptr(), f64_bits(weight_decay), f64_bits(scale)]
        scalars = (0.0, 0.0)  # derived in the kernel
    else:
        scalars = sign_scalars(float(lr), weight_decay, scale)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    tensors = [(params[i], grads[i]) for i in items]
    records = [[p.data_ptr(), g.data_ptr(), p.numel()] for p, g in tensors]
    table, grid = launch_table(device, [p.numel() for p, _ in tensors], records, BLOCK, tail)
    _sign_sgd_kernel[(grid,)](
        table, len(items), *scalars, amp if use_amp else table,
        P_DTYPE=TL_DTYPES[params[0].dtype], AMP=use_amp, SCALARS_IN_KERNEL=bool(scalars_in_kernel),
        ALIGNED=aligned([t for pair in tensors for t in pair]), BLOCK=BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
