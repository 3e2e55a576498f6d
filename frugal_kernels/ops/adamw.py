"""``frugal::adamw_``: AdamW on lists of tensors in one call."""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

from frugal_kernels._extension import extension
from frugal_kernels.ops._common import GatheredBatch, check_batch
from frugal_kernels.ops._spec import (REQUIRED, Arg, OpSpec, amp, flag, non_negative, real, scalar,
                                      tensors, unit_interval)
from frugal_kernels.ops.prepared import Call

OP = "frugal::adamw_"


def adamw_hyper(weight_decay: Any = REQUIRED) -> Tuple[Arg, ...]:
    """AdamW's hyper-parameters, shared with every op that runs AdamW on a subset
    (``frugal_step_``, ``lowrank_adamw_step_``, ``dqt_update_``)."""
    return (scalar("lr"), real("beta1", check=unit_interval), real("beta2", check=unit_interval),
            real("eps", check=non_negative), real("weight_decay", weight_decay), scalar("step"))


def _check(op: str, a) -> None:
    check_batch(op, a.params, a.grads, {"exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs})


SPEC = OpSpec("adamw_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("exp_avgs", written=True), tensors("exp_avg_sqs", written=True),
    *adamw_hyper(), flag("maximize", False), *amp(),
), record="AdamWHyper", check=_check, ext=lambda: extension())

Tensors, AdamWHyper = SPEC.Tensors, SPEC.Hyper


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)

    def call(grads: List[int], h) -> None:
        ext.adamw_cpu(batch.with_grads(ext, grads), h.kernel(ext), torch.get_num_threads())
    return call


@SPEC.prepared("cuda")
def _prepare_cuda(ext, t) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs), t.params[0].device

    def call(grads: List[int], h) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.adamw_cuda(batch.with_grads(ext, grads), hyper, scalars, stream)
    return call


_cpu, _cuda = SPEC.impls["cpu"], SPEC.impls["cuda"]

adamw_ = SPEC.register(
    doc='''AdamW (decoupled weight decay) on lists of tensors, in place, in one call.

The math of ``torch.optim.AdamW``: ``p *= 1 - lr * weight_decay``;
``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g^2``;
``p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)``.

Args:
    params, grads: tensors of one dtype (float32, bfloat16 or float16) on one
        device; params contiguous. Math runs in float32.
    exp_avgs, exp_avg_sqs: float32 moments, contiguous, shaped as the params.
    lr: a number or a one-element tensor (a device tensor is read on the
        device, without a sync, by the cuda and triton backends).
    step: the update count after this update, from 1, as ``state["step"]``
        of torch.optim.AdamW; a number or a one-element tensor.
    maximize: ascend the objective instead.
    grad_scale, found_inf: a GradScaler's tensors (one element each, or None):
        the gradients are divided by ``grad_scale`` as they are read, and a
        non-zero ``found_inf`` leaves every tensor untouched; both are read on
        the device by the cuda and triton backends (docs/ops.md). The other ops
        take them too.
    backend: "auto", "cpu", "cuda", "triton" or "torch" (see DESIGN.md section 3).

Raises ValueError / TypeError naming the offending argument before anything
is written.
''')

