"""Row sharding, the one home of it: where a rank's rows of a dim-0-sharded tensor lie.

FSDP2's ``fully_shard`` shards a parameter by rows in ``torch.chunk``'s split (DTensor's
``Shard(0)``): ``ceil(rows / ranks)`` rows per rank, the last ranks fewer or none. The
optimizers step a DTensor parameter through its local block, and the deprecated
``nn.shard_quantized_`` keeps a block of a quantized weight's rows the same way; both
speak of the block through one :class:`RowShard`: its rows ``[offset, offset + size)``
of the ``rows`` of the whole, the process group that shards them, how to gather the
whole from the blocks and how to take this rank's rows of a whole tensor.

This module sits below ``nn`` and ``optim`` and imports nothing of the package (the layer
rules of tests/test_layers.py). Everything here that communicates is a collective of the
shard group: every rank must call it, for the same tensors in the same order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RowShard", "row_chunk", "is_sharded", "local", "all_gather_into",
           "contiguous_stride"]


@functools.lru_cache(maxsize=None)
def _dtensor():
    # torch.distributed.tensor is imported only where a DTensor can exist: torch builds
    # without distributed support have no such module. (Public from torch 2.5; FSDP2's
    # fully_shard, from 2.6, is what this module is tested with, on torch 2.13.) Looked
    # up once: is_sharded asks for every gradient of every step, and the import
    # statement cost about 1 us each time (111 tensors: a tenth of fused AdamW's step).
    from torch.distributed import tensor
    return tensor


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


def row_chunk(n: int, num_shards: int, shard_rank: int) -> Tuple[int, int]:
    """(offset, size) of shard ``shard_rank`` of ``n`` rows split as ``torch.chunk`` and
    DTensor's ``Shard(0)`` split them: ``ceil(n / num_shards)`` rows each, the last
    shards fewer or none."""
    size = -(-n // num_shards) if n else 0
    offset = min(n, size * shard_rank)
    return offset, max(0, min(n, offset + size) - offset)


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a size-0 dim counts as 1, as
    torch's own strides do)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def all_gather_into(out: Tensor, block: Tensor, group: object) -> None:
    """Every rank's equal-sized ``block`` of ``group``, concatenated along dim 0 into
    ``out``: the one place that knows torch's name for it."""
    # torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, block, group=group)


@dataclass(frozen=True, eq=False)
class RowShard:
    """Where one rank's block of a dim-0-sharded tensor lies: rows ``[offset, offset +
    size)`` of the whole tensor's ``rows``, in DTensor's split.

    ``mesh`` and ``placements`` are the DTensor's (``(Shard(0),)`` on a 1-D mesh, or a
    ``Shard(0)`` beside replicated dimensions: HSDP's); ``group`` is the process group
    of the mesh dimension that shards dim 0, with ``num_shards`` ranks of which this one
    is ``shard_rank`` (None, 1 and 0 for a DTensor replicated on every dimension).
    Replicated dimensions hold equal copies and take no part in what is computed here.

    A tensor of another row count whose rows go with these (a weight's codes, its row
    scales, a state of ``k`` rows chosen from the whole) is split the same way: the
    methods that take ``n`` split ``n`` rows over the same ranks."""

    rows: int
    offset: int
    size: int
    mesh: object
    placements: tuple
    group: object
    num_shards: int
    shard_rank: int

    @classmethod
    def of(cls, t: Tensor, name: str) -> Optional["RowShard"]:
        """The row shard of a DTensor ``t`` (None for a plain tensor); a ValueError naming
        ``name`` for placements that are not rows (a shard of another dim, of two mesh
        dims, a pending reduction) or a local block that is not DTensor's contiguous
        split of the rows (the block is updated and read as rows in place)."""
        if not is_sharded(t):
            return None
        tensor = _dtensor()
        mesh, placements = t.device_mesh, tuple(t.placements)
        shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, tensor.Shard)]
        others = [pl for pl in placements if not isinstance(pl, (tensor.Shard, tensor.Replicate))]
        if others or len(shard_dims) > 1 or any(placements[i].dim != 0 for i in shard_dims):
            raise ValueError(
                f"{name} is a DTensor with placements {placements}: the optimizers and "
                "quantized layers take DTensors sharded on dim 0 over one mesh dimension "
                "and replicated on the others (FSDP2's fully_shard, HSDP), not "
                "tensor-parallel or other shardings")
        block = t.to_local()
        if not block.is_contiguous():
            raise ValueError(f"{name}: the local block of this DTensor is not contiguous; the "
                             "fused ops update blocks in place")
        rows = t.shape[0] if t.dim() else 1
        if not shard_dims:
            return cls(rows, 0, rows, mesh, placements, None, 1, 0)
        mesh_dim = shard_dims[0]
        num_shards, shard_rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        offset, size = row_chunk(rows, num_shards, shard_rank)
        if block.shape[0] != size:
            raise ValueError(f"{name}: a local block of {block.shape[0]} rows where DTensor's "
                             f"split of {rows} rows over {num_shards} ranks gives {size}")
        return cls(rows, offset, size, mesh, placements, mesh.get_group(mesh_dim),
                   num_shards, shard_rank)

    @classmethod
    def over(cls, mesh, rows: int) -> "RowShard":
        """This rank's shard of ``rows`` rows split over the ranks of a 1-D ``mesh``."""
        num_shards, shard_rank = mesh.size(0), mesh.get_local_rank(0)
        offset, size = row_chunk(rows, num_shards, shard_rank)
        return cls(rows, offset, size, mesh, (_dtensor().Shard(0),), mesh.get_group(0),
                   num_shards, shard_rank)

    def chunk(self, n: int) -> Tuple[int, int]:
        """(offset, size) of this rank's share of ``n`` rows in DTensor's split."""
        return row_chunk(n, self.num_shards, self.shard_rank)

    def chunks(self, n: int) -> List[Tuple[int, int]]:
        """Every rank's (offset, size) of ``n`` rows, in shard-rank order."""
        return [row_chunk(n, self.num_shards, r) for r in range(self.num_shards)]

    # ------------------------------------------------------------- global form

    def to_dtensor(self, block: Tensor, shape: Sequence[int]) -> Tensor:
        """The DTensor of global ``shape`` whose block on this rank is ``block`` (this
        rank's rows of ``shape[0]`` in DTensor's split). No communication."""
        shape = torch.Size(shape)
        return _dtensor().DTensor.from_local(block, self.mesh, self.placements,
                                             run_check=False, shape=shape,
                                             stride=contiguous_stride(shape))

    def block_of(self, value: Tensor, device: Optional[torch.device] = None) -> Tensor:
        """This rank's rows (DTensor's split of ``value.shape[0]``) of a global-form
        ``value``, as a new contiguous tensor on ``device`` (``value``'s by default):
        of a DTensor split as this shard splits, its block; of a plain tensor, which
        holds the whole, its rows; a DTensor split some other way is gathered whole
        first (a collective)."""
        if is_sharded(value):
            if value.device_mesh == self.mesh and tuple(value.placements) == self.placements:
                block = value.to_local()
                return block.to(block.device if device is None else device, copy=True)
            value = value.full_tensor()
        offset, size = self.chunk(value.shape[0])
        block = value.narrow(0, offset, size)
        return block.to(block.device if device is None else device, copy=True).contiguous()

    def full(self, t: Tensor) -> Tensor:
        """The whole of a DTensor (an all-gather), or ``t`` itself."""
        return t.full_tensor() if is_sharded(t) else t

    # ------------------------------------------------------------- collectives

    def gather(self, block: Tensor, n: Optional[int] = None) -> Tensor:
        """The whole ``[n, ...]`` tensor (``n`` defaults to ``rows``) of which every rank
        holds its chunk as ``block``: one all-gather of chunks padded to full size. In
        DTensor's split every chunk but the last ones is full, so the first ``n`` rows of
        the padded chunks, one after the other, are the tensor."""
        if self.num_shards == 1:
            return block
        n = self.rows if n is None else n
        size = -(-n // self.num_shards)
        padded = block.new_zeros((size, *block.shape[1:]))
        padded[:block.shape[0]] = block
        out = block.new_empty((self.num_shards * size, *block.shape[1:]))
        all_gather_into(out, padded, self.group)
        return out[:n]

    def reduce_scatter_mean(self, whole: Tensor) -> Tensor:
        """This rank's rows of the mean over the ranks of ``whole`` (``[rows, ...]``):
        one reduce-scatter of the padded rows, then a division by the rank count."""
        if self.num_shards == 1:
            return whole
        size = -(-self.rows // self.num_shards)
        padded = whole.new_zeros((self.num_shards * size, *whole.shape[1:]))
        padded[:self.rows] = whole
        out = whole.new_empty((size, *whole.shape[1:]))
        # torch 2.13 names it reduce_scatter_single and deprecates reduce_scatter_tensor.
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, padded, group=self.group)
        return out[:self.size].div_(self.num_shards)

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the shard group, in place."""
        if self.num_shards > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: Tensor) -> Tensor:
        """``t`` as the shard group's first rank holds it, on every rank, in place."""
        if self.num_shards > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return t

    # --------------------------------------------------------- subsets of rows

    def own_range(self, ids: Tensor, per_row: int = 1) -> Tuple[int, int]:
        """[lo, hi): the positions in sorted global ``ids`` (of rows, or of flat
        coordinates with ``per_row`` per row) that fall in this rank's rows."""
        bounds = torch.tensor([self.offset * per_row, (self.offset + self.size) * per_row],
                              dtype=ids.dtype, device=ids.device)
        lo, hi = torch.searchsorted(ids, bounds).tolist()
        return lo, hi

    def owned_ranges(self, ids: Tensor, per_row: int = 1) -> List[Tuple[int, int]]:
        """Every rank's [lo, hi) in sorted global ``ids`` (see :meth:`own_range`)."""
        edges = torch.tensor([o * per_row for o, _ in self.chunks(self.rows)]
                             + [self.rows * per_row], dtype=ids.dtype, device=ids.device)
        cuts = torch.searchsorted(ids, edges).tolist()
        # Empty shards sit at the end (offset == rows): their ranges come out empty.
        return [(cuts[r], cuts[r + 1]) for r in range(self.num_shards)]

    def gather_ids(self, local_ids: Tensor, per_row: int = 1) -> Tensor:
        """The sorted global ids of every rank's rows (or flat coordinates) from each
        rank's local ones: an all-gather (the ranks' blocks follow one another)."""
        shifted = local_ids.long() + self.offset * per_row
        return _all_gather_ragged(shifted, self.group, self.num_shards).to(local_ids.dtype)

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
    all_gather_into(out, padded, group)
    return torch.cat([out[r * longest:r * longest + c] for r, c in enumerate(counts)])
