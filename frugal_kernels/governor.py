"""The compute governor: continue, reallocate or stop training from the gain per FLOP.

A training loop counts the FLOPs it spends (:meth:`Governor.step` or
:meth:`Governor.add_flops`) and reports each evaluation loss to :meth:`Governor.observe`, which
answers a :class:`Decision`. The policy maps the training state (the recent loss curve) and the
remaining budget to an action, driven by the marginal gain per FLOP ``G_t = -dL/dFLOPs``.

Example::

    governor = Governor(flop_budget=1e15, flops_per_token=flops_per_token(config, seq_len))
    governor.attach(optimizer)  # its apply_governor(decision) is called on reallocate
    for step, batch in enumerate(batches):
        ...
        governor.step(tokens=batch_size * seq_len,
                      optimizer_flops=optimizer_flops(num_params, "adamw"))
        if step % eval_every == 0 and governor.observe(val_loss).action == "stop":
            break
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["OPTIMIZER_FLOPS_PER_ELEMENT", "Decision", "Governor", "optimizer_flops"]

logger = logging.getLogger(__name__)

# Rough FLOPs per parameter element of one optimizer step, counting each add, multiply,
# divide, sqrt and sign as one: AdamW is two moment updates (7), the bias-corrected
# denominator (3), the update (2); SignSGD is sign, scale and subtract. The state-free
# rules go by the optimizers' names for them (frugal_kernels._layout.STATE_FREE_RULES).
OPTIMIZER_FLOPS_PER_ELEMENT: dict[str, int] = {
    "adamw": 12,
    "adam": 12,
    "sign": 3,
    "sgd": 2,
    "sgd_momentum": 4,
    "none": 0,
}


def optimizer_flops(num_params: int, rule: str = "adamw") -> int:
    """FLOPs of one optimizer step over ``num_params`` elements updated by ``rule``.

    ``rule`` is a key of :data:`OPTIMIZER_FLOPS_PER_ELEMENT`. Mixed optimizers add their parts,
    e.g. FRUGAL: ``optimizer_flops(n_state_full, "adamw") + optimizer_flops(n_state_free,
    group["state_free"])``.
    """
    try:
        per_element = OPTIMIZER_FLOPS_PER_ELEMENT[rule.lower()]
    except KeyError:
        raise ValueError(
            f"unknown update rule {rule!r}; known: {sorted(OPTIMIZER_FLOPS_PER_ELEMENT)}"
        ) from None
    return per_element * num_params


@dataclass
class Decision:
    """The governor's answer at one evaluation.

    ``gain_per_flop`` is ``G_t`` (``None`` until the window is full) and
    ``projected_improvement`` is ``G_t * remaining_flops / loss``, the relative loss
    improvement that spending the rest of the budget at the current rate would buy.
    ``suggestion`` is set on ``"reallocate"`` (factors for the optimizer's schedule) and on
    ``"decay"`` (``decay_flops``: the FLOPs the learning-rate decay is given).
    """

    action: str
    reason: str
    evaluation: int
    step: int
    flops: float
    loss: float
    remaining_flops: float
    gain_per_flop: Optional[float] = None
    projected_improvement: Optional[float] = None
    suggestion: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value) and value > 0


def _check_count(name: str, value: Any, least: int, why: str = "") -> None:
    # bool is an int to Python, and window=True is surely a mistake. Error types as
    # torch.optim's: the wrong type is a TypeError, a value out of range a ValueError.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}{' ' + why if why else ''}, got {value!r}")


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (centred, so 1e15-sized FLOP counts are harmless)."""
    x_mean = sum(xs) / len(xs)
    y_mean = sum(ys) / len(ys)
    sxy = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys))
    sxx = sum((x - x_mean) ** 2 for x in xs)
    return sxy / sxx


class Governor:
    """Compute governor: ``pi(state, remaining budget) -> continue | select | reallocate | decay | stop``.

    At each evaluation ``t`` (a call of :meth:`observe`) with cumulative FLOPs ``F_t``, loss
    ``L_t`` and remaining budget ``R_t = flop_budget - F_t``:

    * ``G_t = -slope`` of the least-squares line through the last ``window`` points
      ``(F_i, L_i)``. A fitted slope averages the evaluation noise of ``window`` losses instead
      of differencing two of them; it is undefined (and no decision but the budget's is taken)
      until ``window`` evaluations exist.
    * ``P_t = G_t * R_t / L_t``: the relative improvement the rest of the budget would buy at
      the current rate (with a decay phase, the rest of the stable phase: see below).

    Rules, first match wins:

    1. **stop** when the loss is not finite, or the budget is spent (``F_t >= flop_budget``).
       The budget is only checked here, so a loop that calls :meth:`observe` every ``k``
       steps overshoots by less than one interval of ``k`` steps; check :attr:`exhausted`
       per step for a hard cap.
    2. **stop** when ``P_t < min_improvement`` (i.e. ``G_t * R_t < min_improvement * L_t``) at
       ``patience`` consecutive evaluations: the remaining compute is not worth spending.
    3. **reallocate** when ``G_t < reallocate_fraction * G_ref`` and at least ``cooldown``
       evaluations passed since the last reallocation. ``G_ref`` is the first positive ``G``,
       then the ``G`` at the last reallocation if it was positive, so each reallocation answers
       a further drop by the same factor, not the same old drop over and over (while the loss
       does not fall, ``G <= 0`` reallocates at every cooldown). The decision carries
       ``suggestion`` (by default grow the update gap T by 1.5 and scale rho by 0.8: make each
       step cheaper once steps pay less), and every attached optimizer with an
       ``apply_governor(decision)`` method is called with it.
    4. **continue** otherwise.

    The cooldown defaults to ``window`` so that the next ``G`` is fitted on losses measured
    after the change only.

    **Online data selection** (``select_trial`` set): the governor also decides whether the
    loop trains on selected batches (``frugal_kernels.data.OnlineSelector``, whose scoring
    FLOPs the loop counts like any others) or on plain ones. :attr:`selecting` is the mode it
    asks for (off at the start). It runs bracketed trials of ``select_trial`` evaluations a
    segment: the held mode (``A``), the other mode (``B``), the held mode again (``A'``),
    each segment's gain per FLOP fitted on its own points (the last point of a segment is
    the first of the next). ``B`` wins when its gain beats the mean of ``A`` and ``A'`` by
    more than ``select_margin`` of that mean's size; bracketing cancels the steady fall of
    ``G`` over a run to first order (the remainder, with a convex loss curve, favours the
    held mode: a switch must be earned). Each change of mode is answered with **select**
    (``suggestion["select"]``: 1.0 on, 0.0 off); the trial repeats ``select_recheck``
    evaluations after each verdict (None: once). Rule 1, a plateau's stop or decay, and the
    budget come first; a decay that begins during a trial returns to the held mode
    (``suggestion["select"]`` on the ``decay`` decision), and the mode then stays.

    **With a warmup-stable-decay schedule** (``decay_fraction`` set), most of the final gain
    comes in the decay ("cooldown") of the learning rate, so a run should not be cut in its
    stable phase: the governor decides when the decay begins instead. Where rule 2 would
    stop, or once the budget left could not pay for a decay of ``decay_fraction`` times the
    FLOPs spent so far (``F_t * (1 + decay_fraction) >= flop_budget``), it answers
    **decay**, with ``suggestion["decay_flops"]``, the FLOPs the decay is given
    (``decay_fraction * F_t``, within the budget). Rule 2's ``P_t`` then takes the stable
    phase's FLOPs left, ``flop_budget / (1 + decay_fraction) - F_t``, for ``R_t``: the decay
    is spent either way, and what a decay begun now gives up is the rest of the stable
    phase. The training loop then anneals its
    learning rate over those FLOPs, and the governor answers **continue** until they are
    spent, then **stop** ("decay done"). An ungoverned WSD run decays at the budget's
    ``1 / (1 + decay_fraction)``; a run that plateaus earlier decays, and ends, earlier
    (the FLOPs it saves).

    Args:
        flop_budget: total FLOPs the run may spend.
        flops_per_token: default model FLOPs per training token for :meth:`step`.
        window: number of evaluations the slope is fitted on (at least 2).
        patience: consecutive evaluations under the stop threshold before stopping.
        min_improvement: relative loss improvement under which the rest of the budget is
            not worth spending (0.005 = 0.5%).
        reallocate_fraction: drop of ``G`` relative to ``G_ref`` that triggers a reallocation.
        cooldown: evaluations between two reallocations (default: ``window``).
        suggestion: what a reallocation proposes to the optimizer.
        decay_fraction: the length of a learning-rate decay phase as a fraction of the
            FLOPs spent before it (e.g. 0.25): the governor then decides when the decay
            begins instead of stopping (see above). None: no decay phase.
        select_trial: evaluations per segment of a selection trial (at least 2; see above).
            None: the governor does not decide on selection.
        select_margin: the relative margin by which the other mode's gain per FLOP must
            beat the held mode's to switch.
        select_recheck: evaluations between a verdict and the next trial (None: one trial).
    """

    def __init__(
        self,
        flop_budget: float,
        *,
        flops_per_token: Optional[float] = None,
        window: int = 5,
        patience: int = 5,
        min_improvement: float = 0.005,
        reallocate_fraction: float = 0.25,
        cooldown: Optional[int] = None,
        suggestion: Optional[dict[str, float]] = None,
        decay_fraction: Optional[float] = None,
        select_trial: Optional[int] = None,
        select_margin: float = 0.0,
        select_recheck: Optional[int] = None,
    ) -> None:
        # Every check before any assignment: a refused governor is never half-built. Each
        # number must be finite: a NaN threshold compares False everywhere and would switch
        # its rule off without a word.
        if not (isinstance(flop_budget, numbers.Real) and math.isfinite(flop_budget)
                and flop_budget > 0):
            raise ValueError(f"flop_budget must be a finite positive number, got {flop_budget!r}")
        if flops_per_token is not None and not _finite_positive(flops_per_token):
            raise ValueError(
                f"flops_per_token must be a finite positive number, got {flops_per_token!r}")
        _check_count("window", window, 2, "to fit a slope")
        _check_count("patience", patience, 1)
        if cooldown is not None:
            _check_count("cooldown", cooldown, 0)
        if not (isinstance(min_improvement, numbers.Real) and math.isfinite(min_improvement)
                and min_improvement >= 0):
            raise ValueError(
                f"min_improvement must be a finite number >= 0, got {min_improvement!r}")
        if not (isinstance(reallocate_fraction, numbers.Real)
                and 0.0 < reallocate_fraction < 1.0):
            raise ValueError(f"reallocate_fraction must lie in (0, 1), got {reallocate_fraction!r}")
        if decay_fraction is not None and not _finite_positive(decay_fraction):
            raise ValueError(
                f"decay_fraction must be a finite positive number, got {decay_fraction!r}")
        if select_trial is not None:
            _check_count("select_trial", select_trial, 2, "to fit a slope per segment")
        if select_recheck is not None:
            _check_count("select_recheck", select_recheck, 1)
        if not (isinstance(select_margin, numbers.Real) and math.isfinite(select_margin)
                and select_margin >= 0):
            raise ValueError(f"select_margin must be a finite number >= 0, got {select_margin!r}")
        if suggestion is not None:
            for key, factor in suggestion.items():
                if not _finite_positive(factor):
                    raise ValueError(
                        f"suggestion[{key!r}] must be a finite positive factor, got {factor!r}")
        self.flop_budget = float(flop_budget)
        self.flops_per_token = flops_per_token
        self.window = window
        self.patience = patience
        self.min_improvement = min_improvement
        self.reallocate_fraction = reallocate_fraction
        self.cooldown = window if cooldown is None else cooldown
        if suggestion is None:
            suggestion = {"update_gap_factor": 1.5, "rho_factor": 0.8}
        self.suggestion = dict(suggestion)
        self.decay_fraction = None if decay_fraction is None else float(decay_fraction)
        self.select_trial = select_trial
        self.select_margin = float(select_margin)
        self.select_recheck = select_recheck
        self._attached: list[Any] = []

        self.spent_flops = 0.0
        self.steps = 0
        self.evaluations = 0
        self.history: list[dict[str, Any]] = []
        self._points: list[tuple[float, float]] = []
        self._below_streak = 0
        self._gain_ref: Optional[float] = None
        self._last_reallocation: Optional[int] = None
        # FLOPs at which the decay phase ends, once the governor has started it.
        self.decay_end: Optional[float] = None
        # Selection trials: the mode asked for, the trial's phase ("hold", "trial" or
        # "bracket"), the current segment's points and the gains of the finished ones.
        self.selecting = False
        self._select_phase = "hold"
        self._segment: list[tuple[float, float]] = []
        self._segment_gains: list[float] = []
        # Evaluations to hold the mode before the next trial; None once trials are over.
        self._hold_left: Optional[int] = 0

    @property
    def remaining_flops(self) -> float:
        return self.flop_budget - self.spent_flops

    @property
    def exhausted(self) -> bool:
        return self.spent_flops >= self.flop_budget

    def attach(self, optimizer: Any) -> None:
        """Have ``optimizer.apply_governor(decision)`` called on every reallocation."""
        if not callable(getattr(optimizer, "apply_governor", None)):
            logger.warning("%s has no apply_governor(decision); reallocations will not change it",
                           type(optimizer).__name__)
        self._attached.append(optimizer)

    def add_flops(self, flops: float) -> None:
        if not (isinstance(flops, numbers.Real) and math.isfinite(flops) and flops >= 0):
            raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
        self.spent_flops += float(flops)

    def step(
        self, tokens: int, flops_per_token: Optional[float] = None, optimizer_flops: float = 0.0
    ) -> None:
        """Count one training step: ``tokens * flops_per_token + optimizer_flops``."""
        flops_per_token = self.flops_per_token if flops_per_token is None else flops_per_token
        if flops_per_token is None:
            raise ValueError("step() needs flops_per_token, here or in the constructor")
        if not (isinstance(tokens, numbers.Integral) and tokens >= 0):
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        self.add_flops(tokens * flops_per_token + optimizer_flops)
        self.steps += 1

    def observe(
        self, loss: float, flops: Optional[float] = None, step: Optional[int] = None
    ) -> Decision:
        """Record an evaluation loss and decide (see the class docstring for the rules).

        ``flops`` is the cumulative FLOP count at this evaluation; given, it replaces the count
        kept by :meth:`step`/:meth:`add_flops`. ``step`` only labels the record (default: the
        number of :meth:`step` calls).
        """
        loss = float(loss)
        if loss <= 0:
            raise ValueError(
                f"the loss must be positive (improvement is relative to it), got {loss}"
            )
        spent = self.spent_flops
        if flops is not None:
            if not (isinstance(flops, numbers.Real) and math.isfinite(flops) and flops >= 0):
                raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
            spent = float(flops)
        if self._points and spent <= self._points[-1][0]:
            raise ValueError(
                f"FLOPs must grow between evaluations: {spent:.6g} after "
                f"{self._points[-1][0]:.6g}; count them with step() or add_flops(), or pass flops="
            )
        self.spent_flops = spent
        self.evaluations += 1
        decision = Decision(
            action="continue",
            reason="",
            evaluation=self.evaluations,
            step=self.steps if step is None else step,
            flops=self.spent_flops,
            loss=loss,
            remaining_flops=self.remaining_flops,
        )
        if math.isfinite(loss):
            self._points = (self._points + [(self.spent_flops, loss)])[-self.window:]
            self._segment.append((self.spent_flops, loss))
        self._decide(decision)
        self.history.append(decision.to_dict())
        level = logging.DEBUG if decision.action == "continue" else logging.INFO
        logger.log(level, "governor %s at evaluation %d (step %d, %.3g FLOPs, loss %.4f): %s",
                   decision.action, decision.evaluation, decision.step, decision.flops,
                   decision.loss, decision.reason)
        if decision.action == "reallocate":
            for optimizer in self._attached:
                if callable(getattr(optimizer, "apply_governor", None)):
                    optimizer.apply_governor(decision)
        return decision

    @property
    def decaying(self) -> bool:
        """Whether the learning-rate decay the governor started is under way."""
        return self.decay_end is not None

    def _start_decay(self, d: Decision, why: str) -> None:
        length = min(self.decay_fraction * d.flops, self.flop_budget - d.flops)
        self.decay_end = d.flops + length
        d.action = "decay"
        d.reason = f"{why}; decay the learning rate over the next {length:.4g} FLOPs"
        d.suggestion = {"decay_flops": length}
        if self._select_phase == "trial":
            # The decay is spent in the mode the run held, not in an unfinished trial's.
            self.selecting = not self.selecting
            self._select_phase = "hold"
            self._segment_gains = []
            d.suggestion["select"] = float(self.selecting)

    def _stake(self, d: Decision) -> float:
        """The FLOPs a stop or decay decided now gives up at the current rate: the rest of
        the budget, or with a decay phase the stable phase's rest, ``flop_budget / (1 +
        decay_fraction) - F_t`` (the decay is spent either way, now or at the budget's end,
        and it is the stable phase's gain that a decay now forgoes)."""
        if self.decay_fraction is None:
            return d.remaining_flops
        return max(0.0, self.flop_budget / (1.0 + self.decay_fraction) - d.flops)

    def _decide(self, d: Decision) -> None:
        if not math.isfinite(d.loss):
            d.action, d.reason = "stop", f"loss is not finite ({d.loss})"
            return
        if self.decaying:
            if d.flops >= self.decay_end or self.exhausted:
                d.action, d.reason = "stop", f"decay done at {d.flops:.4g} FLOPs"
            else:
                d.reason = f"decaying until {self.decay_end:.4g} FLOPs"
            return
        if self.exhausted:
            d.action, d.reason = "stop", (
                f"budget exhausted: {d.flops:.4g} of {self.flop_budget:.4g} FLOPs spent"
            )
            return
        if self.decay_fraction is not None and \
                d.flops * (1.0 + self.decay_fraction) >= self.flop_budget:
            self._start_decay(d, "the budget left pays for the decay and no more")
            return
        gain = None
        if len(self._points) >= self.window:
            xs, ys = zip(*self._points)
            gain = -_slope(list(xs), list(ys))
            d.gain_per_flop = gain
            d.projected_improvement = gain * self._stake(d) / d.loss
            if d.projected_improvement < self.min_improvement:
                self._below_streak += 1
            else:
                self._below_streak = 0
            if self._below_streak >= self.patience:
                why = (f"the rest of the budget would improve the loss by "
                       f"{d.projected_improvement:.3%} at the current rate, under "
                       f"{self.min_improvement:.3%}, for {self._below_streak} evaluations")
                if self.decay_fraction is not None:
                    self._start_decay(d, why)
                else:
                    d.action, d.reason = "stop", why
                return
        if self.select_trial is not None and self._decide_selection(d):
            return
        if gain is None:
            d.reason = f"filling the window: {len(self._points)} of {self.window} evaluations"
            return

        if self._gain_ref is None:
            if gain > 0:
                self._gain_ref = gain
            d.reason = f"G = {gain:.3g} per FLOP"
            return
        cooled = (self._last_reallocation is None
                  or d.evaluation - self._last_reallocation >= self.cooldown)
        if gain < self.reallocate_fraction * self._gain_ref and cooled:
            d.action, d.reason = "reallocate", (
                f"G = {gain:.3g} per FLOP fell under {self.reallocate_fraction:g} x "
                f"{self._gain_ref:.3g}"
            )
            d.suggestion = dict(self.suggestion)
            if gain > 0:
                self._gain_ref = gain
            self._last_reallocation = d.evaluation
            return
        d.reason = f"G = {gain:.3g} per FLOP (reference {self._gain_ref:.3g})"

    def _segment_done(self) -> bool:
        # A segment's first point is the last of the one before (the loss where the mode
        # changed); the run's first segment has no such point.
        return len(self._segment) > self.select_trial

    def _switch(self, d: Decision, why: str) -> None:
        self.selecting = not self.selecting
        self._segment = self._segment[-1:]
        d.action = "select"
        d.reason = f"selection {'on' if self.selecting else 'off'}: {why}"
        d.suggestion = {"select": float(self.selecting)}

    def _decide_selection(self, d: Decision) -> bool:
        """Advance the selection trial; True when it decided (a switch or a verdict)."""
        if self._hold_left is None:
            return False
        if self._select_phase == "hold":
            # Only the last segment's worth of the held mode is compared.
            self._segment = self._segment[-(self.select_trial + 1):]
            if self._hold_left > 0:
                self._hold_left -= 1
                if self._hold_left > 0:
                    return False
        if not self._segment_done():
            return False
        xs, ys = zip(*self._segment)
        self._segment_gains.append(-_slope(list(xs), list(ys)))
        held = "selected" if (self.selecting != (self._select_phase == "trial")) else "plain"
        if self._select_phase == "hold":
            self._select_phase = "trial"
            self._switch(d, f"trial of {self.select_trial} evaluations against {held} steps "
                            f"(G = {self._segment_gains[-1]:.3g} per FLOP)")
            return True
        if self._select_phase == "trial":
            self._select_phase = "bracket"
            self._switch(d, f"back to {held} steps to bracket the trial "
                            f"(G = {self._segment_gains[-1]:.3g} per FLOP)")
            return True
        before, tried, after = self._segment_gains
        reference = 0.5 * (before + after)
        self._select_phase = "hold"
        self._segment_gains = []
        # None: no further trial.
        self._hold_left = self.select_recheck
        verdict = (f"G = {tried:.3g} per FLOP on trial against {reference:.3g} on {held} "
                   f"steps ({before:.3g} before, {after:.3g} after)")
        if tried - reference > self.select_margin * abs(reference):
            self._switch(d, verdict)
            return True
        self._segment = self._segment[-1:]
        d.reason = f"selection stays {'on' if self.selecting else 'off'}: {verdict}"
        return True

    def state_dict(self) -> dict[str, Any]:
        """The run's progress, as plain JSON-able values.

        The settings (budget, window, thresholds) are not included: they come from the
        constructor, so a resumed run may, for instance, be given a larger budget.
        """
        return {
            "spent_flops": self.spent_flops,
            "steps": self.steps,
            "evaluations": self.evaluations,
            "points": [list(p) for p in self._points],
            "below_streak": self._below_streak,
            "gain_ref": self._gain_ref,
            "last_reallocation": self._last_reallocation,
            "decay_end": self.decay_end,
            "selecting": self.selecting,
            "select_phase": self._select_phase,
            "segment": [list(p) for p in self._segment],
            "segment_gains": list(self._segment_gains),
            "hold_left": self._hold_left,
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spent_flops = float(state_dict["spent_flops"])
        self.steps = int(state_dict["steps"])
        self.evaluations = int(state_dict["evaluations"])
        self._points = [(float(f), float(l)) for f, l in state_dict["points"]][-self.window:]
        self._below_streak = int(state_dict["below_streak"])
        self._gain_ref = state_dict["gain_ref"]
        self._last_reallocation = state_dict["last_reallocation"]
        # Saved before the decay phase existed: none had started.
        self.decay_end = state_dict.get("decay_end")
        # Saved before selection trials existed: selection was off.
        self.selecting = bool(state_dict.get("selecting", False))
        self._select_phase = state_dict.get("select_phase", "hold")
        self._segment = [(float(f), float(l)) for f, l in state_dict.get("segment", [])]
        self._segment_gains = [float(g) for g in state_dict.get("segment_gains", [])]
        self._hold_left = state_dict.get("hold_left", 0)
        self.history = [dict(h) for h in state_dict["history"]]
