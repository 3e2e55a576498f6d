"""``frugal::sign_sgd_``: SignSGD with decoupled weight decay on lists of tensors."""

from __future__ import annotations

from typing import List

import torch

from frugal_kernels._extension import extension
from frugal_kernels.ops._common import GatheredBatch, check_batch
from frugal_kernels.ops._spec import OpSpec, amp, real, scalar, tensors
from frugal_kernels.ops.prepared import Call

OP = "frugal::sign_sgd_"


def _check(op: str, a) -> None:
    check_batch(op, a.params, a.grads, {})


SPEC = OpSpec("sign_sgd_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    scalar("lr"), real("weight_decay", 0.0), real("scale", 1.0), *amp(),
), record="SignSgdHyper", check=_check, ext=lambda: extension())

Tensors, SignSgdHyper = SPEC.Tensors, SPEC.Hyper


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params)

    def call(grads: List[int], h) -> None:
        ext.sign_sgd_cpu(batch.with_grads(ext, grads), h.kernel(ext), torch.get_num_threads())
    return call


@SPEC.prepared("cuda")
def _prepare_cuda(ext, t) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch, device = GatheredBatch(t.params), t.params[0].device

    def call(grads: List[int], h) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.sign_sgd_cuda(batch.with_grads(ext, grads), hyper, scalars, stream)
    return call


_cpu, _cuda = SPEC.impls["cpu"], SPEC.impls["cuda"]

sign_sgd_ = SPEC.register(
    doc='''SignSGD in place: ``p = p * (1 - lr * weight_decay) - lr * scale * sign(g)``.

Reads p and g and writes p, nothing more: no optimizer state. Tensors as
for :func:`adamw_`; ``lr`` a number or a one-element tensor.
''')
