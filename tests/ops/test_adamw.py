"""frugal::adamw_ against torch.optim.AdamW; the generic op tests (each backend
against the reference, bad inputs, opcheck, ISA levels) are tests/ops/test_ops.py's,
driven by the ADAMW entry of tests/op_db.py."""

import pytest
import torch

from frugal_kernels import ops

from .helpers import cpu_backends, rel_diff


@pytest.mark.parametrize("backend", cpu_backends())
def test_matches_torch_adamw_over_50_steps(backend):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (17,), (1,), (4099,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(50)]
    hyper = dict(lr=3e-3, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.1)

    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(theirs, foreach=False, **hyper)
    ours = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    for step, g in enumerate(grads, start=1):
        for p, gi in zip(theirs, g):
            p.grad = gi
        opt.step()
        ops.adamw_(ours, g, m, v, lr=hyper["lr"], beta1=0.85, beta2=0.98, eps=1e-7,
                   weight_decay=0.1, step=step, backend=backend)
    for i, p in enumerate(theirs):
        state = opt.state[p]
        assert rel_diff(ours[i], p.detach()) <= 1e-6, f"param {i}"
        assert rel_diff(m[i], state["exp_avg"]) <= 1e-6, f"exp_avg {i}"
        assert rel_diff(v[i], state["exp_avg_sq"]) <= 1e-6, f"exp_avg_sq {i}"
