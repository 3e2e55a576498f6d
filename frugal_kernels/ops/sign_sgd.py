"""``frugal::sign_sgd_``: SignSGD with decoupled weight decay on lists of tensors."""

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

OP = "frugal::sign_sgd_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]


@dataclasses.dataclass(frozen=True)
class SignSgdHyper(Hyper):
    lr: Tensor
    weight_decay: float
    scale: float
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched


def _check(params, grads, lr, weight_decay, scale, grad_scale, found_inf, backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    check_batch(OP, params, grads, {})
    check_finite(OP, weight_decay=weight_decay, scale=scale)


@torch.library.custom_op(OP, mutates_args=("params",))
def _sign_sgd_op(params: List[Tensor], grads: List[Tensor], lr: Tensor, weight_decay: float,
                 scale: float, grad_scale: Optional[Tensor],
                 found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, lr, weight_decay, scale, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params},
                     read={"grads": grads})
    apply(params, grads, lr, weight_decay, scale, grad_scale, found_inf, backend)


def apply(params: List[Tensor], grads: List[Tensor], lr: Tensor, weight_decay: float,
          scale: float, grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks (see :func:`frugal_kernels.ops.adamw.apply`)."""
    check_scalars(OP, lr)
    if skipped_on_host(found_inf):
        return
    if not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(Tensors(params, [g.contiguous() for g in grads]), SignSgdHyper(lr, weight_decay, scale,
                                                                        grad_scale, found_inf))


_sign_sgd_op.register_fake(_check)


def _prepare_cpu(ext, t: Tensors) -> Call:
    batch = GatheredBatch(t.params)

    def call(grads: List[int], h: SignSgdHyper) -> None:
        ext.sign_sgd_cpu(batch.with_grads(ext, grads), h.kernel(ext), torch.get_num_threads())
    return call


def _prepare_cuda(ext, t: Tensors) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params), t.params[0].device

    def call(grads: List[int], h: SignSgdHyper) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.sign_sgd_cuda(batch.with_grads(ext, grads), hyper, scalars, stream)
    return call


def _triton(t: Tensors, h: SignSgdHyper) -> None:
    from frugal_kernels.kernels.triton.sign_sgd import sign_sgd_

    sign_sgd_(*t, **h.values())


def _torch(t: Tensors, h: SignSgdHyper) -> None:
    reference.sign_sgd_(*t, **h.on_host())


_PREPARED = {"cpu": _prepare_cpu, "cuda": _prepare_cuda}
_cpu = gathered_backend(_prepare_cpu, lambda: extension())
_cuda = gathered_backend(_prepare_cuda, lambda: extension())

_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


class Prepared(PreparedCall):
    """:func:`sign_sgd_` over fixed params (:mod:`frugal_kernels.ops.prepared`)."""

    op, impls, prepared = OP, _IMPLS, _PREPARED

    def __init__(self, params: List[Tensor], backend: str):
        super().__init__(Tensors(params, []), params, backend)

    def __call__(self, grads: List[Tensor], *, lr: Tensor, weight_decay: float = 0.0,
                 scale: float = 1.0, grad_scale: Optional[Tensor] = None,
                 found_inf: Optional[Tensor] = None) -> None:
        self._run(grads, SignSgdHyper(lr.reshape(()), float(weight_decay), float(scale),
                                      grad_scale, found_inf))


def sign_sgd_(params: Sequence[Tensor], grads: Sequence[Tensor], *, lr: Scalar,
              weight_decay: float = 0.0, scale: float = 1.0, grad_scale: Optional[Tensor] = None,
              found_inf: Optional[Tensor] = None, backend: str = "auto") -> None:
    """SignSGD in place: ``p = p * (1 - lr * weight_decay) - lr * scale * sign(g)``.

    Reads p and g and writes p, nothing more: no optimizer state. Tensors as
    for :func:`adamw_`; ``lr`` a number or a one-element tensor.
    """
    check_amp(OP, grad_scale, found_inf)
    _sign_sgd_op(list(params), list(grads), as_scalar_tensor(OP, "lr", lr), float(weight_decay),
                 float(scale), grad_scale, found_inf, backend)
