"""A clear error where plain DDP would meet a QuantLinear's weight.

DistributedDataParallel's constructor broadcasts every parameter and buffer from rank 0
and writes the result back into each, flattened into one buffer. A QuantLinear's
``weight`` is a QuantWeight, packed codes and scales with no float values of its own,
which that flattening cannot take: torch then raises from its C++ code ("Tensors must
have same number of dimensions"), which says nothing of the cause. The recipe that works
(DDP's initial broadcast off) is in docs/integration.md.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["guard_ddp_broadcast"]

_MESSAGE = (
    "DistributedDataParallel cannot broadcast a frugal_kernels QuantLinear's weight: it is "
    "a QuantWeight (packed codes and scales, no float values of its own), which DDP's "
    "flattened broadcast cannot take. Wrap the model with "
    "DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False) and build "
    "it alike on every rank (same seed): docs/integration.md, \"DQT under DDP\"")


def guard_ddp_broadcast() -> None:
    """Make DDP's initial broadcast refuse a QuantWeight with the recipe, before it
    writes anything. Installed once, by the first QuantLinear; other modules broadcast
    unchanged."""
    from frugal_kernels.nn.quant_weight import QuantWeight

    if not torch.distributed.is_available():
        return
    import torch.distributed.utils as dist_utils

    original = getattr(dist_utils, "_sync_params_and_buffers", None)
    if original is None or getattr(original, "_frugal_guard", False):
        return

    @functools.wraps(original)
    def _sync_params_and_buffers(process_group, module_states, *args, **kwargs):
        if any(isinstance(t, QuantWeight) for t in module_states):
            raise RuntimeError(_MESSAGE)
        return original(process_group, module_states, *args, **kwargs)

    _sync_params_and_buffers._frugal_guard = True
    dist_utils._sync_params_and_buffers = _sync_params_and_buffers
