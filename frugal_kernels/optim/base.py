"""What the package's optimizers share: a torch.optim.Optimizer whose step is a plan of op calls.

:class:`FusedOptimizer` owns the torch.optim contract (closures, GradScaler,
LR schedulers with a float or a tensor lr, torch.compile, ``state_bytes``, a
``load_state_dict`` that checks before it changes anything and keeps the
dtypes of the state); a subclass says which projection family each group
uses (:meth:`FusedOptimizer._family`), what changes before a step
(:meth:`FusedOptimizer._before_plan`: subspaces, active blocks) and which rule
each tensor takes (:meth:`FusedOptimizer._assign`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from frugal_kernels import ops
from frugal_kernels.optim import plan
from frugal_kernels.optim.plan import Assignment, Bucket
from frugal_kernels.optim.projections import Projection

__all__ = ["FusedOptimizer", "check_adamw_options"]

_ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class FusedOptimizer(Optimizer):
    """Base of the optimizers whose step is a few fused op calls (see the module docstring)."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: dict, backend: str):
        if backend != "auto" and backend not in ops.BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {', '.join(ops.BACKENDS)}; "
                             f"got {backend!r}")
        self.backend = backend
        self._plan: Optional[List[Bucket]] = None
        self._plan_key: Optional[tuple] = None
        self._lr_tensors: Dict[int, Tensor] = {}
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

    # ------------------------------------------------------------------ public

    def state_bytes(self) -> int:
        """Bytes of optimizer state allocated right now (every tensor in ``self.state``)."""
        return sum(value.untyped_storage().nbytes() for st in self.state.values()
                   for value in st.values() if isinstance(value, Tensor))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plan = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimization step (``closure`` re-evaluates the model and returns the loss).

        When driven by a GradScaler (``optimizer.found_inf`` set and non-zero)
        the step is skipped and nothing changes, schedules included.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = self._prepare_step()
        if prepared is not None:
            self._apply(*prepared)
        return loss

    @torch._dynamo.disable
    def _prepare_step(self) -> Optional[Tuple[List[Bucket], List[List[Tensor]]]]:
        """Everything but the update: AMP checks, counters, subspace changes and
        the plan of op calls, with each bucket's gradients. Kept out of
        torch.compile's graphs: it is Python bookkeeping and random draws, and
        the plan it returns changes only at subspace changes, so compiled steps
        reuse their graph in between. The gradients are handed over as lists
        rather than read from ``p.grad`` in the graph: a graph that reads them
        from the parameters is tied to the gradient tensors themselves, and a
        backward pass makes new ones each step."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item()):
            return None
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_scale.reciprocal())
        self._before_plan()
        key = tuple(p.grad is not None for g in self.param_groups for p in g["params"])
        if self._plan is None or key != self._plan_key:
            self._plan = plan.build(self.param_groups, self.state, self._assign, self._group_lr)
            self._plan_key = key
        for gi, group in enumerate(self.param_groups):
            if not isinstance(group["lr"], Tensor):
                # A group whose tensors have no gradients yet has no bucket, so
                # its lr tensor may not exist yet.
                self._group_lr(gi, group).fill_(group["lr"])
        steps = plan.step_counters(self._plan, self.state)
        if steps:
            torch._foreach_add_(steps, 1.0)
        return self._plan, [[p.grad for p in b.params] for b in self._plan]

    def _apply(self, buckets: List[Bucket], grads: List[List[Tensor]]) -> None:
        for bucket, bucket_grads in zip(buckets, grads):
            plan.run(bucket, bucket_grads, self.state, self.backend)

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

    # ------------------------------------------------------------- checkpoints

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume exactly from :meth:`state_dict`, or raise a ValueError that says
        why the checkpoint does not fit these parameters (nothing is changed then)."""
        self._check_state_dict(state_dict)
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [pid for g in saved_groups for pid in g["params"]]
        # torch's loader casts every floating state tensor to the param's dtype
        # (and would turn int indices into floats): load groups through it, and
        # the per-param state here, keeping dtypes.
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        self.state = defaultdict(dict)
        for pid, p in zip(ids, params):
            # Copies, so that the optimizer never shares state with the dict it loaded.
            self.state[p] = {k: (v.to(p.device, copy=True) if k != "step" else v.clone())
                             if isinstance(v, Tensor) else v
                             for k, v in saved_state.get(pid, {}).items()}
        self._load_optimizer_state(state_dict)
        self._plan = None

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
                _check_saved_state(state_dict["state"].get(pid, {}), p, pid, family)

    def _check_saved_group(self, gi: int, saved: dict, group: dict) -> None:
        """Raise a ValueError if the saved group ``gi`` cannot resume ``group``."""


def _check_saved_state(saved: dict, p: Tensor, pid: Any, family: Projection) -> None:
    for key, value in saved.items():
        if key not in _ADAMW_STATE_KEYS + family.state_keys:
            raise ValueError(f"state of param {pid}: unknown entry {key!r}")
        if key != "step" and not isinstance(value, Tensor):
            raise ValueError(f"state of param {pid}: {key} is a {type(value).__name__}, "
                             "not a tensor")
    m = saved.get("exp_avg")
    if m is None:
        return
    if m.dtype != torch.float32:
        raise ValueError(f"state of param {pid}: exp_avg has dtype {m.dtype}, not float32")
    if "exp_avg_sq" not in saved or tuple(saved["exp_avg_sq"].shape) != tuple(m.shape):
        raise ValueError(f"state of param {pid}: exp_avg_sq is missing or shaped unlike exp_avg")
    if not family.fits(saved, p):
        raise ValueError(f"state of param {pid}: exp_avg of shape {tuple(m.shape)} does not fit "
                         f"a parameter of shape {tuple(p.shape)}")


def check_adamw_options(group: dict, where: str) -> None:
    """Raise a ValueError unless ``group``'s lr, betas, eps and weight_decay are AdamW's."""
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: a tensor lr must have one element")
    elif not lr >= 0.0:
        raise ValueError(f"{where}: lr must be >= 0, got {lr!r}")
    beta1, beta2 = group.get("betas")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{where}: betas must be in [0, 1), got {group.get('betas')!r}")
    if not group.get("eps") >= 0.0:
        raise ValueError(f"{where}: eps must be >= 0, got {group.get('eps')!r}")
    if not group.get("weight_decay") >= 0.0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group.get('weight_decay')!r}")
