"""``QuantLinear``: a linear layer whose weight exists only as packed INT-n codes and a scale.

The weight is ``W = s * q`` in the format of :mod:`frugal_kernels._quant`: the
codes ``q`` live in the uint8 buffer ``codes`` (``bits / 8`` bytes per weight),
the fp32 scales in ``scale`` (one per tensor or per output row). No float copy
of ``W`` is kept anywhere: on a GPU the forward pass and the input gradient run
the fused dequantize-matmul (:func:`frugal_kernels.ops.quant_matmul`, Triton),
which reads the codes inside the GEMM; on the CPU they dequantize a block of rows
at a time (:func:`frugal_kernels.ops.dequantize`) and run the GEMM on it; and
:class:`frugal_kernels.DQT` updates the codes in place with a fused
stochastic-rounding step.

The module still has a ``weight`` parameter, a :class:`QuantWeight`: a
placeholder of one element seen through a stride-0 view of the weight's shape.
It is what autograd gives the ``[out, in]`` weight gradient to and what an
optimizer receives from ``model.parameters()``, so a training loop
(``zero_grad``, gradient clipping, LR schedulers, ``param_groups``) works
unchanged; its storage is a single value and it is not part of the state dict.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from frugal_kernels import _quant, ops

__all__ = ["QuantLinear", "QuantWeight"]

_SCALES = ("tensor", "row")
# Floats of the dequantized block of rows each GEMM sees: 4 MiB in fp32, in L2
# beside the inputs, and large enough that the GEMM runs at its full speed.
_BLOCK_VALUES = 1 << 20
_FORMAT = 1  # of the module's extra state


class QuantWeight(nn.Parameter):
    """The gradient carrier of a :class:`QuantLinear`'s weight (see the module docstring).

    Its values are not the weight: read :meth:`QuantLinear.dequantize` for that.
    ``codes``, ``scale``, ``bits`` and ``seed`` are those of its module."""

    def __new__(cls, data: Tensor, module: "QuantLinear"):
        weight = super().__new__(cls, data, requires_grad=True)
        # A strong reference (a cycle the garbage collector breaks): an optimizer
        # holding the weight keeps the layer whose codes it updates.
        weight.module = module
        return weight

    @property
    def codes(self) -> Tensor:
        return self.module.codes

    @property
    def scale(self) -> Tensor:
        return self.module.scale

    @property
    def bits(self) -> int:
        return self.module.bits

    @property
    def seed(self) -> int:
        return self.module.seed

    @property
    def shard(self):
        """The module's :class:`frugal_kernels.nn.sharded.RowShard` (None unless
        :func:`frugal_kernels.nn.shard_quantized_` split its rows over ranks)."""
        return self.module.shard

    @property
    def index_offset(self) -> int:
        """The global index of the first element of the module's codes: 0, unless
        :func:`frugal_kernels.nn.shard_quantized_` gave the module a block of rows
        (the rounding keys each element by its index in the whole weight)."""
        return self.module.first_row * self.module.in_features

    def __deepcopy__(self, memo):
        raise TypeError("a QuantWeight is copied with its QuantLinear (copy.deepcopy(module))")

    def __reduce_ex__(self, protocol):
        raise TypeError("a QuantWeight is not saved on its own: save its QuantLinear's "
                        "state_dict() (the codes and scales)")

    def __repr__(self) -> str:
        return (f"QuantWeight(shape={tuple(self.shape)}, bits={self.bits}, "
                f"grad dtype={self.dtype})")


def _placeholder(rows: int, cols: int, dtype: torch.dtype, device) -> Tensor:
    return torch.zeros(1, dtype=dtype, device=device).expand(rows, cols)


def _fused_backend(device: torch.device) -> Optional[str]:
    """The backend of ``ops.quant_matmul`` for inputs on ``device`` (triton on a GPU),
    or None for the blocked dequantize-then-GEMM (the CPU, which has no fused kernel:
    its blocks go through the BLAS GEMM; also a GPU whose ``auto`` is not triton,
    as under ``FRUGAL_BACKEND=torch`` or without triton installed)."""
    return ops.kernel_backend("frugal::quant_matmul", device)


def linear_forward(x: Tensor, codes: Tensor, scale: Tensor, bias: Optional[Tensor],
                   bits: int) -> Tuple[Tensor, Tensor]:
    """``x @ W.T + b``, by the fused dequantize-matmul where there is one
    (:func:`_fused_backend`), else with ``W`` dequantized a block of rows at a time;
    returns it and ``x`` as a 2-D view. The blocked output is made in its final shape,
    not reshaped from 2-D: a view returned from a module makes FSDP2 warn that an
    in-place op on it would skip its backward hook."""
    rows, cols = codes.shape[0], x.shape[-1]
    x2 = x.reshape(-1, cols)
    backend = _fused_backend(x.device)
    if backend is not None:
        out = ops.quant_matmul(x2, codes, scale, bias, bits=bits, cols=cols, backend=backend)
        return out.reshape(*x.shape[:-1], rows), x2
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, rows)
    for r0, r1, w in _blocks(codes, scale, bits, cols, x.dtype):
        # Into a fresh block then copied: a column block of `out` as the GEMM's
        # own output took 1.4x as long (BLAS went through a slower path).
        out2[:, r0:r1] = torch.mm(x2, w.t())
    if bias is not None:
        out += bias
    return out, x2


def grad_input(g2: Tensor, x2: Tensor, codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    """``g2 @ W`` (the input's gradient, 2-D): fused where there is a kernel, else a
    block of rows of ``W`` at a time."""
    backend = _fused_backend(x2.device)
    if backend is not None:
        return ops.quant_matmul(g2, codes, scale, bits=bits, cols=x2.shape[1],
                                transpose_weight=False, backend=backend)
    grad_x = torch.zeros_like(x2, memory_format=torch.contiguous_format)
    for r0, r1, w in _blocks(codes, scale, bits, x2.shape[1], x2.dtype):
        grad_x.addmm_(g2[:, r0:r1], w)
    return grad_x


def grad_weight(g2: Tensor, x2: Tensor, dtype: torch.dtype) -> Tensor:
    """``g2.T @ x2`` (the weight's gradient ``[rows, cols]``) in ``dtype``."""
    if dtype == x2.dtype:
        return g2.t().mm(x2)
    # A gradient of another dtype (bf16 for fp32 inputs) is cast a block of rows at a
    # time, in cache: casting the whole product afterwards was one more pass over the
    # weight's size (at 4096 x 4096, batch 4, the step took 1.64x nn.Linear + fused
    # AdamW's time with it, against 1.31x in fp32).
    rows = g2.shape[1]
    out = torch.empty(rows, x2.shape[1], dtype=dtype, device=x2.device)
    step = _rows_per_block(rows, x2.shape[1])
    for r0 in range(0, rows, step):
        out[r0:r0 + step] = g2[:, r0:r0 + step].t().mm(x2)
    return out


class _QuantLinearFunction(torch.autograd.Function):
    """``x @ W.T + b`` with ``W`` read from its codes: on a GPU by the fused
    dequantize-matmul (``ops.quant_matmul``, forward and input gradient), elsewhere
    dequantized a block of rows at a time; the gradient of the placeholder
    ``weight`` is the weight's, in the placeholder's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, codes: Tensor, scale: Tensor,
                bias: Optional[Tensor], bits: int) -> Tensor:
        out, x2 = linear_forward(x, codes, scale, bias, bits)
        ctx.save_for_backward(x2, codes, scale)
        ctx.bits, ctx.has_bias, ctx.shape = bits, bias is not None, x.shape
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, codes, scale = ctx.saved_tensors
        g2 = grad_out.reshape(-1, codes.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_input(g2, x2, codes, scale, ctx.bits).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = grad_weight(g2, x2, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, None, None, grad_b, None


# One dequantization buffer per (device, dtype), reused by every layer's blocks:
# the blocks are used one after the other, and memory written before costs no
# page faults (see frugal_kernels.ops.dequantize).
_WORKSPACES: Dict[Tuple[torch.device, torch.dtype], Tensor] = {}


def _workspace(device: torch.device, dtype: torch.dtype, numel: int) -> Tensor:
    buffer = _WORKSPACES.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer


def _rows_per_block(rows: int, cols: int) -> int:
    """Rows of a block of about _BLOCK_VALUES values (at least one, at most all)."""
    return max(1, min(rows, _BLOCK_VALUES // max(cols, 1)))


def _blocks(codes: Tensor, scale: Tensor, bits: int, cols: int, dtype: torch.dtype):
    """(first row, end row, dequantized rows) over the weight, a cache-sized block at a
    time; each block is valid until the next is drawn."""
    rows = codes.shape[0]
    step = _rows_per_block(rows, cols)
    buffer = _workspace(codes.device, dtype, step * cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        s = scale if scale.numel() == 1 else scale[r0:r1]
        out = buffer[: (r1 - r0) * cols].view(r1 - r0, cols)
        yield r0, r1, ops.dequantize(codes[r0:r1], s, bits=bits, cols=cols, dtype=dtype,
                                     out=out)


class QuantLinear(nn.Module):
    r"""``y = x W^T + b`` with ``W`` stored as packed INT-n codes and fp32 scales.

    Args:
        in_features, out_features, bias: as :class:`torch.nn.Linear`.
        bits: the code width: 2 (ternary, codes -1..1 in 2-bit fields), 3, 4 or
            8; the codes are symmetric, ``-qmax .. qmax`` with
            ``qmax = 2**(bits-1) - 1``. Storage: ``ceil(in * bits / 8)`` bytes
            per row, plus 4 bytes per scale.
        scale: ``"tensor"`` (one scale) or ``"row"`` (one per output row).
        scale_init: how the scale is set from a float weight (at initialisation,
            :meth:`quantize_from`, :meth:`from_linear`): ``"absmean"``, DQT's rule
            ``s = mean(|W|) / qmax`` over the tensor or the row, which clips the
            weights above ``mean(|W|)`` (about 40% of a Gaussian or uniform
            weight); ``"absmax"``, ``s = max(|W|) / qmax``, which clips nothing.
            Then ``q = clamp(round(W / s), -qmax, qmax)``. The scale stays fixed
            in training. On the demo model absmax trains much better (4-bit:
            AdamW's loss, against +8% with absmean; docs/demo.md).
        device: where the codes, scales and bias live.
        dtype: of the bias and of the weight gradient (float32, bfloat16 or
            float16). A bf16 gradient halves its memory (2 bytes per weight)
            and is what :class:`frugal_kernels.DQT` reads in its step.
        seed: of the stochastic rounding of this layer's updates (with the
            optimizer's step count it fixes every rounding; give each layer
            its own, as :func:`frugal_kernels.quantize_` does).

    Inputs may be float32, bfloat16 or float16; the weight is dequantized to
    the input's dtype. ``state_dict()`` holds ``codes`` (uint8), ``scale``
    (float32), ``bias`` and an extra state with the format, ``bits`` and
    ``seed``; it loads back bit-exactly.
    """

    # Set by frugal_kernels.nn.shard_quantized_, which keeps a block of the rows.
    shard = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bits: int = 4,
                 scale: str = "tensor", device=None, dtype: Optional[torch.dtype] = None,
                 seed: int = 0, scale_init: str = "absmean"):
        super().__init__()
        _quant.check_bits(bits, "QuantLinear")
        if scale not in _SCALES:
            raise ValueError(f"QuantLinear: scale must be 'tensor' or 'row', got {scale!r}")
        _quant.check_scale_init(scale_init, "QuantLinear")
        # No empty layers: an empty weight has no scale to size, nor a GEMM to run.
        for name, value, least in (("in_features", in_features, 1),
                                   ("out_features", out_features, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"QuantLinear: {name} must be an int >= {least}, "
                                 f"got {value!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"QuantLinear: dtype must be torch.float32, torch.bfloat16 or "
                            f"torch.float16, got {dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.scale_mode, self.seed = bits, scale, seed % (1 << 32)
        self.scale_init = scale_init
        # The global row of the first row of `codes` (shard_quantized_ keeps a block).
        self.first_row = 0
        self.register_buffer("codes", torch.zeros(
            _quant.packed_shape((out_features, in_features), bits), dtype=torch.uint8,
            device=device))
        self.register_buffer("scale", torch.ones(1 if scale == "tensor" else out_features,
                                                 dtype=torch.float32, device=device))
        self.weight = QuantWeight(_placeholder(out_features, in_features, dtype, device), self)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) \
            if bias else None
        self.reset_parameters()

    # ---------------------------------------------------------------- weights

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation, quantized (see :meth:`quantize_from`)."""
        w = torch.empty(self.out_features, self.in_features, device=self.codes.device)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self.quantize_from(w)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    @torch.no_grad()
    def quantize_from(self, weight: Tensor) -> None:
        """Set the codes and scales from a float weight by the layer's
        ``scale_init`` rule (per tensor or row), rounding to nearest."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"QuantLinear.quantize_from: a weight of shape "
                             f"{tuple(weight.shape)} for a [{self.out_features}, "
                             f"{self.in_features}] layer")
        w = weight.detach().to(device=self.codes.device, dtype=torch.float32)
        qmax = _quant.qmax(self.bits)
        groups = w.abs().reshape(1, -1) if self.scale_mode == "tensor" else w.abs()
        if self.scale_init == "absmean":
            size = groups.mean(dim=1)
        else:
            size = groups.amax(dim=1)
        scale = (size / qmax).clamp_(min=1e-8)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("QuantLinear.quantize_from: the weight has non-finite values")
        q = torch.round(w / scale.reshape(-1, 1)).clamp_(-qmax, qmax).to(torch.int32)
        self.scale.copy_(scale)
        self.codes.copy_(_quant.pack(q, self.bits))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight ``s * q`` as a new float tensor (for inspection and export:
        the layer itself never holds it)."""
        return ops.dequantize(self.codes, self.scale, bits=self.bits, cols=self.in_features,
                              dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, scale: str = "tensor",
                    dtype: Optional[torch.dtype] = None, seed: int = 0,
                    scale_init: str = "absmean") -> "QuantLinear":
        """A QuantLinear with ``linear``'s quantized weight and its bias (copied)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        if dtype is None:
            dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) \
                else torch.float32
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  bits=bits, scale=scale, device=weight.device, dtype=dtype, seed=seed,
                  scale_init=scale_init)
        new.quantize_from(weight)
        if linear.bias is not None:
            with torch.no_grad():
                new.bias.copy_(linear.bias)
        return new

    # ---------------------------------------------------------------- forward

    def forward(self, x: Tensor) -> Tensor:
        return _QuantLinearFunction.apply(x, self.weight, self.codes, self.scale,
                                          self._bias_for(x), self.bits)

    def _bias_for(self, x: Tensor) -> Optional[Tensor]:
        """The bias in ``x``'s dtype, once ``x`` is checked to fit the layer."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input of shape {tuple(x.shape)} for "
                             f"in_features={self.in_features}")
        bias = self.bias
        return bias.to(x.dtype) if bias is not None and bias.dtype != x.dtype else bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits={self.bits}, scale={self.scale_mode!r}, "
                f"scale_init={self.scale_init!r}")

    # ------------------------------------------- the placeholder in module APIs

    def _with_weight(self, stand_in, fn):
        """Run ``fn`` with ``stand_in`` in the weight's place in ``_parameters``
        (same key, so the parameters keep their order)."""
        weight = self._parameters["weight"]
        self._parameters["weight"] = stand_in
        try:
            return fn()
        finally:
            self._parameters["weight"] = weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The placeholder's value is not the weight: the codes and scales are.
        self._with_weight(None, lambda: super(QuantLinear, self)._save_to_state_dict(
            destination, prefix, keep_vars))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        codes = state_dict.get(prefix + "codes")
        if codes is not None and codes.dtype != torch.uint8:
            error_msgs.append(f"{prefix}codes: packed codes are torch.uint8, the checkpoint's "
                              f"are {codes.dtype}")
            return
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict) and (extra.get("bits"), extra.get("scale")) != \
                (self.bits, self.scale_mode):
            # Checked before anything loads: torch would copy the bias and report
            # the codes' shape, or raise from set_extra_state half way.
            error_msgs.append(f"{prefix}: the checkpoint's layer has bits={extra.get('bits')}, "
                              f"scale={extra.get('scale')!r}; this one bits={self.bits}, "
                              f"scale={self.scale_mode!r}")
            return
        if prefix + "weight" in state_dict:
            error_msgs.append(f"{prefix}weight: the checkpoint holds a float weight (an "
                              "nn.Linear's?); build this layer with QuantLinear.from_linear")
            return
        self._with_weight(None, lambda: super(QuantLinear, self)._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs))

    def get_extra_state(self) -> dict:
        return {"format": _FORMAT, "bits": self.bits, "seed": self.seed,
                "scale": self.scale_mode}

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"QuantLinear: an extra state of an unknown format: {state!r}")
        if state.get("bits") != self.bits or state.get("scale") != self.scale_mode:
            raise ValueError(f"QuantLinear: the checkpoint's layer has bits={state.get('bits')}"
                             f", scale={state.get('scale')!r}; this one bits={self.bits}, "
                             f"scale={self.scale_mode!r}")
        self.seed = int(state["seed"])

    def _apply(self, fn, recurse=True):
        # Module._apply would materialise the stride-0 placeholder (a full float
        # weight) and turn the fp32 scales into the new dtype: convert a
        # one-element stand-in instead, then view it as the weight's shape again.
        weight = self._parameters["weight"]
        stand_in = nn.Parameter(weight.detach()[:1, :1].clone())
        self._with_weight(stand_in, lambda: super(QuantLinear, self)._apply(fn, recurse))
        new = stand_in.detach().reshape(1)
        weight.data = new.expand(weight.shape)
        if weight.grad is not None:
            weight.grad = fn(weight.grad)
        if self.scale.dtype != torch.float32:
            self.scale = self.scale.float()
        return self

    def __deepcopy__(self, memo):
        new = QuantLinear.__new__(QuantLinear)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_parameters":
                continue
            new.__dict__[key] = copy.deepcopy(value, memo)
        params = {}
        for key, p in self._parameters.items():
            if key == "weight":
                params[key] = QuantWeight(_placeholder(self.out_features, self.in_features,
                                                       p.dtype, p.device), new)
            else:
                params[key] = copy.deepcopy(p, memo)
        new.__dict__["_parameters"] = params
        return new
