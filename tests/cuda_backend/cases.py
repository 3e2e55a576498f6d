"""Cases shared by the CUDA tests: the emulated kernels (test_cuda_emulation)
and the real ones on a GPU (test_cuda_gpu). Sizes sit around the kernels'
launch constants, which _C reports from the headers (csrc/cuda/*.cuh)."""

import pytest
import torch

from frugal_kernels import _quant, reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import (MOMENT_BLOCK, STATE_FREE_RULES, MomentBlocks, subset_dim,
                                    subset_state_shape)

from ..required import skip_unless_required

_C = extension()
if _C is None:
    skip_unless_required("frugal_kernels._C is not built")

# Per kernel: threads, chunk (elements a block owns), max_tensors and
# max_blocks per launch, and for frugal_step_ the tile (8 tiles a block).
LIMITS = _C.cuda_limits()
CHUNK = LIMITS["adamw"]["chunk"]
TILE = LIMITS["frugal_step"]["tile"]
# dqt_update_'s tiles and chunks count padded positions (rows padded to groups of 8).
DQT_TILE = LIMITS["dqt_update"]["tile"]
DQT_CHUNK = LIMITS["dqt_update"]["chunk"]
# adamw_int8_'s chunks count moment blocks (MOMENT_BLOCK elements of a row, or the row).
INT8_CHUNK = LIMITS["adamw_int8"]["chunk"]
# grad_norm's chunks: one partial result each.
GN_CHUNK = LIMITS["grad_norm"]["chunk"]
GN_SIZES = [1, 7, 2047, 2048, 2049, GN_CHUNK - 1, GN_CHUNK, GN_CHUNK + 1, 2 * GN_CHUNK + 5]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# lr is a power of two so that a float32 device tensor holds it exactly.
LR, BETA1, BETA2, EPS, WD, STEP = 2.0**-7, 0.9, 0.999, 1e-8, 0.1, 3.0
SIZES = [1, 7, TILE - 1, TILE, TILE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 40001]

# Shapes per subset kind, each with the fraction of its rows, columns or
# coordinates that is state-full: 0 and 1 give empty and full index lists.
FRUGAL_SHAPES = {
    # C > 1 not dividing TILE, C = TILE, C > TILE, C dividing TILE, a single row
    "rows": [((37, 300), 0.3), ((3, 700), 0.5), ((8, TILE), 0.4), ((5, 5000), 0.4),
             ((40, 512), 0.25), ((1, 7), 1.0), ((20, 5000), 0.3), ((6, 33), 0.0),
             ((9, 250), 1.0)],
    # C < TILE, C > TILE, C = TILE, C = TILE + 1, a single column, 3-D
    "columns": [((300, 77), 0.3), ((3, 4500), 0.2), ((20, TILE), 0.1), ((7, TILE + 1), 0.5),
                ((50, 513), 0.25), ((40, 1), 1.0), ((10, 100), 0.0), ((13, 40), 1.0),
                ((2, 3, 700), 0.3)],
    # C = 1: sizes around TILE and the block's chunk
    "flat": [((1,), 1.0), ((7,), 0.5), ((TILE - 1,), 0.3), ((TILE,), 0.3), ((TILE + 1,), 0.3),
             ((CHUNK + 1,), 0.25), ((40000,), 0.1), ((3000,), 0.0), ((2500,), 1.0)],
}


# adamw_int8_: rows around the moment block (one warp's round) and a thread block's
# chunk of moment blocks: rows of one element and of 7 (many blocks a chunk), of a block
# and one, of 300 (a partial last block; rows after the first off the 16-byte path),
# a row of INT8_CHUNK blocks and one element (a second thread block of one short moment
# block), rows exactly a chunk's worth, 0-dim, 3-D.
INT8_SHAPES = [(1,), (7,), (MOMENT_BLOCK - 1,), (MOMENT_BLOCK,), (MOMENT_BLOCK + 1,),
               (INT8_CHUNK * MOMENT_BLOCK + 1,), (40, 7), (9, MOMENT_BLOCK + 1), (3, 300),
               (INT8_CHUNK, MOMENT_BLOCK), (2, 3, 700), (), (1, 1), (5, 2 * MOMENT_BLOCK)]


# frugal_step_int8_: shapes per subset kind with their state-full fractions. rows: state
# rows of 300, 700, one block, 20 blocks, 7 (one short block), a full subset of 70 rows
# (more blocks than a chunk), 1-D tensors (one gathered state row of k; k = 1 is a
# member row), 3-D; columns: state rows of k around and past a block (C = 4500: 4
# blocks), a single column, a full subset, 3-D (state rows of 3 x k).
FRUGAL_INT8_SHAPES = {
    "rows": [((37, 300), 0.3), ((3, 700), 0.5), ((8, MOMENT_BLOCK), 0.4), ((5, 5000), 0.4),
             ((1, 7), 1.0), ((6, 33), 0.0), ((9, 250), 1.0), ((70, MOMENT_BLOCK), 1.0),
             ((3000,), 0.3), ((1,), 1.0), ((2, 3, 700), 0.5)],
    "columns": [((300, 77), 0.3), ((3, 4500), 0.2), ((20, TILE), 0.1), ((50, 513), 0.25),
                ((40, 1), 1.0), ((10, 100), 0.0), ((13, 40), 1.0), ((2, 3, 700), 0.3),
                ((200, 600), 0.5)],
}


def as_shape(shape):
    """A shape, from a shape or a length."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


def moment_blocks(shapes):
    """The units adamw_int8_'s planner cuts into chunks: each tensor's moment blocks."""
    blocks = [MomentBlocks(as_shape(s)) for s in shapes]
    return [b.rows * b.per_row for b in blocks]


# dqt_update_: weights [R, C] per subset kind with their state-full fractions:
# rows shorter than a group many to a tile (C = 1, 5), C not a multiple of 8
# (padding), a row of exactly one tile, rows that tiles cut, 3-bit fields that
# straddle bytes at any of these, empty and full subsets.
DQT_SHAPES = {
    "rows": [((37, 300), 0.3), ((3, 700), 0.5), ((8, DQT_TILE), 0.4), ((5, 5000), 0.4),
             ((1, 7), 1.0), ((300, 5), 0.5), ((6, 33), 0.0), ((9, 250), 1.0),
             ((3000, 1), 0.3)],
    "columns": [((300, 77), 0.3), ((3, 4500), 0.2), ((20, DQT_TILE), 0.1),
                ((7, DQT_TILE + 1), 0.5), ((50, 513), 0.25), ((40, 1), 1.0), ((10, 100), 0.0),
                ((13, 40), 1.0)],
    "flat": [((1, 1), 1.0), ((7, 1), 0.5), ((DQT_TILE - 1, 1), 0.3), ((3, 2053), 0.3),
             ((100, 201), 0.25), ((3000, 1), 0.0), ((50, 50), 1.0)],
}


def dqt_padded(shapes):
    """The padded lengths dqt_update_'s planner cuts into chunks: R rows of C rounded
    up to a multiple of 8."""
    return [r * -(-c // 8) * 8 for (r, c), _ in shapes]


def launches_for(op, numels):
    """The launch count the planner must reach for ``op`` (csrc/cuda/multi_tensor.h)."""
    chunk, max_tensors, max_blocks = (LIMITS[op][k] for k in ("chunk", "max_tensors",
                                                              "max_blocks"))
    launches = tensors = blocks = 0
    for n in numels:
        if n == 0:
            continue
        chunks = -(-n // chunk)
        tensors += 1
        for c in range(chunks):
            blocks += 1
            last = c + 1 == chunks
            if blocks == max_blocks or (last and tensors == max_tensors):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


def placed(values, *, misaligned=False, device="cpu"):
    """A copy of ``values`` on ``device`` whose data starts 16-byte aligned, or
    one element past it, so that the kernels' 16-byte vector path is or is not
    taken."""
    n = values.numel()
    base = torch.empty(n + 16, dtype=values.dtype, device=device)
    assert base.data_ptr() % 16 == 0, "torch's allocators align to at least 64 bytes"
    offset = 1 if misaligned else 0
    out = base[offset:offset + n].view(values.shape)
    out.copy_(values)
    # An empty view has no address of its own (torch reports its storage's).
    assert n == 0 or (out.data_ptr() % 16 == 0) != misaligned
    return out


def grads_like(shape, dtype, gen):
    g = torch.randn(shape, generator=gen)
    # Exact zeros: sign(0) = 0 must agree too.
    g[torch.rand(shape, generator=gen) < 0.05] = 0.0
    return g.to(dtype)


def subset(dim, fraction, index_dtype, gen):
    """Sorted unique ids of range(dim), each in with probability ``fraction``
    (so 0 and 1 give the empty and the full list)."""
    return (torch.rand(dim, generator=gen) < fraction).nonzero().flatten().to(index_dtype)


def adamw_data(numels, dtype, seed):
    """params, grads, exp_avgs, exp_avg_sqs: lists of host tensors."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m, v = [], [], [], []
    for n in numels:
        p.append(torch.randn(n, generator=gen).to(dtype))
        g.append(grads_like(n, dtype, gen))
        m.append(0.1 * torch.randn(n, generator=gen))
        v.append(0.01 * torch.rand(n, generator=gen))
    return p, g, m, v


def adamw_int8_data(shapes, dtype, seed):
    """params, grads and the 8-bit moments (exp_avgs, exp_avg_scales, exp_avg_sqs,
    exp_avg_sq_scales: the reference's codes of random fp32 moments, second moments over
    four decades): lists of host tensors. The first row of every tensor of two rows or
    more has zero moments and gradients, so that it quantizes to blocks of scale 0."""
    gen = torch.Generator().manual_seed(seed)
    p, g, moments = [], [], ([], [], [], [])
    for shape in map(as_shape, shapes):
        p.append(torch.randn(shape, generator=gen).to(dtype))
        g.append(grads_like(shape, dtype, gen))
        m = 0.1 * torch.randn(shape, generator=gen)
        v = 0.01 * torch.rand(shape, generator=gen) ** 4
        if len(shape) >= 2 and shape[0] >= 2:
            m[0], v[0], g[-1][0] = 0.0, 0.0, 0.0
        for lst, t in zip(moments, (*reference.quantize_moment(m, False),
                                    *reference.quantize_moment(v, True))):
            lst.append(t)
    return (p, g, *moments)


def frugal_int8_data(kind, shapes, dtype, index_dtype, seed):
    """params, grads, the 8-bit moments of the compact states (4 lists, as
    adamw_int8_data's) and indices for ``shapes`` (pairs of a shape and a state-full
    fraction): lists of host tensors."""
    p, g, m, v, idx = frugal_data(kind, shapes, dtype, index_dtype, seed)
    moments = ([], [], [], [])
    for mi, vi in zip(m, v):
        for lst, t in zip(moments, (*reference.quantize_moment(mi, False),
                                    *reference.quantize_moment(vi, True))):
            lst.append(t)
    return (p, g, *moments, idx)


def sign_sgd_data(numels, dtype, seed):
    """params, grads: lists of host tensors."""
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen).to(dtype) for n in numels]
    return p, [grads_like(n, dtype, gen) for n in numels]


def frugal_data(kind, shapes, dtype, index_dtype, seed):
    """params, grads, exp_avgs, exp_avg_sqs, indices for ``shapes`` (pairs of a
    shape and a state-full fraction): lists of host tensors."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m, v, idx = [], [], [], [], []
    for shape, fraction in shapes:
        p.append(torch.randn(shape, generator=gen).to(dtype))
        g.append(grads_like(shape, dtype, gen))
        idx.append(subset(subset_dim(p[-1], kind), fraction, index_dtype, gen))
        sshape = subset_state_shape(p[-1], kind, idx[-1].numel())
        m.append(0.1 * torch.randn(sshape, generator=gen))
        v.append(0.01 * torch.rand(sshape, generator=gen))
    return p, g, m, v, idx


def assert_equal(name, got, want):
    """Lists of tensors equal bit for bit (after moving ``got`` to the host)."""
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.cpu()
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            first = tuple(bad[0].tolist())
            raise AssertionError(f"{name}[{i}] (shape {tuple(a.shape)}, {a.dtype}): "
                                 f"{len(bad)} elements differ, first at {list(first)}: "
                                 f"got {a[first].item()!r}, want {b[first].item()!r}")


def dqt_data(kind, shapes, bits, dtype, index_dtype, seed):
    """codes, scales, grads, exp_avgs, exp_avg_sqs, indices for ``shapes`` (pairs of a
    weight shape [R, C] and a state-full fraction): random codes over the whole range,
    a scale per row for every other weight; lists of host tensors."""
    gen = torch.Generator().manual_seed(seed)
    top = _quant.qmax(bits)
    q, s, g, m, v, idx = [], [], [], [], [], []
    for i, (shape, fraction) in enumerate(shapes):
        q.append(_quant.pack(torch.randint(-top, top + 1, shape, generator=gen), bits))
        s.append(torch.rand(shape[0] if i % 2 else 1, generator=gen) * 0.02 + 0.01)
        g.append((0.3 * grads_like(shape, torch.float32, gen)).to(dtype))
        idx.append(subset(subset_dim(g[-1], kind), fraction, index_dtype, gen))
        sshape = subset_state_shape(g[-1], kind, idx[-1].numel())
        m.append(0.1 * torch.randn(sshape, generator=gen))
        v.append(0.01 * torch.rand(sshape, generator=gen))
    return q, s, g, m, v, idx


def grad_norm_data(numels, dtype, seed):
    """Gradients (host tensors) with magnitudes over several decades, so that a wrong
    index or a lost element moves the norm."""
    gen = torch.Generator().manual_seed(seed)
    return [(grads_like(n, torch.float32, gen) * torch.exp(torch.randn(n, generator=gen) * 2))
            .to(dtype) for n in numels]


def grad_norm_partials(grads, max_norm):
    """The partial results of grad_norm's kernel from first principles: per chunk of each
    non-empty gradient, in order, its sum of squares or largest magnitude (double)."""
    out = []
    for g in grads:
        flat = g.reshape(-1).double()
        for a in range(0, flat.numel(), GN_CHUNK):
            part = flat[a:a + GN_CHUNK]
            out.append(part.abs().max().item() if max_norm else part.square().sum().item())
    return out
