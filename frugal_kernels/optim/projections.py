"""FRUGAL's projection families: how each splits a param group into state-full and state-free.

A family knows, for the tensors of one param group, how to choose the
state-full subspace (:meth:`Projection.choose`, at each subspace change),
which op rule each tensor takes and the state that rule needs
(:meth:`Projection.assign`, when the plan is built) and whether a saved state
fits a tensor (:meth:`Projection.fits`). The optimizer keeps the schedule
(when subspaces change, with which density) and the plan; a new projection is
a new family here, not a new branch there. :data:`DENSE` (every coordinate
state-full) serves the groups that are not projected.

Families hold no state of their own: what one remembers about a group
between subspace changes (the active blocks, the cursor of their order) lives
in :attr:`Subspace.record`, which the optimizer saves in its state dict.

On DTensor parameters (FSDP2, :mod:`frugal_kernels.optim.sharding`) a family
chooses the subspace of the global tensor, the same draw on every rank, and
keeps the state of this rank's rows only; :meth:`Projection.global_state` and
:meth:`Projection.local_state` turn that state into the one a single process
would hold (for state dicts and checkpoints) and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, MutableMapping, Optional, Tuple

import torch
from torch import Tensor

from frugal_kernels import ops, reference
from frugal_kernels._layout import (LEFT, MomentBlocks, lowrank_dim, lowrank_side, lowrank_state_shape,
                                    matrix_shape, projection_rank, projection_shapes, subset_dim,
                                    subset_state_shape)
from frugal_kernels._shard import RowShard, is_sharded, local
from frugal_kernels.optim import subspace_choice
from frugal_kernels.optim.plan import (ADAMW_INT8, ADAMW_INT8_MASTER, ADAMW_MASTER, STATE_FREE,
                                       Assignment, adamw_assignment, ensure_moments,
                                       stores_int8, subset_int8)
from frugal_kernels.optim.sharding import SHARDED_KEYS

__all__ = ["DENSE", "DENSE_MASTER", "FAMILIES", "Blocks", "CoordinateSubset", "Dense",
           "DenseMaster", "LowRank", "Projection", "Subspace"]


@dataclass
class Subspace:
    """What a family reads and writes about one param group.

    ``group`` is the param group (``params``, ``reset_state``,
    ``block_order``...), ``state`` the optimizer's per-tensor state,
    ``density`` the fraction to keep state-full now, ``generator`` the source
    of every random choice, ``record`` the family's own memory of the group
    (numbers and lists of numbers, so that it is saved with the state) and
    ``layouts`` the layouts of the DTensor parameters among the group's.

    ``arriving``: the step's gradients are not there yet when the subspace is
    chosen, and each arrives as backward completes its tensor
    (:func:`frugal_kernels.step_in_backward`). A choice that reads a gradient
    then waits for its tensor's (:meth:`Projection.assign`); the others are
    made for every tensor that requires a gradient, since which tensors will
    get one is not known yet."""

    group: dict
    state: MutableMapping[Tensor, dict]
    generator: torch.Generator
    density: float
    record: dict
    layouts: Mapping[Tensor, RowShard] = field(default_factory=dict)
    arriving: bool = False


class Projection:
    """A family of state-full subspaces (blocks, coordinate subsets, low-rank)."""

    # Per-tensor state entries besides AdamW's exp_avg, exp_avg_sq and step.
    state_keys: tuple = ()

    def choose(self, sub: Subspace) -> None:
        """Choose the group's subspace again, dropping the state it no longer needs."""

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        """The rule of ``p`` (``group["params"][i]``, with a gradient) until the next change;
        gives it the state that rule needs."""
        raise NotImplementedError

    def fits(self, saved: dict, p: Tensor) -> bool:
        """Whether a saved state with moments (``exp_avg``) belongs to ``p`` in this family."""
        raise NotImplementedError

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        """Why the family's entries of a saved state (``state_keys``, moments or not)
        cannot serve ``p``, or None when they can."""
        return None

    # Saved states (fits, check_saved) are in the global form, checked against the
    # global tensor (a DTensor's shape is the global one).

    def global_state(self, st: dict, p: Tensor, layout: RowShard) -> dict:
        """The state a single process would hold for the DTensor ``p``, from this
        rank's ``st``: DTensors for the entries that :func:`sharding.sharded_entry`
        names, plain tensors (the same on every rank) for the others. A collective."""
        return {key: layout.to_dtensor(value, self._global_shape(key, value, st, p))
                if key in SHARDED_KEYS else value for key, value in st.items()}

    def local_state(self, saved: dict, p: Tensor, layout: RowShard,
                    device: torch.device) -> dict:
        """This rank's state from a global-form ``saved`` (checked already): copies,
        never the saved tensors. A collective."""
        return {key: layout.block_of(value, device) if key in SHARDED_KEYS
                else value.to(device if key != "step" else value.device, copy=True)
                for key, value in saved.items()}

    def _global_shape(self, key: str, value: Tensor, st: dict, p: Tensor) -> Tuple[int, ...]:
        """The global shape of a sharded entry whose rows are this rank's chunk."""
        if key.endswith("_scale"):
            return MomentBlocks(p.shape).scale_shape
        return tuple(p.shape)


class Dense(Projection):
    """Every coordinate state-full: plain AdamW with moments of the tensor's shape."""

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        st = sub.state[p]
        ensure_moments(st, local(p).shape, p.device, int8=stores_int8(sub.group, p))
        return adamw_assignment(st)

    def fits(self, saved: dict, p: Tensor) -> bool:
        return tuple(saved["exp_avg"].shape) == tuple(p.shape)


class DenseMaster(Dense):
    """Every coordinate state-full, a bf16 / fp16 tensor updated on an fp32 master copy
    (``state["master"]``, made with its moments) that is rounded into it after every
    step (BAdam's ``inner="adamw"``); float32 tensors as :class:`Dense`. The moments are
    fp32 or 8-bit as :class:`Dense` makes them (the group's ``state_dtype``)."""

    state_keys = ("master",)

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        st = sub.state[p]
        rule = super().assign(sub, i, p)
        if p.dtype == torch.float32:
            return rule
        if "master" not in st:
            st["master"] = local(p.detach()).float().contiguous()
        return ADAMW_INT8_MASTER if rule == ADAMW_INT8 else ADAMW_MASTER

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        master = saved.get("master")
        if master is None:
            return ("the master copy of a bf16 / fp16 parameter is missing beside its moments"
                    if "exp_avg" in saved and p.dtype != torch.float32 else None)
        if p.dtype == torch.float32:
            return "a master copy belongs to bf16 / fp16 params only"
        if "exp_avg" not in saved:
            return "a master copy without moments"
        if master.dtype != torch.float32 or tuple(master.shape) != tuple(p.shape):
            return (f"the master copy must be a float32 tensor of the param's shape "
                    f"{tuple(p.shape)}, got {master.dtype} {tuple(master.shape)}")
        return None


class Blocks(Dense):
    """Whole tensors: ``round(density * n)`` of the group's n tensors get AdamW, in the
    group's ``block_order``; the others the state-free rule, and no state."""

    def choose(self, sub: Subspace) -> None:
        params, order = sub.group["params"], sub.group["block_order"]
        n_active = subspace_choice.num_active_blocks(sub.density, len(params), order)
        first = len(params) - 1 if order == "descending" else 0
        active, cursor = subspace_choice.choose_blocks(len(params), n_active, order,
                                                sub.record.get("cursor", first), sub.generator)
        previous = set(sub.record.get("active", ()))
        sub.record.update(active=active, cursor=cursor)
        for i, p in enumerate(params):
            if i not in active or sub.group["reset_state"] or i not in previous:
                # Leaving (or staying out of) the state-full set frees the state;
                # entering it, or a reset, starts fresh moments at the next step.
                sub.state[p].clear()

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        return super().assign(sub, i, p) if i in sub.record["active"] else STATE_FREE


class CoordinateSubset(Projection):
    """A random subset of ``round(density * dim)`` rows, columns or flat coordinates of each
    tensor, with compact moments; one fused ``frugal_step_`` per bucket."""

    state_keys = ("indices",)

    def __init__(self, subset_kind: str):
        self.subset_kind = subset_kind

    def _subset_kind(self, p: Tensor) -> str:
        return "flat" if p.dim() == 0 else self.subset_kind

    def _per_row(self, p: Tensor, layout: RowShard) -> Optional[int]:
        """For a DTensor sharded on dim 0: how many of the subset's ids fall in each
        row when the subset picks along the sharded rows (rows; flat coordinates,
        which run row after row; the columns of a 1-D tensor, its only dim), or
        None when it picks along an unsharded dim (the columns of a matrix: every
        rank takes the same ids, for its rows)."""
        kind = self._subset_kind(p)
        if kind == "columns" and p.dim() >= 2:
            return None
        return math.prod(p.shape[1:]) if kind == "flat" else 1

    def choose(self, sub: Subspace) -> None:
        for p in sub.group["params"]:
            subset_kind = self._subset_kind(p)
            dim = subset_dim(p, subset_kind)  # of the global tensor
            indices = subspace_choice.choose_subset(dim, subspace_choice.subset_size(sub.density, dim),
                                             sub.generator, p.device)
            layout = sub.layouts.get(p)
            per_row = None if layout is None else self._per_row(p, layout)
            if per_row is not None:
                # This rank's ids of the global subset, as ids of its rows.
                lo, hi = layout.own_range(indices, per_row)
                indices = indices[lo:hi] - layout.offset * per_row
            st = sub.state[p]
            if sub.group["reset_state"] or "exp_avg" not in st:
                st.clear()
            else:
                _carry_moments(st, indices,
                               subset_state_shape(local(p), subset_kind, indices.numel()),
                               dim=-1 if subset_kind == "columns" else 0)
            st["indices"] = indices

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        st = sub.state[p]
        subset_kind = self._subset_kind(p)
        int8 = subset_int8(sub.group, p, subset_kind)
        ensure_moments(st, subset_state_shape(local(p), subset_kind, st["indices"].numel()),
                       p.device, int8=int8)
        return Assignment("subset_int8" if st["exp_avg"].dtype == torch.int8 else "subset",
                          subset_kind=subset_kind, index_dtype=st["indices"].dtype)

    def global_state(self, st: dict, p: Tensor, layout: RowShard) -> dict:
        per_row = self._per_row(p, layout)
        if per_row is None or "indices" not in st:
            # Matrix columns: the ids are global already and the moments are this
            # rank's rows of [..., k], as the parameter's are.
            return super().global_state(st, p, layout)
        out = dict(st)
        ids = out["indices"] = layout.gather_ids(st["indices"], per_row)
        if "exp_avg" in st:
            # This rank's moments are the global subset's positions [lo, hi) (its rows'
            # ids): moved to DTensor's split of the k positions, they are a DTensor.
            k = ids.numel()
            sources = layout.owned_ranges(ids, per_row)
            targets = [(o, o + n) for o, n in layout.chunks(k)]
            # 8-bit moments' scales are rows of the compact state too (one per member row).
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
                if key not in st:
                    continue
                block = layout.move_rows(st[key], sources, targets)
                out[key] = layout.to_dtensor(block, (k, *st[key].shape[1:]))
        return out

    def local_state(self, saved: dict, p: Tensor, layout: RowShard,
                    device: torch.device) -> dict:
        per_row = self._per_row(p, layout)
        if per_row is None or "indices" not in saved:
            return super().local_state(saved, p, layout, device)
        ids = saved["indices"].to(device)
        lo, hi = layout.own_range(ids, per_row)
        out = {key: value.clone() for key, value in saved.items() if key == "step"}
        out["indices"] = (ids[lo:hi] - layout.offset * per_row).clone()
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            value = saved.get(key)
            if value is None:
                continue
            if is_sharded(value) and value.device_mesh == layout.mesh and \
                    tuple(value.placements) == layout.placements:
                sources = [(o, o + n) for o, n in layout.chunks(ids.numel())]
                out[key] = layout.move_rows(value.to_local().to(device), sources,
                                            layout.owned_ranges(ids, per_row))
            else:
                out[key] = layout.full(value)[lo:hi].to(device, copy=True)
        return out

    def _global_shape(self, key: str, value: Tensor, st: dict, p: Tensor) -> Tuple[int, ...]:
        shape = subset_state_shape(p, self._subset_kind(p), st["indices"].numel())
        return MomentBlocks(shape).scale_shape if key.endswith("_scale") else shape

    def fits(self, saved: dict, p: Tensor) -> bool:
        return "indices" in saved and tuple(saved["exp_avg"].shape) == subset_state_shape(
            p, self._subset_kind(p), saved["indices"].numel())

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        ids = saved.get("indices")
        if ids is None:
            return "indices are missing beside the moments" if "exp_avg" in saved else None
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
            return f"indices must be a 1-D int32 or int64 tensor, got {ids.dtype} {tuple(ids.shape)}"
        dim = subset_dim(p, self._subset_kind(p))
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= dim):
            return (f"indices range over [{int(ids.min())}, {int(ids.max())}], beyond the "
                    f"{dim} {self.subset_kind} of a parameter of shape {tuple(p.shape)}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            return "indices must be sorted and unique"
        return None


def _carry_moments(st: dict, indices: Tensor, shape, dim: int) -> None:
    """reset_state=False: coordinates in both the old and the new subset keep their
    moments, new ones start at zero. 8-bit moments are carried as the fp32 moments their
    codes stand for and quantized again in their new blocks."""
    if "exp_avg_scale" in st:
        for key, second in (("exp_avg", False), ("exp_avg_sq", True)):
            st[key] = reference.dequantize_moment(st[key], st.pop(key + "_scale"), second)
        _carry_moments(st, indices, shape, dim)
        for key, second in (("exp_avg", False), ("exp_avg_sq", True)):
            st[key], st[key + "_scale"] = reference.quantize_moment(st[key], second)
        return
    old, new = st["indices"].long(), indices.long()
    if old.numel() == 0:
        src = dst = torch.empty(0, dtype=torch.long, device=new.device)
    else:
        pos = torch.searchsorted(old, new).clamp(max=old.numel() - 1)
        hit = old[pos] == new
        src, dst = pos[hit], torch.nonzero(hit).squeeze(1)
    for key in ("exp_avg", "exp_avg_sq"):
        moment = st[key]
        fresh = torch.zeros(shape, dtype=moment.dtype, device=moment.device)
        fresh.index_copy_(dim, dst, moment.index_select(dim, src))
        st[key] = fresh


class LowRank(Projection):
    """A rank ``round(density * d)`` subspace of each matrix (``d`` its smaller side), random
    semi-orthogonal or the gradient's top singular vectors; the state-free rule takes the
    residual. Tensors of fewer than 2 dims get plain AdamW."""

    state_keys = ("projection",)

    def __init__(self, projection: str):
        self.projection = projection

    def choose(self, sub: Subspace) -> None:
        reads_gradient = self.projection == "svd"
        for p in sub.group["params"]:
            st = sub.state[p]
            if p.dim() < 2:
                if sub.group["reset_state"]:
                    st.clear()
            elif sub.arriving and reads_gradient:
                # The gradient is on its way: chosen when it arrives (assign), where
                # _project keeps or resets the moments as it does here.
                st.pop("projection", None)
            elif p.grad is None and not (sub.arriving and p.requires_grad):
                st.clear()  # chosen from a gradient: at its first step with one (assign)
            else:
                self._project(sub, p, st)

    def _project(self, sub: Subspace, p: Tensor, st: dict) -> None:
        rank = subspace_choice.subset_size(sub.density, lowrank_dim(p.shape))
        layout = sub.layouts.get(p)
        # svd reads the gradient; random only a shape and a device, which the parameter
        # has before its gradient arrives (in backward).
        source = p.grad if self.projection == "svd" else p.detach()
        if layout is not None and self.projection == "svd":
            # The top singular vectors are those of the whole gradient: every rank
            # gathers it (an all-gather, once per subspace change). A random
            # projection needs only the shape.
            source = layout.full(source)
        projection = subspace_choice.make_projection(self.projection, source, rank, sub.generator)
        if layout is not None:
            if self.projection == "svd":
                # One subspace for all: a factorization need not give the same bits
                # on every device, so the first rank's is everyone's.
                layout.broadcast(projection)
            if lowrank_side(p.shape) == LEFT:
                # P [m, r] acts on the rows: each rank keeps its own.
                projection = projection.narrow(0, layout.offset, layout.size).contiguous()
        keep = (not sub.group["reset_state"] and "exp_avg" in st
                and tuple(st["exp_avg"].shape) == _lowrank_moments_shape(p, rank, layout))
        if not keep:
            st.clear()
        st["projection"] = projection

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        st = sub.state[p]
        if p.dim() < 2:
            return DENSE.assign(sub, i, p)
        if "projection" not in st:
            self._project(sub, p, st)
        rank = projection_rank(st["projection"], lowrank_side(p.shape))
        ensure_moments(st, _lowrank_moments_shape(p, rank, sub.layouts.get(p)), p.device)
        rows, cols = matrix_shape(p.shape)
        # Small matrices take the whole step in one lowrank_adamw_step_ call where that
        # pays (the capability table's size limits).
        fused = p not in sub.layouts and ops.worth_calling("frugal::lowrank_adamw_step_",
                                                             p.device, rows * cols * rank)
        return Assignment("lowrank", full_rank=rank == lowrank_dim(p.shape), fused=fused)

    def global_state(self, st: dict, p: Tensor, layout: RowShard) -> dict:
        out = super().global_state(st, p, layout)
        if p.dim() >= 2 and lowrank_side(p.shape) == LEFT and "projection" in st:
            out["projection"] = layout.to_dtensor(st["projection"],
                                                  (p.shape[0], st["projection"].shape[1]))
        return out

    def local_state(self, saved: dict, p: Tensor, layout: RowShard,
                    device: torch.device) -> dict:
        out = super().local_state(saved, p, layout, device)
        if p.dim() >= 2 and lowrank_side(p.shape) == LEFT and "projection" in saved:
            out["projection"] = layout.block_of(saved["projection"], device)
        return out

    def _global_shape(self, key: str, value: Tensor, st: dict, p: Tensor) -> Tuple[int, ...]:
        if p.dim() < 2:
            return tuple(p.shape)
        side = lowrank_side(p.shape)
        return lowrank_state_shape(p.shape, projection_rank(st["projection"], side))

    def fits(self, saved: dict, p: Tensor) -> bool:
        if p.dim() < 2:
            return "projection" not in saved and DENSE.fits(saved, p)
        projection = saved.get("projection")
        if projection is None or projection.dim() != 2:
            return False
        side = lowrank_side(p.shape)
        rank = projection_rank(projection, side)
        return (tuple(projection.shape) == projection_shapes(p.shape, rank, side)[0]
                and tuple(saved["exp_avg"].shape) == lowrank_state_shape(p.shape, rank))

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        projection = saved.get("projection")
        if p.dim() < 2:
            return None if projection is None else "a projection for a tensor of < 2 dims"
        if projection is None:
            return "the projection is missing beside the moments" if "exp_avg" in saved else None
        side = lowrank_side(p.shape)
        if projection.dim() != 2 or projection.dtype != torch.float32:
            return f"the projection must be a 2-D float32 matrix, got {projection.dtype} " \
                   f"{tuple(projection.shape)}"
        rank = projection_rank(projection, side)
        if not rank <= lowrank_dim(p.shape) or \
                tuple(projection.shape) != projection_shapes(p.shape, rank, side)[0]:
            return (f"a projection of shape {tuple(projection.shape)} does not fit a parameter "
                    f"of shape {tuple(p.shape)}")
        return None


def _lowrank_moments_shape(p: Tensor, rank: int, layout: Optional[RowShard]
                           ) -> Tuple[int, ...]:
    """The moments' shape on this rank: the global [m, r] (right side) or [r, n]
    (left side), of which a DTensor's rank holds its chunk of the rows: its own rows
    of [m, r], or its share of the r rows of [r, n]."""
    shape = lowrank_state_shape(p.shape, rank)
    if layout is None:
        return shape
    return (layout.chunk(shape[0])[1], shape[1])


DENSE = Dense()
DENSE_MASTER = DenseMaster()

# One family per value of FRUGAL's ``projection`` (subspace_choice.PROJECTIONS, in its order).
FAMILIES: Dict[str, Projection] = {
    "blocks": Blocks(),
    "columns": CoordinateSubset("columns"),
    "rows": CoordinateSubset("rows"),
    "randk": CoordinateSubset("flat"),
    "random": LowRank("random"),
    "svd": LowRank("svd"),
}
