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

from typing import List, Sequence

import torch
from torch import Tensor

from frugal_kernels._extension import extension
from frugal_kernels._layout import (LEFT, RIGHT, SIDES, matrix_shape, projection_rank,
                                    projection_shapes)
from frugal_kernels.ops._common import GatheredBatch, addresses, check_batch
from frugal_kernels.ops._spec import OpSpec, amp, ints, tensors
from frugal_kernels.ops.adamw import adamw_hyper
from frugal_kernels.ops.frugal_step import FrugalHyper, state_free_hyper
from frugal_kernels.ops.prepared import Call

OP = "frugal::lowrank_adamw_step_"


def _check(op: str, a) -> None:
    params, projections, sides = a.params, a.projections, a.sides
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
    check_batch(OP, params, a.grads, {"exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs},
                state_shape=lambda i, p: low_shapes[i])


# Empty params are stepped too: their moments see a zero projected gradient when the
# projected side is not the empty one (a [0, n] tensor at side LEFT has moments [r, n]),
# as the reference's GEMMs give them.
SPEC = OpSpec("lowrank_adamw_step_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("exp_avgs", written=True), tensors("exp_avg_sqs", written=True),
    tensors("projections"), ints("sides"),
    *adamw_hyper(weight_decay=0.0), *state_free_hyper(), *amp(),
), record=FrugalHyper, check=_check, ext=lambda: extension())

Tensors = SPEC.Tensors


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


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    lowrank = _lowrank_batch(ext, t.params, t.projections, t.sides)

    def call(grads: List[int], h) -> None:
        ext.lowrank_adamw_step_cpu(batch.with_grads(ext, grads), lowrank, h.kernel(ext),
                                   torch.get_num_threads())
    return call


lowrank_adamw_step_ = SPEC.register(
    doc=r'''A whole low-rank FRUGAL step, in place: AdamW in the span of each projection,
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
''')
