"""A clear error where plain DDP would meet a QuantLinear's weight placeholder.

DistributedDataParallel's constructor broadcasts every parameter and buffer from rank 0
and writes the result back into each. A QuantLinear's ``weight`` is one element seen
through a stride-0 view of the weight's shape, which cannot be written, and torch then
raises "unsupported operation: more than one element of the written-to tensor refers
to a single memory location. Please clone() the tensor", advice that does not apply.
The recipe that works (DDP's initial broadcast off) is in docs/integration.md.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["guard_ddp_broadcast"]

_MESSAGE = (
    "DistributedDataParallel cannot broadcast a frugal_kernels QuantLinear's weight: it is "
    "a placeholder (one element seen through a stride-0 view; the weight lives in the "
    "module's codes), which cannot be written. Wrap the model with "
    "DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False) and build "
    "it alike on every rank (same seed): docs/integration.md, \"DQT under DDP\"")


def guard_ddp_broadcast() -> None:
    """Make DDP's initial broadcast refuse a self-overlapping parameter or buffer (a
    QuantLinear's placeholder) with the recipe, before it writes anything. Installed
    once, by the first QuantLinear; other modules broadcast unchanged."""
    if not torch.distributed.is_available():
        return
    import torch.distributed.utils as dist_utils

    original = getattr(dist_utils, "_sync_params_and_buffers", None)
    if original is None or getattr(original, "_frugal_guard", False):
        return

    @functools.wraps(original)
    def _sync_params_and_buffers(process_group, module_states, *args, **kwargs):
        # 1: torch's MemOverlap::Yes, a tensor whose elements share memory.
        if any(torch._debug_has_internal_overlap(t) == 1 for t in module_states):
            raise RuntimeError(_MESSAGE)
        return original(process_group, module_states, *args, **kwargs)

    _sync_params_and_buffers._frugal_guard = True
    dist_utils._sync_params_and_buffers = _sync_params_and_buffers
