"""The step in backward under DistributedDataParallel: two CPU ranks (gloo).

With ``step_in_backward(opt, ddp=model)`` each tensor is stepped once DDP's all-reduce
of its bucket has completed, with the averaged gradient; the result must equal the
ordinary DDP loop's bit for bit, on every rank (the all-reduce is the same, and so are
the op calls). Buckets are made tiny so that a backward pass reduces several, and both
DDP gradient layouts (``gradient_as_bucket_view``) and accumulation over two
micro-batches (the first under ``no_sync``) are covered. Without ``ddp=``, each rank's
hooks would see its own gradient: refused. FSDP2's parameters (DTensors) are refused.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import frugal_kernels as fk

from .helpers import end_rank, rendezvous
from .test_ddp import BATCH, model

STEPS = 5
CONFIGS = [("FRUGAL", "blocks"), ("FRUGAL", "svd"), ("AdaFRUGAL", "columns"), ("AdamW", "")]
LAYOUTS = [False, True]  # gradient_as_bucket_view
ACCUMULATION = [1, 2]


def optimizer(kind, projection, m):
    groups = [{"params": [p for p in m.parameters() if p.dim() >= 2]},
              {"params": [p for p in m.parameters() if p.dim() < 2], "projected": False}]
    if kind == "FRUGAL":
        return fk.FRUGAL(groups, lr=1e-2, density=0.5, projection=projection, update_gap=2,
                         seed=7, nonfinite="raise")
    if kind == "AdaFRUGAL":
        return fk.AdaFRUGAL(groups, lr=1e-2, rho_start=0.5, rho_end=0.2, rho_steps=STEPS,
                            update_gap=2, projection=projection, seed=7, nonfinite="raise")
    return fk.swap(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))


def micro_batches(k):
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 4, generator=gen))
             for _ in range(k)] for _ in range(STEPS)]


def train(config, bucket_view, k, rank, world, in_backward):
    ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.0005,
                                              gradient_as_bucket_view=bucket_view)
    opt = optimizer(*config, ddp.module)
    handle = fk.step_in_backward(opt, accumulation_steps=k, ddp=ddp) if in_backward else None
    where = []  # of each tensor's update: inside DDP's communication hook or not
    if handle is not None:
        tensor_steps = handle._tensor_steps
        step_tensor = tensor_steps.step_tensor

        def recorded(p):
            where.append(any(f.name == "_ddp_comm_hook" for f in traceback.extract_stack()))
            step_tensor(p)
        tensor_steps.step_tensor = recorded
    per_rank = BATCH // world
    grads_left = False
    for step in micro_batches(k):
        for j, (x, y) in enumerate(step):
            xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            sync = ddp.no_sync() if j < k - 1 else contextlib.nullcontext()
            with sync:
                loss = nn.functional.mse_loss(ddp(xs), ys) / k
                loss.backward()
        grads_left |= any(p.grad is not None for p in ddp.module.parameters())
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in ddp.module.parameters()],
            "steps": handle.steps if handle else STEPS, "grads_left": grads_left,
            "in_comm_hook": where}


def _rank(rank, world, init_method, out):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for config in CONFIGS:
        for bucket_view in LAYOUTS:
            for k in ACCUMULATION:
                name = f"{config[0]}-{config[1]}-view{int(bucket_view)}-k{k}"
                results[name] = {
                    "ordinary": train(config, bucket_view, k, rank, world, False),
                    "in_backward": train(config, bucket_view, k, rank, world, True)}
    # Without ddp=, the hooks would see this rank's own gradient: refused.
    try:
        fk.step_in_backward(optimizer("FRUGAL", "blocks", model()))
        results["refused"] = ""
    except ValueError as e:
        results["refused"] = str(e)
    # handle.remove() under DDP: DDP keeps the comm hook, which then all-reduces only.
    ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.0005)
    opt = optimizer("AdamW", "", ddp.module)
    fk.step_in_backward(opt, ddp=ddp).remove()
    x, y = micro_batches(1)[0][0]
    per_rank = BATCH // world
    nn.functional.mse_loss(ddp(x[rank * per_rank:(rank + 1) * per_rank]),
                           y[rank * per_rank:(rank + 1) * per_rank]).backward()
    results["after_remove_grads"] = [p.grad.clone() for p in ddp.module.parameters()]
    plain = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.0005)
    nn.functional.mse_loss(plain(x[rank * per_rank:(rank + 1) * per_rank]),
                           y[rank * per_rank:(rank + 1) * per_rank]).backward()
    results["plain_grads"] = [p.grad.clone() for p in plain.module.parameters()]
    results["fsdp2"] = _fsdp2_refusal()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    end_rank()


def _fsdp2_refusal() -> str:
    """What step_in_backward says to FSDP2's sharded parameters (DTensors)."""
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as e:
        return f"unavailable: {e}"
    m = model()
    fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = fk.swap(torch.optim.AdamW(m.parameters(), lr=1e-2))
    try:
        fk.step_in_backward(opt)
    except ValueError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp_in_backward"))
    mp.spawn(_rank, args=(2, rendezvous(out), out), nprocs=2, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]


NAMES = [f"{c[0]}-{c[1]}-view{int(v)}-k{k}" for c in CONFIGS for v in LAYOUTS
         for k in ACCUMULATION]


@pytest.mark.parametrize("name", NAMES)
def test_equals_the_ordinary_ddp_loop_on_every_rank(two_ranks, name):
    for rank in two_ranks:
        ordinary, in_backward = rank[name]["ordinary"], rank[name]["in_backward"]
        assert in_backward["steps"] == STEPS
        # Every update ran inside DDP's communication hook, after its bucket's all-reduce,
        # and left no gradient behind (the ordinary loop holds them all).
        params = len(in_backward["params"])
        assert in_backward["in_comm_hook"] == [True] * (STEPS * params)
        assert not in_backward["grads_left"] and ordinary["grads_left"]
        for a, b in zip(in_backward["params"], ordinary["params"]):
            assert torch.equal(a, b), name
    for a, b in zip(two_ranks[0][name]["in_backward"]["params"],
                    two_ranks[1][name]["in_backward"]["params"]):
        assert torch.equal(a, b), name


def test_more_than_one_rank_without_ddp_is_refused(two_ranks):
    for rank in two_ranks:
        assert "pass ddp=" in rank["refused"]


def test_after_remove_ddp_reduces_as_before(two_ranks):
    for rank in two_ranks:
        for a, b in zip(rank["after_remove_grads"], rank["plain_grads"]):
            assert torch.equal(a, b)


def test_fsdp2_parameters_are_refused(two_ranks):
    message = two_ranks[0]["fsdp2"]
    if message.startswith("unavailable"):
        pytest.skip(message)
    assert "DTensor" in message
