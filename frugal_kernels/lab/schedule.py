"""A warmup-stable-decay learning-rate schedule whose decay the compute governor starts.

With a WSD schedule most of the final gain comes in the decay, so a governed run should not
be cut in its stable phase: a :class:`~frugal_kernels.Governor` built with
``decay_fraction`` answers ``"decay"`` (with ``suggestion["decay_flops"]``) when the run
plateaus or when the budget only pays for the decay, then ``"stop"`` once the decay's FLOPs
are spent (docs/governor.md). :class:`GovernedWSD` is the learning-rate multiplier that
follows those decisions: a linear warmup, then the peak lr until the governor's ``"decay"``,
then a linear decay to ``min_lr_ratio`` over the steps its FLOPs pay for.

The schedule holds no state of its own: the decay's start and length are read from the
governor's history, so a run whose governor is restored (``load_state_dict``) resumes its
schedule too. An ungoverned twin of the same budget decays at the budget's
``1 / (1 + decay_fraction)``: :func:`twin_cooldown_fraction` is its ``cooldown_fraction``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from frugal_kernels.governor import Governor

__all__ = ["GovernedWSD", "evaluation_due", "governed_schedule", "twin_cooldown_fraction"]


def twin_cooldown_fraction(decay_fraction: float) -> float:
    """The ``cooldown_fraction`` of a plain WSD run that decays where a governed run that
    never plateaus does: at ``1 / (1 + decay_fraction)`` of its length (0.2 for 0.25)."""
    return decay_fraction / (1.0 + decay_fraction)


class GovernedWSD:
    """Multiplier of the base lr for update ``step`` (0-based, as ``LambdaLR`` counts):
    ``(step + 1) / warmup_steps`` in the warmup, 1 in the stable phase, and from the
    governor's ``"decay"`` decision at step ``s`` (1-based, after its update) a linear
    decay reaching ``min_lr_ratio`` at update ``s + n``, where ``n`` is the number of
    steps the decision's ``decay_flops`` pay for at the mean FLOPs per step until ``s``.
    """

    def __init__(self, governor: Governor, warmup_steps: int, min_lr_ratio: float) -> None:
        if governor.decay_fraction is None:
            raise ValueError("GovernedWSD follows a governor built with decay_fraction; "
                             "this one has none, so it never starts a decay")
        self.governor = governor
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio

    def decay(self) -> Optional[tuple[int, int]]:
        """``(start, length)`` in steps of the decay the governor started, None before."""
        for decision in reversed(self.governor.history):
            if decision["action"] == "decay":
                per_step = decision["flops"] / max(1, decision["step"])
                length = max(1, math.ceil(decision["suggestion"]["decay_flops"] / per_step))
                return decision["step"], length
        return None

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = self.decay()
        if decay is None:
            return 1.0
        start, length = decay
        progress = min(1.0, max(0.0, (step - start + 1) / length))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress

    def apply_now(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Set the optimizer's lrs for its next update from this schedule. ``LambdaLR`` set
        them when it stepped, before the evaluation whose decision started the decay; without
        this the decay would begin one update late."""
        for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base_lr * self(scheduler.last_epoch)


def governed_schedule(governor: Optional[Governor], warmup_steps: int,
                      min_lr_ratio: float) -> Optional[GovernedWSD]:
    """The governed WSD schedule of a run under ``governor`` with a ``decay_fraction``;
    None for every other run (its schedule is the config's own)."""
    if governor is None or governor.decay_fraction is None:
        return None
    return GovernedWSD(governor, warmup_steps, min_lr_ratio)


def evaluation_due(governor: Optional[Governor]) -> bool:
    """Whether the loop should evaluate now, between its regular evaluations, so that the
    governor decides at the step its budget calls for rather than up to an interval late:
    the budget is spent, the budget left only pays for the decay, or the decay is done."""
    if governor is None:
        return False
    if governor.exhausted:
        return True
    if governor.decay_fraction is None:
        return False
    if governor.decaying:
        return governor.spent_flops >= governor.decay_end
    return governor.spent_flops * (1.0 + governor.decay_fraction) >= governor.flop_budget

