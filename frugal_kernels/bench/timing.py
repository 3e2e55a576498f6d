"""Timing that survives a noisy machine: candidates measured side by side.

Every round runs each candidate once, in turn, so that slow phases of a
shared machine hit all of them alike; the median over rounds is reported.
On a GPU each run is timed with CUDA events.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional

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
    return {name: statistics.median(s) for name, s in samples.items()}


def _noop() -> None:
    pass
