"""``frugal::lowrank_step_``: the weight update of FRUGAL's low-rank projections.

For the ``random`` and ``svd`` projections the state-full part lives in a
rank-r subspace: the optimizer projects the gradient (``low_grad = P^T g``),
runs AdamW there (``low_update``), and this op does the rest in one pass per
tensor: back-project the update, back-project the projected gradient, apply
the state-free rule to the residual ``g - P P^T g`` and the weight decay:

    p = p * (1 - lr * wd) - lr * scale * rule(g - up(low_grad)) + up(low_update)

Backends: ``triton`` fuses both back-projections (``tl.dot``) with the update
in one kernel; ``cpu`` runs one batched GEMM in torch and the update in one C++
pass; ``torch`` is the reference. There is no ``cuda`` backend: on GPUs
``auto`` picks ``triton``.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import (LEFT, RIGHT, SIDES, STATE_FREE_RULES, back_project,
                                    projection_rank, projection_shapes)
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Hyper, Scalar, as_scalar_tensor, check_batch, check_finite,
                                        check_amp, check_no_overlap, check_scalars,
                                        skipped_on_host, kernel_batch)

OP = "frugal::lowrank_step_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]
    low_updates: List[Tensor]
    low_grads: List[Tensor]
    projections: List[Tensor]
    sides: List[int]


@dataclasses.dataclass(frozen=True)
class LowrankHyper(Hyper):
    lr: Tensor
    weight_decay: float
    state_free: str
    state_free_scale: float
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched


def _check(params, grads, low_updates, low_grads, projections, sides, lr, weight_decay,
           state_free, state_free_scale, grad_scale, found_inf, backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    if state_free not in STATE_FREE_RULES:
        raise ValueError(f"{OP}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {state_free!r}")
    n = len(params)
    for name, lst in (("low_updates", low_updates), ("low_grads", low_grads),
                      ("projections", projections), ("sides", sides)):
        if len(lst) != n:
            raise ValueError(f"{OP}: got {n} params but {len(lst)} {name}")
    check_batch(OP, params, grads, {})
    for i, (p, u, lg, proj, side) in enumerate(zip(params, low_updates, low_grads, projections,
                                                   sides)):
        if p.dim() < 2:
            raise ValueError(f"{OP}: params[{i}] has {p.dim()} dims; low-rank projections "
                             "need a matrix (tensors of more dims are seen as [shape[0], rest])")
        if side not in SIDES:
            raise ValueError(f"{OP}: sides[{i}] must be {RIGHT} (right) or {LEFT} (left)")
        if proj.dim() != 2:
            raise ValueError(f"{OP}: projections[{i}] must be a matrix")
        want_proj, want_low = projection_shapes(p.shape, projection_rank(proj, side), side)
        for name, t, want in (("projections", proj, want_proj), ("low_updates", u, want_low),
                              ("low_grads", lg, want_low)):
            if t.dtype != torch.float32:
                raise TypeError(f"{OP}: {name}[{i}] has dtype {t.dtype}; it must be float32")
            if t.device != p.device:
                raise ValueError(f"{OP}: {name}[{i}] is on {t.device} but params[{i}] is on "
                                 f"{p.device}")
            if tuple(t.shape) != want:
                raise ValueError(f"{OP}: {name}[{i}] has shape {tuple(t.shape)} but must have "
                                 f"shape {want} for params[{i}] of shape {tuple(p.shape)}")
    check_finite(OP, weight_decay=weight_decay, state_free_scale=state_free_scale)


@torch.library.custom_op(OP, mutates_args=("params",))
def _lowrank_step_op(params: List[Tensor], grads: List[Tensor], low_updates: List[Tensor],
                     low_grads: List[Tensor], projections: List[Tensor], sides: List[int],
                     lr: Tensor, weight_decay: float, state_free: str, state_free_scale: float,
                     grad_scale: Optional[Tensor],
                     found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, low_updates, low_grads, projections, sides, lr, weight_decay,
           state_free, state_free_scale, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params},
                     read={"grads": grads, "low_updates": low_updates, "low_grads": low_grads,
                      "projections": projections})
    apply(params, grads, low_updates, low_grads, projections, sides, lr, weight_decay,
          state_free, state_free_scale, grad_scale, found_inf, backend)


def apply(params: List[Tensor], grads: List[Tensor], low_updates: List[Tensor],
          low_grads: List[Tensor], projections: List[Tensor], sides: List[int], lr: Tensor,
          weight_decay: float, state_free: str, state_free_scale: float,
          grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks (see :func:`frugal_kernels.ops.adamw.apply`)."""
    check_scalars(OP, lr)
    if skipped_on_host(found_inf):
        return
    keep = [i for i, p in enumerate(params) if p.numel() > 0]
    if not keep:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    # Every input but the params is only read: the kernels get contiguous copies
    # where needed (the Triton kernel walks them as row-major matrices and read a
    # transposed projection as the wrong matrix).
    read_only = [[t.contiguous() for t in lst] for lst in (grads, low_updates, low_grads,
                                                             projections)]
    impl(Tensors(*([lst[i] for i in keep] for lst in (params, *read_only, sides))),
         LowrankHyper(lr, weight_decay, state_free, state_free_scale, grad_scale, found_inf))


_lowrank_step_op.register_fake(_check)


def _back_projections(u: Tensor, lg: Tensor, proj: Tensor, side: int) -> Tensor:
    """[up(u), up(lg)] as one [2, m, n] tensor from one batched GEMM."""
    return back_project(torch.stack((u, lg)), proj, side)


def _cpu(t: Tensors, h: LowrankHyper) -> None:
    ext = extension()
    hyper = h.kernel(ext)
    for p, g, u, lg, proj, side in zip(*t):
        # One tensor at a time: the [2, m, n] back-projections are transient.
        up = _back_projections(u, lg, proj, side)
        ext.lowrank_step_cpu(kernel_batch(ext, [p], [g]), [up[0].data_ptr()], [up[1].data_ptr()],
                             hyper, torch.get_num_threads())


def _triton(t: Tensors, h: LowrankHyper) -> None:
    from frugal_kernels.kernels.triton.lowrank_step import lowrank_step_

    lowrank_step_(*t, **h.values())


def _torch(t: Tensors, h: LowrankHyper) -> None:
    reference.lowrank_step_(*t, **h.on_host())


_IMPLS = {"cpu": _cpu, "triton": _triton, "torch": _torch}


def lowrank_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                  low_updates: Sequence[Tensor], low_grads: Sequence[Tensor],
                  projections: Sequence[Tensor], sides: Sequence[int], *, lr: Scalar,
                  weight_decay: float = 0.0, state_free: str = "sign",
                  state_free_scale: float = 1.0, grad_scale: Optional[Tensor] = None,
                  found_inf: Optional[Tensor] = None, backend: str = "auto") -> None:
    r"""The weight update of a low-rank FRUGAL step, in place.

    Each param is seen as a matrix [m, n] = [shape[0], rest] with a projection
    :math:`P` on one side; :math:`\mathrm{up}` is the back-projection,
    :math:`\mathrm{up}(x) = x P` (side RIGHT, :math:`P` [r, n] with orthonormal
    rows) or :math:`P x` (side LEFT, :math:`P` [m, r] with orthonormal columns).
    The optimizer ran AdamW in the subspace; this op applies its update, and
    the state-free rule to the part of the gradient outside the subspace:

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                         \\
            &\textbf{input}: \theta \text{ (params)}, \: g \text{ (grads)}, \:
                P \text{ (projections, sides)}, \: u \text{ (low\_updates)}, \:
                \hat{g} = P^\top g \text{ (low\_grads)}                                  \\
            &\hspace{13mm} \gamma \text{ (lr)}, \: \lambda \text{ (weight\_decay)}, \:
                \phi \text{ (state\_free)}, \: s \text{ (state\_free\_scale)}          \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                         \\
            &r \leftarrow g - \mathrm{up}(\hat{g})
                \hspace{5mm} \text{(the residual, outside the subspace)}                 \\
            &\theta \leftarrow \theta \, (1 - \gamma \lambda) - \gamma s \, \phi(r)
                + \mathrm{up}(u), \quad \phi(r) = \mathrm{sign}(r) \text{ (sign)}, \;
                r \text{ (sgd)}, \; 0 \text{ (none)}                                     \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                         \\[-1.ex]
       \end{aligned}

    Args:
        params, grads: tensors of >= 2 dims, seen as matrices [m, n].
        low_updates: AdamW updates in the subspace (lr already applied), fp32,
            [m, r] for side RIGHT and [r, n] for side LEFT.
        low_grads: the projected gradients, same shapes.
        projections: fp32 [r, n] (RIGHT, orthonormal rows) or [m, r] (LEFT,
            orthonormal columns).
        sides: 0 (RIGHT) or 1 (LEFT) per tensor.
        lr, weight_decay, state_free, state_free_scale, backend: as for
            :func:`frugal_step_`.
    """
    check_amp(OP, grad_scale, found_inf)
    _lowrank_step_op(list(params), list(grads), list(low_updates), list(low_grads),
                     list(projections), [int(s) for s in sides], as_scalar_tensor(OP, "lr", lr),
                     float(weight_decay), state_free, float(state_free_scale), grad_scale,
                     found_inf, backend)
