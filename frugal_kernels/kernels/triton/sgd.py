"""``sgd_`` on Triton: torch.optim.SGD's update over a list of tensors in one launch.

Each program updates one tile of ``BLOCK`` coordinates of one tensor: it reads
p, g and (with momentum) the buffer, and writes p and the buffer. The table
record of a tensor is ``(p, g, buffer or 0, numel)``; the tail, when lr lives
on the device, is ``(&lr,)`` (see ``_common``). The options that pick the
path (momentum on or off, Nesterov, maximize, decay, first step) are
compile-time constants.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, aligned, amp_in_kernel, amp_scalars, device_scalars, field_ptr, find_tile,
    launch_table, load_tile, start,
    store_tile, tail_scalar)

# Not tuned on hardware yet; as for adamw.
BLOCK = 4096
NUM_WARPS = 8
_RECORD = tl.constexpr(4)  # table fields per tensor: p, g, buffer, numel


@triton.jit
def sgd_update(p, g, buf, lr, momentum, one_minus_dampening, weight_decay,
               MAXIMIZE: tl.constexpr, DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
               NESTEROV: tl.constexpr, FIRST_STEP: tl.constexpr):
    """update_rules.h ``sgd_update``, operation for operation: returns (p, buf)."""
    if MAXIMIZE:
        g = -g
    if DECAY:
        g = g + weight_decay * p
    if MOMENTUM:
        if FIRST_STEP:
            buf = g
        else:
            buf = buf * momentum + one_minus_dampening * g
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    return p - lr * g, buf


@triton.jit
def _sgd_tile(p_ptr, g_ptr, b_ptr, count, lr, momentum, one_minus_dampening, weight_decay, inv,
              MAXIMIZE: tl.constexpr, DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
              NESTEROV: tl.constexpr, FIRST_STEP: tl.constexpr, MASKED: tl.constexpr,
              BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    p = load_tile(p_ptr, lane, count, MASKED)
    g = load_tile(g_ptr, lane, count, MASKED) * inv
    buf = g  # unread unless momentum is on and this is not the first step
    if MOMENTUM and not FIRST_STEP:
        buf = load_tile(b_ptr, lane, count, MASKED)
    p, buf = sgd_update(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, MAXIMIZE,
                        DECAY, MOMENTUM, NESTEROV, FIRST_STEP)
    store_tile(p_ptr, lane, count, p, MASKED)
    if MOMENTUM:
        store_tile(b_ptr, lane, count, buf, MASKED)


@triton.jit(do_not_specialize=["n_tensors"])
def _sgd_kernel(table, n_tensors, lr, momentum, one_minus_dampening, weight_decay, amp,
                P_DTYPE: tl.constexpr, AMP: tl.constexpr, MAXIMIZE: tl.constexpr,
                DECAY: tl.constexpr,
                MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST_STEP: tl.constexpr,
                SCALARS_IN_KERNEL: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        lr = tail_scalar(tail, 0).to(tl.float32)
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    start = tile * BLOCK
    p_ptr = field_ptr(record, 0, P_DTYPE) + start
    g_ptr = field_ptr(record, 1, P_DTYPE) + start
    b_ptr = field_ptr(record, 2, tl.float32) + start
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        b_ptr = tl.multiple_of(b_ptr, 16)
    count = tl.minimum(tl.load(record + 3) - start, BLOCK)  # positions in this tile
    inv, count = amp_in_kernel(amp, count, AMP)
    if count == BLOCK:
        _sgd_tile(p_ptr, g_ptr, b_ptr, count, lr, momentum, one_minus_dampening, weight_decay,
                  inv, MAXIMIZE, DECAY, MOMENTUM, NESTEROV, FIRST_STEP, False, BLOCK)
    elif count > 0:
        _sgd_tile(p_ptr, g_ptr, b_ptr, count, lr, momentum, one_minus_dampening, weight_decay,
                  inv, MAXIMIZE, DECAY, MOMENTUM, NESTEROV, FIRST_STEP, True, BLOCK)


def sgd_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
         *, lr: Tensor, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
         maximize: bool, first_step: bool, grad_scale: Optional[Tensor] = None,
         found_inf: Optional[Tensor] = None, scalars_in_kernel: Optional[bool] = None) -> None:
    """SGD in place, as ``frugal_kernels.ops.sgd_`` (inputs already checked).

    ``lr`` is a 0-dim tensor; ``scalars_in_kernel`` as for ``adamw_``.
    """
    items, device, scalars_in_kernel = start(params, (lr,), scalars_in_kernel)
    if not items:
        return
    use_momentum = momentum != 0.0
    tail, alive = [], []
    if scalars_in_kernel:
        alive = device_scalars((lr,), device)
        tail = [alive[0].data_ptr()]
        host_lr = 0.0  # read in the kernel
    else:
        host_lr = float(lr)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    records, tensors = [], []
    for i in items:
        p, g = params[i], grads[i]
        b = momentum_buffers[i] if use_momentum else None
        records.append([p.data_ptr(), g.data_ptr(), b.data_ptr() if b is not None else 0,
                        p.numel()])
        tensors += [p, g] + ([b] if b is not None else [])
    table, grid = launch_table(device, [params[i].numel() for i in items], records, BLOCK, tail)
    _sgd_kernel[(grid,)](
        table, len(items), host_lr, momentum, 1.0 - dampening, weight_decay,
        amp if use_amp else table, P_DTYPE=TL_DTYPES[params[0].dtype], AMP=use_amp,
        MAXIMIZE=bool(maximize),
        DECAY=weight_decay != 0.0, MOMENTUM=use_momentum, NESTEROV=bool(nesterov),
        FIRST_STEP=bool(first_step), SCALARS_IN_KERNEL=bool(scalars_in_kernel),
        ALIGNED=aligned(tensors), BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
