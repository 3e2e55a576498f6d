"""lowrank_step_ reads non-contiguous projections, low-rank updates and projected
gradients right on every backend (the Triton kernel once read them as the wrong matrix)."""

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels._layout import LEFT, RIGHT, project

from .helpers import cpu_backends


@pytest.mark.parametrize("backend", cpu_backends("frugal::lowrank_step_"))
@pytest.mark.parametrize("side", [RIGHT, LEFT])
@pytest.mark.parametrize("which", ["projection", "low_update", "low_grad"])
def test_non_contiguous_read_only_inputs(backend, side, which):
    gen = torch.Generator().manual_seed(0)
    m, n, r = (40, 24, 5) if side == RIGHT else (24, 40, 5)
    p = torch.randn(m, n, generator=gen)
    g = torch.randn(m, n, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(n if side == RIGHT else m, r, generator=gen))
    proj = q.t().contiguous() if side == RIGHT else q.contiguous()
    low_grad = project(g, proj, side)
    low_update = torch.randn(low_grad.shape, generator=gen) * 1e-3
    inputs = {"projection": proj, "low_update": low_update, "low_grad": low_grad}
    strided = dict(inputs)
    # The same values through a transposed buffer: a tensor whose strides are swapped.
    strided[which] = inputs[which].t().contiguous().t()
    assert not strided[which].is_contiguous()
    want, got = p.clone(), p.clone()
    for target, args in ((want, inputs), (got, strided)):
        ops.lowrank_step_([target], [g], [args["low_update"]], [args["low_grad"]],
                          [args["projection"]], [side], lr=1e-2, weight_decay=0.1,
                          backend=backend)
    assert torch.equal(got, want)
