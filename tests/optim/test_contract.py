"""The torch.optim contract: checkpoints, schedulers, closures, groups, AMP, compile.

The generic tests run every entry of the optimizer table (tests/optim_db.py);
the FRUGAL-specific ones (option checks, state dtypes, subsets of added groups)
follow at the end.
"""

import pytest
import torch

import frugal_kernels as fk

from ..optim_db import OPTIMIZERS, values
from .helpers import (HYPER, assert_same, grad_sequence, groups, make_params, roundtrip, run,
                      set_grads)


def _entries(predicate=lambda info: True):
    return [pytest.param(info, id=info.name) for info in OPTIMIZERS if predicate(info)]


def _with_variants():
    return [pytest.param(info, options, id=f"{info.name}-{name}")
            for info in OPTIMIZERS for name, options in info.variants.items()]


def _with_misfits():
    return [pytest.param(info, misfit, id=f"{info.name}-{misfit.name}")
            for info in OPTIMIZERS for misfit in info.misfits]


@pytest.mark.parametrize("info,options", _with_variants())
def test_resume_is_bit_identical(info, options):
    n, m = 7, 8
    full_opt, full_params = info.build(**options)
    seq = grad_sequence(full_params, n + m, seed=9)
    info.train(full_opt, full_params, seq)

    first, params = info.build(**options)
    info.train(first, params, seq[:n])
    saved_params = values(params, clone=True)
    sd = roundtrip(first.state_dict())
    del first

    resumed, params2 = info.build(seed=123, **options)
    with torch.no_grad():
        for v, s in zip(values(params2), saved_params):
            v.copy_(s)
    resumed.load_state_dict(sd)
    info.train(resumed, params2, seq[n:], start=n)
    for a, b in zip(values(params2), values(full_params)):
        assert torch.equal(a, b)
    for name in info.resumed_attributes:
        assert getattr(resumed, name) == getattr(full_opt, name), name


@pytest.mark.parametrize("info", _entries())
def test_load_does_not_share_tensors_with_the_state_dict(info):
    opt, params = info.build()
    info.train(opt, params, grad_sequence(params, 2))
    sd = opt.state_dict()
    other, _ = info.build()
    other.load_state_dict(sd)
    in_order = [p for g in other.param_groups for p in g["params"]]
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                loaded = other.state[in_order[pid]][key]
                assert loaded.data_ptr() != value.data_ptr()


@pytest.mark.parametrize("info", _entries())
def test_state_dict_holds_only_tensors_and_numbers_per_param(info):
    opt, params = info.build()
    info.train(opt, params, grad_sequence(params, 2))
    for st in opt.state_dict()["state"].values():
        for value in st.values():
            assert isinstance(value, (torch.Tensor, int, float))


@pytest.mark.parametrize("info,misfit", _with_misfits())
def test_a_state_dict_that_does_not_fit_raises_and_changes_nothing(info, misfit):
    opt, params = info.build()
    info.train(opt, params, grad_sequence(params, 2))
    sd = roundtrip(opt.state_dict())
    misfit.mutate(sd)
    target, params2 = info.build()
    info.train(target, params2, grad_sequence(params2, 1, seed=3))
    before = target.state_dict()
    with pytest.raises(ValueError, match=misfit.message):
        target.load_state_dict(sd)
    assert_same(target.state_dict(), before)


@pytest.mark.parametrize("info", _entries())
def test_lr_scheduler_drives_the_step(info):
    seq = None
    results = []
    for use_scheduler in (True, False):
        opt, params = info.build()
        base_lrs = [g["lr"] for g in opt.param_groups]
        seq = seq or grad_sequence(params, 6)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1) if use_scheduler \
            else None
        for t, grads in enumerate(seq):
            if not use_scheduler:
                for g, base in zip(opt.param_groups, base_lrs):
                    g["lr"] = base * 0.1 ** (t // 2)
            info.train(opt, params, [grads], start=t)
            if sched:
                sched.step()
        results.append(values(params, clone=True))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", _entries())
def test_tensor_lr_equals_float_lr(info):
    a_opt, a = info.build()
    b_opt, b = info.build(lr=torch.tensor(HYPER["lr"], dtype=torch.float64))
    seq = grad_sequence(a, 5)
    info.train(a_opt, a, seq)
    info.train(b_opt, b, seq)
    for x, y in zip(values(a), values(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("info", _entries())
def test_closure_is_evaluated_with_grad_and_its_loss_returned(info):
    opt, params = info.build()
    before = values(params, clone=True)
    start = [p.detach().clone() for p in params]

    def closure():
        opt.zero_grad()
        loss = sum((p * 2).sum() for p in params)
        loss.backward()
        return loss

    with torch.no_grad():
        expected = sum((p * 2).sum() for p in start).item()
    loss = opt.step(closure)
    assert loss.item() == expected
    moved = {id(p) for p in info.moved(opt, params)}
    assert moved
    for i, (p, v, b) in enumerate(zip(params, values(params), before)):
        if id(p) in moved:
            assert not torch.equal(v, b), f"param {i} did not move"
        else:
            assert torch.equal(v, b), f"param {i} moved outside the trained set"


@pytest.mark.parametrize("info", _entries())
def test_grad_scaler_skips_steps_with_inf_and_unscales_the_rest(info):
    """The skip is decided on the device, so the schedules count the skipped call
    (docs/optimizers.md, "Skipped steps and schedules"): the twin that sees the
    unscaled gradients is skipped at the same call by a found_inf of its own."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt, params = info.build()
    plain, plain_params = info.build()
    seq = grad_sequence(params, 4)
    for t, grads in enumerate(seq):
        scaler.scale(torch.ones(()))  # what scaling a loss would do: start the scale
        if t == 2:
            bad = [g.clone() for g in grads]
            bad[0].view(-1)[0] = float("inf")
            before = values(params, clone=True)
            set_grads(params, [g * scaler.get_scale() for g in bad])
            scaler.step(opt)
            scaler.update()
            assert all(torch.equal(v, b) for v, b in zip(values(params), before))
            set_grads(plain_params, bad)
            plain.found_inf = torch.ones(())
            plain.step()
            del plain.found_inf
            assert list(getattr(opt, "history", [])) == list(getattr(plain, "history", []))
        set_grads(params, [g * scaler.get_scale() for g in grads])
        scaler.step(opt)
        scaler.update()
        if info.after_step is not None:
            info.after_step(opt, t)
        info.train(plain, plain_params, [grads], start=t)
    for a, b in zip(values(params), values(plain_params)):
        assert torch.allclose(a.double(), b.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("info", _entries(lambda info: info.compile_graphs is not None))
def test_compiled_step_matches_eager_and_lr_changes_do_not_recompile(info):
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        opt, params = info.build(**info.compile_options)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        step = torch.compile(opt.step) if compiled else opt.step
        for t, grads in enumerate(grad_sequence(params, 8)):
            set_grads(params, grads)
            step()
            sched.step()
            if info.after_step is not None:
                info.after_step(opt, t)
        results.append(values(params, clone=True))
        if compiled:
            # the graphs of the update, kept through 8 lr values (and the subspace changes)
            assert counters["stats"]["unique_graphs"] == info.compile_graphs
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", _entries())
def test_add_param_group_steps_the_new_group(info):
    opt, params = info.build()
    info.train(opt, params, grad_sequence(params, 2))
    extra = torch.nn.Parameter(torch.randn(12, 10, generator=torch.Generator().manual_seed(4)))
    before = extra.detach().clone()
    if info.add_param_group_refused is not None:
        saved = opt.state_dict()
        with pytest.raises(ValueError, match=info.add_param_group_refused):
            opt.add_param_group({"params": [extra]})
        assert len(opt.param_groups) == len(saved["param_groups"])
        return
    opt.add_param_group({"params": [extra]})
    info.train(opt, params + [extra], grad_sequence(params + [extra], 1), start=2)
    assert not torch.equal(extra, before)


@pytest.mark.parametrize("idle", ["first", "last"])
@pytest.mark.parametrize("info", _entries())
def test_group_without_gradients_is_left_alone(info, idle):
    """A group none of whose tensors has a gradient (unused, or added before its
    first backward) is skipped; the groups with gradients step as usual."""
    opt, _ = info.build()
    idle_group = opt.param_groups[0 if idle == "first" else -1]
    idle_params = list(idle_group["params"])
    stepped = [p for g in opt.param_groups if g is not idle_group for p in g["params"]]
    before_stepped = values(stepped, clone=True)
    before_idle = values(idle_params, clone=True)
    gen = torch.Generator().manual_seed(2)
    trained = set()
    for _ in range(3):
        for p in stepped:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        trained.update(id(p) for p in info.moved(opt, stepped))
    assert any(id(p) in trained for p in stepped)
    for i, (p, v, b) in enumerate(zip(stepped, values(stepped), before_stepped)):
        if id(p) in trained:
            assert not torch.equal(v, b), f"stepped param {i} did not move"
        else:
            assert torch.equal(v, b), f"param {i} moved outside the trained set"
    for p, v, b in zip(idle_params, values(idle_params), before_idle):
        assert torch.equal(v, b)
        assert "exp_avg" not in opt.state[p]  # moments come with the first gradient


# ---------------------------------------------------------------- FRUGAL-specific


def test_state_keeps_its_dtypes_through_a_checkpoint():
    proj, reg = make_params(dtype=torch.bfloat16)
    opt = fk.FRUGAL(groups(proj, reg), projection="randk", **HYPER)
    run(opt, proj + reg, grad_sequence(proj + reg, 2))
    other = fk.FRUGAL(groups(*make_params(dtype=torch.bfloat16)), projection="randk", **HYPER)
    other.load_state_dict(roundtrip(opt.state_dict()))
    for st in other.state.values():
        assert st["exp_avg"].dtype == torch.float32
        if "indices" in st:
            assert st["indices"].dtype == torch.int32


def test_adafrugal_refuses_a_frugal_checkpoint():
    by_name = {info.name: info for info in OPTIMIZERS}
    opt, params = by_name["FRUGAL-blocks"].build()
    run(opt, params, grad_sequence(params, 2))
    ada, _ = by_name["AdaFRUGAL-blocks"].build()
    with pytest.raises(ValueError, match="saved by FRUGAL, not AdaFRUGAL"):
        ada.load_state_dict(roundtrip(opt.state_dict()))


def test_add_param_group_gets_a_subspace_at_its_next_step():
    proj, reg = make_params()
    opt = fk.FRUGAL([{"params": reg, "projected": False}], projection="rows", update_gap=100,
                    **HYPER)
    run(opt, reg, grad_sequence(reg, 2))
    opt.add_param_group({"params": proj, "density": 0.5})
    run(opt, proj + reg, grad_sequence(proj + reg, 1))
    for p in proj:
        assert opt.state[p]["indices"].numel() == round(0.5 * p.shape[0])
    with pytest.raises(ValueError, match="projection must be one of"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))],
                             "projection": "diagonal"})


@pytest.mark.parametrize("bad", [dict(density=1.5), dict(projection="qr"),
                                 dict(state_free="adam"), dict(block_order="zigzag"),
                                 dict(update_gap=0), dict(betas=(1.0, 0.9)), dict(lr=-1.0),
                                 dict(backend="fpga")])
def test_constructor_rejects_bad_options(bad):
    proj, reg = make_params()
    with pytest.raises(ValueError):
        fk.FRUGAL(groups(proj, reg), **{**HYPER, **bad})
