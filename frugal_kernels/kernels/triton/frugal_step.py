"""``frugal_step_`` on Triton: the fused FRUGAL update over a list of tensors in one launch.

Each program updates one tile [a, b) of ``BLOCK`` flat positions of one tensor,
viewed as the row-major matrix [R, C] of csrc/include/frugal/frugal_tile.h
(flat coordinate lists are rows with C = 1). As there, the tile's state-full
members are one range [q_begin, q_end) of a two-level enumeration whose
positions increase with q, and member q keeps its moments at slot_base + q;
two binary searches over the sorted index list find the range.

The moments are compact: they hold only the members, in q order, so a
member's slot follows from q and not from its position. The program therefore
runs AdamW in q order: it lists the members' positions (member q - q_begin in
lane q - q_begin), loads m and v as one contiguous run, gathers p and g from
the tile it has just loaded (cache hits), and scatters p back. A histogram of
those positions over the tile (one bin per position) is the membership mask,
and the state-free rule is stored at the other positions only: every
coordinate of p is read from memory once and written once. Positions in a tile
are unique, so a tile never has more than BLOCK members and one pass of BLOCK
lanes lists them all. Tiles with no members skip all of it; tiles made only
of members (inside a state-full row) need no list.

(A prefix sum over the membership would give each position its slot instead,
in position order; tl.cumsum is not used because it is one of triton.language's
own @triton.jit functions, see ``_common``. The q order also makes the moments
one contiguous run.)

The table record of a tensor is ``(p, g, m, v, indices, numel, C, k)``; the
tail, when lr / step live on the device, is ``(&lr, &step, weight_decay,
log(beta1), log(beta2), state_free_scale)`` (see ``_common``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, TL_INDEX_DTYPES, adamw_launch, adamw_scalars_in_kernel, aligned, amp_in_kernel,
    amp_scalars, field_ptr, find_tile, from_param, launch_table, load_tile, lower_bound, start,
    store_tile, tail_f64, tail_scalar, to_param)
from frugal_kernels.kernels.triton.adamw import adamw_update
from frugal_kernels.kernels.triton.sign_sgd import state_free_update
from frugal_kernels._layout import STATE_FREE_CODES, matrix_view

# Not tuned on hardware yet. Smaller than the elementwise kernels' 4096: the
# histogram works over BLOCK bins in shared memory and the members' positions
# are int64 vectors of BLOCK lanes (93-110 registers at 2048 on sm_90, no spill).
BLOCK = 2048
NUM_WARPS = 8
_RECORD = tl.constexpr(8)  # table fields per tensor: p, g, m, v, indices, numel, C, k


@triton.jit
def _tile_members(idx_ptr, a, b, C, k, COLUMNS: tl.constexpr):
    """frugal_tile.h ``tile_members`` of the tile [a, b): (q_begin, q_end, inner_len,
    outer_base, slot_base)."""
    r0 = a // C
    r1 = (b - 1) // C
    if COLUMNS:
        zero = tl.full((), 0, tl.int64)
        q_begin = lower_bound(idx_ptr, zero, k, a - r0 * C)
        q_end = (r1 - r0) * k + lower_bound(idx_ptr, zero, k, b - r1 * C)
        inner_len = k
        outer_base = r0
    else:
        lo = lower_bound(idx_ptr, tl.full((), 0, tl.int64), k, r0)
        hi = lower_bound(idx_ptr, lo, k, r1 + 1)
        # Only the tile's first and last rows can be cut by its bounds.
        first = tl.load(idx_ptr + lo, mask=lo < hi, other=-1).to(tl.int64)
        last = tl.load(idx_ptr + (hi - 1), mask=lo < hi, other=-1).to(tl.int64)
        head_cut = tl.where(first == r0, a - r0 * C, 0)
        tail_cut = tl.where(last == r1, (r1 + 1) * C - b, 0)
        q_begin = tl.where(lo < hi, head_cut, 0)
        q_end = tl.where(lo < hi, (hi - lo) * C - tail_cut, 0)
        inner_len = C
        outer_base = lo
    return q_begin, q_end, inner_len, outer_base, outer_base * inner_len


@triton.jit
def _member_positions(idx_ptr, a, C, q_begin, inner_len, outer_base, lane, listed,
                      COLUMNS: tl.constexpr):
    """Position, relative to the tile start ``a``, of member q_begin + lane (frugal_tile.h
    ``member_at``); lanes not ``listed`` are left undefined."""
    q = q_begin + lane
    outer = q // inner_len
    inner = q - outer * inner_len
    if COLUMNS:
        column = tl.load(idx_ptr + inner, mask=listed, other=0).to(tl.int64)
        position = (outer_base + outer) * C + column
    else:
        row = tl.load(idx_ptr + (outer_base + outer), mask=listed, other=0).to(tl.int64)
        position = row * C + inner
    return (position - a).to(tl.int32)


@triton.jit
def _frugal_tile(p_ptr, g_ptr, m_ptr, v_ptr, idx_ptr, a, count, C, k, decay, one_minus_beta1,
                 beta2, one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, inv,
                 COLUMNS: tl.constexpr, STATE_FREE: tl.constexpr, MASKED: tl.constexpr,
                 BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    p = load_tile(p_ptr, lane, count, MASKED)
    g = load_tile(g_ptr, lane, count, MASKED) * inv
    q_begin, q_end, inner_len, outer_base, slot_base = _tile_members(idx_ptr, a, a + count, C, k,
                                                                     COLUMNS)
    m_ptr += slot_base + q_begin
    v_ptr += slot_base + q_begin
    n_members = q_end - q_begin
    if n_members == count:
        in_tile = lane < count
        m = tl.load(m_ptr + lane, mask=in_tile)
        v = tl.load(v_ptr + lane, mask=in_tile)
        p, m, v = adamw_update(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2,
                               step_size, bc2_sqrt, eps, False)
        tl.store(m_ptr + lane, m, mask=in_tile)
        tl.store(v_ptr + lane, v, mask=in_tile)
        store_tile(p_ptr, lane, count, p, MASKED)
    elif n_members > 0:
        listed = lane < n_members
        position = _member_positions(idx_ptr, a, C, q_begin, inner_len, outer_base, lane, listed,
                                     COLUMNS)
        is_member = tl.histogram(position, BLOCK, mask=listed) > 0
        # Members and the others are disjoint positions: no store overwrites another.
        free = (lane < count) & ~is_member
        tl.store(p_ptr + lane, to_param(state_free_update(p, g, decay, sf_step, STATE_FREE),
                                        p_ptr.dtype.element_ty), mask=free)
        mp = from_param(tl.load(p_ptr + position, mask=listed, other=0.0))
        mg = from_param(tl.load(g_ptr + position, mask=listed, other=0.0)) * inv
        m = tl.load(m_ptr + lane, mask=listed)
        v = tl.load(v_ptr + lane, mask=listed)
        mp, m, v = adamw_update(mp, mg, m, v, decay, one_minus_beta1, beta2, one_minus_beta2,
                                step_size, bc2_sqrt, eps, False)
        tl.store(m_ptr + lane, m, mask=listed)
        tl.store(v_ptr + lane, v, mask=listed)
        tl.store(p_ptr + position, to_param(mp, p_ptr.dtype.element_ty), mask=listed)
    else:
        store_tile(p_ptr, lane, count,
                   state_free_update(p, g, decay, sf_step, STATE_FREE), MASKED)


@triton.jit(do_not_specialize=["n_tensors"])
def _frugal_step_kernel(table, n_tensors, decay, one_minus_beta1, beta2, one_minus_beta2,
                        step_size, bc2_sqrt, eps, sf_step, amp, P_DTYPE: tl.constexpr,
                        AMP: tl.constexpr,
                        INDEX_DTYPE: tl.constexpr, COLUMNS: tl.constexpr,
                        STATE_FREE: tl.constexpr, SCALARS_IN_KERNEL: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        lr = tail_scalar(tail, 0)
        decay, step_size, bc2_sqrt = adamw_scalars_in_kernel(
            lr, tail_scalar(tail, 1), tail_f64(tail, 2), tail_f64(tail, 3), tail_f64(tail, 4))
        sf_step = (lr * tail_f64(tail, 5)).to(tl.float32)
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    a = tile * BLOCK
    p_ptr = field_ptr(record, 0, P_DTYPE) + a
    g_ptr = field_ptr(record, 1, P_DTYPE) + a
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    m_ptr = field_ptr(record, 2, tl.float32)
    v_ptr = field_ptr(record, 3, tl.float32)
    idx_ptr = field_ptr(record, 4, INDEX_DTYPE)
    count = tl.minimum(tl.load(record + 5) - a, BLOCK)  # positions in this tile
    C = tl.load(record + 6)
    k = tl.load(record + 7)
    inv, count = amp_in_kernel(amp, count, AMP)
    if count == BLOCK:
        _frugal_tile(p_ptr, g_ptr, m_ptr, v_ptr, idx_ptr, a, count, C, k, decay, one_minus_beta1,
                     beta2, one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, inv, COLUMNS,
                     STATE_FREE, False, BLOCK)
    elif count > 0:
        _frugal_tile(p_ptr, g_ptr, m_ptr, v_ptr, idx_ptr, a, count, C, k, decay, one_minus_beta1,
                     beta2, one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, inv, COLUMNS,
                     STATE_FREE, True, BLOCK)


def frugal_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], indices: Sequence[Tensor], *, kind: str,
                 lr: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: Tensor, state_free: str, state_free_scale: float,
                 grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                 scalars_in_kernel: Optional[bool] = None) -> None:
    """The FRUGAL step in place, as ``frugal_kernels.ops.frugal_step_`` (inputs already
    checked, indices sorted and unique).

    ``lr`` and ``step`` are 0-dim tensors; ``scalars_in_kernel`` as for ``adamw_``.
    """
    items, device, scalars_in_kernel = start(params, (lr, step), scalars_in_kernel)
    if not items:
        return
    scalars, tail, alive = adamw_launch(lr, step, beta1, beta2, eps, weight_decay, device,
                                        scalars_in_kernel, state_free_scale)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    records = []
    for i in items:
        _, _, cols = matrix_view(params[i], kind)
        records.append([params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                        exp_avg_sqs[i].data_ptr(), indices[i].data_ptr(), params[i].numel(),
                        cols, indices[i].numel()])
    table, grid = launch_table(device, [params[i].numel() for i in items], records, BLOCK, tail)
    _frugal_step_kernel[(grid,)](
        table, len(items), *scalars, amp if use_amp else table,
        P_DTYPE=TL_DTYPES[params[0].dtype], AMP=use_amp,
        INDEX_DTYPE=TL_INDEX_DTYPES[indices[items[0]].dtype], COLUMNS=kind == "columns",
        STATE_FREE=STATE_FREE_CODES[state_free], SCALARS_IN_KERNEL=bool(scalars_in_kernel),
        ALIGNED=aligned([t for i in items for t in (params[i], grads[i])]), BLOCK=BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
