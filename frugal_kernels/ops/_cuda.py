"""What the cuda backend of every op needs from torch: the stream and device scalars."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor


@contextlib.contextmanager
def launch_context(device: torch.device) -> Iterator[int]:
    """Make ``device`` current and give the raw handle of its current stream."""
    with torch.cuda.device(device):
        yield torch.cuda.current_stream(device).cuda_stream


def device_scalar(t: Tensor, device: torch.device) -> Tuple[float, int, Optional[Tensor]]:
    """How a kernel reads a scalar: (host value, 0, None) for a host tensor, or
    (0.0, address of a float32 copy on ``device``, that copy) for a device
    tensor, which the kernel then reads without a host sync. The caller keeps
    the copy alive until the launch is queued."""
    if t.device.type == "cpu":
        return float(t), 0, None
    if t.device != device:
        raise ValueError(f"a scalar on {t.device} cannot drive a kernel on {device}")
    f32 = t.to(torch.float32).reshape(())
    return 0.0, f32.data_ptr(), f32
