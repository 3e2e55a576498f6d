"""The plan of a step: tensors bucketed into fused op calls, and the calls themselves.

An optimizer says, for each tensor with a gradient, which update *rule* it
takes this step (an :class:`Assignment`); :func:`build` groups the tensors
into :class:`Bucket` s, one per rule, param group, dtype, device and
bias-correction step, and :func:`run` makes one op call per bucket. The plan
changes only when a subspace or the set of tensors with gradients changes, so
it is built outside torch.compile's graphs and reused between changes.

A new rule (a quantized update, say) is a new entry in :data:`RUNNERS`.

A step inside backward (:func:`frugal_kernels.step_in_backward`) updates each
tensor on its own, as its gradient completes: its plan is one bucket per tensor
(:func:`single`), run the same way.

A bucket's first call goes through the registered ops, which check every
argument; the calls after it, while its params are the tensors that call
checked (same storage, shape and dtype), go around the per-tensor checks and
torch.library's Python dispatch (``frugal_kernels.ops.unchecked``), except
under torch.compile, whose graphs call the registered ops. What can change
between steps (the gradients, the options and lr) is checked by the optimizer
at every step. A call whose only new tensors at each step are the gradients
(AdamW, the state-free rule, a subset split, the one-call low-rank step) is
prepared once per bucket (:mod:`frugal_kernels.ops.prepared`: the moments,
subsets and projections are the plan's until it is rebuilt), and a step hands
it the gradients and scalars only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from frugal_kernels import _quant, ops
from frugal_kernels._layout import LEFT, MomentBlocks, inverse_grad_scale, lowrank_side, project
from frugal_kernels._shard import RowShard, local

unchecked = ops.unchecked

__all__ = ["ADAMW", "ADAMW_INT8", "ADAMW_INT8_MASTER", "ADAMW_MASTER", "INT8_MIN_NUMEL",
           "SGD", "SGD_FIRST",
           "STATE_FREE", "Assignment", "Bucket", "RUNNERS", "adamw_assignment", "build",
           "ensure_moments", "stores_int8", "subset_int8", "check_int8_projection",
           "INT8_PROJECTIONS",
           "release", "run", "signature", "single", "pack_step_counters"]


@dataclass(frozen=True)
class Assignment:
    """The rule one tensor takes in a step, with what its op call needs to know.

    ``rule`` is ``"adamw"`` (every coordinate state-full), ``"state_free"``
    (none: the group's ``state_free`` rule only), ``"subset"`` (AdamW on the
    rows, columns or flat coordinates in ``state["indices"]``, the state-free
    rule elsewhere) or ``"lowrank"`` (AdamW in the span of
    ``state["projection"]``, the state-free rule on the residual);
    ``"subset_int8"`` is ``"subset"`` (rows or columns only) on 8-bit moments of the
    compact state (``ops.frugal_step_int8_``, the keys of ``"adamw_int8"``);
    ``"adamw_int8"`` is ``"adamw"`` on 8-bit moments (``ops.adamw_int8_``: codes in
    ``exp_avg`` / ``exp_avg_sq``, their block scales in ``exp_avg_scale`` /
    ``exp_avg_sq_scale``), either with torch.optim.Adam's coupled weight decay when
    ``coupled`` (a swapped torch Adam's); ``"sgd"`` is torch.optim.SGD (``"sgd_first"``
    its first step with momentum, a swapped SGD's); ``"adamw_master"`` is AdamW on an
    fp32 master copy (``state["master"]``) of a bf16 / fp16 tensor, rounded into it
    after every call (BAdam's), and ``"adamw_int8_master"`` the same on 8-bit moments. DQT's
    quantized weights take ``"dqt_adamw"``, ``"dqt_state_free"`` and
    ``"dqt_subset"``: the same three splits applied to their packed codes by
    one ``dqt_update_`` call. Tensors whose assignments are equal can share an
    op call.
    """

    rule: str
    subset_kind: str = ""                    # subset: rows, columns or flat
    index_dtype: Optional[torch.dtype] = None  # subset: every call takes one index dtype
    full_rank: bool = False                  # lowrank at full rank: no residual
    fused: bool = False                      # lowrank: the whole step in one op call
    bits: int = 0                            # dqt: the code width of every weight of the call
    coupled: bool = False                    # adamw(_int8): torch.optim.Adam's L2 decay

    @property
    def stateful(self) -> bool:
        return self.rule not in ("state_free", "dqt_state_free")


ADAMW = Assignment("adamw")
ADAMW_INT8 = Assignment("adamw_int8")
SGD = Assignment("sgd")
SGD_FIRST = Assignment("sgd_first")
ADAMW_MASTER = Assignment("adamw_master")
ADAMW_INT8_MASTER = Assignment("adamw_int8_master")
STATE_FREE = Assignment("state_free")


@dataclass
class Bucket:
    """Tensors one op call updates together.

    ``params`` are the optimizer's parameters (the keys of its state); a DTensor
    among them (FSDP2) is updated through its local block, and ``layouts`` (None for
    a plain tensor) says where that block lies (:class:`RowShard`).
    """

    assignment: Assignment
    group: dict
    lr: Tensor                     # the group's lr as a 0-dim tensor
    params: List[Tensor] = field(default_factory=list)
    layouts: List[Optional[RowShard]] = field(default_factory=list)
    # What the bucket's last checked call saw of its params (see signature); None
    # until a call has been checked.
    checked: Optional[list] = None
    # Per-rule tensors that do not change between calls (the state-free rule's
    # empty subsets).
    cache: dict = field(default_factory=dict)
    # The optimizer's count of steps taken, set before each call: the counter of the
    # random numbers of the rules that draw them (DQT's stochastic rounding).
    rng_step: int = 0
    # The optimizer's per-tensor state dicts of ``params``, in order. The op calls read
    # the moments through them, not through the optimizer's state (keyed by tensor):
    # torch.compile guards a lookup in that mapping on its keys, and would compile the
    # update again whenever a blocks subspace change frees one tensor's state and gives
    # another its moments. A plan is rebuilt whenever the optimizer's state is replaced.
    states: List[dict] = field(default_factory=list)


def signature(params: Sequence[Tensor]) -> list:
    """What a checked call's validity rests on for each param: its storage, shape
    and dtype (``p.data`` replaced by another tensor changes one of them)."""
    return [(p.data_ptr(), p.shape, p.dtype) for p in params]


# With state_dtype="int8", tensors of fewer elements than this, and 1-D tensors (norms,
# biases), keep fp32 moments, as bitsandbytes' and torchao's 8-bit AdamW keep theirs
# (4096 elements is bitsandbytes' min_8bit_size): their state is a sliver of the bytes,
# a scale per block would cost a large share of a small tensor, and a 1-D tensor is one
# row, whose blocks would straddle the ranks' shards under FSDP2.
INT8_MIN_NUMEL = 4096


def stores_int8(group: dict, p: Tensor) -> bool:
    """Whether ``p`` (of ``group``; a DTensor's global shape decides) keeps 8-bit moments."""
    return (group.get("state_dtype", "fp32") == "int8" and p.dim() >= 2
            and p.numel() >= INT8_MIN_NUMEL)


def subset_int8(group: dict, p: Tensor, subset_kind: str) -> bool:
    """Whether ``p``'s rows or columns subset keeps 8-bit moments: the tensors
    :func:`stores_int8` picks, with the compact state's blocks along its rows, which are
    the tensor's rows (rows: the member rows; columns: every row's members), so that a
    row-sharded tensor holds whole blocks. A flat (randk) subset never does."""
    return subset_kind in ("rows", "columns") and stores_int8(group, p)


# The projections whose groups may take state_dtype="int8": whole tensors (blocks) and the
# rows / columns subsets (ops.frugal_step_int8_).
INT8_PROJECTIONS = ("blocks", "rows", "columns")


def check_int8_projection(state_dtype: str, projection: str, where: str,
                          unprojected: str) -> None:
    """Raise a ValueError when ``state_dtype`` asks for 8-bit moments with a projection
    that has none (``unprojected`` names the settings that hold whole-tensor moments)."""
    if state_dtype != "int8":
        return
    if projection == "randk":
        raise ValueError(
            f"{where}: state_dtype='int8' is not available with projection='randk': 8-bit "
            "moments are cut into blocks along the rows of the compact state, and randk's "
            "state is one row of coordinates spread over every row of the tensor, so its "
            "blocks would straddle the tensor's rows and the state would change with the "
            "sharding; use projection='rows', 'columns' or 'blocks' with int8, or "
            "state_dtype='fp32' with randk")
    if projection not in INT8_PROJECTIONS:
        raise ValueError(f"{where}: state_dtype='int8' keeps 8-bit moments for whole tensors "
                         f"({unprojected}) and for the rows and columns subsets; the fused "
                         f"step of projection={projection!r} takes fp32 moments")


def ensure_moments(st: dict, shape, device: torch.device, int8: bool = False) -> None:
    """Give a state its AdamW moments (zero) and step count, unless it has them: fp32
    tensors of ``shape``, or with ``int8`` the 8-bit codes and block scales of
    ``ops.adamw_int8_``.

    Moments are allocated at the first step a tensor is state-full with a
    gradient, as torch.optim does, not when its subspace is chosen."""
    if "exp_avg" in st:
        return
    if int8:
        scales = MomentBlocks(shape).scale_shape
        st["exp_avg"] = torch.zeros(shape, dtype=torch.int8, device=device)
        st["exp_avg_scale"] = torch.zeros(scales, dtype=torch.float32, device=device)
        st["exp_avg_sq"] = torch.zeros(shape, dtype=torch.uint8, device=device)
        st["exp_avg_sq_scale"] = torch.zeros(scales, dtype=torch.float32, device=device)
    else:
        st["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=device)
        st["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=device)
    st["step"] = torch.zeros((), dtype=torch.float32)


def adamw_assignment(st: dict) -> Assignment:
    """The AdamW rule of a state with moments: on fp32 or on 8-bit moments."""
    return ADAMW_INT8 if st["exp_avg"].dtype == torch.int8 else ADAMW


def build(param_groups: Sequence[dict], state,
          assign: Callable[[int, dict, int, Tensor], Assignment],
          group_lr: Callable[[int, dict], Tensor],
          layouts: Optional[Dict[Tensor, RowShard]] = None,
          group_steps: Optional[Callable[[int], bool]] = None) -> List[Bucket]:
    """Bucket every tensor with a gradient by ``assign(group_index, group, index, p)``.

    ``assign`` also gives the tensor the state its rule needs; a bucket holds
    tensors of one group, dtype, device and bias-correction step. ``layouts`` maps
    the DTensor parameters to their :class:`RowShard`; ``group_steps(gi)`` False
    leaves group ``gi`` out (BAdam's inactive blocks)."""
    layouts = layouts or {}
    buckets: Dict[tuple, Bucket] = {}
    for gi, group in enumerate(param_groups):
        if group_steps is not None and not group_steps(gi):
            continue
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            assignment = assign(gi, group, i, p)
            st = state[p]
            step = float(st["step"]) if "step" in st else 0.0
            key = (assignment, gi, p.dtype, p.device, step)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket(assignment, group, group_lr(gi, group))
            bucket.params.append(p)
            bucket.layouts.append(layouts.get(p))
            bucket.states.append(st)
    # In an order of what the buckets are, not of which tensor came first: a subspace
    # change that moves the first tensor from one rule to another then leaves the
    # sequence of calls as it was, which a compiled step is keyed on (the calls touch
    # disjoint tensors, so their order changes no result).
    order = sorted(buckets, key=lambda k: (k[1], k[0].rule, k[0].subset_kind,
                                           str(k[0].index_dtype), k[0].bits, str(k[2]),
                                           str(k[3]), -k[4]))
    return [buckets[k] for k in order]


def single(gi: int, group: dict, i: int, p: Tensor, state,
           assign: Callable[[int, dict, int, Tensor], Assignment],
           group_lr: Callable[[int, dict], Tensor]) -> Bucket:
    """The bucket of ``p`` alone (``group["params"][i]``), as :func:`build` would make it:
    the plan of a tensor stepped on its own, when backward completes its gradient."""
    # A step in backward refuses DTensor parameters (frugal_kernels.step_in_backward):
    # the tensor has no layout.
    assignment = assign(gi, group, i, p)
    return Bucket(assignment, group, group_lr(gi, group), [p], layouts=[None],
                  states=[state[p]])


def release(plan: Sequence[Bucket]) -> None:
    """Let go of what a replaced plan's buckets keep of their tensors (the prepared calls,
    which hold the moments they were made for), so that the state a subspace change
    dropped is freed at once, not when the last reference to the old plan goes."""
    for bucket in plan:
        bucket.cache.clear()
        bucket.checked = None


def pack_step_counters(plan: Sequence[Bucket], state) -> Dict[torch.device, Tensor]:
    """The bias-correction step counts of the plan's state-full tensors as one tensor per
    device (that of the tensors they count for, where the kernels read them and where
    a skipped step's flag is subtracted from them without a host sync), each tensor's
    ``state["step"]`` becoming a 0-dim view of it, so that one ``add_`` counts a step
    for all of them: ``_foreach_add_`` over 0-dim CPU tensors took about 5 us per
    tensor, 560 us a step for LLaMA-130M's."""
    by_device: Dict[torch.device, List[dict]] = {}
    for b in plan:
        if b.assignment.stateful:
            for p in b.params:
                by_device.setdefault(p.device, []).append(state[p])
    packed = {}
    for device, states in by_device.items():
        counts = torch.stack([st["step"].to(device) for st in states])
        for i, st in enumerate(states):
            st["step"] = counts[i]
        packed[device] = counts
    return packed


def run(bucket: Bucket, grads: List[Tensor], backend: str,
        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """One fused op call: ``bucket``'s tensors take their rule with ``grads`` (the local
    blocks of DTensor gradients), which a GradScaler's ``grad_scale`` (when given) is
    divided out of inside the op; a non-zero ``found_inf`` (on the bucket's device)
    leaves every tensor of the call untouched, decided by the kernels."""
    runner = RUNNERS[bucket.assignment.rule]
    amp = {name: t for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf))
           if t is not None}
    # The local blocks are taken at every step: FSDP2 may give a parameter a new
    # block (its lazy init does), and a block taken once would then be stale.
    params = [local(p) for p in bucket.params] if any(bucket.layouts) else bucket.params
    if torch.compiler.is_compiling():
        runner(bucket, params, grads, backend, ops, amp)
        return
    sig = signature(params)
    if bucket.checked is not None and bucket.checked == sig:
        runner(bucket, params, grads, backend, unchecked, amp)
        return
    bucket.checked = None
    bucket.cache.clear()  # made for the tensors the bucket held before
    runner(bucket, params, grads, backend, ops, amp)
    bucket.checked = sig


def _moments(bucket: Bucket):
    states = bucket.states
    m, v = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
    if any(bucket.layouts):
        # A swapped torch optimizer keeps torch's state, DTensors like its parameters
        # (the package's own optimizers keep the local rows): the ops take their blocks.
        m, v = [local(t) for t in m], [local(t) for t in v]
    return states, m, v, bucket.states[0]["step"]


def _prepared(bucket: Bucket, prepare: Callable[[], Callable[..., None]]) -> Callable[..., None]:
    """The bucket's prepared call (``ops.unchecked.prepare_*``), made by ``prepare`` at
    its first unchecked call: its tensors are the plan's until the plan is rebuilt (at
    every subspace change and state dict load), and run checks its params at every
    call (and clears the cache when they change)."""
    prepared = bucket.cache.get("prepared")
    if prepared is None:
        prepared = bucket.cache["prepared"] = prepare()
    return prepared


def _adamw(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    grads, hyper = _adamw_hyper(bucket, params, grads, amp)
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_adamw_(
            params, *_moments(bucket)[1:3], backend=backend))(grads, **hyper)
        return
    calls.adamw_(params, grads, *_moments(bucket)[1:3], backend=backend, **hyper)


def _adamw_int8(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    grads, hyper = _adamw_hyper(bucket, params, grads, amp)
    moments = [[st[key] for st in bucket.states]
               for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")]
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_adamw_int8_(
            params, *moments, backend=backend))(grads, **hyper)
        return
    calls.adamw_int8_(params, grads, *moments, backend=backend, **hyper)


def _adamw_hyper(bucket: Bucket, params, grads, amp):
    """The gradients and keywords of an AdamW call. A torch optimizer's group may say
    maximize (frugal_kernels.swap; the package's own groups do not). A torch Adam's
    decay is coupled (``assignment.coupled``): ``g = (-g if maximize) + weight_decay *
    p`` is formed from the unscaled gradient first (one extra pass), then AdamW runs
    without decay, as torch's single-tensor step rounds it."""
    group = bucket.group
    beta1, beta2 = group["betas"]
    weight_decay, maximize = group["weight_decay"], group.get("maximize", False)
    if bucket.assignment.coupled and weight_decay != 0:
        if "grad_scale" in amp:
            grads = torch._foreach_mul(grads, inverse_grad_scale(amp["grad_scale"]))
        if maximize:
            grads = torch._foreach_neg(grads)
        grads = torch._foreach_add(grads, params, alpha=float(weight_decay))
        amp = {"found_inf": amp["found_inf"]} if "found_inf" in amp else {}
        weight_decay, maximize = 0.0, False
    return grads, dict(lr=bucket.lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=weight_decay, maximize=maximize,
                       step=bucket.states[0]["step"], **amp)


def _sgd(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    """torch.optim.SGD, its momentum buffers in ``state["momentum_buffer"]`` (none without
    momentum); an ``"sgd_first"`` call starts them from the gradients, as torch's first
    step does."""
    group = bucket.group
    momentum = float(group["momentum"])
    buffers = [st["momentum_buffer"] for st in bucket.states] if momentum else []
    if any(bucket.layouts):
        buffers = [local(b) for b in buffers]
    calls.sgd_(params, grads, buffers, lr=bucket.lr, momentum=momentum,
               dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
               nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
               first_step=bucket.assignment.rule == "sgd_first", backend=backend, **amp)


def _on_masters(runner: Callable[..., None]) -> Callable[..., None]:
    """``runner`` applied to the fp32 master copies of bf16 / fp16 params, from their
    gradients read into fp32 (a copy of each, for the call), the result rounded into the
    params. A skipped call (found_inf) leaves the masters as they were, so the params too."""
    def on_masters(bucket: Bucket, params, grads, backend, calls, amp) -> None:
        masters = [st["master"] for st in bucket.states]
        runner(bucket, masters, [g.float() for g in grads], backend, calls, amp)
        torch._foreach_copy_(params, masters)
    return on_masters


def _state_free(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    group = bucket.group
    rule = group["state_free"]
    wd, scale = group["weight_decay"], group["state_free_lr_scale"]
    if rule == "sign":
        hyper = dict(lr=bucket.lr, weight_decay=wd, scale=scale, **amp)
        if calls is unchecked:
            _prepared(bucket, lambda: unchecked.prepare_sign_sgd_(
                params, backend=backend))(grads, **hyper)
            return
        calls.sign_sgd_(params, grads, backend=backend, **hyper)
        return
    # sgd / none: the fused FRUGAL op with an empty state-full set.
    empty, zeros, one = _empty_subsets(bucket)
    hyper = dict(lr=bucket.lr, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=wd, step=one,
                 state_free=rule, state_free_scale=scale, **amp)
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_frugal_step_(
            params, zeros, zeros, empty, kind="flat", backend=backend))(grads, **hyper)
        return
    calls.frugal_step_(params, grads, zeros, zeros, empty, kind="flat", backend=backend,
                       check_indices=False, **hyper)


def _frugal_hyper(bucket: Bucket, amp, state_free: Optional[str] = None) -> dict:
    """The hyper-parameters the FRUGAL ops (frugal_step_, frugal_step_int8_,
    lowrank_adamw_step_) take from a bucket's group: AdamW's for the state-full part, the
    state-free rule (the group's unless ``state_free`` is given) and its lr scale."""
    group = bucket.group
    beta1, beta2 = group["betas"]
    return dict(lr=bucket.lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=bucket.states[0]["step"],
                state_free=state_free or group["state_free"],
                state_free_scale=group["state_free_lr_scale"], **amp)


def _subset(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    kind = bucket.assignment.subset_kind
    hyper = _frugal_hyper(bucket, amp)
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_frugal_step_(
            params, *_subsets(bucket), kind=kind, backend=backend))(grads, **hyper)
        return
    calls.frugal_step_(params, grads, *_subsets(bucket), kind=kind, backend=backend,
                       check_indices=False, **hyper)


def _subset_int8(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    kind = bucket.assignment.subset_kind
    hyper = _frugal_hyper(bucket, amp)
    moments = [[st[key] for st in bucket.states]
               for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")]
    indices = [st["indices"] for st in bucket.states]
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_frugal_step_int8_(
            params, *moments, indices, kind=kind, backend=backend))(grads, **hyper)
        return
    calls.frugal_step_int8_(params, grads, *moments, indices, kind=kind, backend=backend,
                            check_indices=False, **hyper)


def _subsets(bucket: Bucket):
    """The moments and state-full indices of a subset bucket's tensors."""
    states, m, v, _ = _moments(bucket)
    return m, v, [st["indices"] for st in states]


def _lowrank(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    if bucket.assignment.fused and ops.implements("frugal::lowrank_adamw_step_", backend):
        _lowrank_fused(bucket, params, grads, backend, calls, amp)
        return
    group = bucket.group
    beta1, beta2 = group["betas"]
    states, m, v, step = _moments(bucket)
    projections = [st["projection"] for st in states]
    # The side is the global tensor's: a local block of a DTensor may be shaped otherwise.
    sides = [lowrank_side(p.shape) for p in bucket.params]
    low_grads = [project(g, proj, side) for g, proj, side in zip(grads, projections, sides)]
    # Under FSDP2 a left-side projection P^T g sums over the rows, which the ranks
    # share out: each rank holds its rows' part, and an all-reduce adds them up. The
    # right side (g P^T) is row by row: each rank's rows of it are its own.
    left = [layout if layout is not None and side == LEFT else None
            for layout, side in zip(bucket.layouts, sides)]
    for low, layout in zip(low_grads, left):
        if layout is not None:
            layout.all_reduce(low)
    if "grad_scale" in amp:
        # The projections of the unscaled gradient, as lowrank_step_ takes them: the
        # low-rank tensors are small, so they are unscaled here rather than in the op.
        torch._foreach_mul_(low_grads, inverse_grad_scale(amp["grad_scale"]))
    # The low-rank AdamW reads the projections, unscaled already: it takes the skip
    # flag alone, or a NaN projected from a skipped step's gradient would reach m and v.
    skip = {"found_inf": amp["found_inf"]} if "found_inf" in amp else {}
    # A left-side tensor's moments [r, n] are shared out by their rows too: each rank
    # steps its chunk, and the chunks of the update are gathered for the back-projection.
    adam_grads = [low if layout is None else low.narrow(0, *layout.chunk(low.shape[0]))
                  for low, layout in zip(low_grads, left)]
    # AdamW on a zero "parameter" without decay leaves exactly the update in it.
    low_updates = [torch.zeros_like(lg) for lg in adam_grads]
    calls.adamw_(low_updates, adam_grads, m, v, lr=bucket.lr, beta1=beta1, beta2=beta2,
               eps=group["eps"], weight_decay=0.0, step=step, backend=backend, **skip)
    low_updates = [up if layout is None else layout.gather(up, low.shape[0])
                   for up, low, layout in zip(low_updates, low_grads, left)]
    # At full rank the residual is zero but for rounding, which a sign would
    # blow up to +-lr: there is no state-free part.
    rule = "none" if bucket.assignment.full_rank else group["state_free"]
    calls.lowrank_step_(params, grads, low_updates, low_grads, projections, sides, lr=bucket.lr,
                      weight_decay=group["weight_decay"], state_free=rule,
                      state_free_scale=group["state_free_lr_scale"], backend=backend, **amp)


def _lowrank_fused(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    """The whole low-rank step of the bucket's small matrices in one op call."""
    hyper = _frugal_hyper(bucket, amp, "none" if bucket.assignment.full_rank else None)
    if calls is unchecked:
        _prepared(bucket, lambda: unchecked.prepare_lowrank_adamw_step_(
            params, *_projected(bucket), backend=backend))(grads, **hyper)
        return
    calls.lowrank_adamw_step_(params, grads, *_projected(bucket), backend=backend, **hyper)


def _projected(bucket: Bucket):
    """The moments, projections and sides of a low-rank bucket's tensors."""
    states, m, v, _ = _moments(bucket)
    return (m, v, [st["projection"] for st in states],
            [lowrank_side(p.shape) for p in bucket.params])


def _empty_subsets(bucket: Bucket):
    """Empty indices and moments per tensor and a step of 1: the arguments of a
    state-full subset that holds nothing, made once per bucket."""
    if "empty" not in bucket.cache:
        bucket.cache["empty"] = ([torch.empty(0, dtype=torch.int32, device=p.device)
                                  for p in bucket.params],
                                 [torch.empty(0, device=p.device) for p in bucket.params],
                                 torch.tensor(1.0, dtype=torch.float64))
    return bucket.cache["empty"]


def _dqt_call(bucket: Bucket, params, grads, m, v, indices, kind: str, step, beta1: float,
              beta2: float, eps: float, calls, backend, amp) -> None:
    """One dqt_update_ over the bucket's quantized weights (``params``: QuantWeights, or
    their local blocks of rows), which writes their codes."""
    group = bucket.group
    rng_step = bucket.rng_step % (1 << 32)
    # A block of a weight's rows (FSDP2's, or shard_quantized_'s) rounds as those rows
    # of the whole weight do: its elements are keyed by their global index.
    seeds = [p.seed if not layout or not layout.offset else
             _quant.shifted_seed(p.seed, rng_step, layout.offset * p.cols)
             for p, layout in zip(params, _row_layouts(bucket))]
    calls.dqt_update_([p.codes for p in params], [p.scale for p in params], grads, m, v, indices,
                      bits=bucket.assignment.bits, kind=kind, seeds=seeds,
                      lr=bucket.lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=group["weight_decay"], step=step,
                      rng_step=rng_step, state_free=group["state_free"],
                      state_free_scale=group["state_free_lr_scale"], backend=backend,
                      check_indices=False, **amp)


def _row_layouts(bucket: Bucket) -> list:
    """Where each param's rows lie in the whole weight: its :class:`RowShard`, a
    DTensor's or the one the deprecated ``shard_quantized_`` gives its weights; None for
    a whole weight."""
    return [layout or getattr(p, "shard", None) for p, layout in zip(bucket.params,
                                                                     bucket.layouts)]


def _dqt_adamw(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    beta1, beta2 = bucket.group["betas"]
    _, m, v, step = _moments(bucket)
    if "rows" not in bucket.cache:
        # AdamW on every coordinate is the FRUGAL split with every row state-full.
        bucket.cache["rows"] = [torch.arange(p.shape[0], dtype=torch.int32, device=p.device)
                                for p in params]
    _dqt_call(bucket, params, grads, m, v, bucket.cache["rows"], "rows", step, beta1, beta2,
              bucket.group["eps"], calls, backend, amp)


def _dqt_state_free(bucket: Bucket, params, grads, backend, calls,
                    amp) -> None:
    empty, zeros, one = _empty_subsets(bucket)
    _dqt_call(bucket, params, grads, zeros, zeros, empty, "flat", one, 0.0, 0.0, 0.0, calls,
              backend, amp)


def _dqt_subset(bucket: Bucket, params, grads, backend, calls, amp) -> None:
    beta1, beta2 = bucket.group["betas"]
    states, m, v, step = _moments(bucket)
    _dqt_call(bucket, params, grads, m, v, [st["indices"] for st in states],
              bucket.assignment.subset_kind, step, beta1, beta2, bucket.group["eps"], calls,
              backend, amp)


# A runner takes the bucket (its state dicts among it), the tensors its ops update (the
# params, or their local blocks), their gradients, the backend, the module whose op
# faces it calls (``ops``, or ``ops.unchecked`` once checked) and the GradScaler
# keywords of its op calls (``grad_scale`` and ``found_inf``, each when given).
RUNNERS: Dict[str, Callable[[Bucket, List[Tensor], List[Tensor], str, Any, dict],
                            None]] = {
    "adamw": _adamw,
    "adamw_int8": _adamw_int8,
    "sgd": _sgd,
    "sgd_first": _sgd,
    "adamw_master": _on_masters(_adamw),
    "adamw_int8_master": _on_masters(_adamw_int8),
    "state_free": _state_free,
    "subset": _subset,
    "subset_int8": _subset_int8,
    "lowrank": _lowrank,
    "dqt_adamw": _dqt_adamw,
    "dqt_state_free": _dqt_state_free,
    "dqt_subset": _dqt_subset,
}
