"""Whole optimizer steps on a LLaMA-shaped parameter set: state bytes and step time.

Peers measured in the same run: torch.optim.AdamW (fused, foreach, and
swapped onto the fused ops by ``frugal_kernels.swap``), a
per-parameter loop written like the FRUGAL paper's code, and, when installed,
bitsandbytes / torchao 8-bit and 4-bit AdamW. BAdam is measured with one layer
active, on its own copy of the parameter set: it clears the gradients and
requires_grad flags of the blocks it does not train, which the others need.
"""

from __future__ import annotations

import copy

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.bench.timing import measure
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM


def llama_param_set(preset: str, device: torch.device) -> nn.Module:
    """A LLaMA model of ``preset`` shape (vocab 32000) with random gradients."""
    config = LlamaConfig.from_preset(preset, vocab_size=32000)
    model = LlamaForCausalLM(config, seed=0).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


class PaperStyleFRUGAL(torch.optim.Optimizer):
    """Blockwise FRUGAL stepped the way the paper's code steps it (the op
    sequence of fzmushko/FRUGAL's ProjOptimizer.step and AdamW._compute_update):
    a Python loop over parameters, each a string of small tensor ops that build
    the update in temporaries. A timing baseline only."""

    def __init__(self, groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 density=0.25):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            if group.get("projected", True):
                n_active = round(density * len(group["params"]))
                for i, p in enumerate(group["params"]):
                    self.state[p]["active"] = i < n_active

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if not state.get("active", True):
                    p.add_(-group["lr"] * p.grad.sign())
                    continue
                if "exp_avg" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = v.sqrt()
                step_size = group["lr"] / (1.0 - beta1 ** state["step"])
                denom.div_((1.0 - beta2 ** state["step"]) ** 0.5)
                denom.add_(group["eps"])
                p.add_(m / denom * (-step_size))


def badam_one_layer(model: nn.Module, **hyper) -> fk.BAdam:
    """BAdam on a copy of ``model`` with its first layer active for good (the switch
    is never due), holding gradients for that layer only, as after a backward pass.
    ``hyper`` may carry BAdam's ``inner`` and the FRUGAL options of ``inner="frugal"``."""
    own = copy.deepcopy(model)
    opt = fk.BAdam(own, switch_every=2**31 - 1, switch_mode="ascending", **hyper)
    for p in opt.param_groups[opt.active_block_index]["params"]:
        p.grad = torch.randn_like(p)
    return opt


# BAdam training its active block with FRUGAL (columns, rho = 0.25) instead of AdamW.
BADAM_FRUGAL = dict(inner="frugal", density=0.25, projection="columns")


def _all_projected(model):
    return [{"params": list(model.parameters()), "projected": True}]


def optimizer_factories(model: nn.Module) -> Dict[str, Callable[[], torch.optim.Optimizer]]:
    """The optimizers compared, by name, each a fresh instance on ``model``."""
    params = list(model.parameters())
    hyper = dict(lr=1e-4, weight_decay=0.01)
    factories = {
        "torch_adamw_fused": lambda: torch.optim.AdamW(params, fused=True, **hyper),
        "torch_adamw_foreach": lambda: torch.optim.AdamW(params, foreach=True, **hyper),
        # The same torch.optim.AdamW stepping on frugal::adamw_ (frugal_kernels.swap).
        "torch_adamw_swapped": lambda: fk.swap(torch.optim.AdamW(params, **hyper)),
        # SGD with momentum, torch's two paths and the same SGD on frugal::sgd_.
        "torch_sgd_fused": lambda: torch.optim.SGD(params, momentum=0.9, fused=True, **hyper),
        "torch_sgd_foreach": lambda: torch.optim.SGD(params, momentum=0.9, foreach=True,
                                                     **hyper),
        "torch_sgd_swapped": lambda: fk.swap(torch.optim.SGD(params, momentum=0.9, **hyper)),
        "frugal_blocks": lambda: fk.FRUGAL(fk.param_groups(model), density=0.25, **hyper),
        "frugal_blocks_all_projected": lambda: fk.FRUGAL(_all_projected(model), density=0.25,
                                                         **hyper),
        "frugal_columns": lambda: fk.FRUGAL(fk.param_groups(model), density=0.25,
                                            projection="columns", **hyper),
        "paper_loop_blocks": lambda: PaperStyleFRUGAL(fk.param_groups(model), density=0.25,
                                                      **hyper),
        "badam_one_layer": lambda: badam_one_layer(model, **hyper),
        "badam_frugal_one_layer": lambda: badam_one_layer(model, **BADAM_FRUGAL, **hyper),
    }
    for name, factory in _optional_peers(model, hyper).items():
        factories[name] = factory
    return factories


def _optional_peers(model, hyper) -> Dict[str, Callable[[], torch.optim.Optimizer]]:
    """Peers measured when their package is installed (never installed by us)."""
    params = list(model.parameters())
    peers = {}
    try:
        from galore_torch import GaLoreAdamW

        def galore():
            regular, projected = fk.param_groups(model)
            rank = max(1, min(p.shape[0] for p in projected["params"]) // 4)
            return GaLoreAdamW([regular, {"params": projected["params"], "rank": rank,
                                          "update_proj_gap": 200, "scale": 0.25,
                                          "proj_type": "std"}], **hyper)
        peers["galore_adamw_rank_d/4"] = galore
    except ImportError:
        pass
    if params[0].device.type == "cuda":
        # bitsandbytes' and torchao's low-bit optimizers are GPU kernels.
        try:
            import bitsandbytes as bnb
            peers["bnb_adamw8bit"] = lambda: bnb.optim.AdamW8bit(params, **hyper)
        except ImportError:
            pass
        try:
            from torchao.optim import AdamW4bit, AdamW8bit
            peers["torchao_adamw8bit"] = lambda: AdamW8bit(params, **hyper)
            peers["torchao_adamw4bit"] = lambda: AdamW4bit(params, **hyper)
        except ImportError:
            pass
    return peers


def state_bytes(model: nn.Module) -> List[dict]:
    """Optimizer-state bytes per parameter, measured from the allocated state."""
    n = sum(p.numel() for p in model.parameters())
    hyper = dict(lr=1e-4, weight_decay=0.01)
    configs = {
        "torch AdamW": lambda: torch.optim.AdamW(model.parameters(), **hyper),
        "AdamW swapped, int8": lambda: fk.swap(torch.optim.AdamW(model.parameters(), **hyper),
                                               state_dtype="int8"),
        "FRUGAL blocks rho=0.25": lambda: fk.FRUGAL(fk.param_groups(model), density=0.25, **hyper),
        "FRUGAL columns rho=0.25": lambda: fk.FRUGAL(fk.param_groups(model), density=0.25,
                                                     projection="columns", **hyper),
        **{f"FRUGAL {projection} rho=0.25 int8": (
            lambda projection=projection: fk.FRUGAL(fk.param_groups(model), density=0.25,
                                                    projection=projection, state_dtype="int8",
                                                    **hyper))
           for projection in ("blocks", "rows", "columns")},
        "FRUGAL rho=0": lambda: fk.FRUGAL(fk.param_groups(model), density=0.0, **hyper),
        "AdaFRUGAL start (rho=0.25)": lambda: fk.AdaFRUGAL(fk.param_groups(model), rho_start=0.25,
                                                           rho_end=0.05, rho_steps=2, update_gap=1,
                                                           **hyper),
        "BAdam (one layer active)": lambda: badam_one_layer(model, **hyper),
        "BAdam+FRUGAL rho=0.25 (one layer active)": lambda: badam_one_layer(
            model, **BADAM_FRUGAL, **hyper),
    }
    rows = []
    for name, make in configs.items():
        opt = make()
        opt.step()
        rows.append(_state_row(name, opt, n))
        if isinstance(opt, fk.AdaFRUGAL):
            opt.step()
            opt.step()  # rho has decayed to rho_end at the change after rho_steps steps
            rows.append(_state_row(f"AdaFRUGAL end (rho={opt.rho:g})", opt, n))
        del opt
    return rows


def _state_row(name, opt, n) -> dict:
    """State bytes, and the bytes of the gradients the optimizer's parameters hold
    during its step (all of them but BAdam's inactive blocks)."""
    total = fk.protocol_of(opt).state_bytes()
    grads = sum(p.grad.untyped_storage().nbytes() for g in opt.param_groups for p in g["params"]
                if p.grad is not None)
    return {"optimizer": name, "state_bytes": total, "bytes_per_param": total / n,
            "state_mb": total / 2**20, "grad_bytes": grads, "grad_mb": grads / 2**20}


def step_times(model: nn.Module, *, rounds: int = 10, names: Optional[List[str]] = None) -> dict:
    """Median seconds per step of each optimizer, measured side by side."""
    factories = optimizer_factories(model)
    opts = {name: make() for name, make in factories.items() if names is None or name in names}
    device = next(model.parameters()).device
    times = measure({name: opt.step for name, opt in opts.items()}, device=device,
                    rounds=rounds, warmup=2)
    return {"seconds": times,
            "speedup_vs_torch_adamw_fused": {n: times["torch_adamw_fused"] / t
                                             for n, t in times.items()}}
