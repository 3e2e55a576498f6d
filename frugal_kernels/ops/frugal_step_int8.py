"""``frugal::frugal_step_int8_``: the fused FRUGAL update with 8-bit subset moments.

:func:`frugal_step_` for the ``rows`` and ``columns`` subsets, whose compact moments
(``(k, *p.shape[1:])`` for rows, ``(*p.shape[:-1], k)`` for columns) are kept as the
8-bit codes and block scales of :func:`adamw_int8_`: the moment matrix is cut into
blocks of :data:`~frugal_kernels._layout.MOMENT_BLOCK` elements along its own rows
(:class:`~frugal_kernels._layout.MomentBlocks` of the compact shape). One pass
dequantizes a block, applies AdamW to its coordinates, quantizes it again and moves
every other coordinate by the state-free rule.
"""

from __future__ import annotations

from typing import List

import torch

from frugal_kernels._extension import extension
from frugal_kernels._layout import SUBSET_KINDS, subset_state_shape
from frugal_kernels.ops._common import GatheredBatch, check_batch, subset_batch
from frugal_kernels.ops._spec import OpSpec, amp, tensors, text
from frugal_kernels.ops.adamw import adamw_hyper
from frugal_kernels.ops.adamw_int8 import check_moments8, moments8_batch
from frugal_kernels.ops.frugal_step import FrugalHyper, check_subsets, state_free_hyper, validate_indices
from frugal_kernels.ops.prepared import Call

OP = "frugal::frugal_step_int8_"

# Why "flat" (FRUGAL's randk) has no 8-bit form: its compact state is one row of
# coordinates spread over the whole tensor, so a block of it straddles the tensor's
# rows and a row-sharded tensor would not hold whole blocks.
FLAT_REFUSAL = ("8-bit moments are cut into blocks along the rows of the compact state, "
                "and the flat (randk) state is one row of coordinates spread over every "
                "row of the tensor: its blocks would straddle the tensor's rows, and the "
                "state would change with the sharding; use kind 'rows' or 'columns', or "
                "fp32 moments (frugal_step_)")


def _check(op: str, a) -> None:
    if a.kind == "flat":
        raise ValueError(f"{op}: kind 'flat' is not supported: {FLAT_REFUSAL}")
    check_subsets(op, a.params, a.indices, a.kind)
    check_batch(op, a.params, a.grads, {})
    check_moments8(op, a, [tuple(subset_state_shape(p, a.kind, idx.numel()))
                           for p, idx in zip(a.params, a.indices)],
                   lambda i, is_scale: (f" (the subset's {a.kind} of params[{i}]"
                                        f"{', block scales' if is_scale else ''})"))


def _validate(op: str, a) -> None:
    validate_indices(a.params, a.indices, a.kind, op=op)


SPEC = OpSpec("frugal_step_int8_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("exp_avgs", written=True), tensors("exp_avg_scales", written=True),
    tensors("exp_avg_sqs", written=True), tensors("exp_avg_sq_scales", written=True),
    tensors("indices", contiguous=True), text("kind", SUBSET_KINDS),
    *adamw_hyper(), *state_free_hyper(), *amp(),
), record=FrugalHyper, check=_check, skip_empty=True, validate=_validate,
    ext=lambda: extension())

Tensors = SPEC.Tensors


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params)
    subsets = subset_batch(ext, t.params, t.indices, t.kind)
    moments = moments8_batch(ext, t)

    def call(grads: List[int], h) -> None:
        ext.frugal_step_int8_cpu(batch.with_grads(ext, grads), subsets, moments, h.kernel(ext),
                                 torch.get_num_threads())
    return call


@SPEC.prepared("cuda")
def _prepare_cuda(ext, t) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params), t.params[0].device
    subsets = subset_batch(ext, t.params, t.indices, t.kind)
    moments = moments8_batch(ext, t)

    def call(grads: List[int], h) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.frugal_step_int8_cuda(batch.with_grads(ext, grads), subsets, moments, hyper,
                                      scalars, stream)
    return call


_cpu, _cuda = SPEC.impls["cpu"], SPEC.impls["cuda"]

frugal_step_int8_ = SPEC.register(
    doc=r'''The fused FRUGAL update of a list of tensors with 8-bit subset moments, in place.

:func:`frugal_step_`'s update for ``kind="rows"`` or ``"columns"``: AdamW on the
state-full rows or columns named by ``indices``, the ``state_free`` rule on every
other coordinate, weight decay on all, in one pass. The compact moments of each
tensor (shape ``(k, *p.shape[1:])`` for rows, ``(*p.shape[:-1], k)`` for columns) are
stored as :func:`adamw_int8_` stores a tensor's moments, with that compact shape as
the tensor: int8 codes of the first moment and uint8 codes of the fourth root of the
second, one fp32 scale per block of 256 elements along the compact state's rows
(``frugal_kernels._layout.MomentBlocks(state_shape).scale_shape``), rounded half to
even. Each block is dequantized, updated in fp32 and quantized again in the same
pass; every backend writes the codes of
:func:`frugal_kernels.reference.frugal_step_int8_`.

``kind="flat"`` (FRUGAL's randk) is refused: its compact state is one row of
coordinates spread over the tensor's rows, so its blocks would straddle them.

Args:
    params, grads, indices, kind, lr, beta1, beta2, eps, weight_decay, step,
        state_free, state_free_scale, grad_scale, found_inf, backend,
        check_indices: as :func:`frugal_step_`.
    exp_avgs, exp_avg_scales: the int8 codes of the first moments (the compact
        shape) and their fp32 block scales.
    exp_avg_sqs, exp_avg_sq_scales: the uint8 codes of the second moments and their
        scales, shaped as those of the first. Zero codes and scales are zero moments.

Raises ValueError / TypeError naming the offending argument before anything
is written.
''')
