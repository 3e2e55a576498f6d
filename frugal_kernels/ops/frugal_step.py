"""``frugal::frugal_step_``: the fused FRUGAL update of projected tensors.

In one pass over memory, the coordinates in each tensor's state-full subset
get AdamW with compact moments that hold only those coordinates, and every
other coordinate gets the state-free rule (SignSGD by default). A state-free
coordinate reads p and g and writes p, nothing more: this is why a density
rho < 1 moves fewer bytes than AdamW.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import STATE_FREE_RULES, SUBSET_KINDS, subset_dim, subset_state_shape
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (GatheredBatch, Scalar, as_scalar_tensor, check_batch,
                                        check_finite, check_amp, check_no_overlap, check_scalars,
                                        skipped_on_host, subset_batch)
from frugal_kernels.ops.prepared import Call, PreparedCall, gathered_backend
from frugal_kernels.ops.adamw import AdamWCore, check_adamw_hyper

OP = "frugal::frugal_step_"


class Tensors(NamedTuple):
    params: List[Tensor]
    grads: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    indices: List[Tensor]
    kind: str  # the subset kind of every indices list


@dataclasses.dataclass(frozen=True)
class FrugalHyper(AdamWCore):
    state_free: str
    state_free_scale: float
    grad_scale: Optional[Tensor]  # GradScaler's scale, divided out of the gradients
    found_inf: Optional[Tensor]  # GradScaler's: non-zero leaves everything untouched


def _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
           weight_decay, step, state_free, state_free_scale, grad_scale, found_inf,
           backend) -> None:
    """The metadata checks, with the op's signature: also its fake kernel."""
    check_amp(OP, grad_scale, found_inf)
    if kind not in SUBSET_KINDS:
        raise ValueError(f"{OP}: kind must be one of {', '.join(SUBSET_KINDS)}; got {kind!r}")
    if state_free not in STATE_FREE_RULES:
        raise ValueError(f"{OP}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {state_free!r}")
    check_subsets(OP, params, indices, kind)
    check_batch(OP, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                state_shape=lambda i, p: subset_state_shape(p, kind, indices[i].numel()))
    check_adamw_hyper(OP, beta1, beta2, eps)
    check_finite(OP, weight_decay=weight_decay, state_free_scale=state_free_scale)


def check_subsets(op: str, params: Sequence[Tensor], indices: Sequence[Tensor], kind: str,
                  name: str = "params") -> None:
    """Metadata checks of the state-full subsets: one index tensor per param, an
    index dtype per call, 1-D, on the param's device, no more ids than the
    param has rows, columns or coordinates."""
    if len(indices) != len(params):
        raise ValueError(f"{op}: got {len(params)} {name} but {len(indices)} indices; "
                         "the lists must have one entry per param")
    for i, (p, idx) in enumerate(zip(params, indices)):
        if not isinstance(idx, Tensor):
            raise TypeError(f"{op}: indices[{i}] is a {type(idx).__name__}, not a torch.Tensor")
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: indices[{i}] has dtype {idx.dtype}; use torch.int32 or "
                            "torch.int64")
        if idx.dtype != indices[0].dtype:
            raise TypeError(f"{op}: indices[{i}] has dtype {idx.dtype} but indices[0] has "
                            f"{indices[0].dtype}; one call takes one index dtype")
        if idx.dim() != 1:
            raise ValueError(f"{op}: indices[{i}] must be 1-D, got shape {tuple(idx.shape)}")
        if isinstance(p, Tensor):
            if idx.device != p.device:
                raise ValueError(f"{op}: indices[{i}] is on {idx.device} but {name}[{i}] is on "
                                 f"{p.device}")
            if kind != "flat" and p.dim() == 0:
                raise ValueError(f"{op}: {name}[{i}] is 0-dim; kind {kind!r} needs at least "
                                 "one dimension (use kind='flat')")
            if idx.numel() > subset_dim(p, kind):
                raise ValueError(f"{op}: indices[{i}] has {idx.numel()} entries but {name}[{i}] "
                                 f"has only {subset_dim(p, kind)} {kind}")


def validate_indices(params: Sequence[Tensor], indices: Sequence[Tensor], kind: str,
                     op: str = OP) -> None:
    """Data checks of the subsets: sorted, unique and in range (a device sync on GPUs)."""
    for i, (p, idx) in enumerate(zip(params, indices)):
        if idx.numel() == 0:
            continue
        limit = subset_dim(p, kind)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            raise ValueError(f"{op}: indices[{i}] holds values in [{lo}, {hi}] but must be in "
                             f"[0, {limit}) for {kind} of a tensor of shape {tuple(p.shape)}")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError(f"{op}: indices[{i}] must be sorted and unique (strictly "
                             "increasing)")


@torch.library.custom_op(OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _frugal_step_op(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                    exp_avg_sqs: List[Tensor], indices: List[Tensor], kind: str, lr: Tensor,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: Tensor,
                    state_free: str, state_free_scale: float, grad_scale: Optional[Tensor],
                    found_inf: Optional[Tensor], backend: str) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
           weight_decay, step, state_free, state_free_scale, grad_scale, found_inf, backend)
    check_no_overlap(OP, written={"params": params, "exp_avgs": exp_avgs,
                                  "exp_avg_sqs": exp_avg_sqs},
                     read={"grads": grads, "indices": indices})
    apply(params, grads, exp_avgs, exp_avg_sqs, indices, kind, lr, beta1, beta2, eps,
          weight_decay, step, state_free, state_free_scale, grad_scale, found_inf, backend)


def apply(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
          exp_avg_sqs: List[Tensor], indices: List[Tensor], kind: str, lr: Tensor,
          beta1: float, beta2: float, eps: float, weight_decay: float, step: Tensor,
          state_free: str, state_free_scale: float, grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor], backend: str) -> None:
    """The op's body after its metadata checks (see :func:`frugal_kernels.ops.adamw.apply`)."""
    check_scalars(OP, lr, step)
    if skipped_on_host(found_inf):
        return
    keep = _stepped(params)
    if not keep:
        return
    impl = _IMPLS[_dispatch.resolve(backend, params[0].device, OP)]
    impl(Tensors([params[i] for i in keep], [grads[i].contiguous() for i in keep],
                 [exp_avgs[i] for i in keep], [exp_avg_sqs[i] for i in keep],
                 [indices[i].contiguous() for i in keep], kind),
         FrugalHyper(lr, beta1, beta2, eps, weight_decay, step, state_free, state_free_scale,
                     grad_scale, found_inf))


_frugal_step_op.register_fake(_check)


def _stepped(params: Sequence[Tensor]) -> List[int]:
    """The positions of the params a call updates: empty tensors have nothing to update
    (and no [R, C] view to speak of)."""
    return [i for i, p in enumerate(params) if p.numel() > 0]


def _prepare_cpu(ext, t: Tensors) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    subsets = subset_batch(ext, t.params, t.indices, t.kind)

    def call(grads: List[int], h: FrugalHyper) -> None:
        ext.frugal_step_cpu(batch.with_grads(ext, grads), subsets, h.kernel(ext),
                            torch.get_num_threads())
    return call


def _prepare_cuda(ext, t: Tensors) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    subsets, device = subset_batch(ext, t.params, t.indices, t.kind), t.params[0].device

    def call(grads: List[int], h: FrugalHyper) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.frugal_step_cuda(batch.with_grads(ext, grads), subsets, hyper, scalars, stream)
    return call


def _triton(t: Tensors, h: FrugalHyper) -> None:
    from frugal_kernels.kernels.triton.frugal_step import frugal_step_

    frugal_step_(t.params, t.grads, t.exp_avgs, t.exp_avg_sqs, t.indices, kind=t.kind,
                 **h.values())


def _torch(t: Tensors, h: FrugalHyper) -> None:
    reference.frugal_step_(t.params, t.grads, t.exp_avgs, t.exp_avg_sqs, t.indices, kind=t.kind,
                           **h.on_host())


_PREPARED = {"cpu": _prepare_cpu, "cuda": _prepare_cuda}
_cpu = gathered_backend(_prepare_cpu, lambda: extension())
_cuda = gathered_backend(_prepare_cuda, lambda: extension())

_IMPLS = {"cpu": _cpu, "cuda": _cuda, "triton": _triton, "torch": _torch}


class Prepared(PreparedCall):
    """:func:`frugal_step_` over fixed params, moments and subsets
    (:mod:`frugal_kernels.ops.prepared`)."""

    op, impls, prepared = OP, _IMPLS, _PREPARED

    def __init__(self, params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                 indices: List[Tensor], kind: str, backend: str):
        keep = _stepped(params)
        tensors = Tensors([params[i] for i in keep], [], [exp_avgs[i] for i in keep],
                          [exp_avg_sqs[i] for i in keep],
                          [indices[i].contiguous() for i in keep], kind)
        super().__init__(tensors, [*params, *exp_avgs, *exp_avg_sqs], backend,
                         None if len(keep) == len(params) else keep)

    def __call__(self, grads: List[Tensor], *, lr: Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: Tensor, state_free: str = "sign",
                 state_free_scale: float = 1.0, grad_scale: Optional[Tensor] = None,
                 found_inf: Optional[Tensor] = None) -> None:
        self._run(grads, FrugalHyper(lr.reshape(()), float(beta1), float(beta2), float(eps),
                                     float(weight_decay), step.reshape(()), state_free,
                                     float(state_free_scale), grad_scale, found_inf))


def frugal_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], indices: Sequence[Tensor], *, kind: str,
                 lr: Scalar, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: Scalar, state_free: str = "sign", state_free_scale: float = 1.0,
                 grad_scale: Optional[Tensor] = None,
                 found_inf: Optional[Tensor] = None, backend: str = "auto",
                 check_indices: bool = True) -> None:
    r"""The fused FRUGAL update of a list of tensors, in place, in one call.

    For each tensor, with :math:`S` its state-full coordinates (the rows,
    columns or flat coordinates ``indices`` names) and :math:`m, v` their
    compact moments:

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                         \\
            &\textbf{input}: \theta \text{ (params)}, \: g \text{ (grads)}, \: S
                \text{ (indices, kind)}, \: m, v \text{ (exp\_avgs, exp\_avg\_sqs on } S
                \text{)},                                                                \\
            &\hspace{13mm} \gamma \text{ (lr)}, \: \beta_1, \beta_2, \: \epsilon, \:
                \lambda \text{ (weight\_decay)}, \: t \text{ (step)}, \:
                \phi \text{ (state\_free)}, \: s \text{ (state\_free\_scale)}             \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                         \\
            &\theta \leftarrow \theta \, (1 - \gamma \lambda)
                \hspace{5mm} \text{(every coordinate)}                                   \\
            &\textbf{for} \: i \in S \: \textbf{do} \hspace{5mm} \text{(AdamW)}          \\
            &\hspace{5mm} m_i \leftarrow \beta_1 m_i + (1 - \beta_1) \, g_i              \\
            &\hspace{5mm} v_i \leftarrow \beta_2 v_i + (1 - \beta_2) \, g_i^2            \\
            &\hspace{5mm} \theta_i \leftarrow \theta_i - \frac{\gamma}{1 - \beta_1^t} \,
                \frac{m_i}{\sqrt{v_i} / \sqrt{1 - \beta_2^t} + \epsilon}                 \\
            &\textbf{for} \: i \notin S \: \textbf{do} \hspace{5mm}
                \text{(the state-free rule)}                                             \\
            &\hspace{5mm} \theta_i \leftarrow \theta_i - \gamma s \, \phi(g_i), \quad
                \phi(g) = \mathrm{sign}(g) \text{ (sign)}, \; g \text{ (sgd)}, \;
                0 \text{ (none)}                                                         \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                         \\[-1.ex]
       \end{aligned}

    A state-free coordinate reads :math:`\theta_i, g_i` and writes
    :math:`\theta_i`, nothing more, and the whole update is one pass over memory.

    Args:
        params, grads: as for :func:`adamw_`.
        indices: for each tensor, the sorted unique ids of its state-full rows
            (``kind="rows"``, along dim 0), columns (``"columns"``, along the
            last dim) or coordinates of the flattened tensor (``"flat"``);
            torch.int32 or torch.int64, one dtype per call. These are the
            ``rows``, ``columns`` and ``randk`` projections of FRUGAL.
        exp_avgs, exp_avg_sqs: float32 moments of the state-full coordinates
            only, in the order of ``indices``: shape ``(k, *p.shape[1:])`` for
            rows, ``(*p.shape[:-1], k)`` for columns, ``(k,)`` for flat.
        lr, beta1, beta2, eps, weight_decay, step: as for :func:`adamw_`;
            weight decay applies to every coordinate.
        state_free: the rule of the other coordinates: ``"sign"``
            (``p -= lr * state_free_scale * sign(g)``), ``"sgd"``
            (``p -= lr * state_free_scale * g``) or ``"none"`` (decay only).
        backend: as for :func:`adamw_`.
        check_indices: check that the indices are sorted, unique and in range
            (a host sync when they live on a GPU); callers that build the
            subsets themselves, as the optimizers do, pass False.
    """
    check_amp(OP, grad_scale, found_inf)
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(indices), kind,
            as_scalar_tensor(OP, "lr", lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), as_scalar_tensor(OP, "step", step), state_free,
            float(state_free_scale), grad_scale, found_inf, backend)
    if check_indices:
        _check(*args)
        validate_indices(args[0], args[4], kind)
    _frugal_step_op(*args)
