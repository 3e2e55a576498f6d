"""``adamw_int8_`` on Triton: AdamW on 8-bit moments over a list of tensors in one launch.

Each program updates ``NB`` blocks of 256 elements of one tensor (the blocks of
``frugal_kernels._layout.MomentBlocks``, counted row by row, each within one row) as
an ``[NB, 256]`` tile: the codes dequantized, ``adamw_update`` of ``adamw.py``
operation for operation (the second moment's square root kept for its code), the
block maxima as integer maxima of the bits (a NaN's lie above every number's, as in
the C++ kernel), the codes rounded half to even. The table record of a tensor is
``(p, g, m codes, m scales, v codes, v scales, blocks, row length)``; the tail when
lr / step live on the device is ``adamw.py``'s.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels._layout import MOMENT_BLOCK, MomentBlocks
from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, adamw_launch, adamw_scalars_in_kernel, amp_scalars, field_ptr, find_tile,
    from_param, launch_table, start, tail_f64, tail_scalar, to_param)

NB = 8  # blocks per program: 2048 elements, as a tile of adamw_'s half
NUM_WARPS = 8
_RECORD = tl.constexpr(8)
# 1.5 * 2^23: adding and subtracting it rounds an fp32 of magnitude under 2^22 to the
# nearest integer, ties to even (the codes are at most 255 in magnitude; FMA is off).
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _code(x, scale, inverse, LOW: tl.constexpr, TOP: tl.constexpr):
    """moments8.h ``moment_code``: rint(x * inverse) clamped to [LOW, TOP]; 0 where the
    scale is not > 0 or the product is NaN."""
    q = (x * inverse + _ROUNDER) - _ROUNDER
    q = tl.where(q < LOW, LOW, q)
    q = tl.where(q > TOP, TOP, q)
    q = tl.where(q == q, q, 0.0)
    return tl.where(scale > 0.0, q, 0.0)


@triton.jit
def _block_max_bits(x):
    """The largest |x| of each row of the tile, as the largest bit pattern."""
    return tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def moments8_tile(p_at, g_at, mq_at, ms_at, vq_at, vs_at, mask, block_ok, inv, decay,
                  one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                  MAXIMIZE: tl.constexpr):
    """A tile of ``[NB, 256]`` moment blocks: the codes at ``mq_at`` / ``vq_at`` with the
    block scales at ``ms_at`` / ``vs_at`` dequantized, AdamW on the coordinates at ``p_at``
    / ``g_at`` (pointer tiles of the same shape: contiguous for adamw_int8_, gathered for
    frugal_step_int8_), the new maxima and codes. Returns (new p in fp32, m codes, v codes,
    m scales, v scales); the caller stores them."""
    p = from_param(tl.load(p_at, mask=mask, other=0.0))
    g = from_param(tl.load(g_at, mask=mask, other=0.0)) * inv
    m = tl.load(mq_at, mask=mask, other=0).to(tl.float32) * \
        tl.load(ms_at, mask=block_ok, other=0.0)[:, None]
    t = tl.load(vq_at, mask=mask, other=0).to(tl.float32) * \
        tl.load(vs_at, mask=block_ok, other=0.0)[:, None]
    u = t * t
    v = u * u
    if MAXIMIZE:
        g = -g
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    root_v = tl.sqrt_rn(v)
    denom = tl.div_rn(root_v, bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    w = tl.sqrt_rn(root_v)
    # Lanes past a row's end hold m = w = 0: they leave the maxima as they are.
    m_scale = tl.div_rn(_block_max_bits(m), 127.0)
    v_scale = tl.div_rn(_block_max_bits(w), 255.0)
    # A scale that is not > 0 gives the codes 0 whatever its inverse: 1 keeps the
    # interpreter's numpy from warning of 1 / 0.
    one = tl.full(m_scale.shape, 1.0, tl.float32)
    m_inv = tl.div_rn(one, tl.where(m_scale > 0.0, m_scale, one))
    v_inv = tl.div_rn(one, tl.where(v_scale > 0.0, v_scale, one))
    mq = _code(m, m_scale[:, None], m_inv[:, None], -127.0, 127.0)
    vq = _code(w, v_scale[:, None], v_inv[:, None], 0.0, 255.0)
    return p, mq, vq, m_scale, v_scale


@triton.jit(do_not_specialize=["n_tensors"])
def _adamw_int8_kernel(table, n_tensors, decay, one_minus_beta1, beta2, one_minus_beta2,
                       step_size, bc2_sqrt, eps, amp, P_DTYPE: tl.constexpr,
                       MAXIMIZE: tl.constexpr, AMP: tl.constexpr,
                       SCALARS_IN_KERNEL: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        decay, step_size, bc2_sqrt = adamw_scalars_in_kernel(
            tail_scalar(tail, 0), tail_scalar(tail, 1), tail_f64(tail, 2), tail_f64(tail, 3),
            tail_f64(tail, 4))
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    p_ptr = field_ptr(record, 0, P_DTYPE)
    g_ptr = field_ptr(record, 1, P_DTYPE)
    mq_ptr = field_ptr(record, 2, tl.int8)
    ms_ptr = field_ptr(record, 3, tl.float32)
    vq_ptr = field_ptr(record, 4, tl.uint8)
    vs_ptr = field_ptr(record, 5, tl.float32)
    n_blocks = tl.load(record + 6)
    cols = tl.load(record + 7)
    per_row = (cols + (BLOCK - 1)) // BLOCK
    b = tile * NB + tl.arange(0, NB)
    inv = 1.0
    if AMP:
        # A GradScaler's inf leaves every block as it was, decided on the device.
        inv = tl.load(amp)
        n_blocks = tl.where(tl.load(amp + 1) != 0.0, 0, n_blocks)
    block_ok = b < n_blocks
    col = (b % per_row)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    offs = (b // per_row)[:, None] * cols + col
    mask = block_ok[:, None] & (col < cols)

    p, mq, vq, m_scale, v_scale = moments8_tile(
        p_ptr + offs, g_ptr + offs, mq_ptr + offs, ms_ptr + b, vq_ptr + offs, vs_ptr + b, mask,
        block_ok, inv, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
        MAXIMIZE)
    tl.store(p_ptr + offs, to_param(p, P_DTYPE), mask=mask)
    tl.store(mq_ptr + offs, mq.to(tl.int8), mask=mask)
    tl.store(vq_ptr + offs, vq.to(tl.uint8), mask=mask)
    tl.store(ms_ptr + b, m_scale, mask=block_ok)
    tl.store(vs_ptr + b, v_scale, mask=block_ok)


def adamw_int8_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                exp_avg_sq_scales: Sequence[Tensor], *, lr: Tensor, beta1: float, beta2: float,
                eps: float, weight_decay: float, step: Tensor, maximize: bool,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                scalars_in_kernel: Optional[bool] = None) -> None:
    """AdamW on 8-bit moments in place, as ``frugal_kernels.ops.adamw_int8_`` (inputs
    checked); ``scalars_in_kernel`` as in ``adamw.py``."""
    items, device, scalars_in_kernel = start(params, (lr, step), scalars_in_kernel)
    if not items:
        return
    scalars, tail, alive = adamw_launch(lr, step, beta1, beta2, eps, weight_decay, device,
                                        scalars_in_kernel)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    blocks = [MomentBlocks(params[i].shape) for i in items]
    counts = [b.rows * b.per_row for b in blocks]
    records = [[t.data_ptr() for t in (params[i], grads[i], exp_avgs[i], exp_avg_scales[i],
                                       exp_avg_sqs[i], exp_avg_sq_scales[i])] + [n, b.cols]
               for i, b, n in zip(items, blocks, counts)]
    table, grid = launch_table(device, counts, records, NB, tail)
    _adamw_int8_kernel[(grid,)](
        table, len(items), *scalars, amp if use_amp else table,
        P_DTYPE=TL_DTYPES[params[0].dtype], MAXIMIZE=bool(maximize), AMP=use_amp,
        SCALARS_IN_KERNEL=bool(scalars_in_kernel), NB=NB, BLOCK=MOMENT_BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
