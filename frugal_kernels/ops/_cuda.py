"""What the cuda backend of every op needs from torch: the stream and device scalars."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor

from frugal_kernels.ops._common import Hyper


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


@contextlib.contextmanager
def launch(ext: Any, hyper: Hyper, device: torch.device) -> Iterator[Tuple[Any, Any, int]]:
    """Make ``device`` current and give what a ``_C.<op>_cuda`` entry point
    takes besides the tensors: the hyper-parameter struct, its
    ``DeviceScalars`` (the tensor fields of ``hyper`` that live on the device,
    see :func:`device_scalar`; their copies live until the block ends) and the
    raw handle of the device's current stream."""
    with torch.cuda.device(device):
        values, pointers, alive = {}, {}, []
        for name, value in hyper.values().items():
            if isinstance(value, Tensor):
                values[name], pointers[name], copy = device_scalar(value, device)
                alive.append(copy)
        yield (hyper.kernel(ext, values), ext.DeviceScalars(**pointers),
               torch.cuda.current_stream(device).cuda_stream)
