"""The optimizers a user would pick instead of FRUGAL, as optional rows of the demo.

GaLore (``galore-torch``), APOLLO (``apollo-torch``), Adam-mini (``adam-mini``) and an 8-bit
AdamW (``bitsandbytes``, whose block-wise 8-bit AdamW runs on the CPU) come with
``pip install "frugal_kernels[peers]"``. Each factory here imports its package only when the
demo builds that optimizer, so that the demo runs without them: a row whose package is missing
is skipped with a one-line notice (:func:`missing`).

Every peer gets the demo's parametrisation (:func:`~frugal_kernels.lab.train.lr_groups`): the
embeddings, norms and head at ``config.lr``, the projected matrices at
``config.matrix_lr_ratio * config.lr``; the low-rank peers project exactly the matrices FRUGAL
projects. The settings each one keeps from its authors are listed in docs/demo.md.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

from frugal_kernels.lab.train import TrainConfig, lr_groups

__all__ = ["PEERS", "missing"]


def _rank(model: nn.Module) -> int:
    """A quarter of the hidden size: the state FRUGAL keeps at rho = 0.25 on a square matrix."""
    return max(1, model.config.hidden_size // 4)


def _galore(model: nn.Module, config: TrainConfig, update_gap: int) -> torch.optim.Optimizer:
    from galore_torch import GaLoreAdamW

    # scale 1: GaLore's scale only multiplies the projected-back update, that is the matrices'
    # lr; the authors' lr 1e-2 with scale 0.25 is matrix_lr_ratio 0.25 here, with the
    # embeddings, norms and head at 1e-2 as in their recipe.
    groups = lr_groups(model, config, rank=_rank(model), update_proj_gap=update_gap,
                       scale=1.0, proj_type="std")
    return GaLoreAdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                       no_deprecation_warning=True)


def _apollo(model: nn.Module, config: TrainConfig, update_gap: int) -> torch.optim.Optimizer:
    from apollo_torch import APOLLOAdamW

    # The authors' APOLLO recipe: random projection, channel-wise scaling, the norm-growth
    # limiter on, scale 1; the rank is GaLore's, so that the two hold the same moments.
    groups = lr_groups(model, config, rank=_rank(model), update_proj_gap=update_gap,
                       scale=1.0, proj="random", proj_type="std", scale_type="channel")
    return APOLLOAdamW(groups, lr=config.lr, weight_decay=config.weight_decay)


def _adam_mini(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    from adam_mini import Adam_mini

    # Adam-mini partitions by parameter name (one group per tensor, one second moment per
    # head of q/k, per neuron of v/o/MLP, per token of the embeddings and head); it needs the
    # model's width and heads to find the heads. The demo's split then sets each tensor's lr.
    opt = Adam_mini(model.named_parameters(), lr=config.lr, weight_decay=config.weight_decay,
                    dim=model.config.hidden_size, n_heads=model.config.num_heads,
                    verbose=False)
    lr_of = {id(p): group["lr"] for group in lr_groups(model, config) for p in group["params"]}
    for group in opt.param_groups:
        group["lr"] = lr_of[id(group["params"][0])]
    return opt


def _adamw8bit(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    # bitsandbytes' defaults: block-wise 8-bit moments for tensors of 4096 elements or more,
    # 32-bit moments for the smaller ones (here the norms).
    return bnb.optim.AdamW8bit(lr_groups(model, config), lr=config.lr,
                               weight_decay=config.weight_decay)


# The demo's rows (frugal_kernels.lab.registry.OPTIMIZERS), as DemoOptimizer's keyword
# arguments; ``requires`` is (module, pip distribution). The factories of the ``subspace`` rows
# take the steps between subspace changes too: the demo gives them its T for FRUGAL, so that
# every subspace method changes its subspace at the same steps (the authors' 200 is for runs
# of 10k+ steps).
PEERS: dict[str, dict[str, Any]] = {
    "galore": dict(label="GaLore rank d/4", color="tab:purple", make=_galore,
                   requires=("galore_torch", "galore-torch"), subspace=True,
                   note="GaLore keeps AdamW's moments for a rank-d/4 projection of each "
                        "matrix's gradient (an SVD every T steps) and drops the rest of it"),
    "apollo": dict(label="APOLLO rank d/4", color="tab:brown", make=_apollo,
                   requires=("apollo_torch", "apollo-torch"), subspace=True,
                   note="APOLLO scales each channel's gradient by a ratio it estimates from "
                        "AdamW moments of a rank-d/4 random projection"),
    "adam-mini": dict(label="Adam-mini", color="tab:pink", make=_adam_mini,
                      requires=("adam_mini", "adam-mini"),
                      note="Adam-mini keeps one second moment per head, neuron or token "
                           "instead of one per weight"),
    "adamw8bit": dict(label="AdamW 8-bit (bnb)", color="tab:olive", make=_adamw8bit,
                      requires=("bitsandbytes", "bitsandbytes"),
                      note="AdamW with its moments kept in 8-bit blocks"),
}


def missing(requires: Optional[tuple[str, str]]) -> Optional[str]:
    """Why an optimizer that needs the package ``requires`` cannot run here (None if it can).

    The package is imported, not just looked up, so that one that is installed but broken
    (a missing dependency of its own) is reported too.
    """
    if requires is None:
        return None
    module, distribution = requires
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (f"{distribution} cannot be imported ({exc}); "
                f"pip install \"frugal_kernels[peers]\"")
    return None
