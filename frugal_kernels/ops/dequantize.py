"""``frugal::dequantize``: packed INT-n codes back to the float weight ``W = s * q``.

The read side of DQT's format (:mod:`frugal_kernels._quant`): ``nn.QuantLinear``
dequantizes blocks of rows in its forward and backward passes and runs the
GEMM on each, so the whole float weight never exists at once. The op writes
into a given ``out``: the layer reuses one buffer for all its blocks, since a
fresh allocation costs more in page faults than dequantizing into it (a 4096 x
4096 weight at 4 bits on this 2-core Xeon, one thread: 89 ms into new memory,
18 ms into memory written before).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from frugal_kernels import _quant, reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import DTYPE_CODES, PARAM_DTYPES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._spec import Implementations
from frugal_kernels.ops._common import check_no_overlap

OP = "frugal::dequantize"
_IMPLS = Implementations(OP)  # its backends, declared below each


def _check(out: Tensor, codes: Tensor, scales: Tensor, bits: int, backend: str) -> None:
    """The metadata checks, with the op's signature; also its fake kernel."""
    _quant.check_bits(bits, OP)
    for name, t in (("out", out), ("codes", codes), ("scales", scales)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{OP}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise TypeError(f"{OP}: codes must be a 2-D torch.uint8 tensor, got {codes.dtype} "
                        f"{tuple(codes.shape)}")
    if out.dim() != 2 or out.shape[0] != codes.shape[0] or \
            codes.shape[1] != _quant.packed_cols(out.shape[1], bits):
        raise ValueError(f"{OP}: codes of shape {tuple(codes.shape)} are not the {bits}-bit "
                         f"codes of a weight of the shape of out, {tuple(out.shape)}")
    rows = codes.shape[0]
    if scales.dtype != torch.float32 or tuple(scales.shape) not in ((1,), (rows,)):
        raise ValueError(f"{OP}: scales must be float32 of shape (1,) or ({rows},), got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    for name, t in (("scales", scales), ("out", out)):
        if t.device != codes.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but codes on {codes.device}")
    if out.dtype not in PARAM_DTYPES:
        raise TypeError(f"{OP}: out must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"{OP}: out must be contiguous")


@torch.library.custom_op(OP, mutates_args=("out",))
def _dequantize_op(out: Tensor, codes: Tensor, scales: Tensor, bits: int, backend: str) -> None:
    _check(out, codes, scales, bits, backend)
    check_no_overlap(OP, written={"out": [out]}, read={"codes": [codes], "scales": [scales]})
    if out.numel():
        _IMPLS[_dispatch.resolve(backend, codes.device, OP)](
            codes.contiguous(), scales.contiguous(), bits, out)


_dequantize_op.register_fake(_check)


@_IMPLS.backend("cpu")
def _cpu(codes: Tensor, scales: Tensor, bits: int, out: Tensor) -> None:
    rows, cols = out.shape
    extension().dequantize_cpu(codes.data_ptr(), scales.data_ptr(), scales.numel(), rows, cols,
                               bits, out.data_ptr(), DTYPE_CODES[out.dtype],
                               torch.get_num_threads())


@_IMPLS.backend("torch")
def _torch(codes: Tensor, scales: Tensor, bits: int, out: Tensor) -> None:
    out.copy_(reference.dequantize(codes, scales, bits=bits, cols=out.shape[1], dtype=out.dtype))


@_IMPLS.backend("triton")
def _triton(codes: Tensor, scales: Tensor, bits: int, out: Tensor) -> None:
    from frugal_kernels.kernels.triton.dequantize import dequantize as kernel
    kernel(codes, scales, bits, out)


_IMPLS.complete()


def dequantize(codes: Tensor, scales: Tensor, *, bits: int, cols: int,
               dtype: torch.dtype = torch.float32, out: Optional[Tensor] = None,
               backend: str = "auto") -> Tensor:
    """The weight ``W = s * q`` of packed codes, ``[R, cols]``, written into ``out``
    (a new tensor when None) and returned.

    Args:
        codes: torch.uint8 ``[R, ceil(cols * bits / 8)]`` in the format of
            :mod:`frugal_kernels._quant` (a block of rows of a weight's codes is
            a valid input: rows are packed on their own).
        scales: float32 ``[1]`` (one per tensor) or ``[R]`` (one per row).
        bits: the code width, 2 (ternary), 3, 4 or 8.
        cols: the number of codes in a row.
        dtype: of the result (float32, bfloat16 or float16); the product
            ``s * q`` is computed in fp32 and then rounded to it.
        out: a contiguous ``[R, cols]`` tensor of ``dtype`` to write into.
        backend: ``"auto"``, ``"cpu"``, ``"triton"`` or ``"torch"``.
    """
    if out is None:
        out = codes.new_empty((codes.shape[0], int(cols)), dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (codes.shape[0], int(cols)):
        raise ValueError(f"{OP}: out is {out.dtype} {tuple(out.shape)}, not {dtype} "
                         f"({codes.shape[0]}, {int(cols)})")
    _dequantize_op(out, codes, scales, int(bits), backend)
    return out
