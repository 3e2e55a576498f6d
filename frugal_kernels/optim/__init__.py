"""torch.optim optimizers built on the fused ops."""

from frugal_kernels.optim.adafrugal import AdaFRUGAL
from frugal_kernels.optim.badam import BAdam
from frugal_kernels.optim.dqt import DQT
from frugal_kernels.optim.checkpoint import optimizer_state_dict_template
from frugal_kernels.optim.frugal import FRUGAL
from frugal_kernels.optim.grouping import param_groups
from frugal_kernels.optim.in_backward import TensorSteps, step_in_backward
from frugal_kernels.optim.protocol import FrugalOptimizer, protocol_of

__all__ = ["FRUGAL", "AdaFRUGAL", "BAdam", "DQT", "param_groups", "step_in_backward",
           "optimizer_state_dict_template", "FrugalOptimizer", "TensorSteps", "protocol_of"]
