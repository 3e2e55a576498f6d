"""``adamw_`` on Triton: AdamW over a list of tensors in one launch.

Each program updates one tile of ``BLOCK`` coordinates of one tensor, reading
p, g, m, v once and writing p, m, v once. The table record of a tensor is
``(p, g, m, v, numel)``; the tail, when lr / step live on the device, is
``(&lr, &step, weight_decay, log(beta1), log(beta2))`` (see ``_common``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, adamw_launch, adamw_scalars_in_kernel, aligned, amp_in_kernel, amp_scalars,
    field_ptr, find_tile, launch_table, load_tile, start, store_tile, tail_f64, tail_scalar)

# Not tuned on hardware yet (no GPU at hand when written): 16 fp32 values per
# thread give four 16-byte loads per stream in flight, a usual choice for a
# bandwidth-bound elementwise kernel on H100/H200. Constants rather than
# autotuning, which would multiply the launches the interpreter has to run.
BLOCK = 4096
NUM_WARPS = 8
_RECORD = tl.constexpr(5)  # table fields per tensor: p, g, m, v, numel


@triton.jit
def adamw_update(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                 bc2_sqrt, eps, MAXIMIZE: tl.constexpr):
    """update_rules.h ``adamw_update``, operation for operation: returns (p, m, v).

    div_rn / sqrt_rn because Triton's plain ``/`` and ``sqrt`` on fp32 are
    approximate on NVIDIA GPUs; the launch disables FMA contraction.
    """
    if MAXIMIZE:
        g = -g
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    return p - step_size * tl.div_rn(m, denom), m, v


@triton.jit
def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, count, decay, one_minus_beta1, beta2,
                one_minus_beta2, step_size, bc2_sqrt, eps, inv, MAXIMIZE: tl.constexpr,
                MASKED: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    p = load_tile(p_ptr, lane, count, MASKED)
    g = load_tile(g_ptr, lane, count, MASKED) * inv
    m = load_tile(m_ptr, lane, count, MASKED)
    v = load_tile(v_ptr, lane, count, MASKED)
    p, m, v = adamw_update(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                           bc2_sqrt, eps, MAXIMIZE)
    store_tile(p_ptr, lane, count, p, MASKED)
    store_tile(m_ptr, lane, count, m, MASKED)
    store_tile(v_ptr, lane, count, v, MASKED)


@triton.jit(do_not_specialize=["n_tensors"])
def _adamw_kernel(table, n_tensors, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                  bc2_sqrt, eps, amp, P_DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr,
                  AMP: tl.constexpr,
                  SCALARS_IN_KERNEL: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        decay, step_size, bc2_sqrt = adamw_scalars_in_kernel(
            tail_scalar(tail, 0), tail_scalar(tail, 1), tail_f64(tail, 2), tail_f64(tail, 3),
            tail_f64(tail, 4))
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    start = tile * BLOCK
    p_ptr = field_ptr(record, 0, P_DTYPE) + start
    g_ptr = field_ptr(record, 1, P_DTYPE) + start
    m_ptr = field_ptr(record, 2, tl.float32) + start
    v_ptr = field_ptr(record, 3, tl.float32) + start
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    count = tl.minimum(tl.load(record + 4) - start, BLOCK)  # positions in this tile
    inv, count = amp_in_kernel(amp, count, AMP)
    if count == BLOCK:
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, count, decay, one_minus_beta1, beta2,
                    one_minus_beta2, step_size, bc2_sqrt, eps, inv, MAXIMIZE, False, BLOCK)
    elif count > 0:
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, count, decay, one_minus_beta1, beta2,
                    one_minus_beta2, step_size, bc2_sqrt, eps, inv, MAXIMIZE, True, BLOCK)


def adamw_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], *, lr: Tensor, beta1: float, beta2: float, eps: float,
           weight_decay: float, step: Tensor, maximize: bool, grad_scale: Optional[Tensor] = None,
           found_inf: Optional[Tensor] = None, scalars_in_kernel: Optional[bool] = None) -> None:
    """AdamW in place, as ``frugal_kernels.ops.adamw_`` (inputs already checked).

    ``lr`` and ``step`` are 0-dim tensors. ``scalars_in_kernel`` (default: when
    either lives on the device) makes the kernel read them and derive its
    scalars itself; the tests force it to run that path on the CPU.
    """
    items, device, scalars_in_kernel = start(params, (lr, step), scalars_in_kernel)
    if not items:
        return
    scalars, tail, alive = adamw_launch(lr, step, beta1, beta2, eps, weight_decay, device,
                                        scalars_in_kernel)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    tensors = [(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in items]
    records = [[t.data_ptr() for t in group] + [group[0].numel()] for group in tensors]
    table, grid = launch_table(device, [group[0].numel() for group in tensors], records, BLOCK,
                               tail)
    _adamw_kernel[(grid,)](
        table, len(items), *scalars, amp if use_amp else table,
        P_DTYPE=TL_DTYPES[params[0].dtype], MAXIMIZE=bool(maximize), AMP=use_amp,
        SCALARS_IN_KERNEL=bool(scalars_in_kernel),
        ALIGNED=aligned([t for group in tensors for t in group]), BLOCK=BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
