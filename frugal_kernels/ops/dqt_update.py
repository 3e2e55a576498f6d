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

import torch
from torch import Tensor

from frugal_kernels import _quant
from frugal_kernels._extension import extension
from frugal_kernels._layout import DTYPE_CODES, PARAM_DTYPES, SUBSET_KINDS, subset_state_shape
from frugal_kernels.ops._common import addresses, numels, subset_batch
from frugal_kernels.ops._spec import OpSpec, amp, integer, ints, tensors, text
from frugal_kernels.ops.adamw import adamw_hyper
from frugal_kernels.ops.frugal_step import check_subsets, state_free_hyper, validate_indices

OP = "frugal::dqt_update_"
_UINT32 = 1 << 32


def _bits(op: str, name: str, value: int) -> None:
    _quant.check_bits(value, op)


def _uint32(op: str, name: str, value: int) -> None:
    if not 0 <= value < _UINT32:
        raise ValueError(f"{op}: {name} must be in [0, 2**32), got {value}")


def _check_tensor(name: str, i: int, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{OP}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return t


def _check(op: str, a) -> None:
    codes, scales, grads, exp_avgs, exp_avg_sqs, indices, kind, seeds = a[:8]
    bits = a.bits
    n = len(codes)
    for name, items in (("scales", scales), ("grads", grads), ("exp_avgs", exp_avgs),
                        ("exp_avg_sqs", exp_avg_sqs), ("seeds", seeds)):
        if len(items) != n:
            raise ValueError(f"{OP}: got {n} codes but {len(items)} {name}; the lists must have "
                             "one entry per weight")
    for i, seed in enumerate(seeds):
        if not 0 <= seed < _UINT32:
            raise ValueError(f"{OP}: seeds[{i}] must be in [0, 2**32), got {seed}")
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


def _validate(op: str, a) -> None:
    validate_indices(a.grads, a.indices, a.kind, op=op)


SPEC = OpSpec("dqt_update_", (
    tensors("codes", written=True), tensors("scales", contiguous=True),
    tensors("grads", contiguous=True), tensors("exp_avgs", written=True),
    tensors("exp_avg_sqs", written=True), tensors("indices", contiguous=True),
    text("kind", SUBSET_KINDS), ints("seeds", keyword=True), integer("bits", check=_bits),
    *adamw_hyper(), *state_free_hyper(),
    integer("rng_step", check=_uint32),  # the counter of the random numbers
    *amp(),
), record="DqtHyper", check=_check, lead="grads", skip_empty=True, validate=_validate,
    ext=lambda: extension())

Tensors, DqtHyper = SPEC.Tensors, SPEC.Hyper


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


@SPEC.backend("cpu")
def _cpu(t, h) -> None:
    ext = extension()
    ext.dqt_update_cpu(*_kernel_batches(ext, t), h.kernel(ext), torch.get_num_threads())


@SPEC.backend("cuda")
def _cuda(t, h) -> None:
    from frugal_kernels.ops._cuda import launch

    ext = extension()
    with launch(ext, h, t.grads[0].device) as (hyper, scalars, stream):
        ext.dqt_update_cuda(*_kernel_batches(ext, t), hyper, scalars, stream)


dqt_update_ = SPEC.register(
    doc='''DQT's step on packed INT-n weights, in place, in one call per group.

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
''')
