"""Input checks and argument conversion shared by every op.

Every check here looks at metadata only (lengths, dtypes, devices, shapes,
layout), so the same function serves the real kernels and the fake (meta)
kernels that torch.compile traces with. Checks run before anything is
written: a call that raises leaves every tensor as it was.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from frugal_kernels._layout import PARAM_DTYPES


Scalar = Union[float, int, Tensor]


def check_batch(
    op: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Mapping[str, Sequence[Tensor]],
    state_shape: Optional[Callable[[int, Tensor], Sequence[int]]] = None,
) -> None:
    """Check lists of params, grads and fp32 states that one call updates together.

    ``state_shape(i, params[i])`` gives the shape each state tensor of item i
    must have (default: the param's shape).
    """
    n = len(params)
    for name, tensors in (("grads", grads), *states.items()):
        if len(tensors) != n:
            raise ValueError(f"{op}: got {n} params but {len(tensors)} {name}; "
                             "the lists must have one entry per param")
    if n == 0:
        return
    first = params[0]
    _check_is_tensor(op, "params", 0, first)
    if first.dtype not in PARAM_DTYPES:
        raise TypeError(f"{op}: params[0] has dtype {first.dtype}; supported dtypes are "
                        "torch.float32, torch.bfloat16 and torch.float16")
    for i, p in enumerate(params):
        _check_is_tensor(op, "params", i, p)
        if p.dtype != first.dtype:
            raise TypeError(f"{op}: params[{i}] has dtype {p.dtype} but params[0] has "
                            f"{first.dtype}; one call takes tensors of one dtype")
        _check_device(op, "params", i, p, first.device)
        _check_contiguous(op, "params", i, p)
        g = grads[i]
        _check_is_tensor(op, "grads", i, g)
        if g.dtype != p.dtype:
            raise TypeError(f"{op}: grads[{i}] has dtype {g.dtype} but params[{i}] has {p.dtype}")
        _check_device(op, "grads", i, g, first.device)
        if g.shape != p.shape:
            raise ValueError(f"{op}: grads[{i}] has shape {tuple(g.shape)} but params[{i}] "
                             f"has shape {tuple(p.shape)}")
        expected = tuple(state_shape(i, p)) if state_shape is not None else tuple(p.shape)
        for name, tensors in states.items():
            s = tensors[i]
            _check_is_tensor(op, name, i, s)
            if s.dtype != torch.float32:
                raise TypeError(f"{op}: {name}[{i}] has dtype {s.dtype}; optimizer states "
                                "are torch.float32")
            _check_device(op, name, i, s, first.device)
            _check_contiguous(op, name, i, s)
            if tuple(s.shape) != expected:
                raise ValueError(f"{op}: {name}[{i}] has shape {tuple(s.shape)} but must have "
                                 f"shape {expected}")


def _check_is_tensor(op: str, name: str, i: int, t: object) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor")


def _check_device(op: str, name: str, i: int, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{op}: {name}[{i}] is on {t.device} but params[0] is on {device}; "
                         "one call takes tensors on one device")


def _check_contiguous(op: str, name: str, i: int, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name}[{i}] is not contiguous; the op updates it in place "
                         "and needs it contiguous (call .contiguous() on the tensor you own)")


def as_scalar_tensor(op: str, name: str, value: Scalar) -> Tensor:
    """``lr`` or ``step`` as the 0-dim tensor the op schema takes."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must be a number or a one-element tensor, got a "
                             f"tensor of shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{op}: {name} must be real, got dtype {value.dtype}")
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number or a tensor, got {type(value).__name__}")
    return torch.tensor(float(value), dtype=torch.float64)


def check_scalars(op: str, lr: Tensor, step: Optional[Tensor] = None) -> None:
    """Value checks of lr and step where they live on the host (no device sync)."""
    if lr.device.type == "cpu" and not math.isfinite(float(lr)):
        raise ValueError(f"{op}: lr must be finite, got {float(lr)}")
    if step is not None and step.device.type == "cpu" and not float(step) >= 1:
        raise ValueError(f"{op}: step counts updates from 1 (the count after this update), "
                         f"got {float(step)}")


def check_finite(op: str, **values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value):
            raise ValueError(f"{op}: {name} must be finite, got {value}")


def host_value(t: Tensor) -> float:
    """A scalar tensor's value on the host (a device sync if it lives on a GPU)."""
    return float(t.item())


def addresses(tensors: Sequence[Tensor]) -> list:
    return [t.data_ptr() for t in tensors]


def numels(tensors: Sequence[Tensor]) -> list:
    return [t.numel() for t in tensors]
