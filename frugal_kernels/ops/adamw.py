"""``frugal::adamw_``: AdamW on lists of tensors in one call."""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import DTYPE_CODES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Scalar, addresses, as_scalar_tensor,
                                        check_batch, check_finite, check_scalars, host_value, numels)

OP = "frugal::adamw_"


def _check(params, grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay) -> None:
    check_batch(OP, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{OP}: {name} must be in [0, 1), got {beta}")
    if not eps >= 0.0:
        raise ValueError(f"{OP}: eps must be >= 0, got {eps}")
    check_finite(OP, weight_decay=weight_decay)


@torch.library.custom_op(OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _adamw_op(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    maximize: bool,
    backend: str,
) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay)
    check_scalars(OP, lr, step)
    if not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(params, [g.contiguous() for g in grads], exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps,
         weight_decay, step, maximize)


@_adamw_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, maximize,
      backend) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay)


def _cpu(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
         maximize) -> None:
    extension().adamw_cpu(
        addresses(params), addresses(grads), addresses(exp_avgs), addresses(exp_avg_sqs),
        numels(params), DTYPE_CODES[params[0].dtype], host_value(lr), beta1, beta2, eps,
        weight_decay, host_value(step), maximize, torch.get_num_threads())


def _cuda(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
          maximize) -> None:
    from frugal_kernels.ops._cuda import device_scalar, launch_context

    with launch_context(params[0].device) as stream:
        lr_value, lr_ptr, _lr_alive = device_scalar(lr, params[0].device)
        step_value, step_ptr, _step_alive = device_scalar(step, params[0].device)
        extension().adamw_cuda(
            addresses(params), addresses(grads), addresses(exp_avgs), addresses(exp_avg_sqs),
            numels(params), DTYPE_CODES[params[0].dtype], lr_value, beta1, beta2, eps,
            weight_decay, step_value, maximize, lr_ptr, step_ptr, stream)


def _triton(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
            maximize) -> None:
    from frugal_kernels.kernels.triton.adamw import adamw_

    adamw_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step, maximize=maximize)


def _torch(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
           maximize) -> None:
    reference.adamw_(params, grads, exp_avgs, exp_avg_sqs, lr=host_value(lr), beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, step=host_value(step),
                     maximize=maximize)


_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    maximize: bool = False,
    backend: str = "auto",
) -> None:
    """AdamW (decoupled weight decay) on lists of tensors, in place, in one call.

    The math of ``torch.optim.AdamW``: ``p *= 1 - lr * weight_decay``;
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g^2``;
    ``p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)``.

    Args:
        params, grads: tensors of one dtype (float32, bfloat16 or float16) on one
            device; params contiguous. Math runs in float32.
        exp_avgs, exp_avg_sqs: float32 moments, contiguous, shaped as the params.
        lr: a number or a one-element tensor (a device tensor is read on the
            device, without a sync, by the cuda and triton backends).
        step: the update count after this update, from 1, as ``state["step"]``
            of torch.optim.AdamW; a number or a one-element tensor.
        maximize: ascend the objective instead.
        backend: "auto", "cpu", "cuda", "triton" or "torch" (see DESIGN.md section 3).

    Raises ValueError / TypeError naming the offending argument before anything
    is written.
    """
    _adamw_op(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
              as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2), float(eps),
              float(weight_decay), as_scalar_tensor(OP, "step", step), bool(maximize), backend)
