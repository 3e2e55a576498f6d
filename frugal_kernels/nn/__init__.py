"""Quantized modules for DQT: weights that exist only as packed INT-n codes.

- :class:`QuantLinear` — a linear layer with INT-n weights (2 = ternary, 3, 4, 8
  bits) and fp32 scales, trained by :class:`frugal_kernels.DQT`;
- :func:`quantize_` — swap a model's ``nn.Linear`` layers for it in place;
- :func:`shard_quantized_` — split every QuantLinear's rows over a device mesh
  (beside FSDP2's ``fully_shard``).
"""

from frugal_kernels.nn.quant_linear import QuantLinear, QuantWeight
from frugal_kernels.nn.quantize import quantize_
from frugal_kernels.nn.sharded import RowShard, ShardedQuantLinear, shard_quantized_

__all__ = ["QuantLinear", "QuantWeight", "RowShard", "ShardedQuantLinear", "quantize_",
           "shard_quantized_"]
