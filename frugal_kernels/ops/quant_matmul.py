"""``frugal::quant_matmul``: ``a @ W.T + bias`` (or ``a @ W``) with ``W = s * q`` given by its
packed INT-n codes.

The GEMM of ``nn.QuantLinear`` on a GPU: the Triton kernel reads the codes
(``bits / 8`` bytes per weight) and dequantizes tiles of them in registers, so
the float weight never exists in memory. ``transpose_weight=True`` is the
forward (``x @ W.T``), ``False`` the input gradient (``grad_out @ W``).
Backends: ``triton`` (GPU; CPU tensors under ``TRITON_INTERPRET=1``) and
``torch`` (the reference: dequantize, then one fp32 GEMM). On CPU tensors
``auto`` picks torch; QuantLinear's CPU path is its own blocked
dequantize-then-GEMM, which never holds the whole float weight either.

Not an in-place op: the result is a new tensor of ``a``'s dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from frugal_kernels import _quant, reference
from frugal_kernels._layout import PARAM_DTYPES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._spec import Implementations

OP = "frugal::quant_matmul"
_IMPLS = Implementations(OP)  # its backends, declared below each


def _out_shape(a: Tensor, codes: Tensor, cols: int, transpose_weight: bool):
    return (a.shape[0], codes.shape[0] if transpose_weight else cols)


def _check(a: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor], bits: int,
           cols: int, transpose_weight: bool) -> None:
    """The metadata checks (shared with the fake kernel)."""
    _quant.check_bits(bits, OP)
    if isinstance(cols, bool) or not isinstance(cols, int) or cols < 0:
        raise ValueError(f"{OP}: cols must be an int >= 0, got {cols!r}")
    if codes.dtype != torch.uint8 or codes.dim() != 2 or \
            codes.shape[1] != _quant.packed_cols(cols, bits):
        raise ValueError(f"{OP}: codes must be the 2-D torch.uint8 {bits}-bit codes of a weight "
                         f"with {cols} columns ([rows, {_quant.packed_cols(cols, bits)}]), got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    rows = codes.shape[0]
    if scales.dtype != torch.float32 or tuple(scales.shape) not in ((1,), (rows,)):
        raise ValueError(f"{OP}: scales must be float32 of shape (1,) or ({rows},), got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if a.dtype not in PARAM_DTYPES:
        raise TypeError(f"{OP}: a must be torch.float32, torch.bfloat16 or torch.float16, got "
                        f"{a.dtype}")
    inner = cols if transpose_weight else rows
    if a.dim() != 2 or a.shape[1] != inner:
        weight = f"W [{rows}, {cols}]"
        product = f"a @ {weight}.T" if transpose_weight else f"a @ {weight}"
        raise ValueError(f"{OP}: {product} needs a of shape [M, {inner}], got "
                         f"{tuple(a.shape)}")
    if bias is not None:
        features = _out_shape(a, codes, cols, transpose_weight)[1]
        if bias.dtype != a.dtype or tuple(bias.shape) != (features,):
            raise ValueError(f"{OP}: bias must be {a.dtype} of shape ({features},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
    for name, t in (("codes", codes), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but a on {a.device}")


@torch.library.custom_op(OP, mutates_args=())
def _quant_matmul_op(a: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor],
                     bits: int, cols: int, transpose_weight: bool, backend: str) -> Tensor:
    _check(a, codes, scales, bias, bits, cols, transpose_weight)
    impl = _IMPLS[_dispatch.resolve(backend, a.device, OP)]
    return impl(a, codes.contiguous(), scales.contiguous(),
                None if bias is None else bias.contiguous(), bits, cols, transpose_weight)


@_quant_matmul_op.register_fake
def _fake(a, codes, scales, bias, bits, cols, transpose_weight, backend):
    _check(a, codes, scales, bias, bits, cols, transpose_weight)
    return a.new_empty(_out_shape(a, codes, cols, transpose_weight))


@_IMPLS.backend("triton")
def _triton(a, codes, scales, bias, bits, cols, transpose_weight) -> Tensor:
    from frugal_kernels.kernels.triton.quant_matmul import quant_matmul as kernel
    out = a.new_empty(_out_shape(a, codes, cols, transpose_weight))
    if out.numel():
        kernel(a, codes, scales, bias, bits, transpose_weight, out)
    return out


@_IMPLS.backend("torch")
def _torch(a, codes, scales, bias, bits, cols, transpose_weight) -> Tensor:
    return reference.quant_matmul(a, codes, scales, bias, bits=bits, cols=cols,
                                  transpose_weight=transpose_weight)


_IMPLS.complete()


def quant_matmul(a: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor] = None, *,
                 bits: int, cols: int, transpose_weight: bool = True,
                 backend: str = "auto") -> Tensor:
    """``a @ W.T + bias`` (``a @ W`` when ``transpose_weight`` is False), ``W = s * q``
    the ``[R, cols]`` weight of packed codes, without the float ``W`` in memory (triton).

    Args:
        a: ``[M, cols]`` (``[M, R]`` without ``transpose_weight``), float32,
            bfloat16 or float16, any strides.
        codes: torch.uint8 ``[R, ceil(cols * bits / 8)]`` in the format of
            :mod:`frugal_kernels._quant`.
        scales: float32 ``[1]`` (one per tensor) or ``[R]`` (one per row).
        bias: None, or ``[R]`` (``[cols]`` without ``transpose_weight``) of ``a``'s dtype.
        bits: the code width, 2 (ternary), 3, 4 or 8.
        cols: the number of codes in a row of the weight.
        transpose_weight: ``a @ W.T`` (a linear layer's forward) or ``a @ W``
            (its input gradient).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``[M, R]`` (``[M, cols]``) of ``a``'s dtype. ``W`` is rounded to ``a``'s
        dtype (as ``ops.dequantize(..., dtype=a.dtype)``), the products are summed
        and the bias added in fp32, and the sum is rounded once; backends differ
        only in the order of the fp32 sums.
    """
    # Here, not in the registered op: its schema would refuse a non-tensor first,
    # with a message about casting.
    for name, t in (("a", a), ("codes", codes), ("scales", scales), ("bias", bias)):
        if not isinstance(t, Tensor) and not (name == "bias" and t is None):
            raise TypeError(f"{OP}: {name} is a {type(t).__name__}, not a torch.Tensor")
    return _quant_matmul_op(a, codes, scales, bias, bits, cols, bool(transpose_weight),
                            backend)
