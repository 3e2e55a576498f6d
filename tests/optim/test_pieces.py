"""The pieces FRUGAL is built from: projection families, lazy state, the checkpoint
format, the memory-release helper and AdaFRUGAL's forwarded options."""

import io

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels.optim import frugal, memory, subspace_choice
from frugal_kernels.optim.projections import FAMILIES, CoordinateSubset

from .helpers import HYPER, grad_sequence, groups, make_params, set_grads


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_every_projection_has_one_family():
    assert tuple(FAMILIES) == subspace_choice.PROJECTIONS


def _make(projection, reset_state=True):
    proj, reg = make_params()
    opt = fk.FRUGAL(groups(proj, reg), density=0.4, update_gap=3, projection=projection,
                    reset_state=reset_state, seed=2, **HYPER)
    return opt, proj + reg


def _step(opt, params, grads, idle=()):
    """One step in which the tensors at the indices in ``idle`` have no gradient."""
    set_grads(params, grads)
    for i in idle:
        params[i].grad = None
    opt.step()


@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
def test_moments_wait_for_the_first_gradient(projection):
    """As in torch.optim, a tensor gets its moments at its first step with a gradient.
    A coordinate subset is still chosen meanwhile, so that the random draws are those
    of a run in which every tensor has a gradient."""
    opt, params = _make(projection)
    seq = grad_sequence(params, 5)
    for grads in seq[:4]:
        _step(opt, params, grads, idle=[0])
    st = opt.state[params[0]]
    assert "exp_avg" not in st and "exp_avg_sq" not in st
    if isinstance(FAMILIES[projection], CoordinateSubset):
        assert st["indices"].numel() > 0
    _step(opt, params, seq[4])
    st = opt.state[params[0]]
    # (blocks: the tensor gets moments only if it is in the state-full set)
    if projection != "blocks" or "exp_avg" in st:
        assert st["step"].item() == 1.0 and st["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("projection", subspace_choice.PROJECTIONS)
@pytest.mark.parametrize("reset_state", [True, False])
def test_resume_with_a_tensor_that_had_no_gradient_yet_is_bit_identical(projection, reset_state):
    n, m = 5, 6
    seq = grad_sequence(make_params()[0] + make_params()[1], n + m, seed=4)
    full, full_params = _make(projection, reset_state)
    for t, grads in enumerate(seq):
        _step(full, full_params, grads, idle=[0] if t < n + 2 else [])

    first, params = _make(projection, reset_state)
    for grads in seq[:n]:
        _step(first, params, grads, idle=[0])
    sd = _roundtrip(first.state_dict())
    saved = [p.detach().clone() for p in params]
    resumed, params2 = _make(projection, reset_state)
    with torch.no_grad():
        for p, s in zip(params2, saved):
            p.copy_(s)
    resumed.load_state_dict(sd)
    for t, grads in enumerate(seq[n:], start=n):
        _step(resumed, params2, grads, idle=[0] if t < n + 2 else [])
    for a, b in zip(params2, full_params):
        assert torch.equal(a, b)
    assert resumed.history == full.history


def _as_format_1(sd):
    """The layout of the "frugal" entry before the families kept their own records (a
    top-level entry, as format 2 kept it too)."""
    extra = dict(frugal._saved_extra(sd))
    records = extra.pop("subspaces")
    extra.update(version=1, chosen_groups=sorted(records),
                 active_blocks={gi: r["active"] for gi, r in records.items() if "active" in r},
                 block_cursor={gi: r["cursor"] for gi, r in records.items() if "cursor" in r})
    groups = [dict(g) for g in sd["param_groups"]]
    del groups[0]["frugal"]
    return {**sd, "param_groups": groups, "frugal": extra}


@pytest.mark.parametrize("block_order", ["random", "ascending"])
def test_a_checkpoint_of_format_1_resumes_exactly(block_order):
    def make():
        return fk.FRUGAL(groups(*make_params()), density=0.5, update_gap=2, seed=1,
                         block_order=block_order, **HYPER)

    full = make()
    full_params = [p for g in full.param_groups for p in g["params"]]
    seq = grad_sequence(full_params, 9)
    first = make()
    params = [p for g in first.param_groups for p in g["params"]]
    for grads in seq:
        _step(full, full_params, grads)
    for grads in seq[:5]:
        _step(first, params, grads)
    old = _roundtrip(_as_format_1(first.state_dict()))
    assert "subspaces" not in old["frugal"]
    resumed = make()
    params2 = [p for g in resumed.param_groups for p in g["params"]]
    with torch.no_grad():
        for p, s in zip(params2, params):
            p.copy_(s)
    resumed.load_state_dict(old)
    for grads in seq[5:]:
        _step(resumed, params2, grads)
    for a, b in zip(params2, full_params):
        assert torch.equal(a, b)


def test_a_low_rank_state_is_checked_against_its_projection():
    p = torch.nn.Parameter(torch.randn(12, 20))
    opt = fk.FRUGAL([{"params": [p]}], density=0.5, projection="random", **HYPER)
    p.grad = torch.randn(12, 20)
    opt.step()
    sd = _roundtrip(opt.state_dict())
    sd["state"][0]["projection"] = sd["state"][0]["projection"][:, :5]
    other = fk.FRUGAL([{"params": [torch.nn.Parameter(torch.randn(12, 20))]}], density=0.5,
                      projection="random", **HYPER)
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(sd)


def test_the_memory_release_helper_is_public_and_shared():
    import frugal_kernels.lab.train as train

    memory.release_freed_memory()  # a no-op where malloc_trim does not exist
    assert train.release_freed_memory is memory.release_freed_memory


def test_adafrugal_forwards_frugal_options_and_keeps_its_own_keyword_only():
    proj, reg = make_params()
    opt = fk.AdaFRUGAL(groups(proj, reg), 3e-3, rho_steps=10, projection="columns",
                       betas=(0.8, 0.9), state_free="sgd", seed=7, backend="torch")
    group = opt.param_groups[1]
    assert (group["lr"], group["betas"], group["projection"], group["state_free"]) == (
        3e-3, (0.8, 0.9), "columns", "sgd")
    assert opt.seed == 7 and opt.backend == "torch" and opt.update_gap == 100
    assert group["density"] == opt.rho == 0.25
    with pytest.raises(TypeError, match="not density"):
        fk.AdaFRUGAL(groups(proj, reg), rho_steps=10, density=0.5)
    with pytest.raises(TypeError):
        fk.AdaFRUGAL(groups(proj, reg), 1e-3, 0.5)  # rho_start is keyword-only
    with pytest.raises(TypeError):
        fk.AdaFRUGAL(groups(proj, reg), rho_steps=10, projections="rows")  # a typo


def test_one_add_counts_a_step_for_every_state_full_tensor():
    # The plan packs the bias-correction counts into one tensor, each state["step"]
    # a view of it: one add per step instead of one per tensor.
    proj, reg = make_params(seed=3)
    opt = fk.FRUGAL(groups(proj, reg), projection="columns", density=0.5, update_gap=100,
                    **HYPER)
    for t in range(3):
        set_grads(proj + reg, [torch.randn_like(p) for p in proj + reg])
        opt.step()
    steps = [st["step"] for st in opt.state.values() if "step" in st]
    assert len(steps) > 1 and all(float(s) == 3.0 for s in steps)
    storage = steps[0].untyped_storage().data_ptr()
    assert all(s.untyped_storage().data_ptr() == storage for s in steps)
    # state_bytes counts that storage once.
    moments = sum(st[k].numel() * 4 for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")
                  if k in st)
    others = sum(v.untyped_storage().nbytes() for st in opt.state.values()
                 for k, v in st.items() if isinstance(v, torch.Tensor)
                 and k not in ("exp_avg", "exp_avg_sq", "step"))
    assert opt.state_bytes() == moments + others + steps[0].untyped_storage().nbytes()
