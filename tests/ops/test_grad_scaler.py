"""GradScaler's tensors as op arguments: ``grad_scale`` and ``found_inf`` on every op.

torch's fused optimizers take both as tensors and act on them inside the
kernel; ours do the same on every backend. With a ``grad_scale`` the
gradients are unscaled as they are read, bit-identical to unscaling them first
(GradScaler's scales are powers of two); a non-zero ``found_inf`` leaves every
tensor untouched. On the host the op returns at once; on a device the kernels
read it (checked here by handing the backends a found_inf as if it lived on a
device, and on the emulated CUDA grid with device-scalar pointers).
"""

from __future__ import annotations

import pytest
import torch

from frugal_kernels._extension import extension
from frugal_kernels.ops import _spec

from ..op_db import OPS
from .helpers import cpu_backends

SCALE = 1024.0  # a power of two, as GradScaler's


def _rows():
    for op in OPS:
        for backend in cpu_backends(op.qualname):
            yield pytest.param(op, backend.values[0], marks=backend.marks,
                               id=f"{op.name}-{backend.id}")


def _scaled(op, call, factor):
    """The call with every gradient multiplied by ``factor``."""
    args, kwargs = call
    args = list(args)
    args[op.grad_position] = [g * factor for g in args[op.grad_position]]
    return tuple(args), kwargs


def _sample_calls(op, backend):
    sample = op.sample(op.tensor_scalar_sample)
    for dtype in sample.dtypes:
        yield sample, dtype, sample.make(dtype, backend)


@pytest.mark.parametrize("op,backend", list(_rows()))
def test_scaled_gradients_with_their_scale_give_the_unscaled_bits(op, backend):
    for sample, dtype, call in _sample_calls(op, backend):
        want = op.run(op.op, call, sample, backend=backend)
        got = op.run(op.op, _scaled(op, call, SCALE), sample, backend=backend,
                     grad_scale=torch.tensor(SCALE), found_inf=torch.tensor(0.0))
        for name, a, e in zip(op.outputs, got, want):
            for i, (x, y) in enumerate(zip(a, e)):
                assert torch.equal(x, y), f"{name}[{i}] ({dtype})"


def _poisoned(op, call):
    """The call with a NaN and infinities in the gradients, as when found_inf is set."""
    args, kwargs = call
    args = list(args)
    grads = [g.clone() for g in args[op.grad_position]]
    for g in grads:
        if g.numel() >= 3:
            g.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    args[op.grad_position] = grads
    return tuple(args), kwargs


def _assert_untouched(op, call, got):
    args, _ = call
    for name, position, tensors in zip(op.outputs, op.output_positions, got):
        for i, (x, before) in enumerate(zip(tensors, args[position])):
            assert torch.equal(x, before), f"{name}[{i}] changed though found_inf was set"


@pytest.mark.parametrize("op,backend", list(_rows()))
def test_found_inf_on_the_host_leaves_everything_untouched(op, backend):
    for sample, dtype, call in _sample_calls(op, backend):
        call = _poisoned(op, call)
        got = op.run(op.op, call, sample, backend=backend, grad_scale=torch.tensor(SCALE),
                     found_inf=torch.tensor(1.0))
        _assert_untouched(op, call, got)


@pytest.mark.parametrize("op,backend", list(_rows()))
def test_found_inf_read_by_the_backend_leaves_everything_untouched(op, backend, monkeypatch):
    # As if found_inf lived on a device: the op body hands it to the backend, whose
    # kernels (or the reference) must skip the update themselves. Every op's body is
    # its spec's (frugal_kernels.ops._spec).
    monkeypatch.setattr(_spec, "skipped_on_host", lambda found_inf: False)
    for sample, dtype, call in _sample_calls(op, backend):
        call = _poisoned(op, call)
        got = op.run(op.op, call, sample, backend=backend, found_inf=torch.tensor(1.0))
        _assert_untouched(op, call, got)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(2), ValueError, "grad_scale must have one element"),
    (torch.tensor(4), TypeError, "grad_scale must be a floating-point tensor"),
    (4.0, TypeError, "grad_scale must be a tensor or None"),
])
def test_a_bad_grad_scale_raises_and_changes_nothing(op, bad, error, match):
    sample = op.sample(op.tensor_scalar_sample)
    call = sample.make(torch.float32, "torch")
    args, kwargs = call
    copies = [[t.clone() for t in args[i]] for i in op.output_positions]
    with pytest.raises(error, match=match):
        op.op(*args, **kwargs, **({"step": 1} if op.counts_steps else {}), grad_scale=bad)
    for i, before in zip(op.output_positions, copies):
        for t, b in zip(args[i], before):
            assert torch.equal(t, b)


# ---------------------------------------------------------------- the emulated CUDA grid

_C = extension()
needs_extension = pytest.mark.skipif(_C is None, reason="compiled extension not built")


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_cuda_kernels_read_grad_scale_and_found_inf_on_the_device(dtype):
    from frugal_kernels.ops._common import kernel_batch

    gen = torch.Generator().manual_seed(0)
    n = 40_000  # more than one block
    p = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(n, generator=gen).to(dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    scale = torch.tensor(SCALE, dtype=torch.float32)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2.0,
                 maximize=False, found_inf=0.0)

    def adamw(grads, grad_scale, pointers):
        out = [p.clone(), m.clone(), v.clone()]
        _C.adamw_cuda_emulated(kernel_batch(_C, [out[0]], [grads], [out[1]], [out[2]]),
                               _C.AdamWHyper(**hyper, grad_scale=grad_scale),
                               _C.DeviceScalars(**pointers))
        return out

    want = adamw(g, 1.0, {})
    # The value beside the pointer is junk, as the ops layer passes for device scalars.
    got = adamw(g * SCALE, 0.0, {"grad_scale": scale.data_ptr()})
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    found = torch.tensor(1.0)
    skipped = adamw(g, 1.0, {"found_inf": found.data_ptr()})
    for a, b in zip(skipped, [p, m, v]):
        assert torch.equal(a, b)

    out = p.clone()
    _C.sign_sgd_cuda_emulated(kernel_batch(_C, [out], [g]),
                              _C.SignSgdHyper(lr=1e-2, weight_decay=0.1, scale=1.0,
                                              grad_scale=1.0, found_inf=0.0),
                              _C.DeviceScalars(found_inf=found.data_ptr()))
    assert torch.equal(out, p)
