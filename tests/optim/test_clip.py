"""``opt.clip_grad_norm_``: the global-norm clip in one read of the gradients.

Every optimizer of the table that runs on the step engine (BAdam included): the clip
returns torch's norm, the step after it equals clipping the gradients first (``g *=
factor``, torch's factor) and stepping after, to the bit, over several steps with
subspace changes (and BAdam's block switches); a non-finite gradient leaves params,
state and counts untouched; the step after a clip makes no non-finite pass of its own.
"""

import math

import pytest
import torch

from frugal_kernels.optim import engine

from ..op_db import fraction_apart
from ..optim_db import OPTIMIZERS, values
from .helpers import assert_same, grad_sequence, set_grads

STEPS = 5
# The low-rank projections multiply the gradient by the projection (a GEMM; svd's is
# chosen from the gradient) before the factor is applied: the same math in another
# rounding order, and SignSGD's sign of a near-zero residual can flip (DESIGN.md section
# 6), so those rows are compared by the fraction of coordinates apart.
LOW_RANK = ("random", "svd")

ENGINE_ROWS = [info for info in OPTIMIZERS
               if isinstance(info.build()[0], engine.FusedOptimizer)]


def test_the_engine_rows_cover_every_family():
    names = {info.name.split("-")[0] for info in ENGINE_ROWS}
    assert {"FRUGAL", "AdaFRUGAL", "DQT", "BAdam"} <= names


@pytest.mark.parametrize("info", ENGINE_ROWS, ids=lambda i: i.name)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2", "inf"])
def test_clip_then_step_equals_clipping_first(info, norm_type):
    clipped, params_a = info.build()
    manual, params_b = info.build()
    # Large gradients, so that the clip bites at every step.
    seq = [[g * 50 for g in grads] for grads in grad_sequence(params_a, STEPS, seed=3)]
    for t, grads in enumerate(seq):
        set_grads(params_a, grads)
        norm = clipped.clip_grad_norm_(1.0, norm_type=norm_type)
        clipped.step()
        set_grads(params_b, [g.clone() for g in grads])
        live = [p for p in params_b if p.grad is not None]
        expected = torch.nn.utils.clip_grad_norm_(live, 1.0, norm_type=norm_type)
        assert norm.item() == pytest.approx(expected.item(), rel=1e-5)
        # the factor clip_grad_norm_ applied, from the norm ours returned
        factor = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        set_grads(params_b, [g.clone() for g in grads])
        for p in live:
            p.grad.mul_(factor)
        manual.step()
        if info.after_step is not None:
            info.after_step(clipped, t)
            info.after_step(manual, t)
        for i, (a, b) in enumerate(zip(values(params_a), values(params_b))):
            if info.name.endswith(LOW_RANK):
                assert fraction_apart(a, b, 1e-5) <= 0.02, f"step {t}: param {i}"
            else:
                assert torch.equal(a, b), f"step {t}: param {i}"
    if not info.name.endswith(LOW_RANK):
        assert_same(clipped.state_dict(), manual.state_dict())


@pytest.mark.parametrize("info", ENGINE_ROWS, ids=lambda i: i.name)
def test_a_non_finite_gradient_after_a_clip_skips_the_step(info, monkeypatch):
    # BAdam's switch, due at the second call, would drop the state the test compares.
    opt, params = info.build(**({"switch_every": 10} if info.name.startswith("BAdam") else {}))
    seq = grad_sequence(params, 2, seed=4)
    info.train(opt, params, seq[:1])
    before_values = values(params, clone=True)
    # Schedules count calls of step(), skipped ones too (docs/optimizers.md); the
    # parameters' state, moments and bias-correction counts, must not move.
    before_state = opt.state_dict()["state"]
    grads = [g.clone() for g in seq[1]]
    grads[-1].view(-1)[0] = float("nan")
    set_grads(params, grads)
    norm = opt.clip_grad_norm_(1.0)
    assert math.isnan(norm.item())
    passes = []
    monkeypatch.setattr(engine, "_nonfinite_flag", lambda g: passes.append(g))
    opt.step()
    assert passes == [], "the step after a clip read the gradients for the flag again"
    for i, (a, b) in enumerate(zip(values(params), before_values)):
        assert torch.equal(a, b), f"param {i} changed"
    assert_same(opt.state_dict()["state"], before_state)


@pytest.mark.parametrize("info", ENGINE_ROWS[:1], ids=lambda i: i.name)
def test_the_clip_applies_to_the_next_step_only(info):
    opt, params = info.build()
    other, params_b = info.build()
    seq = [[g * 50 for g in grads] for grads in grad_sequence(params, 2, seed=5)]
    set_grads(params, seq[0])
    opt.clip_grad_norm_(0.5)
    opt.step()
    set_grads(params, seq[1])
    opt.step()  # no clip: the whole gradient
    set_grads(params_b, seq[0])
    other.clip_grad_norm_(0.5)
    other.step()
    set_grads(params_b, seq[1])
    other.step()
    for a, b in zip(values(params), values(params_b)):
        assert torch.equal(a, b)
    assert opt._pending_clip is None


@pytest.mark.parametrize("max_norm,error", [(float("nan"), ValueError), (-1.0, ValueError),
                                            (float("inf"), ValueError), ("1", TypeError),
                                            (True, TypeError)])
def test_a_bad_max_norm_is_refused_and_changes_nothing(max_norm, error):
    opt, params = ENGINE_ROWS[0].build()
    set_grads(params, grad_sequence(params, 1)[0])
    with pytest.raises(error, match="max_norm"):
        opt.clip_grad_norm_(max_norm)
    assert opt._pending_clip is None


def test_error_if_nonfinite_raises_as_torch_does():
    opt, params = ENGINE_ROWS[0].build()
    grads = grad_sequence(params, 1)[0]
    grads[0].view(-1)[0] = float("inf")
    set_grads(params, grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("rows,threaded", [(1100, True), (10, False)])
def test_the_default_skip_check_reads_large_gradients_with_grad_norm(monkeypatch, rows,
                                                                     threaded):
    """Without a clip, nonfinite="skip" reads the gradients once for its flag: through
    ops.grad_norm's threaded kernel on the CPU when they are large, GradScaler's check
    when they are small (its host time is lower); either way a NaN skips the step."""
    import frugal_kernels as fk
    from frugal_kernels import ops

    calls = []
    real = ops.grad_norm
    monkeypatch.setattr(ops, "grad_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = torch.nn.Parameter(torch.randn(rows, 1000))
    opt = fk.FRUGAL([p], lr=0.1, projection="rows", density=0.5)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    p.grad = torch.randn_like(p)
    p.grad[rows - 1, 999] = float("nan")
    opt.step()
    assert torch.equal(p.detach(), before)
    assert bool(calls) == (threaded and "cpu" in ops.usable_backends("cpu",
                                                                     "frugal::grad_norm"))
