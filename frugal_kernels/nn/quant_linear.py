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

The module's ``weight`` parameter is a :class:`QuantWeight`, a tensor subclass that
carries the codes, the scales, the width and the rounding seed (``layer.codes`` and
``layer.scale`` read its). Autograd gives it the ``[out, in]`` weight gradient (a plain
tensor of the weight's dtype) and an optimizer receives it from ``model.parameters()``,
so a training loop (``zero_grad``, gradient clipping, LR schedulers, ``param_groups``)
works unchanged, and so do ``.to()``, ``deepcopy``, ``torch.save(model)`` and FSDP2's
``fully_shard``. The state dict holds the codes and scales as plain tensors.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from frugal_kernels import _quant, ops
from frugal_kernels._shard import RowShard
from frugal_kernels.nn import _ddp
from frugal_kernels.nn.quant_weight import QuantWeight

__all__ = ["QuantLinear", "QuantWeight"]

_SCALES = ("tensor", "row")
# Floats of the dequantized block of rows each GEMM sees: 4 MiB in fp32, in L2
# beside the inputs, and large enough that the GEMM runs at its full speed.
_BLOCK_VALUES = 1 << 20
_FORMAT = 1  # of the module's extra state


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
    dequantized a block of rows at a time; the gradient of ``weight`` (its
    QuantWeight, whose codes and scales are passed beside it) is a plain tensor of
    its dtype."""

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
            in training. An all-zero weight (or row, with ``scale="row"``), such
            as a zero-initialised output projection, has no size to take: it
            gets the size nn.Linear's default init has by the same rule
            (``0.5 / sqrt(in_features)`` for absmean, ``1 / sqrt(in_features)``
            for absmax), so that DQT can train it. On the demo model absmax
            trains much better (4-bit: AdamW's loss, against +8% with absmean;
            docs/demo.md).
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
    ``seed``; it loads back bit-exactly. A load checks the whole layer before it
    copies anything: the extra state must be there (it says the codes' width) and
    the codes must be codes of that width (no field above ``2 * qmax``, padding
    bits zero). ``.to(dtype)`` changes the dtype of the bias and of the weight's
    gradient; the scales stay fp32.
    """

    # Set by frugal_kernels.nn.shard_quantized_, which keeps a block of the rows.
    shard = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bits: int = 4,
                 scale: str = "tensor", device=None, dtype: Optional[torch.dtype] = None,
                 seed: int = 0, scale_init: str = "absmean"):
        super().__init__()
        _ddp.guard_ddp_broadcast()  # DDP's broadcast would fail obscurely on it
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
        self.bits, self.scale_mode, self.scale_init = bits, scale, scale_init
        codes = torch.zeros(_quant.packed_shape((out_features, in_features), bits),
                            dtype=torch.uint8, device=device)
        scales = torch.ones(1 if scale == "tensor" else out_features, dtype=torch.float32,
                            device=device)
        self.weight = nn.Parameter(QuantWeight(codes, scales, bits, in_features,
                                               seed % (1 << 32), dtype,
                                               row_scale=scale == "row"))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) \
            if bias else None
        self.reset_parameters()

    # ---------------------------------------------------------------- weights

    @property
    def codes(self) -> Tensor:
        """The packed codes of the weight (this rank's rows under FSDP2)."""
        return _local(self.weight).codes

    @property
    def scale(self) -> Tensor:
        """The fp32 scales of the weight (this rank's rows of row scales under FSDP2)."""
        return _local(self.weight).scale

    @property
    def seed(self) -> int:
        """The seed of the stochastic rounding of the weight's updates."""
        return _local(self.weight).seed

    @seed.setter
    def seed(self, value: int) -> None:
        _local(self.weight).seed = value

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
        # An all-zero weight (or row), as a zero-initialised output projection has, gives
        # no size: its floor scale would cap every weight the layer can reach at
        # qmax * 1e-8, and DQT (which keeps the scales fixed) could never train it. It
        # takes the size nn.Linear's default init (uniform in +-1/sqrt(in_features)) has
        # by the same rule, so its codes step as a freshly initialised layer's do.
        default = (0.5 if self.scale_init == "absmean" else 1.0) / math.sqrt(self.in_features)
        size = torch.where(size == 0, torch.full_like(size, default), size)
        scale = (size / qmax).clamp_(min=1e-8)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("QuantLinear.quantize_from: the weight has non-finite values")
        q = torch.round(w / scale.reshape(-1, 1)).clamp_(-qmax, qmax).to(torch.int32)
        self.scale.copy_(scale)
        self.codes.copy_(_quant.pack(q, self.bits))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The whole weight ``s * q`` as a new float tensor (for inspection and export:
        the layer itself never holds it).

        Under FSDP2's ``fully_shard`` it is the whole weight too, as an ``nn.Linear``'s
        ``weight.full_tensor()`` is, and so a collective that every rank of the mesh
        must call: the ranks all-gather their packed codes (and row scales), never float
        values. ``layer.weight.to_local().dequantize()`` gives this rank's rows alone."""
        weight = self.weight
        if isinstance(weight, QuantWeight):
            return weight.dequantize(dtype)
        local = weight.to_local()
        codes = _as_rows_of(weight, local.codes).full_tensor()
        scale = _as_rows_of(weight, local.scale).full_tensor() if local.row_scale else local.scale
        return ops.dequantize(codes, scale, bits=self.bits, cols=self.in_features, dtype=dtype)

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
        weight = self.weight
        return _QuantLinearFunction.apply(x, weight, weight.codes, weight.scale,
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

    # ------------------------------------- the state dict: codes and scales

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The weight is saved as its codes and scales, plain tensors (a checkpoint that
        # torch.load(weights_only=True) reads), in the order of the format's first
        # release: bias, codes, scale, extra state.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        del destination[prefix + "weight"]
        extra = destination.pop(prefix + "_extra_state")
        for name, value in self._weight_tensors().items():
            destination[prefix + name] = value if keep_vars else value.detach()
        destination[prefix + "_extra_state"] = extra

    def _weight_tensors(self) -> Dict[str, Tensor]:
        """The codes and scales as the state dict holds them: under FSDP2 in the global
        form (as FSDP2's parameters are), DTensors of the whole weight's rows whose block
        on each rank is its rows (a per-tensor scale, the same on every rank, plain)."""
        weight = self.weight
        if isinstance(weight, QuantWeight):
            return {"codes": weight.codes, "scale": weight.scale}
        local = weight.to_local()
        return {"codes": _as_rows_of(weight, local.codes),
                "scale": _as_rows_of(weight, local.scale) if local.row_scale else local.scale}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Nothing of this layer changes before its codes and scales are known to fit:
        # torch would copy the bias and report the codes' shape, or raise from
        # set_extra_state half way.
        state_dict = self._as_read(state_dict, prefix)
        problem, loads, missing = self._check_read(state_dict, prefix)
        if problem is not None:
            error_msgs.append(problem)
            return
        missing_keys.extend(missing)
        # The weight's own key is never in the state dict (its codes and scales are).
        first_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        missing_keys[first_missing:] = [k for k in missing_keys[first_missing:]
                                        if k != prefix + "weight"]
        if strict:  # torch counts the keys of no parameter or buffer as unexpected
            mine = {prefix + name for name in loads}
            unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]
        with torch.no_grad():
            for name, value in loads.items():
                getattr(self, name).copy_(value)

    def _check_load(self, state_dict, prefix: str
                    ) -> Tuple[Optional[str], Dict[str, Tensor], List[str]]:
        """What would stop this layer loading from ``state_dict`` at ``prefix`` (or None),
        the codes and scales it would copy, and their keys that are missing: the check
        :func:`frugal_kernels.quantize_` puts on a model runs it before anything of the
        model loads."""
        return self._check_read(self._as_read(state_dict, prefix), prefix)

    def _as_read(self, state_dict, prefix: str):
        """``state_dict`` as this layer reads it (a ShardedQuantLinear: its rows)."""
        return state_dict

    def _check_read(self, state_dict, prefix: str
                    ) -> Tuple[Optional[str], Dict[str, Tensor], List[str]]:
        """:meth:`_check_load` of a state dict already as the layer reads it."""
        if prefix + "weight" in state_dict:
            return (f"{prefix}weight: the checkpoint holds a float weight (an nn.Linear's?); "
                    "build this layer with QuantLinear.from_linear"), {}, []
        extra = state_dict.get(prefix + "_extra_state")
        if extra is None:
            if prefix + "codes" in state_dict or prefix + "scale" in state_dict:
                # A tensors-only state dict: codes of another width can have this one's
                # packed shape (2 columns at 2, 3 or 4 bits) and would load as garbage.
                return (f"{prefix}_extra_state: missing beside the codes; it says their "
                        f"width (bits), scale kind and rounding seed, without which they "
                        f"cannot be read (this layer has bits={self.bits}): load the whole "
                        "state_dict(), which torch.load(weights_only=True) reads"), {}, []
        elif not isinstance(extra, dict) or extra.get("format") != _FORMAT:
            return f"{prefix}_extra_state: QuantLinear: an extra state of an unknown " \
                   f"format: {extra!r}", {}, []
        elif (extra.get("bits"), extra.get("scale")) != (self.bits, self.scale_mode):
            return (f"{prefix}: the checkpoint's layer has bits={extra.get('bits')}, "
                    f"scale={extra.get('scale')!r}; this one bits={self.bits}, "
                    f"scale={self.scale_mode!r}"), {}, []
        loads, missing = {}, []
        for name, mine in (("codes", self.codes), ("scale", self.scale)):
            key = prefix + name
            if key not in state_dict:
                missing.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, Tensor):
                return f"{key}: expected a tensor, got {type(value).__name__}", {}, []
            if not isinstance(self.weight, QuantWeight) and (name == "codes" or
                                                            self.scale_mode == "row"):
                value = _own_rows(self.weight, value)
            if value.dtype != mine.dtype:
                kind = "packed codes are torch.uint8" if name == "codes" else \
                    "scales are torch.float32"
                return f"{key}: {kind}, the checkpoint's are {value.dtype}", {}, []
            if value.shape != mine.shape:
                return (f"size mismatch for {key}: copying a param with shape "
                        f"{tuple(value.shape)} from checkpoint, the shape in current model "
                        f"is {tuple(mine.shape)}"), {}, []
            if name == "codes" and not _quant.are_codes(value, self.bits, self.in_features):
                qmax = _quant.qmax(self.bits)
                return (f"{key}: not {self.bits}-bit codes of {self.in_features} columns (a "
                        f"field above {2 * qmax}, the code {qmax + 1}, or padding bits set): "
                        "a checkpoint of another width or a damaged one"), {}, []
            loads[name] = value
        return None, loads, missing

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


def _as_rows_of(weight: Tensor, block: Tensor) -> Tensor:
    """``block`` (this rank's rows of a tensor whose rows are the weight's) as the
    DTensor of all the rows, split as the DTensor ``weight``. No communication."""
    return _row_shard(weight).to_dtensor(block, (weight.shape[0], *block.shape[1:]))


def _own_rows(weight: Tensor, value: Tensor) -> Tensor:
    """This rank's rows, as the DTensor ``weight`` splits them, of ``value``: a DTensor
    split the same way (its block), another DTensor (gathered whole first: a
    collective) or a plain tensor of all the rows (a one-process checkpoint)."""
    if value.dim() == 0 or value.shape[0] != weight.shape[0]:
        return value  # the shape check names the mismatch
    return _row_shard(weight).block_of(value)


def _row_shard(weight: Tensor) -> RowShard:
    return RowShard.of(weight, "a QuantLinear's weight")


def _local(weight: Tensor) -> QuantWeight:
    """The QuantWeight of a layer's weight: itself, or under FSDP2 (a DTensor between
    the passes) this rank's block of rows."""
    return weight if isinstance(weight, QuantWeight) else weight.to_local()
