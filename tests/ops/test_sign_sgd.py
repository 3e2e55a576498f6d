"""frugal::sign_sgd_ on every backend usable on the CPU, against the reference."""

import re

import pytest
import torch

from frugal_kernels import ops, reference

from .helpers import DTYPES, clone, cpu_backends, make_batch, ulp_diff

SIZES = [1, 7, 4097, 2**20 + 3]


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_matches_reference(backend, dtype, size):
    if backend == "triton" and size > 2**16:
        size = 2**16 + 3  # the interpreter is slow; the largest size adds no new path there
    params, grads, _, _ = make_batch([size, 3], dtype, seed=size)
    grads[0].view(-1)[::5] = 0  # sign(0) = 0: those coordinates only decay
    fast, ref = clone(params), clone(params)
    for _ in range(3):
        ops.sign_sgd_(fast, grads, lr=1e-2, weight_decay=0.1, scale=0.5, backend=backend)
        reference.sign_sgd_(ref, grads, lr=1e-2, weight_decay=0.1, scale=0.5)
    for a, b in zip(fast, ref):
        # Same operations in the same order: exact in fp32; the interpreter's
        # 16-bit stores may round one ulp apart.
        assert ulp_diff(a, b) <= (0 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("backend", cpu_backends())
def test_mixed_sizes_empty_and_tensor_lr(backend):
    params, grads, _, _ = make_batch([0, 5, (4, 0), 1000, (7, 9)], torch.float32, seed=1)
    fast, ref = clone(params), clone(params)
    ops.sign_sgd_(fast, grads, lr=torch.tensor(3e-3), weight_decay=0.0, backend=backend)
    reference.sign_sgd_(ref, grads, lr=3e-3)
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)


def test_update_rule_by_hand():
    p = torch.tensor([1.0, -2.0, 0.5, 3.0])
    g = torch.tensor([0.3, -1e-30, 0.0, -7.0])
    ops.sign_sgd_([p], [g], lr=0.1, weight_decay=0.5, scale=2.0)
    decay = 1 - 0.1 * 0.5
    expected = torch.tensor([1.0 * decay - 0.2, -2.0 * decay + 0.2, 0.5 * decay, 3.0 * decay + 0.2])
    assert torch.allclose(p, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad,error,message", [
    (lambda p, g: ([p[0]], g), ValueError, "got 1 params but 2 grads"),
    (lambda p, g: (p, [g[0].half(), g[1]]), TypeError, "grads[0] has dtype"),
    (lambda p, g: ([p[0], torch.randn(6, 3).t()], [g[0], torch.randn(3, 6)]), ValueError,
     "params[1] is not contiguous"),
    (lambda p, g: (p, [g[0], g[1][:2]]), ValueError, "grads[1] has shape"),
])
def test_bad_input_raises_and_leaves_params_untouched(bad, error, message):
    params, grads, _, _ = make_batch([10, 6], torch.float32)
    args = bad(params, grads)
    before = [clone(lst) for lst in args]
    with pytest.raises(error, match=re.escape(message)):
        ops.sign_sgd_(*args, lr=0.1)
    for lst, saved in zip(args, before):
        for t, s in zip(lst, saved):
            assert torch.equal(t, s)


def test_opcheck():
    params, grads, _, _ = make_batch([33, 4], torch.float32, seed=5)
    torch.library.opcheck(torch.ops.frugal.sign_sgd_.default,
                          (params, grads, torch.tensor(1e-3), 0.01, 1.0, "auto"))
