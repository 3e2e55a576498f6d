"""``dqt_update_`` on Triton: DQT's step on packed INT-n weights over a list of tensors in one launch.

The codes of a weight [R, C] are packed row by row (``_quant``), so a byte may
hold fields of several columns, and two programs must never own parts of one
byte. A group of eight consecutive fields of a row fills ``bits`` whole bytes
and owns them, so the programs cut each weight at group boundaries: every row
is seen with its length padded to ``pitch = ceil(C / 8) * 8`` positions, and
program ``t`` of a weight takes the padded positions ``[t * BLOCK, (t + 1) *
BLOCK)`` (``BLOCK`` a multiple of 8; lanes in the padding do nothing). Short
rows share a tile, long rows span several.

Per lane, in position order: the lane's field (from its one or two bytes) is
dequantized, ``w = s * (field - qmax)``; its state-full membership and its
moments' slot come from a search of the sorted index list (the branch-free
halving of ``lower_bound_lanes``, narrowed to the tile's members by two
searches per tile as in frugal_step); the member lanes get AdamW, the others
the state-free rule; then ``w / s`` is rounded stochastically with the
counter-based uniforms of ``_quant`` (``mix32``, ``rng_key``, ``rng_uniform``
below, ported from csrc/include/frugal/quant.h in uint32 arithmetic) and each
group's eight fields are OR-ed into one word whose bytes are stored. The update
rules are frugal_step's, operation for operation, so the codes equal the cpu
backend's bit for bit and the moments too.

The table record of a tensor is ``(codes, scales, g, m, v, indices, R, C,
packed_cols, scale_stride, subset_cols, k, seed)``: ``scale_stride`` is 1 for a
scale per row and 0 for one per tensor; ``subset_cols`` is the C of the
subset's [rows, cols] view (``matrix_view``: C for rows and columns, 1 for
flat coordinates). The tail, when lr / step live on the device, is frugal_step's.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels import _quant
from frugal_kernels._layout import STATE_FREE_CODES, matrix_view
from frugal_kernels.kernels.triton._common import (
    TL_DTYPES, TL_INDEX_DTYPES, adamw_launch, adamw_scalars_in_kernel, amp_in_kernel, amp_scalars,
    field_ptr, find_tile, from_param, launch_table, lower_bound, start, tail_f64, tail_scalar)
from frugal_kernels.kernels.triton.adamw import adamw_update
from frugal_kernels.kernels.triton.sign_sgd import state_free_update

# Not tuned on hardware yet (written without a GPU at hand): 1024 lanes, 128
# groups of eight, at 4 warps are eight lanes per thread, each lane carrying a
# few int64 values (its position, slot and search bounds).
BLOCK = 1024
NUM_WARPS = 4
_GROUP = tl.constexpr(8)  # fields per group: eight fields fill `bits` whole bytes
_RECORD = tl.constexpr(13)  # table fields per tensor, see the module docstring

# quant.h's generator constants.
_GOLDEN = tl.constexpr(_quant.GOLDEN)
_MIX_1 = tl.constexpr(_quant._MIX_1)
_MIX_2 = tl.constexpr(_quant._MIX_2)


# ---------------------------------------------------------------- the generator (quant.h)

@triton.jit
def mix32(x):
    """quant.h ``mix32`` (lowbias32) of uint32 values: products wrap as in C."""
    x = x ^ (x >> 16)
    x = x * _MIX_1
    x = x ^ (x >> 15)
    x = x * _MIX_2
    return x ^ (x >> 16)


@triton.jit
def rng_key(seed, step):
    """quant.h ``rng_key``: the key of one tensor at one step (uint32 in, uint32 out)."""
    return mix32(step + mix32(seed + _GOLDEN))


@triton.jit
def rng_uniform(key, index):
    """quant.h ``rng_uniform``: the fp32 uniform in [0, 1) of the element at ``index``
    (uint32), 24 bits so that the float holds it exactly."""
    return (mix32(index + key) >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def round_to_field(x, u, QMAX: tl.constexpr):
    """quant.h ``round_to_field``: x (in units of the scale) up with probability
    x - floor(x), clamped by the same comparisons (a NaN goes to the code 0, +-inf
    to +-qmax), as the unsigned field q + qmax (int32)."""
    f = tl.floor(x)
    q = f + tl.where(u < x - f, 1.0, 0.0)
    q = tl.where(q < -QMAX, -QMAX, q)
    q = tl.where(q > QMAX, QMAX, q)
    q = tl.where(q != q, 0.0, q)
    return q.to(tl.int32) + QMAX


# ---------------------------------------------------------------- the tile

@triton.jit
def lower_bound_lanes(idx_ptr, lo, hi, key, BLOCK: tl.constexpr):
    """For every lane, the first j in [lo, hi) with idx[j] >= key[lane] (hi if none).

    The width ``n`` of the range left is the same for every lane (each step
    keeps ``n - n // 2`` of it), so the loop runs on a scalar; only where the
    range sits differs. Every probe is inside [lo, hi), whatever the key.
    """
    base = tl.full((BLOCK,), 0, tl.int64) + lo
    n = hi - lo
    while n > 1:
        half = n >> 1
        below = tl.load(idx_ptr + (base + half)).to(tl.int64) < key
        base = tl.where(below, base + half, base)
        n -= half
    if n == 1:
        base = tl.where(tl.load(idx_ptr + base).to(tl.int64) < key, base + 1, base)
    return base


@triton.jit
def _or_groups(x, BLOCK: tl.constexpr):
    """x [BLOCK] (disjoint bit fields) to [BLOCK / 8]: the OR of each group of eight
    consecutive lanes, by halving the group three times (split is a builtin; the
    reductions of triton.language are its own @triton.jit functions, see ``_common``)."""
    G: tl.constexpr = BLOCK // 8
    a, b = tl.split(tl.reshape(x, (G, 4, 2)))
    a, b = tl.split(tl.reshape(a | b, (G, 2, 2)))
    a, b = tl.split(tl.reshape(a | b, (G, 1, 2)))
    return tl.reshape(a | b, (G,))


@triton.jit
def _dqt_tile(codes_ptr, scale_ptr, g_ptr, m_ptr, v_ptr, idx_ptr, first, count, C, pitch,
              packed_cols, scale_stride, subset_cols, k, key, decay, one_minus_beta1, beta2,
              one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, inv, COLUMNS: tl.constexpr,
              STATE_FREE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    lane = tl.arange(0, BLOCK)
    padded = first + lane
    r = padded // pitch
    c = padded - r * pitch
    valid = (lane < count) & (c < C)
    pos = r * C + c  # the element's index in the unpacked [R, C] weight

    # Dequantize: the lane's field spans one byte, or two when it straddles (bits = 3).
    bit = c * BITS
    byte_ptr = codes_ptr + r * packed_cols + (bit >> 3)
    shift = (bit & 7).to(tl.int32)
    low = tl.load(byte_ptr, mask=valid, other=0).to(tl.int32)
    high = tl.load(byte_ptr + 1, mask=valid & (shift + BITS > 8), other=0).to(tl.int32)
    field = ((low | (high << 8)) >> shift) & ((1 << BITS) - 1)
    scale = tl.load(scale_ptr + r * scale_stride, mask=valid, other=1.0)
    w = scale * (field - QMAX).to(tl.float32)
    g = from_param(tl.load(g_ptr + pos, mask=valid, other=0.0)) * inv

    # The tile's real positions [a, b) and the part of the index list that can
    # hold their members (a tile never starts in a row's padding: its first
    # column is a multiple of 8, and the padding is under 8 long).
    r0 = first // pitch
    c0 = first - r0 * pitch
    last = first + count - 1
    r1 = last // pitch
    c1 = tl.minimum(last - r1 * pitch, C - 1)
    zero = tl.full((), 0, tl.int64)
    if COLUMNS:
        # Member columns; within one row only the tile's columns can be members.
        lo = tl.where(r0 == r1, lower_bound(idx_ptr, zero, k, c0), zero)
        hi = tl.where(r0 == r1, lower_bound(idx_ptr, lo, k, c1 + 1), k)
        lane_key = c
    else:
        # Member rows of the subset's view: the weight's rows (subset_cols = C),
        # or its flat coordinates (subset_cols = 1).
        flat = subset_cols == 1
        lo = lower_bound(idx_ptr, zero, k, tl.where(flat, r0 * C + c0, r0))
        hi = lower_bound(idx_ptr, lo, k, tl.where(flat, r1 * C + c1, r1) + 1)
        lane_key = tl.where(flat, pos, r)
    j = lower_bound_lanes(idx_ptr, lo, hi, lane_key, BLOCK)
    listed = valid & (j < hi)
    member = listed & (tl.load(idx_ptr + j, mask=listed, other=-1).to(tl.int64) == lane_key)
    if COLUMNS:
        slot = r * k + j
    else:
        slot = tl.where(flat, j, j * C + c)

    m = tl.load(m_ptr + slot, mask=member, other=0.0)
    v = tl.load(v_ptr + slot, mask=member, other=0.0)
    wa, m, v = adamw_update(w, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2,
                            step_size, bc2_sqrt, eps, False)
    tl.store(m_ptr + slot, m, mask=member)
    tl.store(v_ptr + slot, v, mask=member)
    w = tl.where(member, wa, state_free_update(w, g, decay, sf_step, STATE_FREE))

    # Round and pack: lanes in the padding contribute no bits, so a row's last
    # byte keeps its padding bits zero.
    u = rng_uniform(key, pos.to(tl.uint32))
    field = tl.where(valid, round_to_field(tl.div_rn(w, scale), u, QMAX), 0)
    word = _or_groups(field.to(tl.int64) << ((lane % _GROUP) * BITS), BLOCK)
    group = first + _GROUP * tl.arange(0, BLOCK // 8)
    gr = group // pitch
    gc = group - gr * pitch
    # Bytes of each group: `bits`, fewer at the end of a row, none past the weight.
    gbyte = (gc // 8) * BITS
    n_bytes = tl.where((group < first + count) & (gc < C),
                       tl.minimum(packed_cols - gbyte, BITS), 0)
    nth = tl.arange(0, 8)
    out = (word[:, None] >> (nth[None, :] * 8)) & 0xFF
    tl.store(codes_ptr + (gr * packed_cols + gbyte)[:, None] + nth[None, :], out.to(tl.uint8),
             mask=nth[None, :] < n_bytes[:, None])


@triton.jit(do_not_specialize=["n_tensors", "rng_step"])
def _dqt_update_kernel(table, n_tensors, decay, one_minus_beta1, beta2, one_minus_beta2,
                       step_size, bc2_sqrt, eps, sf_step, rng_step, amp, G_DTYPE: tl.constexpr,
                       AMP: tl.constexpr, INDEX_DTYPE: tl.constexpr, COLUMNS: tl.constexpr,
                       STATE_FREE: tl.constexpr, BITS: tl.constexpr,
                       SCALARS_IN_KERNEL: tl.constexpr, BLOCK: tl.constexpr):
    if SCALARS_IN_KERNEL:
        tail = table + (n_tensors + 1) + n_tensors * _RECORD
        lr = tail_scalar(tail, 0)
        decay, step_size, bc2_sqrt = adamw_scalars_in_kernel(
            lr, tail_scalar(tail, 1), tail_f64(tail, 2), tail_f64(tail, 3), tail_f64(tail, 4))
        sf_step = (lr * tail_f64(tail, 5)).to(tl.float32)
    tensor, tile = find_tile(table, n_tensors)
    record = table + (n_tensors + 1) + tensor * _RECORD
    R = tl.load(record + 6)
    C = tl.load(record + 7)
    pitch = (C + 7) // 8 * 8
    first = tile * BLOCK  # the tile's first padded position
    count = tl.minimum(R * pitch - first, BLOCK)
    inv, count = amp_in_kernel(amp, count, AMP)
    if count > 0:
        key = rng_key(tl.load(record + 12).to(tl.uint32), rng_step.to(tl.uint32))
        _dqt_tile(field_ptr(record, 0, tl.uint8), field_ptr(record, 1, tl.float32),
                  field_ptr(record, 2, G_DTYPE), field_ptr(record, 3, tl.float32),
                  field_ptr(record, 4, tl.float32), field_ptr(record, 5, INDEX_DTYPE), first,
                  count, C, pitch, tl.load(record + 8), tl.load(record + 9),
                  tl.load(record + 10), tl.load(record + 11), key, decay, one_minus_beta1,
                  beta2, one_minus_beta2, step_size, bc2_sqrt, eps, sf_step, inv, COLUMNS,
                  STATE_FREE, BITS, BLOCK)


def dqt_update_(codes: Sequence[Tensor], scales: Sequence[Tensor], grads: Sequence[Tensor],
                exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                indices: Sequence[Tensor], *, kind: str, seeds: Sequence[int], bits: int,
                lr: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                step: Tensor, state_free: str, state_free_scale: float, rng_step: int,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                scalars_in_kernel: Optional[bool] = None) -> None:
    """DQT's step in place, as ``frugal_kernels.ops.dqt_update_`` (inputs already
    checked, indices sorted and unique, gradients and scales contiguous).

    ``lr`` and ``step`` are 0-dim tensors; ``scalars_in_kernel`` as for ``adamw_``.
    """
    items, device, scalars_in_kernel = start(grads, (lr, step), scalars_in_kernel)
    if not items:
        return
    scalars, tail, alive = adamw_launch(lr, step, beta1, beta2, eps, weight_decay, device,
                                        scalars_in_kernel, state_free_scale)
    amp, use_amp = amp_scalars(grad_scale, found_inf, device)
    records, padded = [], []
    for i in items:
        rows, cols = grads[i].shape
        _, _, subset_cols = matrix_view(grads[i], kind)
        records.append([codes[i].data_ptr(), scales[i].data_ptr(), grads[i].data_ptr(),
                        exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), indices[i].data_ptr(),
                        rows, cols, codes[i].shape[1], int(scales[i].numel() > 1), subset_cols,
                        indices[i].numel(), seeds[i]])
        padded.append(rows * triton.cdiv(cols, 8) * 8)
    table, grid = launch_table(device, padded, records, BLOCK, tail)
    _dqt_update_kernel[(grid,)](
        table, len(items), *scalars, rng_step, amp if use_amp else table,
        G_DTYPE=TL_DTYPES[grads[0].dtype], AMP=use_amp,
        INDEX_DTYPE=TL_INDEX_DTYPES[indices[items[0]].dtype], COLUMNS=kind == "columns",
        STATE_FREE=STATE_FREE_CODES[state_free], BITS=bits,
        SCALARS_IN_KERNEL=bool(scalars_in_kernel), BLOCK=BLOCK, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
