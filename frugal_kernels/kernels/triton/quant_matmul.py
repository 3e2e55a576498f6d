"""``quant_matmul`` on Triton: ``a @ W.T + bias`` (or ``a @ W``) with ``W = s * q`` read from
its packed INT-n codes inside the GEMM, never written to memory.

``W`` is ``[R, C]`` in the format of ``_quant``. Both products are written as
``out[m, j] = sum_k a[m, k] * B[k, j]``: with ``transpose_weight`` (the forward
of a linear layer) ``B = W.T``, so ``k`` runs over W's columns and ``j`` over
its rows; without it (the input gradient, ``grad_out @ W``) ``B = W``. A
program owns one output tile [BLOCK_M, BLOCK_N] and walks ``k`` in steps of
BLOCK_K: it loads the ``a`` tile, reads the codes of the ``B`` tile from their
packed bytes (``dequantize.load_codes``; ``bits / 8`` bytes per weight instead of
the 2 or 4 of a float weight), multiplies by the scales in fp32, rounds the
tile into ``a``'s dtype (as the reference's ``dequantize(..., dtype=a.dtype)``)
and accumulates with ``tl.dot`` in fp32. The bias is added to the fp32
accumulator and the sum rounded once into ``a``'s dtype.

fp32 inputs take ``input_precision="ieee"``: TF32 (Triton's default) would keep
10 bits of ``a``'s mantissa, an error of ~5e-4 relative, far from the fp32
layer a user asked for. bf16 and fp16 inputs use the tensor cores' native
products with fp32 accumulation (bf16 under the interpreter: ``wide_products``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (check_device, from_param, grouped_tile,
                                                    interpreting, to_param)
from frugal_kernels.kernels.triton.dequantize import load_codes

# Not tuned on hardware yet (written without a GPU at hand): 64 x 64 output tiles,
# k steps of 32 and 4 warps, the usual starting point of a Triton GEMM; with at
# most 16 rows of ``a`` (decoding, small batches) tiles of 16 rows, the least
# tl.dot takes, so that programs do not multiply padding.
BLOCK_M = 64
BLOCK_M_SMALL = 16
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4
# Programs ordered in groups of GROUP_M tile rows (the usual Triton matmul swizzle),
# so that programs running together share code tiles in L2.
GROUP_M = 8


@triton.jit
def _quant_matmul_kernel(a_ptr, codes_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_am,
                         stride_ak, packed_cols, scale_stride, HAS_BIAS: tl.constexpr,
                         TRANSPOSE: tl.constexpr, WIDE: tl.constexpr, BITS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, K_STEPS: tl.constexpr):
    tile_m, tile_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # int64 offsets: M * N or a weight's size may pass 2^31.
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < M
    col_in = cols < N
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    if TRANSPOSE:
        # B = W.T: the output columns are W's rows, each with its scale.
        scale = tl.load(scale_ptr + cols * scale_stride, mask=col_in, other=0.0)[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # A constexpr trip count, cdiv(K, BLOCK_K), for Triton 3.6's interpreter as in
    # lowrank_step._back_projections; a model has few distinct K (its layers' widths).
    for k_step in range(K_STEPS):
        kk = k_step * BLOCK_K + ks
        k_in = kk < K
        a = tl.load(a_ptr + (rows[:, None] * stride_am + kk[None, :] * stride_ak),
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        b_in = k_in[:, None] & col_in[None, :]
        if TRANSPOSE:
            q = load_codes(codes_ptr, cols[None, :], kk[:, None], b_in, packed_cols, BITS)
            w = scale * q.to(tl.float32)
        else:
            # B = W: the reduction runs over W's rows, each with its scale.
            q = load_codes(codes_ptr, kk[:, None], cols[None, :], b_in, packed_cols, BITS)
            w = tl.load(scale_ptr + kk * scale_stride, mask=k_in, other=0.0)[:, None] * \
                q.to(tl.float32)
        # Zero outside the weight: the padding's field 0 is the code -qmax.
        b = to_param(tl.where(b_in, w, 0.0), a_ptr.dtype.element_ty)
        if WIDE:
            acc = tl.dot(from_param(a), from_param(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += from_param(tl.load(bias_ptr + cols, mask=col_in, other=0.0))[None, :]
    tl.store(out_ptr + (rows[:, None] * N + cols[None, :]),
             to_param(acc, out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def wide_products(dtype: torch.dtype) -> bool:
    """Whether the tiles go into tl.dot as fp32 with IEEE products: fp32 inputs always
    (see the module docstring), bf16 ones under the interpreter, whose dot multiplies
    the raw bits of bf16 values (it holds them as uint16) as integers. The product of
    two bf16 values is exact in fp32, so the widened dot computes what the tensor
    cores do: exact products, fp32 sums."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def quant_matmul(a: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor], bits: int,
                 transpose_weight: bool, out: Tensor) -> None:
    """``out = a @ W.T + bias`` (``a @ W`` without ``transpose_weight``) as
    ``frugal_kernels.ops.quant_matmul`` (inputs checked; codes, scales and bias
    contiguous; ``a`` of any strides; ``out`` contiguous and non-empty)."""
    check_device(out.device)
    m, n = out.shape
    k = a.shape[1]
    block_m = BLOCK_M_SMALL if m <= BLOCK_M_SMALL else BLOCK_M
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N),)
    _quant_matmul_kernel[grid](
        a, codes, scales, out if bias is None else bias, out, m, n, k, a.stride(0), a.stride(1),
        codes.shape[1], int(scales.numel() > 1), HAS_BIAS=bias is not None,
        TRANSPOSE=bool(transpose_weight), WIDE=wide_products(a.dtype), BITS=bits,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        K_STEPS=triton.cdiv(k, BLOCK_K), num_warps=NUM_WARPS)
