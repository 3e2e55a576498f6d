"""Memory-frugal LLM training: FRUGAL, AdaFRUGAL and BAdam optimizers on fused kernels.

Layers (see DESIGN.md): ``frugal_kernels.ops`` holds the fused ops as
``torch.library`` operators with CPU (C++), CUDA, Triton and torch backends;
``frugal_kernels.reference`` is the readable pure-torch ground truth.
"""

from frugal_kernels._version import __version__
from frugal_kernels._build_info import build_info
from frugal_kernels import ops, reference
from frugal_kernels.governor import Governor
from frugal_kernels.optim import (FRUGAL, AdaFRUGAL, BAdam, optimizer_state_dict_template,
                                  param_groups)
from frugal_kernels.optim.swap import swap

__all__ = ["__version__", "build_info", "ops", "reference", "Governor", "FRUGAL", "AdaFRUGAL",
           "BAdam", "param_groups", "swap", "optimizer_state_dict_template"]
