"""The Triton kernel of frugal::dequantize under the interpreter, against the torch reference
bit for bit.

tests/ops/test_dequantize.py runs the op's generic cases on this backend too; here
the cases aim at the kernel's geometry: flat tiles of BLOCK = 1024 positions that
start mid-row and hold many short rows, 3-bit fields straddling two bytes, rows
ending mid-byte, a block of rows of a larger weight, and special scales.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import _quant, ops, reference

from .helpers import compile_for_h200, interpreted, ulps

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# C = 1 (1024 rows to a tile), C = 9 (3 bits: a row of 27 bits ends mid-byte),
# C = 1021 (every tile after the first starts mid-row), C = 1025 (a tile and one).
SHAPES = [(1, 1), (300, 1), (37, 9), (3, 1021), (2, 1025), (5, 3)]


def _case(shape, bits, per_row, seed):
    gen = torch.Generator().manual_seed(seed)
    top = _quant.qmax(bits)
    q = torch.randint(-top, top + 1, shape, generator=gen)
    scales = torch.rand(shape[0] if per_row else 1, generator=gen) * 3 + 1e-3
    return _quant.pack(q, bits), scales


@pytest.fixture(scope="module", autouse=True)
def kernel():
    yield from interpreted(("_common", "dequantize"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor scale", "row scales"])
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_tiles_equal_the_reference(bits, per_row, dtype):
    for i, shape in enumerate(SHAPES):
        packed, scales = _case(shape, bits, per_row, seed=10 * bits + i)
        out = torch.full(shape, float("nan"), dtype=dtype)
        ops.dequantize(packed, scales, bits=bits, cols=shape[1], dtype=dtype, out=out,
                       backend="triton")
        expected = reference.dequantize(packed, scales, bits=bits, cols=shape[1], dtype=dtype)
        differ = int((ulps(out, expected) != 0).sum())
        assert differ == 0, f"{shape}: {differ} of {out.numel()} values differ from the reference"


def test_a_block_of_rows_reads_its_own_scales():
    """QuantLinear's blocks: a slice of rows of the codes with its slice of the scales."""
    packed, scales = _case((50, 13), 3, per_row=True, seed=1)
    got = ops.dequantize(packed[17:41], scales[17:41], bits=3, cols=13, backend="triton")
    assert torch.equal(got, reference.dequantize(packed, scales, bits=3, cols=13)[17:41])


def test_rounding_into_bf16_is_to_nearest_even():
    """Products that fall between two bf16 values: the interpreter's own cast truncates,
    the kernel rounds as torch does (and subnormal and huge scales stay exact)."""
    q = torch.tensor([[1, -1, 2, -2, 3, 7, -7]])
    packed = _quant.pack(q, 4)
    for s in (1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, 1.0 - 2.0**-10, 3e-39, 3e37):
        scales = torch.tensor([s])
        got = ops.dequantize(packed, scales, bits=4, cols=7, dtype=torch.bfloat16,
                             backend="triton")
        assert torch.equal(got, (q.float() * s).to(torch.bfloat16)), f"scale {s}"


_COMPILE = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import dequantize as k

    for bits, out in ((3, "*bf16"), (4, "*fp32"), (2, "*fp16"), (8, "*bf16")):
        signature = {"codes_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": out, "total": "i64",
                     "C": "i64", "packed_cols": "i64", "scale_stride": "i32",
                     "BITS": "constexpr", "BLOCK": "constexpr"}
        source = triton.compiler.ASTSource(fn=k._dequantize_kernel, signature=signature,
                                           constexprs={"BITS": bits, "BLOCK": k.BLOCK})
        triton.compile(source, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": k.NUM_WARPS})
        print(bits, "ok")
""")


def test_kernel_compiles_for_h200():
    """Compile for sm_90 with Triton's bundled ptxas (no GPU needed): the interpreter does
    not see GPU-only errors."""
    assert compile_for_h200(_COMPILE).count("ok") == 4
