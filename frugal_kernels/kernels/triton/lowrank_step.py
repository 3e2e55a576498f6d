"""``lowrank_step_`` on Triton: both back-projections and the update of a low-rank FRUGAL
step in one kernel per tensor.

Each tensor is the row-major matrix [M, N] = [shape[0], rest]; its projection P
has rank R. Side RIGHT: P is [R, N], the low tensors are [M, R] and
``up(x) = x @ P``; side LEFT: P is [M, R], the low tensors are [R, N] and
``up(x) = P @ x``. A program owns one output tile [BLOCK_M, BLOCK_N] of p: it
accumulates ``up(low_update)`` and ``up(low_grad)`` over the rank in steps of
BLOCK_K, each step loading the P tile once for both products, then loads the
p and g tile, applies update_rules.h ``lowrank_update``
(``state_free_update(p, g - up_grad) + up_update``) and stores p once. Neither
back-projection ever exists in memory: the cpu backend writes and reads two
[M, N] fp32 tensors for them.

The launches go one tensor at a time, unlike the elementwise kernels' single
launch per list: here the GEMMs dominate (4 M N R flops against 3 M N
parameter-sized memory accesses), so a launch per tensor costs little, and
each launch gets its own M, N, R without a table.

Scalars as in ``_common``: derived on the host in double when ``lr`` is on
the host; otherwise the kernel reads ``lr`` (an fp64 copy on the device) from
the tail ``(&lr, weight_decay, scale)`` of a small int64 table, which is built
once per call and shared by the launches of all tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    amp_scalars, device_scalars, f64_bits, from_param, grouped_tile, launch_table, sign_scalars,
    start, tail_f64, tail_scalar, to_param)
from frugal_kernels.kernels.triton.sign_sgd import state_free_update
from frugal_kernels._layout import RIGHT, STATE_FREE_CODES, projection_rank

# Not tuned on hardware yet. 64 x 64 output tiles, rank steps of 32 and 4 warps:
# a usual starting point for an fp32 Triton GEMM on H100/H200. Two 64 x 64 fp32
# accumulators are 64 registers per thread at 4 warps. tl.dot needs every
# block dimension >= 16; a rank smaller than BLOCK_K (down to 1) and ragged
# M, N are padded with masked zeros, which add nothing to the products.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4
# Programs ordered in groups of GROUP_M tile rows (the usual Triton matmul
# swizzle), so programs running together share tiles of P and the low tensors
# in L2.
GROUP_M = 8

_RIGHT = tl.constexpr(RIGHT)  # the other side is _layout.LEFT


@triton.jit
def _back_projections(u_ptr, lg_ptr, proj_ptr, rows, cols, M, N, R, SIDE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile (rows, cols) of up(low_update) and up(low_grad), in fp32.

    input_precision="ieee": true fp32 products. TF32 (Triton's default for fp32
    on NVIDIA) keeps 10 bits of mantissa in the inputs, an error of ~5e-4
    relative in each product of up(low_grad); the state-free rule takes the
    sign of g - up(low_grad), a residual that cancels part of g, and would
    turn that error into wrong signs. The price on GPUs: the products run on
    the CUDA cores (fp32 FMA, 67 TFLOP/s peak on an H200) instead of the
    tensor cores (~495 TFLOP/s dense TF32), so the kernel is compute-bound
    once R passes ~40 (4 R flops per 12 bytes of p and g against 67 TFLOP/s
    over 4.8 TB/s), and Triton's FMA products reach only part of that peak.
    """
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    row_in = rows < M
    col_in = cols < N
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    for k0 in range(0, R, BLOCK_K):
        kk = k0 + ks
        k_in = kk < R
        if SIDE == _RIGHT:
            # low tensors [M, R], P [R, N]
            low_at = rows[:, None] * R + kk[None, :]
            low_in = row_in[:, None] & k_in[None, :]
            proj = tl.load(proj_ptr + (kk[:, None] * N + cols[None, :]),
                           mask=k_in[:, None] & col_in[None, :], other=0.0)
            u = tl.load(u_ptr + low_at, mask=low_in, other=0.0)
            acc_u = tl.dot(u, proj, acc_u, input_precision="ieee")
            lg = tl.load(lg_ptr + low_at, mask=low_in, other=0.0)
            acc_g = tl.dot(lg, proj, acc_g, input_precision="ieee")
        else:
            # P [M, R], low tensors [R, N]
            proj = tl.load(proj_ptr + (rows[:, None] * R + kk[None, :]),
                           mask=row_in[:, None] & k_in[None, :], other=0.0)
            low_at = kk[:, None] * N + cols[None, :]
            low_in = k_in[:, None] & col_in[None, :]
            u = tl.load(u_ptr + low_at, mask=low_in, other=0.0)
            acc_u = tl.dot(proj, u, acc_u, input_precision="ieee")
            lg = tl.load(lg_ptr + low_at, mask=low_in, other=0.0)
            acc_g = tl.dot(proj, lg, acc_g, input_precision="ieee")
    return acc_u, acc_g


# M and R are not specialised (Triton compiles a variant per "== 1" and "% 16 == 0" of
# each specialised integer, so a model's tensors could need several): M only bounds the
# tiles, and R the rank loop of a compute-bound kernel. N stays specialised: its
# divisibility lets the loads and the store of p and g be vectorised.
@triton.jit(do_not_specialize=["M", "R"])
def _lowrank_step_kernel(p_ptr, g_ptr, u_ptr, lg_ptr, proj_ptr, tail, M, N, R, decay, step, amp,
                         AMP: tl.constexpr, SIDE: tl.constexpr, STATE_FREE: tl.constexpr,
                         SCALARS_IN_KERNEL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    if SCALARS_IN_KERNEL:
        lr = tail_scalar(tail, 0)
        decay = (1.0 - lr * tail_f64(tail, 1)).to(tl.float32)
        step = (lr * tail_f64(tail, 2)).to(tl.float32)
    tile_m, tile_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # int64 offsets: M * N may pass 2^31.
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    up_update, up_grad = _back_projections(u_ptr, lg_ptr, proj_ptr, rows, cols, M, N, R, SIDE,
                                           BLOCK_M, BLOCK_N, BLOCK_K)
    at = rows[:, None] * N + cols[None, :]
    if AMP:
        # A GradScaler found an inf: no row is read or written, decided on the device.
        inv = tl.load(amp)
        live_rows = tl.where(tl.load(amp + 1) == 0.0, M, 0)
    else:
        inv = 1.0
        live_rows = M
    inside = (rows < live_rows)[:, None] & (cols < N)[None, :]
    p = from_param(tl.load(p_ptr + at, mask=inside, other=0.0))
    g = from_param(tl.load(g_ptr + at, mask=inside, other=0.0)) * inv
    # update_rules.h lowrank_update: the state-free rule on the residual, then
    # the back-projected AdamW update.
    p = state_free_update(p, g - up_grad, decay, step, STATE_FREE) + up_update
    tl.store(p_ptr + at, to_param(p, p_ptr.dtype.element_ty), mask=inside)


def lowrank_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                  low_updates: Sequence[Tensor], low_grads: Sequence[Tensor],
                  projections: Sequence[Tensor], sides: Sequence[int], *, lr: Tensor,
                  weight_decay: float, state_free: str, state_free_scale: float,
                  grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                  scalars_in_kernel: Optional[bool] = None) -> None:
    """The low-rank step in place, as ``frugal_kernels.ops.lowrank_step_`` (inputs already
    checked: matrices of the right shapes, fp32 low tensors and projections, all
    contiguous).

    ``lr`` is a 0-dim tensor; ``scalars_in_kernel`` as for ``adamw_``.
    """
    items, device, scalars_in_kernel = start(params, (lr,), scalars_in_kernel)
    if not items:
        return
    tail, alive = None, []
    if scalars_in_kernel:
        alive = device_scalars((lr,), device)
        # A table without tensors: [0] then the tail (see _common).
        table, _ = launch_table(device, [], [], 1, [alive[0].data_ptr(), f64_bits(weight_decay),
                                                    f64_bits(state_free_scale)])
        tail = table[1:]
        scalars = (0.0, 0.0)  # derived in the kernel
    else:
        scalars = sign_scalars(float(lr), weight_decay, state_free_scale)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    for i in items:
        p = params[i]
        m = p.shape[0]
        n = p.numel() // m
        side = int(sides[i])
        r = projection_rank(projections[i], side)
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        _lowrank_step_kernel[grid](
            p, grads[i], low_updates[i], low_grads[i], projections[i], tail, m, n, r, *scalars,
            amp if use_amp else p, AMP=use_amp, SIDE=side, STATE_FREE=STATE_FREE_CODES[state_free],
            SCALARS_IN_KERNEL=bool(scalars_in_kernel), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=NUM_WARPS, enable_fp_fusion=False)
