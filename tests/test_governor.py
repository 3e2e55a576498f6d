import json
import math
import random

import pytest

from frugal_kernels.governor import Decision, Governor, optimizer_flops

BUDGET = 1e12
EVALUATIONS = 100  # evaluations the budget pays for at the default interval


def plateau(x):
    """Falls fast, then is flat to 1e-3 from x = 0.35 on."""
    return 2.0 + math.exp(-20.0 * x)


def steady(x):
    return 5.0 - 2.0 * x


def flattening(x):
    """Keeps falling over the whole budget, ever more slowly."""
    return 2.0 + 3.0 / math.sqrt(1.0 + 50.0 * x)


def rising(x):
    """Falls, then goes up: G is negative from x = 0.1 on."""
    return 3.0 - x if x < 0.1 else 2.9 + x


def run(curve, governor=None, noise=0.0, seed=0, intervals=None):
    """Feed ``curve(flops / BUDGET)`` plus Gaussian noise to a governor until it stops."""
    governor = governor or Governor(BUDGET)
    rng = random.Random(seed)
    intervals = intervals or [BUDGET / EVALUATIONS] * (2 * EVALUATIONS)
    decisions = []
    for interval in intervals:
        governor.add_flops(interval)
        loss = curve(governor.spent_flops / BUDGET) + rng.gauss(0.0, noise)
        decisions.append(governor.observe(loss))
        if decisions[-1].action == "stop":
            break
    return decisions


class RecordingOptimizer:
    def __init__(self):
        self.update_gap = 200
        self.decisions = []

    def apply_governor(self, decision):
        self.update_gap = round(self.update_gap * decision.suggestion["update_gap_factor"])
        self.decisions.append(decision)


@pytest.mark.parametrize("seed", range(5))
def test_stops_on_plateau(seed):
    decisions = run(plateau, noise=1e-3, seed=seed)
    last = decisions[-1]
    assert last.action == "stop"
    assert not last.reason.startswith("budget exhausted")
    # Not while the curve still falls (at x = 0.25 spending the rest would buy over 1%)...
    assert last.flops > 0.3 * BUDGET
    # ...but well before the budget runs out.
    assert last.flops < 0.65 * BUDGET
    assert last.projected_improvement < 0.005
    assert all(d.action != "stop" for d in decisions[:-1])


@pytest.mark.parametrize("seed", range(5))
def test_does_not_stop_on_steady_fall(seed):
    decisions = run(steady, noise=1e-3, seed=seed)
    assert [d.action for d in decisions[:-1]] == ["continue"] * (EVALUATIONS - 1)
    assert decisions[-1].action == "stop"
    assert decisions[-1].reason.startswith("budget exhausted")
    assert decisions[-1].evaluation == EVALUATIONS


@pytest.mark.parametrize("curve", [steady, plateau, flattening])
@pytest.mark.parametrize("seed", range(3))
def test_stops_when_budget_runs_out(curve, seed):
    rng = random.Random(seed)
    intervals = [BUDGET * rng.uniform(0.002, 0.03) for _ in range(2000)]
    # min_improvement=0: only the budget, never the curve, may stop this run.
    governor = Governor(BUDGET, min_improvement=0.0)
    decisions = run(curve, governor, intervals=intervals)
    last = decisions[-1]
    assert last.action == "stop" and last.reason.startswith("budget exhausted")
    assert governor.exhausted and last.remaining_flops <= 0
    assert all(d.flops < BUDGET for d in decisions[:-1])
    assert last.flops - BUDGET < intervals[len(decisions) - 1]


def test_stops_when_budget_runs_out_before_the_window_fills():
    governor = Governor(BUDGET, window=5)
    decisions = run(steady, governor, intervals=[0.4 * BUDGET] * 5)
    assert [d.action for d in decisions] == ["continue", "continue", "stop"]
    assert decisions[0].gain_per_flop is None


def test_reallocates_before_stopping_and_calls_the_optimizer():
    optimizer = RecordingOptimizer()
    governor = Governor(BUDGET)
    governor.attach(optimizer)
    decisions = run(flattening, governor, noise=1e-3)
    reallocations = [d for d in decisions if d.action == "reallocate"]
    assert decisions[-1].action == "stop"
    assert reallocations
    assert reallocations[0].evaluation < decisions[-1].evaluation
    assert optimizer.decisions == reallocations
    assert optimizer.update_gap > 200
    assert reallocations[0].suggestion == {"update_gap_factor": 1.5, "rho_factor": 0.8}
    # Each reallocation needs the gain per FLOP to have dropped 4x since the last one.
    gains = [d.gain_per_flop for d in reallocations]
    assert all(later < 0.25 * earlier for earlier, later in zip(gains, gains[1:]))
    evaluations = [d.evaluation for d in reallocations]
    assert all(b - a >= governor.cooldown for a, b in zip(evaluations, evaluations[1:]))


def test_cooldown_spaces_reallocations():
    # A loss that goes up is below any fraction of the first gain at every evaluation.
    governor = Governor(BUDGET, window=3, cooldown=4, patience=10**6)
    decisions = run(rising, governor)
    reallocations = [d.evaluation for d in decisions if d.action == "reallocate"]
    assert len(reallocations) > 5
    assert all(b - a == 4 for a, b in zip(reallocations, reallocations[1:]))


def test_optimizer_without_apply_governor_is_accepted(caplog):
    governor = Governor(BUDGET)
    governor.attach(object())
    assert "no apply_governor" in caplog.text
    decisions = run(flattening, governor)
    assert any(d.action == "reallocate" for d in decisions)


def test_gain_per_flop_is_the_least_squares_slope():
    governor = Governor(BUDGET, window=4)
    decisions = run(steady, governor, intervals=[BUDGET / 10] * 4)
    last = decisions[-1]
    assert last.gain_per_flop == pytest.approx(2.0 / BUDGET)
    assert last.projected_improvement == pytest.approx(2.0 * 0.6 / steady(0.4))
    noisy = Governor(BUDGET, window=4)
    losses = [5.0, 4.0, 4.5, 3.0]
    for i, loss in enumerate(losses):
        decision = noisy.observe(loss, flops=(i + 1) * 1e9)
    # slope of the fit through (1, 5), (2, 4), (3, 4.5), (4, 3) in units of 1e9 FLOPs
    assert decision.gain_per_flop == pytest.approx(0.55 / 1e9)


def test_step_counts_model_and_optimizer_flops():
    governor = Governor(BUDGET, flops_per_token=1000.0)
    governor.step(tokens=512, optimizer_flops=optimizer_flops(10_000, "adamw"))
    governor.step(tokens=512, flops_per_token=2000.0)
    assert governor.steps == 2
    assert governor.spent_flops == 512 * 1000 + 12 * 10_000 + 512 * 2000
    assert governor.observe(3.0).step == 2
    with pytest.raises(ValueError, match="flops_per_token"):
        Governor(BUDGET).step(tokens=10)


def test_optimizer_flops():
    assert optimizer_flops(1000, "adamw") == 12_000
    assert optimizer_flops(1000, "Sign") == 3_000  # names are case-insensitive
    assert optimizer_flops(1000, "none") == 0
    with pytest.raises(ValueError, match="unknown update rule 'lion'"):
        optimizer_flops(1000, "lion")


def test_every_state_free_rule_has_its_flops_under_the_optimizers_name():
    from frugal_kernels._layout import STATE_FREE_RULES
    from frugal_kernels.governor import OPTIMIZER_FLOPS_PER_ELEMENT

    assert set(STATE_FREE_RULES) <= set(OPTIMIZER_FLOPS_PER_ELEMENT)


def test_non_finite_loss_stops():
    governor = Governor(BUDGET)
    governor.observe(3.0, flops=1e9)
    decision = governor.observe(math.nan, flops=2e9)
    assert decision.action == "stop" and "not finite" in decision.reason


def test_invalid_observations_are_rejected():
    governor = Governor(BUDGET)
    governor.observe(3.0, flops=1e9)
    with pytest.raises(ValueError, match="FLOPs must grow"):
        governor.observe(2.9)
    with pytest.raises(ValueError, match="must be positive"):
        governor.observe(0.0, flops=2e9)
    with pytest.raises(ValueError, match="window"):
        Governor(BUDGET, window=1)


def test_history_is_json_serialisable():
    governor = Governor(BUDGET)
    governor.attach(RecordingOptimizer())
    decisions = run(flattening, governor, noise=1e-3)
    assert len(governor.history) == len(decisions)
    restored = json.loads(json.dumps(governor.history))
    assert restored == [d.to_dict() for d in decisions]
    assert {h["action"] for h in restored} == {"continue", "reallocate", "stop"}
    assert Decision(**restored[-1]) == decisions[-1]


@pytest.mark.parametrize("curve, settings", [
    (flattening, {}),
    (rising, {"window": 3, "cooldown": 4, "patience": 10**6}),
])
def test_state_dict_round_trip_resumes_exactly(curve, settings):
    reference = Governor(BUDGET, **settings)
    expected = run(curve, reference, noise=1e-3, seed=3)
    losses = [d.loss for d in expected]
    interval = BUDGET / EVALUATIONS
    # Every cut point: the stop streak, the cooldown and the reference gain each matter
    # at some of them.
    for cut in range(1, len(losses)):
        first = Governor(BUDGET, **settings)
        for loss in losses[:cut]:
            first.add_flops(interval)
            first.observe(loss)
        resumed = Governor(BUDGET, **settings)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for loss in losses[cut:]:
            resumed.add_flops(interval)
            resumed.observe(loss)
        assert resumed.history == reference.history, cut
        assert resumed.state_dict() == reference.state_dict(), cut


# Bad input (issue 27 item 5): refused with a clear error, and a refused call changes nothing.

@pytest.mark.parametrize("kwargs,match", [
    ({"window": 2.5}, "window"),
    ({"window": True}, "window"),
    ({"patience": 1.5}, "patience"),
    ({"cooldown": 0.5}, "cooldown"),
])
def test_a_count_of_the_wrong_type_is_a_type_error(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Governor(BUDGET, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"flop_budget": float("nan")}, "flop_budget"),
    ({"flop_budget": float("inf")}, "flop_budget"),
    ({"window": 1}, "window"),
    ({"min_improvement": float("nan")}, "min_improvement"),
    ({"min_improvement": -0.1}, "min_improvement"),
    ({"reallocate_fraction": float("nan")}, "reallocate_fraction"),
    ({"flops_per_token": float("nan")}, "flops_per_token"),
    ({"suggestion": {"update_gap_factor": float("nan")}}, "update_gap_factor"),
    ({"suggestion": {"rho_factor": 0.0}}, "rho_factor"),
])
def test_bad_settings_are_refused(kwargs, match):
    kwargs = {"flop_budget": BUDGET, **kwargs}
    with pytest.raises(ValueError, match=match):
        Governor(**kwargs)


@pytest.mark.parametrize("flops", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_flops_are_refused_and_change_nothing(flops):
    governor = Governor(BUDGET)
    governor.add_flops(10.0)
    with pytest.raises(ValueError, match="flops"):
        governor.add_flops(flops)
    with pytest.raises(ValueError, match="flops"):
        governor.observe(3.0, flops=flops)
    assert governor.spent_flops == 10.0
    assert governor.evaluations == 0 and governor.history == []


def test_flops_going_backwards_are_refused_before_the_count_changes():
    governor = Governor(BUDGET)
    governor.observe(3.0, flops=100.0)
    with pytest.raises(ValueError, match="must grow"):
        governor.observe(2.9, flops=50.0)
    assert governor.spent_flops == 100.0
    assert governor.evaluations == 1


def test_a_nan_budget_cannot_be_reached_through_the_count():
    governor = Governor(BUDGET)
    with pytest.raises(ValueError):
        governor.add_flops(float("nan"))
    governor.add_flops(BUDGET)
    assert governor.exhausted
    assert governor.observe(3.0).action == "stop"


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), -2.0, 0.0, "2", True])
def test_apply_governor_refuses_a_bad_factor_and_changes_nothing(factor):
    import frugal_kernels as fk
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for opt, key in [(fk.AdaFRUGAL(model.parameters(), rho_steps=10), "update_gap_factor"),
                     (fk.AdaFRUGAL(model.parameters(), rho_steps=10), "rho_factor"),
                     (fk.BAdam(model, switch_every=4, blocks=[[r"0\..*"], [r"1\..*"]]), "update_gap_factor"),
                     (fk.BAdam(model, switch_every=4, blocks=[[r"0\..*"], [r"1\..*"]]),
                      "switch_every_factor")]:
        before = (opt.update_gap if hasattr(opt, "update_gap") else None, list(opt.history),
                  getattr(opt, "_switch_every", None))
        decision = Decision(action="reallocate", reason="", evaluation=1, step=1, flops=1.0,
                            loss=1.0, remaining_flops=1.0, suggestion={key: factor})
        with pytest.raises((TypeError if isinstance(factor, (str, bool)) else ValueError),
                           match=key):
            opt.apply_governor(decision)
        after = (opt.update_gap if hasattr(opt, "update_gap") else None, list(opt.history),
                 getattr(opt, "_switch_every", None))
        assert after == before


# A warmup-stable-decay schedule: the governor decides when the decay begins (issue 28).

DECAY = 0.25


def _run_decay(curve, seed=0):
    governor = Governor(BUDGET, decay_fraction=DECAY)
    decisions = run(curve, governor=governor, noise=1e-3, seed=seed)
    return governor, decisions


@pytest.mark.parametrize("seed", range(3))
def test_a_plateau_starts_the_decay_early_and_the_run_ends_after_it(seed):
    governor, decisions = _run_decay(plateau, seed)
    actions = [d.action for d in decisions]
    assert actions.count("decay") == 1 and actions[-1] == "stop"
    start = decisions[actions.index("decay")]
    assert "would improve the loss" in start.reason
    # the plateau begins at 0.35 of the budget: the decay starts well before the
    # budget's 1 / (1 + 0.25) = 0.8 (the window of 5 and patience of 5 evaluations
    # after the projection falls under the threshold), and is a quarter of what was
    # spent before it
    assert start.flops < 0.65 * BUDGET
    assert start.suggestion["decay_flops"] == pytest.approx(DECAY * start.flops)
    assert governor.decay_end == pytest.approx(start.flops * (1 + DECAY))
    # the decay runs to its end, then the run stops: the FLOPs saved are the rest
    assert all(a == "continue" for a in actions[actions.index("decay") + 1:-1])
    assert decisions[-1].reason.startswith("decay done")
    assert decisions[-1].flops >= governor.decay_end
    assert decisions[-1].flops < 0.8 * BUDGET


def test_a_steady_run_decays_when_the_budget_only_pays_for_the_decay():
    governor, decisions = _run_decay(steady)
    start = next(d for d in decisions if d.action == "decay")
    assert start.reason.startswith("the budget left pays for the decay")
    assert start.flops * (1 + DECAY) >= BUDGET
    assert start.flops == pytest.approx(BUDGET / (1 + DECAY), rel=0.02)
    assert decisions[-1].action == "stop"
    assert decisions[-1].flops <= BUDGET + BUDGET / EVALUATIONS


def test_with_a_decay_phase_the_rate_is_weighed_against_the_stable_phase_left():
    # G = 0.1 per FLOP unit at 0.6 of the budget: the stable phase ends at 0.8, so a decay now
    # gives up 0.2 of the budget's stable FLOPs, not the 0.4 left in all.
    points = [(0.5 * BUDGET, 1.0 + 0.01), (0.6 * BUDGET, 1.0)]
    gain = 0.01 / (0.1 * BUDGET)
    for fraction, stake in ((None, 0.4), (DECAY, 0.2)):
        governor = Governor(BUDGET, window=2, decay_fraction=fraction)
        for flops, loss in points:
            last = governor.observe(loss, flops=flops)
        assert last.projected_improvement == pytest.approx(gain * stake * BUDGET / 1.0)


def test_without_a_decay_phase_a_plateau_stops_as_before():
    decisions = run(plateau, governor=Governor(BUDGET), noise=1e-3)
    assert "decay" not in [d.action for d in decisions]
    assert decisions[-1].action == "stop"


def test_the_decay_phase_resumes_from_a_state_dict():
    governor, decisions = _run_decay(plateau)
    start = [d.action for d in decisions].index("decay")
    # replay up to just after the decay started, save, load into a new governor
    first = Governor(BUDGET, decay_fraction=DECAY)
    for d in decisions[:start + 1]:
        first.observe(d.loss, flops=d.flops)
    second = Governor(BUDGET, decay_fraction=DECAY)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert second.decaying and second.decay_end == first.decay_end
    for d in decisions[start + 1:]:
        assert second.observe(d.loss, flops=d.flops).action == d.action


@pytest.mark.parametrize("fraction", [0.0, -0.1, float("nan"), float("inf")])
def test_a_bad_decay_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="decay_fraction"):
        Governor(BUDGET, decay_fraction=fraction)


# --- the selection action ---------------------------------------------------------------

class SelectionCurve:
    """A loss that falls towards 2.0 at ``plain_rate`` per evaluation interval of plain steps
    and ``select_rate`` per interval of selected ones, whose intervals cost ``select_cost``
    times the FLOPs (the scoring pass); the mode is ``governor.selecting``."""

    def __init__(self, select_rate, plain_rate=1.0, select_cost=1.25, noise=0.0, seed=0):
        self.rates = {True: (select_rate, select_cost), False: (plain_rate, 1.0)}
        self.noise, self.rng, self.loss = noise, random.Random(seed), 5.0

    def drive(self, governor, evaluations):
        decisions = []
        for _ in range(evaluations):
            rate, cost = self.rates[governor.selecting]
            self.loss = 2.0 + (self.loss - 2.0) * math.exp(-rate / 60)
            governor.add_flops(cost * BUDGET / 240)
            decisions.append(governor.observe(self.loss + self.rng.gauss(0.0, self.noise)))
        return decisions


def selection_run(select_rate, select_cost=1.25, governor=None, evaluations=60):
    governor = governor or Governor(BUDGET, select_trial=3)
    return governor, SelectionCurve(select_rate, select_cost=select_cost).drive(
        governor, evaluations)


def test_selection_that_pays_per_flop_is_turned_on():
    governor, decisions = selection_run(select_rate=2.0)
    selects = [d for d in decisions if d.action == "select"]
    # trial on, back off to bracket, then on for good
    assert [d.suggestion["select"] for d in selects] == [1.0, 0.0, 1.0]
    assert governor.selecting
    assert "on trial" in selects[-1].reason


def test_selection_that_does_not_pay_for_its_scoring_stays_off():
    # twice the gain per step, but the scoring makes a step cost 2.5 times the FLOPs
    governor, decisions = selection_run(select_rate=2.0, select_cost=2.5)
    assert [d.suggestion["select"] for d in decisions if d.action == "select"] == [1.0, 0.0]
    assert not governor.selecting
    assert any("selection stays off" in d.reason for d in decisions)


def test_selection_trials_repeat_after_select_recheck_evaluations():
    governor, decisions = selection_run(
        select_rate=0.5, governor=Governor(BUDGET, select_trial=3, select_recheck=5))
    switches = [d.evaluation for d in decisions if d.action == "select"]
    verdicts = [d.evaluation for d in decisions if "stays off" in d.reason]
    assert len(verdicts) >= 2
    # each trial starts select_recheck evaluations after the verdict before it
    assert switches[2] == verdicts[0] + 5


@pytest.mark.parametrize("stop", [3, 4, 5, 8, 12])
def test_the_selection_trial_resumes_from_a_state_dict(stop):
    settings = dict(select_trial=3, select_recheck=4)
    whole = Governor(BUDGET, **settings)
    expected = SelectionCurve(2.0, noise=1e-3).drive(whole, 30)
    first, curve = Governor(BUDGET, **settings), SelectionCurve(2.0, noise=1e-3)
    head = curve.drive(first, stop)
    resumed = Governor(BUDGET, **settings)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = curve.drive(resumed, 30 - stop)
    assert [d.to_dict() for d in head + tail] == [d.to_dict() for d in expected]
    assert resumed.state_dict() == whole.state_dict()


def test_a_decay_during_a_trial_returns_to_the_held_mode():
    governor = Governor(BUDGET, select_trial=3, decay_fraction=0.25)
    for i in range(4):
        governor.add_flops(BUDGET / 100)
        governor.observe(5.0 - 0.1 * i)
    assert governor.selecting  # the trial began
    governor.add_flops(0.8 * BUDGET - governor.spent_flops)
    decision = governor.observe(4.0)
    assert decision.action == "decay"
    assert decision.suggestion["select"] == 0.0 and not governor.selecting


@pytest.mark.parametrize("kwargs, error", [
    ({"select_trial": 1}, ValueError), ({"select_trial": 2.5}, TypeError),
    ({"select_recheck": 0}, ValueError), ({"select_margin": -0.1}, ValueError),
    ({"select_margin": math.nan}, ValueError)])
def test_bad_selection_settings_are_refused(kwargs, error):
    with pytest.raises(error):
        Governor(BUDGET, **kwargs)
