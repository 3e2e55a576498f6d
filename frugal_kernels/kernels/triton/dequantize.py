"""``dequantize`` on Triton: packed INT-n codes back to the float weight ``W = s * q``.

The format is ``_quant``'s: each row of ``[R, C]`` is a little-endian bit stream
of ``bits``-wide fields ``q + qmax``, ``packed_cols`` bytes long. A lane reads
its field from one byte, or from two when the field straddles a byte boundary
(3 bits), multiplies ``s * (field - qmax)`` in fp32 and rounds once into the
output dtype (``to_param``: to nearest even, as torch), so the result equals the
reference bit for bit. ``load_codes`` reads the codes at any (broadcast) indices
and is shared with the fused dequantize-matmul (``quant_matmul``), which reads
2-D tiles of them.

Program ``t`` takes the flat positions ``[t * BLOCK, (t + 1) * BLOCK)`` of the
row-major output; only reads are shared between programs (a byte holding fields
of two programs' columns is read by both), so any cut of the weight is valid.
"""

from __future__ import annotations

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import check_device, to_param

# Not tuned on hardware yet: an elementwise kernel bound by the output's
# stores, 1024 positions (8 per thread at 4 warps), as dqt_update.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def load_codes(codes_ptr, r, c, mask, packed_cols, BITS: tl.constexpr):
    """The codes ``q[r, c]`` (int32, ``-qmax .. qmax``) at the broadcast indices ``r``, ``c``
    (int64) where ``mask`` holds; ``-qmax`` (the field 0) elsewhere."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    bit = c * BITS
    byte_ptr = codes_ptr + r * packed_cols + (bit >> 3)
    shift = (bit & 7).to(tl.int32)
    low = tl.load(byte_ptr, mask=mask, other=0).to(tl.int32)
    if BITS == 3:
        # The second byte exists whenever the field reaches into it: a row's
        # packed_cols bytes cover every bit of its last field.
        high = tl.load(byte_ptr + 1, mask=mask & (shift + BITS > 8), other=0).to(tl.int32)
        low = low | (high << 8)
    return ((low >> shift) & ((1 << BITS) - 1)) - QMAX


# No size is specialised: the codes are loaded byte by byte through a division by C and
# the output is written at contiguous positions whatever the sizes, so a variant per
# "== 1" or "% 16 == 0" of each would buy nothing but compilations.
@triton.jit(do_not_specialize=["total", "C", "packed_cols", "scale_stride"])
def _dequantize_kernel(codes_ptr, scale_ptr, out_ptr, total, C, packed_cols, scale_stride,
                       BITS: tl.constexpr, BLOCK: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < total
    r = pos // C
    c = pos - r * C
    q = load_codes(codes_ptr, r, c, inside, packed_cols, BITS)
    scale = tl.load(scale_ptr + r * scale_stride, mask=inside, other=0.0)
    w = scale * q.to(tl.float32)
    tl.store(out_ptr + pos, to_param(w, out_ptr.dtype.element_ty), mask=inside)


def dequantize(codes: Tensor, scales: Tensor, bits: int, out: Tensor) -> None:
    """``out = s * q`` as ``frugal_kernels.ops.dequantize`` (inputs checked, contiguous,
    ``out`` non-empty)."""
    check_device(out.device)
    rows, cols = out.shape
    total = rows * cols
    _dequantize_kernel[(triton.cdiv(total, BLOCK),)](
        codes, scales, out, total, cols, codes.shape[1], int(scales.numel() > 1), BITS=bits,
        BLOCK=BLOCK, num_warps=NUM_WARPS)
