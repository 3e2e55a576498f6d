"""FRUGAL, AdaFRUGAL and BAdam (AdamW or FRUGAL inside) under FSDP2 (``fully_shard``):
two CPU ranks (gloo) against one process on the same global batch, and
torch.distributed.checkpoint across 2 -> 2, 2 -> 1 and 1 -> 2 ranks.

Under FSDP2 every parameter is a DTensor sharded on dim 0 and the optimizer steps
each rank's rows; the subspace is chosen on the global shape from the optimizer's
generator, the same on every rank. So the ranks together must step as one process
on the whole batch would, but for the rounding of the gradients' reduction (a sum
over two halves): sign-based updates may flip where a gradient is near zero
(DESIGN.md section 6), and the comparisons count the coordinates that moved apart.

One spawn of two ranks runs every configuration (starting processes is the slow
part); the single-process runs and checkpoints are made in the test process.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import frugal_kernels as fk
from frugal_kernels.optim.subspace_choice import PROJECTIONS

from .helpers import end_rank, fraction_apart, load, rendezvous, save

STEPS = 6
CUT = 3  # checkpoints are taken after CUT steps
BATCH = 8  # global; each of the two ranks takes half
# The first rank's is the last layer's whole weight: the second rank's block is empty.
CONFIGS = [f"FRUGAL-{p}" for p in PROJECTIONS] + ["AdaFRUGAL-rows", "AdaFRUGAL-svd", "BAdam",
                                                   "BAdam-frugal"]
# Those stepped once more with a NaN on one rank (nonfinite="skip", the default), and a
# torch AdamW swapped onto the fused ops (swap's default is the same).
SKIP_CONFIGS = ["FRUGAL-columns", "FRUGAL-svd", "BAdam", "swap-AdamW"]


class Net(nn.Module):
    """Shapes that cover both low-rank sides, uneven shards (5 rows over two ranks) and an
    empty one (1 row); ``layers.N`` names for BAdam's blocks."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 12), nn.Linear(12, 5),
                                     nn.Linear(5, 1)])
        self.norm = nn.LayerNorm(12)

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        x = self.norm(self.layers[1](x))
        return self.layers[3](torch.tanh(self.layers[2](x)))


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(name, model):
    kind, _, projection = name.partition("-")
    if kind == "BAdam":
        # The last block mixes the norm with the one-row weight, whose rows all lie on the
        # first rank; layers.3.bias stays frozen.
        blocks = [[f"layers.{i}.weight", f"layers.{i}.bias"] for i in range(3)]
        blocks.append(["norm.weight", "norm.bias", "layers.3.weight"])
        # BAdam-frugal: a FRUGAL (rows, new subsets every step) trains the active block.
        inner = dict(inner="frugal", projection="rows", density=0.5, update_gap=1) \
            if projection == "frugal" else {}
        return fk.BAdam(model, lr=1e-2, switch_every=2, switch_mode="random", blocks=blocks,
                        seed=3, **inner)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "projected": False}]
    if kind == "FRUGAL":
        return fk.FRUGAL(groups, lr=1e-2, density=0.5, projection=projection, update_gap=2,
                         seed=7)
    return fk.AdaFRUGAL(groups, lr=1e-2, rho_start=0.6, rho_end=0.2, rho_steps=STEPS,
                        update_gap=2, projection=projection, seed=7)


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 1, generator=gen))
            for _ in range(STEPS)]


def train(model, opt, start, stop, rank=0, world=1):
    per_rank = BATCH // world
    for x, y in batches()[start:stop]:
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def full_params(model):
    return [p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p.detach()
            for p in model.parameters()]


def whole(state_dict):
    """A state dict with every DTensor gathered whole."""
    from torch.distributed.tensor import DTensor

    def full(value):
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, dict):
            return {k: full(v) for k, v in value.items()}
        return value
    return full(state_dict)


class CollectiveCounter:
    """Counts the collectives called while it is on (the optimizers call them through
    torch.distributed, and DTensor's full_tensor for an svd's gradient)."""

    # all_gather_single is new in torch 2.13 (which deprecates all_gather_into_tensor);
    # torch 2.11 has only the latter, so only the names this torch has are wrapped.
    NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather",
             "all_to_all_single", "broadcast")

    def __init__(self):
        self.counts, self.on, self._real = Counter(), False, {}
        for name in self.NAMES:
            if not hasattr(dist, name):
                continue
            real = self._real[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, real))
        from torch.distributed.tensor import DTensor
        self._real["full_tensor"] = real = DTensor.full_tensor
        DTensor.full_tensor = self._wrap("full_tensor", real)

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            if self.on:
                self.counts[name] += 1
            return real(*args, **kwargs)
        return call

    def step(self, opt):
        self.on = True
        try:
            opt.step()
        finally:
            self.on = False


def _rank(rank, world, init_method, out):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    counter = CollectiveCounter()
    results = {}
    for name in CONFIGS:
        # Uninterrupted, counting the collectives of each step.
        model = shard(Net(), mesh)
        opt = optimizer(name, model)
        per_rank = BATCH // world
        steps, state_bytes = [], []
        for x, y in batches():
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            counter.counts.clear()
            counter.step(opt)
            steps.append(dict(counter.counts))
            state_bytes.append(opt.state_bytes())
            opt.zero_grad()
        history = [dict(h) for h in opt.history]
        results[name] = {"params": full_params(model), "history": history,
                         "state_bytes": state_bytes, "collectives": steps,
                         "state_dict": whole(opt.state_dict())}

        # 2 -> 2: save after CUT steps, resume in a fresh model and optimizer.
        model = shard(Net(), mesh)
        opt = optimizer(name, model)
        train(model, opt, 0, CUT, rank, world)
        save(model, opt, os.path.join(out, f"{name}-2"))
        model = shard(Net(seed=5), mesh)
        opt = optimizer(name, model)
        load(model, opt, os.path.join(out, f"{name}-2"))
        train(model, opt, CUT, STEPS, rank, world)
        results[name]["resumed"] = full_params(model)
        results[name]["resumed_history"] = [dict(h) for h in opt.history]

        # 1 -> 2: the test process saved after CUT single-process steps.
        model = shard(Net(seed=5), mesh)
        opt = optimizer(name, model)
        load(model, opt, os.path.join(out, f"{name}-1"))
        train(model, opt, CUT, STEPS, rank, world)
        results[name]["from_one"] = full_params(model)
        results[name]["from_one_history"] = [dict(h) for h in opt.history]

    # A NaN in the second rank's rows only: the ranks agree through a max all-reduce of
    # the flag, on the device, and both skip (the first rank's gradients are finite).
    results["one_rank_nan"] = {}
    for name in SKIP_CONFIGS:
        model = shard(Net(), mesh)
        opt = (fk.swap(torch.optim.AdamW(model.parameters(), lr=1e-2)) if name == "swap-AdamW"
               else optimizer(name, model))
        train(model, opt, 0, 1, rank, world)  # the moments exist
        x, y = batches()[1]
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if rank == 1:
            p = next(p for p in model.parameters()
                     if p.grad is not None and p.grad.to_local().numel())
            p.grad.to_local().view(-1)[0] = float("nan")
        before = _local_tensors(model, opt)
        opt.step()
        results["one_rank_nan"][name] = all(
            torch.equal(a, b) for a, b in zip(before, _local_tensors(model, opt)))

    # swap and from_optimizer on DTensors: a torch AdamW on the fused op, and turned into
    # FRUGAL at density 1 (which continues AdamW), against torch's own AdamW.
    torch_run, swapped, turned = (shard(Net(), mesh) for _ in range(3))
    adamw = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (torch_run, swapped, turned)]
    fk.swap(adamw[1])
    for m, opt in zip((torch_run, swapped, turned), adamw):
        train(m, opt, 0, CUT, rank, world)
    frugal = fk.FRUGAL.from_optimizer(adamw[2], density=1.0, projection="rows")
    for m, opt in zip((torch_run, swapped, turned), (adamw[0], adamw[1], frugal)):
        train(m, opt, CUT, STEPS, rank, world)
    results["swap"] = [full_params(m) for m in (torch_run, swapped, turned)]

    # AdaFRUGAL's loss-aware T with a loss that differs per rank: the rule sees the
    # mean, so the ranks grow T together.
    ada = optimizer("AdaFRUGAL-rows", shard(Net(), mesh))
    for loss in ([1.0, 1.0, 1.0] if rank == 0 else [3.0, 2.0, 1.0]):
        ada.observe_loss(loss)
    results["observe_loss"] = {"update_gap": ada.update_gap,
                               "history": [dict(h) for h in ada.history]}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    end_rank()


def _local_tensors(model, opt):
    """This rank's blocks of the params and every tensor of the optimizer's state (the
    step counts too), cloned."""
    out = [p.to_local().clone() for p in model.parameters()]
    return out + [(v.to_local() if isinstance(v, torch.distributed.tensor.DTensor) else v).clone()
                  for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]


def single(name, start=0, stop=STEPS, path=None, save_to=None, state_bytes=None):
    """One process on the whole batch, from a checkpoint when ``path`` is given."""
    model = Net(seed=0 if path is None else 5)
    opt = optimizer(name, model)
    if path is not None:
        load(model, opt, path)
    for x, y in batches()[start:stop]:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if state_bytes is not None:
            state_bytes.append(opt.state_bytes())
        opt.zero_grad()
    if save_to is not None:
        save(model, opt, save_to)
    return model, opt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp"))
    for name in CONFIGS:
        single(name, 0, CUT, save_to=os.path.join(out, f"{name}-1"))
    mp.spawn(_rank, args=(2, rendezvous(out), out), nprocs=2, join=True)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
    return out, ranks


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_close_run(params, reference, name):
    for a, b in zip(params, reference):
        # Sign flips of near-zero gradients move a coordinate by 2 * lr (0.02).
        assert fraction_apart(a, b.detach()) <= 0.02, name


@pytest.mark.parametrize("name", CONFIGS)
def test_ranks_agree_and_match_one_process(runs, name):
    _, ranks = runs
    rank0, rank1 = ranks[0][name], ranks[1][name]
    # The same subspaces (and blocks) on both ranks, and the same global parameters.
    assert rank0["history"] == rank1["history"]
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)
    model, opt = single(name)
    assert [dict(h) for h in opt.history] == rank0["history"]
    assert_close_run(rank0["params"], model.parameters(), name)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_ranks_hold_one_process_state_between_them(runs, name):
    _, ranks = runs
    _, opt = single(name)
    one = opt.state_dict()
    two = ranks[0][name]["state_dict"]
    # The global form of the ranks' state (gathered whole) is one process's state: the
    # same records and generator, the same subset ids; moments and projections made
    # from gradients that differ in their rounding.
    assert_same(ranks[1][name]["state_dict"]["param_groups"], two["param_groups"])
    assert_same(two["param_groups"], one["param_groups"])
    assert one["state"].keys() == two["state"].keys()
    for pid, st in one["state"].items():
        assert st.keys() == two["state"][pid].keys(), (name, pid)
        for key, value in st.items():
            if key in ("indices", "step"):
                assert torch.equal(value, two["state"][pid][key]), (name, pid, key)
            else:
                torch.testing.assert_close(two["state"][pid][key], value, atol=1e-5,
                                           rtol=1e-3, msg=f"{name} {pid} {key}")


@pytest.mark.parametrize("name", CONFIGS)
def test_each_rank_holds_the_state_of_its_rows(runs, name):
    _, ranks = runs
    one = []
    single(name, state_bytes=one)
    for t, expected in enumerate(one):
        per_rank = [r[name]["state_bytes"][t] for r in ranks]
        # Half each but for what every rank holds whole (the subsets' column ids, a
        # right-side projection, the step counts) and for subsets whose rows fall
        # unevenly between the ranks (FRUGAL-rows: 5 of the 8 rows of the first
        # layer's subset on one rank).
        assert max(per_rank) <= 0.7 * expected, (name, t, per_rank, expected)
        assert sum(per_rank) >= expected, (name, t, per_rank, expected)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.split("-")[-1] in
                                  ("blocks", "columns", "rows", "randk")] + ["BAdam"])
def test_coordinate_and_block_kinds_step_without_gathering(runs, name):
    _, ranks = runs
    for step in ranks[0][name]["collectives"]:
        # The ranks agree on skipping a step with a non-finite gradient (one all-reduce
        # of a flag, FRUGAL's nonfinite="skip"); nothing else is exchanged.
        assert set(step) <= {"all_reduce"} and step.get("all_reduce", 0) <= 1, (name, step)


@pytest.mark.parametrize("name", ["FRUGAL-random", "FRUGAL-svd"])
def test_low_rank_kinds_reduce_the_left_projections(runs, name):
    _, ranks = runs
    steps = ranks[0][name]["collectives"]
    # Three left-side matrices ([12, 16], [5, 12], [1, 5]) each step: an all-reduce of
    # P^T g and an all-gather of the update's chunks; the flag of the non-finite check.
    left = 3
    for t, step in enumerate(steps):
        assert step.get("all_reduce", 0) == left + 1, (name, t, step)
        # The optimizer gathers with all_gather_single where torch has it (2.13), else
        # with all_gather_into_tensor (2.11).
        gathers = step.get("all_gather_single", 0) + step.get("all_gather_into_tensor", 0)
        assert gathers == left, (name, t, step)
        changed = t % 2 == 0  # update_gap=2: new subspaces at steps 1, 3, 5
        # svd: every gradient gathered, and the first rank's projection broadcast.
        expect = 4 if name.endswith("svd") and changed else 0
        assert step.get("full_tensor", 0) == expect, (name, t, step)
        assert step.get("broadcast", 0) == expect, (name, t, step)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_resumes_on_two_ranks(runs, name):
    _, ranks = runs
    for r in ranks:
        # Same ranks: the resumed run is the uninterrupted one, bit for bit.
        assert r[name]["resumed_history"] == r[name]["history"]
        for a, b in zip(r[name]["resumed"], r[name]["params"]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_of_two_ranks_resumes_in_one_process(runs, name):
    out, ranks = runs
    model, opt = single(name, CUT, STEPS, path=os.path.join(out, f"{name}-2"))
    assert [dict(h) for h in opt.history] == ranks[0][name]["history"]
    assert_close_run(list(model.parameters()), single(name)[0].parameters(), name)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_of_one_process_resumes_on_two_ranks(runs, name):
    _, ranks = runs
    model, opt = single(name)
    for r in ranks:
        assert r[name]["from_one_history"] == [dict(h) for h in opt.history]
    assert_close_run(ranks[0][name]["from_one"], model.parameters(), name)


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(runs):
    _, ranks = runs
    for rank, results in enumerate(ranks):
        assert results["one_rank_nan"] == {name: True for name in SKIP_CONFIGS}, rank


def test_swap_and_from_optimizer_on_dtensors_follow_torchs_adamw(runs):
    _, ranks = runs
    reference, swapped, turned = ranks[0]["swap"]
    for a, b, c in zip(reference, swapped, turned):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)


def test_observe_loss_keeps_the_ranks_on_one_schedule(runs):
    _, ranks = runs
    # Alone, rank 0 (a flat loss) would see a plateau and grow T while rank 1 (a falling
    # loss) would not; on the mean (2, 1.5, 1: no plateau) both keep T.
    assert ranks[0]["observe_loss"] == ranks[1]["observe_loss"]
    assert ranks[0]["observe_loss"]["update_gap"] == 2
