"""``shard_quantized_`` (deprecated): the rows of every :class:`QuantLinear` split over a
device mesh, beside FSDP2.

Deprecated: FSDP2's ``fully_shard`` now shards a QuantLinear's weight itself (a
:class:`~frugal_kernels.nn.QuantWeight`, whose all-gather hooks exchange its packed
codes); this recipe stays for one release. :func:`shard_quantized_` shards the weight
the way FSDP2 shards a parameter, by rows in ``torch.chunk``'s split
(``ceil(rows / ranks)`` rows per rank, the last ranks fewer or none):

- each rank keeps its block of rows of the codes (and of the scales with
  ``scale="row"``; one scale per tensor is kept whole): its ``weight`` is that block,
  so that its gradient, and the DQT state made for it, covers the rank's rows only;
- forward and backward all-gather the codes (and row scales) of the whole weight,
  which are dropped again when the pass is done (FSDP2's default, reshard after
  forward);
- backward reduce-scatters the weight's gradient: each rank gets the mean over the
  ranks of its rows, as FSDP2 averages its parameters' gradients;
- :class:`frugal_kernels.DQT` steps the block, and its stochastic rounding keys
  every element by its index in the whole weight (the ``shard`` attribute the weight
  carries): a row rounds as it would in one process.

The weights it returns go to ``fully_shard(..., ignored_params=...)``; FSDP2 shards
the rest of the model (biases included) as usual. ``state_dict()`` gives the codes
(and row scales) as DTensors of the whole weight's shape, sharded on dim 0, which
``torch.distributed.checkpoint`` saves and reshards onto any number of ranks;
``load_state_dict`` takes them as such DTensors, of any split, or as plain tensors of
the whole weight (a one-process checkpoint).
"""

from __future__ import annotations

import warnings
from typing import List, Optional

import torch
from torch import Tensor, nn

from frugal_kernels import ops
from frugal_kernels._shard import RowShard
from frugal_kernels.nn.quant_linear import (QuantLinear, QuantWeight, grad_input, grad_weight,
                                            linear_forward)

__all__ = ["ShardedQuantLinear", "shard_quantized_"]


class _ShardedQuantLinearFunction(torch.autograd.Function):
    """``x @ W.T + b`` with the whole ``W`` gathered from the ranks' blocks of codes; the
    gradient of the rank's ``weight`` block is its rows of the ranks' mean gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, codes: Tensor, scale: Tensor,
                bias: Optional[Tensor], bits: int, shard: RowShard, row_scale: bool) -> Tensor:
        whole_scale = shard.gather(scale) if row_scale else scale
        out, x2 = linear_forward(x, shard.gather(codes), whole_scale, bias, bits)
        ctx.save_for_backward(x2, codes, scale)
        ctx.bits, ctx.shard, ctx.row_scale = bits, shard, row_scale
        ctx.has_bias, ctx.shape, ctx.weight_dtype = bias is not None, x.shape, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, codes, scale = ctx.saved_tensors
        shard = ctx.shard
        g2 = grad_out.reshape(-1, shard.rows)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # The codes are gathered again rather than kept from forward (FSDP2's
            # default: nothing of the whole weight lives between the passes).
            whole_scale = shard.gather(scale) if ctx.row_scale else scale
            grad_x = grad_input(g2, x2, shard.gather(codes), whole_scale,
                                ctx.bits).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = shard.reduce_scatter_mean(grad_weight(g2, x2, ctx.weight_dtype))
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, None, None, grad_b, None, None, None


class ShardedQuantLinear(QuantLinear):
    """A :class:`QuantLinear` that holds one block of its rows (see the module
    docstring); made by :func:`shard_quantized_`, which turns a QuantLinear into one
    in place. ``out_features`` stays the whole layer's; ``codes``, the ``scale`` of
    ``scale="row"`` and the ``weight`` have ``shard.size`` rows."""

    shard: RowShard

    def forward(self, x: Tensor) -> Tensor:
        return _ShardedQuantLinearFunction.apply(x, self.weight, self.codes, self.scale,
                                                 self._bias_for(x), self.bits, self.shard,
                                                 self.scale_mode == "row")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The whole weight ``s * q`` (a collective: the codes are gathered)."""
        scale = self.shard.gather(self.scale) if self.scale_mode == "row" else self.scale
        return ops.dequantize(self.shard.gather(self.codes), scale, bits=self.bits,
                              cols=self.in_features, dtype=dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # The global form: what one process would save, as DTensors of the whole shape.
        for name in self._sharded_buffers():
            block = destination[prefix + name]
            destination[prefix + name] = self.shard.to_dtensor(
                block, (self.shard.rows, *block.shape[1:]))

    def _as_read(self, state_dict, prefix: str):
        state_dict = dict(state_dict)
        for name in self._sharded_buffers():
            value = state_dict.get(prefix + name)
            # A tensor of other rows is left whole: the module's own check names it.
            if isinstance(value, Tensor) and value.dim() and value.shape[0] == self.shard.rows:
                state_dict[prefix + name] = self.shard.block_of(value)
        return state_dict

    def _sharded_buffers(self) -> List[str]:
        return ["codes", "scale"] if self.scale_mode == "row" else ["codes"]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rows={self.shard.offset}.."
                f"{self.shard.offset + self.shard.size} of {self.shard.num_shards} shards")

    def __deepcopy__(self, memo):
        raise TypeError("a ShardedQuantLinear holds one rank's rows: copy the model before "
                        "shard_quantized_, or save and load its state dict")

    def _apply(self, fn, recurse=True):
        # Module._apply swaps a converted weight in (its attributes with it): the new one
        # is told its rows again.
        super()._apply(fn, recurse)
        self.weight.shard = self.shard
        return self


def shard_quantized_(model: nn.Module, mesh) -> List[QuantWeight]:
    """Split the rows of every :class:`QuantLinear` of ``model`` over ``mesh``, in place
    (each becomes a :class:`ShardedQuantLinear`; see the module docstring), and return
    their weights, for ``fully_shard(..., ignored_params=set(...))``.

    Deprecated (a ``DeprecationWarning``; removed in the next release): call
    ``fully_shard`` alone, which shards the QuantWeights itself.

    ``mesh`` is a 1-D ``DeviceMesh`` (FSDP2's data-parallel mesh); every rank calls
    this with the same model. Build the optimizer afterwards, from the model's new
    parameters, and call it before ``fully_shard``::

        frugal_kernels.quantize_(model, bits=4)
        weights = frugal_kernels.nn.shard_quantized_(model, mesh)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=set(weights))
        fully_shard(model, mesh=mesh, ignored_params=set(weights))
        opt = frugal_kernels.DQT(model.parameters(), lr=1e-3)
    """
    warnings.warn("frugal_kernels.nn.shard_quantized_ is deprecated and goes in the next "
                  "release: fully_shard shards a QuantLinear's weight itself (drop "
                  "shard_quantized_ and ignored_params)", DeprecationWarning, stacklevel=2)
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError("shard_quantized_ takes a 1-D DeviceMesh (the ranks that shard the "
                         f"rows); got {mesh!r}")
    weights = []
    for name, module in model.named_modules():
        if isinstance(module, ShardedQuantLinear):
            raise ValueError(f"shard_quantized_: {name} is sharded already")
        if type(module) is not QuantLinear:
            continue
        shard = RowShard.over(mesh, module.out_features)
        old = module.weight
        block = old.narrow(0, shard.offset, shard.size).clone()
        weight = nn.Parameter(block, requires_grad=old.requires_grad)
        module._parameters["weight"] = weight
        module.__class__ = ShardedQuantLinear
        module.shard = weight.shard = shard
        weights.append(weight)
    return weights
