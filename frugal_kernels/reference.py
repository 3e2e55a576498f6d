"""Readable pure-torch implementations of every op: the ground truth.

Each function here is written for clarity, one tensor at a time, in fp32, in
the order of operations of ``torch.optim.AdamW(foreach=False)``. The fast
backends (C++, CUDA, Triton) are tested against these functions; the ``torch``
backend of every op calls them directly. Arguments are as in
:mod:`frugal_kernels.ops`, with ``lr`` and ``step`` as Python numbers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from frugal_kernels import _quant
from frugal_kernels._layout import (MOMENT_BLOCK, MomentBlocks, back_project,
                                    inverse_grad_scale, matrix_shape, project)

def _unscaled(g: Tensor, grad_scale: Optional[float]) -> Tensor:
    """``g`` in fp32 with GradScaler's scale divided out as its unscale_ does: times the
    inverse scale, computed in double and rounded to fp32 once."""
    g32 = g.float()
    if grad_scale is None:
        return g32
    return g32 * inverse_grad_scale(torch.tensor(grad_scale, dtype=torch.float64))


__all__ = ["adamw_", "adamw_int8_", "quantize_moment", "dequantize_moment", "sign_sgd_", "sgd_", "frugal_step_", "frugal_step_int8_", "lowrank_step_", "lowrank_adamw_step_",
           "dqt_update_", "dequantize", "quant_matmul", "grad_norm", "linear_cross_entropy"]



@torch.no_grad()
def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    maximize: bool = False,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """AdamW with decoupled weight decay; ``step`` counts from 1 (after this update).

    Every op of this module takes GradScaler's ``grad_scale`` (divided out of the
    gradients as they are read) and ``found_inf`` (non-zero: nothing changes)."""
    if found_inf:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    step_size = lr / bias_correction1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32 = p.float()
        g32 = _unscaled(g, grad_scale)
        g32 = -g32 if maximize else g32
        p32.mul_(1 - lr * weight_decay)
        m.lerp_(g32, 1 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p32.addcdiv_(m, denom, value=-step_size)
        p.copy_(p32)


# ---------------------------------------------------------------- 8-bit moments
#
# A moment tensor is stored as 8-bit codes of its shape and one fp32 scale per block of
# MOMENT_BLOCK elements along its rows (frugal_kernels._layout.MomentBlocks). Per block:
#
#   first moment m (signed, linear):  s = max|m| / 127,    q = rint(m * (1 / s))  in -127..127
#                                      m = q * s
#   second moment v (unsigned, on the fourth root): w = sqrt(sqrt(v)),
#                                      s = max w / 255,      q = rint(w * (1 / s))  in 0..255
#                                      t = q * s; v = (t * t) * (t * t)
#
# all in fp32 (1 / s rounded once per block), rint rounding half to even; a block whose
# scale is not > 0 (all zeros, or a NaN in it: the max propagates NaN) gets the codes 0,
# and a NaN product (inf * 0) the code 0. Why the fourth root: a block of 256 coordinates holds second moments
# spanning decades (an outlier column beside quiet ones), and a linear code on sqrt(v)
# rounds every coordinate under max / 510 to 0, whose next update is m / (sqrt(new v) + eps)
# with v rebuilt from one gradient: seen 5x the fp32 update with gradients spread over 2
# decades in a block and 5e4x over 3 decades. On the fourth root the code 1 is
# (1 / 255)^4 of the block's max v (a range of 9.6 decades against 4.8), so such a
# coordinate keeps a second moment of its own size (2.5x and 6.5x in the same trials),
# at 2x the relative step of the linear code near the top (docs/optimizers.md).


def _sqrt(x: Tensor) -> Tensor:
    """The fp32 square root rounded correctly, as C++'s sqrtf and CUDA's sqrtf: torch's
    CPU sqrt of fp32 is not (one ulp off on 15% of values, torch 2.13 with AVX-512), and
    a code can turn on one ulp. The root is taken in double and rounded once: a double
    carries over twice the fp32 digits, so that rounding is the correct fp32 root."""
    return x.double().sqrt().float()


def _blocks(x: Tensor) -> Tensor:
    """``x`` (fp32, any shape) as ``[rows, blocks per row, MOMENT_BLOCK]``, each row
    padded with zeros to whole blocks."""
    b = MomentBlocks(x.shape)
    rows = x.reshape(b.rows, b.cols)
    rows = torch.nn.functional.pad(rows, (0, b.per_row * MOMENT_BLOCK - b.cols))
    return rows.reshape(b.rows, b.per_row, MOMENT_BLOCK)


def _unblocked(x: Tensor, shape) -> Tensor:
    b = MomentBlocks(shape)
    return x.reshape(b.rows, b.per_row * MOMENT_BLOCK)[:, :b.cols].reshape(shape)


@torch.no_grad()
def quantize_moment(x: Tensor, second: bool) -> Tuple[Tensor, Tensor]:
    """The 8-bit codes (``x``'s shape; int8 for the first moment, uint8 for the second)
    and the fp32 scales (``MomentBlocks(x.shape).scale_shape``) of a moment."""
    blocks = _blocks(x.float())
    w, top, low, dtype = ((_sqrt(_sqrt(blocks)), 255.0, 0.0, torch.uint8) if second
                          else (blocks, 127.0, -127.0, torch.int8))
    scales = w.abs().amax(-1) / top
    s = scales.unsqueeze(-1)
    inverse = torch.ones_like(s) / s
    q = torch.where(s > 0, torch.round(w * inverse), 0.0).clamp(low, top).nan_to_num(0.0)
    return _unblocked(q, x.shape).to(dtype), scales


@torch.no_grad()
def dequantize_moment(codes: Tensor, scales: Tensor, second: bool) -> Tensor:
    """The fp32 moment of 8-bit codes and their block scales (the inverse of
    :func:`quantize_moment` up to its rounding)."""
    t = _blocks(codes.float()) * scales.float().unsqueeze(-1)
    if second:
        u = t * t
        t = u * u
    return _unblocked(t, codes.shape)


@torch.no_grad()
def adamw_int8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_sq_scales: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    maximize: bool = False,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """:func:`adamw_` on 8-bit moments: each tensor's moments dequantized, the AdamW
    update in fp32 (the parameter moves with the updated fp32 moments), the moments
    quantized again into their codes and scales."""
    if found_inf:
        return
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    for p, g, mq, ms, vq, vs in zip(params, grads, exp_avgs, exp_avg_scales, exp_avg_sqs,
                                    exp_avg_sq_scales):
        m, v = dequantize_moment(mq, ms, False), dequantize_moment(vq, vs, True)
        g32 = _unscaled(g, grad_scale)
        g32 = -g32 if maximize else g32
        # adamw_'s math with each fp32 operation on its own, in the kernels' order
        # (adamw_update in csrc/include/frugal/update_rules.h), and a correctly rounded
        # sqrt: torch's addcmul_ and addcdiv_ may fuse a product into an FMA, and a moment
        # one ulp apart can round to another code.
        p32 = p.float() * (1 - lr * weight_decay)
        m += (1 - beta1) * (g32 - m)
        v.mul_(beta2).add_((1 - beta2) * (g32 * g32))
        denom = _sqrt(v) / bias_correction2_sqrt + eps
        p.copy_(p32 - step_size * (m / denom))
        for codes, scales, moment, second in ((mq, ms, m, False), (vq, vs, v, True)):
            new_codes, new_scales = quantize_moment(moment, second)
            codes.copy_(new_codes)
            scales.copy_(new_scales)


def _state_free_update(p32: Tensor, g32: Tensor, *, lr: float, weight_decay: float,
                       scale: float, state_free: str) -> Tensor:
    """The rule for coordinates without optimizer state (returns a new tensor)."""
    out = p32 * (1 - lr * weight_decay)
    if state_free == "sign":
        out = out - (lr * scale) * torch.sign(g32)
    elif state_free == "sgd":
        out = out - (lr * scale) * g32
    elif state_free != "none":
        raise ValueError(f"unknown state_free rule {state_free!r}")
    return out


@torch.no_grad()
def sign_sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float = 0.0,
    scale: float = 1.0,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """``p = p * (1 - lr * weight_decay) - lr * scale * sign(g)``."""
    if found_inf:
        return
    for p, g in zip(params, grads):
        p.copy_(_state_free_update(p.float(), _unscaled(g, grad_scale), lr=lr,
                                   weight_decay=weight_decay,
                                   scale=scale, state_free="sign"))


@torch.no_grad()
def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """torch.optim.SGD's update; ``first_step`` sets the buffers to the gradient."""
    if found_inf:
        return
    buffers = momentum_buffers if momentum != 0 else [None] * len(params)
    for p, g, buf in zip(params, grads, buffers):
        p32 = p.float()
        g32 = _unscaled(g, grad_scale)
        g32 = -g32 if maximize else g32
        if weight_decay != 0:
            g32 = g32 + weight_decay * p32
        if momentum != 0:
            if first_step:
                buf.copy_(g32)
            else:
                # (1 - dampening) * g as its own product: add_'s alpha may fuse into an FMA
                buf.mul_(momentum).add_((1 - dampening) * g32)
            g32 = g32 + momentum * buf if nesterov else buf
        p.copy_(p32 - lr * g32)


@torch.no_grad()
def frugal_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    indices: Sequence[Tensor],
    *,
    kind: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """One FRUGAL step on tensors whose state-full set is a subset of coordinates.

    For each tensor, ``indices`` (sorted, unique) names the state-full rows,
    columns or flat coordinates (``kind``); those coordinates get AdamW with
    the compact moments ``exp_avgs`` / ``exp_avg_sqs``, which hold exactly
    them (shape ``(k, *p.shape[1:])`` for rows, ``(*p.shape[:-1], k)`` for
    columns, ``(k,)`` for flat), in the order of ``indices``. Every other
    coordinate gets the ``state_free`` rule with step ``lr * state_free_scale``.
    Weight decay applies to all coordinates.
    """
    if found_inf:
        return
    for p, g, m, v, idx in zip(params, grads, exp_avgs, exp_avg_sqs, indices):
        _subset_step(p, g, idx, kind, grad_scale,
                     lambda full_p, full_g: adamw_(
                         [full_p], [full_g], [m], [v], lr=lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay, step=step),
                     lr=lr, weight_decay=weight_decay, scale=state_free_scale,
                     state_free=state_free)


def _subset_step(p: Tensor, g: Tensor, idx: Tensor, kind: str, grad_scale: Optional[float],
                 full_step, **state_free_options) -> None:
    """One tensor's split step: the state-full rows, columns or flat coordinates named by
    ``idx`` gathered (as new contiguous tensors) and updated in place by
    ``full_step(full_p, full_g)``, every coordinate taking the state-free rule, the
    state-full ones then written back over it."""
    p32, g32 = p.float(), _unscaled(g, grad_scale)
    idx = idx.long()
    if kind == "rows":
        full_p, full_g = p32[idx], g32[idx]
    elif kind == "columns":
        full_p, full_g = p32[..., idx], g32[..., idx]
    elif kind == "flat":
        full_p, full_g = p32.reshape(-1)[idx], g32.reshape(-1)[idx]
    else:
        raise ValueError(f"unknown subset kind {kind!r}")
    full_step(full_p, full_g)
    new_p = _state_free_update(p32, g32, **state_free_options)
    if kind == "rows":
        new_p[idx] = full_p
    elif kind == "columns":
        new_p[..., idx] = full_p
    else:
        new_p.view(-1)[idx] = full_p
    p.copy_(new_p)


@torch.no_grad()
def frugal_step_int8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_sq_scales: Sequence[Tensor],
    indices: Sequence[Tensor],
    *,
    kind: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """:func:`frugal_step_` with the subset's moments as 8-bit codes: the compact
    moments (shape ``(k, *p.shape[1:])`` for rows, ``(*p.shape[:-1], k)`` for columns)
    are codes with block scales along their own rows (:func:`quantize_moment`), and the
    state-full coordinates take :func:`adamw_int8_`'s update on them."""
    if found_inf:
        return
    if kind not in ("rows", "columns"):
        raise ValueError(f"frugal_step_int8_ takes kind 'rows' or 'columns', not {kind!r}")
    for p, g, mq, ms, vq, vs, idx in zip(params, grads, exp_avgs, exp_avg_scales, exp_avg_sqs,
                                         exp_avg_sq_scales, indices):
        _subset_step(p, g, idx, kind, grad_scale,
                     lambda full_p, full_g: adamw_int8_(
                         [full_p], [full_g], [mq], [ms], [vq], [vs], lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, weight_decay=weight_decay, step=step),
                     lr=lr, weight_decay=weight_decay, scale=state_free_scale,
                     state_free=state_free)


@torch.no_grad()
def lowrank_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    low_updates: Sequence[Tensor],
    low_grads: Sequence[Tensor],
    projections: Sequence[Tensor],
    sides: Sequence[int],
    *,
    lr: float,
    weight_decay: float,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """The weight update of a low-rank FRUGAL step.

    Each param is seen as a matrix [m, n] = [shape[0], rest]. With ``up`` the
    back-projection (``x @ P`` for side RIGHT, ``P @ x`` for LEFT):
    ``p = p * (1 - lr * weight_decay) - lr * state_free_scale * rule(g - up(low_grad))
    + up(low_update)``, where ``low_grad = P^T g`` is the projected gradient and
    ``low_update`` the (already lr-scaled) AdamW update in the subspace. With a
    ``grad_scale``, ``g`` is divided by it and ``low_grad`` is the projection of the
    unscaled gradient.
    """
    if found_inf:
        return
    for p, g, u, lg, proj, side in zip(params, grads, low_updates, low_grads, projections, sides):
        # [m, rest] spelled out: reshape(m, -1) is ambiguous for a tensor of 0 rows.
        mn = matrix_shape(p.shape)
        p32, g32 = p.float().reshape(mn), _unscaled(g, grad_scale).reshape(mn)

        residual = g32 - back_project(lg, proj, side)
        new_p = _state_free_update(p32, residual, lr=lr, weight_decay=weight_decay,
                                   scale=state_free_scale, state_free=state_free)
        new_p = new_p + back_project(u, proj, side)
        p.copy_(new_p.reshape(p.shape))


@torch.no_grad()
def lowrank_adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    projections: Sequence[Tensor],
    sides: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """A whole low-rank FRUGAL step: the projected gradient ``low = P^T g`` (of the
    unscaled gradient: the stored one projected, then unscaled), AdamW with ``low`` on
    the compact moments, whose update (lr applied, no decay) is what AdamW leaves in a
    zero parameter, then :func:`lowrank_step_` with that update and ``low``."""
    if found_inf:
        return
    for p, g, m, v, proj, side in zip(params, grads, exp_avgs, exp_avg_sqs, projections, sides):
        low = project(g, proj, side)
        if grad_scale is not None:
            low = low * inverse_grad_scale(torch.tensor(grad_scale, dtype=torch.float64))
        update = torch.zeros_like(low)
        adamw_([update], [low], [m], [v], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=0.0, step=step)
        lowrank_step_([p], [g], [update], [low], [proj], [side], lr=lr,
                      weight_decay=weight_decay, state_free=state_free,
                      state_free_scale=state_free_scale, grad_scale=grad_scale)


@torch.no_grad()
def dqt_update_(
    codes: Sequence[Tensor],
    scales: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    indices: Sequence[Tensor],
    *,
    bits: int,
    kind: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    state_free: str = "sign",
    state_free_scale: float = 1.0,
    seeds: Sequence[int],
    rng_step: int,
    grad_scale: Optional[float] = None,
    found_inf: Optional[float] = None,
) -> None:
    """One DQT step on INT-n weights in the format of :mod:`frugal_kernels._quant`.

    For each weight: dequantize ``W = s * q``; apply :func:`frugal_step_` to ``W``
    (AdamW with compact moments on the ``indices`` subset, the ``state_free``
    rule elsewhere; all rows gives plain AdamW, no indices plain SignSGD);
    round ``W / s`` stochastically with the uniforms of ``(seeds[i], rng_step,
    element index)``; pack the codes back. ``grads[i]`` is ``[R, C]``; the scales
    do not change.
    """
    if found_inf:
        return
    for q, s, g, m, v, idx, seed in zip(codes, scales, grads, exp_avgs, exp_avg_sqs, indices,
                                        seeds):
        rows, cols = g.shape
        w = _quant.dequantize(q, s, bits, cols)
        frugal_step_([w], [g], [m], [v], [idx], kind=kind, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, step=step, state_free=state_free,
                     state_free_scale=state_free_scale, grad_scale=grad_scale)
        x = w / s.float().reshape(-1, 1)
        u = _quant.uniform(seed, rng_step, torch.arange(rows * cols, device=g.device))
        q.copy_(_quant.pack(_quant.stochastic_round(x, u.reshape(rows, cols), bits), bits))


@torch.no_grad()
def dequantize(codes: Tensor, scales: Tensor, *, bits: int, cols: int,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """``ops.dequantize``: the weight ``s * q`` of packed codes, computed in fp32
    (the format's own definition, :func:`frugal_kernels._quant.dequantize`) and
    rounded to ``dtype``."""
    return _quant.dequantize(codes, scales, bits, cols).to(dtype)


@torch.no_grad()
def quant_matmul(a: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor] = None, *,
                 bits: int, cols: int, transpose_weight: bool = True) -> Tensor:
    """``ops.quant_matmul``: ``a @ W.T + bias`` (``a @ W`` without ``transpose_weight``),
    ``W`` the packed codes' weight rounded to ``a``'s dtype, as :func:`dequantize`
    gives it; the products summed and the bias added in fp32, the result rounded
    to ``a``'s dtype once."""
    w = dequantize(codes, scales, bits=bits, cols=cols, dtype=a.dtype).float()
    out = a.float() @ (w.t() if transpose_weight else w)
    if bias is not None:
        out += bias.float()
    return out.to(a.dtype)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                         bias: Optional[Tensor] = None, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         scores: Sequence[str] = ()):
    """``ops.linear_cross_entropy`` from the full ``[N, V]`` logits, in fp32: the loss of
    ``F.cross_entropy(hidden @ weight.T + bias, targets)`` and the per-token scores.

    Differentiable (autograd through the logits), so it is also the ground truth of the
    gradients. Returns ``(loss, {name: [N] fp32 tensor})``; ignored tokens score 0.
    """
    z = hidden.float() @ weight.float().t()
    if bias is not None:
        z = z + bias.float()
    per_token = torch.nn.functional.cross_entropy(
        z, targets.long(), ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction="none")
    loss = {"none": per_token, "sum": per_token.sum()}.get(reduction)
    if loss is None:
        loss = per_token.sum() / (targets != ignore_index).sum()
    kept = targets != ignore_index
    out = {}
    with torch.no_grad():
        vocab = z.shape[1]
        # The target of the smoothed loss: (1 - eps) on the label, eps / V everywhere.
        q = torch.full_like(z, label_smoothing / vocab)
        rows = kept.nonzero().flatten()
        q[rows, targets[rows].long()] += 1.0 - label_smoothing
        # The gradient of a token's loss with respect to its logits is softmax(z) - q.
        el2n = (torch.softmax(z, dim=1) - q).norm(dim=1) * kept
        for name in scores:
            if name == "loss":
                out[name] = per_token.detach().clone()
            elif name == "el2n":
                out[name] = el2n
            else:
                out[name] = el2n * hidden.float().norm(dim=1)
    return loss, out
# Elements a grad_norm pass widens to double at a time: the reference runs on any device,
# and a whole gradient in double would be twice its own size again.
_NORM_CHUNK = 1 << 20


@torch.no_grad()
def grad_norm(grads: Sequence[Tensor], *, norm_type: float = 2.0) -> tuple:
    """``ops.grad_norm``: the norm of all of ``grads`` as one vector, and whether any
    element is NaN or infinite.

    The 2-norm is the square root of the sum of the squares, summed in double (no finite
    fp32 gradient overflows it, so it is non-finite exactly when an element is); the max
    norm (``norm_type=inf``) is the largest magnitude, NaN when an element is NaN.
    Returns ``(total_norm, found_inf)``: a 0-dim float32 tensor (as
    ``torch.nn.utils.clip_grad_norm_`` returns it) and GradScaler's one-element float32
    flag, both on the gradients' device.
    """
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        flat = g.detach().reshape(-1)
        for start in range(0, flat.numel(), _NORM_CHUNK):
            part = flat[start:start + _NORM_CHUNK].double()
            if math.isinf(norm_type):
                # torch.maximum propagates NaN; so does amax.
                total = torch.maximum(total, part.abs().amax())
            else:
                total = total + (part * part).sum()
    if not math.isinf(norm_type):
        total = total.sqrt()
    found_inf = (~total.isfinite()).float().reshape(1)
    return total.float(), found_inf
