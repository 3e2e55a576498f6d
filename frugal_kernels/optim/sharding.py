"""The optimizers on DTensor parameters: FSDP2's ``fully_shard``, dim-0 shards.

``fully_shard`` hands an optimizer DTensor parameters and gradients sharded on
dim 0: each rank holds one contiguous block of rows, ``torch.chunk``'s split
(``ceil(rows / ranks)`` rows per rank, the last ranks fewer or none). The
package's optimizers keep working on plain tensors: the fused ops run on the
local blocks (``to_local()``, a view of the parameter's storage), and the
optimizer state is local too, allocated for the local rows only. What a
subspace is stays a property of the *global* tensor, chosen from the global
shape by the optimizer's generator, the same draw on every rank; the
parameter's :class:`~frugal_kernels._shard.RowShard` (``RowShard.of(p, name)``)
says where a rank's rows lie in the global tensor, so that each rank maps the
subspace to its rows.

A state dict holds the state in its *global form*, the one a single process
would hold: DTensors of the global shape, sharded on dim 0 in
``torch.chunk``'s split (what ``torch.distributed.checkpoint`` reshards), and
plain tensors, the same on every rank, for what every rank holds whole
(subset indices, a right-side projection, step counts). Which entries are
sharded is one rule, :func:`sharded_entry`, shared by the optimizers' state
dicts and the checkpoint template (:mod:`frugal_kernels.optim.checkpoint`).

Everything here that communicates is a collective of the shard group: every
rank must call it, for the same tensors in the same order.
"""

from __future__ import annotations

from typing import Iterable, List

import torch.distributed as dist
from torch import Tensor

from frugal_kernels._layout import LEFT, lowrank_side
from frugal_kernels._shard import RowShard

__all__ = ["sharded_entry", "max_over_ranks_", "process_groups", "sum_over_ranks_"]

# State entries that are sharded on dim 0 in the global form when their parameter
# is: the moments (of every kind; the block scales of 8-bit moments too, whose blocks
# never straddle rows) and BAdam's master copy. A left-side projection ([m, r], see
# sharded_entry) is sharded too; everything else is held whole.
SHARDED_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "master")


def sharded_entry(key: str, p: Tensor) -> bool:
    """Whether state entry ``key`` of a DTensor parameter ``p`` is a DTensor in the global
    form (the rest are plain tensors, the same on every rank)."""
    if key in SHARDED_KEYS:
        return True
    # A left-side projection P [m, r] acts on the sharded rows: each rank holds its rows.
    return key == "projection" and p.dim() >= 2 and lowrank_side(p.shape) == LEFT


def process_groups(shards: Iterable[RowShard]) -> List[object]:
    """The process groups ``shards`` are sharded over, once each."""
    groups: List[object] = []
    for shard in shards:
        if shard.group is not None and all(shard.group is not g for g in groups):
            groups.append(shard.group)
    return groups


def max_over_ranks_(flag: Tensor, groups: Iterable[object]) -> Tensor:
    """``flag`` replaced, in place, by its maximum over the ranks of ``groups`` (an
    all-reduce on each, on ``flag``'s device): how the ranks agree on skipping a step
    without any of them reading the flag on the host."""
    for group in groups:
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def sum_over_ranks_(value: Tensor, groups: Iterable[object]) -> Tensor:
    """``value`` replaced, in place, by its sum over the ranks of ``group`` (one process
    group: the ranks a tensor's rows are sharded over). Summing over several groups would
    count a rank's share once per group, so that is refused."""
    groups = [g for g in groups if g is not None]
    if len(groups) > 1:
        raise NotImplementedError("a sum over the parameters' ranks needs them sharded over "
                                  f"one process group; they are sharded over {len(groups)}")
    for group in groups:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
