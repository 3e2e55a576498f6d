"""Handing the memory of dropped optimizer state back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Iterable

import torch

__all__ = ["release_freed_memory", "storage_bytes"]


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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views and aliases count once; a
    DTensor counts its local block's storage (this rank's bytes)."""
    from frugal_kernels.optim.sharding import local

    storages = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
