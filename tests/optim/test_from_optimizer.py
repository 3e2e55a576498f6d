"""FRUGAL.from_optimizer / AdaFRUGAL.from_optimizer: an existing AdamW becomes FRUGAL,
keeping its param groups, hyper-parameters and moments."""

from __future__ import annotations

import pytest
import torch

import frugal_kernels as fk

HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)


def params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 6, generator=gen)),
            torch.nn.Parameter(torch.randn(5, 7, generator=gen)),
            torch.nn.Parameter(torch.randn(6, generator=gen))]


def grads(ps, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in ps] for _ in range(steps)]


def run(opt, ps, seq):
    for gs in seq:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()


def adamw_after(steps, ps):
    opt = torch.optim.AdamW([{"params": ps[:2], "name": "matrices"},
                             {"params": ps[2:], "projected": False, "lr": 3e-3}], **HYPER)
    run(opt, ps, grads(ps, steps))
    return opt


@pytest.mark.parametrize("projection", ["blocks", "columns", "rows", "randk"])
def test_at_density_one_it_continues_adamw(projection):
    # Every coordinate state-full: FRUGAL is AdamW, so the carried moments and step
    # counts must give torch's AdamW trajectory.
    ps, ref = params(), params()
    old, ref_opt = adamw_after(4, ps), adamw_after(4, ref)
    new = fk.FRUGAL.from_optimizer(old, density=1.0, projection=projection, update_gap=100)
    seq = grads(ps, 6, seed=2)
    run(new, ps, seq)
    run(ref_opt, ref, seq)
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_groups_and_hyper_parameters_are_kept():
    ps = params()
    new = fk.FRUGAL.from_optimizer(adamw_after(1, ps), density=0.5, projection="columns")
    first, second = new.param_groups
    assert first["params"] == ps[:2] and second["params"] == ps[2:]
    assert (first["lr"], first["betas"], first["eps"], first["weight_decay"]) == \
        (1e-2, (0.8, 0.99), 1e-7, 0.1)
    assert first["name"] == "matrices" and first["projected"] and first["density"] == 0.5
    assert second["lr"] == 3e-3 and not second["projected"]
    for key in ("amsgrad", "foreach", "fused", "capturable", "maximize"):
        assert key not in first


@pytest.mark.parametrize("projection, kind", [("columns", "columns"), ("rows", "rows"),
                                              ("randk", "flat")])
def test_a_subset_keeps_its_part_of_the_moments(projection, kind):
    ps = params()
    old = adamw_after(3, ps)
    before = {id(p): (old.state[p]["exp_avg"].clone(), old.state[p]["exp_avg_sq"].clone())
              for p in ps[:2]}
    new = fk.FRUGAL.from_optimizer(old, density=0.5, projection=projection)
    gs = grads(ps, 1, seed=7)[0]
    run(new, ps, [gs])
    beta1, beta2 = HYPER["betas"]
    for p, g in zip(ps[:2], gs):
        st = new.state[p]
        idx = st["indices"].long()
        m, v = before[id(p)]
        pick = {"rows": lambda t: t[idx], "columns": lambda t: t[..., idx],
                "flat": lambda t: t.reshape(-1)[idx]}[kind]
        # One AdamW update of the carried part: m <- b1 m + (1 - b1) g.
        torch.testing.assert_close(st["exp_avg"], beta1 * pick(m) + (1 - beta1) * pick(g))
        torch.testing.assert_close(st["exp_avg_sq"],
                                   beta2 * pick(v) + (1 - beta2) * pick(g) ** 2)
        assert float(st["step"]) == 4.0
    assert not new._carried  # let go after the first step


def test_low_rank_kinds_start_afresh_and_adafrugal_works():
    ps = params()
    new = fk.FRUGAL.from_optimizer(adamw_after(2, ps), density=0.5, projection="random")
    run(new, ps, grads(ps, 1, seed=3))
    assert all(float(new.state[p]["step"]) == 1.0 for p in ps[:2])
    ps = params()
    ada = fk.AdaFRUGAL.from_optimizer(adamw_after(2, ps), rho_start=0.5, rho_end=0.1,
                                      rho_steps=10, update_gap=2, projection="columns")
    run(ada, ps, grads(ps, 3, seed=4))
    assert ada.rho < 0.5 and float(ada.state[ps[2]]["step"]) == 5.0


@pytest.mark.parametrize("make, error, match", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), TypeError, "AdamW or Adam"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), ValueError, "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, maximize=True), ValueError, "maximize"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), ValueError, "L2 term"),
])
def test_what_frugal_has_no_counterpart_for_is_refused(make, error, match):
    ps = params()
    old = make(ps)
    run(old, ps, grads(ps, 1))
    before = {k: v.clone() for p in ps for k, v in old.state[p].items()
              if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=match):
        fk.FRUGAL.from_optimizer(old)
    after = {k: v for p in ps for k, v in old.state[p].items() if isinstance(v, torch.Tensor)}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adam_without_weight_decay_is_accepted():
    ps, ref = params(), params()
    old = torch.optim.Adam(ps, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    run(old, ps, grads(ps, 2))
    run(ref_opt, ref, grads(ref, 2))
    new = fk.FRUGAL.from_optimizer(old, density=1.0)
    seq = grads(ps, 3, seed=5)
    run(new, ps, seq)
    run(ref_opt, ref, seq)
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def scheduled_adamw(ps, steps, t_max):
    """An AdamW with a cosine schedule, after ``steps`` steps."""
    opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], **HYPER)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    for gs in grads(ps, steps):
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        sched.step()
    return opt, sched


@pytest.mark.parametrize("cls", [fk.FRUGAL, fk.AdaFRUGAL])
@pytest.mark.parametrize("how", ["last_epoch", "load_state_dict"])
def test_the_documented_scheduler_lines_continue_the_schedule(cls, how):
    # docs/integration.md: from_optimizer, then a new scheduler that continues the AdamW's.
    step, t_max, more = 3, 10, 4
    ps = params()
    adamw, old = scheduled_adamw(ps, step, t_max)
    opt = cls.from_optimizer(adamw, **({"rho_steps": 100} if cls is fk.AdaFRUGAL else {}))
    if how == "last_epoch":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max,
                                                           last_epoch=step - 1)
    else:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
        sched.load_state_dict(old.state_dict())
    _, ref = scheduled_adamw(params(), step, t_max)  # the same run, never interrupted
    for gs in grads(ps, more, seed=5):
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        sched.step()
        ref.optimizer.step()
        ref.step()
        assert sched.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(ref.get_last_lr())


def test_without_an_earlier_scheduler_the_groups_get_initial_lr():
    # torch's schedulers made with last_epoch read "initial_lr", which only a scheduler
    # sets: the documented line raised KeyError on an AdamW that never had one.
    opt = fk.FRUGAL.from_optimizer(adamw_after(3, params()))
    assert [g["initial_lr"] for g in opt.param_groups] == [HYPER["lr"], 3e-3]
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, last_epoch=2)
    assert sched.base_lrs == [HYPER["lr"], 3e-3]
    fresh = torch.optim.lr_scheduler.CosineAnnealingLR(
        fk.FRUGAL.from_optimizer(adamw_after(3, params())), T_max=10)
    assert fresh.get_last_lr() == [HYPER["lr"], 3e-3]


def test_a_kept_initial_lr_is_not_replaced():
    ps = params()
    adamw = adamw_after(2, ps)
    torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)  # sets initial_lr
    adamw.param_groups[0]["lr"] = 1e-3  # as that scheduler would have lowered it
    opt = fk.FRUGAL.from_optimizer(adamw)
    assert opt.param_groups[0]["initial_lr"] == HYPER["lr"]
