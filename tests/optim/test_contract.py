"""The torch.optim contract: checkpoints, schedulers, closures, groups, AMP."""

import io

import pytest
import torch

import frugal_kernels as fk

from .helpers import HYPER, grad_sequence, groups, make_params, run, set_grads

ALL_PROJECTIONS = ["blocks", "columns", "rows", "randk", "random", "svd"]


def _make(kind, projection, seed=0, reset_state=True):
    proj, reg = make_params(seed=seed)
    if kind == "FRUGAL":
        opt = fk.FRUGAL(groups(proj, reg), density=0.3, update_gap=3, projection=projection,
                        reset_state=reset_state, seed=5, **HYPER)
    else:
        opt = fk.AdaFRUGAL(groups(proj, reg), rho_start=0.5, rho_end=0.1, rho_steps=10,
                           update_gap=2, update_gap_max=6, projection=projection,
                           reset_state=reset_state, seed=5, **HYPER)
    return opt, proj + reg


def _steps(opt, params, seq, start=0):
    for t, grads in enumerate(seq, start=start):
        set_grads(params, grads)
        opt.step()
        if isinstance(opt, fk.AdaFRUGAL):
            opt.observe_loss(1.0 + 0.001 * (t % 2))  # flat: T grows on the way


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind", ["FRUGAL", "AdaFRUGAL"])
@pytest.mark.parametrize("projection", ALL_PROJECTIONS)
@pytest.mark.parametrize("reset_state", [True, False])
def test_resume_is_bit_identical(kind, projection, reset_state):
    n, m = 7, 8
    full_opt, full_params = _make(kind, projection, reset_state=reset_state)
    seq = grad_sequence(full_params, n + m, seed=9)
    _steps(full_opt, full_params, seq)

    first, params = _make(kind, projection, reset_state=reset_state)
    _steps(first, params, seq[:n])
    saved_params = [p.detach().clone() for p in params]
    sd = _roundtrip(first.state_dict())
    del first

    resumed, params2 = _make(kind, projection, seed=123, reset_state=reset_state)
    with torch.no_grad():
        for p, s in zip(params2, saved_params):
            p.copy_(s)
    resumed.load_state_dict(sd)
    _steps(resumed, params2, seq[n:], start=n)
    for a, b in zip(params2, full_params):
        assert torch.equal(a, b)
    assert resumed.history == full_opt.history
    assert resumed.update_gap == full_opt.update_gap and resumed.rho == full_opt.rho


def test_load_does_not_share_tensors_with_the_state_dict():
    opt, params = _make("FRUGAL", "columns")
    run(opt, params, grad_sequence(params, 2))
    sd = opt.state_dict()
    other, params2 = _make("FRUGAL", "columns")
    other.load_state_dict(sd)
    in_order = [p for g in other.param_groups for p in g["params"]]
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                loaded = other.state[in_order[pid]][key]
                assert loaded.data_ptr() != value.data_ptr()


def test_state_keeps_its_dtypes_through_a_checkpoint():
    proj, reg = make_params(dtype=torch.bfloat16)
    opt = fk.FRUGAL(groups(proj, reg), projection="randk", **HYPER)
    run(opt, proj + reg, grad_sequence(proj + reg, 2))
    other = fk.FRUGAL(groups(*make_params(dtype=torch.bfloat16)), projection="randk", **HYPER)
    other.load_state_dict(_roundtrip(opt.state_dict()))
    for st in other.state.values():
        assert st["exp_avg"].dtype == torch.float32
        if "indices" in st:
            assert st["indices"].dtype == torch.int32


@pytest.mark.parametrize("mutate,message", [
    (lambda sd: sd.pop("frugal"), "not saved by a FRUGAL optimizer"),
    (lambda sd: sd["param_groups"].pop(), "1 param groups"),
    (lambda sd: sd["param_groups"][1]["params"].pop(), "params but the state dict"),
    (lambda sd: sd["param_groups"][1].update(projection="rows"), "projection is 'columns'"),
    (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(3, 3),
                                      exp_avg_sq=torch.zeros(3, 3)), "does not fit"),
    (lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].double()),
     "exp_avg has dtype"),
    (lambda sd: sd["state"][0].update(projector="a Python object"), "unknown entry"),
])
def test_a_state_dict_that_does_not_fit_raises_and_changes_nothing(mutate, message):
    opt, params = _make("FRUGAL", "columns")
    run(opt, params, grad_sequence(params, 2))
    sd = _roundtrip(opt.state_dict())
    mutate(sd)
    target, params2 = _make("FRUGAL", "columns")
    run(target, params2, grad_sequence(params2, 1, seed=3))
    before = target.state_dict()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(sd)
    after = target.state_dict()
    assert after["frugal"]["steps_taken"] == before["frugal"]["steps_taken"]
    for pid in before["state"]:
        for key, value in before["state"][pid].items():
            assert torch.equal(after["state"][pid][key], value)


def test_adafrugal_refuses_a_frugal_checkpoint():
    opt, params = _make("FRUGAL", "blocks")
    run(opt, params, grad_sequence(params, 2))
    ada, _ = _make("AdaFRUGAL", "blocks")
    with pytest.raises(ValueError, match="saved by FRUGAL, not AdaFRUGAL"):
        ada.load_state_dict(_roundtrip(opt.state_dict()))


def test_lr_scheduler_drives_the_step():
    seq = None
    results = []
    for use_scheduler in (True, False):
        opt, params = _make("FRUGAL", "columns")
        seq = seq or grad_sequence(params, 6)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1) if use_scheduler \
            else None
        for t, grads in enumerate(seq):
            if not use_scheduler:
                for g in opt.param_groups:
                    g["lr"] = HYPER["lr"] * 0.1 ** (t // 2)
            set_grads(params, grads)
            opt.step()
            if sched:
                sched.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_tensor_lr_equals_float_lr():
    a_opt, a = _make("FRUGAL", "randk")
    proj, reg = make_params()
    b_opt = fk.FRUGAL(groups(proj, reg), density=0.3, update_gap=3, projection="randk", seed=5,
                      **{**HYPER, "lr": torch.tensor(HYPER["lr"], dtype=torch.float64)})
    seq = grad_sequence(a, 5)
    run(a_opt, a, seq)
    run(b_opt, proj + reg, seq)
    for x, y in zip(a, proj + reg):
        assert torch.equal(x, y)


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    w = torch.nn.Parameter(torch.ones(4, 4))
    opt = fk.FRUGAL([{"params": [w]}], projection="columns", **HYPER)

    def closure():
        opt.zero_grad()
        loss = (w * 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 32.0
    assert not torch.equal(w, torch.ones(4, 4))


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


def test_grad_scaler_skips_steps_with_inf_and_unscales_the_rest():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    proj, reg = make_params()
    params = proj + reg
    opt = fk.FRUGAL(groups(proj, reg), projection="columns", update_gap=2, **HYPER)
    plain_proj, plain_reg = make_params()
    plain = fk.FRUGAL(groups(plain_proj, plain_reg), projection="columns", update_gap=2, **HYPER)
    seq = grad_sequence(params, 4)
    for t, grads in enumerate(seq):
        scaler.scale(torch.ones(()))  # what scaling a loss would do: start the scale
        if t == 2:
            bad = [g.clone() for g in grads]
            bad[0][0, 0] = float("inf")
            before = [p.detach().clone() for p in params]
            history = list(opt.history)
            set_grads(params, [g * scaler.get_scale() for g in bad])
            scaler.step(opt)
            scaler.update()
            assert all(torch.equal(p, b) for p, b in zip(params, before))
            assert opt.history == history
        set_grads(params, [g * scaler.get_scale() for g in grads])
        scaler.step(opt)
        scaler.update()
        set_grads(plain_proj + plain_reg, grads)
        plain.step()
    for a, b in zip(params, plain_proj + plain_reg):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_state_dict_holds_only_tensors_and_numbers_per_param():
    for projection in ALL_PROJECTIONS:
        opt, params = _make("FRUGAL", projection)
        run(opt, params, grad_sequence(params, 2))
        for st in opt.state_dict()["state"].values():
            for value in st.values():
                assert isinstance(value, (torch.Tensor, int, float)), projection


@pytest.mark.parametrize("projection,update_gap", [("columns", 3), ("blocks", 100)])
def test_compiled_step_matches_eager_and_lr_changes_do_not_recompile(projection, update_gap):
    """Subspace changes of coordinate kinds keep the graph; with blocks the set
    of tensors in each op call changes, which recompiles (docs/optimizers.md)."""
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        proj, reg = make_params()
        params = proj + reg
        opt = fk.FRUGAL(groups(proj, reg), density=0.3, update_gap=update_gap,
                        projection=projection, seed=5, **HYPER)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        step = torch.compile(opt.step) if compiled else opt.step
        for grads in grad_sequence(params, 8):
            set_grads(params, grads)
            step()
            sched.step()
        results.append([p.detach().clone() for p in params])
        if compiled:
            # one graph for the update, kept through 8 lr values (and 3 subspace changes)
            assert counters["stats"]["unique_graphs"] == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("projection", ALL_PROJECTIONS)
@pytest.mark.parametrize("first_has_grad", [True, False])
def test_group_without_gradients_is_left_alone(projection, first_has_grad):
    """A group none of whose tensors has a gradient (unused, or added before its
    first backward) is skipped; the groups with gradients step as usual."""
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(torch.randn(5))
    opt = fk.FRUGAL([{"params": [a]}, {"params": [b], "projected": False}], density=0.5,
                    projection=projection, **HYPER)
    stepped, idle = (a, b) if first_has_grad else (b, a)
    before_stepped, before_idle = stepped.detach().clone(), idle.detach().clone()
    for _ in range(3):
        stepped.grad = torch.randn_like(stepped)
        opt.step()
    assert not torch.equal(stepped, before_stepped)
    assert torch.equal(idle, before_idle)
    assert "exp_avg" not in opt.state[idle]  # moments come with the first gradient
