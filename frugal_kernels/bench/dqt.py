"""DQT's benchmark: the storage of a quantized weight and a whole training step of one layer.

:func:`storage` measures the bytes per weight of a :class:`~frugal_kernels.nn.QuantLinear`
(codes and scales, from the tensors' storages) against ``nn.Linear`` in fp32 and bf16.
:func:`layer_step` times forward, backward and the optimizer step of one ``dim x dim`` layer
on a batch of ``batch`` rows, QuantLinear + DQT against ``nn.Linear`` fp32 with
``torch.optim.AdamW(fused=True)``, in interleaved rounds. :func:`forward` times the
forward pass of one layer on a GPU, where QuantLinear runs the fused
dequantize-matmul (``ops.quant_matmul``), against ``nn.Linear`` in fp32 and bf16;
without CUDA it reports itself skipped. The op sweep
(:mod:`frugal_kernels.bench.ops`) has ``dqt_update_`` against the roofline.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from frugal_kernels import _quant
from frugal_kernels.bench.timing import measure
from frugal_kernels.nn import QuantLinear
from frugal_kernels.optim import DQT
from frugal_kernels.optim.memory import storage_bytes

__all__ = ["forward", "layer_step", "storage"]

FORWARD_SKIPPED = "needs a CUDA GPU (QuantLinear's fused dequantize-matmul runs through Triton)"


def storage(dim: int = 4096, device: torch.device = torch.device("cpu")) -> List[dict]:
    """Bytes per weight of a ``dim x dim`` layer's weight as each format stores it."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.empty(dim, dim, dtype=dtype, device=device)
        rows.append({"format": f"nn.Linear {str(dtype).replace('torch.', '')}",
                     "bytes_per_weight": storage_bytes([w]) / dim ** 2})
    for bits in _quant.QUANT_BITS:
        for scale in ("tensor", "row"):
            layer = QuantLinear(dim, dim, bias=False, bits=bits, scale=scale, device=device)
            held = storage_bytes([layer.codes, layer.scale, layer.weight])
            rows.append({"format": f"QuantLinear {bits} bits, {scale} scale",
                         "bytes_per_weight": held / dim ** 2})
            del layer
    return rows


def _linear_step(layer: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    def step():
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def layer_step(dim: int = 4096, batch: int = 4, bits: int = 4, rounds: int = 7,
               device: torch.device = torch.device("cpu")) -> Dict[str, object]:
    """Median seconds of a whole training step (forward, backward, optimizer) of one layer,
    and each candidate's time relative to ``nn.Linear`` fp32 + fused AdamW's."""
    torch.manual_seed(0)
    linear = nn.Linear(dim, dim, device=device)
    x = torch.randn(batch, dim, device=device)
    fused = torch.optim.AdamW(linear.parameters(), lr=1e-4, fused=True)
    candidates = {"nn.Linear fp32 + AdamW(fused)": _linear_step(linear, fused, x)}
    for update in ("adamw", "frugal"):
        for grad_dtype in (torch.float32, torch.bfloat16):
            layer = QuantLinear.from_linear(linear, bits=bits, scale="row", dtype=grad_dtype)
            opt = DQT(layer.parameters(), lr=1e-4, update=update, density=0.25,
                      projection="columns")
            name = (f"QuantLinear {bits}-bit ({str(grad_dtype).replace('torch.', '')} grad) "
                    f"+ DQT {update}")
            candidates[name] = _linear_step(layer, opt, x)
    seconds = measure(candidates, device=device, rounds=rounds)
    base = seconds["nn.Linear fp32 + AdamW(fused)"]
    return {"dim": dim, "batch": batch, "bits": bits, "seconds": seconds,
            "vs_linear_adamw": {name: t / base for name, t in seconds.items()}}


def forward(dim: int = 4096, batches=(4, 2048), bits: int = 4, rounds: int = 15,
            device: torch.device = torch.device("cpu")) -> Dict[str, object]:
    """Median seconds of the forward pass of one ``dim x dim`` layer at each batch size:
    QuantLinear (``bits``, per-row scales; ``ops.quant_matmul`` on the GPU) against
    ``nn.Linear`` of the input's dtype, fp32 and bf16, in the same rounds. A small batch
    is bound by reading the weight (``bits / 8`` bytes per weight against 4 or 2), a
    large one by the products. ``{"skipped": reason}`` on a device other than CUDA."""
    if device.type != "cuda":
        return {"skipped": FORWARD_SKIPPED}
    torch.manual_seed(0)
    linear = nn.Linear(dim, dim, device=device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        dense = nn.Linear(dim, dim, device=device, dtype=dtype)
        quant = QuantLinear.from_linear(linear, bits=bits, scale="row", dtype=dtype)
        for batch in batches:
            x = torch.randn(batch, dim, device=device, dtype=dtype)
            candidates = {"nn.Linear": lambda: dense(x), "QuantLinear": lambda: quant(x)}
            with torch.no_grad():
                seconds = measure(candidates, device=device, rounds=rounds)
            rows.append({"dtype": name, "batch": batch, "linear_s": seconds["nn.Linear"],
                         "quant_s": seconds["QuantLinear"],
                         "vs_linear": seconds["QuantLinear"] / seconds["nn.Linear"]})
    return {"dim": dim, "bits": bits, "rows": rows}
