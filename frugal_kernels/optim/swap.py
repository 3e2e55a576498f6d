"""``swap(optimizer)``: run an existing torch.optim AdamW, Adam or SGD on the fused ops.

The swap patches the step of the given instance and changes nothing else: the
param groups, their hyper-parameters, ``optimizer.state`` and so
``state_dict()`` keep torch's layout (``step`` as a scalar tensor,
``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so a checkpoint written
before the swap loads after it and the reverse, and every reference to the
optimizer (an LR scheduler, a training loop, hooks) keeps working. The new
step runs torch's step hooks and profiler label as the original does.

Math follows ``torch.optim``'s single-tensor path to rounding: AdamW's
decoupled weight decay is ``adamw_``'s own; Adam's coupled (L2) decay is
added to the gradient first (``g + weight_decay * p``, one extra pass) and
``adamw_`` then runs without decay; SGD runs on ``sgd_``.

The swapped step is built from the step engine's pieces (optim/engine.py,
optim/plan.py): its op calls are the engine's plan (``plan.build`` /
``plan.run`` with the ``adamw`` and ``adamw_int8`` rules, ``coupled`` for
Adam's L2 decay, and the ``sgd`` and ``sgd_first`` rules, kept between steps,
see _group_plan), its option values are checked by
the engine's checks, the skip decision is its ``skip_flag`` and the step
counts are counted and taken back by its ``count_steps`` /
``uncount_skipped``. The state stays torch's (a count per tensor, in torch's
dtype and on torch's device), not the engine's packed counts.

What a swapped step refuses, with a ValueError naming the group and option:
``amsgrad``, ``capturable`` and ``differentiable`` set, option values the
engine refuses (an lr, eps, weight_decay, momentum or dampening not finite and
>= 0, betas outside [0, 1)), sparse gradients, non-contiguous parameters and
parameters that are not float32 (torch keeps their state in the parameter's
dtype, which the fused ops, with float32 state, do not store). The
``foreach`` and ``fused`` flags are ignored: the fused ops replace both
paths (a ``fused`` group's new ``step`` tensors still live where torch's
fused path puts them, on the parameter's device).

A ``fused=True`` torch AdamW / Adam / SGD tells a GradScaler that its step
unscales the gradients and skips on an inf itself (``_step_supports_amp_scaling``):
the swapped step does both as torch's fused step does, with the scaler's
``grad_scale`` and ``found_inf`` handed to the fused ops, decided on the device
(no host sync). The step counts are counted before the update and take a
skipped step back after it, as torch's fused step does, so a skipped step
leaves them as they were (a scaler's sum of two devices' flags counts as one).

The swap also gives the instance ``clip_grad_norm_(max_norm, norm_type=2.0,
error_if_nonfinite=False)``, the step engine's clip: the global norm and the
non-finite flag in one read of the gradients (``ops.grad_norm``), the clip
factor handed to the next step, whose fused ops apply it as they read the
gradients (folded into a GradScaler's scale), and the flag its skip decision
(``found_inf``, with the step counts taken back). A method on the instance, as
the swapped ``step`` is, rather than a free function: the optimizer is the
thing that holds the pending clip until its next step, and a training loop
calls ``opt.clip_grad_norm_`` the same way on every optimizer of the package.
``swap(undo=True)`` removes it with the step (and a clip still pending).
"""

from __future__ import annotations

import dataclasses
import types
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from frugal_kernels import reference
from frugal_kernels._layout import STATE_DTYPES, on_device
from frugal_kernels._shard import RowShard, is_sharded, local
from frugal_kernels.optim import plan, sharding
from frugal_kernels.optim.engine import (by_device, check_adamw_options, check_lr, check_number,
                                       clip_factor, clipped_scale, count_steps,
                                       refuse_clip_in_backward, skip_flag, uncount_skipped)

__all__ = ["SWAPPABLE", "is_swapped", "swap", "tensor_steps"]

# Where the swap keeps what it replaced: the instance's own ``step``
# attribute before the swap (an LR scheduler's wrapper, say), or None.
_SAVED = "_frugal_swap_saved_step"
# Where it keeps the backend of the swapped step.
_BACKEND = "_frugal_swap_backend"
# Where it keeps each group's plan of op calls, and each tensor's that steps in
# backward (see _group_plan).
_CALLS = "_frugal_swap_calls"
_REFUSED = ("amsgrad", "capturable", "differentiable")
# Where clip_grad_norm_ leaves (clip factor, non-finite flag) for the next step.
_CLIP = "_frugal_swap_clip"
# Where a swap with state_dtype="int8" keeps the handles of its state dict hooks.
_INT8_HOOKS = "_frugal_swap_int8_hooks"
_CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def swap(optimizer: Optimizer, *, backend: str = "auto", undo: bool = False,
         state_dtype: str = "fp32") -> Optimizer:
    """Make ``optimizer.step`` run on the fused ops; returns the same optimizer.

    ``optimizer`` is a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` instance (not
    a subclass, whose step may differ). Swapping a swapped optimizer changes
    nothing; ``swap(optimizer, undo=True)`` restores the original step, and the
    state written meanwhile carries over.

    Args:
        backend: the backend of the fused ops ("auto" by default, see
            DESIGN.md section 3).
        undo: restore the original step instead.
        state_dtype: ``"fp32"`` (torch's state), or ``"int8"`` for AdamW / Adam: the
            moments of tensors of two dims or more and at least 4096 elements as 8-bit
            codes with block scales (``ops.adamw_int8_``; docs/optimizers.md), under
            torch's keys (``exp_avg`` int8, ``exp_avg_sq`` uint8) with
            ``exp_avg_scale`` / ``exp_avg_sq_scale`` beside them. The state dict
            records it in each group (``"state_dtype"``), and loading one of another
            state dtype raises a ValueError, the optimizer untouched. ``undo=True``
            turns the 8-bit moments back into fp32 moments for torch's own step.

    Raises:
        TypeError: for an optimizer of another type.
        ValueError: for an option the swapped step does not honour (see the
            module docstring); checked now and again at every step, since
            param groups may change.
        RuntimeError: for ``undo=True`` while the optimizer steps in backward
            (:func:`frugal_kernels.step_in_backward`): ``handle.remove()`` first.
    """
    if undo:
        if _SAVED not in optimizer.__dict__:
            raise ValueError("swap(undo=True): this optimizer was not swapped")
        # Imported here: the step in backward is built on this module.
        from frugal_kernels.optim.in_backward import handle_of

        if handle_of(optimizer) is not None:
            # Its hooks step through the swapped step, and its remove() puts back the
            # optimizer.step it replaced: the swapped one.
            raise RuntimeError("swap(undo=True): this optimizer steps in backward "
                               "(frugal_kernels.step_in_backward); call handle.remove() "
                               "first, then undo the swap")
        saved = optimizer.__dict__.pop(_SAVED)
        for handle in optimizer.__dict__.pop(_INT8_HOOKS, ()):
            handle.remove()
        _dequantize_state(optimizer)
        optimizer.__dict__.pop(_BACKEND, None)
        optimizer.__dict__.pop(_CALLS, None)
        optimizer.__dict__.pop(_CLIP, None)
        del optimizer.step
        del optimizer.clip_grad_norm_
        if saved is not None:
            optimizer.step = saved
        return optimizer
    kind = type(optimizer)
    if kind not in _STEPS:
        raise TypeError(f"swap supports torch.optim.AdamW, Adam and SGD instances, got "
                        f"{kind.__module__}.{kind.__qualname__}")
    if _SAVED in optimizer.__dict__:
        return optimizer
    _check_groups(optimizer, read_device=True)
    _check_state_dtype(optimizer, state_dtype)
    group_step = _STEPS[kind]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # An LR scheduler attached before the swap watches this flag.
        self._opt_called = True
        with_grads = _check_groups(self)
        clip = self.__dict__.pop(_CLIP, None)  # taken by this step, whatever happens below
        amp = _amp(self, with_grads, clip)
        for group in self.param_groups:
            group_step(self, group, backend, amp=amp)
        return loss

    hooked = Optimizer.profile_hook_step(step)
    # Tells LR schedulers made after the swap that this step already sets
    # _opt_called (they would otherwise wrap it again).
    hooked._wrapped_by_lr_sched = True
    optimizer.__dict__[_SAVED] = optimizer.__dict__.get("step")
    optimizer.__dict__[_BACKEND] = backend
    if state_dtype == "int8":
        optimizer.__dict__[_INT8_HOOKS] = (
            optimizer.register_state_dict_post_hook(_record_state_dtype),
            optimizer.register_load_state_dict_pre_hook(_refuse_other_state_dtype),
            optimizer.register_load_state_dict_post_hook(_restore_code_dtypes))
    optimizer.step = types.MethodType(hooked, optimizer)
    optimizer.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, optimizer)
    return optimizer


def _amp(optimizer: Optimizer, with_grads: List[Tuple[int, int, Tensor]],
         clip: Optional[Tuple[Tensor, Tensor]]) -> dict:
    """The ``grad_scale`` and ``found_inf`` of a swapped step's op calls. A GradScaler sets
    its tensors only on an optimizer whose step unscales and skips (a fused torch
    optimizer). The skip is decided by the engine's :func:`skip_flag` under torch's own
    policy, ``"propagate"``, but where a pending clip has already read the gradients:
    its flag is then the step's (``"skip"`` without a read of its own). A GradScaler's
    flag stands over a clip's (it was computed over these gradients), and neither needs
    the ranks of FSDP2 to agree again (a sharded scaler's and a clip's already do)."""
    grad_scale, clip_flag = getattr(optimizer, "grad_scale", None), None
    if clip is not None:
        grad_scale, clip_flag = clipped_scale(grad_scale, clip[0]), clip[1]
    found_inf = skip_flag(getattr(optimizer, "found_inf", None),
                          "propagate" if clip is None else "skip", with_grads, [],
                          clip_flag=clip_flag)
    return {"grad_scale": grad_scale, "found_inf": found_inf}


def _clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
    over this optimizer's parameters, in one read of them.

    Returns the total norm (a 0-dim float32 tensor, as torch's). The gradients are not
    rewritten: the next ``step()`` applies torch's factor ``min(1, max_norm / (norm +
    1e-6))`` as its fused ops read them, which equals clipping first and stepping after
    with that factor to the bit, and skips itself on the device (params, state and step
    counts untouched) when a gradient is NaN or infinite, where torch's clip would scale
    every gradient to NaN. Under FSDP2 the norm is reduced over the ranks. Call it after
    backward (after a GradScaler's ``unscale_``), right before ``step()``; it applies to
    that step only. Refused while the optimizer steps in backward (its clip is then the
    handle's ``max_grad_norm``).
    """
    refuse_clip_in_backward(self)
    params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
    layouts = [layout for i, p in enumerate(params)
               if (layout := RowShard.of(p, f"parameter {i} with a gradient")) is not None]
    total, factor, found_inf = clip_factor([local(p.grad) for p in params], max_norm, norm_type,
                                           error_if_nonfinite, sharding.process_groups(layouts))
    self.__dict__[_CLIP] = (factor, found_inf)
    return total


def is_swapped(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step runs on the fused ops (:func:`swap`)."""
    return _SAVED in optimizer.__dict__


class _TensorSteps:
    """A swapped optimizer's step, one tensor at a time: what
    :func:`frugal_kernels.step_in_backward` drives (see its module)."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self._group_step = _STEPS[type(optimizer)]
        self._group_of: Dict[Tensor, dict] = {}

    def _tensor_steps_refused(self):
        return None

    def _begin_tensor_steps(self) -> None:
        _check_groups(self.optimizer)
        self._group_of = {p: group for group in self.optimizer.param_groups
                          for p in group["params"]}

    def _step_tensor(self, p: Tensor) -> None:
        self._group_step(self.optimizer, self._group_of[p],
                         self.optimizer.__dict__[_BACKEND], [p])

    def _end_tensor_steps(self) -> None:
        pass


def tensor_steps(optimizer: Optimizer) -> _TensorSteps:
    """The swapped step of ``optimizer`` one tensor at a time (TypeError unless swapped)."""
    if not is_swapped(optimizer):
        raise TypeError("tensor_steps takes an optimizer swapped by frugal_kernels.swap")
    return _TensorSteps(optimizer)


def _check_groups(optimizer: Optimizer, read_device: bool = False
                  ) -> List[Tuple[int, int, Tensor]]:
    """Raise unless every group's options and tensors are ones the swapped step honours
    (``read_device``: a tensor lr on a GPU may be read, a sync); the tensors with
    gradients, as (group index, index in the group, tensor)."""
    with_grads = []
    for i, group in enumerate(optimizer.param_groups):
        for option in _REFUSED:
            if group.get(option, False):
                raise ValueError(f"swap: param group {i} sets {option}=True, which the fused "
                                 "ops do not implement; leave the optimizer unswapped or "
                                 f"set {option}=False")
        _CHECKS[type(optimizer)](group, f"swap: param group {i}", read_device)
        for j, p in enumerate(group["params"]):
            if p.dtype != torch.float32:
                raise ValueError(f"swap: param group {i} holds a {p.dtype} parameter; the "
                                 "swapped step runs float32 parameters only (torch keeps "
                                 "other dtypes' state in their own dtype)")
            if not p.is_contiguous():
                raise ValueError(f"swap: param group {i} holds a non-contiguous parameter; "
                                 "the fused ops update parameters in place and need them "
                                 "contiguous")
            if p.grad is not None:
                if p.grad.layout != torch.strided:
                    raise ValueError(f"swap: param group {i} has a sparse gradient "
                                     f"({p.grad.layout}); the fused ops take dense gradients")
                with_grads.append((i, j, p))
    return with_grads


def _check_sgd_options(group: dict, where: str, read_device: bool = False) -> None:
    """lr as the engine checks it; momentum, dampening and weight_decay finite and >= 0."""
    check_lr(group.get("lr"), where, read_device)
    for name in ("momentum", "dampening", "weight_decay"):
        check_number(group.get(name), name, where)


def _check_state_dtype(optimizer: Optimizer, state_dtype: str) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"swap: state_dtype must be one of {', '.join(STATE_DTYPES)}; got "
                         f"{state_dtype!r}")
    if state_dtype == "fp32":
        return
    if type(optimizer) is torch.optim.SGD:
        raise ValueError("swap: state_dtype='int8' stores AdamW's moments; an SGD's momentum "
                         "buffers stay fp32 (leave state_dtype='fp32')")
    if any(is_sharded(p) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("swap: state_dtype='int8' takes plain tensors; for DTensor "
                         "parameters (FSDP2) use FRUGAL.from_optimizer(optimizer, "
                         "state_dtype='int8') with unprojected groups")
    if any(len(st) for st in optimizer.state.values()):
        raise ValueError("swap: state_dtype='int8' starts from an optimizer without state "
                         "(its moments would be fp32); swap it before its first step")


def _int8(optimizer: Optimizer) -> bool:
    return _INT8_HOOKS in optimizer.__dict__


def _record_state_dtype(optimizer: Optimizer, state_dict: dict) -> dict:
    for group in state_dict["param_groups"]:
        group["state_dtype"] = "int8"
    return state_dict


def _refuse_other_state_dtype(optimizer: Optimizer, state_dict: dict) -> None:
    for gi, group in enumerate(state_dict["param_groups"]):
        saved = group.get("state_dtype", "fp32")
        if saved != "int8":
            raise ValueError(f"param group {gi}: the state dict's moments are "
                             f"state_dtype={saved!r} but this swapped optimizer's are 'int8'; "
                             f"swap it with state_dtype={saved!r} to resume from it")


def _restore_code_dtypes(optimizer: Optimizer) -> None:
    """torch's loader casts every state tensor of a float parameter to its dtype: the
    codes come back as floats holding integers, which this puts back into int8 / uint8
    (exactly)."""
    for state in optimizer.state.values():
        if "exp_avg_scale" in state:
            for key, dtype in _CODE_DTYPES.items():
                state[key] = state[key].to(dtype)


def _dequantize_state(optimizer: Optimizer) -> None:
    """8-bit moments back to fp32 moments (for torch's own step, after an undo)."""
    for state in optimizer.state.values():
        if "exp_avg_scale" in state:
            for key in _CODE_DTYPES:
                state[key] = reference.dequantize_moment(state[key], state.pop(key + "_scale"),
                                                         key == "exp_avg_sq")


def _with_grads(group: dict, params: Optional[List[Tensor]] = None) -> List[Tensor]:
    """The group's tensors with gradients (of ``params`` only, when given)."""
    return [p for p in (group["params"] if params is None else params) if p.grad is not None]


# ------------------------------------------------------------------ Adam(W)

def _capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _new_step(group: dict, p: Tensor) -> Tensor:
    """``state["step"]`` as torch creates it for this group."""
    if group.get("fused"):
        return torch.tensor(0.0, dtype=_get_scalar_dtype(is_fused=True), device=p.device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def _adam_group(optimizer: Optimizer, group: dict, backend: str,
                params: Optional[List[Tensor]] = None, amp: Optional[dict] = None) -> None:
    with_grads = _with_grads(group, params)
    if not with_grads:
        return
    for p in with_grads:
        state = optimizer.state[p]
        if len(state) == 0:
            if _int8(optimizer) and plan.stores_int8({"state_dtype": "int8"}, p):
                plan.ensure_moments(state, p.shape, p.device, int8=True)
            state["step"] = _new_step(group, p)
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    steps = [optimizer.state[p]["step"] for p in with_grads]
    if _capturing() and any(step.device.type == "cpu" for step in steps):
        # The kernels read a host step count when they are launched: a captured step
        # would replay with the bias correction of the step it was captured at.
        raise RuntimeError(
            f"{type(optimizer).__name__} keeps its step counts on the host, which a CUDA graph "
            "capture would freeze at their value now; build it with fused=True (its counts "
            "live on the GPU) to capture its swapped step, as torch asks of its own AdamW")
    coupled = not (type(optimizer) is torch.optim.AdamW
                   or group.get("decoupled_weight_decay", False))

    def assign(gi: int, g: dict, i: int, p: Tensor) -> plan.Assignment:
        # fp32 or 8-bit moments (state_dtype="int8"): each tensor's own.
        rule = plan.adamw_assignment(optimizer.state[p])
        return dataclasses.replace(rule, coupled=True) if coupled else rule

    buckets = _group_plan(optimizer, group, with_grads, params is None, coupled, assign,
                          optimizer.state)
    counters = by_device(steps)
    count_steps(counters)
    _run(group, buckets, backend, amp)
    uncount_skipped(counters, (amp or {}).get("found_inf"))
    _keep(optimizer, group, with_grads, params is None, coupled, buckets)


def _sgd_group(optimizer: Optimizer, group: dict, backend: str,
               params: Optional[List[Tensor]] = None, amp: Optional[dict] = None) -> None:
    with_grads = _with_grads(group, params)
    if not with_grads:
        return
    momentum = float(group["momentum"]) != 0
    # A param without a buffer starts it from its gradient: its own call.
    first = set()
    for p in with_grads:
        state = optimizer.state[p] if momentum else None
        if momentum and state.get("momentum_buffer") is None:
            first.add(p)
            # Zeros rather than empty: a first step that found_inf skips leaves the
            # buffer as it is, and the next step takes it as started (from zero).
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def assign(gi: int, g: dict, i: int, p: Tensor) -> plan.Assignment:
        return plan.SGD_FIRST if p in first else plan.SGD

    # torch keeps no state without momentum: the plan's state entries are thrown away.
    state = optimizer.state if momentum else defaultdict(dict)
    key = (momentum, bool(first))
    buckets = _group_plan(optimizer, group, with_grads, params is None, key, assign, state)
    _run(group, buckets, backend, amp)
    _keep(optimizer, group, with_grads, params is None, key, buckets)


def _run(group: dict, buckets: List[plan.Bucket], backend: str, amp: Optional[dict]) -> None:
    """The group's op calls (plan.run), with the step's GradScaler and skip tensors."""
    grad_scale, found_inf = (amp or {}).get("grad_scale"), (amp or {}).get("found_inf")
    # The calls take a tensor lr (a float one, what LR schedulers set, as the engine's).
    lr = group["lr"]
    lr = lr if isinstance(lr, Tensor) else torch.tensor(float(lr), dtype=torch.float64)
    for bucket in buckets:
        # DTensor parameters (FSDP2) keep torch's state, DTensors like them, which
        # torch.distributed.checkpoint saves as it saves AdamW's; the ops take the
        # local blocks of all of them.
        device = bucket.params[0].device
        bucket.lr = lr
        plan.run(bucket, [local(p.grad) for p in bucket.params], backend,
                 on_device(grad_scale, device), on_device(found_inf, device))


def _group_plan(optimizer: Optimizer, group: dict, with_grads: List[Tensor], whole: bool,
                key, assign: Callable[..., plan.Assignment], state) -> List[plan.Bucket]:
    """``with_grads`` bucketed into op calls by the engine's plan (:func:`plan.build`: one
    per rule, device and step count, params added later counting their own steps; not
    ``whole``: the one tensor a step in backward updates, :func:`plan.single`), each
    tensor's rule given by ``assign``. Building it reads every ``state["step"]`` (a host
    sync each for a fused group's device counts), so the plan is kept (:func:`_keep`) and
    reused while the group (the tensor) steps the same tensors with the same state
    tensors and ``key`` (what decides the rules), none of the state written since (their
    version counters as the last step left them): every step adds the same to all the
    counts, so equal counts stay equal. A count reset in place (``state["step"].zero_()``,
    as some loops do on restarts) moves its version, and the group is bucketed again by
    the counts it holds now. A kept plan's calls go around the checks (plan.run)."""
    kept = optimizer.__dict__.get(_CALLS, {}).get(_where(group, with_grads, whole))
    if kept is not None and kept[0] == key and kept[1] is not None:
        held = [*with_grads, *_state_tensors(optimizer, with_grads)]
        if len(kept[2]) == len(held) and all(a is b for a, b in zip(kept[2], held)) and \
                kept[1] == _versions(held[len(with_grads):]):
            return kept[3]

    def lr(gi: int, g: dict):
        return g["lr"]

    if not whole:
        # A step in backward's tensor (never a DTensor there): its own call.
        return [plan.single(0, group, 0, with_grads[0], state, assign, lr)]
    layouts = {p: RowShard.of(p, f"a parameter of shape {tuple(p.shape)}")
               for p in with_grads if is_sharded(p)}
    return plan.build([group], state, assign, lr, layouts)


def _keep(optimizer: Optimizer, group: dict, with_grads: List[Tensor], whole: bool, key,
          buckets: List[plan.Bucket]) -> None:
    """Keep a plan once its step is done (one that raised halfway keeps nothing, and the
    next builds afresh). The tensors are held, so that none of them is freed and another
    made at its address (the check is by identity)."""
    states = _state_tensors(optimizer, with_grads)
    optimizer.__dict__.setdefault(_CALLS, {})[_where(group, with_grads, whole)] = (
        key, _versions(states), [*with_grads, *states], buckets)


def _where(group: dict, with_grads: List[Tensor], whole: bool) -> int:
    """Where a plan is kept: by its group, or by its one tensor (a step in backward's)."""
    return id(group) if whole else id(with_grads[0])


def _state_tensors(optimizer: Optimizer, with_grads: List[Tensor]) -> List[Tensor]:
    """The state tensors of ``with_grads`` (none without momentum: no state entry made)."""
    return [v for p in with_grads for v in optimizer.state.get(p, {}).values()
            if isinstance(v, Tensor)]


def _versions(tensors: List[Tensor]) -> Optional[Tuple[int, ...]]:
    """The version counters of ``tensors`` (bumped by every in-place write), or None where
    one has none (a tensor made under ``torch.inference_mode``: never reused then)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


# What each checks of a param group's options (group, where, read_device).
_CHECKS: Dict[type, Callable[..., None]] = {
    torch.optim.AdamW: check_adamw_options,
    torch.optim.Adam: check_adamw_options,
    torch.optim.SGD: _check_sgd_options,
}
# Each steps one param group (only ``params`` of it, when given).
_STEPS: Dict[type, Callable[..., None]] = {
    torch.optim.AdamW: _adam_group,
    torch.optim.Adam: _adam_group,
    torch.optim.SGD: _sgd_group,
}
# The torch optimizers swap takes.
SWAPPABLE = tuple(_STEPS)
