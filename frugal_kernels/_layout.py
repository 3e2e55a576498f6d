"""Codes and shapes every layer shares: the one home of each.

The kernels (C++, CUDA, Triton), the ops, the reference and the optimizers
all speak of the same things: which storage type a parameter has, which rule
moves the state-free coordinates, whether a subset picks rows, columns or flat
coordinates, which side of a matrix a low-rank projection acts on, and the
shapes that follow. They are defined here once. This module sits below
``ops`` and ``kernels`` and imports neither (tests/test_layers.py checks it).

Glossary (docs/glossary.md has the longer one): *density* is the paper's rho,
the fraction of coordinates kept state-full; *update_gap* is T, the steps
between subspace changes; a *state-free rule* is what the other coordinates
get (``sign``, ``sgd``, ``none``); a *subset kind* is what a coordinate subset
picks from a tensor (``rows``, ``columns``, ``flat``: the ``randk`` projection
uses ``flat``); a *side* is where a low-rank projection multiplies.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor

# Parameter storage types and their codes in csrc/include/frugal/common.h (DType).
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# The rules of the state-free coordinates and their codes in
# csrc/include/frugal/update_rules.h (StateFree).
STATE_FREE_RULES = ("sign", "sgd", "none")
STATE_FREE_CODES = {"sign": 0, "sgd": 1, "none": 2}

# What a coordinate subset picks from a tensor, and the codes of
# csrc/include/frugal/frugal_tile.h (SubsetKind): a flat subset is a subset of
# the rows of the tensor seen as an [numel, 1] column.
SUBSET_KINDS = ("rows", "columns", "flat")
SUBSET_KIND_CODES = {"rows": 0, "flat": 0, "columns": 1}

# Which side of a matrix G [m, n] a low-rank projection acts on. RIGHT:
# low = G @ P^T with P [r, n] (orthonormal rows); LEFT: low = P^T @ G with
# P [m, r] (orthonormal columns).
RIGHT, LEFT = 0, 1
SIDES = (RIGHT, LEFT)


# ---------------------------------------------------------------- subsets

def subset_dim(p: Tensor, subset_kind: str) -> int:
    """How many rows, columns or coordinates of ``p`` a subset of ``subset_kind`` picks from."""
    if subset_kind == "rows":
        return p.shape[0]
    if subset_kind == "columns":
        return p.shape[-1]
    return p.numel()


def subset_state_shape(p: Tensor, subset_kind: str, k: int) -> Tuple[int, ...]:
    """Shape of the compact moments of a subset of ``k`` rows, columns or coordinates."""
    if subset_kind == "rows":
        return (k, *p.shape[1:])
    if subset_kind == "columns":
        return (*p.shape[:-1], k)
    return (k,)


def matrix_view(p: Tensor, subset_kind: str) -> Tuple[int, int, int]:
    """(subset kind code, R, C): the [R, C] row-major matrix the kernels walk."""
    n = p.numel()
    if subset_kind == "rows":
        return SUBSET_KIND_CODES["rows"], p.shape[0], n // p.shape[0]
    if subset_kind == "columns":
        return SUBSET_KIND_CODES["columns"], n // p.shape[-1], p.shape[-1]
    return SUBSET_KIND_CODES["flat"], n, 1


# ---------------------------------------------------------------- low rank

def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The [m, n] matrix a tensor of >= 2 dims is projected as: [shape[0], rest]."""
    return shape[0], math.prod(shape[1:])


def lowrank_side(shape: Sequence[int]) -> int:
    """GaLore's rule: project the smaller side (RIGHT when rows >= columns)."""
    rows, cols = matrix_shape(shape)
    return RIGHT if rows >= cols else LEFT


def lowrank_dim(shape: Sequence[int]) -> int:
    """The length of the projected side: the largest rank a projection can have."""
    m, n = matrix_shape(shape)
    return n if lowrank_side(shape) == RIGHT else m


def lowrank_state_shape(shape: Sequence[int], rank: int) -> Tuple[int, int]:
    """Shape of the moments (and of the projected gradient) at ``rank``."""
    m, n = matrix_shape(shape)
    return (m, rank) if lowrank_side(shape) == RIGHT else (rank, n)


def projection_shapes(shape: Sequence[int], rank: int, side: int
                      ) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(projection shape, low-rank tensor shape) of a tensor of ``shape`` at ``rank``."""
    m, n = matrix_shape(shape)
    if side == RIGHT:
        return (rank, n), (m, rank)
    return (m, rank), (rank, n)


def projection_rank(projection: Tensor, side: int) -> int:
    return projection.shape[0] if side == RIGHT else projection.shape[1]


def project(grad: Tensor, projection: Tensor, side: int) -> Tensor:
    """The projected gradient ``P^T g`` in fp32 (``g @ P^T`` or ``P^T @ g`` by side)."""
    # [m, rest] spelled out: reshape(m, -1) is ambiguous for a tensor of 0 rows (an
    # FSDP2 rank's block can have none).
    g2 = grad.reshape(matrix_shape(grad.shape)).float()
    return g2 @ projection.t() if side == RIGHT else projection.t() @ g2


def back_project(low: Tensor, projection: Tensor, side: int) -> Tensor:
    """A low-rank tensor back in the [m, n] space: ``low @ P`` or ``P @ low`` by side.

    ``low`` may carry leading batch dims (both back-projections in one GEMM)."""
    return torch.matmul(low, projection) if side == RIGHT else torch.matmul(projection, low)


# ---------------------------------------------------------------- 8-bit moments

# How the optimizers may store AdamW's moments (their ``state_dtype`` option).
STATE_DTYPES = ("fp32", "int8")

# Elements of one block of 8-bit moments: one fp32 scale per block, so 1/64 of a byte
# per element and moment on top of the code. torchao's 8-bit AdamW uses 256 as well.
MOMENT_BLOCK = 256

# The dtypes of the codes: the first moment signed, the second moment's (a root of a
# non-negative value) unsigned.
MOMENT_CODE_DTYPES = (torch.int8, torch.uint8)


class MomentBlocks:
    """The blocks of the 8-bit moments of a tensor of ``shape``.

    The tensor is seen as rows: ``[shape[0], rest]`` for two dims or more, one row for a
    1-D or 0-dim tensor. Each row is cut into blocks of :data:`MOMENT_BLOCK` consecutive
    elements (its last block may be shorter); a block never straddles two rows, so a
    block of rows of the tensor (a rank's rows under FSDP2's row sharding) holds exactly
    the blocks of those rows of the whole, and its state, hence its updates, is the same
    on any number of ranks. The scales of a tensor are fp32 of shape ``[rows, blocks per
    row]``, row-major like the codes. The codes have the tensor's shape
    (``frugal_kernels.reference.quantize_moment`` has the math)."""

    __slots__ = ("rows", "cols")

    def __init__(self, shape: Sequence[int]):
        shape = tuple(shape)
        self.rows = shape[0] if len(shape) >= 2 else 1
        self.cols = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)

    @property
    def per_row(self) -> int:
        return -(-self.cols // MOMENT_BLOCK)

    @property
    def scale_shape(self) -> Tuple[int, int]:
        return self.rows, self.per_row


# ---------------------------------------------------------------- GradScaler

def inverse_grad_scale(grad_scale: Tensor) -> Tensor:
    """GradScaler's inverse scale, as its ``unscale_`` computes it: in double, rounded to
    fp32 once (0-dim, on ``grad_scale``'s device: no host sync)."""
    return grad_scale.detach().reshape(()).double().reciprocal().float()


def on_device(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """``t`` (a GradScaler tensor, a skip flag, a step count) on ``device``, where the op
    that reads it runs: a copy only when it lives elsewhere; None stays None."""
    return t if t is None or t.device == device else t.to(device)


# ---------------------------------------------------------------- memory

def memory_span(t: Tensor) -> Optional[Tuple[int, int]]:
    """[first byte, one past the last byte) of the memory ``t`` touches; None if empty."""
    numel = t.numel()
    if numel == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + numel * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def first_overlap(tensors: Iterable[Tuple[Tensor, bool, Any]]) -> Optional[Tuple[Any, Any]]:
    """Labels ``(later, earlier)`` of two of ``(tensor, written, label)`` whose memory
    overlaps, at least one of them written; None if there are none. One sweep over the
    spans sorted by start (stable: of two starting together, the later listed is named
    first). A label is whatever names the tensor to the caller (formatted only for the
    message of a clash)."""
    spans = []
    for t, written, name in tensors:
        span = memory_span(t)
        if span is not None:
            spans.append((span, written, name))
    spans.sort(key=lambda s: s[0][0])
    any_end, any_name, written_end, written_name = -1, "", -1, ""
    for (start, end), written, name in spans:
        if written and start < any_end:
            return name, any_name
        if not written and start < written_end:
            return name, written_name
        if end > any_end:
            any_end, any_name = end, name
        if written and end > written_end:
            written_end, written_name = end, name
    return None
