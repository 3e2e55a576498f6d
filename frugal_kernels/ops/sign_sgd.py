"""``frugal::sign_sgd_``: SignSGD with decoupled weight decay on lists of tensors."""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import DTYPE_CODES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Scalar, addresses, as_scalar_tensor,
                                        check_batch, check_finite, check_scalars, host_value,
                                        numels)

OP = "frugal::sign_sgd_"


def _check(params, grads, weight_decay, scale) -> None:
    check_batch(OP, params, grads, {})
    check_finite(OP, weight_decay=weight_decay, scale=scale)


@torch.library.custom_op(OP, mutates_args=("params",))
def _sign_sgd_op(params: List[Tensor], grads: List[Tensor], lr: Tensor, weight_decay: float,
                 scale: float, backend: str) -> None:
    _check(params, grads, weight_decay, scale)
    check_scalars(OP, lr)
    if not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(params, [g.contiguous() for g in grads], lr, weight_decay, scale)


@_sign_sgd_op.register_fake
def _(params, grads, lr, weight_decay, scale, backend) -> None:
    _check(params, grads, weight_decay, scale)


def _cpu(params, grads, lr, weight_decay, scale) -> None:
    extension().sign_sgd_cpu(addresses(params), addresses(grads), numels(params),
                             DTYPE_CODES[params[0].dtype], host_value(lr), weight_decay, scale,
                             torch.get_num_threads())


def _cuda(params, grads, lr, weight_decay, scale) -> None:
    from frugal_kernels.ops._cuda import device_scalar, launch_context

    with launch_context(params[0].device) as stream:
        lr_value, lr_ptr, _lr_alive = device_scalar(lr, params[0].device)
        extension().sign_sgd_cuda(addresses(params), addresses(grads), numels(params),
                                  DTYPE_CODES[params[0].dtype], lr_value, weight_decay, scale,
                                  lr_ptr, stream)


def _triton(params, grads, lr, weight_decay, scale) -> None:
    from frugal_kernels.kernels.triton.sign_sgd import sign_sgd_

    sign_sgd_(params, grads, lr=lr, weight_decay=weight_decay, scale=scale)


def _torch(params, grads, lr, weight_decay, scale) -> None:
    reference.sign_sgd_(params, grads, lr=host_value(lr), weight_decay=weight_decay, scale=scale)


_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


def sign_sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    lr: Scalar,
    weight_decay: float = 0.0,
    scale: float = 1.0,
    backend: str = "auto",
) -> None:
    """SignSGD in place: ``p = p * (1 - lr * weight_decay) - lr * scale * sign(g)``.

    Reads p and g and writes p, nothing more: no optimizer state. Tensors as
    for :func:`adamw_`; ``lr`` a number or a one-element tensor.
    """
    _sign_sgd_op(list(params), list(grads), as_scalar_tensor(OP, "lr", lr), float(weight_decay),
                 float(scale), backend)
