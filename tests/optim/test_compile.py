"""torch.compile(opt.step) across subspace changes: which ones compile the update again.

The blocks projection moves whole tensors between AdamW and the state-free rule at each
change. The compiled update is keyed on the sequence of op calls and on their tensors'
shapes (parameters keep static shapes under torch.compile), not on which tensors they
are, so a change that picks tensors of the shapes of an earlier choice reuses its graph.
"""

import pytest
import torch

import frugal_kernels as fk


def _layers(n: int = 8, shape=(16, 12)):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for _ in range(n)]


def _run(make, params, steps: int, compiled: bool):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    opt = make(params)
    step = torch.compile(opt.step) if compiled else opt.step
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        step()
    return [p.detach().clone() for p in params], counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("block_order", ["ascending", "random"])
def test_blocks_changes_among_equal_tensors_keep_one_graph(block_order):
    """Eight subspace changes, each a new pair of state-full tensors of one shape."""
    def make(params):
        return fk.FRUGAL(params, lr=1e-2, density=0.25, update_gap=2, projection="blocks",
                         block_order=block_order, seed=3)

    eager, _ = _run(make, _layers(), 16, compiled=False)
    compiled, graphs = _run(make, _layers(), 16, compiled=True)
    assert graphs == 1
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_adafrugal_blocks_compiles_once_per_count_of_active_tensors():
    """rho from 0.5 to 0.125 over eight tensors: 4, 3, 2 and 1 state-full tensors, one
    graph for each count, none for the changes between them."""
    def make(params):
        return fk.AdaFRUGAL(params, lr=1e-2, rho_start=0.5, rho_end=0.125, rho_steps=12,
                            update_gap=2, update_gap_max=2, projection="blocks", seed=3)

    eager, _ = _run(make, _layers(), 16, compiled=False)
    compiled, graphs = _run(make, _layers(), 16, compiled=True)
    assert graphs == 4
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
