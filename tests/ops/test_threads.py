"""The cpu backend gives the same bits for any number of threads, for every op."""

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels._layout import lowrank_side, project, subset_state_shape
from frugal_kernels.optim import subspace_choice

from .helpers import DTYPES, cpu_backends

SHAPES = [(300, 257), (1, 7), (4097,), (65, 3, 11)]
LR, BETA1, BETA2, EPS, WD, STEP = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3


def _adamw(p, g, gen):
    m = [torch.randn(x.shape, generator=gen) * 0.1 for x in p]
    v = [torch.rand(x.shape, generator=gen) * 0.01 for x in p]
    return lambda: ops.adamw_(p, g, m, v, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                              weight_decay=WD, step=STEP, backend="cpu"), m + v


def _sign_sgd(p, g, gen):
    return lambda: ops.sign_sgd_(p, g, lr=LR, weight_decay=WD, backend="cpu"), []


def _frugal_step(kind):
    def make(p, g, gen):
        idx, m, v = [], [], []
        for x in p:
            if kind != "flat" and x.dim() == 0:
                continue
            dim = {"rows": x.shape[0], "columns": x.shape[-1], "flat": x.numel()}[kind]
            ids = subspace_choice.choose_subset(dim, max(1, dim // 3), gen, x.device)
            idx.append(ids)
            shape = subset_state_shape(x, kind, ids.numel())
            m.append(torch.randn(shape, generator=gen) * 0.1)
            v.append(torch.rand(shape, generator=gen) * 0.01)
        return lambda: ops.frugal_step_(p, g, m, v, idx, kind=kind, lr=LR, beta1=BETA1,
                                        beta2=BETA2, eps=EPS, weight_decay=WD, step=STEP,
                                        backend="cpu"), m + v
    return make


def _lowrank_step(p, g, gen):
    mats = [(x, y) for x, y in zip(p, g) if x.dim() >= 2]
    ps, gs = [x for x, _ in mats], [y for _, y in mats]
    sides = [lowrank_side(x.shape) for x in ps]
    projs = [subspace_choice.make_projection("random", y, 2, gen) for y in gs]
    lows = [project(y, proj, side) for y, proj, side in zip(gs, projs, sides)]
    ups = [torch.randn(low.shape, generator=gen) * 1e-3 for low in lows]
    return lambda: ops.lowrank_step_(ps, gs, ups, lows, projs, sides, lr=LR, weight_decay=WD,
                                     backend="cpu"), []


def _lowrank_adamw_step(p, g, gen):
    mats = [(x, y) for x, y in zip(p, g) if x.dim() >= 2]
    ps, gs = [x for x, _ in mats], [y for _, y in mats]
    sides = [lowrank_side(x.shape) for x in ps]
    projs = [subspace_choice.make_projection("random", y, 2, gen) for y in gs]
    lows = [project(y, proj, side) for y, proj, side in zip(gs, projs, sides)]
    m = [torch.randn(low.shape, generator=gen) * 0.1 for low in lows]
    v = [torch.rand(low.shape, generator=gen) * 0.01 for low in lows]
    return lambda: ops.lowrank_adamw_step_(ps, gs, m, v, projs, sides, lr=LR, beta1=BETA1,
                                           beta2=BETA2, eps=EPS, weight_decay=WD, step=STEP,
                                           backend="cpu"), m + v


CASES = {"adamw_": _adamw, "sign_sgd_": _sign_sgd, "frugal_step_[rows]": _frugal_step("rows"),
         "frugal_step_[columns]": _frugal_step("columns"), "frugal_step_[flat]": _frugal_step("flat"),
         "lowrank_step_": _lowrank_step, "lowrank_adamw_step_": _lowrank_adamw_step}


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b.values[0] == "cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_for_1_2_and_4_threads(case, dtype, backend):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(0)
            p = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            g = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            run, states = CASES[case](p, g, gen)
            for _ in range(3):
                run()
            results.append([t.clone() for t in p + states])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
