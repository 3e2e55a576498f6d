"""Prepared calls (frugal_kernels.ops.prepared) of adamw_, sign_sgd_ and frugal_step_
against the registered ops: the same bits over several calls with new gradients and
scalars, GradScaler's tensors honoured, version counters bumped. The prepared call of
lowrank_adamw_step_ is tested in tests/ops/test_lowrank_adamw_step.py."""

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels._layout import subset_dim, subset_state_shape
from frugal_kernels.ops import unchecked

from .helpers import cpu_backends, make_batch

SHAPES = [(9, 7), (0, 5), (16,), (3, 4, 5)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ADAMW = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _grads(params, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(dtype) for p in params]


def _subsets(params, kind):
    """Every other row, column or coordinate of each param, and the moments' shapes."""
    ids = [torch.arange(0, subset_dim(p, kind), 2, dtype=torch.int32) for p in params]
    shapes = [subset_state_shape(p, kind, i.numel()) for p, i in zip(params, ids)]
    return ids, shapes


def _case(op, dtype, kind=None):
    """(tensors the prepared call holds, the op's extra keywords, its hyper-parameters)."""
    if op == "adamw_":
        p, _, m, v = make_batch(SHAPES, dtype)
        return (p, m, v), {}, ADAMW
    if op == "sign_sgd_":
        p, _, _, _ = make_batch(SHAPES, dtype)
        return (p,), {}, dict(weight_decay=0.1, scale=0.5)
    shapes = [s for s in SHAPES if len(s) >= 2] if kind != "flat" else SHAPES
    p, _, _, _ = make_batch(shapes, dtype)
    ids, state_shapes = _subsets(p, kind)
    _, _, m, v = make_batch(shapes, dtype, state_shapes=state_shapes)
    return (p, m, v, ids), {"kind": kind}, dict(ADAMW, state_free="sign", state_free_scale=0.5)


CASES = [("adamw_", None), ("sign_sgd_", None), ("frugal_step_", "rows"),
         ("frugal_step_", "columns"), ("frugal_step_", "flat")]


def _call_op(op, tensors, grads, static, hyper, backend):
    """The registered op on ``tensors`` (params first) with ``grads``."""
    params, *rest = tensors
    getattr(ops, op)(params, grads, *rest, backend=backend, **static, **hyper)


def _prepare(op, tensors, static, backend):
    return getattr(unchecked, f"prepare_{op}")(*tensors, backend=backend, **static)


def _scalars(op, step):
    lr = torch.tensor(2.0**-7)
    return dict(lr=lr) if op == "sign_sgd_" else dict(lr=lr, step=torch.tensor(float(step)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,kind", CASES, ids=[f"{o}{k or ''}" for o, k in CASES])
@pytest.mark.parametrize("backend", cpu_backends())
def test_a_prepared_call_gives_the_ops_bits_over_calls(backend, op, kind, dtype):
    if backend not in ops.CAPABILITIES[f"frugal::{op}"]:
        pytest.skip(f"{op} has no {backend} backend")
    tensors, static, hyper = _case(op, dtype, kind)
    theirs = [[t.clone() for t in lst] for lst in tensors]
    prepared = _prepare(op, tensors, static, backend)
    for step in range(1, 5):
        grads = _grads(tensors[0], dtype, seed=step)
        prepared(grads, **hyper, **_scalars(op, step))
        _call_op(op, theirs, grads, static, dict(hyper, **_scalars(op, step)), backend)
    for ours, want in zip(tensors, theirs):
        for a, b in zip(ours, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("op,kind", CASES, ids=[f"{o}{k or ''}" for o, k in CASES])
def test_a_prepared_call_unscales_skips_on_found_inf_and_counts_versions(op, kind):
    tensors, static, hyper = _case(op, torch.float32, kind)
    want = [[t.clone() for t in lst] for lst in tensors]
    written = [t for lst in tensors[:3] for t in lst]  # params and moments, not ids
    before = [t.clone() for t in written]
    versions = [t._version for t in written]
    prepared = _prepare(op, tensors, static, "cpu")
    grads = _grads(tensors[0], torch.float32, seed=3)
    scaled = [g * 1024 for g in grads]
    amp = dict(hyper, grad_scale=torch.tensor(1024.0), **_scalars(op, 1))
    prepared(scaled, found_inf=torch.tensor(1.0), **amp)
    assert all(torch.equal(a, b) for a, b in zip(written, before))
    prepared(scaled, found_inf=torch.tensor(0.0), **amp)
    assert all(t._version > n for t, n in zip(written, versions))
    _call_op(op, want, grads, static, dict(hyper, **_scalars(op, 1)), "cpu")
    for ours, theirs in zip(tensors, want):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_a_prepared_call_refuses_a_bad_lr_before_writing():
    p, _, m, v = make_batch(SHAPES, torch.float32)
    prepared = unchecked.prepare_adamw_(p, m, v, backend="cpu")
    before = [t.clone() for t in p + m + v]
    with pytest.raises(ValueError, match="lr must be finite"):
        prepared(_grads(p, torch.float32, 0), lr=torch.tensor(float("nan")),
                 step=torch.tensor(1.0), **ADAMW)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, before))


def test_a_prepared_call_over_no_tensors_does_nothing():
    prepared = unchecked.prepare_frugal_step_([torch.zeros(0, 3)], [torch.zeros(0, 2)],
                                              [torch.zeros(0, 2)],
                                              [torch.tensor([0, 2], dtype=torch.int32)],
                                              kind="columns", backend="cpu")
    prepared([torch.zeros(0, 3)], lr=torch.tensor(0.1), step=torch.tensor(1.0), **ADAMW)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,kind", CASES, ids=[f"{o}{k or ''}" for o, k in CASES])
def test_a_prepared_call_on_the_cuda_backend_gives_the_ops_bits(op, kind, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    tensors, static, hyper = _case(op, dtype, kind)
    tensors = tuple([t.cuda() for t in lst] for lst in tensors)
    theirs = [[t.clone() for t in lst] for lst in tensors]
    prepared = _prepare(op, tensors, static, "cuda")
    for step in range(1, 5):
        grads = [g.cuda() for g in _grads(tensors[0], dtype, seed=step)]
        prepared(grads, **hyper, **_scalars(op, step))
        _call_op(op, theirs, grads, static, dict(hyper, **_scalars(op, step)), "cuda")
    for ours, want in zip(tensors, theirs):
        for a, b in zip(ours, want):
            assert torch.equal(a, b)
