"""The default step and the clipped step, against torch's, on the same tensors.

Issue 31's rows: for FRUGAL (rows, columns, randk at density 1 and 0.25) and a torch AdamW
swapped onto the fused ops, the step with the defaults (``nonfinite="skip"``: its
non-finite decision reads the gradients once) against ``torch.optim.AdamW(fused=True)``,
and ``opt.clip_grad_norm_(1.0); opt.step()`` against ``torch.nn.utils.clip_grad_norm_`` +
fused AdamW's step, all in the same rounds. Two parameter sets: one 4096 x 4096 float32
matrix, and the LLaMA shapes of a preset (the embeddings and head on AdamW, the blocks'
matrices projected).

Beside them, FRUGAL rows with ``nonfinite="propagate"`` (no non-finite decision at all), so
that the default's own cost is the difference of two rows of one run, and FRUGAL blocks at
density 0.25, the demo's default projection.

Every candidate steps the same parameters with the same gradients (the values drift,
which timing does not mind); the clip's factor stays below 1 so that it bites.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.bench.timing import measure
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM

# (label, projection, density, nonfinite).
ROWS: List[Tuple[str, str, float, str]] = [
    (f"frugal_{kind}_rho{density:g}", kind, density, "skip")
    for kind in ("rows", "columns", "randk") for density in (1.0, 0.25)
] + [(f"frugal_rows_rho{density:g}_propagate", "rows", density, "propagate")
     for density in (1.0, 0.25)] + [("frugal_blocks_rho0.25", "blocks", 0.25, "skip")]
MAX_NORM = 1.0


def _param_sets(preset: str, device: torch.device, side: int) -> Dict[str, nn.Module]:
    single = nn.Linear(side, side, bias=False).to(device)
    config = LlamaConfig.from_preset(preset, vocab_size=32000)
    return {f"{side * side / 2**20:.3g}M single tensor": single,
            f"LLaMA-{preset}": LlamaForCausalLM(config, seed=0).to(device)}


def _groups(model: nn.Module) -> list:
    if isinstance(model, nn.Linear):
        return [{"params": [model.weight]}]
    return fk.param_groups(model)


def _candidates(model: nn.Module) -> Dict[str, Callable[[], None]]:
    params = [p for p in model.parameters()]
    for p in params:
        # Large enough that the clip's factor is below 1.
        p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW(params, lr=1e-5, fused=True)
    swapped = fk.swap(torch.optim.AdamW(params, lr=1e-5))
    ours = {label: fk.FRUGAL(_groups(model), lr=1e-5, projection=kind, density=density,
                             update_gap=10**9, nonfinite=nonfinite)
            for label, kind, density, nonfinite in ROWS}
    ours["adamw_swapped"] = swapped

    def torch_clip_step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        fused.step()

    candidates = {"torch_adamw_fused": fused.step, "torch_clip+adamw_fused": torch_clip_step}
    for label, opt in ours.items():
        candidates[label] = opt.step
        candidates[f"{label} clip"] = _clip_step(opt)
    return candidates


def _clip_step(opt) -> Callable[[], None]:
    surface = fk.protocol_of(opt)  # a swapped optimizer's clip is its own fused one

    def run():
        surface.clip_grad_norm_(MAX_NORM)
        opt.step()
    return run


def clip_rows(preset: str, *, device: torch.device, rounds: int, side: int = 4096) -> dict:
    """The step and clip+step times per parameter set (a ``side x side`` matrix and the
    preset's LLaMA shapes), with their ratios to torch's."""
    out = {}
    for name, model in _param_sets(preset, device, side).items():
        seconds = measure(_candidates(model), device=device, rounds=rounds)
        step, clip = seconds["torch_adamw_fused"], seconds["torch_clip+adamw_fused"]
        rows = []
        for label in [r[0] for r in ROWS] + ["adamw_swapped"]:
            row = {"optimizer": label, "step_ms": seconds[label] * 1e3,
                   "step_vs_fused_adamw": step / seconds[label]}
            if f"{label} clip" in seconds:
                row["clip_step_ms"] = seconds[f"{label} clip"] * 1e3
                row["clip_step_vs_torch"] = clip / seconds[f"{label} clip"]
            rows.append(row)
        out[name] = {"numel": sum(p.numel() for p in model.parameters()),
                     "torch_adamw_fused_ms": step * 1e3, "torch_clip_adamw_fused_ms": clip * 1e3,
                     "rows": rows}
        del model
    return out
