"""``frugal_step_int8_`` on Triton: the FRUGAL step with 8-bit subset moments in one launch.

Each tensor owns two ranges of programs. A moment program updates ``NB`` blocks of
256 elements of the subset's compact moment matrix (the blocks of
``MomentBlocks(state shape)``, as ``adamw_int8.py`` walks a tensor's): it finds the
param position of each moment slot (rows: ``idx[slot // C] * C + slot % C``; columns:
``(slot // k) * C + idx[slot % k]``), gathers p and g there and runs
``adamw_int8.moments8_tile``, the block math shared with ``adamw_int8_``. A state-free
program takes ``NB * 256`` consecutive positions of p, finds which are members with a
vectorised binary search of each position's row (rows) or column (columns) in the
sorted indices, and moves the others by the state-free rule. The two sets of
positions are disjoint, so the programs never write the same element and every
coordinate of p is read and written once.

The table record of a tensor part is ``(p, g, m codes, m scales, v codes, v scales,
indices, units, moment row length, C, k, part)`` with part 0 for moments (units:
blocks) and 1 for the state-free positions (units: 256 positions); the tail, when
lr / step live on the device, is ``frugal_step.py``'s.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels._layout import MOMENT_BLOCK, STATE_FREE_CODES, MomentBlocks, matrix_view
from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, TL_INDEX_DTYPES, adamw_launch, adamw_scalars_in_kernel, amp_scalars, field_ptr,
    find_tile, from_param, launch_table, start, tail_f64, tail_scalar, to_param)
from frugal_kernels.kernels.triton.adamw_int8 import moments8_tile
from frugal_kernels.kernels.triton.sign_sgd import state_free_update

NB = 8  # blocks per program, as adamw_int8.py
NUM_WARPS = 8
_RECORD = tl.constexpr(12)


@triton.jit
def _is_member(idx_ptr, k, key, valid, STEPS: tl.constexpr):
    """Whether each ``key`` is in the sorted ``idx[0:k)``: a binary search per lane,
    ``STEPS`` (at least log2(k + 1)) halvings. A compile-time bound (tests/triton_backend/
    test_loop_bounds.py): one compiled kernel per bit length of the largest subset."""
    lo = tl.zeros(key.shape, tl.int64)
    hi = tl.zeros(key.shape, tl.int64) + k
    for _ in range(STEPS):
        live = valid & (lo < hi)
        mid = (lo + hi) >> 1
        below = tl.load(idx_ptr + mid, mask=live, other=0).to(tl.int64) < key
        lo = tl.where(live & below, mid + 1, lo)
        hi = tl.where(live & ~below, mid, hi)
    found = valid & (lo < k)
    return found & (tl.load(idx_ptr + lo, mask=found, other=-1).to(tl.int64) == key)


@triton.jit(do_not_specialize=["n_tensors"])
def _frugal_step_int8_kernel(table, n_tensors, decay, one_minus_beta1, beta2,
                             one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, amp,
                             STEPS: tl.constexpr, P_DTYPE: tl.constexpr, AMP: tl.constexpr,
                             INDEX_DTYPE: tl.constexpr, COLUMNS: tl.constexpr,
                             STATE_FREE: tl.constexpr, SCALARS_IN_KERNEL: tl.constexpr,
                             NB: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        lr = tail_scalar(tail, 0)
        decay, step_size, bc2_sqrt = adamw_scalars_in_kernel(
            lr, tail_scalar(tail, 1), tail_f64(tail, 2), tail_f64(tail, 3), tail_f64(tail, 4))
        sf_step = (lr * tail_f64(tail, 5)).to(tl.float32)
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    p_ptr = field_ptr(record, 0, P_DTYPE)
    g_ptr = field_ptr(record, 1, P_DTYPE)
    idx_ptr = field_ptr(record, 6, INDEX_DTYPE)
    units = tl.load(record + 7)
    C = tl.load(record + 9)
    k = tl.load(record + 10)
    inv = 1.0
    if AMP:
        # A GradScaler's inf leaves everything as it was, decided on the device.
        inv = tl.load(amp)
        units = tl.where(tl.load(amp + 1) != 0.0, 0, units)
    if tl.load(record + 11) == 0:
        mq_ptr = field_ptr(record, 2, tl.int8)
        ms_ptr = field_ptr(record, 3, tl.float32)
        vq_ptr = field_ptr(record, 4, tl.uint8)
        vs_ptr = field_ptr(record, 5, tl.float32)
        cols = tl.load(record + 8)
        per_row = (cols + (BLOCK - 1)) // BLOCK
        b = tile * NB + tl.arange(0, NB)
        block_ok = b < units
        col = (b % per_row)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        slot = (b // per_row)[:, None] * cols + col
        mask = block_ok[:, None] & (col < cols)
        if COLUMNS:
            column = tl.load(idx_ptr + slot % k, mask=mask, other=0).to(tl.int64)
            position = (slot // k) * C + column
        else:
            row = tl.load(idx_ptr + slot // C, mask=mask, other=0).to(tl.int64)
            position = row * C + slot % C
        p, mq, vq, m_scale, v_scale = moments8_tile(
            p_ptr + position, g_ptr + position, mq_ptr + slot, ms_ptr + b, vq_ptr + slot,
            vs_ptr + b, mask, block_ok, inv, decay, one_minus_beta1, beta2, one_minus_beta2,
            step_size, bc2_sqrt, eps, False)
        tl.store(p_ptr + position, to_param(p, P_DTYPE), mask=mask)
        tl.store(mq_ptr + slot, mq.to(tl.int8), mask=mask)
        tl.store(vq_ptr + slot, vq.to(tl.uint8), mask=mask)
        tl.store(ms_ptr + b, m_scale, mask=block_ok)
        tl.store(vs_ptr + b, v_scale, mask=block_ok)
    else:
        numel = tl.load(record + 8)
        position = tile * (NB * BLOCK) + tl.arange(0, NB * BLOCK).to(tl.int64)
        # No units (a GradScaler's inf): no valid position.
        valid = position < tl.where(units > 0, numel, 0)
        if COLUMNS:
            key = position % C
        else:
            key = position // C
        free = valid & ~_is_member(idx_ptr, k, key, valid, STEPS)
        p = from_param(tl.load(p_ptr + position, mask=free, other=0.0))
        g = from_param(tl.load(g_ptr + position, mask=free, other=0.0)) * inv
        tl.store(p_ptr + position, to_param(state_free_update(p, g, decay, sf_step, STATE_FREE),
                                            P_DTYPE), mask=free)


def frugal_step_int8_(params: Sequence[Tensor], grads: Sequence[Tensor],
                      exp_avgs: Sequence[Tensor], exp_avg_scales: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], exp_avg_sq_scales: Sequence[Tensor],
                      indices: Sequence[Tensor], *, kind: str, lr: Tensor, beta1: float,
                      beta2: float, eps: float, weight_decay: float, step: Tensor,
                      state_free: str, state_free_scale: float,
                      grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                      scalars_in_kernel: Optional[bool] = None) -> None:
    """The FRUGAL step with 8-bit subset moments in place, as
    ``frugal_kernels.ops.frugal_step_int8_`` (inputs checked, indices sorted and unique);
    ``scalars_in_kernel`` as for ``adamw_``."""
    items, device, scalars_in_kernel = start(params, (lr, step), scalars_in_kernel)
    if not items:
        return
    scalars, tail, alive = adamw_launch(lr, step, beta1, beta2, eps, weight_decay, device,
                                        scalars_in_kernel, state_free_scale)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    counts, records, steps = [], [], 1
    for i in items:
        _, _, C = matrix_view(params[i], kind)
        k = indices[i].numel()
        steps = max(steps, k.bit_length())
        pointers = [t.data_ptr() for t in (params[i], grads[i], exp_avgs[i], exp_avg_scales[i],
                                           exp_avg_sqs[i], exp_avg_sq_scales[i], indices[i])]
        blocks = MomentBlocks(exp_avgs[i].shape)
        if blocks.rows * blocks.per_row > 0:
            counts.append(blocks.rows * blocks.per_row)
            records.append(pointers + [counts[-1], blocks.cols, C, k, 0])
        n = params[i].numel()
        counts.append(triton.cdiv(n, MOMENT_BLOCK))
        records.append(pointers + [counts[-1], n, C, k, 1])
    table, grid = launch_table(device, counts, records, NB, tail)
    _frugal_step_int8_kernel[(grid,)](
        table, len(records), *scalars, amp if use_amp else table, STEPS=steps,
        P_DTYPE=TL_DTYPES[params[0].dtype], AMP=use_amp,
        INDEX_DTYPE=TL_INDEX_DTYPES[indices[items[0]].dtype], COLUMNS=kind == "columns",
        STATE_FREE=STATE_FREE_CODES[state_free], SCALARS_IN_KERNEL=bool(scalars_in_kernel),
        NB=NB, BLOCK=MOMENT_BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
