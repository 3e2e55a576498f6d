"""``linear_cross_entropy`` on Triton: the logits of ``hidden @ weight.T + bias`` in tiles
that never leave the program, with an online softmax over the vocabulary.

Forward (``forward``): a program owns BLOCK_N tokens and walks the vocabulary in tiles
of BLOCK_V; each logit tile is a GEMM over D in steps of BLOCK_D (fp32 accumulation).
Per token it keeps the running maximum ``m`` and, rescaled by ``exp(m_old - m_new)``
whenever the maximum grows, the sums of ``exp(z - m)`` over all classes (``s``) and over
the classes other than the target (``s_other``), of ``exp(2 (z - m))`` over those
(``s2_other``), and the plain sums of the logits and the target's logit. Then
``lse = m + log(s)``; the loss is ``lse - (1 - eps) z_y - eps mean(z)``; and with
``p = softmax(z)``, ``c = eps / V`` and ``q`` the smoothed target,

    ||p - q||^2 = s2_other / s^2 - 2 c s_other / s + (V - 1) c^2 + (eps - c - s_other / s)^2

(the target's term uses ``1 - p_y = s_other / s``, which keeps a confident token's
small score from cancelling: ``1 - p_y`` computed as a difference would lose it).

Backward (``backward``): one program per (token tile, vocabulary tile) recomputes its
logit tile, forms ``d = scale * (exp(z - lse) - q)`` and adds ``d @ W[tile]`` into the
hidden states' gradient and ``d.T @ h[tile]`` into the weight's (and ``d``'s column
sums into the bias's) with fp32 atomic adds, tile of D by tile of D. The sums'
order on a GPU is thus not fixed: the gradients may differ in the last bits from run to
run. fp32 inputs multiply in IEEE fp32 (as ``quant_matmul``: no TF32); 16-bit ones on
a GPU enter the dots in their dtype, ``d`` rounded to it, with fp32 accumulation.

Block sizes are the usual GEMM starting point, not tuned on hardware (written without
a GPU at hand).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import check_device, from_param, to_param
from frugal_kernels.kernels.triton.quant_matmul import wide_products

BLOCK_N = 64
BLOCK_N_SMALL = 16  # at most 16 tokens: the least tl.dot takes
BLOCK_V = 64
BLOCK_D = 32
NUM_WARPS = 4


@triton.jit
def _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_in, col_in, D,
                HAS_BIAS: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr):
    """``hidden[rows] @ weight[cols].T + bias[cols]`` in fp32, [BLOCK_N, BLOCK_V]."""
    acc = tl.full((BLOCK_N, BLOCK_V), 0.0, tl.float32)
    ks = tl.arange(0, BLOCK_D).to(tl.int64)
    for k_step in range(D_STEPS):
        kk = k_step * BLOCK_D + ks
        k_in = kk < D
        a = tl.load(h_ptr + (rows[:, None] * D + kk[None, :]),
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(w_ptr + (cols[None, :] * D + kk[:, None]),
                    mask=k_in[:, None] & col_in[None, :], other=0.0)
        if WIDE:
            acc = tl.dot(from_param(a), from_param(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += from_param(tl.load(b_ptr + cols, mask=col_in, other=0.0))[None, :]
    return acc


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, t_ptr, loss_ptr, lse_ptr, el2n_ptr, N, V, D,
                    ignore_index, eps, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    V_STEPS: tl.constexpr, D_STEPS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    t = tl.load(t_ptr + rows, mask=row_in, other=0).to(tl.int64)
    kept = row_in & (t != ignore_index)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.full((BLOCK_N,), 0.0, tl.float32)
    s_other = tl.full((BLOCK_N,), 0.0, tl.float32)
    s2_other = tl.full((BLOCK_N,), 0.0, tl.float32)
    sum_z = tl.full((BLOCK_N,), 0.0, tl.float32)
    z_y = tl.full((BLOCK_N,), 0.0, tl.float32)
    for v_step in range(V_STEPS):
        cols = v_step * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
        col_in = cols < V
        z = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_in, col_in, D, HAS_BIAS, WIDE,
                        BLOCK_N, BLOCK_V, BLOCK_D, D_STEPS)
        is_t = cols[None, :] == t[:, None]
        z_y += tl.sum(tl.where(is_t, z, 0.0), axis=1)
        sum_z += tl.sum(tl.where(col_in[None, :], z, 0.0), axis=1)
        z = tl.where(col_in[None, :], z, float("-inf"))
        # Every tile has a column inside the vocabulary: m_new is finite.
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        e_other = tl.where(is_t, 0.0, e)
        s = s * alpha + tl.sum(e, axis=1)
        s_other = s_other * alpha + tl.sum(e_other, axis=1)
        s2_other = s2_other * (alpha * alpha) + tl.sum(e_other * e_other, axis=1)
        m = m_new
    lse = m + tl.log(s)
    loss = (1.0 - eps) * (lse - z_y) + eps * (lse - sum_z / V)
    c = eps / V
    miss = s_other / s  # 1 - p_y
    sq = s2_other / (s * s) - 2.0 * c * miss + (V - 1) * c * c + (eps - c - miss) * (eps - c - miss)
    el2n = tl.sqrt(tl.maximum(sq, 0.0))
    tl.store(lse_ptr + rows, lse, mask=row_in)
    tl.store(loss_ptr + rows, tl.where(kept, loss, 0.0), mask=row_in)
    tl.store(el2n_ptr + rows, tl.where(kept, el2n, 0.0), mask=row_in)


@triton.jit
def _backward_kernel(h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, scale_ptr, gh_ptr, gw_ptr, gb_ptr,
                     N, V, D, eps, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                     D_STEPS: tl.constexpr):
    tiles_v = tl.cdiv(V, BLOCK_V)
    pid = tl.program_id(0)
    rows = (pid // tiles_v).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (pid % tiles_v).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_in = rows < N
    col_in = cols < V
    z = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_in, col_in, D, HAS_BIAS, WIDE,
                    BLOCK_N, BLOCK_V, BLOCK_D, D_STEPS)
    t = tl.load(t_ptr + rows, mask=row_in, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
    # 0 beyond N and for ignored tokens (the host's row scales): their rows of d vanish.
    scale = tl.load(scale_ptr + rows, mask=row_in, other=0.0)
    q = tl.where(cols[None, :] == t[:, None], 1.0 - eps, 0.0) + eps / V
    d = scale[:, None] * (tl.exp(z - lse[:, None]) - q)
    d = tl.where(row_in[:, None] & col_in[None, :], d, 0.0)
    if HAS_BIAS:
        tl.atomic_add(gb_ptr + cols, tl.sum(d, axis=0), mask=col_in)
    if not WIDE:
        d = to_param(d, h_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_D).to(tl.int64)
    for k_step in range(D_STEPS):
        kk = k_step * BLOCK_D + ks
        k_in = kk < D
        w = tl.load(w_ptr + (cols[:, None] * D + kk[None, :]),
                    mask=col_in[:, None] & k_in[None, :], other=0.0)
        h = tl.load(h_ptr + (rows[:, None] * D + kk[None, :]),
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        if WIDE:
            gh = tl.dot(d, from_param(w), input_precision="ieee")
            gw = tl.dot(tl.trans(d), from_param(h), input_precision="ieee")
        else:
            gh = tl.dot(d, w)
            gw = tl.dot(tl.trans(d), h)
        tl.atomic_add(gh_ptr + (rows[:, None] * D + kk[None, :]), gh,
                      mask=row_in[:, None] & k_in[None, :])
        tl.atomic_add(gw_ptr + (cols[:, None] * D + kk[None, :]), gw,
                      mask=col_in[:, None] & k_in[None, :])


def _block_n(n: int) -> int:
    return BLOCK_N_SMALL if n <= BLOCK_N_SMALL else BLOCK_N


def forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
            ignore_index: int, label_smoothing: float):
    """Per-token loss (0 where ignored), log-sum-exp and el2n (0 where ignored), fp32
    ``[N]`` each, as ``ops.linear_cross_entropy`` (inputs checked and contiguous)."""
    check_device(hidden.device)
    n, d = hidden.shape
    v = weight.shape[0]
    loss, lse, el2n = (torch.empty(n, dtype=torch.float32, device=hidden.device)
                       for _ in range(3))
    if n:
        block_n = _block_n(n)
        _forward_kernel[(triton.cdiv(n, block_n),)](
            hidden, weight, weight if bias is None else bias, targets, loss, lse, el2n, n, v, d,
            ignore_index, float(label_smoothing), HAS_BIAS=bias is not None,
            WIDE=wide_products(hidden.dtype), BLOCK_N=block_n, BLOCK_V=BLOCK_V,
            BLOCK_D=BLOCK_D, V_STEPS=triton.cdiv(v, BLOCK_V), D_STEPS=triton.cdiv(d, BLOCK_D),
            num_warps=NUM_WARPS)
    return loss, lse, el2n


def backward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
             lse: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float):
    """Gradients of ``sum_i scale_i * loss_i`` with respect to hidden, weight and bias
    (an empty tensor without bias), in their dtypes, from the forward's ``lse``."""
    check_device(hidden.device)
    n, d = hidden.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    gh = torch.zeros((n, d), **f32)
    gw = torch.zeros((v, d), **f32)
    gb = torch.zeros((v,), **f32) if bias is not None else None
    if n:
        block_n = _block_n(n)
        grid = (triton.cdiv(n, block_n) * triton.cdiv(v, BLOCK_V),)
        _backward_kernel[grid](
            hidden, weight, weight if bias is None else bias, targets, lse,
            scale.contiguous(), gh, gw, gw if gb is None else gb, n, v, d,
            float(label_smoothing), HAS_BIAS=bias is not None,
            WIDE=wide_products(hidden.dtype), BLOCK_N=block_n, BLOCK_V=BLOCK_V,
            BLOCK_D=BLOCK_D, D_STEPS=triton.cdiv(d, BLOCK_D), num_warps=NUM_WARPS)
    return (gh.to(hidden.dtype), gw.to(weight.dtype),
            weight.new_empty((0,)) if gb is None else gb.to(bias.dtype))
