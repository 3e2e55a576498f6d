"""state_dtype="int8" under FSDP2: the blocks of 8-bit moments lie along rows, so each
rank holds the codes and scales of its rows, and torch.distributed.checkpoint moves
them between 2 ranks and 1 process bit for bit (the state of the whole is the same
on any number of ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import frugal_kernels as fk

from .helpers import end_rank, fraction_apart, load, rendezvous, save

STEPS, CUT, BATCH = 4, 2, 8


class Net(nn.Module):
    """A weight of 63 rows of 300 (two blocks per row, the second of 44; rows 32 and 31 on
    the two ranks) with 8-bit moments, a small one and a norm with fp32 moments."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.big = nn.Linear(300, 63)
        self.norm = nn.LayerNorm(63)
        self.out = nn.Linear(63, 1)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.big(x))))


def optimizer(model, projection=None):
    """Every tensor unprojected (AdamW on 8-bit moments), or the big weight's rows or
    columns subset (half of them) with 8-bit compact moments beside the others' AdamW."""
    if projection is None:
        return fk.FRUGAL([{"params": list(model.parameters()), "projected": False}], lr=1e-2,
                         weight_decay=0.1, state_dtype="int8")
    rest = [p for p in model.parameters() if p is not model.big.weight]
    return fk.FRUGAL([{"params": [model.big.weight]}, {"params": rest, "projected": False}],
                     lr=1e-2, weight_decay=0.1, density=0.5, projection=projection,
                     update_gap=100, seed=3, state_dtype="int8")


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 300, generator=gen), torch.randn(BATCH, 1, generator=gen))
            for _ in range(STEPS)]


def train(model, opt, start, stop, rank=0, world=1):
    per_rank = BATCH // world
    for x, y in batches()[start:stop]:
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def whole(sd):
    from torch.distributed.tensor import DTensor
    if isinstance(sd, DTensor):
        return sd.full_tensor()
    if isinstance(sd, dict):
        return {k: whole(v) for k, v in sd.items()}
    # A copy: a step count is a view of the counters the next step adds to.
    return sd.clone() if isinstance(sd, torch.Tensor) else sd


def params_of(model):
    from torch.distributed.tensor import DTensor
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in model.parameters()]


def _rank(rank, world, init_method, out, projection):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded(seed):
        model = Net(seed)
        fully_shard(model.big, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    results = {}
    model = sharded(0)
    opt = optimizer(model, projection)
    train(model, opt, 0, CUT, rank, world)
    save(model, opt, os.path.join(out, "two"))
    results["at_cut"] = whole(opt.state_dict()["state"])
    st = opt.state[model.big.weight]
    results["local"] = {k: (v.dtype, tuple(v.shape)) for k, v in st.items()}
    results["local_k"] = st["indices"].numel() if "indices" in st else None
    train(model, opt, CUT, STEPS, rank, world)
    results["params"] = params_of(model)
    # 1 -> 2: the test process saved after CUT steps; the loaded state is its state.
    model = sharded(5)
    opt = optimizer(model, projection)
    load(model, opt, os.path.join(out, "one"))
    results["loaded_from_one"] = whole(opt.state_dict()["state"])
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    end_rank()


@pytest.fixture(scope="module", params=[None, "rows", "columns"],
                ids=["unprojected", "rows", "columns"])
def runs(request, tmp_path_factory):
    projection = request.param
    out = str(tmp_path_factory.mktemp("int8"))
    model = Net()
    opt = optimizer(model, projection)
    train(model, opt, 0, CUT)
    single = {"state": {k: {n: t.clone() for n, t in v.items()}
                        for k, v in opt.state_dict()["state"].items()}}
    save(model, opt, os.path.join(out, "one"))
    train(model, opt, CUT, STEPS)
    single["params"] = params_of(model)
    mp.spawn(_rank, args=(2, rendezvous(out), out, projection), nprocs=2, join=True)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
    return out, single, ranks, projection


def test_each_rank_holds_the_codes_and_scales_of_its_rows(runs):
    _, _, ranks, projection = runs
    for rank, rows in zip(ranks, (32, 31)):
        local = rank["local"]
        # Its rows (unprojected), its member rows (rows: the subset's ids in its rows),
        # or its rows of the 150 member columns.
        codes = {None: (rows, 300), "rows": (rank["local_k"], 300),
                 "columns": (rows, 150)}[projection]
        per_row = 1 if projection == "columns" else 2
        assert local["exp_avg"] == (torch.int8, codes)
        assert local["exp_avg_sq"] == (torch.uint8, codes)
        assert local["exp_avg_scale"] == local["exp_avg_sq_scale"] == \
            (torch.float32, (codes[0], per_row))
    if projection == "rows":
        assert 0 < ranks[0]["local_k"] < 32 and 0 < ranks[1]["local_k"] < 31


def test_two_ranks_step_as_one_process(runs):
    _, single, ranks, _ = runs
    for a, b, c in zip(ranks[0]["params"], ranks[1]["params"], single["params"]):
        assert torch.equal(a, b)
        # The reduction of the gradients over two halves rounds otherwise.
        assert fraction_apart(a, c, tol=1e-4) <= 0.01


def test_a_checkpoint_of_one_process_loads_on_two_ranks_bit_for_bit(runs):
    _, single, ranks, _ = runs
    for rank in ranks:
        loaded = rank["loaded_from_one"]
        assert loaded.keys() == single["state"].keys()
        for pid, st in single["state"].items():
            for key, value in st.items():
                assert loaded[pid][key].dtype == value.dtype
                assert torch.equal(loaded[pid][key], value), (pid, key)


def test_a_checkpoint_of_two_ranks_loads_in_one_process_bit_for_bit(runs):
    out, _, ranks, projection = runs
    model = Net(5)
    opt = optimizer(model, projection)
    load(model, opt, os.path.join(out, "two"))
    mine = opt.state_dict()["state"]
    saved = ranks[0]["at_cut"]
    assert mine.keys() == saved.keys()
    for pid, st in saved.items():
        for key, value in st.items():
            assert mine[pid][key].dtype == value.dtype
            assert torch.equal(mine[pid][key], value), (pid, key)
    assert mine[0]["exp_avg"].dtype == torch.int8
    want = {None: (63, 2), "rows": (len(mine[0].get("indices", ())), 2),
            "columns": (63, 1)}[projection]
    assert tuple(mine[0]["exp_avg_scale"].shape) == want
