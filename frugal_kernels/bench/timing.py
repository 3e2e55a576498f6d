"""Timing that survives a noisy machine: candidates measured side by side.

Every round runs each candidate once, in turn, so that slow phases of a
shared machine hit all of them alike; the median over rounds is reported.
On a GPU each run is timed with CUDA events.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    if device.type == "cuda":
        def cuda_time(fn):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def cpu_time(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return cpu_time


def measure(candidates: Dict[str, Callable[[], None]], *, device: torch.device, rounds: int = 15,
            warmup: int = 2, setup: Optional[Dict[str, Callable[[], None]]] = None) -> Dict[str, float]:
    """Median seconds per call of each candidate, measured in interleaved rounds.

    ``setup[name]`` (untimed) runs before each timed call of ``name``.
    """
    samples = measure_rounds(candidates, device=device, rounds=rounds, warmup=warmup,
                             setup=setup)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure_rounds(candidates: Dict[str, Callable[[], None]], *, device: torch.device,
                   rounds: int = 15, warmup: int = 2,
                   setup: Optional[Dict[str, Callable[[], None]]] = None
                   ) -> Dict[str, List[float]]:
    """Seconds of each call of each candidate, one per round (see :func:`measure`): round
    ``i`` of every candidate ran back to back, so their ratio in that round is measured
    under the same load."""
    timer = _timer(device)
    setup = setup or {}
    for _ in range(warmup):
        for name, fn in candidates.items():
            setup.get(name, _noop)()
            fn()
    samples: Dict[str, list] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            setup.get(name, _noop)()
            samples[name].append(timer(fn))
    return samples


def ratio_spread(numerator: List[float], denominator: List[float]) -> List[float]:
    """The quartiles [q1, q3] of the per-round ratio ``numerator[i] / denominator[i]``: how
    much a ratio moved from round to round (its median is the reported ratio's peer)."""
    ratios = sorted(n / d for n, d in zip(numerator, denominator))
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q1, q3]


def _noop() -> None:
    pass
