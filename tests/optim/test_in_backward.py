"""The optimizer step inside backward (frugal_kernels.step_in_backward).

Every entry of the optimizer table (tests/optim_db.py), and the swapped torch
optimizers, trains twice from the same start on the same gradients: once with the
ordinary loop (backward ``k`` times, then ``step()``), once with its tensors stepped
in backward. Each gradient comes from a real backward pass (of ``sum(p * g)``, whose
gradient is exactly ``g``), so the two loops accumulate micro-batches in the same
order; the updates are the same op calls on the same numbers, one tensor per call
instead of a bucket, so the parameters and the state must agree bit for bit (no
sign-based coordinate can flip, DESIGN.md section 6).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.optim.in_backward import handle_of

from ..optim_db import OPTIMIZERS, OptimizerInfo, values
from .helpers import HYPER, assert_same, grad_sequence, groups, make_params, roundtrip

STEPS = 8


def _grouped(seed):
    proj, reg = make_params(seed=seed)
    return groups(proj, reg), proj + reg


def _swapped(kind, **options):
    def factory(inputs, **extra):
        return fk.swap(kind(inputs, **{**options, **extra}))
    return factory


# The torch optimizers step_in_backward takes once swapped onto the fused ops.
SWAPPED = (
    OptimizerInfo("swap-AdamW", _grouped, _swapped(torch.optim.AdamW, **HYPER)),
    OptimizerInfo("swap-Adam-L2", _grouped, _swapped(torch.optim.Adam, lr=1e-2,
                                                     weight_decay=0.1)),
    OptimizerInfo("swap-SGD-momentum", _grouped, _swapped(torch.optim.SGD, lr=1e-2,
                                                          momentum=0.9, nesterov=True,
                                                          weight_decay=0.1)),
)
ENTRIES = [pytest.param(info, id=info.name) for info in OPTIMIZERS + SWAPPED]


def _build(info, seed=0):
    return info.build(seed=seed, **info.in_backward_options)


def _backward(params, grads):
    """A backward pass whose gradient for each trainable tensor is exactly ``grads``'s."""
    loss = sum((p * g).sum() for p, g in zip(params, grads) if p.requires_grad)
    loss.backward()


def _train(info, opt, params, grad_seq, k=1, start=0):
    """The ordinary loop with gradient accumulation, whether or not the step runs in
    backward: ``k`` backward passes, then step() and zero_grad()."""
    for t in range(len(grad_seq) // k):
        for j in range(k):
            _backward(params, grad_seq[t * k + j])
        opt.step()
        opt.zero_grad()
        if info.after_step is not None:
            info.after_step(opt, start + t)


def _assert_equal(a_params, b_params):
    """Equal values (a DQT weight's are its codes, optim_db.values)."""
    for i, (a, b) in enumerate(zip(values(a_params), values(b_params))):
        assert torch.equal(a, b), \
            f"param {i} differs by {(a.double() - b.double()).abs().max().item():.3g}"


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("info", ENTRIES)
def test_equals_the_ordinary_step(info, k):
    ordinary, params = _build(info)
    seq = grad_sequence(params, STEPS * k, seed=9)
    _train(info, ordinary, params, seq, k)

    opt, params2 = _build(info)
    handle = fk.step_in_backward(opt, accumulation_steps=k)
    _train(info, opt, params2, seq, k)
    assert handle.steps == STEPS
    _assert_equal(params2, params)
    assert_same(opt.state_dict(), ordinary.state_dict())
    assert all(p.grad is None for p in params2)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("info", ENTRIES)
def test_one_gradient_is_alive_at_a_time(info, k):
    """Counted in a hook that runs before the step's own: the tensor whose gradient just
    completed, and those still accumulating (earlier micro-batches' gradients of tensors
    this backward has not reached yet); every gradient stepped before is freed."""
    opt, params = _build(info)
    before, fired, stepped_refs, checks = set(), set(), [], []
    stepping = [False]

    def watch(p):
        alive = {q for q in params if q.grad is not None}
        if stepping[0]:
            expected = ({p} | before) - fired
            assert alive == expected, f"{len(alive)} gradients alive, expected {len(expected)}"
            assert all(ref() is None for ref in stepped_refs), "a stepped gradient is alive"
            stepped_refs.append(weakref.ref(p.grad))
        else:
            assert alive == before | fired | {p}
        fired.add(p)
        checks.append(len(alive))

    # Watchers first, so that they run before the step's hooks; BAdam's frozen blocks are
    # watched too (a hook needs requires_grad while it is registered).
    for p in params:
        frozen = not p.requires_grad
        p.requires_grad_(True)
        p.register_post_accumulate_grad_hook(watch)
        p.requires_grad_(not frozen)
    fk.step_in_backward(opt, accumulation_steps=k)
    seq = grad_sequence(params, 4 * k)
    for t in range(4):
        for j in range(k):
            stepping[0] = j == k - 1
            before = {q for q in params if q.grad is not None}
            fired.clear()
            stepped_refs.clear()
            _backward(params, seq[t * k + j])
        opt.step()
        opt.zero_grad()
    assert checks and max(checks) <= (1 if k == 1 else len(params))
    if k == 1:
        assert set(checks) == {1}


@pytest.mark.parametrize("info", ENTRIES)
def test_state_dict_and_exact_resume_are_unchanged(info):
    n, m = 5, 4
    full, params = _build(info)
    seq = grad_sequence(params, n + m, seed=9)
    _train(info, full, params, seq[:n])
    saved_ordinary = roundtrip(full.state_dict())  # state_dict() holds the live tensors
    _train(info, full, params, seq[n:], start=n)

    first, params1 = _build(info)
    fk.step_in_backward(first)
    _train(info, first, params1, seq[:n])
    sd = roundtrip(first.state_dict())
    assert_same(sd, saved_ordinary)
    saved_params = values(params1, clone=True)
    del first

    # Resumed in backward from a checkpoint written in backward...
    resumed, params2 = _build(info, seed=123)
    with torch.no_grad():
        for v, s in zip(values(params2), saved_params):
            v.copy_(s)
    resumed.load_state_dict(roundtrip(sd))  # torch's loader may keep sd's tensors
    fk.step_in_backward(resumed)
    _train(info, resumed, params2, seq[n:], start=n)
    _assert_equal(params2, params)
    # ...and with the ordinary step: the checkpoints are the same.
    plain, params3 = _build(info, seed=123)
    with torch.no_grad():
        for v, s in zip(values(params3), saved_params):
            v.copy_(s)
    plain.load_state_dict(roundtrip(sd))
    _train(info, plain, params3, seq[n:], start=n)
    _assert_equal(params3, params)


@pytest.mark.parametrize("info", ENTRIES)
def test_remove_restores_the_ordinary_step(info):
    ordinary, params = _build(info)
    seq = grad_sequence(params, 6)
    _train(info, ordinary, params, seq)

    opt, params2 = _build(info)
    step_before = opt.__dict__.get("step")
    handle = fk.step_in_backward(opt)
    assert handle_of(opt) is handle and "step" in opt.__dict__
    _train(info, opt, params2, seq[:3])
    handle.remove()
    handle.remove()  # a second remove changes nothing
    assert handle_of(opt) is None and opt.__dict__.get("step") is step_before
    assert all(not p._post_accumulate_grad_hooks for p in params2
               if p._post_accumulate_grad_hooks is not None)
    # The ordinary step again: gradients stay until step(), which uses them.
    _backward(params2, seq[3])
    assert any(p.grad is not None for p in params2)
    opt.step()
    opt.zero_grad()
    if info.after_step is not None:
        info.after_step(opt, 3)
    _train(info, opt, params2, seq[4:], start=4)
    _assert_equal(params2, params)
    # And in backward once more.
    fk.step_in_backward(opt).remove()


@pytest.mark.parametrize("info", [pytest.param(i, id=i.name) for i in OPTIMIZERS[:1]
                                  + OPTIMIZERS[-1:] + SWAPPED[:1]])
def test_lr_scheduler_and_closure(info):
    results = []
    for in_backward in (False, True):
        opt, params = _build(info)
        if in_backward:
            fk.step_in_backward(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for t, grads in enumerate(grad_sequence(params, 5)):
            def closure(grads=grads):
                loss = sum((p * g).sum() for p, g in zip(params, grads) if p.requires_grad)
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor)
            opt.zero_grad()
            sched.step()
        results.append(list(params))
    _assert_equal(*results)


# ------------------------------------------------------------------ clipping


def test_per_tensor_clip_clips_each_gradient_by_its_own_norm():
    info = OPTIMIZERS[0]
    seq = [[g * 10 for g in grads] for grads in grad_sequence(_build(info)[1], 4)]
    ordinary, params = _build(info)
    for grads in seq:
        _backward(params, grads)
        for p in params:
            coef = torch.clamp(0.5 / (torch.linalg.vector_norm(p.grad) + 1e-6), max=1.0)
            p.grad.mul_(coef)
        ordinary.step()
        ordinary.zero_grad()
    opt, params2 = _build(info)
    fk.step_in_backward(opt, max_grad_norm=0.5)
    _train(info, opt, params2, seq)
    _assert_equal(params2, params)


@pytest.mark.parametrize("info", [pytest.param(i, id=i.name) for i in OPTIMIZERS[:1]
                                  + SWAPPED[:1]])
def test_two_pass_global_clip_equals_clip_grad_norm(info):
    seq = grad_sequence(_build(info)[1], 4)
    ordinary, params = _build(info)
    # The norm is taken over the tensors in the optimizer's order (the order of the sum
    # decides its last bit).
    in_order = [p for group in ordinary.param_groups for p in group["params"]]
    for grads in seq:
        _backward(params, grads)
        torch.nn.utils.clip_grad_norm_(in_order, 1.0)
        ordinary.step()
        ordinary.zero_grad()
    opt, params2 = _build(info)
    handle = fk.step_in_backward(opt, max_grad_norm=1.0, clip="global")
    for grads in seq:
        loss = sum((p * g).sum() for p, g in zip(params2, grads))
        with handle.norm_pass():
            loss.backward(retain_graph=True)
        assert all(p.grad is None for p in params2)
        loss.backward()
        opt.step()
    _assert_equal(params2, params)


def test_global_clip_without_its_norm_pass_raises_and_the_next_step_works():
    opt, params = _build(OPTIMIZERS[0])
    handle = fk.step_in_backward(opt, max_grad_norm=1.0, clip="global")
    before = [p.detach().clone() for p in params]
    grads = grad_sequence(params, 1)[0]
    with pytest.raises(RuntimeError, match="norm_pass"):
        _backward(params, grads)
    _assert_equal(params, before)
    opt.zero_grad()
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    with handle.norm_pass():
        loss.backward(retain_graph=True)
    loss.backward()
    assert handle.steps == 1 and not torch.equal(params[0], before[0])


# ----------------------------------------------------- what cannot work says so


@pytest.mark.parametrize("info", [pytest.param(i, id=i.name) for i in OPTIMIZERS[:1]
                                  + OPTIMIZERS[-1:] + SWAPPED[:1]])
def test_a_grad_scaler_raises(info):
    opt, params = _build(info)
    fk.step_in_backward(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = sum((p * g).sum() for p, g in zip(params, grad_sequence(params, 1)[0])
               if p.requires_grad)
    scaler.scale(loss).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot drive a step in backward"):
        scaler.step(opt)


def test_refusals_name_what_to_change():
    proj, reg = make_params()
    with pytest.raises(TypeError, match=r"frugal_kernels.swap\(optimizer\)"):
        fk.step_in_backward(torch.optim.AdamW(proj + reg))
    with pytest.raises(TypeError, match="step_in_backward takes"):
        fk.step_in_backward(torch.optim.RMSprop(proj + reg))
    opt = fk.FRUGAL(groups(proj, reg), nonfinite="raise")
    for bad in (dict(accumulation_steps=True), dict(accumulation_steps=2.0),
                dict(max_grad_norm="1")):
        with pytest.raises(TypeError):
            fk.step_in_backward(opt, **bad)
    for bad, message in [(dict(accumulation_steps=0), "accumulation_steps"),
                         (dict(max_grad_norm=-1.0), "max_grad_norm"),
                         (dict(max_grad_norm=float("inf")), "max_grad_norm"),
                         (dict(clip="layer"), "clip must be one of"),
                         (dict(max_grad_norm=1.0, clip="global", accumulation_steps=2),
                          "accumulation_steps > 1")]:
        with pytest.raises(ValueError, match=message):
            fk.step_in_backward(opt, **bad)
    handle = fk.step_in_backward(opt)
    with pytest.raises(ValueError, match="already steps in backward"):
        fk.step_in_backward(opt)
    with pytest.raises(RuntimeError, match="clip='global'"):
        with handle.norm_pass():
            pass
    # Switched to skip after the hooks were set: the next step skips per tensor.
    opt.nonfinite = "skip"
    grads = grad_sequence(proj + reg, 1)[0]
    grads[0] = torch.full_like(grads[0], float("nan"))
    before = proj[0].detach().clone()
    _backward(proj + reg, grads)
    assert handle.nonfinite_skips == 1 and torch.equal(proj[0], before)


def test_a_non_finite_gradient_raises_from_backward_naming_its_tensor():
    opt, params = _build(OPTIMIZERS[0])
    handle = fk.step_in_backward(opt)
    grads = grad_sequence(params, 2)
    grads[0][0] = grads[0][0].clone()
    grads[0][0].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=r"params\[0\] of param group 1 .* non-finite"):
        _backward(params, grads[0])
    opt.zero_grad()
    _backward(params, grads[1])  # the next backward steps again
    assert handle.steps == 1 and all(p.grad is None for p in params)


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
def test_badam_in_backward_follows_its_nonfinite_policy(inner):
    """Under "raise" a non-finite gradient of BAdam's active block raises from backward
    (its default "skip": test_the_default_skips_each_non_finite_tensor_and_goes_on)."""
    info = next(i for i in OPTIMIZERS if i.name == ("BAdam-frugal" if inner == "frugal"
                                                      else "BAdam-ascending"))
    opt, params = _build(info)
    assert opt.nonfinite == "raise"
    fk.step_in_backward(opt)
    active = info.moved(opt, params)
    grads = grad_sequence(params, 1)[0]
    at = next(i for i, p in enumerate(params) if p is active[0])
    grads[at] = grads[at].clone()
    grads[at].view(-1)[0] = float("inf")
    before = active[0].detach().clone()
    with pytest.raises(ValueError, match="non-finite gradient"):
        _backward(params, grads)
    assert torch.equal(active[0], before)


def _nan_at(grads, i):
    grads[i] = grads[i].clone()
    grads[i].view(-1)[0] = float("nan")


@pytest.mark.parametrize("name", ["FRUGAL-blocks", "FRUGAL-columns", "FRUGAL-svd",
                                  "AdaFRUGAL-randk", "BAdam-ascending", "BAdam-frugal",
                                  "DQT-adamw", "DQT-frugal-columns"])
def test_the_default_skips_each_non_finite_tensor_and_goes_on(name):
    """Built with its defaults (nonfinite="skip"), an optimizer steps in backward; a tensor
    whose gradient is non-finite is not updated (param as before, state as the ordinary
    step leaves a tensor without a gradient), the others
    take exactly the ordinary step's update of a step without that tensor's gradient, the
    event is counted on the handle and in the history, and the next step goes on."""
    info = next(i for i in OPTIMIZERS if i.name == name)
    opt, params = info.build()
    ref, ref_params = info.build()
    assert opt.nonfinite == "skip"
    handle = fk.step_in_backward(opt)  # refused before: it needed nonfinite="raise"
    assert handle.skips_per_tensor
    seq = grad_sequence(params, 3)
    _train(info, opt, params, seq[:1])
    _train(info, ref, ref_params, seq[:1])
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    bad = trainable[0]
    _nan_at(seq[1], bad)
    before = values(params)[bad].clone()
    history = len(opt.history)
    _backward(params, seq[1])
    opt.step()
    opt.zero_grad()
    assert torch.equal(values(params)[bad], before)
    assert all(p.grad is None for p in params)
    assert handle.nonfinite_skips == 1 and handle.steps == 2
    skips = [h for h in opt.history[history:] if h["reason"].startswith("nonfinite")]
    assert len(skips) == 1 and skips[0]["reason"].startswith("nonfinite gradient: 1 tensor")
    assert skips[0]["step"] == 2
    # The ordinary loop, with that tensor given no gradient.
    _backward(ref_params, seq[1])
    ref_params[bad].grad = None
    ref.step()
    ref.zero_grad()
    _assert_equal(params, ref_params)
    assert_same(opt.state_dict()["state"], ref.state_dict()["state"])  # the bad one's too
    # And the step after goes on as the ordinary one.
    _train(info, opt, params, seq[2:])
    _train(info, ref, ref_params, seq[2:])
    _assert_equal(params, ref_params)
    assert all(torch.isfinite(v).all() for v in values(params))


def test_a_swapped_torch_optimizer_propagates_as_torch_does_under_propagate():
    _, params = _grouped(0)
    opt = fk.swap(torch.optim.AdamW(params, lr=1e-2), nonfinite="propagate")
    handle = fk.step_in_backward(opt)
    assert not handle.skips_per_tensor
    grads = grad_sequence(params, 1)[0]
    _nan_at(grads, 0)
    _backward(params, grads)
    assert torch.isnan(params[0]).any() and handle.nonfinite_skips == 0


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.SGD])
def test_a_swapped_torch_optimizer_follows_its_nonfinite_policy(kind):
    """swap's nonfinite= is the engine's: by default ("skip") the tensor with a NaN keeps its
    param and state and the others step; under "raise" backward raises naming it."""
    _, params = _grouped(0)
    opt = fk.swap(kind(params, lr=1e-2, momentum=0.9) if kind is torch.optim.SGD
                  else kind(params, lr=1e-2))
    handle = fk.step_in_backward(opt)
    assert handle.skips_per_tensor
    grads = grad_sequence(params, 1)[0]
    _nan_at(grads, 1)
    before = [p.detach().clone() for p in params]
    _backward(params, grads)
    assert handle.nonfinite_skips == 1 and torch.equal(params[1], before[1])
    assert not opt.state[params[1]] and all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[0], before[0])
    handle.remove()

    _, params = _grouped(0)
    opt = fk.swap(kind(params, lr=1e-2), nonfinite="raise")
    fk.step_in_backward(opt)
    grads = grad_sequence(params, 1)[0]
    _nan_at(grads, 0)
    with pytest.raises(ValueError, match=r"params\[0\] of param group 0 .* non-finite"):
        _backward(params, grads)


def test_clip_grad_norm_after_a_step_in_backward_is_refused():
    """torch's clip_grad_norm_ after backward found no gradient and returned 0.0: the
    clip silently did nothing. It now raises, naming the ways to clip; other parameters
    and removed handles clip as before."""
    opt, params = _build(OPTIMIZERS[0])
    handle = fk.step_in_backward(opt)
    _backward(params, grad_sequence(params, 1)[0])
    before = [p.detach().clone() for p in params]
    for call in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(RuntimeError, match="max_grad_norm=.*clip='tensor'"):
            call(params, 1.0)
        with pytest.raises(RuntimeError, match="step in backward"):
            call(params[0], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.full((3,), 2.0)
    assert torch.nn.utils.clip_grad_norm_([other], 1.0) == pytest.approx(12 ** 0.5)
    handle.remove()
    _backward(params, grad_sequence(params, 1)[0])
    assert torch.nn.utils.clip_grad_norm_(params, 1.0) > 0


def test_exported_at_the_top():
    assert fk.step_in_backward is fk.optim.step_in_backward
    assert "step_in_backward" in fk.__all__


def test_undoing_the_swap_while_it_steps_in_backward_is_refused_and_changes_nothing():
    """swap(opt, undo=True) under a live step in backward used to take the swapped step
    away from under the hooks (a KeyError from inside backward), and remove() then put the
    swapped step back while is_swapped() said False. It is refused, touching nothing; after
    remove() the undo works."""
    from frugal_kernels.optim.swap import is_swapped

    _, params = _grouped(0)
    _, ref_params = _grouped(0)
    opt = fk.swap(torch.optim.AdamW(params, **HYPER))
    ref = fk.swap(torch.optim.AdamW(ref_params, **HYPER))
    handle = fk.step_in_backward(opt)
    seq = grad_sequence(params, 3)
    _backward(params, seq[0])
    bookkeeping = opt.step
    with pytest.raises(RuntimeError, match=r"steps in backward.*handle.remove\(\)"):
        fk.swap(opt, undo=True)
    assert is_swapped(opt) and handle_of(opt) is handle and opt.step == bookkeeping
    _backward(params, seq[1])
    assert handle.steps == 2
    handle.remove()
    assert fk.swap(opt, undo=True) is opt and not is_swapped(opt)
    assert "step" not in opt.__dict__
    for grads in seq[:2]:
        _backward(ref_params, grads)
        ref.step()
        ref.zero_grad()
    _assert_equal(params, ref_params)
    fk.swap(ref, undo=True)
    for o, ps in ((opt, params), (ref, ref_params)):
        _backward(ps, seq[2])
        o.step()
    _assert_equal(params, ref_params)


class _Checkpointed(torch.nn.Module):
    """Two blocks under reentrant activation checkpointing (what Hugging Face's
    gradient_checkpointing_enable() uses unless told otherwise) and a frozen head: the
    first trained tensors to get their gradients are inside a checkpointed region, in a
    backward pass nested in the outer one."""

    def __init__(self, nested: bool):
        super().__init__()
        torch.manual_seed(0)
        self.nested = nested  # both blocks in one more checkpoint: backward nested twice
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 4).requires_grad_(False)

    def _blocks(self, h):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            h = checkpoint(lambda t, block=block: torch.tanh(block(t)), h, use_reentrant=True)
        return h

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        h = checkpoint(self._blocks, h, use_reentrant=True) if self.nested else self._blocks(h)
        return self.head(h)


# The outer checkpoint runs the inner ones without gradients in the forward pass.
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("kind, k, nested", [("frugal", 2, False), ("frugal", 1, False),
                                             ("frugal", 2, True), ("swap-AdamW", 2, False)])
def test_reentrant_checkpointing_steps_once_per_backward_pass(kind, k, nested):
    """Each nested backward of a reentrant checkpoint used to start and end a step of its
    own: 4 backward passes gave handle.steps == 12, accumulation stepped with partial
    gradients and update_gap ran three times too fast. The step now ends with the
    outermost backward pass and equals the ordinary loop."""
    def build():
        model = _Checkpointed(nested)
        trained = [p for p in model.parameters() if p.requires_grad]
        if kind == "frugal":
            opt = fk.FRUGAL(trained, lr=1e-2, density=0.5, update_gap=2,
                            projection="columns")
        else:
            opt = fk.swap(torch.optim.AdamW(trained, lr=1e-2))
        return model, opt

    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen))
               for _ in range(4 * k)]
    results = []
    for in_backward in (False, True):
        model, opt = build()
        handle = fk.step_in_backward(opt, accumulation_steps=k) if in_backward else None
        for t in range(0, len(batches), k):
            for x, y in batches[t:t + k]:
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            assert handle.steps == 4 and handle.micro_batch == 0
        if kind == "frugal":
            assert opt._steps_taken == 4
        results.append((model, opt))
    (ordinary, ordinary_opt), (model, opt) = results
    for (name, a), b in zip(ordinary.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert_same(opt.state_dict(), ordinary_opt.state_dict())


@pytest.mark.parametrize("kind, options, builds", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 1),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 2)])
def test_a_swapped_optimizers_tensors_keep_their_calls_in_backward(kind, options, builds,
                                                                  monkeypatch):
    """Each tensor's plan (plan.single) is made once and kept over the steps in backward
    (SGD's again after its first step, which starts the momentum buffer), as the engine
    keeps FRUGAL's, and the steps equal the ordinary swapped step's."""
    from frugal_kernels.optim import plan

    _, params = _grouped(0)
    _, ref_params = _grouped(0)
    opt, ref = fk.swap(kind(params, **options)), fk.swap(kind(ref_params, **options))
    made = []
    real = plan.single
    monkeypatch.setattr(plan, "single", lambda *a, **k: made.append(1) or real(*a, **k))
    fk.step_in_backward(opt)
    grad_seq = grad_sequence(params, 4)
    for grads in grad_seq:
        _backward(params, grads)
        _backward(ref_params, grads)
        ref.step()
        ref.zero_grad()
    assert len(made) == builds * len(params)
    assert_same(values(params), values(ref_params))


class _PlainSGD(torch.optim.Optimizer):
    """A user's optimizer that joins the step in backward through the public protocol."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.calls = []

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])

    def tensor_steps_refused(self):
        return None

    def begin_tensor_steps(self):
        self.calls.append("begin")

    def step_tensor(self, p):
        self.calls.append("tensor")
        p.data.add_(p.grad, alpha=-self.param_groups[0]["lr"])

    def end_tensor_steps(self):
        self.calls.append("end")


def test_an_optimizer_with_the_public_protocol_steps_in_backward():
    model, ordinary = nn.Linear(3, 2), nn.Linear(3, 2)
    ordinary.load_state_dict(model.state_dict())
    opt, reference = _PlainSGD(model.parameters(), 0.1), _PlainSGD(ordinary.parameters(), 0.1)
    assert isinstance(opt, fk.optim.TensorSteps)
    handle = fk.step_in_backward(opt)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x).square().sum().backward()
        assert all(p.grad is None for p in model.parameters())
        ordinary(x).square().sum().backward()
        reference.step()
        reference.zero_grad()
    assert handle.steps == 2
    assert opt.calls == ["begin", "tensor", "tensor", "end"] * 2
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p, q)
    handle.remove()
