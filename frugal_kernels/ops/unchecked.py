"""The ops' faces without their metadata checks and without torch.library's dispatch.

For callers that have checked the same call once and repeat it, as the
optimizers' plans do (:func:`frugal_kernels.optim.plan.run`): every step
updates the same params and states, and only the gradients and the scalars
change. A call here runs the op's body (:func:`frugal_kernels.ops.adamw.apply`
and its siblings: the same backend, kernels and arguments as the registered
op, so the result is bit-identical) and bumps the version counters of the
tensors it mutates, as the registered op does. The scalar checks that need no
device sync (a finite lr, a step >= 1) still run.

The ``prepare_*`` functions go further for the calls whose only new tensors at
each step are the gradients: they gather the other tensors once
(:mod:`frugal_kernels.ops.prepared`).

Not for torch.compile (its graphs call the registered ops) and not for users:
a mismatched call here is undefined, where the public ops raise.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels.ops import (adamw, dqt_update, frugal_step, lowrank_adamw_step, lowrank_step,
                                sign_sgd)

__all__ = ["adamw_", "dqt_update_", "lowrank_step_", "prepare_adamw_",
           "prepare_frugal_step_", "prepare_lowrank_adamw_step_", "prepare_sign_sgd_"]


def _mutated(*lists: Sequence[Tensor]) -> None:
    torch._C._increment_version([t for tensors in lists for t in tensors])


def adamw_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
           exp_avg_sqs: List[Tensor], *, lr: Tensor, beta1: float, beta2: float, eps: float,
           weight_decay: float, step: Tensor, maximize: bool = False,
           grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
           backend: str = "auto") -> None:
    adamw.apply(params, grads, exp_avgs, exp_avg_sqs, lr.reshape(()), float(beta1),
                float(beta2), float(eps), float(weight_decay), step.reshape(()), bool(maximize),
                grad_scale, found_inf, backend)
    _mutated(params, exp_avgs, exp_avg_sqs)


def lowrank_step_(params: List[Tensor], grads: List[Tensor], low_updates: List[Tensor],
                  low_grads: List[Tensor], projections: List[Tensor], sides: List[int], *,
                  lr: Tensor, weight_decay: float = 0.0, state_free: str = "sign",
                  state_free_scale: float = 1.0, grad_scale: Optional[Tensor] = None,
                  found_inf: Optional[Tensor] = None, backend: str = "auto") -> None:
    lowrank_step.apply(params, grads, low_updates, low_grads, projections,
                       [int(s) for s in sides], lr.reshape(()), float(weight_decay), state_free,
                       float(state_free_scale), grad_scale, found_inf, backend)
    _mutated(params)


def dqt_update_(codes: List[Tensor], scales: List[Tensor], grads: List[Tensor],
                exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], indices: List[Tensor], *,
                bits: int, kind: str, seeds: List[int], lr: Tensor, beta1: float, beta2: float,
                eps: float, weight_decay: float, step: Tensor, rng_step: int,
                state_free: str = "sign", state_free_scale: float = 1.0,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                backend: str = "auto", check_indices: bool = False) -> None:
    dqt_update.apply(codes, scales, grads, exp_avgs, exp_avg_sqs, indices, kind, seeds, int(bits),
                     lr.reshape(()), float(beta1), float(beta2), float(eps), float(weight_decay),
                     step.reshape(()), state_free, float(state_free_scale), int(rng_step),
                     grad_scale, found_inf, backend)
    _mutated(codes, exp_avgs, exp_avg_sqs)


# Prepared calls (frugal_kernels.ops.prepared): the op over these tensors, to be called
# with each step's gradients and scalars (the keywords of the op's face).

def prepare_adamw_(params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *,
                   backend: str = "auto") -> adamw.Prepared:
    return adamw.Prepared(params, exp_avgs, exp_avg_sqs, backend)


def prepare_sign_sgd_(params: List[Tensor], *, backend: str = "auto") -> sign_sgd.Prepared:
    return sign_sgd.Prepared(params, backend)


def prepare_frugal_step_(params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                         indices: List[Tensor], *, kind: str, backend: str = "auto"
                         ) -> frugal_step.Prepared:
    return frugal_step.Prepared(params, exp_avgs, exp_avg_sqs, indices, kind, backend)


def prepare_lowrank_adamw_step_(params: List[Tensor], exp_avgs: List[Tensor],
                                exp_avg_sqs: List[Tensor], projections: List[Tensor],
                                sides: List[int], *, backend: str = "auto"
                                ) -> lowrank_adamw_step.Prepared:
    return lowrank_adamw_step.Prepared(params, exp_avgs, exp_avg_sqs, projections, sides,
                                       backend)
