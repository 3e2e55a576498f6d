"""``ops.quant_matmul``, the GEMM on packed INT-n weights, on every backend that runs on CPU
tensors (torch; triton under the interpreter).

Not an optimizer step (out of place, no lists), so not an entry of the op table
(tests/op_db.py); it gets the table's checks here: every code width, scale kind,
dtype and both products (``a @ W.T``, ``a @ W``) over odd and empty sizes within
the stated bound of the exact result (``helpers.assert_within_gemm_bound``), bad
input raising a clear error, and opcheck. The Triton kernel's own geometry is in
tests/triton_backend/test_quant_matmul.py.
"""

import pytest
import torch

from frugal_kernels import _quant, ops, reference

from .helpers import DTYPES, assert_within_gemm_bound, cpu_backends, quant_matmul_case

# (M, R, C): one of each, odd sizes, empty M, R and C (an empty reduction gives the bias).
SHAPES = [(1, 1, 1), (5, 19, 37), (3, 6, 9), (0, 5, 7), (4, 0, 7), (4, 6, 0)]


@pytest.mark.parametrize("backend", cpu_backends("frugal::quant_matmul"))
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor scale", "row scales"])
@pytest.mark.parametrize("transpose_weight", [True, False], ids=["a@W.T", "a@W"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_within_the_bound_of_the_exact_product(backend, bits, per_row, transpose_weight, dtype):
    for i, (m, rows, cols) in enumerate(SHAPES):
        if per_row and rows == 0:
            continue
        a, codes, scales, bias, q = quant_matmul_case(m, rows, cols, bits, per_row, dtype,
                                                      transpose_weight, bias=i % 2 == 0, seed=i)
        out = ops.quant_matmul(a, codes, scales, bias, bits=bits, cols=cols,
                               transpose_weight=transpose_weight, backend=backend)
        assert_within_gemm_bound(out, a, q, scales, bias, transpose_weight,
                                 what=f"{(m, rows, cols)}")


@pytest.mark.parametrize("backend", cpu_backends("frugal::quant_matmul"))
def test_non_contiguous_a_and_a_block_of_rows(backend):
    """``a`` of any strides (a transposed view, a column slice of a gradient); a block of
    rows of the codes with its slice of the scales."""
    a, codes, scales, _, q = quant_matmul_case(7, 40, 13, 3, True, torch.float32, seed=3)
    a_t = a.t().contiguous().t()
    out = ops.quant_matmul(a_t, codes[10:30], scales[10:30], bits=3, cols=13, backend=backend)
    assert_within_gemm_bound(out, a, q[10:30], scales[10:30], None, True, what="transposed a")
    g = torch.randn(7, 50)[:, 5:45]
    out = ops.quant_matmul(g, codes, scales, bits=3, cols=13, transpose_weight=False,
                           backend=backend)
    assert_within_gemm_bound(out, g, q, scales, None, False, what="sliced a")


def test_auto_on_cpu_tensors_is_the_reference():
    a, codes, scales, bias, _ = quant_matmul_case(5, 9, 11, 4, True, torch.bfloat16, seed=1)
    out = ops.quant_matmul(a, codes, scales, bias, bits=4, cols=11)
    assert torch.equal(out, reference.quant_matmul(a, codes, scales, bias, bits=4, cols=11))


def _errors():
    a, codes, scales, bias, _ = quant_matmul_case(3, 6, 10, 4, False, torch.float32)
    base = dict(a=a, codes=codes, scales=scales, bias=bias, bits=4, cols=10)
    return [
        ("bits", dict(base, bits=5), ValueError, "bits must be one of"),
        ("codes dtype", dict(base, codes=codes.to(torch.int16)), ValueError, "2-D torch.uint8"),
        ("cols", dict(base, cols=12), ValueError, "codes of a weight with 12 columns"),
        ("codes of other bits", dict(base, bits=2), ValueError, "2-bit codes"),
        ("negative cols", dict(base, cols=-1), ValueError, "cols must be an int >= 0"),
        ("scale shape", dict(base, scales=torch.ones(4)), ValueError,
         "float32 of shape (1,) or (6,)"),
        ("scale dtype", dict(base, scales=scales.double()), ValueError, "float32 of shape"),
        ("a dtype", dict(base, a=a.double(), bias=None), TypeError, "a must be torch.float32"),
        ("a shape", dict(base, a=a[:, :9]), ValueError, "needs a of shape [M, 10]"),
        ("a for a @ W", dict(base, transpose_weight=False, bias=None), ValueError,
         "a @ W [6, 10] needs a of shape [M, 6]"),
        ("1-D a", dict(base, a=a[0]), ValueError, "needs a of shape"),
        ("bias shape", dict(base, bias=bias[:5]), ValueError, "bias must be torch.float32 of "
         "shape (6,)"),
        ("bias dtype", dict(base, bias=bias.half()), ValueError, "bias must be torch.float32"),
        ("bias for a @ W", dict(base, a=torch.randn(3, 6), transpose_weight=False), ValueError,
         "shape (10,)"),
        ("bias device", dict(base, bias=bias.to("meta")), ValueError, "bias is on meta"),
        ("codes not a tensor", dict(base, codes=codes.tolist()), TypeError,
         "codes is a list"),
        ("backend", dict(base, backend="cuda"), ValueError, "has no cuda implementation"),
    ]


@pytest.mark.parametrize("name,kwargs,error,match", _errors(), ids=[e[0] for e in _errors()])
def test_bad_input_raises(name, kwargs, error, match):
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        ops.quant_matmul(**kwargs)


@pytest.mark.parametrize("backend", cpu_backends("frugal::quant_matmul"))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("transpose_weight", [True, False], ids=["a@W.T", "a@W"])
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor scale", "row scales"])
def test_opcheck(per_row, transpose_weight, bias, backend):
    a, codes, scales, b, _ = quant_matmul_case(5, 9, 13, 3, per_row, torch.float32,
                                               transpose_weight, bias, seed=2)
    torch.library.opcheck(torch.ops.frugal.quant_matmul.default,
                          (a, codes, scales, b, 3, 13, transpose_weight, backend))


def test_compiles_with_torch_compile():
    """The fake kernel gives torch.compile the output's shape and dtype."""
    a, codes, scales, bias, _ = quant_matmul_case(4, 6, 10, 2, True, torch.float32, seed=5)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def layer(x):
        return torch.relu(ops.quant_matmul(x, codes, scales, bias, bits=2, cols=10))

    assert torch.equal(layer(a), torch.relu(reference.quant_matmul(a, codes, scales, bias,
                                                                   bits=2, cols=10)))
