"""``frugal::dqt_update_``: DQT's fused step on weights stored as packed INT-n codes.

For each weight, in one pass over memory: dequantize ``W = s * q``, apply the
FRUGAL update (AdamW with compact moments on a state-full subset of rows,
columns or coordinates, the state-free rule on the rest; every row state-full
is plain AdamW, none is plain SignSGD), round ``W / s`` stochastically with a
counter-based generator and pack the codes back in place. The format and the
random numbers are those of :mod:`frugal_kernels._quant`, so every backend
writes the same codes for the same seed and step.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import _quant, reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import (DTYPE_CODES, PARAM_DTYPES, STATE_FREE_RULES, SUBSET_KINDS,
                                    subset_state_shape)
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Scalar, as_scalar_tensor, check_amp, check_finite,
                                        check_no_overlap, check_scalars, skipped_on_host,
                                        numels, addresses, subset_batch)
from frugal_kernels.ops.adamw import AdamWCore, check_adamw_hyper
from frugal_kernels.ops.frugal_step import check_subsets, validate_indices

OP = "frugal::dqt_update_"
_UINT32 = 1 << 32


class Tensors(NamedTuple):
    codes: List[Tensor]
    scales: List[Tensor]
    grads: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    indices: List[Tensor]
    kind: str  # the subset kind of every indices list
    seeds: List[int]  # one generator seed per weight


@dataclasses.dataclass(frozen=True)
class DqtHyper(AdamWCore):
    state_free: str
    state_free_scale: float
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched
    bits: int
    rng_step: int  # the counter of the random numbers (taken modulo 2**32)


def _check_tensor(name: str, i: int, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{OP}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return t


def _check(codes, scales, grads, exp_avgs, exp_avg_sqs, indices, kind, seeds, bits, lr, beta1,
           beta2, eps, weight_decay, step, state_free, state_free_scale, rng_step, grad_scale,
           found_inf, backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    _quant.check_bits(bits, OP)
    if kind not in SUBSET_KINDS:
        raise ValueError(f"{OP}: kind must be one of {', '.join(SUBSET_KINDS)}; got {kind!r}")
    if state_free not in STATE_FREE_RULES:
        raise ValueError(f"{OP}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {state_free!r}")
    n = len(codes)
    for name, items in (("scales", scales), ("grads", grads), ("exp_avgs", exp_avgs),
                        ("exp_avg_sqs", exp_avg_sqs), ("seeds", seeds)):
        if len(items) != n:
            raise ValueError(f"{OP}: got {n} codes but {len(items)} {name}; the lists must have "
                             "one entry per weight")
    if not 0 <= rng_step < _UINT32:
        raise ValueError(f"{OP}: rng_step must be in [0, 2**32), got {rng_step}")
    for i, seed in enumerate(seeds):
        if not 0 <= seed < _UINT32:
            raise ValueError(f"{OP}: seeds[{i}] must be in [0, 2**32), got {seed}")
    check_adamw_hyper(OP, beta1, beta2, eps)
    check_finite(OP, weight_decay=weight_decay, state_free_scale=state_free_scale)
    if n == 0:
        check_subsets(OP, grads, indices, kind, name="grads")
        return
    device = _check_tensor("grads", 0, grads[0]).device
    for i in range(n):
        q, s, g = (_check_tensor(name, i, t) for name, t in
                   (("codes", codes[i]), ("scales", scales[i]), ("grads", grads[i])))
        if g.dtype not in PARAM_DTYPES:
            raise TypeError(f"{OP}: grads[{i}] has dtype {g.dtype}; supported dtypes are "
                            "torch.float32, torch.bfloat16 and torch.float16")
        if g.dtype != grads[0].dtype:
            raise TypeError(f"{OP}: grads[{i}] has dtype {g.dtype} but grads[0] has "
                            f"{grads[0].dtype}; one call takes gradients of one dtype")
        if g.dim() != 2:
            raise ValueError(f"{OP}: grads[{i}] must be a 2-D weight gradient [R, C], got shape "
                             f"{tuple(g.shape)}")
        if g.numel() >= _UINT32:
            raise ValueError(f"{OP}: grads[{i}] has {g.numel()} elements; the random numbers "
                             "index elements in 32 bits")
        if q.dtype != torch.uint8:
            raise TypeError(f"{OP}: codes[{i}] has dtype {q.dtype}; packed codes are torch.uint8")
        want = _quant.packed_shape(tuple(g.shape), bits)
        if tuple(q.shape) != want:
            raise ValueError(f"{OP}: codes[{i}] has shape {tuple(q.shape)} but a [{g.shape[0]}, "
                             f"{g.shape[1]}] weight at {bits} bits packs to {want}")
        if s.dtype != torch.float32:
            raise TypeError(f"{OP}: scales[{i}] has dtype {s.dtype}; scales are torch.float32")
        if tuple(s.shape) not in ((1,), (g.shape[0],)):
            raise ValueError(f"{OP}: scales[{i}] has shape {tuple(s.shape)}; it must be (1,) "
                             f"(one per tensor) or ({g.shape[0]},) (one per row)")
        for name, t in (("codes", q), ("scales", s), ("grads", g)):
            if t.device != device:
                raise ValueError(f"{OP}: {name}[{i}] is on {t.device} but grads[0] is on "
                                 f"{device}; one call takes tensors on one device")
        if not q.is_contiguous():
            raise ValueError(f"{OP}: codes[{i}] is not contiguous; the op packs it in place and "
                             "needs it contiguous")
    check_subsets(OP, grads, indices, kind, name="grads")
    for i, g in enumerate(grads):
        expected = tuple(subset_state_shape(g, kind, indices[i].numel()))
        for name, t in (("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])):
            t = _check_tensor(name, i, t)
            if t.dtype != torch.float32:
                raise TypeError(f"{OP}: {name}[{i}] has dtype {t.dtype}; optimizer states are "
                                "torch.float32")
            if t.device != device:
                raise ValueError(f"{OP}: {name}[{i}] is on {t.device} but grads[0] is on {device}")
            if not t.is_contiguous():
                raise ValueError(f"{OP}: {name}[{i}] is not contiguous; the op updates it in place")
            if tuple(t.shape) != expected:
                raise ValueError(f"{OP}: {name}[{i}] has shape {tuple(t.shape)} but must have "
                                 f"shape {expected}")


@torch.library.custom_op(OP, mutates_args=("codes", "exp_avgs", "exp_avg_sqs"))
def _dqt_update_op(codes: List[Tensor], scales: List[Tensor], grads: List[Tensor],
                   exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], indices: List[Tensor],
                   kind: str, seeds: List[int], bits: int, lr: Tensor, beta1: float, beta2: float,
                   eps: float, weight_decay: float, step: Tensor, state_free: str,
                   state_free_scale: float, rng_step: int, grad_scale: Optional[Tensor],
                   found_inf: Optional[Tensor], backend: str) -> None:
    args = (codes, scales, grads, exp_avgs, exp_avg_sqs, indices, kind, seeds, bits, lr, beta1,
            beta2, eps, weight_decay, step, state_free, state_free_scale, rng_step, grad_scale,
            found_inf, backend)
    _check(*args)
    check_no_overlap(OP, written={"codes": codes, "exp_avgs": exp_avgs,
                                  "exp_avg_sqs": exp_avg_sqs},
                     read={"scales": scales, "grads": grads, "indices": indices})
    apply(*args)


def apply(codes: List[Tensor], scales: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
          exp_avg_sqs: List[Tensor], indices: List[Tensor], kind: str, seeds: List[int],
          bits: int, lr: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
          step: Tensor, state_free: str, state_free_scale: float, rng_step: int,
          grad_scale: Optional[Tensor], found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks (see :func:`frugal_kernels.ops.adamw.apply`)."""
    check_scalars(OP, lr, step)
    if skipped_on_host(found_inf):
        return
    keep = [i for i, g in enumerate(grads) if g.numel() > 0]
    if not keep:
        return
    impl = _IMPLS[_dispatch.resolve(backend, grads[0].device, OP)]
    impl(Tensors([codes[i] for i in keep], [scales[i].contiguous() for i in keep],
                 [grads[i].contiguous() for i in keep], [exp_avgs[i] for i in keep],
                 [exp_avg_sqs[i] for i in keep], [indices[i].contiguous() for i in keep], kind,
                 [seeds[i] for i in keep]),
         DqtHyper(lr, beta1, beta2, eps, weight_decay, step, state_free, state_free_scale,
                  grad_scale, found_inf, bits, rng_step))


_dqt_update_op.register_fake(_check)


def _kernel_batches(ext, t: Tensors):
    """The tensors as ``_C`` batches: the codes travel as the params of a
    TensorBatch of the gradients' dtype, their scales and sizes as a QuantBatch."""
    batch = ext.TensorBatch(dtype=DTYPE_CODES[t.grads[0].dtype], numel=numels(t.grads),
                            params=addresses(t.codes), grads=addresses(t.grads),
                            exp_avgs=addresses(t.exp_avgs), exp_avg_sqs=addresses(t.exp_avg_sqs))
    quant = ext.QuantBatch(scales=addresses(t.scales), scale_count=numels(t.scales),
                           rows=[g.shape[0] for g in t.grads], cols=[g.shape[1] for g in t.grads],
                           seeds=list(t.seeds))
    return batch, subset_batch(ext, t.grads, t.indices, t.kind), quant


def _cpu(t: Tensors, h: DqtHyper) -> None:
    ext = extension()
    ext.dqt_update_cpu(*_kernel_batches(ext, t), h.kernel(ext), torch.get_num_threads())


def _cuda(t: Tensors, h: DqtHyper) -> None:
    from frugal_kernels.ops._cuda import launch

    ext = extension()
    with launch(ext, h, t.grads[0].device) as (hyper, scalars, stream):
        ext.dqt_update_cuda(*_kernel_batches(ext, t), hyper, scalars, stream)


def _triton(t: Tensors, h: DqtHyper) -> None:
    from frugal_kernels.kernels.triton.dqt_update import dqt_update_

    dqt_update_(t.codes, t.scales, t.grads, t.exp_avgs, t.exp_avg_sqs, t.indices, kind=t.kind,
                seeds=t.seeds, **h.values())


def _torch(t: Tensors, h: DqtHyper) -> None:
    reference.dqt_update_(t.codes, t.scales, t.grads, t.exp_avgs, t.exp_avg_sqs, t.indices,
                          kind=t.kind, seeds=t.seeds, **h.on_host())


_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


def dqt_update_(codes: Sequence[Tensor], scales: Sequence[Tensor], grads: Sequence[Tensor],
                exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                indices: Sequence[Tensor], *, bits: int, kind: str, seeds: Sequence[int],
                lr: Scalar, beta1: float, beta2: float, eps: float, weight_decay: float,
                step: Scalar, rng_step: int, state_free: str = "sign",
                state_free_scale: float = 1.0, grad_scale: Optional[Tensor] = None,
                found_inf: Optional[Tensor] = None, backend: str = "auto",
                check_indices: bool = True) -> None:
    """DQT's step on packed INT-n weights, in place, in one call per group.

    For each weight ``i`` (its gradient ``grads[i]`` of shape ``[R, C]``):
    ``W = scales[i] * q`` with ``q`` the codes ``codes[i]`` unpack to; ``W`` is
    updated as :func:`frugal_step_` updates a parameter (AdamW on the
    state-full subset ``indices[i]`` with the compact moments ``exp_avgs[i]``,
    ``exp_avg_sqs[i]``; ``state_free`` elsewhere; decoupled weight decay on
    every weight); then ``W / scales[i]`` is rounded stochastically to a code in
    ``-qmax .. qmax`` and packed back into ``codes[i]``. The scales do not
    change. Plain AdamW is ``kind="rows"`` with every row in ``indices``;
    plain SignSGD is an empty ``indices``.

    Args:
        codes: torch.uint8 ``[R, ceil(C * bits / 8)]``, the format of
            :mod:`frugal_kernels._quant`; rewritten in place.
        scales: float32 ``[1]`` (one per tensor) or ``[R]`` (one per row).
        grads: float32, bfloat16 or float16 ``[R, C]``, one dtype per call.
        exp_avgs, exp_avg_sqs, indices, kind, state_free, state_free_scale:
            as for :func:`frugal_step_`.
        bits: the code width, 2 (ternary), 3, 4 or 8.
        seeds: one generator seed per weight, in ``[0, 2**32)``.
        rng_step: the generator's step, in ``[0, 2**32)``: with the seed and the
            element's index it fixes every rounding, so a resumed run that
            passes the same values writes the same codes on every backend.
        lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf,
        backend, check_indices: as for :func:`frugal_step_`.
    """
    check_amp(OP, grad_scale, found_inf)
    args = (list(codes), list(scales), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(indices), kind, [int(s) for s in seeds], int(bits),
            as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), as_scalar_tensor(OP, "step", step), state_free,
            float(state_free_scale), int(rng_step), grad_scale, found_inf, backend)
    if check_indices:
        _check(*args)
        validate_indices(args[2], args[5], kind, op=OP)
    _dqt_update_op(*args)
