"""A steady-state step captured in a CUDA graph and replayed equals the eager step.

A steady-state step (between subspace changes, block switches and rho changes)
reads no tensor on the host (tests/optim/test_no_host_sync.py) and launches the
cuda backend's kernels with their tensors' addresses and host scalars as
arguments, so it can be captured once and replayed with new gradients copied
into the captured gradient tensors. What the host does in a step (the
schedules, a new plan) is not replayed: a replay is a steady step only, and a
float lr is the one of the captured step (give lr as a CUDA tensor to change it
between replays). The random and svd projections' weight update runs in Triton
on a GPU (lowrank_step_), launched per tensor with host scalars as arguments:
captured too. Two steps refuse a capture with a clear error instead of
recording something a replay would get wrong: a Triton launch with a launch
table copied from host memory (sgd_, which a swapped SGD calls; any Triton op
given a device lr), and DQT, whose stochastic rounding draws by a host-side
counter.

GPU only (``pytest -m gpu`` on a GPU machine); the CPU has no graphs to capture.
"""

from __future__ import annotations

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels.nn import QuantLinear

from ..optim_db import OPTIMIZERS
from .helpers import HYPER, grad_sequence

pytestmark = pytest.mark.gpu

WARMUP, REPLAYS = 3, 4
# Options that keep every step after the first a steady one.
STEADY = {"FRUGAL": {"update_gap": 10**6},
          "AdaFRUGAL": {"update_gap": 10**6, "update_gap_max": 10**6, "rho_end": 0.5},
          "BAdam": {"switch_every": 10**6},
          "BAdam-frugal": {"switch_every": 10**6, "update_gap": 10**6},
          "BAdam-frugal-int8": {"switch_every": 10**6, "update_gap": 10**6}}


def _steady(info) -> dict:
    return STEADY.get(info.name, STEADY.get(info.name.split("-")[0]))


CAPTURED = [info for info in OPTIMIZERS if _steady(info) is not None]


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")


def _on_cuda(info):
    """The entry's optimizer over its parameters moved to the GPU (before it is built)."""
    inputs, params = info.make_model(0)
    with torch.no_grad():
        for p in params:
            p.data = p.data.cuda()
    return info.factory(inputs, **_steady(info)), params


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _state(opt, params):
    return [p.detach().clone() for p in params] + [
        t.clone() for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]


def _capture(opt, params, warmup_grads):
    """Warm ``opt`` up on a side stream (plans built, calls prepared), then capture one
    step reading the gradients from static tensors; returns the graph and those tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for grads in warmup_grads:
            _set(params, grads)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    static = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static):
        p.grad = g
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph, static


def _replayed_equals_eager(eager, e_params, captured, c_params):
    seq = [[g.cuda() for g in grads] for grads in grad_sequence(e_params, WARMUP + REPLAYS)]
    for grads in seq[:WARMUP]:
        _set(e_params, grads)
        eager.step()
    graph, static = _capture(captured, c_params, seq[:WARMUP])
    for grads in seq[WARMUP:]:
        for buffer, g in zip(static, grads):
            buffer.copy_(g)
        graph.replay()
        _set(e_params, grads)
        eager.step()
        torch.cuda.synchronize()
        for a, b in zip(_state(captured, c_params), _state(eager, e_params)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("info", CAPTURED, ids=lambda info: info.name)
def test_a_captured_steady_step_replays_as_the_eager_one(info):
    eager, e_params = _on_cuda(info)
    captured, c_params = _on_cuda(info)
    _replayed_equals_eager(eager, e_params, captured, c_params)


def test_a_swapped_adamw_replays_as_the_eager_one():
    """fused=True: torch's AdamW keeps its step counts on the GPU then (without it they
    live on the host, and the swapped step refuses the capture: tests/optim/test_swap.py).
    The first GPU run (bench/results/gpu-check-h200.md) found the replay of an AdamW
    without it 2e-4 off the eager step."""
    def build():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda())
                  for s in [(24, 40), (40,), (7,)]]
        return fk.swap(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)), params

    (eager, e_params), (captured, c_params) = build(), build()
    _replayed_equals_eager(eager, e_params, captured, c_params)


def test_a_triton_launch_table_refuses_the_capture():
    """A swapped SGD steps through sgd_, which has no cuda backend: its Triton kernel
    takes a launch table copied from host memory."""
    params = [torch.nn.Parameter(torch.randn(24, 40, device="cuda"))]
    opt = fk.swap(torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    grads = [[torch.randn_like(p) for p in params] for _ in range(WARMUP)]
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _capture(opt, params, grads)


def test_dqt_refuses_the_capture():
    layer = QuantLinear(16, 8, bits=4, seed=1).cuda()
    opt = fk.DQT(layer.parameters(), **HYPER)
    params = list(layer.parameters())
    grads = [[torch.randn_like(p) for p in params] for _ in range(WARMUP)]
    with pytest.raises(RuntimeError, match="draws random numbers"):
        _capture(opt, params, grads)
