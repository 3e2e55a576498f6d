"""The Triton kernel of frugal::quant_matmul under the interpreter: the GEMM whose weight tiles
are read from packed INT-n codes, within the stated bound of the exact product.

tests/ops/test_quant_matmul.py runs the op's generic cases on this backend; here the
shapes aim at the kernel's geometry: a (at most 16 rows: tiles of 16) and more
rows (tiles of 64, two tile rows); outputs of one, two and three 64-wide tile
columns with a ragged edge; reductions shorter than, equal to and longer than a
k step of 32, whose 3-bit fields straddle bytes at the tile edges; and per-row
scales along either axis (the output's in ``a @ W.T``, the reduction's in
``a @ W``). The bound (``tests.ops.helpers.assert_within_gemm_bound``) is
``(K + 2) * 2**-23 * sum |a| |w|`` for the fp32 sums in any order, plus one
rounding into the output dtype: the kernel sums in another order than torch's
GEMM, so its bits may differ, by far less than any wrong code or scale would.

Under the interpreter bf16 tiles enter tl.dot widened to fp32 (its dot multiplies
the raw bits of bf16 values); the native bf16 dot of the GPU is compiled for
sm_90 below but has not run here.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import _quant, ops

from ..ops.helpers import assert_within_gemm_bound, quant_matmul_case
from .helpers import compile_for_h200, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, R, C) of the weight [R, C]: with a @ W.T the output is [M, R] and the
# reduction C; with a @ W the output is [M, C] and the reduction R.
SHAPES = [(16, 70, 41), (17, 33, 130), (70, 64, 32), (3, 5, 1)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    yield from interpreted(("_common", "dequantize", "quant_matmul"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transpose_weight", [True, False], ids=["a@W.T", "a@W"])
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor scale", "row scales"])
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_tiles_within_the_bound(bits, per_row, transpose_weight, dtype):
    for i, (m, rows, cols) in enumerate(SHAPES):
        a, codes, scales, bias, q = quant_matmul_case(m, rows, cols, bits, per_row, dtype,
                                                      transpose_weight, bias=i != 1,
                                                      seed=100 * bits + i)
        out = ops.quant_matmul(a, codes, scales, bias, bits=bits, cols=cols,
                               transpose_weight=transpose_weight, backend="triton")
        assert_within_gemm_bound(out, a, q, scales, bias, transpose_weight,
                                 what=f"{bits} bits {(m, rows, cols)}")


def test_the_padding_of_tiles_adds_nothing():
    """Codes whose every field is -qmax: the padding of a partial tile reads the field 0,
    the code -qmax too, so a kernel that multiplied the padding would add it."""
    rows, cols = 3, 5
    q = torch.full((rows, cols), -7)
    codes, scales = _quant.pack(q, 4), torch.tensor([0.5])
    a = torch.ones(2, cols)
    out = ops.quant_matmul(a, codes, scales, bits=4, cols=cols, backend="triton")
    assert torch.equal(out, torch.full((2, rows), -3.5 * cols))
    out = ops.quant_matmul(torch.ones(2, rows), codes, scales, bits=4, cols=cols,
                           transpose_weight=False, backend="triton")
    assert torch.equal(out, torch.full((2, cols), -3.5 * rows))


_COMPILE = textwrap.dedent("""
    import re, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import quant_matmul as k

    # (bits, dtype, transpose, has bias, wide products, block_m)
    for bits, dtype, transpose, bias, wide, block_m in (
            (3, "bf16", True, True, False, k.BLOCK_M), (4, "fp32", False, False, True, k.BLOCK_M),
            (2, "fp16", True, False, False, k.BLOCK_M_SMALL), (8, "bf16", False, True, False,
                                                              k.BLOCK_M_SMALL)):
        constexprs = dict(HAS_BIAS=bias, TRANSPOSE=transpose, WIDE=wide, BITS=bits,
                          BLOCK_M=block_m, BLOCK_N=k.BLOCK_N, BLOCK_K=k.BLOCK_K,
                          GROUP_M=k.GROUP_M, K_STEPS=24)  # K from 737 to 768
        signature = {"a_ptr": "*" + dtype, "codes_ptr": "*u8", "scale_ptr": "*fp32",
                     "bias_ptr": "*" + dtype, "out_ptr": "*" + dtype,
                     **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak",
                                           "packed_cols", "scale_stride")},
                     **{c: "constexpr" for c in constexprs}}
        source = triton.compiler.ASTSource(fn=k._quant_matmul_kernel, signature=signature,
                                           constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": k.NUM_WARPS}).asm["ptx"]
        if wide:
            assert "tf32" not in ptx, "fp32 products on TF32"
        else:
            assert re.search(r"mma", ptx), f"{dtype}: no tensor-core instruction"
        print(bits, dtype, "ok")
""")


def test_kernel_compiles_for_h200():
    """Compile for sm_90 with Triton's bundled ptxas (no GPU needed): the interpreter does
    not see GPU-only errors; 16-bit inputs reach the tensor cores (mma), fp32 ones not
    through TF32."""
    assert compile_for_h200(_COMPILE).count("ok") == 4
