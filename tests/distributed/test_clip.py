"""``opt.clip_grad_norm_`` under FSDP2: each rank holds the gradients of its rows only, so
the norm is the ranks' partial sums (or maxima) reduced over the group. Two ranks return
the norm of the whole gradient, the same on both, and step as one process that clips
the same gradient."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import frugal_kernels as fk

from .helpers import end_rank, fraction_apart, rendezvous

STEPS, BATCH, MAX_NORM = 3, 8, 0.05
NORM_TYPES = (2.0, math.inf)


class Net(nn.Module):
    """A weight of 63 rows (32 and 31 on the two ranks), a norm and a small head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(40, 63)
        self.norm = nn.LayerNorm(63)
        self.out = nn.Linear(63, 1)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.big(x))))


def optimizer(model):
    return fk.FRUGAL(fk.param_groups(model, extra_patterns=["big"]), lr=1e-2, density=0.5, projection="rows")


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 40, generator=gen), torch.randn(BATCH, 1, generator=gen))
            for _ in range(STEPS)]


def train(model, opt, norm_type, rank=0, world=1):
    """The norms ``clip_grad_norm_`` returned, one per step."""
    per_rank = BATCH // world
    norms = []
    for x, y in batches():
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad()
    return norms


def params_of(model):
    from torch.distributed.tensor import DTensor
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in model.parameters()]


def _rank(rank, world, init_method, out):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for norm_type in NORM_TYPES:
        model = Net()
        fully_shard(model.big, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = optimizer(model)
        results[norm_type] = {"norms": train(model, opt, norm_type, rank, world),
                              "params": params_of(model)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    end_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clip"))
    single = {}
    for norm_type in NORM_TYPES:
        model = Net()
        single[norm_type] = {"norms": train(model, optimizer(model), norm_type),
                             "params": params_of(model)}
    mp.spawn(_rank, args=(2, rendezvous(out), out), nprocs=2, join=True)
    return single, [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True)
                    for r in (0, 1)]


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=["2-norm", "inf-norm"])
def test_two_ranks_return_the_whole_norm_and_clip_as_one_process(runs, norm_type):
    single, ranks = runs
    one = single[norm_type]
    # The clip is active at every step, so a rank that clipped by its own shard's norm
    # would step otherwise.
    assert min(one["norms"]) > 2 * MAX_NORM
    assert ranks[0][norm_type]["norms"] == ranks[1][norm_type]["norms"]
    torch.testing.assert_close(torch.tensor(ranks[0][norm_type]["norms"]),
                               torch.tensor(one["norms"]), rtol=1e-5, atol=0)
    for a, b, c in zip(ranks[0][norm_type]["params"], ranks[1][norm_type]["params"],
                       one["params"]):
        assert torch.equal(a, b)
        # The reduction of the gradients over two halves rounds otherwise.
        assert fraction_apart(a, c, tol=1e-4) <= 0.01
