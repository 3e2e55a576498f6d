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

import torch
from torch import Tensor

from frugal_kernels._extension import extension
from frugal_kernels._layout import (LEFT, RIGHT, SIDES, back_project, projection_rank,
                                    projection_shapes)
from frugal_kernels.ops._common import check_batch, kernel_batch
from frugal_kernels.ops._spec import OpSpec, amp, ints, real, scalar, tensors
from frugal_kernels.ops.frugal_step import state_free_hyper

OP = "frugal::lowrank_step_"


def _check(op: str, a) -> None:
    params, grads, low_updates, low_grads, projections, sides = a[:6]
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


# Every input but the params is only read: the kernels get contiguous copies where
# needed (the Triton kernel walks them as row-major matrices and read a transposed
# projection as the wrong matrix).
SPEC = OpSpec("lowrank_step_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("low_updates", contiguous=True), tensors("low_grads", contiguous=True),
    tensors("projections", contiguous=True), ints("sides"),
    scalar("lr"), real("weight_decay", 0.0), *state_free_hyper(), *amp(),
), record="LowrankHyper", check=_check, skip_empty=True, ext=lambda: extension())

Tensors, LowrankHyper = SPEC.Tensors, SPEC.Hyper


def _back_projections(u: Tensor, lg: Tensor, proj: Tensor, side: int) -> Tensor:
    """[up(u), up(lg)] as one [2, m, n] tensor from one batched GEMM."""
    return back_project(torch.stack((u, lg)), proj, side)


@SPEC.backend("cpu")
def _cpu(t, h) -> None:
    ext = extension()
    hyper = h.kernel(ext)
    for p, g, u, lg, proj, side in zip(*t):
        # One tensor at a time: the [2, m, n] back-projections are transient.
        up = _back_projections(u, lg, proj, side)
        ext.lowrank_step_cpu(kernel_batch(ext, [p], [g]), [up[0].data_ptr()], [up[1].data_ptr()],
                             hyper, torch.get_num_threads())


lowrank_step_ = SPEC.register(
    doc=r'''The weight update of a low-rank FRUGAL step, in place.

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
''')
