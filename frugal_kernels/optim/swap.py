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

The swapped step is the step engine's (optim/engine.py, optim/plan.py) over
torch's state: its checks (:func:`check_new_params` when a group is first
stepped, :func:`check_step` at every step, the option checks, the saved-state
checks where a group's plan is built), then the skip decision under the
``nonfinite`` policy (:func:`step_scales`: a GradScaler's flag, a pending clip's,
or one read of the gradients), then the writes: each group's state, its plan of
op calls (``plan.build`` / ``plan.run`` with the ``adamw`` and ``adamw_int8``
rules, ``coupled`` for Adam's L2 decay, and the ``sgd`` and ``sgd_first``
rules, kept between steps, see _kept) and the step counts
(:func:`count_steps` / :func:`uncount_skipped`). So a step that raises, in any
group, has changed nothing. The state stays torch's (a count per tensor, in
torch's dtype and on torch's device), not the engine's packed counts.

What a swapped step refuses beyond the engine's checks, with a ValueError naming
the group and option or the parameter: ``amsgrad``, ``capturable`` and
``differentiable`` set, and parameters that are not float32 (torch keeps their
state in the parameter's dtype, which the fused ops, with float32 state, do not
store). The ``foreach`` and ``fused`` flags are ignored: the fused ops replace
both paths (a ``fused`` group's new ``step`` tensors still live where torch's
fused path puts them, on the parameter's device).

A ``fused=True`` torch optimizer tells a GradScaler that its step unscales and
skips itself (``_step_supports_amp_scaling``): the swapped step hands the scaler's
``grad_scale`` and ``found_inf`` to the fused ops, as the engine does, its step
counts taken back after a skipped step on the device, as torch's fused step does.

The swap also gives the instance the engine's ``clip_grad_norm_``
(:func:`clip_grad_norm`): a method of the instance, as the swapped ``step`` is,
since the optimizer holds the pending clip until its next step.
``swap(undo=True)`` removes both (and a clip still pending).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import defaultdict
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from frugal_kernels import reference
from frugal_kernels._layout import STATE_DTYPES, on_device
from frugal_kernels._shard import RowShard, is_sharded, local
from frugal_kernels.optim import plan, sharding
from frugal_kernels.optim.engine import (by_device, check_adamw_options, check_backend, check_lr,
                                         check_new_params, check_nonfinite, check_number,
                                         check_saved_state, check_step, check_tensor_step,
                                         clip_grad_norm, count_steps, param_name, step_scales,
                                         uncount_skipped)
from frugal_kernels.optim.projections import DENSE

__all__ = ["SWAPPABLE", "is_swapped", "swap", "tensor_steps"]

# Where the swap keeps its record (_Swap) on the instance.
_SWAP = "_frugal_swap"
_REFUSED = ("amsgrad", "capturable", "differentiable")
_CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


@dataclasses.dataclass
class _Swap:
    """What a swap keeps on the instance besides its ``step`` and ``clip_grad_norm_``."""

    # The instance's own ``step`` attribute before the swap (an LR scheduler's wrapper),
    # or None.
    saved_step: Optional[Callable]
    backend: str
    nonfinite: str
    # With state_dtype="int8": the handles of its state dict hooks.
    int8_hooks: tuple = ()
    # The DTensor parameters' layouts (FSDP2), of the groups checked so far.
    layouts: Dict[Tensor, RowShard] = dataclasses.field(default_factory=dict)
    # How many param groups had their parameters checked: a group added after the swap
    # (torch's add_param_group) is checked at the next step.
    checked: int = 0
    # Each group's plan of op calls, and each tensor's that steps in backward (see _kept).
    plans: Dict[int, tuple] = dataclasses.field(default_factory=dict)
    # Each group's step counts packed per device (_packed_counts), beside its plan.
    counts: Dict[int, Dict[torch.device, List[Tensor]]] = dataclasses.field(default_factory=dict)


def swap(optimizer: Optimizer, *, backend: str = "auto", undo: bool = False,
         state_dtype: str = "fp32", nonfinite: str = "skip") -> Optimizer:
    """Make ``optimizer.step`` run on the fused ops; returns the same optimizer.

    ``optimizer`` is a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` instance (not
    a subclass, whose step may differ). Swapping a swapped optimizer with the
    same options changes nothing (other options raise a ValueError);
    ``swap(optimizer, undo=True)`` restores the original step, and the state
    written meanwhile carries over.

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
        nonfinite: what a step does when a gradient holds a NaN or an infinity, as
            for the package's optimizers (:class:`frugal_kernels.FRUGAL`):
            ``"skip"`` (default) leaves params, state and step counts as they were,
            decided on the device; ``"raise"`` raises a ValueError naming the
            parameter (one host sync per step); ``"propagate"`` applies the step as
            torch's own does. Under a GradScaler its ``found_inf`` decides.

    Raises:
        TypeError: for an optimizer of another type.
        ValueError: for an option the swapped step does not honour (see the module
            docstring), a bad ``backend``, ``state_dtype`` or ``nonfinite``; a
            group's options are checked now and again at every step, since param
            groups may change; a repeated swap with other options than the first's.
        RuntimeError: for ``undo=True`` while the optimizer steps in backward
            (:func:`frugal_kernels.step_in_backward`): ``handle.remove()`` first.
    """
    if undo:
        if not is_swapped(optimizer):
            raise ValueError("swap(undo=True): this optimizer was not swapped")
        # Imported here: the step in backward is built on this module.
        from frugal_kernels.optim.in_backward import handle_of

        if handle_of(optimizer) is not None:
            # Its hooks step through the swapped step, and its remove() puts back the
            # optimizer.step it replaced: the swapped one.
            raise RuntimeError("swap(undo=True): this optimizer steps in backward "
                               "(frugal_kernels.step_in_backward); call handle.remove() "
                               "first, then undo the swap")
        record = optimizer.__dict__.pop(_SWAP)
        for handle in record.int8_hooks:
            handle.remove()
        _dequantize_state(optimizer)
        optimizer.__dict__.pop("_pending_clip", None)
        del optimizer.step
        del optimizer.clip_grad_norm_
        if record.saved_step is not None:
            optimizer.step = record.saved_step
        return optimizer
    kind = type(optimizer)
    if kind not in _KINDS:
        raise TypeError(f"swap supports torch.optim.AdamW, Adam and SGD instances, got "
                        f"{kind.__module__}.{kind.__qualname__}")
    if is_swapped(optimizer):
        _check_same_swap(optimizer.__dict__[_SWAP], backend, state_dtype, nonfinite)
        return optimizer
    check_backend(backend)
    check_nonfinite(nonfinite)
    record = _Swap(optimizer.__dict__.get("step"), backend, nonfinite)
    _check_new_groups(optimizer, record)
    _check_state_dtype(optimizer, state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # An LR scheduler attached before the swap watches this flag.
        self._opt_called = True
        _step(self, self.__dict__[_SWAP])
        return loss

    hooked = Optimizer.profile_hook_step(step)
    # Tells LR schedulers made after the swap that this step already sets
    # _opt_called (they would otherwise wrap it again).
    hooked._wrapped_by_lr_sched = True
    if state_dtype == "int8":
        record.int8_hooks = (
            optimizer.register_state_dict_post_hook(_record_state_dtype),
            optimizer.register_load_state_dict_pre_hook(_refuse_other_state_dtype),
            optimizer.register_load_state_dict_post_hook(_restore_code_dtypes))
    optimizer.__dict__[_SWAP] = record
    optimizer.step = types.MethodType(hooked, optimizer)
    optimizer.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, optimizer)
    return optimizer


def _clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
    over this optimizer's parameters, in one read of them: ``FusedOptimizer``'s clip
    (:func:`clip_grad_norm`). Returns the total norm; the next ``step()`` applies torch's
    factor as its fused ops read the gradients and takes the norm's non-finite flag as
    its skip decision. Call it after backward (after a GradScaler's ``unscale_``), right
    before ``step()``."""
    record = self.__dict__[_SWAP]
    _check_new_groups(self, record)
    return clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite,
                          sharding.process_groups(record.layouts.values()))


def is_swapped(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step runs on the fused ops (:func:`swap`)."""
    return _SWAP in optimizer.__dict__


class _TensorSteps:
    """A swapped optimizer's step, one tensor at a time: what
    :func:`frugal_kernels.step_in_backward` drives (see its module)."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self._record: _Swap = optimizer.__dict__[_SWAP]
        self._index: Dict[Tensor, Tuple[int, int]] = {}

    @property
    def nonfinite(self) -> str:
        """The swap's policy, which the step in backward applies per tensor."""
        return self._record.nonfinite

    def tensor_steps_refused(self):
        return None

    def begin_tensor_steps(self) -> None:
        _check_new_groups(self.optimizer, self._record)
        for gi, group in enumerate(self.optimizer.param_groups):
            _check_options(self.optimizer, group, f"param group {gi}")
        self._index = {p: (gi, i) for gi, group in enumerate(self.optimizer.param_groups)
                       for i, p in enumerate(group["params"])}

    def step_tensor(self, p: Tensor) -> None:
        gi, i = self._index[p]
        check_tensor_step(gi, i, p, self._record.nonfinite)
        if p.dtype is not torch.float32:
            _refuse_dtype(gi, i, p)
        group = self.optimizer.param_groups[gi]
        prepared = _prepare(self.optimizer, self._record, gi, group, [(i, p)], whole=False)
        _apply(self.optimizer, self._record, group, [p], False, *prepared, None, None)

    def end_tensor_steps(self) -> None:
        pass


def tensor_steps(optimizer: Optimizer) -> _TensorSteps:
    """The swapped step of ``optimizer`` one tensor at a time (TypeError unless swapped)."""
    if not is_swapped(optimizer):
        raise TypeError("tensor_steps takes an optimizer swapped by frugal_kernels.swap")
    return _TensorSteps(optimizer)


# ------------------------------------------------------------------ the step

def _step(optimizer: Optimizer, record: _Swap) -> None:
    """Check every group, decide the skip, then write: a step that raises changes nothing."""
    _check_new_groups(optimizer, record)
    _, with_grads, grads = check_step(optimizer.param_groups,
                                      functools.partial(_check_options, optimizer),
                                      record.layouts)
    by_group: Dict[int, List[Tuple[int, Tensor]]] = defaultdict(list)
    for gi, i, p in with_grads:
        if p.dtype is not torch.float32:
            _refuse_dtype(gi, i, p)
        by_group[gi].append((i, p))
    groups = optimizer.param_groups
    prepared = [(groups[gi], [p for _, p in items],
                 _prepare(optimizer, record, gi, groups[gi], items, whole=True))
                for gi, items in by_group.items()]
    grad_scale, found_inf = step_scales(optimizer, record.nonfinite, with_grads,
                                        sharding.process_groups(record.layouts.values()), grads)
    optimizer.__dict__.pop("_pending_clip", None)  # taken by this step
    for group, params, (rules, kept) in prepared:
        _apply(optimizer, record, group, params, True, rules, kept, grad_scale, found_inf)


def _check_new_groups(optimizer: Optimizer, record: _Swap) -> None:
    """The engine's checks of the parameters of the groups not checked yet (all of them at
    the swap, a group added since then after it), with their options (a tensor lr on a
    GPU read by value: once per group), and their DTensors' layouts kept."""
    groups = optimizer.param_groups
    if record.checked == len(groups):
        return
    existing = [(gi, i, p) for gi in range(record.checked)
                for i, p in enumerate(groups[gi]["params"])]
    layouts = {}
    for gi in range(record.checked, len(groups)):
        params = groups[gi]["params"]
        _check_options(optimizer, groups[gi], f"param group {gi}", read_device=True)
        for i, p in enumerate(params):
            if isinstance(p, Tensor) and p.dtype is not torch.float32:
                _refuse_dtype(gi, i, p)
        layouts.update(check_new_params(params, gi, existing))
        existing += [(gi, i, p) for i, p in enumerate(params)]
    record.layouts.update(layouts)
    record.checked = len(groups)


def _check_options(optimizer: Optimizer, group: dict, where: str,
                   read_device: bool = False) -> None:
    """Raise unless ``group``'s options are ones the swapped step honours, valid as the
    engine checks them (``read_device``: a tensor lr on a GPU may be read, a sync)."""
    where = f"swap: {where}"
    for option in _REFUSED:
        if group.get(option, False):
            raise ValueError(f"{where} sets {option}=True, which the fused ops do not "
                             f"implement; leave the optimizer unswapped or set {option}=False")
    _KINDS[type(optimizer)].check_options(group, where, read_device)


def _refuse_dtype(gi: int, i: int, p: Tensor) -> None:
    raise ValueError(f"swap: {param_name(gi, i, p)} is a {p.dtype} parameter; the swapped "
                     "step runs float32 parameters only (torch keeps other dtypes' state in "
                     "their own dtype, the fused ops keep float32 state)")


def _check_sgd_options(group: dict, where: str, read_device: bool = False) -> None:
    """lr as the engine checks it; momentum, dampening and weight_decay finite and >= 0."""
    check_lr(group.get("lr"), where, read_device)
    for name in ("momentum", "dampening", "weight_decay"):
        check_number(group.get(name), name, where)


class _GroupStep(NamedTuple):
    """A group's step (of its tensors with gradients), decided before anything is written."""

    key: tuple                     # what decides the rules: a kept plan serves while equal
    assign: Callable[..., plan.Assignment]
    state: object                  # the state the rules read and fill (plan.build's)
    start: Callable[[], None]      # gives the tensors without state theirs (a write)
    counted: bool                  # whether the tensors' state["step"] counts the step


def _prepare(optimizer: Optimizer, record: _Swap, gi: int, group: dict,
             items: List[Tuple[int, Tensor]], whole: bool
             ) -> Tuple[_GroupStep, Optional[List[plan.Bucket]]]:
    """A group's step of ``items`` ((index, tensor) with gradients; one tensor when not
    ``whole``) and its kept plan, or None; raises (writing nothing) where the step cannot
    be taken. A plan that is not kept is built from the tensors' states, which are checked
    first, as the engine checks a loaded state (torch's loader checks no shapes)."""
    kind = _KINDS[type(optimizer)]
    params = [p for _, p in items]
    rules = kind.prepare(optimizer, record, group, params)
    kept = _kept(optimizer, record, group, params, whole, rules.key)
    if kept is None:
        for i, p in items:
            state, name = optimizer.state.get(p, {}), param_name(gi, i, p)
            kind.check_state(state, p, name)
            _check_placement(state, p, name)
    return rules, kept


def _check_placement(state: dict, p: Tensor, name: str) -> None:
    """The state tensors on their parameter's device, contiguous, as the ops take them
    (torch's loader moves them to the device but keeps their strides)."""
    for key, value in state.items():
        if key != "step" and isinstance(value, Tensor):
            block = local(value)
            if block.device != local(p).device or not block.is_contiguous():
                raise ValueError(f"state of param {name}: {key} is not a contiguous tensor on "
                                 f"its parameter's device ({local(p).device}); the fused ops "
                                 "update it in place there")


def _apply(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor],
           whole: bool, rules: _GroupStep, kept: Optional[List[plan.Bucket]],
           grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    """The writes of a group's step (:func:`_prepare` checked them): state, plan, op calls
    and step counts; the plan is kept for the next step."""
    rules.start()
    buckets = kept
    if buckets is None:
        def lr(gi: int, g: dict):
            return g["lr"]

        if whole:
            buckets = plan.build([group], rules.state, rules.assign, lr, record.layouts)
        else:
            # A step in backward's tensor (never a DTensor there): its own call.
            buckets = [plan.single(0, group, 0, params[0], rules.state, rules.assign, lr)]
    counters = {}
    if rules.counted:
        counters = _packed_counts(optimizer, record, group, params, kept is None) if whole \
            else by_device([optimizer.state[params[0]]["step"]])
    count_steps(counters)
    _run(group, buckets, record.backend, grad_scale, found_inf)
    uncount_skipped(counters, found_inf)
    _keep(optimizer, record, group, params, whole, rules.key, buckets)


def _run(group: dict, buckets: List[plan.Bucket], backend: str, grad_scale: Optional[Tensor],
         found_inf: Optional[Tensor]) -> None:
    """The group's op calls (plan.run), with the step's GradScaler and skip tensors."""
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


# ------------------------------------------------------------------ Adam(W)

def _capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _step_device(optimizer: Optimizer, group: dict, p: Tensor) -> torch.device:
    """Where ``p``'s ``state["step"]`` lives, or will when its state is made (_new_step)."""
    step = optimizer.state.get(p, {}).get("step")
    if step is not None:
        return step.device
    return p.device if group.get("fused") else torch.device("cpu")


def _new_step(group: dict, p: Tensor) -> Tensor:
    """``state["step"]`` as torch creates it for this group."""
    if group.get("fused"):
        return torch.tensor(0.0, dtype=_get_scalar_dtype(is_fused=True), device=p.device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def _adam(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor]) -> _GroupStep:
    if _capturing() and any(_step_device(optimizer, group, p).type == "cpu" for p in params):
        # The kernels read a host step count when they are launched: a captured step
        # would replay with the bias correction of the step it was captured at.
        raise RuntimeError(
            f"{type(optimizer).__name__} keeps its step counts on the host, which a CUDA "
            "graph capture would freeze at their value now; build it with fused=True (its "
            "counts live on the GPU) to capture its swapped step, as torch asks of its own "
            "AdamW")
    coupled = not (type(optimizer) is torch.optim.AdamW
                   or group.get("decoupled_weight_decay", False))
    int8 = bool(record.int8_hooks)

    def start() -> None:
        for p in params:
            state = optimizer.state[p]
            if len(state) == 0:
                if int8 and plan.stores_int8({"state_dtype": "int8"}, p):
                    plan.ensure_moments(state, p.shape, p.device, int8=True)
                state["step"] = _new_step(group, p)
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)

    def assign(gi: int, g: dict, i: int, p: Tensor) -> plan.Assignment:
        # fp32 or 8-bit moments (state_dtype="int8"): each tensor's own.
        rule = plan.adamw_assignment(optimizer.state[p])
        return dataclasses.replace(rule, coupled=True) if coupled else rule

    return _GroupStep((coupled,), assign, optimizer.state, start, True)


def _check_adam_state(state: dict, p: Tensor, name: str) -> None:
    if state:
        # The engine's family of AdamW state over every coordinate: a torch Adam's.
        check_saved_state(state, p, name, DENSE)


# ------------------------------------------------------------------ SGD

def _sgd(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor]
         ) -> _GroupStep:
    momentum = float(group["momentum"]) != 0
    # A param without a buffer starts it from its gradient: its own call.
    first = {p for p in params
             if momentum and optimizer.state.get(p, {}).get("momentum_buffer") is None}

    def start() -> None:
        for p in first:
            # Zeros rather than empty: a first step that found_inf skips leaves the
            # buffer as it is, and the next step takes it as started (from zero).
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                p, memory_format=torch.contiguous_format)

    def assign(gi: int, g: dict, i: int, p: Tensor) -> plan.Assignment:
        return plan.SGD_FIRST if p in first else plan.SGD

    # torch keeps no state without momentum: the plan's state entries are thrown away.
    state = optimizer.state if momentum else defaultdict(dict)
    return _GroupStep((momentum, bool(first)), assign, state, start, False)


def _check_sgd_state(state: dict, p: Tensor, name: str) -> None:
    buffer = state.get("momentum_buffer")
    if buffer is not None and not (isinstance(buffer, Tensor) and buffer.dtype == torch.float32
                                   and tuple(buffer.shape) == tuple(p.shape)):
        got = (f"{buffer.dtype} of shape {tuple(buffer.shape)}" if isinstance(buffer, Tensor)
               else f"a {type(buffer).__name__}")
        raise ValueError(f"state of param {name}: momentum_buffer is {got}; a parameter of "
                         f"shape {tuple(p.shape)} takes a float32 buffer of its shape")


# ------------------------------------------------------------------ kept plans

def _kept(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor], whole: bool,
          key: tuple) -> Optional[List[plan.Bucket]]:
    """The plan kept (:func:`_keep`) for these tensors of ``group`` (not ``whole``: the one
    tensor a step in backward updates), or None where it must be built again.

    Building it (:func:`plan.build`: one call per rule, device and step count, params added
    later counting their own steps) reads every ``state["step"]`` (a host sync each for a
    fused group's device counts), so it is reused while the group (the tensor) steps the
    same tensors with the same state tensors and ``key`` (what decides the rules), none of
    the state written since (their version counters as the last step left them): every
    step adds the same to all the counts, so equal counts stay equal. A count reset in
    place (``state["step"].zero_()``, as some loops do on restarts) moves its version, and
    the group is bucketed again by the counts it holds now. A kept plan's calls go around
    the checks (plan.run)."""
    kept = record.plans.get(_where(group, params, whole))
    if kept is None or kept[0] != key or kept[1] is None:
        return None
    held = [*params, *_state_tensors(optimizer, params)]
    if len(kept[2]) == len(held) and all(a is b for a, b in zip(kept[2], held)) and \
            kept[1] == _versions(held[len(params):]):
        return kept[3]
    return None


def _keep(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor], whole: bool,
          key: tuple, buckets: List[plan.Bucket]) -> None:
    """Keep a plan once its step is done. The tensors are held, so that none of them is
    freed and another made at its address (the check is by identity)."""
    states = _state_tensors(optimizer, params)
    record.plans[_where(group, params, whole)] = (key, _versions(states), [*params, *states],
                                                  buckets)


def _packed_counts(optimizer: Optimizer, record: _Swap, group: dict, params: List[Tensor],
                   built: bool) -> Dict[torch.device, List[Tensor]]:
    """The group's step counts as one tensor per device and dtype, each ``state["step"]``
    a 0-dim view of it (as ``plan.pack_step_counters`` does for the package's optimizers),
    packed again whenever the plan is built: one ``add_`` counts a step for all of them
    and one ``sub_`` takes a skipped one back, where a foreach over torch's 0-dim tensors
    costs about 2 us a tensor, twice a step. The state stays torch's: a 0-dim count per
    tensor, which torch's own step, ``state_dict`` and ``undo`` take as before. A kept plan
    means the same state tensors, so the same views (:func:`_kept`)."""
    where = _where(group, params, True)
    if built or where not in record.counts:
        by_kind: Dict[tuple, List[dict]] = {}
        for p in params:
            state = optimizer.state[p]
            by_kind.setdefault((state["step"].device, state["step"].dtype), []).append(state)
        packed: Dict[torch.device, List[Tensor]] = {}
        for (device, _), states in by_kind.items():
            counts = torch.stack([state["step"] for state in states])
            for i, state in enumerate(states):
                state["step"] = counts[i]
            packed.setdefault(device, []).append(counts)
        record.counts[where] = packed
    return record.counts[where]


def _where(group: dict, params: List[Tensor], whole: bool) -> int:
    """Where a plan is kept: by its group, or by its one tensor (a step in backward's)."""
    return id(group) if whole else id(params[0])


def _state_tensors(optimizer: Optimizer, params: List[Tensor]) -> List[Tensor]:
    """The state tensors of ``params`` (none without momentum: no state entry made)."""
    return [v for p in params for v in optimizer.state.get(p, {}).values()
            if isinstance(v, Tensor)]


def _versions(tensors: List[Tensor]) -> Optional[Tuple[int, ...]]:
    """The version counters of ``tensors`` (bumped by every in-place write), or None where
    one has none (a tensor made under ``torch.inference_mode``: never reused then)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


# ------------------------------------------------------------------ 8-bit state

def _check_same_swap(record: _Swap, backend: str, state_dtype: str, nonfinite: str) -> None:
    """A repeated swap changes nothing, so it may not ask for other options than the first."""
    has = {"backend": record.backend, "state_dtype": "int8" if record.int8_hooks else "fp32",
           "nonfinite": record.nonfinite}
    asked = {"backend": backend, "state_dtype": state_dtype, "nonfinite": nonfinite}
    other = [f"{k}={asked[k]!r} (it has {has[k]!r})" for k in has if asked[k] != has[k]]
    if other:
        raise ValueError(f"swap: this optimizer is swapped already, with other options: "
                         f"{', '.join(other)}; swap(optimizer, undo=True) first to change them")


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


class _Kind(NamedTuple):
    """What differs between the torch optimizers swap takes."""

    check_options: Callable[..., None]   # (group, where, read_device)
    prepare: Callable[..., _GroupStep]   # (optimizer, record, group, params with gradients)
    check_state: Callable[..., None]     # (a tensor's state, the tensor, its name)


_KINDS: Dict[type, _Kind] = {
    torch.optim.AdamW: _Kind(check_adamw_options, _adam, _check_adam_state),
    torch.optim.Adam: _Kind(check_adamw_options, _adam, _check_adam_state),
    torch.optim.SGD: _Kind(_check_sgd_options, _sgd, _check_sgd_state),
}
# The torch optimizers swap takes.
SWAPPABLE = tuple(_KINDS)
