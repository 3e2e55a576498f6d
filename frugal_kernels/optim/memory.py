"""Handing the memory of dropped optimizer state back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import resource
import sys
from typing import Iterable, List

import torch

__all__ = ["PeakMemory", "memory_of", "release_freed_memory", "storage_bytes"]


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    glibc keeps freed heap memory for reuse, and its mmap threshold grows after
    large frees, so a process that drops optimizer state (a subspace that
    shrinks, a block that goes inactive) would keep its resident size; this
    hands the freed pages back. CUDA memory is not concerned: torch's caching
    allocator keeps that (``torch.cuda.empty_cache`` releases it).
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def memory_of(t: torch.Tensor) -> List[torch.Tensor]:
    """The tensors whose memory ``t`` is: a DTensor's local block, a wrapper subclass's
    inner tensors (a QuantWeight's codes and scales: it owns no storage), else ``t``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from frugal_kernels._shard import local

    block = local(t)
    if is_traceable_wrapper_subclass(block):
        names, _ = block.__tensor_flatten__()
        return [inner for name in names for inner in memory_of(getattr(block, name))]
    return [block]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views and aliases count once; a
    DTensor counts its local block's storage (this rank's bytes), a QuantWeight its codes'
    and scales'."""
    storages = {}
    for t in tensors:
        for block in memory_of(t):
            storage = block.untyped_storage()
            storages[(block.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class PeakMemory:
    """Peak memory from now on: CUDA's allocator high-water mark on a GPU, else the process's
    resident-set high-water mark (VmHWM).

    tracemalloc would miss torch's allocations, so the CPU figure is the whole process's RSS,
    model and libraries included. Linux resets VmHWM on request (clear_refs), so each run
    starts its own; where that fails, ``kind`` says the peak covers the process's lifetime.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.kind = "cuda_max_allocated"
            return
        gc.collect()
        # Without this, heap memory freed by an earlier run stays resident and sets the floor.
        release_freed_memory()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.kind = "rss_peak"
        except OSError:
            self.kind = "rss_peak_since_process_start"

    def read(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        try:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
        except (OSError, AttributeError):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, else kB

    def current(self) -> int:
        """Memory in use now: CUDA's allocated bytes, else the process's resident set (VmRSS;
        0 where /proc is missing)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        try:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
        except (OSError, AttributeError):
            return 0
