"""``QuantWeight``: a quantized weight as a tensor subclass that carries its own codes.

A :class:`QuantWeight` of shape ``[rows, cols]`` is the weight ``W = s * q`` of a
:class:`frugal_kernels.nn.QuantLinear`, stored as it is stored everywhere in the package
(:mod:`frugal_kernels._quant`): the packed INT-n ``codes`` (uint8, ``[rows,
packed_cols]``) and the fp32 ``scale`` (``[1]`` or ``[rows]``), with the width ``bits``
and the ``seed`` of its stochastic rounding. It has no float storage of its own (a
wrapper subclass, as torchao's NF4 weights and low-bit optimizer states are): its
``dtype`` is the dtype of its gradient, which autograd gives it as a plain tensor.

So it is a parameter like any other for the module APIs: ``.to(dtype)`` changes the
gradient's dtype and nothing else (the scales stay fp32, the codes uint8), ``.to(device)``
moves the codes and scales, ``deepcopy`` and pickling keep ``requires_grad``, and a module
registered under several names shares one weight. An op that reads its values
(``w * 2``, ``F.linear(x, w)``, ``w.norm()``) runs on the dequantized weight and returns a
plain tensor; an op that would write them (an in-place update by an optimizer for float
tensors, which the layer would never read) raises a NotImplementedError that says so:
:class:`frugal_kernels.DQT` updates the codes.

Under FSDP2, ``fully_shard`` splits it by rows like any parameter (the row ops below), and
its all-gather goes through :meth:`QuantWeight.fsdp_pre_all_gather` and
:meth:`QuantWeight.fsdp_post_all_gather`: the ranks exchange packed codes (and the row
scales), never float values.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map_only

from frugal_kernels import _quant, ops

__all__ = ["QuantWeight"]

aten = torch.ops.aten


class QuantWeight(Tensor):
    """The packed weight ``s * q`` of ``rows`` x ``cols`` (see the module docstring).

    Args:
        codes: uint8 ``[rows, packed_cols(cols, bits)]``.
        scale: float32 ``[1]`` (one per tensor) or ``[rows]``.
        bits: the code width (one of ``_quant.QUANT_BITS``).
        cols: the weight's columns (the codes' rows are padded to whole bytes).
        seed: of the stochastic rounding of its updates.
        dtype: of its gradient.
        row_scale: one scale per row (the default when ``scale`` has more than one).
    """

    codes: Tensor
    scale: Tensor
    bits: int
    cols: int
    seed: int
    row_scale: bool

    @staticmethod
    def __new__(cls, codes: Tensor, scale: Tensor, bits: int, cols: int, seed: int = 0,
                dtype: torch.dtype = torch.float32, requires_grad: bool = False,
                row_scale: Optional[bool] = None):
        return Tensor._make_wrapper_subclass(cls, (codes.shape[0], cols), dtype=dtype,
                                             device=codes.device, requires_grad=requires_grad)

    def __init__(self, codes: Tensor, scale: Tensor, bits: int, cols: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, requires_grad: bool = False,
                 row_scale: Optional[bool] = None):
        if codes.dtype != torch.uint8 or codes.dim() != 2 or \
                codes.shape[1] != _quant.packed_cols(cols, bits):
            raise ValueError(f"QuantWeight: codes must be uint8 [rows, "
                             f"{_quant.packed_cols(cols, bits)}] for {cols} columns of "
                             f"{bits} bits; got {codes.dtype} {tuple(codes.shape)}")
        row_scale = scale.numel() != 1 if row_scale is None else row_scale
        want = codes.shape[0] if row_scale else 1
        if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() != want:
            raise ValueError(f"QuantWeight: scale must be float32 [{want}]; got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        self.codes, self.scale, self.bits, self.cols, self.seed = codes, scale, bits, cols, seed
        self.row_scale = row_scale

    # ------------------------------------------------------------- reading it

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight ``s * q`` as a new plain tensor."""
        return ops.dequantize(self.codes, self.scale, bits=self.bits, cols=self.cols,
                              dtype=dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantWeight(shape={tuple(self.shape)}, bits={self.bits}, "
                f"scale={'row' if self.row_scale else 'tensor'}, grad dtype={self.dtype}, "
                f"device={self.device})")

    # ---------------------------------------------- as a traceable subclass

    def __tensor_flatten__(self):
        return ["codes", "scale"], (self.bits, self.cols, self.seed, self.dtype,
                                    self.row_scale)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        bits, cols, seed, dtype, row_scale = meta
        return QuantWeight(inner["codes"], inner["scale"], bits, cols, seed, dtype,
                           row_scale=row_scale)

    # --------------------------------------------------- copies and pickling

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = _like(self, copy.deepcopy(self.codes, memo), copy.deepcopy(self.scale, memo),
                    requires_grad=self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.codes, self.scale, self.bits, self.cols, self.seed, self.dtype,
                           self.row_scale, self.requires_grad,
                           bool(getattr(self, "_is_param", False))))

    # ----------------------------------------------------------- dispatch

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, *args, **kwargs)
        if _writes_a_quant_weight(func, args, kwargs):
            # Not a TypeError: Tensor's operators turn that into NotImplemented, whose
            # message names the operand types only.
            raise NotImplementedError(
                f"{func} would write a QuantWeight's values, which are packed INT-n codes "
                "and a scale: train it with frugal_kernels.DQT, which updates the codes (an "
                "optimizer for float tensors would update values the layer never reads); "
                "set its codes from a float weight with QuantLinear.quantize_from")
        # Any other op reads the weight's values: it runs on the dequantized weight, in
        # the weight's dtype (autograd, above this, gives the weight its gradient).
        return func(*tree_map_only(QuantWeight, lambda w: w.dequantize(w.dtype), args),
                    **tree_map_only(QuantWeight, lambda w: w.dequantize(w.dtype), kwargs))

    # ------------------------------------------------------------- FSDP2

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 all-gathers for this rank's rows: its codes (and row scales), the
        per-tensor scale (the same on every rank) riding in the metadata.

        Rows that split evenly over the ranks go as they are stored. Otherwise FSDP2
        asks every input to have its padded block's shape, ``[ceil(rows / ranks),
        cols]``: the codes and row scale of each row are then laid out as bytes in the
        ``cols`` elements of the narrowest integer dtype that holds them (uint8 for
        codes narrower than 8 bits, as the scale's 4 bytes fit in the packing's
        savings)."""
        rows, ranks = int(outer_size[0]), mesh.size()
        padded = -(-rows // ranks)
        even = rows % ranks == 0
        meta = (rows, even, None if self.row_scale else self.scale, self.bits, self.cols,
                self.seed, self.row_scale)
        if even:
            return ((self.codes, self.scale) if self.row_scale else (self.codes,)), meta
        packed = self.codes.shape[1]
        need = packed + (4 if self.row_scale else 0)
        itemsize = next(n for n in (1, 2, 4, 8) if n * self.cols >= need)
        row_bytes = torch.zeros(padded, self.cols * itemsize, dtype=torch.uint8,
                                device=self.device)
        local = self.codes.shape[0]
        row_bytes[:local, :packed] = self.codes
        if self.row_scale:
            row_bytes[:local, packed:need] = self.scale.reshape(-1, 1).view(torch.uint8)
        return (row_bytes.view(_INT_OF_SIZE[itemsize]),), meta

    def fsdp_post_all_gather(self, outputs: Sequence[Tensor], meta: Any, param_dtype,
                             *, out: Optional[Tensor] = None):
        """The whole weight from what :meth:`fsdp_pre_all_gather` sent: views of FSDP2's
        all-gather buffers where the rows split evenly (FSDP2 frees and refills them),
        else codes (and row scales) copied out of the byte rows (handed to FSDP2, which
        frees them after each pass and reallocates them for ``out``)."""
        rows, even, scale, bits, cols, seed, row_scale = meta
        if even:
            codes = outputs[0][:rows]
            scale = outputs[1][:rows] if row_scale else scale
            made: Tuple[Tensor, ...] = ()
        else:
            row_bytes = outputs[0][:rows].view(torch.uint8)
            packed = _quant.packed_cols(cols, bits)
            codes = row_bytes[:, :packed].contiguous()
            if row_scale:
                scale = row_bytes[:, packed:packed + 4].contiguous().view(torch.float32)
                scale = scale.reshape(rows)
                made = (codes, scale)
            else:
                made = (codes,)
        if out is not None:
            if not even:
                # Refilled with the weight's values, as FSDP2 refills its buffers: the
                # tensors that autograd saved in forward are valid again for backward.
                refill = (out.codes, out.scale) if row_scale else (out.codes,)
                with torch.autograd._unsafe_preserve_version_counter(refill):
                    for mine, new in zip(refill, made):
                        mine.copy_(new)
            return None
        weight = QuantWeight(codes, scale, bits, cols, seed, param_dtype, row_scale=row_scale)
        return weight, made


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _writes_a_quant_weight(func, args, kwargs) -> bool:
    """Whether ``func`` writes one of its QuantWeight arguments (its schema marks the
    argument as written: in-place ops, ``out=``)."""
    schema = func._schema
    if not schema.is_mutable:
        return False
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and any(
                isinstance(t, QuantWeight) for t in tree_flatten(value)[0]):
            return True
    return False


def _like(w: QuantWeight, codes: Tensor, scale: Tensor, dtype: Optional[torch.dtype] = None,
          requires_grad: bool = False) -> QuantWeight:
    return QuantWeight(codes, scale, w.bits, w.cols, w.seed, dtype or w.dtype, requires_grad,
                       row_scale=w.row_scale)


def _rebuild(codes, scale, bits, cols, seed, dtype, row_scale, requires_grad, is_param):
    weight = QuantWeight(codes, scale, bits, cols, seed, dtype, requires_grad,
                         row_scale=row_scale)
    if is_param:
        weight._is_param = True
    return weight


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[:t.shape[0]] = t
    return padded


def _rows(w: QuantWeight, start: int, length: int) -> QuantWeight:
    """Rows ``[start, start + length)``: views of the codes (and row scales)."""
    scale = w.scale.narrow(0, start, length) if w.row_scale else w.scale
    return _like(w, w.codes.narrow(0, start, length), scale)


def _check_dim0(w: QuantWeight, dim: int, what: str) -> None:
    if dim % 2 != 0:
        raise TypeError(f"{what} of a QuantWeight along its columns: its codes are packed by "
                        "row, so it splits along dim 0 only")


# -------------------------------------------------------------- the ops it takes

def _alias(func, w, *args, **kwargs):
    return _like(w, w.codes, w.scale)


def _clone(func, w, *args, **kwargs):
    return _like(w, w.codes.clone(), w.scale.clone())


def _to_copy(func, w, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    # The dtype is the gradient's: the codes stay uint8 and the scales fp32.
    device = w.device if device is None else torch.device(device)
    codes = w.codes.to(device, non_blocking=non_blocking, copy=True)
    scale = w.scale.to(device, non_blocking=non_blocking, copy=True)
    return _like(w, codes, scale, dtype)


def _copy(func, dst, src, non_blocking=False):
    if not isinstance(src, QuantWeight):
        raise TypeError("copying float values into a QuantWeight: set its codes from a float "
                        "weight with QuantLinear.quantize_from (round to nearest)")
    if (src.bits, src.cols, src.shape[0], src.scale.shape) != \
            (dst.bits, dst.cols, dst.shape[0], dst.scale.shape):
        raise ValueError(f"copying a QuantWeight of bits={src.bits}, shape {tuple(src.shape)}, "
                         f"scale {tuple(src.scale.shape)} into one of bits={dst.bits}, shape "
                         f"{tuple(dst.shape)}, scale {tuple(dst.scale.shape)}")
    dst.codes.copy_(src.codes, non_blocking)
    dst.scale.copy_(src.scale, non_blocking)
    return dst


def _split(func, w, split_size, dim=0):
    _check_dim0(w, dim, "a split")
    rows, out, start = w.shape[0], [], 0
    sizes = split_size if isinstance(split_size, (list, tuple)) else \
        [min(split_size, rows - s) for s in range(0, rows, split_size)] or [0]
    for size in sizes:
        out.append(_rows(w, start, size))
        start += size
    return out


def _narrow(func, w, dim, start, length):
    _check_dim0(w, dim, "a narrow")
    return _rows(w, start, length)


def _slice(func, w, dim=0, start=None, end=None, step=1):
    _check_dim0(w, dim, "a slice")
    rows = w.shape[0]
    start, end, _ = slice(start, end, step).indices(rows)
    if step != 1:
        raise TypeError("a strided slice of a QuantWeight")
    return _rows(w, start, max(0, end - start))


def _new_zeros(func, w, size, dtype=None, layout=None, device=None, pin_memory=None):
    """A weight of ``size`` rows of zeros (code 0; the scales 1, one per tensor copied):
    FSDP2 pads a rank's block of rows with it."""
    size = tuple(size)
    if len(size) != 2 or size[1] != w.cols:
        raise TypeError(f"new_zeros({list(size)}) of a QuantWeight of {w.cols} columns")
    device = w.device if device is None else torch.device(device)
    zero = _quant.pack(torch.zeros(1, w.cols, dtype=torch.int32), w.bits).to(device)
    codes = zero.expand(size[0], -1).contiguous()
    scale = torch.ones(size[0], dtype=torch.float32, device=device) if w.row_scale \
        else w.scale.to(device, copy=True)
    return _like(w, codes, scale, dtype)


def _same_shape(func, w, size, *args, **kwargs):
    """view / as_strided / reshape to the weight's own shape (FSDP2 takes such views of
    the parameters it shards and gathers); any other shape is refused."""
    # FSDP2 also keeps ``view(-1)`` of a sharded parameter as its "1-D data", which it
    # reads only on the path of parameters without all-gather hooks: the weight itself.
    if tuple(size) not in (tuple(w.shape), (-1, w.cols), (-1,), (w.numel(),)):
        raise TypeError(f"{func} of a QuantWeight of shape {tuple(w.shape)} to {list(size)}: "
                        "its codes are packed by row")
    return _like(w, w.codes, w.scale)


def _zeros_like(func, w, *args, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None, **kwargs):
    """A plain tensor of zeros of the weight's shape: what FSDP2 and autograd ask for as
    a zero gradient."""
    return torch.zeros(w.shape, dtype=dtype or w.dtype, device=device or w.device)


def _empty_like(func, w, *args, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None, **kwargs):
    """A QuantWeight of the same format with uninitialised codes and scales
    (``Module.to_empty``)."""
    device = w.device if device is None else torch.device(device)
    return _like(w, torch.empty_like(w.codes, device=device),
                 torch.empty_like(w.scale, device=device), dtype)


def _is_same_size(func, a, b):
    return tuple(a.shape) == tuple(b.shape)


_HANDLERS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.narrow.default: _narrow,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.view.default: _same_shape,
    aten._unsafe_view.default: _same_shape,
    aten.reshape.default: _same_shape,
    aten.as_strided.default: _same_shape,
    aten.zeros_like.default: _zeros_like,
    aten.empty_like.default: _empty_like,
    aten.is_same_size.default: _is_same_size,
}
