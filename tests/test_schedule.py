"""The WSD schedule whose decay the governor starts (frugal_kernels/lab/schedule.py) and the
training loop that follows it."""

import dataclasses

import pytest
import torch

from frugal_kernels.governor import Governor
from frugal_kernels.lab import train as train_module
from frugal_kernels.lab.corpus import load_corpus
from frugal_kernels.lab.schedule import (GovernedWSD, evaluation_due, governed_schedule,
                                         twin_cooldown_fraction)
from frugal_kernels.lab.train import TrainConfig, lr_factor, train

TINY = TrainConfig(model="tiny", steps=40, batch_size=2, seq_len=16, warmup_steps=2,
                   eval_every=2, eval_batches=1, max_bytes=200_000, lr=1e-3, min_lr_ratio=0.1)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=TINY.max_bytes)


def adamw(model, config):
    return torch.optim.AdamW(model.parameters(), lr=config.lr)


def test_the_schedule_holds_until_the_governor_decays_then_decays_linearly():
    governor = Governor(100.0, decay_fraction=0.25, window=2, patience=1)
    schedule = GovernedWSD(governor, warmup_steps=4, min_lr_ratio=0.1)
    assert [schedule(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(30) == 1.0  # no decay before the governor starts one
    # A flat loss: the window of 2 is full at the second evaluation, and a patience of 1
    # decays there, at 40 FLOPs after 8 steps of 5: 10 FLOPs of decay are 2 steps.
    governor.observe(2.0, flops=20.0, step=4)
    decision = governor.observe(2.0, flops=40.0, step=8)
    assert decision.action == "decay" and decision.suggestion["decay_flops"] == 10.0
    assert schedule.decay() == (8, 2)
    assert schedule(7) == 1.0  # update 8 ran before the decision
    assert schedule(8) == pytest.approx(0.55)
    assert schedule(9) == pytest.approx(0.1)
    assert schedule(50) == pytest.approx(0.1)


def test_only_a_governor_with_decay_fraction_gets_the_governed_schedule():
    assert governed_schedule(None, 2, 0.1) is None
    assert governed_schedule(Governor(1.0), 2, 0.1) is None
    assert isinstance(governed_schedule(Governor(1.0, decay_fraction=0.25), 2, 0.1), GovernedWSD)
    with pytest.raises(ValueError, match="decay_fraction"):
        GovernedWSD(Governor(1.0), 2, 0.1)


def test_the_ungoverned_twin_decays_where_the_budget_pays_for_the_decay_and_no_more():
    fraction = twin_cooldown_fraction(0.25)
    assert fraction == pytest.approx(0.2)
    # 200 steps: stable for the first 160 = 200 / 1.25 (lr_factor's decay starts from 1.0
    # at update index 160), then the decay.
    assert lr_factor(160, 200, 20, 0.1, "wsd", fraction) == 1.0
    assert lr_factor(161, 200, 20, 0.1, "wsd", fraction) < 1.0


def test_evaluations_fall_where_the_governor_must_decide():
    assert not evaluation_due(None)
    governor = Governor(100.0, decay_fraction=0.25)
    governor.add_flops(79.0)
    assert not evaluation_due(governor)
    governor.add_flops(1.0)  # 80 * 1.25 = 100: the budget left only pays for the decay
    assert evaluation_due(governor)
    assert governor.observe(3.0).action == "decay"
    assert not evaluation_due(governor)
    governor.add_flops(20.0)
    assert evaluation_due(governor)
    plain = Governor(100.0)
    plain.add_flops(99.0)
    assert not evaluation_due(plain)
    plain.add_flops(1.0)
    assert evaluation_due(plain)


def test_a_governor_with_a_decay_needs_the_wsd_schedule():
    with pytest.raises(ValueError, match="warmup-stable-decay"):
        dataclasses.replace(TINY, schedule="cosine", governor={"decay_fraction": 0.25})


def test_on_a_plateau_the_loop_decays_the_lr_then_stops(corpus, monkeypatch):
    """A synthetic plateau (the evaluation loss stubbed to a constant): the governor decays
    after its window (5) and patience (3), at the 7th evaluation, step 14; the lr falls
    linearly to its floor over the steps 0.25 x the FLOPs so far pay for, and the run stops
    when they are spent, long before its budget."""
    monkeypatch.setattr(train_module, "_evaluate", lambda model, batches: 2.0)
    budget_steps = 40
    per_step = TINY.tokens_per_step() * train_module.flops_per_token(
        TINY.model_config(corpus.vocab_size), TINY.seq_len)
    # AdamW's step FLOPs on top; the budget pays for about 40 steps of this run.
    config = dataclasses.replace(TINY, flop_budget=budget_steps * per_step * 1.05,
                                 governor={"decay_fraction": 0.25, "window": 5, "patience": 3})
    result = train(config, adamw, data=corpus, progress=False)
    actions = [(d["step"], d["action"]) for d in result.decisions if d["action"] != "continue"]
    assert actions == [(14, "decay"), (18, "stop")], actions
    assert "decay done" in result.stop_reason
    assert result.steps_done == 18
    lrs = [s["lr"] for s in result.steps]
    assert lrs[2:14] == [pytest.approx(1e-3)] * 12  # stable until the decision
    assert lrs[14:18] == pytest.approx([1e-3 * (1 - 0.9 * p) for p in (0.25, 0.5, 0.75, 1.0)])
    assert result.flops < 0.5 * config.flop_budget

    # The ungoverned run on the same plateau runs its 40 steps.
    twin = train(TINY, adamw, data=corpus, progress=False)
    assert twin.steps_done == 40 and twin.decisions == []


def test_a_run_that_never_plateaus_decays_at_the_budgets_share(corpus, monkeypatch):
    """A loss falling steadily: the governor decays where the budget left pays for the decay
    alone (1 / 1.25 of the budget), evaluated at that step rather than at the next regular
    evaluation (every 7 steps here), and the run ends at its budget."""
    losses = iter(5.0 - 0.05 * k for k in range(1000))
    monkeypatch.setattr(train_module, "_evaluate", lambda model, batches: next(losses))
    config = dataclasses.replace(TINY, eval_every=7)
    # AdamW's steps all cost the same: the budget of 30 of them, as train counts them.
    per_step = train(dataclasses.replace(config, steps=1, warmup_steps=0), adamw, data=corpus,
                     progress=False).flops
    result = train(dataclasses.replace(config, flop_budget=30 * per_step,
                                       governor={"decay_fraction": 0.25}),
                   adamw, data=corpus, progress=False)
    decay = [d for d in result.decisions if d["action"] == "decay"]
    assert [d["step"] for d in decay] == [24]  # 24 * 1.25 = 30
    assert "budget left" in decay[0]["reason"]
    assert result.steps_done == 30
    lrs = [s["lr"] for s in result.steps]
    assert lrs[23] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
