"""What the Triton kernels share: the launch table, the scalars, per-tile helpers.

Every elementwise kernel updates a whole list of tensors in one launch (the
GEMM kernel of ``lowrank_step`` launches once per tensor and only uses the
tail). The host packs one int64 table per call (``launch_table``)::

    [0, n]          first block of each tensor, then the total: block starts
    [n + 1, ...)    one record per tensor: addresses and sizes (fields per op)
    then            the per-call tail: addresses of lr / step and fp64 bit
                    patterns of hyper-parameters, when the kernel derives its
                    scalars itself (see below)

Program ``pid`` finds its tensor by a binary search over the block starts
(``find_tile``) and its tile as ``pid - start``. The table thus grows with the
number of tensors, not of blocks: LLaMA-130M (model.py preset "130m") has 111
parameter tensors but 32,761 blocks of 4096, and the table is copied to the
device at every call.

Scalars: when ``lr`` and ``step`` live on the host, the derived scalars of
csrc/include/frugal/update_rules.h (``adamw_scalars``, ``sign_scalars``) are
computed here in double precision, exactly as there, and passed as fp32 kernel
arguments (Triton rounds a Python float to fp32 to nearest, as the C++ cast
does). When either lives on the device, reading it on the host would wait for
the device; the kernel then loads both (as fp64 copies) and derives the same
scalars in fp64 itself, with ``beta ** step`` computed as
``exp(step * log(beta))`` (libdevice has no pow for the interpreter to run;
the two differ by ~1e-15 relative, far below the fp32 rounding of the result).

The kernels use Triton builtins and functions of this package only, not the
helpers that triton.language itself writes as @triton.jit functions
(``tl.zeros``, ``tl.cumsum``, ...): whether those are compiled or interpreted
is decided when triton is first imported, which may be before
TRITON_INTERPRET is set (torch.compile imports triton), and an interpreted
kernel cannot call a compiled function. Our own functions follow the
variable when their module is imported, which the tests control.
"""

from __future__ import annotations

import math
import os
import struct
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from frugal_kernels._layout import inverse_grad_scale

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TL_INDEX_DTYPES = {torch.int32: tl.int32, torch.int64: tl.int64}

# A pointer on a 16-byte boundary lets Triton load 16 bytes per instruction;
# torch's allocations are, but a tensor carved out of a flat buffer may not be.
VECTOR_ALIGNMENT = 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(device: torch.device) -> None:
    """The interpreter dereferences the table's raw addresses on the host."""
    if interpreting() and device.type != "cpu":
        raise ValueError("under TRITON_INTERPRET=1 the triton backend of frugal_kernels runs on "
                         f"CPU tensors only, got tensors on {device}")


def aligned(tensors: Sequence[Tensor]) -> bool:
    return all(t.data_ptr() % VECTOR_ALIGNMENT == 0 for t in tensors)


def f64_bits(x: float) -> int:
    """The bits of a double as a signed int64: how a table carries an fp64 value."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def log_beta(beta: float) -> float:
    """``log(beta)``, with ``beta ** step = exp(step * log(beta))`` also right for beta = 0."""
    return math.log(beta) if beta > 0.0 else -math.inf


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: float) -> Tuple[float, ...]:
    """update_rules.h ``adamw_scalars`` in double precision: (decay, 1 - beta1, beta2,
    1 - beta2, step_size, bc2_sqrt, eps), each rounded to fp32 once, at the launch."""
    return (1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2,
            lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), eps)


def sign_scalars(lr: float, weight_decay: float, scale: float) -> Tuple[float, float]:
    """update_rules.h ``sign_scalars``: (decay, step) = (1 - lr * wd, lr * scale)."""
    return 1.0 - lr * weight_decay, lr * scale


def scalars_on_device(*scalars: Tensor) -> bool:
    return any(s.device.type != "cpu" for s in scalars)


def start(params: Sequence[Tensor], scalars: Sequence[Tensor],
          scalars_in_kernel: Optional[bool]) -> Tuple[List[int], Optional[torch.device], bool]:
    """What every op wrapper begins with: the non-empty tensors' positions (an
    empty tensor owns no block), their device, and whether the kernel derives
    its scalars itself (by default: when any of ``scalars`` lives on the device)."""
    items = [i for i, p in enumerate(params) if p.numel() > 0]
    if not items:
        return items, None, False
    device = params[0].device
    check_device(device)
    if scalars_in_kernel is None:
        scalars_in_kernel = scalars_on_device(*scalars)
    return items, device, bool(scalars_in_kernel)


def device_scalars(scalars: Sequence[Tensor], device: torch.device) -> List[Tensor]:
    """fp64 copies of ``lr`` / ``step`` on ``device`` for the kernel to read: no host sync.

    The caller keeps them alive until the launch is queued; the caching
    allocator orders their reuse after the kernel on the same stream.
    """
    return [s.detach().reshape(()).to(device=device, dtype=torch.float64) for s in scalars]


def adamw_launch(lr: Tensor, step: Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float, device: torch.device, scalars_in_kernel: bool,
                 state_free_scale: Optional[float] = None
                 ) -> Tuple[Tuple[float, ...], List[int], List[Tensor]]:
    """AdamW's scalars for one launch, as the AdamW-family kernels take them: ``(scalars,
    tail, alive)``. On the host, ``scalars`` are :func:`adamw_scalars` (and, with a
    ``state_free_scale``, the state-free step ``lr * scale`` after them) and the tail is
    empty. In the kernel, the table's tail points at fp64 copies of ``lr`` and ``step``
    (``alive``: keep them until the launch is queued) and carries ``weight_decay``,
    ``log(beta1)``, ``log(beta2)`` (and the state-free scale) as fp64 bits; the scalars
    the kernel derives (decay, step size, bc2_sqrt, the state-free step) are zeros."""
    if not scalars_in_kernel:
        scalars = adamw_scalars(float(lr), beta1, beta2, eps, weight_decay, float(step))
        if state_free_scale is not None:
            scalars += (sign_scalars(float(lr), weight_decay, state_free_scale)[1],)
        return scalars, [], []
    alive = device_scalars((lr, step), device)
    tail = [s.data_ptr() for s in alive] + [
        f64_bits(weight_decay), f64_bits(log_beta(beta1)), f64_bits(log_beta(beta2))]
    scalars = (0.0, 1.0 - beta1, beta2, 1.0 - beta2, 0.0, 0.0, eps)
    if state_free_scale is not None:
        tail.append(f64_bits(state_free_scale))
        scalars += (0.0,)
    return scalars, tail, alive


def amp_scalars(grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                device: Optional[torch.device]) -> Tuple[Optional[Tensor], bool]:
    """GradScaler's tensors as a kernel reads them: an fp32 pair (inverse scale,
    found_inf) on ``device``, derived there without a host sync, and True; or
    (None, False) without a GradScaler. The inverse is GradScaler's: computed in
    double and rounded to fp32 once."""
    if grad_scale is None and found_inf is None:
        return None, False
    if grad_scale is None:
        inv = torch.ones((), device=device)
    else:
        inv = inverse_grad_scale(grad_scale.to(device))
    if found_inf is None:
        found = torch.zeros((), device=device)
    else:
        found = found_inf.detach().reshape(()).to(device, torch.float32)
    return torch.stack([inv, found]), True


def launch_table(device: torch.device, numels: Sequence[int], records: Sequence[Sequence[int]],
                 block: int, tail: Sequence[int] = ()) -> Tuple[Tensor, int]:
    """The packed int64 table of one launch (layout in the module docstring) and its grid.

    Every tensor must be non-empty: each owns at least one block, which keeps
    ``find_tile``'s search free of empty ranges.
    """
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + triton.cdiv(n, block))
    values = starts + [field for record in records for field in record] + list(tail)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # A captured copy reads the host buffer again at every replay, after
            # the allocator has handed it to someone else.
            raise RuntimeError(
                "frugal_kernels: this Triton launch cannot be captured in a CUDA graph (its "
                "launch table is copied from host memory at each call, which a replay would "
                "read after it was reused); the cuda backend's launches can be (adamw_, "
                "sign_sgd_, frugal_step_, dqt_update_: backend='cuda' or 'auto'), or step "
                "this one eagerly (sgd_, which a swapped SGD calls, has no cuda backend)")
        # Pinned memory makes the copy asynchronous; torch's host allocator
        # keeps the buffer until the copy is done.
        host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
        return host.to(device, non_blocking=True), starts[-1]
    return torch.tensor(values, dtype=torch.int64, device=device), starts[-1]


@triton.jit
def find_tile(table, n_tensors):
    """(tensor, tile) of this program: the last tensor whose first block is <= pid."""
    pid = tl.program_id(0).to(tl.int64)
    lo = tl.full((), 0, tl.int64)
    hi = n_tensors.to(tl.int64)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        right = tl.load(table + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo, pid - tl.load(table + lo)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of this program of a one-dimensional grid over the
    [M, N] output (CUDA caps the second grid dimension at 65,535), the tiles in groups
    of GROUP_M tile rows so that programs running together share their input tiles
    in L2 (the usual Triton matmul order)."""
    pid = tl.program_id(0)
    tiles_m = (M + (BLOCK_M - 1)) // BLOCK_M  # not tl.cdiv, itself a @triton.jit helper
    tiles_n = (N + (BLOCK_N - 1)) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def lower_bound(idx_ptr, lo, hi, key):
    """First j in [lo, hi) with idx[j] >= key (hi if none), as frugal_tile.h ``lower_bound``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        below = tl.load(idx_ptr + mid).to(tl.int64) < key
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def amp_in_kernel(amp, count, AMP: tl.constexpr):
    """(inverse grad scale, positions to update) of a tile: no positions when a
    GradScaler found an inf, decided on the device."""
    if AMP:
        inv = tl.load(amp)
        count = tl.where(tl.load(amp + 1) != 0.0, 0, count)
    else:
        inv = 1.0
    return inv, count


@triton.jit
def field_ptr(record, field, DTYPE: tl.constexpr):
    """A table entry that holds an address, as a typed pointer."""
    return tl.load(record + field).to(tl.pointer_type(DTYPE))


@triton.jit
def tail_f64(tail, i):
    return tl.load(tail + i).to(tl.float64, bitcast=True)


@triton.jit
def tail_scalar(tail, i):
    """The fp64 device scalar whose address is entry ``i`` of the tail."""
    return tl.load(tl.load(tail + i).to(tl.pointer_type(tl.float64)))


@triton.jit
def adamw_scalars_in_kernel(lr, step, weight_decay, log_beta1, log_beta2):
    """The lr- and step-dependent scalars of ``adamw_scalars``, in fp64, rounded to fp32
    once: (decay, step_size, bc2_sqrt)."""
    decay = (1.0 - lr * weight_decay).to(tl.float32)
    step_size = (lr / (1.0 - tl.exp(step * log_beta1))).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2)).to(tl.float32)
    return decay, step_size, bc2_sqrt


@triton.jit
def from_param(x):
    """A value of the parameter dtype as fp32, exactly.

    bf16 is widened by hand (a 16-bit shift, which is all the conversion is):
    the interpreter's cast turns bf16 subnormals into zeros.
    """
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def load_tile(ptr, lane, count, MASKED: tl.constexpr):
    """Elements ``lane < count`` of a tile as fp32. Full tiles load unmasked, because
    a mask against a size read from memory stops Triton from vectorising."""
    if MASKED:
        x = tl.load(ptr + lane, mask=lane < count, other=0.0)
    else:
        x = tl.load(ptr + lane)
    return from_param(x)


@triton.jit
def to_param(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest even into the parameter dtype.

    bf16 is rounded by hand: the interpreter truncates an fp32 -> bf16 cast, so
    this is what gives the bits of torch and of the C++ backend (common.h
    ``from_float<bf16>``, NaN as 0x7FC0) on every backend; it costs a few
    integer operations in a kernel bound by memory.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def store_tile(ptr, lane, count, x, MASKED: tl.constexpr):
    """Store fp32 ``x`` into elements ``lane < count`` of a tile of ``ptr``'s dtype."""
    y = to_param(x, ptr.dtype.element_ty)
    if MASKED:
        tl.store(ptr + lane, y, mask=lane < count)
    else:
        tl.store(ptr + lane, y)
