"""Prepared calls: an op over the same tensors, called again and again with new gradients.

An optimizer's plan makes the same op calls at every step between two subspace
changes: the same params, moments and subsets, new gradients and scalars. A
prepared call is made from a call that was checked (the plan's first call of a
bucket goes through the registered op), and it keeps what the kernels need of
the tensors that do not change: on the cpu and cuda backends their addresses and
sizes as the ``_C`` argument structs, gathered once; a call gathers only the
gradients' addresses. Gathering a TensorBatch of LLaMA-130M's 111 tensors took
about 120 us per call, which the host-overhead benchmark counts against fused
AdamW's whole step (docs/benchmarks.md); on a GPU that host time is the step's.

A prepared call runs the op's body (its backend, kernels and arguments), so its
results are bit-identical to the registered op's; it bumps the version counters
of the tensors it writes, as the op does, and still checks the scalars that need
no device sync (a finite lr, a step >= 1). It is valid while its tensors live and
keep their memory: the plans rebuild it whenever a subspace change, a loaded
state dict or new parameter data may have replaced them. Not for torch.compile
(its graphs call the registered ops) and not for users: a mismatched call here
is undefined, where the public ops raise.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels._extension import extension
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import Hyper, addresses, check_scalars, skipped_on_host

__all__ = ["Call", "PreparedCall"]

# What an op's backend prepares from its tensors (``prepare(ext, tensors)``, the
# gradients left out): the launch of its kernel, taking the gradients' addresses and the
# op's hyper-parameter record.
Call = Callable[[List[int], Hyper], None]


class PreparedCall:
    """An op's body over fixed tensors; each call gives the gradients and the scalars.

    A subclass (:class:`frugal_kernels.ops._spec.Prepared`, made from an op's
    declaration) names the op (``op``), its backends (``impls``) and the backends that
    gather their tensors once (``prepared``: backend -> ``prepare(ext, tensors)``, the
    cpu and cuda ones), and builds the op's hyper-parameter record in its
    ``__call__``, which hands it to :meth:`_run`.

    ``tensors`` is the op's ``Tensors`` record with an empty ``grads``;
    ``written`` lists the tensors the op writes; ``keep`` the positions the op
    steps (None: all of them; an op may leave empty tensors out)."""

    op: str
    impls: Dict[str, Callable[[NamedTuple, Hyper], None]]
    prepared: Dict[str, Callable[[Any, NamedTuple], Call]]

    def __init__(self, tensors: NamedTuple, written: Sequence[Tensor], backend: str,
                 keep: Optional[List[int]] = None):
        self.tensors = tensors
        self.written = list(written)
        self.keep = keep
        params = tensors.params
        self.empty = not params
        self.backend = "torch" if self.empty else _dispatch.resolve(backend, params[0].device,
                                                                    self.op)
        prepare = self.prepared.get(self.backend)
        self.call = (prepare(extension(), tensors)
                     if prepare is not None and not self.empty else None)

    def _run(self, grads: List[Tensor], h: Hyper) -> None:
        check_scalars(self.op, h.lr, getattr(h, "step", None))
        if self.empty or skipped_on_host(h.found_inf):
            return
        if self.keep is not None:
            grads = [grads[i] for i in self.keep]
        grads = [g.contiguous() for g in grads]
        if self.call is not None:
            self.call(addresses(grads), h)
        else:
            self.impls[self.backend](self.tensors._replace(grads=grads), h)
        torch._C._increment_version(self.written)
