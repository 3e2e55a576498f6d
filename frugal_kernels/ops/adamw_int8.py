"""``frugal::adamw_int8_``: AdamW on lists of tensors whose moments are 8-bit codes.

The moments of each tensor are int8 / uint8 codes of its shape with one fp32 scale per
block of :data:`~frugal_kernels._layout.MOMENT_BLOCK` elements along its rows
(:class:`~frugal_kernels._layout.MomentBlocks`; the math is
:func:`frugal_kernels.reference.quantize_moment`). One pass per block dequantizes them,
applies AdamW and quantizes the updated moments again, so they never exist in fp32
outside the kernel's block.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from frugal_kernels._extension import extension
from frugal_kernels._layout import MOMENT_CODE_DTYPES, MomentBlocks
from frugal_kernels.ops._common import GatheredBatch, addresses, check_batch
from frugal_kernels.ops._spec import OpSpec, amp, flag, tensors
from frugal_kernels.ops.adamw import AdamWHyper, adamw_hyper
from frugal_kernels.ops.prepared import Call

OP = "frugal::adamw_int8_"


def check_moments8(op: str, a, shapes: Sequence[Tuple[int, ...]],
                   detail: Callable[[int, bool], str] = lambda i, is_scale: "") -> None:
    """The four lists of 8-bit moments of an op (``a.exp_avgs``, ``a.exp_avg_scales``,
    ``a.exp_avg_sqs``, ``a.exp_avg_sq_scales``): one contiguous tensor per param, of the
    code or scale dtype, on the param's device, the codes shaped as ``shapes[i]`` (the
    moments' shape: the param's, or its compact subset's) and the scales as their
    :class:`~frugal_kernels._layout.MomentBlocks`. ``detail(i, is_scale)`` ends a shape
    error's message."""
    n = len(a.params)
    lists = (("exp_avgs", a.exp_avgs, MOMENT_CODE_DTYPES[0], False),
             ("exp_avg_scales", a.exp_avg_scales, torch.float32, True),
             ("exp_avg_sqs", a.exp_avg_sqs, MOMENT_CODE_DTYPES[1], False),
             ("exp_avg_sq_scales", a.exp_avg_sq_scales, torch.float32, True))
    for name, items, _, _ in lists:
        if len(items) != n:
            raise ValueError(f"{op}: got {n} params but {len(items)} {name}; the lists must "
                             "have one entry per param")
    for i, (p, shape) in enumerate(zip(a.params, shapes)):
        want_scales = MomentBlocks(shape).scale_shape
        for name, items, dtype, is_scale in lists:
            t = items[i]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name}[{i}] is a {type(t).__name__}, not a "
                                "torch.Tensor")
            if t.dtype != dtype:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; it must be {dtype}")
            if t.device != p.device:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device} but params[{i}] is on "
                                 f"{p.device}; one call takes tensors on one device")
            want = want_scales if is_scale else tuple(shape)
            if tuple(t.shape) != tuple(want):
                raise ValueError(f"{op}: {name}[{i}] has shape {tuple(t.shape)} but must have "
                                 f"shape {tuple(want)}{detail(i, is_scale)}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] is not contiguous; the op updates it in "
                                 "place and needs it contiguous")


def _check(op: str, a) -> None:
    check_batch(op, a.params, a.grads, {})
    check_moments8(op, a, [tuple(p.shape) for p in a.params])

SPEC = OpSpec("adamw_int8_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("exp_avgs", written=True), tensors("exp_avg_scales", written=True),
    tensors("exp_avg_sqs", written=True), tensors("exp_avg_sq_scales", written=True),
    *adamw_hyper(), flag("maximize", False), *amp(),
), record=AdamWHyper, check=_check, ext=lambda: extension())

Tensors = SPEC.Tensors


def moments8_batch(ext, t):
    """The C++ kernels' view of ``t``'s 8-bit moments: their codes' and scales' addresses
    and the block layout of each moment tensor (the parameter's shape for adamw_int8_,
    the compact subset's for frugal_step_int8_)."""
    blocks = [MomentBlocks(m.shape) for m in t.exp_avgs]
    return ext.Moments8Batch(exp_avgs=addresses(t.exp_avgs),
                             exp_avg_scales=addresses(t.exp_avg_scales),
                             exp_avg_sqs=addresses(t.exp_avg_sqs),
                             exp_avg_sq_scales=addresses(t.exp_avg_sq_scales),
                             rows=[b.rows for b in blocks], cols=[b.cols for b in blocks])


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params)
    moments = moments8_batch(ext, t)

    def call(grads: List[int], h) -> None:
        ext.adamw_int8_cpu(batch.with_grads(ext, grads), moments, h.kernel(ext),
                           torch.get_num_threads())
    return call


@SPEC.prepared("cuda")
def _prepare_cuda(ext, t) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params), t.params[0].device
    moments = moments8_batch(ext, t)

    def call(grads: List[int], h) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.adamw_int8_cuda(batch.with_grads(ext, grads), moments, hyper, scalars, stream)
    return call


_cpu, _cuda = SPEC.impls["cpu"], SPEC.impls["cuda"]

adamw_int8_ = SPEC.register(
    doc='''AdamW on lists of tensors whose moments are stored in 8 bits, in place, in one call.

The update of :func:`adamw_` on moments kept as codes with one fp32 scale per block of
256 elements along each tensor's rows (a block never straddles two rows, so a tensor's
rows sharded over ranks hold the blocks of the whole): the first moment as int8 codes
``-127..127`` of ``m * (1 / s)`` with ``s = max|m| / 127`` over the block, the second as
uint8 codes ``0..255`` of ``v^(1/4) * (1 / s)`` with ``s = max v^(1/4) / 255`` (the
fourth root keeps small second moments beside large ones in a block; docs/ops.md),
rounded half to even. Each block is dequantized, updated in fp32 (the parameter moves with the updated
fp32 moments) and quantized again in one pass; every backend writes the same codes as
:func:`frugal_kernels.reference.adamw_int8_`.

Args:
    params, grads: as :func:`adamw_`; a tensor of two dims or more is seen as rows
        ``[shape[0], rest]``, a 1-D or 0-dim one as one row.
    exp_avgs: int8 codes of the first moments, shaped as the params.
    exp_avg_scales: their fp32 scales, ``[rows, ceil(row length / 256)]``
        (``frugal_kernels._layout.MomentBlocks(p.shape).scale_shape``).
    exp_avg_sqs, exp_avg_sq_scales: the uint8 codes of the second moments and their
        scales, shaped as those of the first.
    lr, beta1, beta2, eps, weight_decay, step, maximize, grad_scale, found_inf,
        backend: as :func:`adamw_`. Zero codes and scales are zero moments.

Raises ValueError / TypeError naming the offending argument before anything
is written.
''')
