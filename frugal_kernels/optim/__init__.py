"""torch.optim optimizers built on the fused ops."""

from frugal_kernels.optim.adafrugal import AdaFRUGAL
from frugal_kernels.optim.badam import BAdam
from frugal_kernels.optim.checkpoint import optimizer_state_dict_template
from frugal_kernels.optim.frugal import FRUGAL
from frugal_kernels.optim.grouping import param_groups

__all__ = ["FRUGAL", "AdaFRUGAL", "BAdam", "param_groups", "optimizer_state_dict_template"]
