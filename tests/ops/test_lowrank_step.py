"""frugal::lowrank_step_ on every backend usable on the CPU, against the reference."""

import re

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._layout import LEFT, RIGHT

from .helpers import DTYPES, cpu_backends, ulp_diff

OP = "frugal::lowrank_step_"


def make_case(shape, rank, side, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = shape[0]
    n = 1
    for d in shape[1:]:
        n *= d
    p = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    dim = n if side == RIGHT else m
    q, _ = torch.linalg.qr(torch.randn(dim, rank, generator=gen))
    proj = q.t().contiguous() if side == RIGHT else q.contiguous()
    g2 = g.float().reshape(m, n)
    low_grad = g2 @ proj.t() if side == RIGHT else proj.t() @ g2
    low_update = torch.randn(low_grad.shape, generator=gen) * 1e-3
    return p, g, low_update, low_grad, proj


def fraction_apart(a, b, tol):
    return ((a.float() - b.float()).abs() > tol).float().mean().item()


@pytest.mark.parametrize("backend", cpu_backends(OP))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rank,side", [
    ((64, 48), 12, RIGHT), ((48, 64), 12, LEFT), ((33, 7), 2, RIGHT), ((5, 70), 1, LEFT),
    ((4, 6, 5), 3, RIGHT), ((130, 150), 37, LEFT),
], ids=str)
@pytest.mark.parametrize("state_free", ["sign", "sgd", "none"])
def test_matches_reference(backend, dtype, shape, rank, side, state_free):
    p, g, u, lg, proj = make_case(shape, rank, side, dtype, seed=rank)
    fast, ref = [p.clone()], [p.clone()]
    kw = dict(lr=1e-2, weight_decay=0.1, state_free=state_free, state_free_scale=0.5)
    ops.lowrank_step_(fast, [g], [u], [lg], [proj], [side], backend=backend, **kw)
    reference.lowrank_step_(ref, [g], [u], [lg], [proj], [side], **kw)
    if dtype == torch.float32:
        # GEMMs round differently per backend; a sign taken of a residual near
        # zero can flip (DESIGN.md section 6): count the coordinates that moved
        # apart by more than rounding.
        assert fraction_apart(fast[0], ref[0], 1e-5) <= 0.002
    else:
        apart = fraction_apart(fast[0], ref[0], 0)
        assert apart <= 0.01 or ulp_diff(fast[0], ref[0]) <= 1


@pytest.mark.parametrize("backend", cpu_backends(OP))
def test_many_tensors_in_one_call(backend):
    cases = [make_case(s, r, side, seed=i) for i, (s, r, side) in
             enumerate([((20, 10), 3, RIGHT), ((10, 20), 3, LEFT), ((16, 16), 16, RIGHT)])]
    params = [c[0].clone() for c in cases]
    expected = [c[0].clone() for c in cases]
    args = [[c[k] for c in cases] for k in range(1, 5)]
    sides = [RIGHT, LEFT, RIGHT]
    ops.lowrank_step_(params, *args, sides, lr=0.1, weight_decay=0.0, state_free="sgd",
                      backend=backend)
    reference.lowrank_step_(expected, *args, sides, lr=0.1, weight_decay=0.0, state_free="sgd")
    for a, b in zip(params, expected):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_update_by_hand():
    """With P = the first r unit vectors, the op is FRUGAL's columns split."""
    p = torch.zeros(2, 3)
    g = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])
    proj = torch.eye(3)[:1]  # RIGHT, r = 1: column 0 is the subspace
    low_grad = g @ proj.t()
    low_update = torch.tensor([[0.5], [0.25]])
    ops.lowrank_step_([p], [g], [low_update], [low_grad], [proj], [RIGHT], lr=0.1)
    expected = torch.tensor([[0.5, 0.1, -0.1], [0.25, -0.1, 0.1]])
    assert torch.allclose(p, expected, atol=1e-7)


@pytest.mark.parametrize("bad,error,message", [
    (lambda c: ([c[0][0]], [c[1][0]], [c[2]], [c[3]], [c[4]], [RIGHT]), ValueError,
     "1 dims"),
    (lambda c: ([c[0]], [c[1]], [c[2].double()], [c[3]], [c[4]], [RIGHT]), TypeError,
     "low_updates[0] has dtype"),
    (lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [LEFT]), ValueError,
     "must have shape"),
    (lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [RIGHT, RIGHT]), ValueError,
     "2 sides"),
    (lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [7]), ValueError, "sides[0] must be"),
])
def test_bad_input_raises_and_leaves_params_untouched(bad, error, message):
    case = make_case((12, 8), 3, RIGHT)
    args = bad(case)
    before = args[0][0].clone()
    with pytest.raises(error, match=re.escape(message)):
        ops.lowrank_step_(*args, lr=0.1)
    assert torch.equal(args[0][0], before)


def test_opcheck():
    p, g, u, lg, proj = make_case((12, 8), 3, RIGHT)
    torch.library.opcheck(torch.ops.frugal.lowrank_step_.default,
                          ([p], [g], [u], [lg], [proj], [RIGHT], torch.tensor(0.1), 0.01, "sign",
                           1.0, "auto"))


@pytest.mark.parametrize("backend", cpu_backends(OP))
@pytest.mark.parametrize("shape,side", [((0, 5), RIGHT), ((5, 0), LEFT), ((0, 3, 4), RIGHT)])
def test_empty_tensors(backend, shape, side):
    p = torch.empty(shape)
    m, n = shape[0], shape[1] * (shape[2] if len(shape) > 2 else 1)
    proj = torch.zeros((1, n) if side == RIGHT else (m, 1))
    low = torch.zeros((m, 1) if side == RIGHT else (1, n))
    ops.lowrank_step_([p], [p.clone()], [low], [low.clone()], [proj], [side], lr=0.1,
                      backend=backend)
    assert p.shape == shape
