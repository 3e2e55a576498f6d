"""``step_in_backward``: the optimizer step inside backward, one tensor at a time.

An ordinary step holds every gradient at once: backward fills them all, then
``optimizer.step()`` reads them. Stepping each tensor as soon as backward has
completed its gradient, and freeing that gradient right after, holds one
tensor's gradient at a time instead (plus, with gradient accumulation, those
still accumulating). :func:`step_in_backward` does this for an existing
optimizer and training loop with ``Tensor.register_post_accumulate_grad_hook``:

- the hook of a parameter fires when autograd has accumulated its gradient;
  on the micro-batch that completes a step it updates that tensor with the
  optimizer's own pieces (its subspace, its rule, its fused op) and sets
  ``.grad = None``;
- the first hook of that backward starts the step (checks, step counts,
  subspace changes), and a callback at the end of backward ends it (BAdam's
  block switch, tensors whose gradient came only from earlier micro-batches):
  the end of the outermost backward, when a reentrant activation checkpoint
  runs a backward pass of its own inside it;
- ``optimizer.step()`` is left with the bookkeeping a loop still calls it for
  (a closure, an LR scheduler's check); ``zero_grad()`` keeps its meaning, and
  after a step in backward there is no gradient left for it to clear.

An optimizer joins by having the four methods of :class:`TensorSteps`
(FusedOptimizer's are the model). A swapped torch optimizer gets them from
:func:`frugal_kernels.optim.swap.tensor_steps`.

Non-finite gradients: the ordinary step's ``nonfinite="skip"`` (the default)
skips the whole step when any gradient is non-finite, which needs every gradient
before the first update. Inside backward it skips per tensor instead: a tensor
whose gradient holds a NaN or an inf is not updated (its parameter and state stay
as they were, its gradient is freed), the others are, and the event is counted
(``handle.nonfinite_skips``, and an entry in the optimizer's ``history``).

What needs every gradient before the first update cannot run this way, and
says so: a GradScaler (its skip of a step with an inf) raises at
``scaler.step``; a global-norm clip is the two-pass :meth:`StepInBackward.norm_pass`
or, in one pass, ``clip="tensor"`` (each tensor's gradient by its own norm), and
``torch.nn.utils.clip_grad_norm_`` over parameters that step in backward raises
(their gradients are gone: it would clip nothing and return 0), as the optimizer's own
one-read ``clip_grad_norm_`` does. Under DistributedDataParallel the
step waits for each bucket's all-reduce (``ddp=``); FSDP2's DTensor parameters
are refused (docs/optimizers.md).
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.optim import Optimizer

from frugal_kernels.optim import swap as _swap
from frugal_kernels.optim.engine import check_int, check_number, first_nonfinite

__all__ = ["CLIP_SCOPES", "StepInBackward", "TensorSteps", "step_in_backward", "handle_of"]

# Where a step in backward keeps its handle on the optimizer instance.
_HANDLE = "_frugal_step_in_backward"
# What max_grad_norm clips by: each tensor's own gradient norm, or the norm of all of them
# (measured in a first backward pass, StepInBackward.norm_pass).
CLIP_SCOPES = ("tensor", "global")
# clip_grad_norm_'s guard against a zero norm, kept so that the two-pass clip is torch's.
_CLIP_EPS = 1e-6

_GRAD_SCALER_ERROR = (
    "a GradScaler cannot drive a step in backward: each tensor was stepped during backward "
    "with its still-scaled gradient, and skipping a step with an inf needs every gradient "
    "first. Train in bfloat16 autocast (no scaler needed), or remove the step in backward "
    "(handle.remove()) to use the GradScaler")

# The handles whose hooks are on now: torch.nn.utils.clip_grad_norm_ is guarded while
# there is one (_guard_clip_grad_norm).
_ACTIVE: "weakref.WeakSet[StepInBackward]" = weakref.WeakSet()
_CLIP_ERROR = (
    "torch.nn.utils.clip_grad_norm_ got parameters that step in backward: their gradients "
    "were used and freed inside backward, so it would clip nothing (and return 0). Clip "
    "inside the step instead: frugal_kernels.step_in_backward(optimizer, max_grad_norm=..., "
    "clip='tensor') (each tensor by its own norm, one pass) or clip='global' (torch's joint "
    "norm, with handle.norm_pass()); or handle.remove() for the ordinary step "
    "(docs/optimizers.md, \"The step in backward\")")


def step_in_backward(optimizer: Optimizer, accumulation_steps: int = 1, *,
                     max_grad_norm: Optional[float] = None, clip: str = "tensor",
                     ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None
                     ) -> "StepInBackward":
    """Step ``optimizer``'s tensors inside backward, each as its gradient completes.

    Every parameter of ``optimizer`` that requires a gradient gets a
    post-accumulate-grad hook. Of each ``accumulation_steps`` backward passes,
    the first ``accumulation_steps - 1`` accumulate gradients as usual; in the
    last, each tensor is updated as soon as its gradient is complete and its
    ``.grad`` is set to None, so about one tensor's gradient is alive at a time
    instead of the model's. The updates equal the ordinary loop's (backward
    ``accumulation_steps`` times, then ``optimizer.step()``). The training loop
    keeps working unchanged: ``optimizer.step()`` only runs a closure and the
    bookkeeping LR schedulers watch, and ``zero_grad()`` finds nothing to clear.

    Args:
        optimizer: a :class:`~frugal_kernels.FRUGAL`, :class:`~frugal_kernels.AdaFRUGAL`,
            :class:`~frugal_kernels.DQT` or :class:`~frugal_kernels.BAdam` (under their
            default ``nonfinite="skip"`` a tensor with a non-finite gradient is not
            updated and the rest of the step goes on; see the module docstring), or
            a torch AdamW / Adam / SGD swapped onto the fused ops
            (:func:`frugal_kernels.swap`), with the ``nonfinite`` policy given to the
            swap (the same default).
        accumulation_steps: backward passes per optimizer step.
        max_grad_norm: clip the gradients to this 2-norm before their update, by
            ``clip``: ``"tensor"``, each tensor's gradient by its own norm (one pass);
            ``"global"``, all of them by their joint norm, as
            ``torch.nn.utils.clip_grad_norm_`` does, measured in a first backward
            pass (:meth:`StepInBackward.norm_pass`); ``accumulation_steps=1`` only.
        ddp: the ``DistributedDataParallel`` module, when ``optimizer`` trains its
            parameters: each tensor is then stepped once its bucket's all-reduce has
            completed (a DDP communication hook), with the averaged gradient. Needed
            under ``torch.distributed`` with more than one rank.

    Returns:
        A :class:`StepInBackward`; ``handle.remove()`` restores the ordinary step.

    Raises:
        TypeError: for an optimizer that cannot step one tensor at a time (a torch
            optimizer not swapped, another type).
        ValueError: for a combination that would be silently wrong (see the module
            docstring), naming what to change.
    """
    return StepInBackward(optimizer, accumulation_steps, max_grad_norm, clip, ddp)


def handle_of(optimizer: Optimizer) -> Optional["StepInBackward"]:
    """The active :class:`StepInBackward` of ``optimizer``, or None."""
    return optimizer.__dict__.get(_HANDLE)


@runtime_checkable
class TensorSteps(Protocol):
    """What :func:`step_in_backward` drives: one optimizer step as these calls, in order.

    - ``tensor_steps_refused()``: why this optimizer, as configured, cannot step inside
      backward (a message), or None; asked when the step in backward is set up.
    - ``begin_tensor_steps()``: once per step, at the first gradient of the backward
      that completes it: the checks and counts the ordinary step makes before its first
      update (a raise here leaves everything as it was).
    - ``step_tensor(p)``: ``p.grad`` is complete; update ``p`` (and its state) as the
      ordinary step would.
    - ``end_tensor_steps()``: once backward is done: the work that needs every tensor
      stepped (BAdam's block switch).

    Every :class:`~frugal_kernels.optim.engine.FusedOptimizer` (FRUGAL, AdaFRUGAL, DQT,
    BAdam) implements it; an optimizer of a user's that does joins the step in backward
    as they do.
    """

    def tensor_steps_refused(self) -> Optional[str]: ...

    def begin_tensor_steps(self) -> None: ...

    def step_tensor(self, p: Tensor) -> None: ...

    def end_tensor_steps(self) -> None: ...


def _tensor_steps_of(optimizer: Optimizer) -> TensorSteps:
    """What steps ``optimizer``'s tensors one at a time (see the module docstring)."""
    if isinstance(optimizer, TensorSteps):
        return optimizer
    if _swap.is_swapped(optimizer):
        return _swap.tensor_steps(optimizer)
    kind = type(optimizer)
    hint = (" (swap it onto the fused ops first: frugal_kernels.swap(optimizer))"
            if kind in _swap.SWAPPABLE else "")
    raise TypeError(f"step_in_backward takes FRUGAL, AdaFRUGAL, BAdam or a swapped torch "
                    f"AdamW / Adam / SGD; got {kind.__module__}.{kind.__qualname__}{hint}")


class StepInBackward:
    """The optimizer step of :func:`step_in_backward`; :meth:`remove` ends it.

    Attributes:
        optimizer: the optimizer it steps.
        accumulation_steps: backward passes per step.
        micro_batch: backward passes since the last step (0 to accumulation_steps - 1).
        steps: steps taken in backward so far.
        peak_grad_bytes: the most bytes of gradients of the optimizer's tensors alive at
            once during the last step's backward passes (each counted at its hook).
        step_seconds: host time the last step spent in the optimizer, inside backward (on
            a GPU the kernels run on asynchronously; synchronize in the hooks to time them).
        nonfinite_skips: tensors left un-updated for a non-finite gradient, over all
            steps (``nonfinite="skip"``; each step with one also adds an entry to the
            optimizer's ``history``).
        skips_per_tensor: whether this handle applies that per-tensor skip (the
            optimizer's ``nonfinite`` is ``"skip"``).
    """

    def __init__(self, optimizer: Optimizer, accumulation_steps: int,
                 max_grad_norm: Optional[float], clip: str, ddp):
        check_int(accumulation_steps, "accumulation_steps", 1, "step_in_backward")
        if clip not in CLIP_SCOPES:
            raise ValueError(f"clip must be one of {', '.join(CLIP_SCOPES)}; got {clip!r}")
        if max_grad_norm is not None:
            check_number(max_grad_norm, "max_grad_norm", "step_in_backward")
            if not max_grad_norm > 0:
                raise ValueError(f"step_in_backward: max_grad_norm must be > 0, got "
                                 f"{max_grad_norm!r}")
            if clip == "global" and accumulation_steps > 1:
                raise ValueError(
                    "a global-norm clip with accumulation_steps > 1 needs the norm of the "
                    "accumulated gradient, which exists only once every micro-batch's "
                    "gradient has been held: use clip='tensor' or accumulation_steps=1")
            if clip == "global" and ddp is not None:
                raise ValueError("a global-norm clip under DDP needs the norm of the averaged "
                                 "gradients before the first update; use clip='tensor'")
        if handle_of(optimizer) is not None:
            raise ValueError("this optimizer already steps in backward; remove() that handle "
                             "first")
        steps = _tensor_steps_of(optimizer)
        reason = steps.tensor_steps_refused()
        if reason is not None:
            raise ValueError(f"{type(optimizer).__name__} cannot step in backward: {reason}")
        params = _params(optimizer)
        for p in params:
            if _is_dtensor(p):
                raise ValueError(
                    "step_in_backward got a DTensor parameter (FSDP2's fully_shard, or "
                    "tensor parallelism): the fused ops update plain tensors; FSDP2 would "
                    "call the hook after its reduce-scatter, on the local shard, but the "
                    "optimizers' subspaces are chosen for the whole tensor")
        _check_distributed(ddp)

        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.clip = clip
        self.micro_batch = 0
        self.steps = 0
        self.peak_grad_bytes = 0
        self.step_seconds = 0.0
        self.nonfinite_skips = 0
        self._step_skips = 0           # of this step
        self._tensor_steps = steps
        self._ddp = ddp
        self._hooks: Dict[Tensor, Any] = {}
        self._in_backward = False
        self._backward_id = 0          # which backward pass an end-of-backward callback ends
        self._stepping = False         # this backward pass completes a step
        self._stepped: set = set()     # tensors stepped in this step
        # Gradient bytes of the hooked tensors alive now, each and in all.
        self._live_grads: Dict[Tensor, int] = {}
        self._live_bytes = 0
        self._norm_pass = False
        self._grad_norms: Dict[Tensor, Tensor] = {}
        self._clip_coef: Optional[Tensor] = None
        self._active = True

        self._patched = {"step": optimizer.__dict__.get("step"),
                         "_step_supports_amp_scaling":
                             optimizer.__dict__.get("_step_supports_amp_scaling")}
        optimizer.__dict__[_HANDLE] = self
        optimizer.step = types.MethodType(_bookkeeping_step(self), optimizer)
        # A GradScaler then hands its scale to step() (which refuses it) instead of
        # unscaling gradients that are gone and failing on an assertion.
        optimizer._step_supports_amp_scaling = True
        self._sync_hooks()
        _ACTIVE.add(self)
        _guard_clip_grad_norm()
        if ddp is not None:
            ddp.register_comm_hook(None, self._ddp_comm_hook)
            # DDP's own optimizer-in-backward switch (DistributedDataParallel.
            # _setup_in_backward_optimizers): its reducer then leaves .grad alone after
            # the all-reduce, where the hook has stepped and freed it.
            ddp.reducer._set_optimizer_in_backward()

    # ------------------------------------------------------------------ public

    def remove(self) -> None:
        """Restore the ordinary step: hooks removed, ``optimizer.step`` as it was. The
        state written meanwhile carries over. Under DDP the communication hook stays
        (DDP cannot unregister one) but only all-reduces, as DDP itself would."""
        if not self._active:
            return
        self._active = False
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        _ACTIVE.discard(self)
        opt = self.optimizer
        del opt.__dict__[_HANDLE]
        for name, saved in self._patched.items():
            opt.__dict__.pop(name, None)
            if saved is not None:
                opt.__dict__[name] = saved

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        """The first backward pass of a global-norm clip (``clip="global"``).

        Inside it, backward's gradients are measured and dropped, without any
        update; the next backward pass steps each tensor with its gradient clipped
        by their joint norm, as ``torch.nn.utils.clip_grad_norm_`` would::

            loss = model(batch)
            with handle.norm_pass():
                loss.backward(retain_graph=True)
            loss.backward()

        Backward runs twice (the clip needs every gradient before the first update,
        and only one is held at a time)."""
        if self.max_grad_norm is None or self.clip != "global":
            raise RuntimeError("norm_pass() is the first pass of step_in_backward(..., "
                               "max_grad_norm=..., clip='global')")
        self._grad_norms = {}
        self._norm_pass = True
        try:
            yield
        finally:
            self._norm_pass = False
        # In the optimizer's order of the tensors, as clip_grad_norm_ over its params.
        norms = [self._grad_norms[p] for p in self._hooks if p in self._grad_norms]
        self._grad_norms = {}
        if not norms:
            self._clip_coef = None
            return
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        self._clip_coef = torch.clamp(self.max_grad_norm / (total + _CLIP_EPS), max=1.0)

    @property
    def skips_per_tensor(self) -> bool:
        # Read at each tensor, as the optimizer's own policy is read at each step.
        return getattr(self._tensor_steps, "nonfinite", None) == "skip"

    # ------------------------------------------------------------------- hooks

    def _sync_hooks(self) -> None:
        """Hook the tensors that require a gradient now (BAdam's next block at its switch)."""
        for p in _params(self.optimizer):
            if p.requires_grad and p not in self._hooks:
                self._hooks[p] = p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: Tensor) -> None:
        if self._norm_pass:
            # Norms in the gradient's dtype, as clip_grad_norm_ takes them.
            self._grad_norms[p] = torch.linalg.vector_norm(p.grad)
            p.grad = None
            return
        try:
            if not self._in_backward:
                self._start_backward()
            self._count_grad(p)
            if self._stepping and self._ddp is None:
                self._step(p)
        except BaseException:
            self._abandon()
            raise

    def _start_backward(self) -> None:
        completes = self.micro_batch + 1 == self.accumulation_steps
        if completes and self.max_grad_norm is not None and self.clip == "global" \
                and self._clip_coef is None:
            raise RuntimeError(
                "clip='global' needs the gradients' norm before the first update: run "
                "`with handle.norm_pass(): loss.backward(retain_graph=True)` before this "
                "backward")
        self._in_backward = True
        self._backward_id += 1
        backward_id = self._backward_id
        # Runs once backward is done (DDP and FSDP end their backward passes this way).
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._end_backward(backward_id))
        self.micro_batch += 1
        if self.micro_batch == 1:
            self.peak_grad_bytes = 0
        if completes:
            # Set first: an error in the step's start ends the step (_abandon).
            self._stepping = True
            self.step_seconds = 0.0
            with _timed(self), torch.no_grad():
                self._tensor_steps.begin_tensor_steps()

    def _count_grad(self, p: Tensor) -> None:
        nbytes = p.grad.untyped_storage().nbytes()
        self._live_bytes += nbytes - self._live_grads.get(p, 0)
        self._live_grads[p] = nbytes
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._live_bytes)

    def _step(self, p: Tensor) -> None:
        """Update ``p`` with its complete gradient and free the gradient."""
        if self.max_grad_norm is not None:
            if self.clip == "global":
                coef = self._clip_coef
            else:
                coef = torch.clamp(self.max_grad_norm /
                                   (torch.linalg.vector_norm(p.grad) + _CLIP_EPS), max=1.0)
            p.grad.mul_(coef.to(p.grad.device))
        # One host read of a flag per tensor, as nonfinite="raise" takes (the ordinary
        # step's on-device skip needs every gradient first).
        if self.skips_per_tensor and first_nonfinite([(0, 0, p)]) is not None:
            self._step_skips += 1
        else:
            with _timed(self), torch.no_grad():
                self._tensor_steps.step_tensor(p)
        self._stepped.add(p)
        p.grad = None
        self._live_bytes -= self._live_grads.pop(p, 0)

    def _end_backward(self, backward_id: int) -> None:
        if backward_id != self._backward_id or not self._in_backward:
            return  # a backward pass that failed and was abandoned
        node = torch._C._current_autograd_node()
        if node is not None:
            # The callback was queued from inside a nested backward pass, run by a node of
            # an outer one (a reentrant activation checkpoint recomputes its region and
            # runs backward through it): the pass this step belongs to goes on. End it
            # with the outer pass: once that node is done, queue this callback again, on
            # the outer pass (nested deeper, it comes back here and moves out again).
            def after_node(grad_inputs, grad_outputs):
                hook.remove()
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._end_backward(backward_id))

            hook = node.register_hook(after_node)
            return
        self._in_backward = False
        if not self._stepping:
            return
        try:
            # Tensors whose gradient came from earlier micro-batches only (none in this
            # one), or arrived where no hook saw it: the ordinary step updates them too.
            for p in list(self._hooks):
                if p.grad is not None and p not in self._stepped:
                    self._step(p)
            # Before the step's end, which may switch BAdam's block: the entry names the
            # block (or rho and T) this step ran with.
            if self._step_skips:
                self._record_skips(self._step_skips)
            with _timed(self), torch.no_grad():
                self._tensor_steps.end_tensor_steps()
        finally:
            self._finish_step()
        self.steps += 1
        self._sync_hooks()

    def _record_skips(self, count: int) -> None:
        """Count the tensors this step left un-updated, on the handle and in the optimizer's
        history (an entry shaped as its others: rho and T, or the block, in force)."""
        self.nonfinite_skips += count
        history = getattr(self.optimizer, "history", None)
        if isinstance(history, list):
            entry = dict(history[-1]) if history else {}
            entry["step"] = getattr(self.optimizer, "_steps_taken", self.steps + 1)
            entry["reason"] = (f"nonfinite gradient: {count} tensor(s) not updated in "
                               "backward")
            history.append(entry)

    def _finish_step(self) -> None:
        self._step_skips = 0
        self._stepping = False
        self._stepped = set()
        self._live_grads, self._live_bytes = {}, 0
        self._clip_coef = None
        self.micro_batch = 0

    def _abandon(self) -> None:
        """Forget the backward pass an error ended (tensors stepped before it stay stepped)."""
        self._in_backward = False
        if self._stepping:
            self._finish_step()

    # --------------------------------------------------------------------- DDP

    def _ddp_comm_hook(self, state: Any, bucket):
        """All-reduce the bucket as DDP's default hook does; in a step, then update its
        tensors with the averaged gradients (as DDP's hook for torch's own
        optimizer-in-backward, optimizer_overlap_hooks._apply_optim_in_backward_hook).
        Returns a Future[Tensor] (unannotated: DDP checks the annotation as an object,
        and this module's annotations are strings)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        fut = allreduce_hook(self._ddp.process_group, bucket)
        fut.wait()
        bucket_view = self._ddp.gradient_as_bucket_view
        stepping = self._active and self._stepping
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if stepping:
                p.grad = g  # the averaged gradient, a view of the bucket, stepped and freed
            elif not bucket_view:
                # The reducer was told to leave .grad alone (_set_optimizer_in_backward):
                # the averaged gradient goes there as DDP's own copy would put it.
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            if stepping and p in self._hooks:
                try:
                    self._step(p)
                except BaseException:
                    self._abandon()
                    raise
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


@contextlib.contextmanager
def _timed(handle: StepInBackward) -> Iterator[None]:
    """Add the time inside to ``handle.step_seconds``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        handle.step_seconds += time.perf_counter() - start


def _bookkeeping_step(handle: StepInBackward) -> Callable:
    """``optimizer.step`` while its tensors step in backward: a closure's forward and
    backward (where the tensors step), and what LR schedulers check."""

    def step(self, closure: Optional[Callable[[], Any]] = None):
        if getattr(self, "grad_scale", None) is not None or \
                getattr(self, "found_inf", None) is not None:
            raise RuntimeError(_GRAD_SCALER_ERROR)
        # An LR scheduler watches this flag (it would wrap the step to set it otherwise).
        self._opt_called = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        handle._sync_hooks()
        return loss

    # Tells LR schedulers made after this that the step already sets _opt_called.
    step._wrapped_by_lr_sched = True
    return step


def _guard_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` refuse the parameters of an active step in
    backward (it would find no gradient and clip nothing); other calls go through
    unchanged. Installed once; a call made while no handle is active only checks an
    empty set."""
    from torch.nn.utils import clip_grad

    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_frugal_guard", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters, *args, **kwargs):
        if _ACTIVE:
            if isinstance(parameters, Tensor):
                parameters = [parameters]
            parameters = list(parameters)
            if any(p in handle._hooks for handle in list(_ACTIVE) for p in parameters):
                raise RuntimeError(_CLIP_ERROR)
        return original(parameters, *args, **kwargs)

    clip_grad_norm_._frugal_guard = True
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if clip_grad.clip_grad_norm_ is original:
        clip_grad.clip_grad_norm_ = clip_grad_norm_


def _params(optimizer: Optimizer) -> List[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_dtensor(p: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(p, DTensor)


def _check_distributed(ddp) -> None:
    """Refuse more than one rank without DDP: each rank's hooks would see its own gradient,
    before any all-reduce, and the ranks would drift apart."""
    if ddp is not None:
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp must be the DistributedDataParallel module, got "
                            f"{type(ddp).__name__}")
        return
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"under torch.distributed with {dist.get_world_size()} ranks a step in backward "
            "would update each tensor with this rank's gradient, before any all-reduce: pass "
            "ddp=<the DistributedDataParallel module> so that it steps after DDP's reduction")
