"""Bad input: atomic steps and loads, aliasing, layouts, option checks, non-finite gradients.

Each test that injects a failure takes a full snapshot of the optimizer
(params, every state entry, the generator, history, step counts, subspaces)
before it and compares after: a step or a load that raises changes nothing.
"""

import copy
import io
import math

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels._layout import RIGHT, lowrank_side
from frugal_kernels.optim import frugal, subspace_choice

from .helpers import HYPER, grad_sequence, groups, make_params, set_grads

KINDS = ["FRUGAL", "AdaFRUGAL"]


def _make(kind, projection, update_gap=2, **options):
    proj, reg = make_params()
    if kind == "FRUGAL":
        opt = fk.FRUGAL(groups(proj, reg), density=0.3, update_gap=update_gap,
                        projection=projection, seed=5, **HYPER, **options)
    else:
        opt = fk.AdaFRUGAL(groups(proj, reg), rho_start=0.5, rho_end=0.1, rho_steps=10,
                           update_gap=update_gap, update_gap_max=8, projection=projection,
                           seed=5, **HYPER, **options)
    return opt, proj + reg


def _steps(opt, params, n, seed=1):
    for grads in grad_sequence(params, n, seed=seed):
        set_grads(params, grads)
        opt.step()


def _snapshot(opt, params):
    sd = opt.state_dict()
    return {"params": [p.detach().clone() for p in params],
            "state": copy.deepcopy(sd["state"]),
            "param_groups": copy.deepcopy(sd["param_groups"]),
            "generator": opt._generator.get_state().clone(),
            "live_state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                               for k, v in opt.state[p].items()}
                           for i, p in enumerate(params) if p in opt.state}}


def _assert_same(a, b, where="snapshot"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"  # NaN equals NaN here


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------ atomic steps

def _set_lr(value):
    def inject(opt, params):
        opt.param_groups[1]["lr"] = value
    return inject


def _sparse_grad(opt, params):
    params[3].grad = params[3].grad.to_sparse()


def _wrong_dtype_grad(opt, params):
    params[3].grad_dtype = None  # torch refuses the assignment otherwise
    params[3].grad = params[3].grad.double()


def _non_contiguous_param(opt, params):
    # What swapping .data for a transposed copy does (the shape is kept).
    params[3].data = params[3].data.transpose(0, -1).contiguous().transpose(0, -1)


def _bad_betas(opt, params):
    opt.param_groups[1]["betas"] = (1.5, 0.99)


def _bad_state_free(opt, params):
    opt.param_groups[1]["state_free"] = "adam"


STEP_FAILURES = {
    "lr=inf": (_set_lr(math.inf), "lr must be finite"),
    "lr=nan": (_set_lr(math.nan), "lr must be finite"),
    "lr=-1": (_set_lr(-1.0), "lr must be finite and >= 0"),
    "lr=tensor(inf)": (_set_lr(torch.tensor(math.inf)), "lr must be finite"),
    "sparse grad": (_sparse_grad, "params\\[3\\] of param group 1 .* sparse gradient"),
    "grad dtype": (_wrong_dtype_grad, "params\\[3\\] of param group 1 .* gradient of dtype"),
    "non-contiguous param": (_non_contiguous_param, "params\\[3\\] of param group 1 .* not "
                                                    "contiguous"),
    "bad betas": (_bad_betas, "betas must be in"),
    "bad state_free": (_bad_state_free, "state_free must be one of"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
@pytest.mark.parametrize("failure", list(STEP_FAILURES))
def test_a_step_that_raises_changes_nothing(kind, projection, failure):
    """The failing step is due to change the subspace (update_gap=2, third step), and the
    failure is in the last tensor of the last group: before this was fixed the counters,
    the subspace and the first group's tensors had moved before the error."""
    inject, message = STEP_FAILURES[failure]
    opt, params = _make(kind, projection)
    _steps(opt, params, 2)
    set_grads(params, grad_sequence(params, 1, seed=9)[0])
    inject(opt, params)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=message):
        opt.step()
    _assert_same(before, _snapshot(opt, params))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", ["random", "svd"])
def test_a_failure_while_choosing_the_subspace_is_undone(kind, projection, monkeypatch):
    """A projection that fails (an svd that does not converge, say) after others were drawn
    from the generator: the generator, state, records and counters are restored, and the
    next step behaves as if the failed one never happened."""
    opt, params = _make(kind, projection)
    twin, twin_params = _make(kind, projection)
    _steps(opt, params, 2)
    _steps(twin, twin_params, 2)
    grads = grad_sequence(params, 2, seed=9)
    set_grads(params, grads[0])
    before = _snapshot(opt, params)
    real, calls = subspace_choice.make_projection, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.linalg.LinAlgError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(subspace_choice, "make_projection", flaky)
    with pytest.raises(torch.linalg.LinAlgError):
        opt.step()
    assert len(calls) == 3  # two projections were made (and drawn) before the failure
    _assert_same(before, _snapshot(opt, params))
    monkeypatch.setattr(subspace_choice, "make_projection", real)
    for g in grads:
        set_grads(params, g)
        opt.step()
        set_grads(twin_params, g)
        twin.step()
    _assert_same(_snapshot(twin, twin_params), _snapshot(opt, params))


# ------------------------------------------------------------------ atomic loads

def _ids(pid, fn):
    def mutate(sd):
        sd["state"][pid]["indices"] = fn(sd["state"][pid]["indices"])
    return mutate


def _projection(fn):
    def mutate(sd):
        sd["state"][2]["projection"] = fn(sd["state"][2]["projection"])
    return mutate


def _extra(fn):
    """Change the "frugal" entry as format 2 held it (a map of subspaces, a history of
    dicts), written back in the state dict's format."""
    def mutate(sd):
        extra = frugal._saved_extra(sd)
        fn(extra)
        sd["param_groups"][0]["frugal"] = frugal._encode_extra(extra)
    return mutate


def _swap_first_two(ids):
    ids = ids.clone()
    ids[[0, 1]] = ids[[1, 0]]
    return ids


def _duplicate_first(ids):
    ids = ids.clone()
    ids[1] = ids[0]
    return ids


# (projection, mutation, message); params 0..3 of the projected group are state 2..5
LOAD_FAILURES = {
    "columns id beyond": ("columns", _ids(2, lambda i: i + 1000), "beyond the 40 columns"),
    "rows id beyond": ("rows", _ids(2, lambda i: i + 1000), "beyond the 24 rows"),
    "randk id beyond": ("randk", _ids(2, lambda i: i + 10_000), "beyond the 960 flat"),
    "negative id": ("columns", _ids(2, lambda i: i - 1000), "indices range over"),
    "unsorted ids": ("rows", _ids(2, _swap_first_two), "sorted and unique"),
    "duplicate ids": ("randk", _ids(2, _duplicate_first), "sorted and unique"),
    "float ids": ("columns", _ids(2, lambda i: i.float()), "int32 or int64"),
    "ids missing": ("columns", lambda sd: sd["state"][2].pop("indices"), "indices are missing"),
    "truncated projection": ("svd", _projection(lambda p: p[:-1]), "does not fit"),
    "projection of another model": ("random", _projection(lambda p: torch.zeros(p.shape[0] + 5, p.shape[1])),
                                    "does not fit"),
    "projection dtype": ("svd", _projection(lambda p: p.double()), "2-D float32"),
    "projection missing": ("svd", lambda sd: sd["state"][2].pop("projection"),
                           "projection is missing"),
    "step missing": ("blocks", lambda sd: [st.pop("step", None) for st in sd["state"].values()],
                     "step count is missing"),
    "step nan": ("columns", lambda sd: sd["state"][0].update(step=torch.tensor(math.nan)),
                 "step count"),
    "step a float": ("columns", lambda sd: sd["state"][0].update(step=3.0), "not a tensor"),
    "generator missing": ("columns", _extra(lambda e: e.pop("generator")), "lacks generator"),
    "generator garbage": ("columns", _extra(lambda e: e.update(generator=torch.zeros(3,
                          dtype=torch.uint8))), "generator state cannot be restored"),
    "steps_taken missing": ("blocks", _extra(lambda e: e.pop("steps_taken")),
                            "lacks steps_taken"),
    "steps_taken a str": ("blocks", _extra(lambda e: e.update(steps_taken="3")),
                          "steps_taken must be an int"),
    "update_gap 0": ("blocks", _extra(lambda e: e.update(update_gap=0)), "update_gap must be"),
    "subspace of a regular group": ("blocks", _extra(lambda e: e["subspaces"].update({0: {}})),
                                    "not a projected group"),
    "active block beyond": ("blocks", _extra(lambda e: e["subspaces"][1].update(active=[0, 9])),
                            "not sorted unique ids"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("failure", list(LOAD_FAILURES))
def test_a_load_that_raises_changes_nothing(kind, failure):
    projection, mutate, message = LOAD_FAILURES[failure]
    source, source_params = _make(kind, projection)
    _steps(source, source_params, 3)
    sd = _roundtrip(source.state_dict())
    mutate(sd)
    target, params = _make(kind, projection)
    _steps(target, params, 1, seed=3)
    before = _snapshot(target, params)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(sd)
    _assert_same(before, _snapshot(target, params))


@pytest.mark.parametrize("source_kind,target_kind,message", [
    ("FRUGAL", "AdaFRUGAL", "saved by FRUGAL, not AdaFRUGAL"),
    ("AdaFRUGAL", "FRUGAL", "does not know: losses, next_rho_scale, rho_scale"),
])
def test_a_checkpoint_of_the_other_optimizer_is_refused_and_changes_nothing(
        source_kind, target_kind, message):
    source, source_params = _make(source_kind, "columns")
    _steps(source, source_params, 3)
    target, params = _make(target_kind, "columns")
    _steps(target, params, 1, seed=3)
    before = _snapshot(target, params)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(_roundtrip(source.state_dict()))
    _assert_same(before, _snapshot(target, params))


def test_adafrugal_schedule_state_is_checked():
    source, source_params = _make("AdaFRUGAL", "columns")
    _steps(source, source_params, 3)
    sd = _roundtrip(source.state_dict())
    sd["param_groups"][0]["frugal"]["rho_scale"] = math.nan
    target, params = _make("AdaFRUGAL", "columns")
    before = _snapshot(target, params)
    with pytest.raises(ValueError, match="rho_scale must be finite"):
        target.load_state_dict(sd)
    _assert_same(before, _snapshot(target, params))


# -------------------------------------------------------------------- aliasing

def _param(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


def test_a_parameter_twice_in_one_group_is_refused():
    a, b = _param(6, 4), _param(6, 4)
    with pytest.raises(ValueError, match="params\\[2\\] of param group 0 .* is the same tensor "
                                         "as params\\[0\\] of param group 0"):
        fk.FRUGAL([a, b, a])


def test_a_parameter_in_two_groups_is_refused():
    a, b = _param(6, 4), _param(5)
    with pytest.raises(ValueError, match="params\\[1\\] of param group 1 .* is the same tensor "
                                         "as params\\[0\\] of param group 0"):
        fk.FRUGAL([{"params": [a]}, {"params": [b, a], "projected": False}])


def test_add_param_group_refuses_a_parameter_already_there_and_changes_nothing():
    a, b = _param(6, 4), _param(5)
    opt = fk.AdaFRUGAL([a, b], rho_steps=10)
    with pytest.raises(ValueError, match="is the same tensor as params\\[1\\] of param group 0"):
        opt.add_param_group({"params": [b], "projected": False})
    assert len(opt.param_groups) == 1


def test_parameters_that_share_memory_are_refused():
    base = torch.randn(8, 4)
    a = torch.nn.Parameter(base)
    b = torch.nn.Parameter(base.view(32))
    with pytest.raises(ValueError, match="shares memory with params\\[0\\] of param group 0"):
        fk.FRUGAL([a, b])
    overlapping = torch.nn.Parameter(base[2:6])
    with pytest.raises(ValueError, match="shares memory"):
        fk.FRUGAL([{"params": [a]}, {"params": [overlapping], "projected": False}])


def test_disjoint_views_of_one_buffer_are_accepted():
    """Views that do not overlap (a flat parameter buffer cut into tensors) are separate
    tensors for the ops: nothing is updated twice."""
    flat = torch.randn(40)
    a, b = torch.nn.Parameter(flat[:24].view(6, 4)), torch.nn.Parameter(flat[24:])
    opt = fk.FRUGAL([a, b], density=1.0, projection="columns")
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()


# ------------------------------------------------------------ layouts, sparsity

def test_a_non_contiguous_parameter_is_refused_at_construction_with_advice_that_works():
    p = torch.nn.Parameter(torch.randn(6, 4).t())
    with pytest.raises(ValueError, match="not contiguous.*param.data = param.data.contiguous()"):
        fk.FRUGAL([p])
    with torch.no_grad():
        p.data = p.data.contiguous()  # the advice, applied to the Parameter itself
    opt = fk.FRUGAL([p], projection="columns", density=0.5)
    p.grad = torch.randn_like(p)
    opt.step()


def test_a_channels_last_conv_is_refused_and_the_advice_works():
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="memory_format=torch.contiguous_format"):
        fk.FRUGAL(conv.parameters())
    conv.to(memory_format=torch.contiguous_format)
    fk.FRUGAL(conv.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_a_sparse_embedding_gradient_is_named_before_anything_changes(kind):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 4)
    params = [lin.weight, lin.bias, emb.weight]
    options = dict(rho_steps=10) if kind == "AdaFRUGAL" else {}
    opt = getattr(fk, kind)([{"params": [lin.weight]},
                             {"params": [lin.bias, emb.weight], "projected": False}], **options)
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match="params\\[1\\] of param group 1 \\(shape \\(10, 4\\)"
                                         ".*sparse gradient.*sparse=False"):
        opt.step()
    _assert_same(before, _snapshot(opt, params))


# --------------------------------------------------------------- option checks

BAD_OPTIONS = [
    (dict(lr=math.inf), ValueError), (dict(lr=math.nan), ValueError),
    (dict(lr=torch.tensor(-1.0)), ValueError), (dict(lr=torch.tensor(math.inf)), ValueError),
    (dict(lr="0.1"), TypeError), (dict(eps=-1e-8), ValueError), (dict(eps=math.nan), ValueError),
    (dict(weight_decay=-0.1), ValueError), (dict(weight_decay=math.inf), ValueError),
    (dict(betas=(0.9,)), ValueError), (dict(betas=0.9), ValueError),
    (dict(betas=(0.9, 0.99, 0.9)), ValueError), (dict(betas=(0.9, math.nan)), ValueError),
    (dict(betas=(-0.1, 0.99)), ValueError), (dict(update_gap=True), TypeError),
    (dict(update_gap=2.5), TypeError), (dict(density=math.nan), ValueError),
    (dict(density=True), TypeError), (dict(state_free_lr_scale=math.inf), ValueError),
    (dict(seed=1.5), TypeError), (dict(seed=True), TypeError),
    (dict(backend="fpga"), ValueError), (dict(nonfinite="ignore"), ValueError),
]


@pytest.mark.parametrize("bad,error", BAD_OPTIONS, ids=lambda x: repr(x)[:40])
def test_frugal_rejects_bad_options_with_torchs_error_types(bad, error):
    proj, reg = make_params()
    with pytest.raises(error):
        fk.FRUGAL(groups(proj, reg), **{**HYPER, **bad})


ADA_BAD_OPTIONS = [
    (dict(gap_growth=math.inf), ValueError), (dict(gap_growth=0.5), ValueError),
    (dict(loss_tolerance=math.nan), ValueError), (dict(loss_tolerance=-0.1), ValueError),
    (dict(rho_start=math.nan), ValueError), (dict(rho_end=math.nan), ValueError),
    (dict(rho_start=0.1, rho_end=0.2), ValueError), (dict(rho_steps=2.5), TypeError),
    (dict(rho_steps=0), ValueError), (dict(update_gap=True), TypeError),
    (dict(update_gap_max=5.5), TypeError), (dict(update_gap_max=True), TypeError),
    (dict(update_gap=10, update_gap_max=5), ValueError), (dict(loss_window=1), ValueError),
    (dict(loss_window=2.0), TypeError), (dict(seed="0"), TypeError),
    (dict(lr=math.inf), ValueError), (dict(nonfinite="ignore"), ValueError),
]


@pytest.mark.parametrize("bad,error", ADA_BAD_OPTIONS, ids=lambda x: repr(x)[:40])
def test_adafrugal_rejects_bad_options_with_torchs_error_types(bad, error):
    proj, reg = make_params()
    with pytest.raises(error):
        fk.AdaFRUGAL(groups(proj, reg), **{**dict(rho_steps=10, update_gap=2), **bad})


def test_add_param_group_checks_its_options():
    opt = fk.FRUGAL([_param(6, 4)])
    with pytest.raises(ValueError, match="param group 1: lr must be finite"):
        opt.add_param_group({"params": [_param(5)], "lr": math.inf})
    assert len(opt.param_groups) == 1


# --------------------------------------------------------- non-finite gradients

NONFINITE = [math.nan, math.inf, -math.inf]


def _bad_grads(params, value, which):
    grads = grad_sequence(params, 1, seed=9)[0]
    grads[which].view(-1)[1] = value
    return grads


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", [0, 4])  # a projected tensor, a regular one
def test_a_nonfinite_gradient_skips_the_step_by_default(kind, projection, value, which):
    """The skipped step (the third: a subspace change, update_gap=2) moves no param,
    and its schedule counts the call as a GradScaler's skip does (the host never
    reads the flag): the run goes on exactly as a twin whose same step a found_inf
    skipped. tests/optim/test_no_host_sync.py checks a skip between changes, where
    every state tensor and step count stays bit-identical too."""
    opt, params = _make(kind, projection)
    twin, twin_params = _make(kind, projection)
    assert opt.nonfinite == "skip"
    _steps(opt, params, 2)
    _steps(twin, twin_params, 2)
    bad = _bad_grads(params, value, which)
    set_grads(params, bad)
    before = [p.detach().clone() for p in params]
    opt.step()
    for i, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p, b), f"params[{i}] moved at a skipped step"
    set_grads(twin_params, [g.clone() for g in bad])
    twin.found_inf = torch.ones(())
    twin.step()
    del twin.found_inf
    _assert_same(_snapshot(twin, twin_params), _snapshot(opt, params))
    for g in grad_sequence(params, 3, seed=4):
        set_grads(params, g)
        opt.step()
        set_grads(twin_params, g)
        twin.step()
    _assert_same(_snapshot(twin, twin_params), _snapshot(opt, params))


@pytest.mark.parametrize("value", NONFINITE)
def test_an_svd_subspace_chosen_at_a_skipped_step_ignores_the_nonfinite_entries(value):
    """A skipped step still changes subspaces (the host never learns of the skip): svd's
    is that of the gradient with its NaN / inf entries as 0, finite, so the steps that
    use it until the next change are not poisoned (torch's svd would fail or give NaN)."""
    opt, params = _make("FRUGAL", "svd")  # update_gap=2: changes at steps 1 and 3
    _steps(opt, params, 2)
    grads = _bad_grads(params, value, 0)
    set_grads(params, grads)
    opt.step()
    assert opt.history[-1]["step"] == 3
    proj = opt.state[params[0]]["projection"]
    side = lowrank_side(params[0].shape)
    rank = proj.shape[0] if side == RIGHT else proj.shape[1]
    clean = grads[0].clone()
    clean.view(-1)[1] = 0.0
    assert torch.equal(proj, subspace_choice.make_projection("svd", clean, rank, opt._generator))
    _steps(opt, params, 1, seed=6)
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(v).all() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.is_floating_point())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
@pytest.mark.parametrize("value", NONFINITE)
def test_nonfinite_raise_names_the_parameter_and_changes_nothing(kind, projection, value):
    opt, params = _make(kind, projection, nonfinite="raise")
    _steps(opt, params, 2)
    set_grads(params, _bad_grads(params, value, 3))
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match="params\\[3\\] of param group 1 \\(shape \\(3, 4, 10\\)"
                                         ".*non-finite gradient"):
        opt.step()
    _assert_same(before, _snapshot(opt, params))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
@pytest.mark.parametrize("value", NONFINITE)
def test_nonfinite_propagate_applies_the_step(kind, projection, value):
    """Today's behaviour: the step is taken; the AdamW coordinate of a regular tensor
    takes the non-finite gradient into its param and moments."""
    opt, params = _make(kind, projection, nonfinite="propagate")
    _steps(opt, params, 2)
    set_grads(params, _bad_grads(params, value, 4))
    steps_taken = opt.state_dict()["param_groups"][0]["frugal"]["steps_taken"]
    opt.step()
    assert opt.state_dict()["param_groups"][0]["frugal"]["steps_taken"] == steps_taken + 1
    assert not torch.isfinite(params[4]).all()
    assert not torch.isfinite(opt.state[params[4]]["exp_avg"]).all()


def test_nonfinite_skip_costs_nothing_more_under_a_grad_scaler(monkeypatch):
    """A GradScaler's found_inf already decides the step: the optimizer's own check
    (one read of the gradients) is not run."""
    from frugal_kernels.optim import engine
    calls = []
    real = engine._nonfinite_flag
    monkeypatch.setattr(engine, "_nonfinite_flag", lambda g: calls.append(1) or real(g))
    opt, params = _make("FRUGAL", "columns")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    set_grads(params, [g * 4.0 for g in grad_sequence(params, 1)[0]])
    scaler.step(opt)
    assert calls == []
    _steps(opt, params, 1)
    assert calls == [1]
