"""frugal_kernels.swap: torch.optim's AdamW, Adam and SGD on the fused ops, same object,
same state, same results."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import frugal_kernels
from frugal_kernels import swap

from ..ops.helpers import rel_diff

SHAPES = [(17, 9), (33,), (4, 5, 6), (1,), (128, 3)]
STEPS = 60

# (optimizer class, per-group options, defaults): three groups each, every
# option of the class that the swap honours set in at least one group.
CONFIGS = {
    "adamw": (torch.optim.AdamW,
              [dict(lr=2e-3), dict(weight_decay=0.0, betas=(0.8, 0.95)),
               dict(maximize=True, eps=1e-6)],
              dict(lr=1e-3, weight_decay=0.1)),
    "adam-l2": (torch.optim.Adam,
                [dict(), dict(weight_decay=0.0), dict(maximize=True, lr=5e-4)],
                dict(lr=1e-3, weight_decay=0.05)),
    "sgd-momentum": (torch.optim.SGD,
                     [dict(), dict(dampening=0.3, weight_decay=0.0), dict(maximize=True)],
                     dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (torch.optim.SGD,
                     [dict(), dict(momentum=0.5, lr=3e-2), dict(weight_decay=0.0)],
                     dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.02)),
    "sgd-plain": (torch.optim.SGD,
                  [dict(), dict(weight_decay=0.0), dict(maximize=True)],
                  dict(lr=5e-2, weight_decay=0.1)),
}
BACKENDS = ["auto", "torch"]


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def make_optimizer(name, params):
    cls, group_options, defaults = CONFIGS[name]
    groups = [dict(params=params[0:2], **group_options[0]),
              dict(params=params[2:4], **group_options[1]),
              dict(params=params[4:], **group_options[2])]
    # foreach=False: the single-tensor path whose order of operations the ops follow.
    return cls(groups, foreach=False, **defaults)


def set_grads(params, k):
    """Gradients of step k: deterministic, depending on the params (cos keeps
    them away from 0, where a relative comparison means nothing); param 1 has
    none on every third step (torch skips it; so must the swap)."""
    gen = torch.Generator().manual_seed(1000 + k)
    for i, p in enumerate(params):
        if i == 1 and k % 3 == 0:
            p.grad = None
        else:
            p.grad = torch.cos(p.detach()) + 0.1 * torch.randn(p.shape, generator=gen)


def run(opt, params, steps, sched=None, first=0):
    for k in range(first, first + steps):
        set_grads(params, k)
        opt.step()
        if sched is not None:
            sched.step()


def assert_same(actual, expected, what="params"):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert rel_diff(a.detach(), e.detach()) <= 1e-6, f"{what}[{i}]: {rel_diff(a, e)}"


# The coordinate-wise tolerance docs/integration.md states, in torch.testing's form
# |swapped - torch| <= atol + rtol * |torch|, for params and state: a relative bound
# alone fails near zero (a coordinate of 1e-6 was seen 3e-2 off relative, 6e-7 absolute).
# SGD's momentum sums in another order than torch's single-tensor loop (5e-5 relative seen).
COORDINATE_TOL = {"adamw": (1e-5, 1e-6), "adam-l2": (1e-5, 1e-6),
                  "sgd-momentum": (1e-4, 1e-6), "sgd-nesterov": (1e-4, 1e-6),
                  "sgd-plain": (1e-4, 1e-6)}


def assert_close_coordinatewise(opt, params, ref, ref_params, rtol, atol):
    for i, (p, q) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"params[{i}]: {m}")
        for name, value in ref.state[q].items():
            if name != "step" and isinstance(value, torch.Tensor):
                torch.testing.assert_close(opt.state[p][name], value, rtol=rtol, atol=atol,
                                           msg=lambda m, i=i, n=name: f"{n}[{i}]: {m}")


def assert_same_state(actual, expected):
    """Two optimizers' state_dicts: one layout, values within 1e-6 relative."""
    sa, se = actual.state_dict(), expected.state_dict()
    assert sa["param_groups"] == se["param_groups"]
    assert sa["state"].keys() == se["state"].keys()
    for key, state in se["state"].items():
        got = sa["state"][key]
        assert got.keys() == state.keys(), key
        for name, value in state.items():
            if name == "step":
                assert got[name].dtype == value.dtype and got[name].device == value.device
                assert torch.equal(got[name], value)
            elif value is None:
                assert got[name] is None
            else:
                assert got[name].dtype == value.dtype and got[name].shape == value.shape
                assert rel_diff(got[name], value) <= 1e-6, (key, name, rel_diff(got[name], value))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_swapped_optimizer_matches_the_original(name, backend):
    ref_params, params = make_params(), make_params()
    ref, opt = make_optimizer(name, ref_params), make_optimizer(name, params)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=7, gamma=0.7)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler warning about the patched step
        assert swap(opt, backend=backend) is opt
        run(ref, ref_params, STEPS, ref_sched)
        run(opt, params, STEPS, sched)
    assert sched.last_epoch == STEPS and opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_same(params, ref_params)
    assert_same_state(opt, ref)
    assert_close_coordinatewise(opt, params, ref, ref_params, *COORDINATE_TOL[name])


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("lr", [1e-3, 1e-1])
def test_adam_holds_the_stated_tolerance_near_zero(cls, lr):
    # Coordinates from 1 down to 1e-6 and gradients from 1 down to 1e-4, 100 steps: the
    # stated atol + rtol * |torch| bound holds where a relative bound alone does not.
    gen = torch.Generator().manual_seed(3)
    scales = 10.0 ** -torch.arange(7.0)
    ref_params = [(torch.randn(7, 50, generator=gen) * scales[:, None]).requires_grad_(),
                  (torch.randn(333, generator=gen) * 1e-6).requires_grad_()]
    params = [p.detach().clone().requires_grad_() for p in ref_params]
    wd = 0.1 if cls is torch.optim.AdamW else 0.0
    ref, opt = cls(ref_params, lr=lr, weight_decay=wd), cls(params, lr=lr, weight_decay=wd)
    swap(opt)
    for k in range(100):
        for p, q in zip(params, ref_params):
            g = torch.randn(p.shape, generator=gen) * 10.0 ** -(k % 5)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert_close_coordinatewise(opt, params, ref, ref_params, *COORDINATE_TOL["adamw"])


@pytest.mark.parametrize("name", ["adamw", "adam-l2", "sgd-momentum"])
def test_a_group_added_after_the_swap_counts_its_own_steps(name):
    ref_params, params = make_params(), make_params()
    extra_ref, extra = torch.randn(10, 3).requires_grad_(), None
    extra = extra_ref.detach().clone().requires_grad_()
    ref, opt = make_optimizer(name, ref_params), swap(make_optimizer(name, params))
    run(ref, ref_params, 20)
    run(opt, params, 20)
    ref.add_param_group(dict(params=[extra_ref], lr=4e-3))
    opt.add_param_group(dict(params=[extra], lr=4e-3))
    run(ref, ref_params + [extra_ref], 20, first=20)
    run(opt, params + [extra], 20, first=20)
    assert_same(params + [extra], ref_params + [extra_ref])
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_fused_optimizer_swapped_honours_a_grad_scaler_as_torch_fused_does(name):
    """A fused=True torch optimizer tells GradScaler that its step unscales and skips
    (_step_supports_amp_scaling): the swapped step must divide grad_scale out and skip
    on found_inf, on the device, as torch's fused step does (step counts included)."""
    cls, group_options, defaults = CONFIGS[name]
    ref_params, params = make_params(), make_params()

    def fused(ps):
        return cls([dict(params=ps[0:2], **group_options[0]),
                    dict(params=ps[2:4], **group_options[1]),
                    dict(params=ps[4:], **group_options[2])], fused=True, **defaults)

    ref, opt = fused(ref_params), swap(fused(params))
    assert opt._step_supports_amp_scaling
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
               for _ in range(2)]
    for k in range(12):
        for o, ps, scaler in ((ref, ref_params, scalers[0]), (opt, params, scalers[1])):
            scaler.scale(torch.ones(()))  # what scaling a loss does: start the scale
            set_grads(ps, k)
            if ps[1].grad is None:
                # torch's fused SGD (2.13) raises when a param starts its momentum
                # buffer later than the others of its group: every param has a gradient.
                ps[1].grad = torch.cos(ps[1].detach())
            for p in ps:
                p.grad.mul_(scaler.get_scale())
            if k == 5:
                ps[2].grad.view(-1)[2] = float("inf")
            before = [p.detach().clone() for p in ps]
            scaler.step(o)
            scaler.update()
            if k == 5:
                assert all(torch.equal(p, b) for p, b in zip(ps, before))
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_same(params, ref_params)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoints_cross_the_swap_both_ways(name):
    ref_params = make_params()
    ref = make_optimizer(name, ref_params)
    run(ref, ref_params, 10)
    before = copy.deepcopy(ref.state_dict())
    before_params = [p.detach().clone() for p in ref_params]
    run(ref, ref_params, 20, first=10)

    # Written unswapped, loaded swapped.
    params = [p.clone().requires_grad_() for p in before_params]
    opt = swap(make_optimizer(name, params))
    opt.load_state_dict(before)
    run(opt, params, 10, first=10)
    middle = copy.deepcopy(opt.state_dict())
    middle_params = [p.detach().clone() for p in params]
    run(opt, params, 10, first=20)
    assert_same(params, ref_params)
    assert_same_state(opt, ref)

    # Written swapped, loaded unswapped.
    plain_params = [p.clone().requires_grad_() for p in middle_params]
    plain = make_optimizer(name, plain_params)
    plain.load_state_dict(middle)
    run(plain, plain_params, 10, first=20)
    assert_same(plain_params, ref_params)
    assert_same_state(plain, ref)


def test_undo_restores_the_original_step_and_keeps_the_state():
    ref_params, params = make_params(), make_params()
    ref, opt = make_optimizer("adamw", ref_params), make_optimizer("adamw", params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1))
    torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1 / (k + 1))
    scheduler_step = opt.step
    swap(opt)
    assert opt.step is not scheduler_step
    run(opt, params, 10, sched)
    assert swap(opt, undo=True) is opt
    assert opt.step == scheduler_step  # the scheduler's wrapper of the original step is back
    run(opt, params, 10, sched, first=10)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1 / (k + 1))
    run(ref, ref_params, 20, ref_sched)
    assert_same(params, ref_params)
    with pytest.raises(ValueError, match="was not swapped"):
        swap(opt, undo=True)


def test_swap_is_idempotent_and_keeps_hooks_and_late_schedulers():
    params = make_params()
    opt = make_optimizer("sgd-momentum", params)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    swap(opt)
    swapped = opt.step
    assert swap(opt) is opt and opt.step == swapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        run(opt, params, 2, sched)
    assert calls == ["pre", "post"] * 2
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_closure_loss_is_returned():
    params = make_params()
    opt = swap(make_optimizer("adam-l2", params))

    def closure():
        opt.zero_grad()
        loss = sum((p ** 2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0


@pytest.mark.parametrize("option", ["amsgrad", "differentiable", "capturable"])
def test_unsupported_options_raise(option):
    params = make_params()
    with pytest.raises(ValueError, match=f"sets {option}=True"):
        swap(torch.optim.Adam(params, **{option: True}))
    # Set after the swap: the step refuses it before changing anything.
    opt = swap(torch.optim.AdamW(params))
    opt.param_groups[0][option] = True
    set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=f"sets {option}=True"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


def test_unsupported_optimizers_and_params_raise():
    params = make_params()
    with pytest.raises(TypeError, match="got torch.optim.rmsprop.RMSprop"):
        swap(torch.optim.RMSprop(params))

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match="MyAdamW"):
        swap(MyAdamW(params))
    with pytest.raises(ValueError, match="torch.bfloat16 parameter"):
        swap(torch.optim.SGD([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], lr=0.1))
    # The engine's refusal (FusedOptimizer's, the same message).
    with pytest.raises(ValueError, match="params\\[0\\] of param group 0 .* is not contiguous"):
        swap(torch.optim.SGD([torch.zeros(3, 4).t().requires_grad_()], lr=0.1))
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = swap(torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9))
    embedding(torch.tensor([1, 3])).sum().backward()
    before = embedding.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.step()
    assert torch.equal(embedding.weight, before) and not opt.state


def test_exported_at_the_top():
    assert frugal_kernels.swap is swap and "swap" in frugal_kernels.__all__


def test_a_capture_of_host_step_counts_is_refused_before_anything_changes(monkeypatch):
    """A swapped AdamW whose step counts live on the host (no fused=True) cannot be
    captured in a CUDA graph: the kernels read the count when launched, so a replay would
    keep the bias correction of the captured step (seen on an H200: 2e-4 off the eager
    step). The capture is emulated here; the GPU test captures for real."""
    from frugal_kernels.optim import swap as swap_module

    params = [torch.nn.Parameter(torch.randn(5, 3))]
    opt = swap(torch.optim.AdamW(params, lr=1e-2))
    params[0].grad = torch.randn(5, 3)
    opt.step()
    before = [params[0].detach().clone(), opt.state[params[0]]["step"].clone()]
    monkeypatch.setattr(swap_module, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="fused=True"):
        opt.step()
    assert torch.equal(params[0].detach(), before[0])
    assert torch.equal(opt.state[params[0]]["step"], before[1])


@pytest.mark.parametrize("reset", ["step", "step and moments", "fill"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_state_reset_in_place_keeps_each_tensors_own_step_count(reset, fused):
    """A loop that resets one tensor's state in place (``state["step"].zero_()``, as some do
    on restarts) keeps the step tensors the swap's split of the group was cached for: the
    split must see the new count, not step that tensor with another's count."""
    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=fused)
    opt = swap(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused))
    for o, ps in ((ref, ref_params), (opt, params)):
        for k in range(6):
            set_grads(ps, k)
            if ps[1].grad is None:
                ps[1].grad = torch.cos(ps[1].detach())
            o.step()
        state = o.state[ps[2]]
        if reset == "fill":
            state["step"].fill_(2.0)
        else:
            state["step"].zero_()
        if reset == "step and moments":
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        for k in range(6, 10):
            set_grads(ps, k)
            if ps[1].grad is None:
                ps[1].grad = torch.cos(ps[1].detach())
            o.step()
    assert_same(params, ref_params)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name, option, value", [
    ("adamw", "lr", float("inf")), ("adamw", "eps", float("nan")),
    ("adam-l2", "weight_decay", -0.1), ("adam-l2", "betas", (0.9, 1.0)),
    ("sgd-momentum", "lr", float("nan")), ("sgd-momentum", "momentum", -0.9),
    ("sgd-plain", "dampening", float("inf"))])
def test_an_option_value_set_after_the_swap_is_refused_before_anything_changes(
        name, option, value):
    """The engine's option checks (FRUGAL's): torch's constructor would refuse some of
    these, and torch's step trains on the others (lr=inf writes NaN, eps=nan too)."""
    params = make_params()
    opt = swap(make_optimizer(name, params))
    run(opt, params, 2)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[1][option] = value
    set_grads(params, 2)
    with pytest.raises(ValueError, match=f"swap: param group 1: {option}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    after = opt.state_dict()["state"]
    for key, entries in state.items():
        for entry, value in entries.items():
            assert torch.equal(after[key][entry], value), (key, entry)


def test_a_grad_scalers_flag_summed_over_devices_takes_back_one_step():
    """GradScaler hands a fused optimizer the sum of its devices' flags (2 when both found
    an inf): the skipped step leaves the step counts as they were, not one lower."""
    params = make_params()
    opt = swap(torch.optim.AdamW(params, lr=1e-2, fused=True))
    set_grads(params, 1)
    opt.step()
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(2.0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(params, steps))


@pytest.mark.parametrize("change", ["weight_decay", "moments replaced"])
def test_a_change_between_steps_reaches_the_kept_calls(change):
    """The group's plan of op calls is kept between steps (its calls prepared over the
    moments): a weight decay turned on mid-run and moments replaced by new tensors (not
    written in place) are the next step's, as in torch's."""
    ref_params, params = make_params(), make_params()
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    opt = swap(torch.optim.Adam(params, lr=1e-2))
    for o, ps in ((ref, ref_params), (opt, params)):
        run(o, ps, 4)
        if change == "weight_decay":
            o.param_groups[0]["weight_decay"] = 0.1
        else:
            for p in ps[:2]:
                o.state[p]["exp_avg"] = torch.full_like(p, 0.01)
                o.state[p]["exp_avg_sq"] = torch.full_like(p, 0.02)
        run(o, ps, 4, first=4)
    assert_same(params, ref_params)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name, builds", [("adamw", 1), ("adam-l2", 1), ("sgd-momentum", 2),
                                          ("sgd-plain", 1)])
def test_a_groups_plan_is_built_once_and_kept(name, builds, monkeypatch):
    """The engine's plan of op calls (plan.build), kept while the group steps the same
    tensors and state (SGD's momentum rebuilds it once: its first step starts the buffers
    in calls of their own); a step count reset in place rebuilds it."""
    from frugal_kernels.optim import plan

    params = make_params()
    opt = swap(make_optimizer(name, params))
    made = []
    real = plan.build
    monkeypatch.setattr(plan, "build", lambda *a, **k: made.append(1) or real(*a, **k))
    for k in range(5):
        for p in params:
            p.grad = torch.cos(p.detach()) + 0.01 * k
        opt.step()
    assert len(made) == builds * 3  # three param groups
    if name.startswith("adam"):
        opt.state[params[0]]["step"].zero_()
        opt.step()
        assert len(made) == builds * 3 + 1


def test_adams_coupled_decay_on_int8_moments_is_the_decay_added_to_the_gradient():
    """A swapped Adam with state_dtype="int8": the L2 term joins the gradient before the
    8-bit AdamW call (the engine's adamw_int8 rule, coupled), bit for bit as stepping
    g + weight_decay * p without decay; the small tensor keeps fp32 moments."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(64, 80), (96, 64), (7,)]
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = swap(torch.optim.Adam(params, lr=1e-2, weight_decay=0.1), state_dtype="int8")
    manual = swap(torch.optim.Adam(twins, lr=1e-2, weight_decay=0.0), state_dtype="int8")
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(params, twins, grads):
            p.grad = g.clone()
            q.grad = torch.add(g, q.detach(), alpha=0.1)
        opt.step()
        manual.step()
    assert opt.state[params[0]]["exp_avg"].dtype == torch.int8
    assert opt.state[params[2]]["exp_avg"].dtype == torch.float32
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    for p, q in zip(params, twins):
        for key, value in opt.state[p].items():
            assert torch.equal(value, manual.state[q][key]), key


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(opt, params, snapshot):
    before, state = snapshot
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    for key, entries in state.items():
        assert after[key].keys() == entries.keys()
        for entry, value in entries.items():
            assert torch.equal(after[key][entry], value), (key, entry)


def _grad_of_another_dtype(opt, params):
    params[4].grad_dtype = None  # torch then takes a gradient of any dtype
    params[4].grad = params[4].grad.bfloat16()


def _state_of_another_shape(opt, params):
    state = opt.state_dict()
    key = "momentum_buffer" if isinstance(opt, torch.optim.SGD) else "exp_avg"
    state["state"][4][key] = torch.zeros(7)
    opt.load_state_dict(state)  # torch's loader checks no shapes


def _state_not_contiguous(opt, params):
    state = opt.state_dict()
    key = "momentum_buffer" if isinstance(opt, torch.optim.SGD) else "exp_avg"
    state["state"][4][key] = torch.zeros(3, 128).t()
    opt.load_state_dict(state)  # torch's loader keeps the strides


def _group_sharing_memory(opt, params):
    opt.add_param_group(dict(params=[params[0].detach()[1:3].requires_grad_()]))
    opt.param_groups[-1]["params"][0].grad = torch.ones(2, 9)


def _nonfinite(opt, params):
    params[4].grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize("name", ["adamw", "adam-l2", "sgd-momentum"])
@pytest.mark.parametrize("case, error", [
    (_grad_of_another_dtype, r"params\[0\] of param group 2 .* gradient of dtype torch.bfloat16"),
    (_state_of_another_shape, r"state of param params\[0\] of param group 2 .*"),
    (_state_not_contiguous, r"state of param params\[0\] of param group 2 .* not a "
                            r"contiguous tensor"),
    (_group_sharing_memory, r"params\[0\] of param group 3 .* shares memory with params\[0\] "
                            r"of param group 0"),
    (_nonfinite, r"params\[0\] of param group 2 .* non-finite gradient"),
], ids=["grad dtype", "state shape", "state strides", "shared memory", "nonfinite raise"])
def test_a_step_that_raises_in_a_later_group_changes_no_group(name, case, error):
    """The engine's atomic step: every group is checked before any op call, so a step that
    raises for the last group leaves the first ones as they were (params, moments, step
    counts). Swapped steps used to update the groups before it, then raise."""
    params = make_params()
    opt = swap(make_optimizer(name, params), **({"nonfinite": "raise"} if case is _nonfinite
                                                 else {}))
    run(opt, params, 2)
    set_grads(params, 2)
    case(opt, params)
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match=error):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


def test_a_bad_backend_or_policy_is_refused_at_the_swap():
    params = make_params()
    opt = torch.optim.AdamW(params)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        swap(opt, backend="cuda-ish")
    with pytest.raises(ValueError, match="nonfinite must be one of skip, raise, propagate"):
        swap(opt, nonfinite="ignore")
    assert not frugal_kernels.optim.swap.is_swapped(opt)


@pytest.mark.parametrize("options", [dict(nonfinite="raise"), dict(backend="torch"),
                                     dict(state_dtype="int8")], ids=lambda o: next(iter(o)))
def test_a_repeated_swap_with_other_options_is_refused_and_changes_nothing(options):
    params = make_params()
    opt = swap(torch.optim.AdamW(params), backend="cpu")
    assert swap(opt, backend="cpu") is opt  # the same options: nothing to do
    step = opt.step
    with pytest.raises(ValueError, match="swapped already, with other options: "
                                         f"{next(iter(options))}="):
        swap(opt, **{"backend": "cpu", **options})
    record = opt.__dict__[frugal_kernels.optim.swap._SWAP]
    assert opt.step == step and (record.backend, record.nonfinite) == ("cpu", "skip")
    assert not record.int8_hooks


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_gradient_skips_the_step_by_default(name, value):
    """swap's nonfinite= is the package's (default "skip"): params, state and step counts
    stay as they were, and the next step goes on from them as torch's would."""
    ref_params, params = make_params(), make_params()
    ref, opt = make_optimizer(name, ref_params), swap(make_optimizer(name, params))
    run(ref, ref_params, 3)
    run(opt, params, 3)
    set_grads(params, 3)
    params[2].grad.view(-1)[1] = value
    snapshot = _snapshot(opt, params)
    opt.step()
    _assert_unchanged(opt, params, snapshot)
    run(ref, ref_params, 3, first=4)
    run(opt, params, 3, first=4)
    assert_same(params, ref_params)
    assert_same_state(opt, ref)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_nonfinite_propagate_is_torchs_step(name):
    ref_params, params = make_params(), make_params()
    ref = make_optimizer(name, ref_params)
    opt = swap(make_optimizer(name, params), nonfinite="propagate")
    for o, ps in ((ref, ref_params), (opt, params)):
        run(o, ps, 2)
        set_grads(ps, 2)
        ps[2].grad.view(-1)[1] = float("nan")
        o.step()
    assert torch.isnan(params[2]).any()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0, equal_nan=True)
