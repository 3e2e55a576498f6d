"""``ops.dequantize``, the read side of the INT-n format, on every CPU backend.

Not an optimizer step (no gradients, no lr), so it is not an entry of the op
table (tests/op_db.py); it gets the table's checks here: the reference over
every code width, scale kind, dtype and odd or empty size, bad input raising
with ``out`` untouched, opcheck, and bit-identical CPU ISA levels.
"""

import pytest
import torch

from frugal_kernels import _quant, ops, reference
from frugal_kernels._extension import extension

from .helpers import DTYPES, cpu_backends

SHAPES = [(1, 1), (7, 5), (3, 17), (4, 2053), (2, 4099), (0, 6), (5, 0), (300, 24)]


def _case(shape, bits, per_row, seed=0):
    gen = torch.Generator().manual_seed(seed)
    top = _quant.qmax(bits)
    q = torch.randint(-top, top + 1, shape, generator=gen)
    scales = torch.rand(shape[0] if per_row else 1, generator=gen) + 0.01
    return q, _quant.pack(q, bits), scales


@pytest.mark.parametrize("backend", cpu_backends("frugal::dequantize"))
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor scale", "row scales"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(backend, bits, per_row, dtype):
    for i, shape in enumerate(SHAPES):
        if per_row and shape[0] == 0:
            continue
        q, packed, scales = _case(shape, bits, per_row, seed=i)
        out = ops.dequantize(packed, scales, bits=bits, cols=shape[1], dtype=dtype,
                             backend=backend)
        expected = (q.float() * scales.reshape(-1, 1)).to(dtype)
        assert out.dtype == dtype and out.shape == shape
        assert torch.equal(out, expected), f"{shape}"
        assert torch.equal(out, reference.dequantize(packed, scales, bits=bits, cols=shape[1],
                                                     dtype=dtype))


@pytest.mark.parametrize("backend", cpu_backends("frugal::dequantize"))
def test_row_blocks_of_a_weight_dequantize_on_their_own(backend):
    """A block of rows of the codes (how QuantLinear reads a weight) is valid input."""
    q, packed, scales = _case((40, 33), 3, per_row=True)
    out = torch.full((10, 33), float("nan"))
    got = ops.dequantize(packed[20:30], scales[20:30], bits=3, cols=33, out=out,
                         backend=backend)
    assert got is out
    assert torch.equal(out, q[20:30].float() * scales[20:30].reshape(-1, 1))


def _errors():
    q, packed, scales = _case((6, 10), 4, per_row=False)
    out = torch.zeros(6, 10)
    return [
        ("bits", dict(codes=packed, scales=scales, bits=5, cols=10), ValueError,
         "bits must be one of"),
        ("codes dtype", dict(codes=packed.to(torch.int16), scales=scales, bits=4, cols=10),
         TypeError, "2-D torch.uint8"),
        ("cols", dict(codes=packed, scales=scales, bits=4, cols=12), ValueError,
         "not the 4-bit codes"),
        ("scale shape", dict(codes=packed, scales=torch.ones(4), bits=4, cols=10), ValueError,
         "float32 of shape (1,) or (6,)"),
        ("scale dtype", dict(codes=packed, scales=scales.double(), bits=4, cols=10),
         ValueError, "float32 of shape"),
        ("dtype", dict(codes=packed, scales=scales, bits=4, cols=10, dtype=torch.float64),
         TypeError, "out must be torch.float32"),
        ("out shape", dict(codes=packed, scales=scales, bits=4, cols=10, out=out[:, :9]),
         ValueError, "out is torch.float32 (6, 9)"),
        ("out not contiguous", dict(codes=packed, scales=scales, bits=4, cols=10,
                                    out=torch.zeros(10, 6).t()), ValueError, "contiguous"),
    ]


@pytest.mark.parametrize("backend", cpu_backends("frugal::dequantize"))
@pytest.mark.parametrize("name,kwargs,error,match", _errors(), ids=[e[0] for e in _errors()])
def test_bad_input_raises_and_writes_nothing(backend, name, kwargs, error, match):
    out = kwargs.get("out")
    before = None if out is None else out.clone()
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
        ops.dequantize(**kwargs, backend=backend)
    if out is not None:
        assert torch.equal(out, before)


@pytest.mark.parametrize("backend", cpu_backends("frugal::dequantize"))
@pytest.mark.parametrize("per_row", [False, True])
def test_opcheck(per_row, backend):
    _, packed, scales = _case((9, 13), 3, per_row)
    out = torch.empty(9, 13)
    torch.library.opcheck(torch.ops.frugal.dequantize.default,
                          (out, packed, scales, 3, backend))


@pytest.mark.skipif(extension() is None, reason="compiled extension not built")
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_every_cpu_isa_level_gives_identical_bits(bits):
    ext = extension()
    _, packed, scales = _case((70, 2100), bits, per_row=True)
    results = []
    try:
        for level in ext.build_info()["cpu_isa_levels"]:
            if ext.cpu_select_isa(level):
                results.append((level, ops.dequantize(packed, scales, bits=bits, cols=2100,
                                                      dtype=torch.bfloat16, backend="cpu")))
    finally:
        ext.cpu_select_isa("auto")
    for level, out in results[1:]:
        assert torch.equal(out, results[0][1]), f"{level} differs from {results[0][0]}"
