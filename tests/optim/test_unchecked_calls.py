"""The plans' checked-once op calls (frugal_kernels.ops.unchecked) against the registered ops.

After a bucket's first call, the optimizers call the ops' bodies directly; these
tests hold that path to bit-identical results with the registered ops, for every
projection and CPU backend, across subspace changes, and hold that a param whose
tensor was replaced sends the bucket back through the checked call."""

from __future__ import annotations

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels import ops
from frugal_kernels.optim import plan

from .helpers import HYPER, grad_sequence, groups, make_params, run

PROJECTIONS = ("blocks", "columns", "rows", "randk", "random", "svd")
BACKENDS = ops.usable_backends("cpu")


def _optimizer(projection, backend, state_free, dtype=torch.float32, ada=False):
    proj, reg = make_params(dtype=dtype)
    options = dict(HYPER, density=0.5, update_gap=3, projection=projection,
                   state_free=state_free, backend=backend, seed=3)
    if ada:
        del options["density"]
        opt = fk.AdaFRUGAL(groups(proj, reg), rho_start=0.5, rho_end=0.25, rho_steps=6,
                           **options)
    else:
        opt = fk.FRUGAL(groups(proj, reg), **options)
    return opt, proj + reg


def _trajectory(monkeypatch, checked_only, **kwargs):
    """Params and moments after 8 steps (subspace changes at steps 1, 4 and 7)."""
    with monkeypatch.context() as m:
        calls = []
        faces = ops if checked_only else plan.unchecked
        m.setattr(plan, "unchecked", _Counting(faces, calls))
        opt, params = _optimizer(**kwargs)
        run(opt, params, grad_sequence(params, 8))
    state = [t.clone() for p in params for t in opt.state[p].values()
             if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params], state, calls


class _Counting:
    """The op faces of ``module``, counting the calls that reach them."""

    def __init__(self, module, calls):
        self._module, self._calls = module, calls

    def __getattr__(self, name):
        if name.startswith("prepare_"):
            return self._prepare(name[len("prepare_"):])
        return self._counted(name, getattr(self._module, name))

    def _counted(self, name, face):
        def call(*args, **kwargs):
            self._calls.append(name)
            return face(*args, **kwargs)
        return call

    def _prepare(self, op):
        """A prepared call (its tensors once, gradients and scalars at each call). The
        registered ops have none: their counterpart is the op over the same tensors."""
        def prepare(params, *rest, backend, **static):
            made = getattr(self._module, f"prepare_{op}", None)
            if made is not None:
                return self._counted(op, made(params, *rest, backend=backend, **static))
            face = getattr(self._module, op)
            return self._counted(op, lambda grads, **kwargs: face(
                params, grads, *rest, backend=backend, **static, **kwargs))
        return prepare


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("state_free", ["sign", "sgd"])
def test_unchecked_calls_are_bit_identical(monkeypatch, backend, projection, state_free):
    ref_params, ref_state, _ = _trajectory(monkeypatch, True, projection=projection,
                                           backend=backend, state_free=state_free)
    params, state, calls = _trajectory(monkeypatch, False, projection=projection,
                                       backend=backend, state_free=state_free)
    assert calls, "the steady steps never took the unchecked calls"
    for a, b in zip(ref_params + ref_state, params + state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [
    dict(projection="columns", backend="cpu", state_free="sign", dtype=torch.bfloat16),
    dict(projection="columns", backend="cpu", state_free="sign", dtype=torch.float16),
    dict(projection="blocks", backend="cpu", state_free="sign", ada=True),
], ids=["bf16", "fp16", "adafrugal"])
def test_unchecked_calls_are_bit_identical_in_half_precision_and_adafrugal(monkeypatch, kwargs):
    ref_params, ref_state, _ = _trajectory(monkeypatch, True, **kwargs)
    params, state, calls = _trajectory(monkeypatch, False, **kwargs)
    assert calls, "the steady steps never took the unchecked calls"
    for a, b in zip(ref_params + ref_state, params + state):
        assert torch.equal(a, b)


def test_a_replaced_param_goes_back_through_the_checked_call(monkeypatch):
    opt, params = _optimizer("columns", "cpu", "sign")
    seq = grad_sequence(params, 3)
    run(opt, params, seq[:2])
    bucket = next(b for b in opt._plan if any(q is params[0] for q in b.params))
    assert bucket.checked is not None
    checked = []
    original = ops.frugal_step_

    def counting(*args, **kwargs):
        checked.append("frugal_step_")
        original(*args, **kwargs)
    monkeypatch.setattr(ops, "frugal_step_", counting)
    with torch.no_grad():
        params[0].data = params[0].data.clone()  # same shape, another storage
    run(opt, params, seq[2:])
    assert "frugal_step_" in checked
    assert bucket.checked == plan.signature(bucket.params)


def test_a_param_replaced_by_one_of_another_shape_raises_before_writing():
    opt, params = _optimizer("columns", "cpu", "sign")
    run(opt, params, grad_sequence(params, 2))
    with torch.no_grad():
        params[0].data = torch.zeros(params[0].shape[0] + 1, params[0].shape[1])
    params[0].grad = torch.ones_like(params[0])
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    assert torch.equal(before[0], params[0].detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_badams_unchecked_calls_are_bit_identical(monkeypatch, dtype):
    """BAdam's active block goes through the plan: its prepared calls after a block's first
    equal the registered op over 8 steps and two switches, on fp32 params and on bf16
    ones (the adamw_master rule: AdamW on fp32 master copies)."""
    def trajectory(checked_only):
        with monkeypatch.context() as m:
            calls = []
            m.setattr(plan, "unchecked",
                      _Counting(ops if checked_only else plan.unchecked, calls))
            gen = torch.Generator().manual_seed(0)
            named = [(f"layers.{i}.{name}",
                      torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype)))
                     for i in range(2) for name, shape in (("weight", (6, 5)), ("bias", (6,)))]
            opt = fk.BAdam(named, switch_every=3, switch_mode="ascending", **HYPER)
            for _ in range(8):
                for _, p in named:
                    p.grad = (torch.randn(p.shape, generator=gen).to(dtype)
                              if p.requires_grad else None)
                opt.step()
            state = [t.clone() for st in opt.state.values() for t in st.values()]
        return [p.detach().clone() for _, p in named], state, calls

    ref_params, ref_state, _ = trajectory(True)
    params, state, calls = trajectory(False)
    assert calls, "the steady steps never took the unchecked calls"
    assert ref_state and len(ref_state) == len(state)
    for a, b in zip(ref_params + ref_state, params + state):
        assert torch.equal(a, b)
