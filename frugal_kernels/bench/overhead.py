"""The host side of an optimizer step: Python bookkeeping, checks and dispatch.

On a GPU the memory traffic of a LLaMA-130M step takes well under a millisecond, so what
decides the step time there is the host. That cost is measured here on the CPU by stepping
the tensor *structure* of the model (the same 111 tensors, names and parameter groups,
each shrunk to a few elements) on one thread, interleaved with
``torch.optim.AdamW(fused=True)`` on the same tensors in the same rounds. Two numbers per
optimizer: the steady-state step (no subspace change in the timed steps) and the extra cost
of a step that changes the subspace (none for the torch AdamW swapped onto the fused ops,
``frugal_kernels.swap``, whose row is its step).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.bench.timing import measure
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM

# Every dimension of the real shapes divided by this (and at least 1): LLaMA-130M's 768
# hidden and 2048 FFN become 6 and 16, its 32000-token vocabulary 250.
SHRINK = 128
# Longer than any timed run: the steady-state candidates never change their subspace.
NO_CHANGE = 10**9
# The row of a torch AdamW swapped onto the fused ops (frugal_kernels.swap).
SWAPPED = "torch_adamw_swapped"


def tiny_structure(preset: str = "130m") -> nn.Module:
    """A model with the tensors of ``preset`` (vocab 32000), every dim shrunk by SHRINK."""
    real = LlamaConfig.from_preset(preset, vocab_size=32000)
    config = dataclasses.replace(
        real, vocab_size=max(1, real.vocab_size // SHRINK),
        hidden_size=max(1, real.hidden_size // SHRINK),
        intermediate_size=max(1, real.intermediate_size // SHRINK), num_heads=1)
    model = LlamaForCausalLM(config, seed=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _frugal(model, projection, update_gap):
    return lambda: fk.FRUGAL(fk.param_groups(model), lr=1e-4, weight_decay=0.01, density=0.25,
                             projection=projection, update_gap=update_gap)


def _adafrugal(model, update_gap):
    return lambda: fk.AdaFRUGAL(fk.param_groups(model), lr=1e-4, weight_decay=0.01,
                                rho_start=0.25, rho_end=0.05, rho_steps=1000,
                                update_gap=update_gap, update_gap_max=max(update_gap, NO_CHANGE))


def factories(model: nn.Module, update_gap: int) -> Dict[str, Callable[[], torch.optim.Optimizer]]:
    """Our optimizers, by name, on ``model``, changing their subspace every ``update_gap``."""
    makers = {f"frugal_{projection}": _frugal(model, projection, update_gap)
              for projection in fk.optim.subspace_choice.PROJECTIONS}
    makers["adafrugal_blocks"] = _adafrugal(model, update_gap)
    return makers


def host_overhead(preset: str = "130m", rounds: int = 15, threads: int = 1) -> dict:
    """Host time per step of every optimizer against fused AdamW, and of a subspace change."""
    model = tiny_structure(preset)
    params = list(model.parameters())
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        steady = {name: make() for name, make in factories(model, NO_CHANGE).items()}
        changing = {name: make() for name, make in factories(model, 1).items()}
        # The same torch AdamW stepping on the fused ops (it has no subspace to change).
        swapped = fk.swap(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01))
        candidates = {"torch_adamw_fused": fused.step, SWAPPED: swapped.step}
        candidates.update({name: opt.step for name, opt in steady.items()})
        candidates.update({f"{name}/change": opt.step for name, opt in changing.items()})
        seconds = measure(candidates, device=torch.device("cpu"), rounds=rounds, warmup=3)
    finally:
        torch.set_num_threads(previous_threads)
    base = seconds["torch_adamw_fused"]
    rows: List[dict] = []
    for name in [*steady, SWAPPED]:
        change = seconds.get(f"{name}/change")
        rows.append({"optimizer": name, "step_us": seconds[name] * 1e6,
                     "vs_torch_adamw_fused": seconds[name] / base,
                     "change_us": None if change is None else (change - seconds[name]) * 1e6})
    return {"preset": preset, "tensors": len(params), "numel": sum(p.numel() for p in params),
            "threads": threads, "torch_adamw_fused_us": base * 1e6, "rows": rows}
