"""Memory and time of the fused linear cross-entropy against the unfused loss.

One training step of the output layer and its loss, forward and backward, two ways:

- unfused: ``F.cross_entropy(hidden @ weight.T, targets)`` then ``backward()``: it holds
  the ``[N, V]`` logits and their log-softmax, then their gradients (about
  ``2 x N x V x 4`` bytes in fp32);
- fused: ``ops.linear_cross_entropy(hidden, weight, targets)`` then ``backward()``.

Peak memory beyond what any implementation must hold (the inputs, and the gradients of
hidden and weight it returns) is measured in a fresh process per row, after a warm-up
step: on the CPU the process's resident high-water mark (``PeakMemory``: Linux VmHWM,
reset before the step, freed heap handed back first) minus the resident memory at the
step's start; on a GPU ``torch.cuda.max_memory_allocated`` minus the allocated bytes at
the start. Time is the median of ``rounds`` steps of each, the two alternating in one
process, with the load average beside it (a loaded machine slows both).

Targets (issue 30): peak beyond inputs and gradients at most 1/8 of the unfused loss's at
vocabularies of 32k and beyond; time at most 1.2x the unfused loss's on the CPU.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from frugal_kernels import ops
from frugal_kernels.optim.memory import PeakMemory, release_freed_memory

__all__ = ["CPU_SHAPES", "GPU_SHAPES", "MEMORY_TARGET", "TIME_TARGET", "markdown_lines",
           "measure_memory", "run", "shapes_for"]

MEMORY_TARGET = 1 / 8
TIME_TARGET = 1.2
# (tokens N, hidden size D, vocabularies): LLaMA-2's and LLaMA-3's vocabularies.
CPU_SHAPES = ((2048, 512, (32000, 128256)),)
GPU_SHAPES = ((8192, 4096, (32000, 128256)),)
QUICK_SHAPES = ((512, 128, (32000,)),)
IMPLS = ("unfused", "fused")


def _inputs(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d ** 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets


def _step(impl: str) -> Callable:
    def unfused(hidden, weight, targets):
        # Logits in the inputs' dtype, the loss in fp32, as a model would (model.py).
        F.cross_entropy((hidden @ weight.t()).float(), targets).backward()

    def fused(hidden, weight, targets):
        ops.linear_cross_entropy(hidden, weight, targets)[0].backward()

    return {"unfused": unfused, "fused": fused}[impl]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(impl: str, n: int, d: int, v: int, dtype: str = "float32",
                   device: str = "cpu") -> dict:
    """Peak bytes of one step of ``impl`` beyond its inputs and returned gradients (in
    this process: :func:`run` calls it in a fresh one per row)."""
    dev = torch.device(device)
    hidden, weight, targets = _inputs(n, d, v, getattr(torch, dtype), dev)
    step = _step(impl)
    step(hidden, weight, targets)  # warm-up: libraries, allocator pools, kernels
    hidden.grad = weight.grad = None
    gc.collect()
    release_freed_memory()
    _sync(dev)
    peak = PeakMemory(dev)
    start = peak.current()
    step(hidden, weight, targets)
    _sync(dev)
    high = peak.read()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, weight))
    return {"impl": impl, "peak_kind": peak.kind, "memory_at_start": start,
            "memory_peak": high, "grad_bytes": grads,
            "beyond_bytes": max(0, high - start - grads)}


def _memory_in_fresh_process(**kwargs) -> dict:
    code = ("import json, sys; from frugal_kernels.bench.loss import measure_memory; "
            "print(json.dumps(measure_memory(**json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {kwargs} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _times(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
           rounds: int) -> Dict[str, List[float]]:
    hidden, weight, targets = _inputs(n, d, v, dtype, device)
    seconds: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    for r in range(rounds + 1):
        # Alternating, so that a change of the machine's load hits both alike; the first
        # round warms up.
        for impl in IMPLS:
            hidden.grad = weight.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _step(impl)(hidden, weight, targets)
            _sync(device)
            if r:
                seconds[impl].append(time.perf_counter() - t0)
    return seconds


def shapes_for(device: torch.device, quick: bool = False) -> Sequence:
    """The (N, D, vocabularies) a run measures on ``device``."""
    return QUICK_SHAPES if quick else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)


def run(device: torch.device, *, quick: bool = False, rounds: int = 3,
        shapes: Optional[Sequence] = None, fresh_processes: bool = True,
        progress=None) -> dict:
    """Every (N, D, V) of ``shapes`` (default :func:`shapes_for`): peak beyond inputs and
    gradients and the median time of forward + backward, fused and unfused, with the
    ratios and targets."""
    if shapes is None:
        shapes = shapes_for(device, quick)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rows = []
    for n, d, vocabs in shapes:
        for v in vocabs:
            row = {"tokens": n, "dim": d, "vocab": v, "dtype": dtype,
                   "load_before": list(os.getloadavg())}
            for impl in IMPLS:
                kwargs = dict(impl=impl, n=n, d=d, v=v, dtype=dtype, device=device.type)
                row[impl] = (_memory_in_fresh_process(**kwargs) if fresh_processes
                             else measure_memory(**kwargs))
            seconds = _times(n, d, v, getattr(torch, dtype), device, rounds)
            for impl in IMPLS:
                row[impl]["seconds"] = seconds[impl]
                row[impl]["median_s"] = statistics.median(seconds[impl])
            row["load_after"] = list(os.getloadavg())
            base = row["unfused"]["beyond_bytes"]
            row["memory_ratio"] = row["fused"]["beyond_bytes"] / base if base else None
            row["time_ratio"] = row["fused"]["median_s"] / row["unfused"]["median_s"]
            row["memory_met"] = row["memory_ratio"] is not None and \
                row["memory_ratio"] <= MEMORY_TARGET
            row["time_met"] = row["time_ratio"] <= TIME_TARGET
            rows.append(row)
            if progress is not None:
                progress.update(1)
    return {"device": device.type, "threads": torch.get_num_threads(), "rounds": rounds,
            "memory_target": MEMORY_TARGET, "time_target": TIME_TARGET, "rows": rows}


def markdown_lines(result: Optional[dict]) -> List[str]:
    """The section's table for the run's report."""
    if not result:
        return []
    lines = ["## Fused linear cross-entropy (forward + backward)", "",
             f"Against `F.cross_entropy(hidden @ weight.T, targets)` on {result['device']} "
             f"({result['threads']} threads), median of {result['rounds']} alternating "
             "rounds. Peak: bytes beyond the inputs and the returned gradients of hidden "
             f"and weight (target <= {result['memory_target']:.3f} of unfused); time "
             f"target <= {result['time_target']}x unfused.", "",
             "| N x D x V | dtype | unfused peak MiB | fused peak MiB | ratio | unfused s | "
             "fused s | ratio | load (1 min) |", "|" + "---|" * 9]
    mib = 1 / (1 << 20)
    for r in result["rows"]:
        ratio = "n/a" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
        lines.append(
            f"| {r['tokens']} x {r['dim']} x {r['vocab']} | {r['dtype']} | "
            f"{r['unfused']['beyond_bytes'] * mib:.0f} | {r['fused']['beyond_bytes'] * mib:.0f}"
            f" | {ratio} | {r['unfused']['median_s']:.3f} | {r['fused']['median_s']:.3f} | "
            f"{r['time_ratio']:.2f} | {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f} |")
    return lines + [""]
