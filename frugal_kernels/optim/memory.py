"""Handing freed host memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

__all__ = ["release_freed_memory"]


def _glibc_malloc_trim() -> Optional[ctypes._CFuncPtr]:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        trim = ctypes.CDLL(path).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _glibc_malloc_trim()


def release_freed_memory() -> None:
    """Return the heap memory freed by dropped optimizer state to the OS.

    glibc keeps freed blocks for reuse, and after a large free it raises its mmap
    threshold, so later state of the same size is carved from the heap; without a
    trim the process would keep holding state an optimizer has dropped. A no-op
    where glibc is not the C library. Device memory is not touched: CUDA's caching
    allocator reuses it within the process, as torch intends.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
