"""What the package's optimizers share: a torch.optim.Optimizer whose step is a plan of op calls.

:class:`FusedOptimizer` owns the torch.optim contract (closures, GradScaler,
LR schedulers with a float or a tensor lr, torch.compile, ``state_bytes``, a
``load_state_dict`` that checks before it changes anything and keeps the
dtypes of the state); a subclass says which projection family each group
uses (:meth:`FusedOptimizer._family`), what changes before a step
(:meth:`FusedOptimizer._before_plan`: subspaces, active blocks) and which rule
each tensor takes (:meth:`FusedOptimizer._assign`).

DTensor parameters (FSDP2's ``fully_shard``) are stepped through their local
blocks, with state for the local rows only (:mod:`frugal_kernels.optim.sharding`);
``state_dict()`` gives the state in its global form and ``load_state_dict``
takes it back, so that ``torch.distributed.checkpoint`` reshards it.

The step's pieces are functions of this module as well as methods, so that a torch
AdamW / Adam / SGD swapped onto the fused ops (:mod:`frugal_kernels.optim.swap`, whose
state stays torch's) steps through the same checks (:func:`check_new_params`,
:func:`check_step`, :func:`check_saved_state`), skip decision (:func:`step_scales`),
step counts and clip (:func:`clip_grad_norm`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from frugal_kernels import ops
from frugal_kernels._layout import PARAM_DTYPES, MomentBlocks, first_overlap, on_device
from frugal_kernels._shard import RowShard, is_sharded, local
from frugal_kernels.optim import plan, sharding
from frugal_kernels.optim.memory import memory_of
from frugal_kernels.optim.plan import Assignment, Bucket
from frugal_kernels.optim.projections import Projection
from frugal_kernels.optim.protocol import FrugalOptimizer

__all__ = ["NONFINITE_POLICIES", "FusedOptimizer", "by_device", "check_adamw_options",
           "check_backend", "check_int", "check_lr", "check_new_params", "check_nonfinite",
           "check_number", "check_saved_state", "check_step", "check_tensor_step",
           "clip_grad_norm", "count_steps", "first_nonfinite", "param_name", "skip_flag",
           "step_scales", "uncount_skipped"]

_ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step", "exp_avg_scale", "exp_avg_sq_scale")

# What a step does when a gradient holds a NaN or an infinity (see FusedOptimizer.step).
NONFINITE_POLICIES = ("skip", "raise", "propagate")

# The key of a plan of one bucket per tensor (a step in backward), which no ordinary
# step's key (a tuple) equals.
_PER_TENSOR = "per tensor"


class FusedOptimizer(FrugalOptimizer, Optimizer):
    """Base of the optimizers whose step is a few fused op calls (see the module docstring),
    with the training loop's surface (:class:`~frugal_kernels.optim.protocol.FrugalOptimizer`)."""

    _step_supports_amp_scaling = True
    # Tensor subclasses (other than DTensor) whose parameters this optimizer's rules
    # update (DQT's QuantWeight, whose rules write its codes): any other subclass is
    # refused when its group is added, since the fused ops write a tensor's own memory.
    _subclass_params: Tuple[type, ...] = ()
    # Whether a rule of this optimizer draws random numbers (DQT's rounding): then each
    # bucket is given _rng_step() before its call.
    _draws_random_numbers = False

    def __init__(self, params: Iterable, defaults: dict, backend: str, nonfinite: str = "skip",
                 seed: int = 0):
        check_backend(backend)
        check_nonfinite(nonfinite)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.backend = backend
        self.nonfinite = nonfinite
        self.seed = seed
        # The source of every random choice (subspaces): on the CPU, the same on every rank.
        self._generator = torch.Generator().manual_seed(seed)
        self._plan: Optional[List[Bucket]] = None
        self._plan_key: Optional[tuple] = None
        self._lr_tensors: Dict[int, Tensor] = {}
        # The plan's bias-correction step counts, one packed tensor per device.
        self._steps: Dict[torch.device, Tensor] = {}
        self._steps_plan: Optional[List[Bucket]] = None  # the plan self._steps counts for
        # While begin_tensor_steps chooses subspaces: the gradients are still to come.
        self._grads_arriving = False
        # A step in backward: each tensor's own bucket, and where each tensor is.
        self._tensor_buckets: Dict[Tensor, Bucket] = {}
        self._tensor_index: Dict[Tensor, Tuple[int, int]] = {}
        # The DTensor parameters' layouts (FSDP2): where each rank's rows lie.
        self._layouts: Dict[Tensor, RowShard] = {}
        # What clip_grad_norm_ hands to the next step: (clip factor, non-finite flag).
        self._pending_clip: Optional[Tuple[Tensor, Tensor]] = None
        super().__init__(params, defaults)

    # ----------------------------------------------------------- subclass hooks

    def _family(self, group: dict) -> Projection:
        """The projection family of ``group``: its rules, state and saved-state checks."""
        raise NotImplementedError

    def _before_plan(self) -> None:
        """Changes due at this step before the plan is used (subspaces, active blocks);
        set ``self._plan = None`` when they change what a tensor takes."""

    def _assign(self, gi: int, group: dict, i: int, p: Tensor) -> Assignment:
        """The rule of ``p`` (``group["params"][i]``, with a gradient), its state made ready."""
        raise NotImplementedError

    def _group_steps(self, gi: int) -> bool:
        """Whether the tensors of param group ``gi`` take this step (BAdam: its active
        block's only); a gradient of a group that does not is neither checked nor read."""
        return True

    def _check_group(self, group: dict, where: str, read_device: bool = False) -> None:
        """Raise unless ``group``'s options are valid (when it is added, and at every
        step: a user or a scheduler may have changed them; ``read_device``: a tensor lr
        on a GPU may be read, a sync)."""
        check_adamw_options(group, where, read_device)

    def _bookkeeping(self) -> dict:
        """What :meth:`_before_plan` may change besides ``self.state``: restored if the
        step fails before its first write."""
        return {}

    def _restore_bookkeeping(self, saved: dict) -> None:
        """Undo :meth:`_before_plan` with what :meth:`_bookkeeping` returned."""

    def _after_plan(self) -> None:
        """Called once the step's subspace changes and plan are in place (and the
        snapshot that could undo them is gone)."""

    def _rng_step(self) -> int:
        """The counter of the random numbers of this step (for ``_draws_random_numbers``)."""
        return 0

    def _state_may_change(self) -> bool:
        """Whether :meth:`_before_plan` may change subspaces at this step (then the
        per-tensor state is snapshotted, so that a failed step can be undone)."""
        return True

    # ------------------------------------------------------------------ public

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """Clip the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        over this optimizer's parameters, in one read of them.

        Returns the total norm of the gradients (a 0-dim float32 tensor, as torch's). The
        gradients are not rewritten: the clip factor ``min(1, max_norm / (norm + 1e-6))``
        is handed to the next :meth:`step`, whose fused ops apply it as they read the
        gradients (with a GradScaler's scale folded in), and the norm pass's non-finite
        flag is that step's skip decision, so the step makes no pass of its own over the
        gradients. The update equals clipping first and stepping after with the same
        factor, to the bit for float32 gradients (a 16-bit gradient is multiplied in
        float32 without being rounded back to 16 bits first). Under FSDP2 the norm is
        reduced over the ranks. Call it after backward, right before ``step()``.
        """
        return clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite, self._shard_groups())

    def add_param_group(self, param_group: dict) -> None:
        gi = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else params
        if isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs; "
                            "use a list")
        params = list(params)
        layouts = check_new_params(params, gi, [(gj, i, p) for gj, g in enumerate(self.param_groups)
                                                for i, p in enumerate(g["params"])],
                                   self._subclass_params)
        self._check_group({**self.defaults, **param_group}, f"param group {gi}", True)
        super().add_param_group({**param_group, "params": params})
        self._layouts.update(layouts)
        # Every parameter has a state entry from the start (empty until its first
        # state-full step): torch.distributed.checkpoint's get/set_optimizer_state_dict
        # take a step with zero gradients on an optimizer whose state is empty, and that
        # step would choose a first subspace (an svd of zeros) and count a step.
        for p in params:
            self.state[p]
        self._plan = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimization step (``closure`` re-evaluates the model and returns the loss).

        A step is atomic: it checks everything it will touch (every group's
        options and lr, every gradient against its parameter) before it changes
        anything, and a step that raises leaves params, state, step counts,
        subspaces, the generator and ``history`` as they were.

        Non-finite gradients (NaN, +inf, -inf) follow ``self.nonfinite``:

        - ``"skip"`` (default): the step is skipped *on the device*. One fused
          read of the gradients sets a flag tensor, which every op call of the
          step takes as ``found_inf`` (GradScaler's convention): params, moments
          and the bias-correction step counts are left bit-identical, and the
          host never reads the flag (no sync; under FSDP2 the ranks agree
          through a device-side max all-reduce of it).
        - ``"raise"``: the same flag is read on the host (one sync per step) and
          a ValueError names the parameter; nothing changes.
        - ``"propagate"``: the step is applied as the math says (NaN and inf
          reach the params and moments).

        Driven by a GradScaler (``optimizer.grad_scale`` / ``found_inf`` set),
        the scaler's ``found_inf`` is the flag (it was computed over these
        gradients: no second read) and its scale is divided out inside the ops.

        Since the host never learns whether a step was skipped, schedules count
        calls of ``step()``, not applied steps: ``update_gap``, AdaFRUGAL's rho
        and T, the subspace choices and the generator advance at a skipped step
        too, and a subspace change due at that step happens (docs/optimizers.md,
        "Skipped steps and schedules"). The bias-correction step counts of the
        moments (``state["step"]``) count applied steps only.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = self._prepare_step()
        self._pending_clip = None  # taken by this step, whatever happens below
        self._apply(*prepared)
        self._uncount_skipped(prepared[3])
        return loss

    @torch._dynamo.disable
    def _prepare_step(self) -> Tuple[List[Bucket], List[List[Tensor]], Optional[Tensor],
                                     Optional[Tensor]]:
        """Everything but the update: AMP checks, counters, subspace changes and
        the plan of op calls, with each bucket's gradients. Kept out of
        torch.compile's graphs: it is Python bookkeeping and random draws, and
        the plan it returns changes only at subspace changes, so compiled steps
        reuse their graph in between. The gradients are handed over as lists
        rather than read from ``p.grad`` in the graph: a graph that reads them
        from the parameters is tied to the gradient tensors themselves, and a
        backward pass makes new ones each step."""
        # Checks first, writes after: nothing below raises on what the user passed.
        key, with_grads, local_grads = check_step(self.param_groups, self._check_group,
                                                  self._layouts, self._group_steps)
        grad_scale, found_inf = step_scales(self, self.nonfinite, with_grads,
                                            self._shard_groups(), local_grads)
        self._prepare_plan(key)
        self._fill_lrs()
        if self._steps_plan is not self._plan:
            # The counters are replaced only when the plan is rebuilt (new moments, a
            # loaded state dict): packed once per plan.
            self._steps = plan.pack_step_counters(self._plan, self.state)
            self._steps_plan = self._plan
        # Taken back after the update if the step is skipped (_uncount_skipped).
        count_steps(self._counters())
        if self._draws_random_numbers:
            _refuse_capture({b.params[0].device for b in self._plan})
            rng_step = self._rng_step()
            for bucket in self._plan:
                bucket.rng_step = rng_step
        if self._layouts:
            grads = [[local(p.grad) for p in b.params] for b in self._plan]
        else:
            grads = [[p.grad for p in b.params] for b in self._plan]
        return self._plan, grads, grad_scale, found_inf

    @torch._dynamo.disable
    def _uncount_skipped(self, found_inf: Optional[Tensor]) -> None:
        """Take back the step counted by :meth:`_prepare_step` if the ops skipped it
        (``found_inf`` set), on the device: queued after the step's op calls."""
        uncount_skipped(self._counters(), found_inf)

    def _counters(self) -> Dict[torch.device, List[Tensor]]:
        """The plan's packed step counts, as :func:`count_steps` takes them."""
        return {device: [steps] for device, steps in self._steps.items()}

    def _shard_groups(self) -> List[Any]:
        """The process groups the DTensor parameters are sharded over, once each."""
        return sharding.process_groups(self._layouts.values())

    def _prepare_plan(self, key: tuple) -> None:
        """Subspace changes and the plan, undone if they raise (an svd that fails, say)."""
        may_change = self._state_may_change() or self._plan is None or key != self._plan_key
        previous = self._plan
        # Copies of the per-tensor dicts, not of their tensors: choosing a subspace or
        # building the plan replaces state tensors but never writes into them.
        saved_state = {p: dict(st) for p, st in self.state.items()} if may_change else None
        generator_state = self._generator.get_state() if may_change else None
        saved = self._bookkeeping()
        try:
            self._before_plan()
            if self._plan is None or key != self._plan_key:
                self._plan = plan.build(self.param_groups, self.state, self._assign,
                                        self._group_lr, self._layouts, self._group_steps)
                self._plan_key = key
        except BaseException:
            self._restore_bookkeeping(saved)
            if may_change:
                self._generator.set_state(generator_state)
                self.state = defaultdict(dict, saved_state)
            self._plan = None
            raise
        # The snapshot and the replaced plans held the state the step dropped: let it go
        # before the hook, which may hand freed memory back to the OS.
        del saved_state, generator_state
        self._release_stale_plans(previous)
        self._after_plan()

    def _release_stale_plans(self, previous: Optional[List[Bucket]]) -> None:
        """Release (plan.release) ``previous`` and the plan the step counters were packed
        for, unless one of them is the plan in use."""
        for stale in (previous, self._steps_plan):
            if stale is not None and stale is not self._plan:
                plan.release(stale)

    def _apply(self, buckets: List[Bucket], grads: List[List[Tensor]],
               grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
        # The flag on each device the buckets live on (one copy per device).
        flags: Dict[torch.device, Optional[Tensor]] = {}
        for bucket, bucket_grads in zip(buckets, grads):
            device = bucket.params[0].device
            if device not in flags:
                flags[device] = on_device(found_inf, device)
            plan.run(bucket, bucket_grads, self.backend, grad_scale, flags[device])

    def _fill_lrs(self) -> None:
        """Copy each float lr into its group's lr tensor (read by the op calls)."""
        for gi, group in enumerate(self.param_groups):
            if not isinstance(group["lr"], Tensor):
                # A group whose tensors have no gradients yet has no bucket, so
                # its lr tensor may not exist yet.
                self._group_lr(gi, group).fill_(group["lr"])

    def _group_lr(self, gi: int, group: dict) -> Tensor:
        """A group's lr as a tensor. A float lr (what LR schedulers set) is
        copied into a tensor of the optimizer's each step, outside compiled
        graphs, so that torch.compile sees a tensor and a new lr does not
        recompile the step."""
        if isinstance(group["lr"], Tensor):
            return group["lr"]
        if gi not in self._lr_tensors:
            self._lr_tensors[gi] = torch.tensor(float(group["lr"]), dtype=torch.float64)
        return self._lr_tensors[gi]

    # ---------------------------------------------------------- steps in backward
    # frugal_kernels.step_in_backward drives one step as these calls: begin_tensor_steps
    # once, step_tensor for each tensor as backward completes its gradient, and
    # end_tensor_steps once backward is done. Each tensor takes the update the ordinary
    # step gives it, from the same pieces: _before_plan's changes, _assign's rule and a
    # plan bucket holding that one tensor, run by plan.run.

    def tensor_steps_refused(self) -> Optional[str]:
        """Why this optimizer, as set up now, cannot step its tensors one at a time (None
        when it can). Every policy can: under ``nonfinite="skip"`` the step in backward
        skips each tensor whose gradient is non-finite (frugal_kernels.optim.in_backward)."""
        return None

    def begin_tensor_steps(self) -> None:
        """The part of a step that needs no gradient, before its first tensor: the groups'
        checks, the step count and subspace changes, the lr tensors. A choice that reads a
        gradient (svd's subspace) waits for its tensor's (``Subspace.arriving``)."""
        reason = self.tensor_steps_refused()
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot step in backward: {reason}")
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f"param group {gi}")
        self._grads_arriving = True
        try:
            self._before_plan()
        finally:
            self._grads_arriving = False
        if self._plan is None or self._plan_key is not _PER_TENSOR:
            # One bucket per tensor, made at the tensor's first step since the plan was
            # last invalidated; the ordinary step rebuilds its own (the key differs).
            previous = self._plan
            self._plan, self._plan_key = [], _PER_TENSOR
            self._tensor_buckets = {}
            self._release_stale_plans(previous)
        self._fill_lrs()
        self._tensor_index = {p: (gi, i) for gi, group in enumerate(self.param_groups)
                              for i, p in enumerate(group["params"])}

    def step_tensor(self, p: Tensor) -> None:
        """Update ``p`` with its gradient, complete now, as the ordinary step would."""
        gi, i = self._tensor_index[p]
        if not self._group_steps(gi):
            return  # the ordinary step leaves it alone too
        check_tensor_step(gi, i, p, self.nonfinite)
        g = p.grad
        bucket = self._tensor_buckets.get(p)
        if bucket is None:
            group = self.param_groups[gi]
            bucket = plan.single(gi, group, i, p, self.state, self._assign, self._group_lr)
            self._tensor_buckets[p] = bucket
            self._plan.append(bucket)
        if bucket.assignment.stateful:
            # The count after this update, as the ordinary step's packed counters hold it.
            self.state[p]["step"].add_(1.0)
        if self._draws_random_numbers:
            bucket.rng_step = self._rng_step()
        plan.run(bucket, [g], self.backend)

    def end_tensor_steps(self) -> None:
        """After the step's last tensor."""
        self._after_plan()

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """torch's layout. With DTensor parameters (FSDP2) each parameter's state is in
        its global form (:mod:`frugal_kernels.optim.sharding`): the state one process
        would hold, as DTensors sharded on dim 0 and plain tensors held whole, which
        ``torch.distributed.checkpoint`` saves and reshards. Then this is a
        collective: every rank must call it (``get_optimizer_state_dict`` does)."""
        sd = super().state_dict()
        if self._layouts:
            ids = {id(p): pid for g, saved in zip(self.param_groups, sd["param_groups"])
                   for p, pid in zip(g["params"], saved["params"])}
            for group in self.param_groups:
                family = self._family(group)
                for p in group["params"]:
                    layout, pid = self._layouts.get(p), ids[id(p)]
                    if layout is not None and pid in sd["state"]:
                        sd["state"][pid] = family.global_state(sd["state"][pid], p, layout)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume exactly from :meth:`state_dict`, or raise a ValueError that says
        why the checkpoint does not fit these parameters (nothing is changed then).

        With DTensor parameters the state is taken in its global form, as DTensors
        (of any split: ``torch.distributed.checkpoint`` hands them split as the
        parameters are) or as plain tensors holding the whole (a state dict of one
        process, or a full state dict); then this is a collective."""
        self._check_state_dict(state_dict)
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        params = [p for g in self.param_groups for p in g["params"]]
        families = [self._family(g) for g in self.param_groups for _ in g["params"]]
        ids = [pid for g in saved_groups for pid in g["params"]]
        # Converted before anything changes (the checks above passed): a state of
        # the global form becomes this rank's.
        loaded = {}
        for pid, p, family in zip(ids, params, families):
            saved = {k: v for k, v in saved_state.get(pid, {}).items()}
            layout = self._layouts.get(p)
            if layout is not None:
                loaded[p] = family.local_state(saved, p, layout, p.device)
            else:
                # Copies, so that the optimizer never shares state with the dict it loaded.
                loaded[p] = {k: (v.to(p.device, copy=True) if k != "step" else v.clone())
                             if isinstance(v, Tensor) else v for k, v in saved.items()}
        # torch's loader casts every floating state tensor to the param's dtype
        # (and would turn int indices into floats): load groups through it, and
        # the per-param state here, keeping dtypes.
        super().load_state_dict({"state": {},
                                 "param_groups": [self._saved_group(g) for g in saved_groups]})
        self.state = defaultdict(dict, loaded)
        self._load_optimizer_state(state_dict)
        self._plan = None

    def _saved_group(self, saved: dict) -> dict:
        """A saved param group as torch's loader should see it (a subclass drops the
        entries it keeps in a group besides the options)."""
        return saved

    def _load_optimizer_state(self, state_dict: dict) -> None:
        """Load what a subclass adds to the state dict (checked already)."""

    def _check_state_dict(self, state_dict: dict) -> None:
        """Raise a ValueError if ``state_dict`` does not fit these param groups and tensors."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups but the "
                             f"optimizer has {len(self.param_groups)}")
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {gi} has {len(group['params'])} params but the "
                                 f"state dict's has {len(saved['params'])}")
            self._check_saved_group(gi, saved, group)
        for saved, group in zip(saved_groups, self.param_groups):
            family = self._family(group)
            for pid, p in zip(saved["params"], group["params"]):
                check_saved_state(state_dict["state"].get(pid, {}), p, pid, family)

    def _check_saved_group(self, gi: int, saved: dict, group: dict) -> None:
        """Raise a ValueError if the saved group ``gi`` cannot resume ``group``."""


def _refuse_capture(devices) -> None:
    """Raise if a step that draws random numbers is being captured in a CUDA graph:
    the counter of its draws is a host number, which a replay would repeat (every
    replayed step rounding with the same random numbers)."""
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("this optimizer's step draws random numbers (DQT's stochastic "
                           "rounding) by a host-side counter, which a CUDA graph would "
                           "replay unchanged: step it eagerly")


def _check_sharded_gradient(gi: int, i: int, p: Tensor) -> None:
    """Raise unless a DTensor parameter's gradient is split as the parameter is, with a
    contiguous block (FSDP2's are)."""
    g = p.grad
    if not is_sharded(g) or tuple(g.placements) != tuple(p.placements) or \
            g.device_mesh != p.device_mesh:
        got = (f"placements {tuple(g.placements)}" if is_sharded(g)
               else "a plain tensor")
        raise ValueError(f"{param_name(gi, i, p)} is a DTensor with placements "
                         f"{tuple(p.placements)} but its gradient is {got}; the fused ops "
                         "step each rank's block with the same block of the gradient")
    if not g.to_local().is_contiguous():
        raise ValueError(f"{param_name(gi, i, p)}: the local block of its gradient is not "
                         "contiguous")


def check_saved_state(saved: dict, p: Tensor, pid: Any, family: Projection) -> None:
    """Raise a ValueError, naming ``pid``, unless ``saved`` (a state of AdamW's keys and
    the family's, in its global form) can resume ``p``."""
    for key, value in saved.items():
        if key not in _ADAMW_STATE_KEYS + family.state_keys:
            raise ValueError(f"state of param {pid}: unknown entry {key!r}")
        if not isinstance(value, Tensor):
            raise ValueError(f"state of param {pid}: {key} is a {type(value).__name__}, "
                             "not a tensor")
    reason = family.check_saved(saved, p)
    if reason is not None:
        raise ValueError(f"state of param {pid}: {reason}")
    m = saved.get("exp_avg")
    if m is None:
        return
    step = saved.get("step")
    if step is None or step.numel() != 1 or step.is_complex() or not (
            math.isfinite(float(step)) and float(step) >= 0):
        raise ValueError(f"state of param {pid}: its step count is missing or not a finite "
                         f"count >= 0 ({step!r})")
    if "exp_avg_sq" not in saved or tuple(saved["exp_avg_sq"].shape) != tuple(m.shape):
        raise ValueError(f"state of param {pid}: exp_avg_sq is missing or shaped unlike exp_avg")
    _check_saved_moment_dtypes(saved, p, pid)
    if not family.fits(saved, p):
        raise ValueError(f"state of param {pid}: exp_avg of shape {tuple(m.shape)} does not fit "
                         f"a parameter of shape {tuple(p.shape)}")


def _check_saved_moment_dtypes(saved: dict, p: Tensor, pid: Any) -> None:
    """fp32 moments, or 8-bit codes (int8 exp_avg, uint8 exp_avg_sq) with fp32 block scales
    of the codes' blocks (``ops.adamw_int8_``, ``ops.frugal_step_int8_``), and nothing of
    the other kind."""
    m, v = saved["exp_avg"], saved["exp_avg_sq"]
    scale_keys = ("exp_avg_scale", "exp_avg_sq_scale")
    if m.dtype not in (torch.float32, torch.int8):
        raise ValueError(f"state of param {pid}: exp_avg has dtype {m.dtype}, not float32 "
                         "(or int8 codes)")
    want_v = torch.float32 if m.dtype == torch.float32 else torch.uint8
    if v.dtype != want_v:
        raise ValueError(f"state of param {pid}: exp_avg_sq has dtype {v.dtype}, not {want_v} "
                         f"(exp_avg is {m.dtype})")
    if m.dtype == torch.float32:
        if any(key in saved for key in scale_keys):
            raise ValueError(f"state of param {pid}: block scales beside float32 moments")
        return
    # The blocks of the codes' own shape: the parameter's, or a subset's compact state.
    want = MomentBlocks(m.shape).scale_shape
    for key in scale_keys:
        scale = saved.get(key)
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            got = "missing" if scale is None else f"{scale.dtype} of shape {tuple(scale.shape)}"
            raise ValueError(f"state of param {pid}: {key} is {got}; 8-bit moments of a "
                             f"parameter of shape {tuple(p.shape)} have float32 scales of "
                             f"shape {want}")


_CONTIGUOUS_ADVICE = ("make it contiguous before building the optimizer: "
                      "`with torch.no_grad(): param.data = param.data.contiguous()` "
                      "(for a channels_last module: module.to(memory_format=torch.contiguous_format))")


def param_name(gi: int, i: int, p: Tensor) -> str:
    return f"params[{i}] of param group {gi} (shape {tuple(p.shape)}, {p.dtype})"


def _refuse_gradient(gi: int, i: int, p: Tensor) -> None:
    """Raise the ValueError that says why ``p`` cannot take a step with its gradient."""
    name, g = param_name(gi, i, p), p.grad
    if g.layout != torch.strided:
        raise ValueError(f"{name} has a sparse gradient ({g.layout}); the fused ops take dense "
                         "gradients (build the module with sparse=False, e.g. "
                         "nn.Embedding(..., sparse=False))")
    if not p.is_contiguous():
        raise ValueError(f"{name} is not contiguous (its .data was replaced after the optimizer "
                         f"was built); {_CONTIGUOUS_ADVICE}")
    raise ValueError(f"{name} has a gradient of dtype {g.dtype}, unlike its parameter; the "
                     "fused ops take gradients of their parameter's dtype")


def check_new_params(params: List[Any], gi: int, existing: List[Tuple[int, int, Tensor]],
                     subclasses: Tuple[type, ...] = ()) -> Dict[Tensor, RowShard]:
    """Refuse what the fused ops cannot update in place: a parameter listed twice (here
    or in an earlier group), two parameters sharing memory, a non-contiguous parameter,
    a parameter of a dtype the ops do not take, a tensor subclass that holds no values of
    its own, unless the optimizer's rules update it (``subclasses``), a DTensor split in a
    way the optimizers cannot step. Checked once, when the group is added, not at every
    step. Returns the layouts of the DTensor parameters among ``params``."""
    seen: Dict[int, str] = {id(p): param_name(gj, i, p) for gj, i, p in existing}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but params[{i}] of param "
                            f"group {gi} is a {type(p).__name__}")
        name = param_name(gi, i, p)
        if id(p) in seen:
            raise ValueError(f"{name} is the same tensor as {seen[id(p)]}: a parameter may "
                             "appear once in an optimizer (it would be updated twice)")
        block = local(p)
        if is_traceable_wrapper_subclass(block) and not isinstance(block, subclasses):
            raise TypeError(f"{name} is a {type(block).__name__}, a tensor subclass with no "
                            "values of its own to update in place (a QuantLinear's weight is "
                            "packed codes: train it with frugal_kernels.DQT, or keep it out "
                            "of this optimizer with requires_grad_(False))")
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous: the fused ops update parameters in "
                             f"place and need them contiguous; {_CONTIGUOUS_ADVICE}")
        if p.dtype not in PARAM_DTYPES:
            # Refused here, not at the step: the op would refuse it after the step had
            # updated the tensors of other dtypes.
            raise TypeError(f"{name}: the fused ops update float32, bfloat16 and float16 "
                            "parameters")
        seen[id(p)] = name
    clash = first_overlap([(t, True, param_name(gj, i, p)) for gj, i, p in existing
                           for t in memory_of(p)]
                          + [(t, True, param_name(gi, i, p)) for i, p in enumerate(params)
                             for t in memory_of(p)])
    if clash is not None:
        raise ValueError(f"{clash[0]} shares memory with {clash[1]} (views of one tensor): "
                         "each would be updated with the other's gradient; pass separate "
                         "tensors")
    return {p: layout for i, p in enumerate(params)
            if (layout := RowShard.of(p, param_name(gi, i, p))) is not None}


def check_step(param_groups: List[dict], check_group: Callable[[dict, str], None],
               layouts: Dict[Tensor, RowShard],
               group_steps: Optional[Callable[[int], bool]] = None
               ) -> Tuple[tuple, List[Tuple[int, int, Tensor]], List[Tensor]]:
    """Every per-step check of a step, before it changes anything: each group's options
    (``check_group(group, where)``; a user or a scheduler may have changed them) and each
    gradient against its parameter (``layouts``: the DTensor parameters'). What cannot
    change between steps (duplicates, aliasing) is checked when a group is added
    (:func:`check_new_params`). Returns the plan's key (which tensors have gradients;
    None for a group that ``group_steps`` leaves out), the tensors with gradients, as
    (group index, index in the group, tensor), and their gradients (a DTensor's local
    block)."""
    key, with_grads, grads = [], [], []
    strided = torch.strided
    for gi, group in enumerate(param_groups):
        check_group(group, f"param group {gi}")
        if group_steps is not None and not group_steps(gi):
            key.append(None)
            continue
        for i, p in enumerate(group["params"]):
            g = p.grad
            key.append(g is not None)
            if g is None:
                continue
            # The cheap test of every step; torch's grad setter and autograd already
            # hold a gradient to its parameter's shape and device (its dtype too,
            # unless p.grad_dtype was cleared).
            if g.layout is not strided or g.dtype is not p.dtype or not p.is_contiguous():
                _refuse_gradient(gi, i, p)
            if layouts and p in layouts:
                _check_sharded_gradient(gi, i, p)
                g = g.to_local()
            with_grads.append((gi, i, p))
            grads.append(g)
    return tuple(key), with_grads, grads


def check_tensor_step(gi: int, i: int, p: Tensor, nonfinite: str) -> None:
    """The checks of one tensor's step inside backward (``params[i]`` of group ``gi``, its
    gradient complete): the gradient against its parameter, as :func:`check_step`, and
    under ``nonfinite="raise"`` its values (one host read of a flag). The read makes no
    temporary the size of the gradient (a bool mask of each was seen to raise a
    LLaMA-20m step's high-water mark by 50 MB)."""
    g = p.grad
    if g.layout is not torch.strided or g.dtype is not p.dtype or not p.is_contiguous():
        _refuse_gradient(gi, i, p)
    if nonfinite == "raise" and first_nonfinite([(gi, i, p)]) is not None:
        raise ValueError(f"{param_name(gi, i, p)} has a non-finite gradient (NaN or inf); "
                         "its update was not applied (nonfinite='raise'); the tensors "
                         "stepped before it in this backward keep theirs")


def step_scales(optimizer: Optimizer, nonfinite: str, with_grads: List[Tuple[int, int, Tensor]],
                shard_groups: List[Any], local_grads: Optional[List[Tensor]] = None
                ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The ``grad_scale`` and ``found_inf`` of a step's op calls. A GradScaler's scale
    (``optimizer.grad_scale``) goes to the ops, which divide it out as they read the
    gradients: no separate pass over them (8 bytes per parameter); so does the factor of
    a pending ``clip_grad_norm_`` (``optimizer._pending_clip``; 12 bytes per parameter
    that torch's clip writes). The skip is :func:`skip_flag` under ``nonfinite``, with
    the clip's flag, when one is pending, instead of a read of its own."""
    grad_scale, clip = getattr(optimizer, "grad_scale", None), getattr(optimizer, "_pending_clip",
                                                                       None)
    clip_flag = None
    if clip is not None:
        grad_scale, clip_flag = clipped_scale(grad_scale, clip[0]), clip[1]
    found_inf = skip_flag(getattr(optimizer, "found_inf", None), nonfinite, with_grads,
                          shard_groups, local_grads, clip_flag)
    return grad_scale, found_inf


def skip_flag(found_inf: Optional[Tensor], nonfinite: str,
              with_grads: List[Tuple[int, int, Tensor]], shard_groups: List[Any],
              local_grads: Optional[List[Tensor]] = None,
              clip_flag: Optional[Tensor] = None) -> Optional[Tensor]:
    """A step's found_inf: a one-element tensor, non-zero when the step must be skipped,
    decided on the device (None: nothing to skip). ``found_inf`` is a GradScaler's flag,
    used as it is (the scaler computed it over these gradients); without one, under
    ``nonfinite="skip"``, one fused read of the gradients of ``with_grads`` ((group
    index, index, tensor) triples; ``local_grads``, when given, are those gradients,
    a DTensor's as its local block). Over the ranks of ``shard_groups`` (FSDP2) the
    flag is their maximum. ``nonfinite="raise"`` reads the flag here (its one host
    sync) and raises a ValueError naming the parameter. ``clip_flag``, the flag of a
    ``clip_grad_norm_`` over these gradients (already agreed over the ranks), replaces
    that read."""
    own = found_inf is None and nonfinite != "propagate" and bool(with_grads)
    if own and clip_flag is not None:
        flag = clip_flag.detach().reshape(1).clone()
        shard_groups = []  # the clip's norm was reduced over the ranks
    elif own:
        if local_grads is None:
            local_grads = [local(p.grad) for _, _, p in with_grads]
        flag = _nonfinite_flag(local_grads)
    elif found_inf is not None:
        # GradScaler sums the flags of its devices: a count, where the step counts
        # must lose exactly one.
        flag = found_inf.detach().reshape(1).clamp(max=1.0)
    else:
        return None
    if shard_groups:
        # Each rank sees its own rows of the gradients: the ranks decide together, or
        # one would skip a step the others take and their states would part.
        sharding.max_over_ranks_(flag, shard_groups)
    if own and nonfinite == "raise":
        if bool(flag):  # the documented host sync of nonfinite="raise"
            bad = _named_nonfinite(with_grads)
            where = "a parameter's rows on another rank" if bad is None else param_name(*bad)
            raise ValueError(f"{where} has a non-finite gradient (NaN or inf); "
                             "the step was not applied (nonfinite='raise')")
        return None
    return flag


def count_steps(steps: Dict[torch.device, List[Tensor]]) -> None:
    """Count a step in the bias-correction step counts ``steps`` (per device) before its
    update: the kernels' bias correction takes the count after the update."""
    for on_dev in steps.values():
        torch._foreach_add_(on_dev, 1.0)


def uncount_skipped(steps: Dict[torch.device, List[Tensor]], found_inf: Optional[Tensor]) -> None:
    """Take back the step :func:`count_steps` counted where the ops skipped it (``found_inf``
    non-zero), on the device, queued after the update: the counts hold the number of
    applied steps without the host reading the flag."""
    if found_inf is None:
        return
    for device, on_dev in steps.items():
        torch._foreach_sub_(on_dev, on_device(found_inf, device).reshape(()))


def by_device(tensors: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    """``tensors`` grouped by device, in their order; the common case of one device without
    building a dict of lists."""
    if len(set(map(Tensor.get_device, tensors))) == 1:
        return {tensors[0].device: tensors}
    out: Dict[torch.device, List[Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device].append(t)
    return out


def _nonfinite_flag(grads: List[Tensor]) -> Tensor:
    """A one-element float32 tensor on the first gradient's device: 1 when one of
    ``grads`` (plain tensors, a DTensor's local block) holds a NaN or an infinity, else
    0, computed on the devices without a host sync.

    One read of the gradients per device: ``ops.grad_norm``'s on the CPU for large
    gradients (threaded, at memory bandwidth), else GradScaler's own check (which
    multiplies them by 1.0, leaving every value as it was)."""
    device = grads[0].device
    flag = None
    for dev, on_dev in by_device(grads).items():
        if _fused_norm(dev, on_dev):
            found = ops.grad_norm(on_dev)[1]
        else:
            found = torch.zeros(1, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(on_dev, found,
                                                             torch.ones(1, device=dev))
        flag = found if flag is None else torch.maximum(flag, found.to(device), out=flag)
    return flag


# Below this many gradient elements the flag is GradScaler's check even on the CPU: one
# C++ call over the list, where ops.grad_norm's checks and dispatch cost more host time
# than its threads save (the host-overhead bench's 111 tensors of 8,334 elements in all
# took about 2x the time per step through it).
_THREADED_FLAG_MIN = 1 << 20


def _fused_norm(device: torch.device, grads: List[Tensor]) -> bool:
    """Whether the flag is read with ``ops.grad_norm``: on the CPU, for gradients large
    enough that its C++ kernel's threads pay (GradScaler's check reads them on one thread:
    about 7 ms of a 10-17 ms FRUGAL step on a 4096 x 4096 matrix, issue 31). On a GPU that
    check is itself one fused read at bandwidth, launched without the host work of a
    Triton launch and capturable in a CUDA graph, so it stays."""
    return (device.type == "cpu" and sum(map(Tensor.numel, grads)) >= _THREADED_FLAG_MIN
            and ops.resolve("auto", device, "frugal::grad_norm") == "cpu")


def global_norm(grads: List[Tensor], norm_type: float, shard_groups: List[Any]
                ) -> Tuple[Tensor, Tensor]:
    """The norm of ``grads`` (local blocks of DTensors included) as one vector over every
    device and rank, and its non-finite flag: ``ops.grad_norm`` per device, the devices'
    norms combined on the first, the ranks' by an all-reduce (as torch reduces a
    DTensor's). No host sync."""
    if not grads:
        return torch.zeros((), dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    device = grads[0].device
    parts = [ops.grad_norm(on_dev, norm_type=norm_type) for on_dev in by_device(grads).values()]
    norms = torch.stack([n.to(device) for n, _ in parts])
    flag = torch.stack([f.to(device) for _, f in parts]).amax().reshape(1)
    groups = [g for g in shard_groups if g is not None]
    if norm_type == math.inf:
        total = norms.amax() if len(parts) > 1 else norms[0]
        if groups:
            total = sharding.max_over_ranks_(total.reshape(1).clone(), groups).reshape(())
    else:
        squares = norms.double().square().sum()
        if groups:
            squares = sharding.sum_over_ranks_(squares.reshape(1), groups).reshape(())
        total = squares.sqrt().float() if (groups or len(parts) > 1) else norms[0]
    if groups:
        sharding.max_over_ranks_(flag, groups)
    return total, flag


def _refuse_clip_in_backward(optimizer: Optimizer) -> None:
    """Refuse ``optimizer.clip_grad_norm_`` while its tensors step in backward: their
    gradients were used and freed inside backward, so it would find none (a norm of 0)."""
    from frugal_kernels.optim.in_backward import handle_of  # it imports this module

    if handle_of(optimizer) is not None:
        raise RuntimeError(
            "clip_grad_norm_ on an optimizer that steps in backward: the gradients were used "
            "and freed inside backward, so it would clip nothing (and return 0). Clip inside "
            "the step instead: frugal_kernels.step_in_backward(optimizer, max_grad_norm=..., "
            "clip='tensor') (each tensor by its own norm, one pass) or clip='global' (the "
            "joint norm, with handle.norm_pass()); or handle.remove() for the ordinary step")


def clip_grad_norm(optimizer: Optimizer, max_norm: float, norm_type: float,
                   error_if_nonfinite: bool, shard_groups: List[Any]) -> Tensor:
    """``optimizer.clip_grad_norm_`` (FusedOptimizer's, and a torch optimizer's swapped by
    :func:`frugal_kernels.swap`), checked as torch checks it and refused while the
    optimizer steps in backward: the total norm of its gradients (see
    :func:`global_norm`; ``shard_groups``: the ranks of its DTensor parameters), returned,
    and torch's clip factor from it with the non-finite flag left in
    ``optimizer._pending_clip`` for the next step (:func:`step_scales`). One read of the
    gradients, no host sync (but the one ``error_if_nonfinite`` asks for); nothing is
    pending when it raises."""
    _refuse_clip_in_backward(optimizer)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number, got {max_norm!r}")
    if not (math.isfinite(max_norm) and max_norm >= 0):
        raise ValueError(f"max_norm must be finite and >= 0, got {max_norm}")
    norm_type = float(norm_type)
    if not (norm_type == 2.0 or norm_type == math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    grads = [local(p.grad) for group in optimizer.param_groups
             for p in group["params"] if p.grad is not None]
    total, found_inf = global_norm(grads, norm_type, shard_groups)
    if error_if_nonfinite and not bool(torch.isfinite(total)):  # the sync torch makes too
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped; to skip such steps "
                           "instead, leave error_if_nonfinite=False")
    # torch's factor, to the bit: computed in float32 from the float32 norm.
    optimizer._pending_clip = (torch.clamp(max_norm / (total + 1e-6), max=1.0), found_inf)
    return total


def clipped_scale(grad_scale: Optional[Tensor], factor: Tensor) -> Tensor:
    """The ``grad_scale`` the ops take (they multiply the gradients by its inverse, computed
    in double and rounded to float32 once) for a clip ``factor``: ``scale / factor`` in
    double, whose inverse rounds back to exactly ``factor / scale`` (for a GradScaler's
    power-of-two scale, exactly the product of both multipliers)."""
    factor = factor.detach().reshape(()).double()
    if grad_scale is None:
        return factor.reciprocal()
    return grad_scale.detach().reshape(()).to(factor.device).double() / factor


def first_nonfinite(with_grads: List[Tuple[int, int, Tensor]]
                    ) -> Optional[Tuple[int, int, Tensor]]:
    """The first (group index, index, tensor) whose gradient holds a NaN or an infinity
    (a host sync: for nonfinite="raise", which names it)."""
    if not bool(_nonfinite_flag([local(p.grad) for _, _, p in with_grads])):
        return None
    return _named_nonfinite(with_grads)


def _named_nonfinite(with_grads: List[Tuple[int, int, Tensor]]
                     ) -> Optional[Tuple[int, int, Tensor]]:
    """The first item whose (local) gradient is not finite, by a second pass over them
    (run only once a flag said one is there; None: it is on another rank)."""
    return next((item for item in with_grads
                 if not bool(local(item[2].grad).isfinite().all())), None)


def check_backend(backend: Any) -> None:
    if backend != "auto" and backend not in ops.BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(ops.BACKENDS)}; "
                         f"got {backend!r}")


def check_nonfinite(nonfinite: Any) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}; "
                         f"got {nonfinite!r}")


def check_int(value: Any, name: str, low: int = 1, where: str = "") -> None:
    """An int >= low (a bool is not an int here: ``update_gap=True`` is a mistake)."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{prefix}{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{prefix}{name} must be an int >= {low}, got {value!r}")


def check_number(value: Any, name: str, where: str, low: float = 0.0) -> None:
    """A real, finite number >= low (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{where}: {name} must be finite and >= {low:g}, got {value!r}")


def check_lr(lr: Any, where: str, read_device: bool = False) -> None:
    """Raise unless ``lr`` is a finite number >= 0, or a one-element real tensor holding
    one; a tensor is checked by value where that needs no device sync (on the CPU, or
    ``read_device``)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: a tensor lr must have one element")
        if lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(f"{where}: a tensor lr must be real, got dtype {lr.dtype}")
        if read_device or lr.device.type == "cpu":
            check_number(float(lr), "lr", where)
    else:
        check_number(lr, "lr", where)


def check_adamw_options(group: dict, where: str, read_device: bool = False) -> None:
    """Raise unless ``group``'s lr, betas, eps and weight_decay are valid AdamW options:
    lr (see :func:`check_lr`), eps and weight_decay finite and >= 0, betas a pair in
    [0, 1)."""
    check_lr(group.get("lr"), where, read_device)
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for beta in betas:
        check_number(beta, "betas", where)
        if not beta < 1.0:
            raise ValueError(f"{where}: betas must be in [0, 1), got {tuple(betas)!r}")
    check_number(group.get("eps"), "eps", where)
    check_number(group.get("weight_decay"), "weight_decay", where)
