"""frugal::lowrank_adamw_step_ by hand and its prepared calls; the generic op tests (each
backend against the reference, empty tensors, bad inputs, opcheck, ISA levels) are
tests/ops/test_ops.py's, driven by the LOWRANK_ADAMW_STEP entry of tests/op_db.py."""

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels._layout import LEFT, RIGHT
from frugal_kernels.ops import unchecked

from ..op_db import LOWRANK_ADAMW_HYPER, lowrank_adamw_case
from .helpers import cpu_backends

HYPER = {**LOWRANK_ADAMW_HYPER, "step": 3}


@pytest.mark.parametrize("backend", cpu_backends("frugal::lowrank_adamw_step_"))
@pytest.mark.parametrize("side,kind", [(RIGHT, "columns"), (LEFT, "rows")])
@pytest.mark.parametrize("rule", ["sign", "sgd", "none"])
def test_unit_vector_projections_are_the_frugal_subset_split(backend, side, kind, rule):
    """P made of unit vectors keeps whole columns (right) or rows (left): the op is then
    frugal_step_ on that subset, to the bit (every product is by 0 or 1)."""
    gen = torch.Generator().manual_seed(0)
    shape = (9, 7) if side == RIGHT else (7, 9)
    ids = torch.tensor([1, 4, 5])
    p, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if side == RIGHT:
        proj, state = torch.eye(shape[1])[ids].contiguous(), (shape[0], 3)
    else:
        proj, state = torch.eye(shape[0])[:, ids].contiguous(), (3, shape[1])
    m = torch.randn(state, generator=gen) * 0.1
    v = torch.rand(state, generator=gen) * 0.1
    ours = [p.clone(), m.clone(), v.clone()]
    theirs = [p.clone(), m.clone(), v.clone()]
    ops.lowrank_adamw_step_([ours[0]], [g], [ours[1]], [ours[2]], [proj], [side],
                            state_free=rule, backend=backend, **HYPER)
    ops.frugal_step_([theirs[0]], [g], [theirs[1]], [theirs[2]], [ids], kind=kind,
                     state_free=rule, backend=backend, **HYPER)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def _tensors(dtype=torch.float32):
    specs = [((16, 6), 2, RIGHT), ((6, 16), 2, LEFT), ((0, 6), 1, RIGHT), ((12, 12), 3, LEFT)]
    cases = [lowrank_adamw_case(s, r, side, dtype, seed=i) for i, (s, r, side) in enumerate(specs)]
    return [list(c) for c in zip(*cases)], [side for _, _, side in specs]


@pytest.mark.parametrize("backend", cpu_backends("frugal::lowrank_adamw_step_"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prepared_call_gives_the_ops_bits_over_steps(backend, dtype):
    (p, g, m, v, proj), sides = _tensors(dtype)
    theirs = [[t.clone() for t in lst] for lst in (p, m, v)]
    prepared = unchecked.prepare_lowrank_adamw_step_(p, m, v, proj, sides, backend=backend)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 6):
        grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in g]
        lr = torch.tensor(2.0**-6)
        prepared(grads, lr=lr, step=torch.tensor(float(step)), beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.1, state_free="sign", state_free_scale=0.5)
        ops.lowrank_adamw_step_(theirs[0], grads, theirs[1], theirs[2], proj, sides, lr=lr,
                                step=step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                state_free="sign", state_free_scale=0.5, backend=backend)
    for ours, want in zip((p, m, v), theirs):
        for a, b in zip(ours, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", cpu_backends("frugal::lowrank_adamw_step_"))
def test_a_prepared_call_unscales_skips_on_found_inf_and_counts_versions(backend):
    (p, g, m, v, proj), sides = _tensors()
    prepared = unchecked.prepare_lowrank_adamw_step_(p, m, v, proj, sides, backend=backend)
    hyper = dict(lr=torch.tensor(1e-2), step=torch.tensor(1.0), beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.1, state_free="sign", state_free_scale=0.5)
    before = [t.clone() for t in p + m + v]
    versions = [t._version for t in p + m + v]
    prepared([t * 1024 for t in g], grad_scale=torch.tensor(1024.0),
             found_inf=torch.tensor(1.0), **hyper)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, before))
    prepared([t * 1024 for t in g], grad_scale=torch.tensor(1024.0), **hyper)
    assert all(t._version > n for t, n in zip(p + m + v, versions))
    want = [t.clone() for t in before]
    k = len(p)
    ops.lowrank_adamw_step_(want[:k], g, want[k:2 * k], want[2 * k:], proj, sides,
                            backend=backend, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, want))
