"""Quantized modules for DQT: weights that exist only as packed INT-n codes.

- :class:`QuantLinear` — a linear layer with INT-n weights (2 = ternary, 3, 4, 8
  bits) and fp32 scales, trained by :class:`frugal_kernels.DQT`;
- :func:`quantize_` — swap a model's ``nn.Linear`` layers for it in place.
"""

from frugal_kernels.nn.quant_linear import QuantLinear, QuantWeight
from frugal_kernels.nn.quantize import quantize_

__all__ = ["QuantLinear", "QuantWeight", "quantize_"]
