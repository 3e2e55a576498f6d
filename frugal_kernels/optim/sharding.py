"""The optimizers on DTensor parameters: FSDP2's ``fully_shard``, dim-0 shards.

``fully_shard`` hands an optimizer DTensor parameters and gradients sharded on
dim 0: each rank holds one contiguous block of rows, ``torch.chunk``'s split
(``ceil(rows / ranks)`` rows per rank, the last ranks fewer or none). The
package's optimizers keep working on plain tensors: the fused ops run on the
local blocks (``to_local()``, a view of the parameter's storage), and the
optimizer state is local too, allocated for the local rows only. What a
subspace is stays a property of the *global* tensor, chosen from the global
shape by the optimizer's generator, the same draw on every rank; a
:class:`ShardLayout` says where a rank's rows lie in the global tensor, so
that each rank maps the subspace to its rows.

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

import functools
import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from frugal_kernels._layout import LEFT, lowrank_side, row_chunk as chunk

__all__ = ["ShardLayout", "layout_of", "local", "is_sharded", "sharded_entry", "chunk",
           "max_over_ranks_", "process_groups"]

# State entries that are sharded on dim 0 in the global form when their parameter
# is: the moments (of every kind; the block scales of 8-bit moments too, whose blocks
# never straddle rows) and BAdam's master copy. A left-side projection ([m, r], see
# sharded_entry) is sharded too; everything else is held whole.
SHARDED_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "master")


@functools.lru_cache(maxsize=None)
def _dtensor():
    # torch.distributed.tensor is imported only where a DTensor can exist: torch builds
    # without distributed support have no such module. (Public from torch 2.5; FSDP2's
    # fully_shard, from 2.6, is what this module is tested with, on torch 2.13.) Looked
    # up once: is_sharded asks for every gradient of every step, and the import
    # statement cost about 1 us each time (111 tensors: a tenth of fused AdamW's step).
    from torch.distributed import tensor
    return tensor


def _all_gather(out: Tensor, block: Tensor, group: object) -> None:
    # torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, block, group=group)


# What a plain parameter or gradient is: told apart from a DTensor without the
# isinstance call (local() is asked for every gradient of every step, 111 of them for
# LLaMA-130M: the isinstance path cost about 1.3 us each).
_PLAIN = (Tensor, torch.nn.Parameter)


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor."""
    if type(t) in _PLAIN or not dist.is_available():
        return False
    return isinstance(t, _dtensor().DTensor)


def local(t: Tensor) -> Tensor:
    """The local block of a DTensor (a view of its storage), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def sharded_entry(key: str, p: Tensor) -> bool:
    """Whether state entry ``key`` of a DTensor parameter ``p`` is a DTensor in the global
    form (the rest are plain tensors, the same on every rank)."""
    if key in SHARDED_KEYS:
        return True
    # A left-side projection P [m, r] acts on the sharded rows: each rank holds its rows.
    return key == "projection" and p.dim() >= 2 and lowrank_side(p.shape) == LEFT


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Where one rank's block of a dim-0-sharded DTensor lies in the global tensor.

    ``offset`` and ``rows`` are the block's first global row and its row count;
    ``group`` is the process group of the mesh dimension that shards dim 0, with
    ``num_shards`` ranks of which this one is ``shard_rank``. Mesh dimensions that
    replicate (HSDP's) hold equal copies and take no part in what is computed here."""

    shape: torch.Size
    offset: int
    rows: int
    mesh: object
    placements: tuple
    group: object
    num_shards: int
    shard_rank: int

    @property
    def row_numel(self) -> int:
        """Elements per row (dim 0) of the global tensor."""
        return math.prod(self.shape[1:])

    def chunk(self, n: int) -> Tuple[int, int]:
        """(offset, size) of this rank's share of ``n`` rows in DTensor's split."""
        return chunk(n, self.num_shards, self.shard_rank)

    def chunks(self, n: int) -> List[Tuple[int, int]]:
        """Every rank's (offset, size) of ``n`` rows, in shard-rank order."""
        return [chunk(n, self.num_shards, r) for r in range(self.num_shards)]

    # ------------------------------------------------------------- global form

    def to_dtensor(self, block: Tensor, shape: Sequence[int]) -> Tensor:
        """The DTensor of global ``shape`` whose block on this rank is ``block`` (this
        rank's rows of ``shape[0]`` in DTensor's split). No communication."""
        shape = torch.Size(shape)
        return _dtensor().DTensor.from_local(block, self.mesh, self.placements,
                                             run_check=False, shape=shape,
                                             stride=_contiguous_stride(shape))

    def block_of(self, value: Tensor, device: torch.device) -> Tensor:
        """This rank's rows (DTensor's split of ``value.shape[0]``) of a global-form
        ``value``: a DTensor split as this layout splits (a copy of its block), a
        plain tensor holding the whole (a copy of the rows) or a DTensor split some
        other way (gathered whole first: a collective)."""
        if is_sharded(value):
            if value.device_mesh == self.mesh and tuple(value.placements) == self.placements:
                return value.to_local().to(device, copy=True)
            value = value.full_tensor()
        offset, size = self.chunk(value.shape[0])
        return value.narrow(0, offset, size).to(device, copy=True).contiguous()

    def full(self, t: Tensor) -> Tensor:
        """The whole of a DTensor (an all-gather), or ``t`` itself."""
        return t.full_tensor() if is_sharded(t) else t

    # --------------------------------------------------------- subsets of rows

    def own_range(self, ids: Tensor, per_row: int = 1) -> Tuple[int, int]:
        """[lo, hi): the positions in sorted global ``ids`` (of rows, or of flat
        coordinates with ``per_row`` per row) that fall in this rank's rows."""
        bounds = torch.tensor([self.offset * per_row, (self.offset + self.rows) * per_row],
                              dtype=ids.dtype, device=ids.device)
        lo, hi = torch.searchsorted(ids, bounds).tolist()
        return lo, hi

    def gather_ids(self, local_ids: Tensor, per_row: int = 1) -> Tensor:
        """The sorted global ids of every rank's rows (or flat coordinates) from each
        rank's local ones: an all-gather (the ranks' blocks follow one another)."""
        shifted = local_ids.long() + self.offset * per_row
        return _all_gather_ragged(shifted, self.group, self.num_shards).to(local_ids.dtype)

    def owned_ranges(self, ids: Tensor, per_row: int = 1) -> List[Tuple[int, int]]:
        """Every rank's [lo, hi) in sorted global ``ids`` (see :meth:`own_range`)."""
        rows = self.shape[0]
        bounds = [chunk(rows, self.num_shards, r) for r in range(self.num_shards)]
        edges = torch.tensor([o * per_row for o, _ in bounds] + [rows * per_row],
                             dtype=ids.dtype, device=ids.device)
        cuts = torch.searchsorted(ids, edges).tolist()
        # Empty shards sit at the end (offset == rows): their ranges come out empty.
        return [(cuts[r], cuts[r + 1]) for r in range(self.num_shards)]

    def move_rows(self, block: Tensor, sources: List[Tuple[int, int]],
                  targets: List[Tuple[int, int]]) -> Tensor:
        """Rows of one global tensor, held by rank r as rows ``sources[r]`` (this rank's
        are ``block``), rearranged so that rank r holds rows ``targets[r]``: one
        all-to-all of the overlaps."""
        if self.num_shards == 1:
            return block.narrow(0, targets[0][0] - sources[0][0],
                                targets[0][1] - targets[0][0]).clone()
        row_shape = block.shape[1:]
        numel = math.prod(row_shape)
        me = self.shard_rank
        (s_lo, s_hi), (t_lo, t_hi) = sources[me], targets[me]
        send = [max(0, min(s_hi, hi) - max(s_lo, lo)) * numel for lo, hi in targets]
        recv = [max(0, min(hi, t_hi) - max(lo, t_lo)) * numel for lo, hi in sources]
        out = block.new_empty((t_hi - t_lo, *row_shape))
        # The overlaps with the ranks in order are consecutive rows of both blocks.
        dist.all_to_all_single(out.reshape(-1), block.contiguous().reshape(-1), recv, send,
                               group=self.group)
        return out

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the shard group, in place."""
        if self.num_shards > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_chunks(self, block: Tensor, n: int) -> Tensor:
        """The whole ``[n, ...]`` tensor of which every rank holds its chunk (DTensor's
        split of ``n`` rows) as ``block``: one all-gather of chunks padded to full size.
        In DTensor's split every chunk but the last ones is full, so the first ``n``
        rows of the padded chunks, one after the other, are the tensor."""
        if self.num_shards == 1:
            return block
        size = -(-n // self.num_shards)
        padded = block.new_zeros((size, *block.shape[1:]))
        padded[:block.shape[0]] = block
        out = block.new_empty((self.num_shards * size, *block.shape[1:]))
        _all_gather(out, padded, self.group)
        return out[:n]

    def broadcast(self, t: Tensor) -> Tensor:
        """``t`` as the shard group's first rank holds it, on every rank, in place."""
        if self.num_shards > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return t


def layout_of(p: Tensor, name: str) -> Optional[ShardLayout]:
    """The layout of a DTensor parameter (None for a plain tensor); a ValueError naming
    ``name`` for placements the optimizers cannot split (a shard of another dim, a
    pending reduction) or a block that is not contiguous."""
    if not is_sharded(p):
        return None
    tensor = _dtensor()
    mesh, placements = p.device_mesh, tuple(p.placements)
    shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, tensor.Shard)]
    others = [pl for pl in placements if not isinstance(pl, (tensor.Shard, tensor.Replicate))]
    if others or len(shard_dims) > 1 or any(placements[i].dim != 0 for i in shard_dims):
        raise ValueError(
            f"{name} is a DTensor with placements {placements}: the optimizers take "
            "DTensors sharded on dim 0 over one mesh dimension and replicated on the "
            "others (FSDP2's fully_shard, HSDP), not tensor-parallel or other shardings")
    block = p.to_local()
    if not block.is_contiguous():
        raise ValueError(f"{name}: the local block of this DTensor is not contiguous; the "
                         "fused ops update blocks in place")
    rows = p.shape[0] if p.dim() else 1
    if not shard_dims:
        return ShardLayout(p.shape, 0, rows, mesh, placements, None, 1, 0)
    mesh_dim = shard_dims[0]
    num_shards, shard_rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    offset, size = chunk(rows, num_shards, shard_rank)
    if block.shape[0] != size:
        raise ValueError(f"{name}: a local block of {block.shape[0]} rows where DTensor's "
                         f"split of {rows} rows over {num_shards} ranks gives {size}")
    return ShardLayout(p.shape, offset, size, mesh, placements, mesh.get_group(mesh_dim),
                       num_shards, shard_rank)


def process_groups(layouts: Iterable["ShardLayout"]) -> List[object]:
    """The process groups ``layouts`` are sharded over, once each (anything with a
    ``group`` counts: DQT's row shards, frugal_kernels.nn.sharded.RowShard, too)."""
    groups: List[object] = []
    for layout in layouts:
        if layout.group is not None and all(layout.group is not g for g in groups):
            groups.append(layout.group)
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


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _all_gather_ragged(block: Tensor, group: object, world: int) -> Tensor:
    """The ranks' ``block`` s (equal but for dim 0) one after the other, in rank order."""
    if world == 1:
        return block.clone()
    count = torch.tensor([block.shape[0]], dtype=torch.long, device=block.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    longest = max(counts)
    padded = block.new_zeros((longest, *block.shape[1:]))
    padded[:block.shape[0]] = block
    out = block.new_empty((world * longest, *block.shape[1:]))
    _all_gather(out, padded, group)
    return torch.cat([out[r * longest:r * longest + c] for r, c in enumerate(counts)])
