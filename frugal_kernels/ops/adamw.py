"""``frugal::adamw_``: AdamW on lists of tensors in one call."""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (GatheredBatch, Hyper, Scalar, as_scalar_tensor,
                                        check_batch, check_finite, check_amp, check_no_overlap,
                                        check_scalars, skipped_on_host)
from frugal_kernels.ops.prepared import Call, PreparedCall, gathered_backend

OP = "frugal::adamw_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]


@dataclasses.dataclass(frozen=True)
class AdamWCore(Hyper):
    """AdamW's hyper-parameters, shared with ``frugal_step_``."""

    lr: Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: Tensor


@dataclasses.dataclass(frozen=True)
class AdamWHyper(AdamWCore):
    maximize: bool
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched


def check_adamw_hyper(op: str, beta1: float, beta2: float, eps: float) -> None:
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {beta}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")


def _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
           maximize, grad_scale, found_inf, backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    check_batch(OP, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    check_adamw_hyper(OP, beta1, beta2, eps)
    check_finite(OP, weight_decay=weight_decay)


@torch.library.custom_op(OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _adamw_op(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
              exp_avg_sqs: List[Tensor], lr: Tensor, beta1: float, beta2: float, eps: float,
              weight_decay: float, step: Tensor, maximize: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
           maximize, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params, "exp_avgs": exp_avgs,
                                  "exp_avg_sqs": exp_avg_sqs}, read={"grads": grads})
    apply(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
          maximize, grad_scale, found_inf, backend)


def apply(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
          exp_avg_sqs: List[Tensor], lr: Tensor, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: Tensor, maximize: bool, grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks, with the op's signature (the
    optimizers' plans call it through :class:`Prepared`, made once per plan)."""
    check_scalars(OP, lr, step)
    if skipped_on_host(found_inf):
        return
    if not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(Tensors(params, [g.contiguous() for g in grads], exp_avgs, exp_avg_sqs),
         AdamWHyper(lr, beta1, beta2, eps, weight_decay, step, maximize, grad_scale, found_inf))


_adamw_op.register_fake(_check)


def _prepare_cpu(ext, t: Tensors) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)

    def call(grads: List[int], h: AdamWHyper) -> None:
        ext.adamw_cpu(batch.with_grads(ext, grads), h.kernel(ext), torch.get_num_threads())
    return call


def _prepare_cuda(ext, t: Tensors) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs), t.params[0].device

    def call(grads: List[int], h: AdamWHyper) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.adamw_cuda(batch.with_grads(ext, grads), hyper, scalars, stream)
    return call


def _triton(t: Tensors, h: AdamWHyper) -> None:
    from frugal_kernels.kernels.triton.adamw import adamw_

    adamw_(*t, **h.values())


def _torch(t: Tensors, h: AdamWHyper) -> None:
    reference.adamw_(*t, **h.on_host())


_PREPARED = {"cpu": _prepare_cpu, "cuda": _prepare_cuda}
_cpu = gathered_backend(_prepare_cpu, lambda: extension())
_cuda = gathered_backend(_prepare_cuda, lambda: extension())

_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


class Prepared(PreparedCall):
    """:func:`adamw_` over fixed params and moments (:mod:`frugal_kernels.ops.prepared`)."""

    op, impls, prepared = OP, _IMPLS, _PREPARED

    def __init__(self, params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                 backend: str):
        super().__init__(Tensors(params, [], exp_avgs, exp_avg_sqs),
                         [*params, *exp_avgs, *exp_avg_sqs], backend)

    def __call__(self, grads: List[Tensor], *, lr: Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: Tensor, maximize: bool = False,
                 grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
        self._run(grads, AdamWHyper(lr.reshape(()), float(beta1), float(beta2), float(eps),
                                    float(weight_decay), step.reshape(()), bool(maximize),
                                    grad_scale, found_inf))


def adamw_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], *, lr: Scalar, beta1: float, beta2: float, eps: float,
           weight_decay: float, step: Scalar, maximize: bool = False,
           grad_scale: Optional[Tensor] = None,
           found_inf: Optional[Tensor] = None, backend: str = "auto") -> None:
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
        grad_scale, found_inf: a GradScaler's tensors (one element each, or None):
            the gradients are divided by ``grad_scale`` as they are read, and a
            non-zero ``found_inf`` leaves every tensor untouched; both are read on
            the device by the cuda and triton backends (docs/ops.md). The other ops
            take them too.
        backend: "auto", "cpu", "cuda", "triton" or "torch" (see DESIGN.md section 3).

    Raises ValueError / TypeError naming the offending argument before anything
    is written.
    """
    check_amp(OP, grad_scale, found_inf)
    _adamw_op(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
              as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2), float(eps),
              float(weight_decay), as_scalar_tensor(OP, "step", step), bool(maximize), grad_scale,
              found_inf, backend)
