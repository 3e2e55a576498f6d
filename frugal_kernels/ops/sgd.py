"""``frugal::sgd_``: torch.optim.SGD (momentum, dampening, Nesterov, L2 decay) on lists of tensors."""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Hyper, Scalar, as_scalar_tensor, check_batch, check_finite,
                                        check_amp, check_no_overlap, check_scalars,
                                        skipped_on_host, kernel_batch)

OP = "frugal::sgd_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]
    momentum_buffers: List[Tensor]


@dataclasses.dataclass(frozen=True)
class SgdHyper(Hyper):
    lr: Tensor
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    first_step: bool
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched


def _check(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov,
           maximize, first_step, grad_scale, found_inf, backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    check_finite(OP, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    if momentum < 0.0:
        raise ValueError(f"{OP}: momentum must be >= 0, got {momentum}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{OP}: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    if momentum == 0.0:
        if momentum_buffers:
            raise ValueError(f"{OP}: momentum is 0, so momentum_buffers must be empty")
        check_batch(OP, params, grads, {})
    else:
        check_batch(OP, params, grads, {"momentum_buffers": momentum_buffers})


@torch.library.custom_op(OP, mutates_args=("params", "momentum_buffers"))
def _sgd_op(params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Tensor], lr: Tensor,
            momentum: float, dampening: float, weight_decay: float, nesterov: bool,
            maximize: bool, first_step: bool, grad_scale: Optional[Tensor],
            found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov,
           maximize, first_step, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params, "momentum_buffers": momentum_buffers},
                     read={"grads": grads})
    check_scalars(OP, lr)
    if skipped_on_host(found_inf):
        return
    if not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(Tensors(params, [g.contiguous() for g in grads], momentum_buffers),
         SgdHyper(lr, momentum, dampening, weight_decay, nesterov, maximize, first_step,
                  grad_scale, found_inf))


_sgd_op.register_fake(_check)


def _cpu(t: Tensors, h: SgdHyper) -> None:
    ext = extension()
    ext.sgd_cpu(kernel_batch(ext, *t), h.kernel(ext), torch.get_num_threads())


def _triton(t: Tensors, h: SgdHyper) -> None:
    from frugal_kernels.kernels.triton.sgd import sgd_

    sgd_(*t, **h.values())


def _torch(t: Tensors, h: SgdHyper) -> None:
    reference.sgd_(*t, **h.on_host())


_IMPLS = {"cpu": _cpu, "triton": _triton, "torch": _torch}


def sgd_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
         *, lr: Scalar, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
         nesterov: bool = False, maximize: bool = False, first_step: bool = False,
         grad_scale: Optional[Tensor] = None,
         found_inf: Optional[Tensor] = None, backend: str = "auto") -> None:
    """SGD in place, in the order of operations of ``torch.optim.SGD(foreach=False)``.

    ``g = -g`` if maximize; ``g = g + weight_decay * p`` (coupled, L2);
    with momentum, ``b = g`` on the first step, else
    ``b = momentum * b + (1 - dampening) * g``, then ``g = g + momentum * b``
    (nesterov) or ``g = b``; finally ``p = p - lr * g``.

    Args:
        params, grads: as for :func:`adamw_` (float32, bfloat16 or float16 on
            one device; params contiguous). Math runs in float32.
        momentum_buffers: float32, contiguous, shaped as the params, one per
            param when ``momentum`` is not 0; an empty list when it is.
        lr: a number or a one-element tensor.
        first_step: this call creates the buffers (torch's ``momentum_buffer``
            is None): they are overwritten with the gradient, whatever they held,
            and dampening does not apply.
        backend: "auto", "cpu", "triton" or "torch" (DESIGN.md section 3).

    Raises ValueError / TypeError naming the offending argument before anything
    is written.
    """
    check_amp(OP, grad_scale, found_inf)
    _sgd_op(list(params), list(grads), list(momentum_buffers), as_scalar_tensor(OP, "lr", lr),
            float(momentum), float(dampening), float(weight_decay), bool(nesterov),
            bool(maximize), bool(first_step), grad_scale, found_inf, backend)
