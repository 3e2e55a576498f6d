"""``frugal::frugal_step_``: the fused FRUGAL update of projected tensors.

In one pass over memory, the coordinates in each tensor's state-full subset
get AdamW with compact moments that hold only those coordinates, and every
other coordinate gets the state-free rule (SignSGD by default). A state-free
coordinate reads p and g and writes p, nothing more: this is why a density
rho < 1 moves fewer bytes than AdamW.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from frugal_kernels._extension import extension
from frugal_kernels._layout import STATE_FREE_RULES, SUBSET_KINDS, subset_dim, subset_state_shape
from frugal_kernels.ops._common import GatheredBatch, check_batch, subset_batch
from frugal_kernels.ops._spec import OpSpec, amp, real, rule, tensors, text
from frugal_kernels.ops.adamw import adamw_hyper
from frugal_kernels.ops.prepared import Call

OP = "frugal::frugal_step_"


def _check(op: str, a) -> None:
    check_subsets(op, a.params, a.indices, a.kind)
    check_batch(op, a.params, a.grads, {"exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs},
                state_shape=lambda i, p: subset_state_shape(p, a.kind, a.indices[i].numel()))


def state_free_hyper(default: str = "sign"):
    """The state-free rule and its lr scale, shared by the FRUGAL ops."""
    return (rule("state_free", STATE_FREE_RULES, default), real("state_free_scale", 1.0))


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


def _validate(op: str, a) -> None:
    validate_indices(a.params, a.indices, a.kind, op=op)


SPEC = OpSpec("frugal_step_", (
    tensors("params", written=True), tensors("grads", contiguous=True),
    tensors("exp_avgs", written=True), tensors("exp_avg_sqs", written=True),
    tensors("indices", contiguous=True), text("kind", SUBSET_KINDS),
    *adamw_hyper(), *state_free_hyper(), *amp(),
), record="FrugalHyper", check=_check, skip_empty=True, validate=_validate,
    ext=lambda: extension())

Tensors, FrugalHyper = SPEC.Tensors, SPEC.Hyper


@SPEC.prepared("cpu")
def _prepare_cpu(ext, t) -> Call:
    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    subsets = subset_batch(ext, t.params, t.indices, t.kind)

    def call(grads: List[int], h) -> None:
        ext.frugal_step_cpu(batch.with_grads(ext, grads), subsets, h.kernel(ext),
                            torch.get_num_threads())
    return call


@SPEC.prepared("cuda")
def _prepare_cuda(ext, t) -> Call:
    from frugal_kernels.ops._cuda import launch

    batch = GatheredBatch(t.params, t.exp_avgs, t.exp_avg_sqs)
    subsets, device = subset_batch(ext, t.params, t.indices, t.kind), t.params[0].device

    def call(grads: List[int], h) -> None:
        with launch(ext, h, device) as (hyper, scalars, stream):
            ext.frugal_step_cuda(batch.with_grads(ext, grads), subsets, hyper, scalars, stream)
    return call


_cpu, _cuda = SPEC.impls["cpu"], SPEC.impls["cuda"]

frugal_step_ = SPEC.register(
    doc=r'''The fused FRUGAL update of a list of tensors, in place, in one call.

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
''')
