"""pytest-benchmark hooks for the op microbenchmarks.

Marked ``benchmark`` and deselected by default (pyproject's addopts); run with
``python -m pytest -m benchmark tests/bench``. Benchmarks are not timed tests:
they assert nothing about speed. ``frugal-kernels bench`` is the full sweep
with ratios measured side by side.
"""

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels.bench.ops import _FACTORIES, param_set

pytestmark = pytest.mark.benchmark

NUMEL = 1 << 22


def _cases():
    backends = [b for b in ops.usable_backends("cpu") if b != "triton"]
    params = []
    for name in _FACTORIES:
        for backend in backends:
            if backend in ops.CAPABILITIES["frugal::" + name]:
                params.append(pytest.param(name, backend, id=f"{name}-{backend}"))
    return params


@pytest.mark.parametrize("op,backend", _cases())
def test_op(benchmark, op, backend):
    tensors = param_set(NUMEL, torch.float32, torch.device("cpu"))
    for case in _FACTORIES[op](tensors, torch.float32, 0.25):
        run = case.run(backend)
        benchmark.extra_info.update(variant=case.variant, bytes=case.bytes)
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
        break  # one variant per test keeps the timing table readable


def test_torch_adamw_fused(benchmark):
    tensors = [torch.nn.Parameter(t) for t in param_set(NUMEL, torch.float32, torch.device("cpu"))]
    for t in tensors:
        t.grad = torch.randn_like(t)
    opt = torch.optim.AdamW(tensors, fused=True)
    benchmark.pedantic(opt.step, rounds=5, warmup_rounds=1)
