"""Memory-frugal LLM training: FRUGAL, AdaFRUGAL, BAdam and DQT optimizers on fused kernels.

Layers (see DESIGN.md): ``frugal_kernels.ops`` holds the fused ops as
``torch.library`` operators with CPU (C++), CUDA, Triton and torch backends;
``frugal_kernels.reference`` is the readable pure-torch ground truth;
``frugal_kernels.nn`` holds ``QuantLinear``, the INT-n layer DQT trains.
"""

from frugal_kernels._version import __version__
from frugal_kernels import _versions

# Before the imports below, so that on an older torch the warning comes first even if
# one of them then fails.
_versions.warn_if_unsupported()

from frugal_kernels._build_info import build_info
from frugal_kernels import data, nn, ops, reference
from frugal_kernels.governor import Governor
from frugal_kernels.nn import quantize_
from frugal_kernels.optim import (DQT, FRUGAL, AdaFRUGAL, BAdam, FrugalOptimizer,
                                  optimizer_state_dict_template, param_groups, protocol_of,
                                  step_in_backward)
from frugal_kernels.optim.swap import swap

__all__ = ["__version__", "build_info", "nn", "ops", "reference", "Governor", "FRUGAL",
           "AdaFRUGAL", "BAdam", "DQT", "param_groups", "quantize_", "step_in_backward", "swap",
           "optimizer_state_dict_template", "FrugalOptimizer", "protocol_of"]
