"""``frugal::sgd_``: torch.optim.SGD (momentum, dampening, Nesterov, L2 decay) on lists of tensors."""

from __future__ import annotations

import torch

from frugal_kernels._extension import extension
from frugal_kernels.ops._common import check_batch, kernel_batch
from frugal_kernels.ops._spec import OpSpec, amp, finite, flag, real, scalar, tensors

OP = "frugal::sgd_"


def _momentum(op: str, name: str, value: float) -> None:
    finite(op, name, value)
    if value < 0.0:
        raise ValueError(f"{op}: momentum must be >= 0, got {value}")


def _check(op: str, a) -> None:
    if a.nesterov and (a.momentum <= 0.0 or a.dampening != 0.0):
        raise ValueError(f"{op}: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    if a.momentum == 0.0:
        if a.momentum_buffers:
            raise ValueError(f"{op}: momentum is 0, so momentum_buffers must be empty")
        check_batch(op, a.params, a.grads, {})
    else:
        check_batch(op, a.params, a.grads, {"momentum_buffers": a.momentum_buffers})


SPEC = OpSpec("sgd_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("momentum_buffers", written=True),
    scalar("lr"), real("momentum", 0.0, check=_momentum), real("dampening", 0.0),
    real("weight_decay", 0.0), flag("nesterov", False), flag("maximize", False),
    flag("first_step", False), *amp(),
), record="SgdHyper", check=_check, ext=lambda: extension())

Tensors, SgdHyper = SPEC.Tensors, SPEC.Hyper


@SPEC.backend("cpu")
def _cpu(t, h) -> None:
    ext = extension()
    ext.sgd_cpu(kernel_batch(ext, *t), h.kernel(ext), torch.get_num_threads())


sgd_ = SPEC.register(
    doc='''SGD in place, in the order of operations of ``torch.optim.SGD(foreach=False)``.

``g = -g`` if maximize; ``g = g + weight_decay * p`` (coupled, L2);
with momentum, ``b = g`` on the first step, else
``b = momentum * b + (1 - dampening) * g``, then ``g = g + momentum * b``
(nesterov) or ``g = b``; finally ``p = p - lr * g``.

Args:
    params, grads: as for :func:`adamw_` (float32, bfloat16 or float16 on
        one device; params contiguous). Math runs in float32.
    momentum_buffers: float32, contiguous, shaped as the params, one per
        param when ``momentum`` is not 0; an empty list when it is.
    lr: a number or a one-element tensor.
    first_step: this call creates the buffers (torch's ``momentum_buffer``
        is None): they are overwritten with the gradient, whatever they held,
        and dampening does not apply.
    backend: "auto", "cpu", "triton" or "torch" (DESIGN.md section 3).

Raises ValueError / TypeError naming the offending argument before anything
is written.
''')
