"""Memory of a whole training step, ordinary versus the step in backward.

A LLaMA-shaped model (the ``20m`` preset: 19.6M parameters, vocabulary 32000) takes a
few training steps on random tokens; one more step (forward, backward, optimizer step,
``zero_grad``) is measured in two ways:

- what it holds: the bytes of the parameters, gradients and optimizer state alive at
  once, and, separately, those with the tensors autograd saved for backward (the
  activations), each storage counted once. Sampled at the end of the forward pass, at
  every parameter's post-accumulate-grad hook (registered before the step's own, so it
  sees each gradient complete), after backward and after the step; the most over the
  samples is reported. Temporaries of the kernels are not tensors anyone holds, so
  they show only in the second measure:
- the process's resident-memory high-water mark during the step (Linux VmHWM, reset
  before it), beside the resident memory at its start; on a GPU,
  ``torch.cuda.max_memory_allocated`` instead. Every configuration runs in a fresh
  process, so that none inherits another's freed heap.

Each optimizer runs twice, with the ordinary step and with
:func:`frugal_kernels.step_in_backward`; the ratios are against ordinary torch AdamW
(fused). See docs/benchmarks.md for the figures recorded in bench/results/.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM
from frugal_kernels.optim.memory import PeakMemory, release_freed_memory, storage_bytes

__all__ = ["OPTIMIZERS", "SHAPES", "TARGET", "measure_step", "step_memory"]

# The bar: in-backward FRUGAL rho=0.25 holding at most this fraction of the
# parameter, gradient and state bytes of an ordinary torch AdamW step.
TARGET = 0.55
_HYPER = dict(lr=1e-4, weight_decay=0.01)


def _torch_adamw(model: nn.Module, in_backward: bool) -> torch.optim.Optimizer:
    if in_backward:
        # Swapped onto the fused ops: a torch optimizer steps in backward that way.
        return fk.swap(torch.optim.AdamW(model.parameters(), **_HYPER))
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    return torch.optim.AdamW(model.parameters(), fused=fused or None, **_HYPER)


# How the parameters are split: the paper's (embeddings, norms and head with full AdamW),
# the embeddings projected too (the FRUGAL paper found the embeddings far less sensitive to
# the state-free rule than the output head, which keeps AdamW), or every matrix projected.
_GROUPING = {"paper": {}, "embeddings": dict(project_embeddings=True),
             "all": dict(project_embeddings=True, project_head=True)}


def _frugal(density: float, projection: str = "blocks",
            grouping: str = "paper") -> Callable[[nn.Module, bool], torch.optim.Optimizer]:
    def make(model: nn.Module, in_backward: bool) -> torch.optim.Optimizer:
        # nonfinite="raise" in both modes ("skip" needs every gradient first).
        return fk.FRUGAL(fk.param_groups(model, **_GROUPING[grouping]), density=density,
                         update_gap=200, projection=projection, nonfinite="raise", **_HYPER)
    return make


# name -> (label, factory(model, in_backward)). Every one runs ordinary and in backward.
OPTIMIZERS: Dict[str, tuple] = {
    "torch_adamw": ("torch AdamW", _torch_adamw),
    "frugal_rho0.25": ("FRUGAL rho=0.25 (blocks)", _frugal(0.25)),
    "frugal_rho0": ("FRUGAL rho=0", _frugal(0.0)),
    "frugal_rho0.25_embeddings_projected": (
        "FRUGAL rho=0.25 (columns), embeddings projected too",
        _frugal(0.25, projection="columns", grouping="embeddings")),
    "frugal_rho0.25_all_projected": (
        "FRUGAL rho=0.25 (columns), embeddings and head projected too",
        _frugal(0.25, projection="columns", grouping="all")),
}


class _Held:
    """The most bytes of parameters + gradients + state, and of those with the saved
    activations, alive at once over the samples taken while ``tracking``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer):
        self.params = list(model.parameters())
        self.opt = opt
        self.saved: List[weakref.ref] = []
        self.tracking = False
        self.peak = {"params_grads_state": 0, "with_activations": 0}
        self.at_peak: Dict[str, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.tracking:
            self.saved.append(weakref.ref(t))
        return t  # kept by the graph as it is: the weak reference follows its life

    def sample(self, *unused) -> None:
        if not self.tracking:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        state = [v for st in self.opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor)]
        saved = [t for t in (ref() for ref in self.saved) if t is not None]
        held = storage_bytes(self.params + grads + state)
        with_activations = storage_bytes(self.params + grads + state + saved)
        if held > self.peak["params_grads_state"]:
            self.peak["params_grads_state"] = held
            self.at_peak = {"params": storage_bytes(self.params), "grads": storage_bytes(grads),
                            "state": storage_bytes(state)}
        self.peak["with_activations"] = max(self.peak["with_activations"], with_activations)


def measure_step(preset: str = "20m", name: str = "torch_adamw", in_backward: bool = False,
                 batch_size: int = 4, seq_len: int = 128, warmup_steps: int = 2,
                 device: str = "cpu", seed: int = 0) -> dict:
    """Train ``warmup_steps`` steps, then measure one whole step (module docstring)."""
    torch.manual_seed(seed)
    dev = torch.device(device)
    config = LlamaConfig.from_preset(preset, max_seq_len=seq_len)
    model = LlamaForCausalLM(config, seed=seed).to(dev)
    label, make = OPTIMIZERS[name]
    opt = make(model, in_backward)
    held = _Held(model, opt)
    # Before the step's own hooks, so that each sample sees the gradient just completed.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(held.sample)
    handle = fk.step_in_backward(opt) if in_backward else None
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen)
               for _ in range(warmup_steps + 1)]

    def step(ids: torch.Tensor) -> float:
        ids = ids.to(dev)
        with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        held.sample()
        loss.backward()
        held.sample()
        opt.step()
        held.sample()
        opt.zero_grad(set_to_none=True)
        return loss.detach().item()

    for ids in batches[:-1]:
        step(ids)
    del ids
    gc.collect()
    release_freed_memory()
    peak = PeakMemory(dev)
    before = peak.current()
    held.tracking = True
    loss = step(batches[-1])
    held.tracking = False
    high = peak.read()
    num_params = sum(p.numel() for p in model.parameters())
    if handle is not None:
        handle.remove()
    return {"optimizer": name, "label": label,
            "mode": "in_backward" if in_backward else "ordinary",
            "preset": preset, "num_params": num_params, "batch_size": batch_size,
            "seq_len": seq_len, "loss": loss,
            "held_bytes": held.peak["params_grads_state"],
            "held_parts": held.at_peak,
            "held_with_activations_bytes": held.peak["with_activations"],
            "peak_kind": peak.kind, "memory_at_start": before, "memory_peak": high}


def _in_fresh_process(**kwargs) -> dict:
    """:func:`measure_step` in a new Python process (nothing inherited but the environment),
    its result read back as JSON."""
    code = ("import json, sys; from frugal_kernels.bench.in_backward import measure_step; "
            "print(json.dumps(measure_step(**json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {kwargs} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# (batch size, sequence length) of the measured steps: few tokens, where the weights,
# gradients and state are most of a step's memory, and more, where the activations
# (the logits over 32000 tokens above all) take over.
SHAPES = ((1, 64), (4, 128))


def step_memory(preset: str = "20m", *, names: Optional[List[str]] = None,
                shapes=SHAPES, device: str = "cpu", fresh_processes: bool = True,
                progress=None) -> dict:
    """Every optimizer of :data:`OPTIMIZERS` (or ``names``), ordinary and in backward, at
    every (batch size, sequence length) of ``shapes``; rows with their ratios to ordinary
    torch AdamW at the same shape, and the target's verdict."""
    rows = []
    for batch_size, seq_len in shapes:
        for name in names or list(OPTIMIZERS):
            for in_backward in (False, True):
                kwargs = dict(preset=preset, name=name, in_backward=in_backward,
                              batch_size=batch_size, seq_len=seq_len, device=device)
                rows.append(_in_fresh_process(**kwargs) if fresh_processes
                            else measure_step(**kwargs))
                if progress is not None:
                    progress.update(1)
    verdicts = []
    for batch_size, seq_len in shapes:
        same = [r for r in rows if (r["batch_size"], r["seq_len"]) == (batch_size, seq_len)]
        base = _row(same, "torch_adamw", "ordinary")
        for r in same:
            r["held_vs_torch_adamw"] = r["held_bytes"] / base["held_bytes"] if base else None
            r["peak_above_start"] = r["memory_peak"] - r["memory_at_start"]
        target = _row(same, "frugal_rho0.25", "in_backward")
        if base is not None and target is not None:
            verdicts.append({"batch_size": batch_size, "seq_len": seq_len,
                             "ratio": target["held_vs_torch_adamw"], "target": TARGET,
                             "met": target["held_vs_torch_adamw"] <= TARGET})
    return {"preset": preset, "device": device, "fresh_processes": fresh_processes,
            "rows": rows, "target": verdicts}


def _row(rows: List[dict], name: str, mode: str) -> Optional[dict]:
    return next((r for r in rows if r["optimizer"] == name and r["mode"] == mode), None)
