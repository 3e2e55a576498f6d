"""``frugal::lowrank_adamw_step_``: a whole low-rank FRUGAL step of many small matrices.

:func:`lowrank_step_` is the last part of a low-rank step: the optimizer
projects each gradient and runs AdamW in the subspace first, which costs
several calls per tensor. This op does all of it, for every tensor of the call,
in one call:

    low = P^T g;  m, v, u = AdamW(m, v, low)  (u the update in the subspace)
    p = p * (1 - lr * wd) - lr * scale * rule(g - up(low)) + up(u)

Backends: ``cpu`` runs the whole step in one C++ pass whose GEMMs are plain
loops, which is what a step of many small matrices wants (LLaMA-130M's shapes
shrunk for the host-overhead benchmark: one call instead of ~5 per tensor) and
what large ones do not (the optimizers send those to torch's GEMMs and
:func:`lowrank_step_`); ``torch`` is the reference. No GPU backend: on GPU
tensors ``auto`` picks ``torch``, and the optimizers take the two-op path there.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import (LEFT, RIGHT, SIDES, STATE_FREE_RULES,
                                    matrix_shape, projection_rank, projection_shapes)
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (GatheredBatch, Scalar, addresses, as_scalar_tensor,
                                        check_amp, check_batch, check_finite, check_no_overlap,
                                        check_scalars, skipped_on_host)
from frugal_kernels.ops.adamw import check_adamw_hyper
from frugal_kernels.ops.frugal_step import FrugalHyper
from frugal_kernels.ops.prepared import Call, PreparedCall, gathered_backend

OP = "frugal::lowrank_adamw_step_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    projections: List[Tensor]
    sides: List[int]


def _check(params, grads, exp_avgs, exp_avg_sqs, projections, sides, lr, beta1, beta2, eps,
           weight_decay, step, state_free, state_free_scale, grad_scale, found_inf,
           backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    if state_free not in STATE_FREE_RULES:
        raise ValueError(f"{OP}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {state_free!r}")
    n = len(params)
    for name, lst in (("projections", projections), ("sides", sides)):
        if len(lst) != n:
            raise ValueError(f"{OP}: got {n} params but {len(lst)} {name}")
    low_shapes = []
    for i, (p, proj, side) in enumerate(zip(params, projections, sides)):
        if not isinstance(p, Tensor) or not isinstance(proj, Tensor):
            raise TypeError(f"{OP}: params[{i}] and projections[{i}] must be torch.Tensors")
        if p.dim() < 2:
            raise ValueError(f"{OP}: params[{i}] has {p.dim()} dims; low-rank projections "
                             "need a matrix (tensors of more dims are seen as [shape[0], rest])")
        if side not in SIDES:
            raise ValueError(f"{OP}: sides[{i}] must be {RIGHT} (right) or {LEFT} (left)")
        if proj.dim() != 2 or proj.dtype != torch.float32:
            raise ValueError(f"{OP}: projections[{i}] must be a float32 matrix, got "
                             f"{proj.dtype} {tuple(proj.shape)}")
        if proj.device != p.device:
            raise ValueError(f"{OP}: projections[{i}] is on {proj.device} but params[{i}] is "
                             f"on {p.device}")
        if not proj.is_contiguous():
            raise ValueError(f"{OP}: projections[{i}] is not contiguous")
        want_proj, want_low = projection_shapes(p.shape, projection_rank(proj, side), side)
        if tuple(proj.shape) != want_proj:
            raise ValueError(f"{OP}: projections[{i}] has shape {tuple(proj.shape)} but must "
                             f"have shape {want_proj} for params[{i}] of shape {tuple(p.shape)}")
        low_shapes.append(want_low)
    check_batch(OP, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                state_shape=lambda i, p: low_shapes[i])
    check_adamw_hyper(OP, beta1, beta2, eps)
    check_finite(OP, weight_decay=weight_decay, state_free_scale=state_free_scale)


@torch.library.custom_op(OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _lowrank_adamw_step_op(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                           exp_avg_sqs: List[Tensor], projections: List[Tensor],
                           sides: List[int], lr: Tensor, beta1: float, beta2: float, eps: float,
                           weight_decay: float, step: Tensor, state_free: str,
                           state_free_scale: float, grad_scale: Optional[Tensor],
                           found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, projections, sides, lr, beta1, beta2, eps,
           weight_decay, step, state_free, state_free_scale, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params, "exp_avgs": exp_avgs,
                                  "exp_avg_sqs": exp_avg_sqs},
                     read={"grads": grads, "projections": projections})
    apply(params, grads, exp_avgs, exp_avg_sqs, projections, sides, lr, beta1, beta2, eps,
          weight_decay, step, state_free, state_free_scale, grad_scale, found_inf, backend)


def apply(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
          exp_avg_sqs: List[Tensor], projections: List[Tensor], sides: List[int], lr: Tensor,
          beta1: float, beta2: float, eps: float, weight_decay: float, step: Tensor,
          state_free: str, state_free_scale: float, grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks (see :func:`frugal_kernels.ops.adamw.apply`).

    Empty params are stepped too: their moments see a zero projected gradient when
    the projected side is not the empty one (a [0, n] tensor at side LEFT has
    moments [r, n]), as the reference's GEMMs give them."""
    check_scalars(OP, lr, step)
    if skipped_on_host(found_inf) or not params:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(Tensors(params, [g.contiguous() for g in grads], exp_avgs, exp_avg_sqs, projections,
                 sides),
         FrugalHyper(lr, beta1, beta2, eps, weight_decay, step, state_free, state_free_scale,
                     grad_scale, found_inf))


_lowrank_adamw_step_op.register_fake(_check)


def _lowrank_batch(ext, params: Sequence[Tensor], projections: Sequence[Tensor],
                   sides: Sequence[int]):
    """Each tensor's matrix shape, rank and side, and its projection, as the kernel's
    ``LowrankBatch``."""
    shapes = [matrix_shape(p.shape) for p in params]
    return ext.LowrankBatch(projections=addresses(projections), rows=[m for m, _ in shapes],
                            cols=[n for _, n in shapes],
                            rank=[projection_rank(proj, side)
                                  for proj, side in zip(projections, sides)],
                            sides=list(sides))


def _prepare_cpu(ext, t: Tensors) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    lowrank = _lowrank_batch(ext, t.params, t.projections, t.sides)

    def call(grads: List[int], h: FrugalHyper) -> None:
        ext.lowrank_adamw_step_cpu(batch.with_grads(ext, grads), lowrank, h.kernel(ext),
                                   torch.get_num_threads())
    return call


def _torch(t: Tensors, h: FrugalHyper) -> None:
    reference.lowrank_adamw_step_(*t, **h.on_host())


_PREPARED = {"cpu": _prepare_cpu}
_cpu = gathered_backend(_prepare_cpu, lambda: extension())

_IMPLS = {"cpu": _cpu, "torch": _torch}


class Prepared(PreparedCall):
    """:func:`lowrank_adamw_step_` over fixed params, moments and projections
    (:mod:`frugal_kernels.ops.prepared`). A step of LLaMA-130M's 84 low-rank tensors
    spent about 250 us of host time gathering them per call (fused AdamW's whole
    step: ~800 us)."""

    op, impls, prepared = OP, _IMPLS, _PREPARED

    def __init__(self, params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                 projections: List[Tensor], sides: List[int], backend: str):
        super().__init__(Tensors(params, [], exp_avgs, exp_avg_sqs, projections, list(sides)),
                         [*params, *exp_avgs, *exp_avg_sqs], backend)

    def __call__(self, grads: List[Tensor], *, lr: Tensor, beta1: float, beta2: float,
                 eps: float, weight_decay: float, step: Tensor, state_free: str,
                 state_free_scale: float, grad_scale: Optional[Tensor] = None,
                 found_inf: Optional[Tensor] = None) -> None:
        self._run(grads, FrugalHyper(lr.reshape(()), float(beta1), float(beta2), float(eps),
                                     float(weight_decay), step.reshape(()), state_free,
                                     float(state_free_scale), grad_scale, found_inf))


def lowrank_adamw_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                        exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                        projections: Sequence[Tensor], sides: Sequence[int], *, lr: Scalar,
                        beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                        step: Scalar, state_free: str = "sign", state_free_scale: float = 1.0,
                        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                        backend: str = "auto") -> None:
    r"""A whole low-rank FRUGAL step, in place: AdamW in the span of each projection,
    the state-free rule on the residual.

    Each param is seen as a matrix [m, n] = [shape[0], rest] with a projection
    :math:`P` on one side (as for :func:`lowrank_step_`: [r, n] with orthonormal
    rows for side RIGHT, [m, r] with orthonormal columns for side LEFT), and
    compact moments of the projected gradient's shape ([m, r] or [r, n]):

    .. math::
       \begin{aligned}
            &\hat{g} \leftarrow P^\top g \hspace{5mm} (g P^\top \text{ or } P^\top g
                \text{ by side; of the unscaled gradient})                             \\
            &m, v, u \leftarrow \text{AdamW}(m, v, \hat{g}; \gamma, \beta_1, \beta_2,
                \epsilon, \text{step}) \hspace{5mm} (u \text{ the update, lr applied})    \\
            &\theta \leftarrow \theta \, (1 - \gamma \lambda)
                - \gamma s \, \phi(g - \mathrm{up}(\hat{g})) + \mathrm{up}(u)
       \end{aligned}

    which is :func:`adamw_` on zero "params" with ``low_grads`` :math:`\hat{g}`
    followed by :func:`lowrank_step_`, in one call.

    Args:
        params, grads: tensors of >= 2 dims, one dtype, on one device.
        exp_avgs, exp_avg_sqs: fp32 compact moments, [m, r] (RIGHT) or [r, n] (LEFT).
        projections: fp32, contiguous, [r, n] (RIGHT) or [m, r] (LEFT).
        sides: 0 (RIGHT) or 1 (LEFT) per tensor.
        lr, beta1, beta2, eps, weight_decay, step: as for :func:`adamw_` (the
            decay applies to the params, not in the subspace).
        state_free, state_free_scale, grad_scale, found_inf, backend: as for
            :func:`frugal_step_`.
    """
    check_amp(OP, grad_scale, found_inf)
    _lowrank_adamw_step_op(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                           list(projections), [int(s) for s in sides],
                           as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2),
                           float(eps), float(weight_decay), as_scalar_tensor(OP, "step", step),
                           state_free, float(state_free_scale), grad_scale, found_inf, backend)
