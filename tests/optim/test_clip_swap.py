"""``clip_grad_norm_`` on torch optimizers swapped by ``frugal_kernels.swap``.

The swap gives the instance the step engine's clip: the step after it equals clipping
the gradients first (``g *= factor``, torch's factor from the norm returned) and taking
the swapped step, to the bit, for AdamW, Adam (L2 decay) and SGD; torch's own clip and
step agree within the swap's stated tolerance; a non-finite gradient skips the step with
params, state and step counts untouched; the clip applies to the next step only, and
``swap(undo=True)`` takes the method away.
"""

import math

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels import ops, swap

from .test_swap import (CONFIGS, COORDINATE_TOL, assert_close_coordinatewise, make_optimizer,
                        make_params, set_grads)

STEPS = 6


def big_grads(params, k):
    """Step k's gradients of test_swap, made large enough that the clip bites."""
    set_grads(params, k)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(20)


def snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            {id(p): {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for p in params if p in opt.state})


def assert_bits(a, b):
    pa, sa = a
    pb, sb = b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"params[{i}]"
    assert [list(s) for s in sa.values()] == [list(s) for s in sb.values()]
    for sx, sy in zip(sa.values(), sb.values()):
        for name in sx:
            assert torch.equal(sx[name], sy[name]), name


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2", "inf"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_clip_then_step_equals_clipping_first(name, norm_type):
    params, params_b, ref_params = make_params(), make_params(), make_params()
    opt = swap(make_optimizer(name, params))
    manual = swap(make_optimizer(name, params_b))
    ref = make_optimizer(name, ref_params)
    for k in range(STEPS):
        big_grads(params, k)
        norm = opt.clip_grad_norm_(1.0, norm_type=norm_type)
        opt.step()
        big_grads(params_b, k)
        factor = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        for p in params_b:
            if p.grad is not None:
                p.grad.mul_(factor)
        manual.step()
        big_grads(ref_params, k)
        live = [p for p in ref_params if p.grad is not None]
        want = torch.nn.utils.clip_grad_norm_(live, 1.0, norm_type=norm_type)
        assert norm.item() == pytest.approx(want.item(), rel=1e-5)
        ref.step()
        assert_bits(snapshot(opt, params), snapshot(manual, params_b))
    assert_close_coordinatewise(opt, params, ref, ref_params, *COORDINATE_TOL[name])


@pytest.mark.parametrize("name", ["adamw", "adam-l2", "sgd-momentum"])
def test_a_non_finite_gradient_after_a_clip_skips_the_step(name, monkeypatch):
    params = make_params()
    opt = swap(make_optimizer(name, params))
    big_grads(params, 1)  # every parameter has a gradient at steps 1 and 2
    opt.step()
    before = snapshot(opt, params)
    big_grads(params, 2)
    params[2].grad.view(-1)[7] = float("nan")
    norm = opt.clip_grad_norm_(1.0)
    assert math.isnan(norm.item())
    reads = []
    real = ops.grad_norm
    monkeypatch.setattr(ops, "grad_norm", lambda *a, **k: reads.append(1) or real(*a, **k))
    opt.step()
    assert reads == [], "the step read the gradients again"
    assert_bits(snapshot(opt, params), before)  # step counts included


def test_under_a_grad_scaler_the_clip_joins_its_unscaled_step():
    """A fused torch AdamW, swapped, driven by a GradScaler: scaler.unscale_, then the
    clip, then scaler.step equals unscale_, g *= factor, scaler.step, bit for bit; the
    step whose gradients hold an inf is the scaler's skip on both sides."""
    def train(ours):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((16, 8), (33,))]
        opt = swap(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for k in range(4):
            grads = [torch.randn(p.shape, generator=gen) * 30 for p in params]
            if k == 2:
                grads[1][5] = float("inf")
            scaler.scale(sum((p * g).sum() for p, g in zip(params, grads))).backward()
            scaler.unscale_(opt)
            if ours:
                opt.clip_grad_norm_(1.0)
            else:
                norm = ops.grad_norm([p.grad for p in params])[0]
                for p in params:
                    p.grad.mul_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return opt, params, scaler.get_scale()

    (opt, params, scale), (ref, ref_params, ref_scale) = train(True), train(False)
    assert scale == ref_scale == 2.0 ** 9  # one skipped step halved it
    assert_bits(snapshot(opt, params), snapshot(ref, ref_params))
    assert opt.state[params[0]]["step"].item() == 3


def test_the_clip_applies_to_the_next_step_only_and_undo_removes_it():
    params, params_b = make_params(), make_params()
    opt = swap(make_optimizer("adamw", params))
    other = swap(make_optimizer("adamw", params_b))
    for p, o in ((params, opt), (params_b, other)):
        big_grads(p, 0)
        o.clip_grad_norm_(0.5)
        o.step()
        big_grads(p, 1)
        if o is opt:
            o.step()  # no clip: the whole gradient
        else:
            torch.nn.utils.clip_grad_norm_([q for q in p if q.grad is not None], 1e9)
            o.step()
    assert_bits(snapshot(opt, params), snapshot(other, params_b))
    big_grads(params, 2)
    opt.clip_grad_norm_(0.5)
    swap(opt, undo=True)
    assert not hasattr(opt, "clip_grad_norm_")
    assert not any(key.startswith("_frugal_swap") for key in vars(opt))
    assert "_pending_clip" not in vars(opt)
    swap(opt)
    opt.step()  # the clip pending at the undo is gone with it
    big_grads(params_b, 2)
    other.step()
    assert_bits(snapshot(opt, params), snapshot(other, params_b))


def test_bad_input_is_refused_and_nothing_is_pending():
    params = make_params()
    opt = swap(make_optimizer("sgd-momentum", params))
    big_grads(params, 0)
    for max_norm, error in ((float("nan"), ValueError), (-1.0, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="max_norm"):
            opt.clip_grad_norm_(max_norm)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)
    params[0].grad.view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert getattr(opt, "_pending_clip", None) is None


@pytest.mark.parametrize("swapped", [True, False], ids=["swapped", "engine"])
def test_clip_grad_norm_is_refused_while_the_optimizer_steps_in_backward(swapped):
    """Its gradients are used and freed inside backward: the clip would find none and
    return 0. The handle's max_grad_norm is the clip there; after remove() it works."""
    params = make_params()
    if swapped:
        opt = swap(make_optimizer("adamw", params))
    else:
        opt = fk.FRUGAL([{"params": params, "projected": False}], lr=1e-3)
    handle = fk.step_in_backward(opt)
    sum((p * p).sum() for p in params).backward()
    with pytest.raises(RuntimeError, match="steps in backward.*max_grad_norm"):
        opt.clip_grad_norm_(1.0)
    assert getattr(opt, "_pending_clip", None) is None
    handle.remove()
    big_grads(params, 1)
    assert opt.clip_grad_norm_(1.0) > 1.0
