"""``ops.grad_norm``: the global gradient norm and non-finite flag, on every CPU backend.

Out of place (it returns the norm and the flag), so it is not an entry of the op table
(tests/op_db.py); it gets the table's checks here: the reference over dtypes, odd and
empty sizes and mixed lists, non-finite values anywhere, bad input refused, opcheck,
bit-identical CPU ISA levels and thread counts, and torch's own clip_grad_norm_.
"""

import math

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._extension import extension

from .helpers import DTYPES, cpu_backends

# Odd sizes around the C++ kernel's lanes (16), fp16 tiles (512) and chunks (32768).
SIZES = [0, 1, 15, 17, 513, 32767, 32769, 2**20 + 3]
NORMS = [2.0, math.inf]


def _grads(sizes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 3).to(dtype) for n in sizes]


def _expected(grads, norm_type):
    """The norm from first principles, in double."""
    flat = torch.cat([g.double().reshape(-1) for g in grads]) if grads else torch.zeros(0)
    if math.isinf(norm_type):
        return flat.abs().max().item() if flat.numel() else 0.0
    return flat.square().sum().sqrt().item()


@pytest.mark.parametrize("backend", cpu_backends("frugal::grad_norm"))
@pytest.mark.parametrize("norm_type", NORMS, ids=["2", "inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_norm_and_the_reference(backend, norm_type, dtype):
    for size in SIZES:
        grads = _grads([size], dtype, seed=size)
        norm, found_inf = ops.grad_norm(grads, norm_type=norm_type, backend=backend)
        assert norm.dtype == torch.float32 and norm.shape == ()
        assert found_inf.dtype == torch.float32 and found_inf.shape == (1,)
        assert found_inf.item() == 0.0
        assert norm.item() == pytest.approx(_expected(grads, norm_type), rel=1e-6), size
        ref_norm, ref_flag = reference.grad_norm(grads, norm_type=norm_type)
        assert torch.equal(norm, ref_norm) or math.isclose(norm.item(), ref_norm.item(),
                                                           rel_tol=2 ** -23), size
        assert torch.equal(found_inf, ref_flag)


@pytest.mark.parametrize("backend", cpu_backends("frugal::grad_norm"))
@pytest.mark.parametrize("norm_type", NORMS, ids=["2", "inf"])
def test_a_mixed_list_is_one_vector(backend, norm_type):
    grads = [g for dtype in DTYPES for g in _grads([33, 0, 4097], dtype, seed=len(str(dtype)))]
    norm, found_inf = ops.grad_norm(grads, norm_type=norm_type, backend=backend)
    assert norm.item() == pytest.approx(_expected(grads, norm_type), rel=1e-6)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("backend", cpu_backends("frugal::grad_norm"))
@pytest.mark.parametrize("norm_type", NORMS, ids=["2", "inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
def test_a_non_finite_element_anywhere_sets_the_flag(backend, norm_type, dtype, bad):
    sizes = [40000, 1, 515]
    for t, position in [(0, 0), (0, 39999), (0, 32770), (1, 0), (2, 514), (2, 3)]:
        grads = _grads(sizes, dtype)
        grads[t][position] = bad
        norm, found_inf = ops.grad_norm(grads, norm_type=norm_type, backend=backend)
        assert found_inf.item() == 1.0, (t, position)
        if math.isnan(bad):
            assert math.isnan(norm.item()), (t, position)
        else:
            assert norm.item() == math.inf, (t, position)


@pytest.mark.parametrize("backend", cpu_backends("frugal::grad_norm"))
def test_huge_finite_gradients_do_not_overflow_the_sum(backend):
    """Squares of fp32 values near its maximum overflow fp32 but not the double sum:
    the flag must not call them non-finite."""
    grads = [torch.full((1000,), 3e38)]
    norm, found_inf = ops.grad_norm(grads, backend=backend)
    assert found_inf.item() == 0.0
    assert norm.item() == math.inf  # the norm itself (9.5e39) is past fp32's range
    grads = [torch.full((1000,), 1e30)]
    norm, found_inf = ops.grad_norm(grads, backend=backend)
    assert found_inf.item() == 0.0
    assert norm.item() == pytest.approx(1e30 * math.sqrt(1000), rel=1e-6)


@pytest.mark.parametrize("backend", cpu_backends("frugal::grad_norm"))
@pytest.mark.parametrize("norm_type", NORMS, ids=["2", "inf"])
def test_equals_torchs_clip_grad_norm(backend, norm_type):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 7, 70000)]
    for p, g in zip(params, _grads([p.numel() for p in params], torch.float32, seed=3)):
        p.grad = g
    ours, _ = ops.grad_norm([p.grad for p in params], norm_type=norm_type, backend=backend)
    theirs = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9, norm_type=norm_type)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_an_empty_list_has_norm_zero():
    norm, found_inf = ops.grad_norm([])
    assert norm.item() == 0.0 and found_inf.item() == 0.0


@pytest.mark.parametrize("call,error,match", [
    (lambda: ops.grad_norm([torch.ones(3)], norm_type=1.0), ValueError, "norm_type"),
    (lambda: ops.grad_norm([torch.ones(3)], norm_type=-math.inf), ValueError, "norm_type"),
    (lambda: ops.grad_norm([torch.ones(3, dtype=torch.int32)]), TypeError, "int32"),
    (lambda: ops.grad_norm([torch.ones(3), "x"]), TypeError, "grads[1]"),
    (lambda: ops.grad_norm([torch.ones(3), torch.ones(3, device="meta")]), ValueError,
     "call once per device"),
    (lambda: ops.grad_norm([torch.ones(3)], backend="nope"), ValueError, "unknown backend"),
    (lambda: ops.grad_norm([torch.ones(3)], backend="cuda"), ValueError, "cuda"),
])
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match.replace("[", r"\[").replace("]", r"\]")):
        call()


@pytest.mark.parametrize("norm_type", NORMS, ids=["2", "inf"])
def test_opcheck(norm_type):
    grads = _grads([5, 17], torch.float32) + _grads([9], torch.bfloat16)
    torch.library.opcheck(torch.ops.frugal.grad_norm.default, (grads, norm_type, "auto"))


@pytest.mark.skipif(extension() is None, reason="compiled extension not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_cpu_isa_level_and_thread_count_gives_identical_bits(dtype):
    ext = extension()
    grads = _grads([2**20 + 3, 70001, 5], dtype, seed=11)
    results = []
    threads = torch.get_num_threads()
    try:
        for level in ext.build_info()["cpu_isa_levels"]:
            if not ext.cpu_select_isa(level):
                continue
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                for norm_type in NORMS:
                    results.append(((level, n, norm_type),
                                    ops.grad_norm(grads, norm_type=norm_type, backend="cpu")))
    finally:
        ext.cpu_select_isa("auto")
        torch.set_num_threads(threads)
    for norm_type in NORMS:
        runs = [(key, out) for key, out in results if key[2] == norm_type]
        (base_key, base), *others = runs
        for key, out in others:
            assert torch.equal(out[0], base[0]), f"{key} differs from {base_key}"
