"""Input checks and argument conversion shared by every op.

Every check here looks at metadata only (lengths, dtypes, devices, shapes,
layout), so the same function serves the real kernels and the fake (meta)
kernels that torch.compile traces with. Checks run before anything is
written: a call that raises leaves every tensor as it was.

Each op builds one hyper-parameter record (a :class:`Hyper`) per call and
hands every backend its tensors and that record; the ``_C`` entry points take
the same record as a struct, with the tensors as a ``TensorBatch``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from frugal_kernels._layout import (DTYPE_CODES, PARAM_DTYPES, STATE_FREE_CODES,
                                    SUBSET_KIND_CODES, first_overlap, matrix_view)


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


def check_amp(op: str, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    """GradScaler's tensors, when given: one-element floating-point tensors."""
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
        if t.numel() != 1:
            raise ValueError(f"{op}: {name} must have one element, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def skipped_on_host(found_inf: Optional[Tensor]) -> bool:
    """A found_inf that lives on the host and is set: the op returns at once.
    One on a device is left to the kernels, which read it there (no sync)."""
    return found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf)


def check_finite(op: str, **values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value):
            raise ValueError(f"{op}: {name} must be finite, got {value}")


def host_value(t: Tensor) -> float:
    """A scalar tensor's value on the host (a device sync if it lives on a GPU)."""
    return float(t.item())



# ------------------------------------------------------- hyper-parameters

# Hyper-parameters the kernels take as the codes of csrc's enums, not by name.
_KERNEL_CODES = {"state_free": STATE_FREE_CODES}
# What the kernels take for an optional hyper-parameter that is not given: no
# GradScaler is a scale of 1 and no inf found.
_KERNEL_DEFAULTS = {"grad_scale": 1.0, "found_inf": 0.0}


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The hyper-parameters of one op call, built once in the op body.

    One subclass per op, made from the op's declaration
    (:class:`frugal_kernels.ops._spec.OpSpec`); its fields are the scalars of the
    op schema under their schema names (``lr`` and ``step`` as the schema's 0-dim
    tensors), and its name is the name of its struct in ``_C``. Every backend
    takes the op's tensors and this record and passes the record on in the form
    it needs, so a new hyper-parameter touches the op's declaration, the struct
    and the math, and no backend.
    """

    def values(self) -> Dict[str, Any]:
        """The fields as keywords, tensors as given (the Triton wrappers' arguments)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def on_host(self) -> Dict[str, Any]:
        """The fields as keywords, tensors as Python floats (the reference's arguments)."""
        return {name: host_value(v) if isinstance(v, Tensor) else v
                for name, v in self.values().items()}

    def kernel(self, ext: Any, scalars: Optional[Mapping[str, float]] = None) -> Any:
        """The record as its ``_C`` struct. ``scalars`` gives the values of the
        tensor fields (default: read on the host); rule names become codes."""
        values = self.on_host() if scalars is None else {**self.values(), **scalars}
        for name, default in _KERNEL_DEFAULTS.items():
            if name in values and values[name] is None:
                values[name] = default
        for name, codes in _KERNEL_CODES.items():
            if name in values:
                values[name] = codes[values[name]]
        return getattr(ext, type(self).__name__)(**values)


# ------------------------------------------------------------ _C arguments

def addresses(tensors: Sequence[Tensor]) -> list:
    return [t.data_ptr() for t in tensors]


def numels(tensors: Sequence[Tensor]) -> list:
    return [t.numel() for t in tensors]


class GatheredBatch:
    """A call's ``_C.TensorBatch`` but for its gradients: the dtype of params[0], the
    sizes and the addresses of the params and moments, gathered once (a prepared call,
    :mod:`frugal_kernels.ops.prepared`, keeps it across calls)."""

    def __init__(self, params: Sequence[Tensor], exp_avgs: Sequence[Tensor] = (),
                 exp_avg_sqs: Sequence[Tensor] = ()):
        self.dtype = DTYPE_CODES[params[0].dtype]
        self.numel = numels(params)
        self.params = addresses(params)
        self.exp_avgs = addresses(exp_avgs)
        self.exp_avg_sqs = addresses(exp_avg_sqs)

    def with_grads(self, ext: Any, grads: Sequence[int]) -> Any:
        """The ``_C.TensorBatch`` with the gradients at ``grads`` (addresses)."""
        return ext.TensorBatch(dtype=self.dtype, numel=self.numel, params=self.params,
                               grads=grads, exp_avgs=self.exp_avgs,
                               exp_avg_sqs=self.exp_avg_sqs)


def kernel_batch(ext: Any, params: Sequence[Tensor], grads: Sequence[Tensor],
                 exp_avgs: Sequence[Tensor] = (), exp_avg_sqs: Sequence[Tensor] = ()) -> Any:
    """The tensors of one call as a ``_C.TensorBatch`` (the dtype of params[0])."""
    return GatheredBatch(params, exp_avgs, exp_avg_sqs).with_grads(ext, addresses(grads))


def subset_batch(ext: Any, params: Sequence[Tensor], indices: Sequence[Tensor],
                 subset_kind: str) -> Any:
    """The state-full subsets of a frugal step as a ``_C.SubsetBatch``: each
    tensor seen as the [R, C] matrix the kernels walk (``matrix_view``)."""
    views = [matrix_view(p, subset_kind) for p in params]
    return ext.SubsetBatch(kind=SUBSET_KIND_CODES[subset_kind],
                           index_is_int32=indices[0].dtype == torch.int32,
                           indices=addresses(indices), rows=[r for _, r, _ in views],
                           cols=[c for _, _, c in views], k=numels(indices))


def check_no_overlap(op: str, written: Mapping[str, Sequence[Tensor]],
                     read: Mapping[str, Sequence[Tensor]]) -> None:
    """Refuse a call in which a tensor it writes shares memory with any other tensor of
    the call (the same tensor as param and grad, one moment twice, a param listed twice,
    overlapping views). The backends would disagree on such a call, each reading values
    another pass has already written. Real tensors only (the fake kernel has no memory)."""
    clash = first_overlap((t, is_written, (name, i))
                          for is_written, lists in ((True, written), (False, read))
                          for name, tensors in lists.items() for i, t in enumerate(tensors))
    if clash is not None:
        (later, i), (earlier, j) = clash
        raise ValueError(f"{op}: {later}[{i}] shares memory with {earlier}[{j}]; the op "
                         "writes in place, so every tensor it writes must have memory of its "
                         "own")
