"""Quantized modules for DQT: weights that exist only as packed INT-n codes.

- :class:`QuantLinear` — a linear layer with INT-n weights (2 = ternary, 3, 4, 8
  bits) and fp32 scales, trained by :class:`frugal_kernels.DQT`;
- :func:`quantize_` — swap a model's ``nn.Linear`` layers for it in place;
- :func:`shard_quantized_` — split every QuantLinear's rows over a device mesh
  (beside FSDP2's ``fully_shard``);
- :class:`LinearCrossEntropy` — an output layer fused with its cross-entropy loss
  (no ``[tokens, vocab]`` logits in memory; per-token scores), and
  :func:`patch_causal_lm`, which gives a causal LM that loss in one line.
"""

from frugal_kernels._shard import RowShard
from frugal_kernels.nn.linear_cross_entropy import (LinearCrossEntropy, LinearCrossEntropyOutput,
                                                   patch_causal_lm)
from frugal_kernels.nn.quant_linear import QuantLinear, QuantWeight
from frugal_kernels.nn.quantize import quantize_
from frugal_kernels.nn.sharded import ShardedQuantLinear, shard_quantized_

__all__ = ["LinearCrossEntropy", "LinearCrossEntropyOutput", "QuantLinear", "QuantWeight",
           "RowShard", "ShardedQuantLinear", "patch_causal_lm", "quantize_", "shard_quantized_"]
