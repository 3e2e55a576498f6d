"""``frugal::frugal_step_``: the fused FRUGAL update of projected tensors.

In one pass over memory, the coordinates in each tensor's state-full subset
get AdamW with compact moments that hold only those coordinates, and every
other coordinate gets the state-free rule (SignSGD by default). A state-free
coordinate reads p and g and writes p, nothing more: this is why a density
rho < 1 moves fewer bytes than AdamW.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import (DTYPE_CODES, STATE_FREE_CODES, STATE_FREE_RULES,
                                    SUBSET_KIND_CODES, SUBSET_KINDS, matrix_view, subset_dim,
                                    subset_state_shape)
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Scalar, addresses, as_scalar_tensor, check_batch,
                                        check_finite, check_scalars, host_value)

OP = "frugal::frugal_step_"


def _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, beta1, beta2, eps, weight_decay,
           state_free, state_free_scale) -> None:
    if kind not in SUBSET_KINDS:
        raise ValueError(f"{OP}: kind must be one of {', '.join(SUBSET_KINDS)}; got {kind!r}")
    if state_free not in STATE_FREE_RULES:
        raise ValueError(f"{OP}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {state_free!r}")
    if len(indices) != len(params):
        raise ValueError(f"{OP}: got {len(params)} params but {len(indices)} indices; "
                         "the lists must have one entry per param")
    for i, (p, idx) in enumerate(zip(params, indices)):
        if not isinstance(idx, Tensor):
            raise TypeError(f"{OP}: indices[{i}] is a {type(idx).__name__}, not a torch.Tensor")
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{OP}: indices[{i}] has dtype {idx.dtype}; use torch.int32 or "
                            "torch.int64")
        if idx.dtype != indices[0].dtype:
            raise TypeError(f"{OP}: indices[{i}] has dtype {idx.dtype} but indices[0] has "
                            f"{indices[0].dtype}; one call takes one index dtype")
        if idx.dim() != 1:
            raise ValueError(f"{OP}: indices[{i}] must be 1-D, got shape {tuple(idx.shape)}")
        if isinstance(p, Tensor):
            if idx.device != p.device:
                raise ValueError(f"{OP}: indices[{i}] is on {idx.device} but params[{i}] is on "
                                 f"{p.device}")
            if kind != "flat" and p.dim() == 0:
                raise ValueError(f"{OP}: params[{i}] is 0-dim; kind {kind!r} needs at least "
                                 "one dimension (use kind='flat')")
            if idx.numel() > subset_dim(p, kind):
                raise ValueError(f"{OP}: indices[{i}] has {idx.numel()} entries but params[{i}] "
                                 f"has only {subset_dim(p, kind)} {kind}")
    check_batch(OP, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                state_shape=lambda i, p: subset_state_shape(p, kind, indices[i].numel()))
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{OP}: {name} must be in [0, 1), got {beta}")
    if not eps >= 0.0:
        raise ValueError(f"{OP}: eps must be >= 0, got {eps}")
    check_finite(OP, weight_decay=weight_decay, state_free_scale=state_free_scale)


def validate_indices(params: Sequence[Tensor], indices: Sequence[Tensor], kind: str) -> None:
    """Data checks of the subsets: sorted, unique and in range (a device sync on GPUs)."""
    for i, (p, idx) in enumerate(zip(params, indices)):
        if idx.numel() == 0:
            continue
        limit = subset_dim(p, kind)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            raise ValueError(f"{OP}: indices[{i}] holds values in [{lo}, {hi}] but must be in "
                             f"[0, {limit}) for {kind} of a tensor of shape {tuple(p.shape)}")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError(f"{OP}: indices[{i}] must be sorted and unique (strictly "
                             "increasing)")


@torch.library.custom_op(OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _frugal_step_op(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    indices: List[Tensor],
    kind: str,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    state_free: str,
    state_free_scale: float,
    backend: str,
) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, beta1, beta2, eps, weight_decay,
           state_free, state_free_scale)
    check_scalars(OP, lr, step)
    # Empty tensors have nothing to update (and no [R, C] view to speak of).
    keep = [i for i, p in enumerate(params) if p.numel() > 0]
    if not keep:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl([params[i] for i in keep], [grads[i].contiguous() for i in keep],
         [exp_avgs[i] for i in keep], [exp_avg_sqs[i] for i in keep],
         [indices[i].contiguous() for i in keep], kind, lr, beta1, beta2, eps, weight_decay,
         step, state_free, state_free_scale)


@_frugal_step_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps, weight_decay,
      step, state_free, state_free_scale, backend) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, beta1, beta2, eps, weight_decay,
           state_free, state_free_scale)


def _kernel_args(params, grads, exp_avgs, exp_avg_sqs, indices, kind) -> list:
    views = [matrix_view(p, kind) for p in params]
    return [
        addresses(params), addresses(grads), addresses(exp_avgs), addresses(exp_avg_sqs),
        [p.numel() for p in params], addresses(indices), [r for _, r, _ in views],
        [c for _, _, c in views], [idx.numel() for idx in indices], SUBSET_KIND_CODES[kind],
        indices[0].dtype == torch.int32, DTYPE_CODES[params[0].dtype],
    ]


def _cpu(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
         weight_decay, step, state_free, state_free_scale) -> None:
    extension().frugal_step_cpu(
        *_kernel_args(params, grads, exp_avgs, exp_avg_sqs, indices, kind), host_value(lr),
        beta1, beta2, eps, weight_decay, host_value(step), state_free_scale,
        STATE_FREE_CODES[state_free], torch.get_num_threads())


def _cuda(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
          weight_decay, step, state_free, state_free_scale) -> None:
    from frugal_kernels.ops._cuda import device_scalar, launch_context

    with launch_context(params[0].device) as stream:
        lr_value, lr_ptr, _lr_alive = device_scalar(lr, params[0].device)
        step_value, step_ptr, _step_alive = device_scalar(step, params[0].device)
        extension().frugal_step_cuda(
            *_kernel_args(params, grads, exp_avgs, exp_avg_sqs, indices, kind), lr_value, beta1,
            beta2, eps, weight_decay, step_value, state_free_scale, STATE_FREE_CODES[state_free],
            lr_ptr, step_ptr, stream)


def _triton(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
            weight_decay, step, state_free, state_free_scale) -> None:
    from frugal_kernels.kernels.triton.frugal_step import frugal_step_

    frugal_step_(params, grads, exp_avgs, exp_avg_sqs, indices, kind=kind, lr=lr, beta1=beta1,
                 beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                 state_free=state_free, state_free_scale=state_free_scale)


def _torch(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
           weight_decay, step, state_free, state_free_scale) -> None:
    reference.frugal_step_(params, grads, exp_avgs, exp_avg_sqs, indices, kind=kind,
                           lr=host_value(lr), beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=host_value(step),
                           state_free=state_free, state_free_scale=state_free_scale)


_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


def frugal_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    indices: Sequence[Tensor],
    *,
    kind: str,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    backend: str = "auto",
    check_indices: bool = True,
) -> None:
    """The fused FRUGAL update of a list of tensors, in place, in one call.

    Args:
        params, grads: as for :func:`adamw_`.
        indices: for each tensor, the sorted unique ids of its state-full rows
            (``kind="rows"``, along dim 0), columns (``"columns"``, along the
            last dim) or coordinates of the flattened tensor (``"flat"``);
            torch.int32 or torch.int64, one dtype per call. These are the
            ``rows``, ``columns`` and ``randk`` projections of FRUGAL.
        exp_avgs, exp_avg_sqs: float32 moments of the state-full coordinates
            only, in the order of ``indices``: shape ``(k, *p.shape[1:])`` for
            rows, ``(*p.shape[:-1], k)`` for columns, ``(k,)`` for flat.
        lr, beta1, beta2, eps, weight_decay, step: as for :func:`adamw_`;
            weight decay applies to every coordinate.
        state_free: the rule of the other coordinates: ``"sign"``
            (``p -= lr * state_free_scale * sign(g)``), ``"sgd"``
            (``p -= lr * state_free_scale * g``) or ``"none"`` (decay only).
        check_indices: check that the indices are sorted, unique and in range
            (a host sync when they live on a GPU); callers that build the
            subsets themselves, as the optimizers do, pass False.
    """
    params, grads, exp_avgs, exp_avg_sqs, indices = (
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(indices))
    if check_indices:
        _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, beta1, beta2, eps,
               weight_decay, state_free, state_free_scale)
        validate_indices(params, indices, kind)
    _frugal_step_op(params, grads, exp_avgs, exp_avg_sqs, indices, kind,
                    as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2), float(eps),
                    float(weight_decay), as_scalar_tensor(OP, "step", step), state_free,
                    float(state_free_scale), backend)
