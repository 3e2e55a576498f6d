"""FRUGAL: AdamW on a state-full subspace, SignSGD on the rest (Zmushko et al., ICML 2025)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from frugal_kernels import ops
from frugal_kernels import _layout
from frugal_kernels._layout import STATE_FREE_RULES, subset_dim, subset_state_shape
from frugal_kernels.optim import subspace
from frugal_kernels.optim.subspace import (BLOCK_ORDERS, COORDINATE_PROJECTIONS,
                                           LOWRANK_PROJECTIONS, PROJECTIONS)

__all__ = ["FRUGAL"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step", "indices", "projection")


@dataclass
class _Bucket:
    """Tensors one op call updates together: same rule, hyper-parameters, dtype,
    device and bias-correction step."""

    rule: str                      # "adamw", "state_free", "subset" or "lowrank"
    group: dict
    lr: Tensor                     # the group's lr as a 0-dim tensor (see _group_lr)
    params: List[Tensor] = field(default_factory=list)
    kind: str = ""                 # subset kind or low-rank projection name
    full_rank: bool = False        # low-rank at full rank: no residual


class FRUGAL(Optimizer):
    r"""FRUGAL: full-rank updates with a state-full subspace.

    Parameters in *projected* groups have their update split in two: a
    subspace holding a fraction ``density`` (rho) of the coordinates is
    updated with AdamW, whose moments exist only for that subspace; everything
    else is updated with the state-free rule (SignSGD by default:
    ``-lr * state_free_lr_scale * sign(g)``). Every ``update_gap`` (T) steps
    the subspace is chosen again; with ``reset_state`` its moments (and their
    bias-correction step) restart. Groups with ``"projected": False`` get plain
    AdamW. Weight decay is decoupled: ``p *= 1 - lr * weight_decay``.

    Projections (``projection``):

    - ``"blocks"``: whole tensors are state-full, ``round(density * n)`` of the
      group's n tensors, chosen by ``block_order`` (``random``, ``ascending``,
      ``descending``, ``mirror``). Tensors that leave the set lose their state.
    - ``"columns"``, ``"rows"``, ``"randk"``: a random subset of
      ``round(density * dim)`` columns (last dim), rows (dim 0) or coordinates
      of each tensor, with compact moments; one fused pass per step
      (:func:`frugal_kernels.ops.frugal_step_`).
    - ``"random"``, ``"svd"``: a rank ``round(density * d)`` subspace of each
      matrix (d the smaller side, GaLore's rule), random semi-orthogonal or the
      top singular vectors of the gradient; the state-free rule acts on the
      residual ``g - P P^T g``. Tensors of more than 2 dims are seen as
      ``[shape[0], rest]``; 1-D tensors get plain AdamW.

    Random choices come from a generator owned by the optimizer, seeded by
    ``seed``: the same on every rank, saved in ``state_dict()``.

    Args:
        params: parameters or param groups; a group may set any of the
            options below and ``"projected"`` (default True).
        lr, betas, eps, weight_decay: as torch.optim.AdamW; ``lr`` may be a
            float or a tensor.
        density: rho, the fraction of each projected group kept state-full.
        update_gap: T, steps between subspace changes.
        projection: one of ``blocks``, ``columns``, ``rows``, ``randk``,
            ``random``, ``svd``.
        state_free: ``"sign"``, ``"sgd"`` or ``"none"`` for the rest.
        state_free_lr_scale: the state-free step is ``lr * state_free_lr_scale``.
        reset_state: restart the moments at each subspace change.
        block_order: order of ``blocks``.
        seed: seed of the optimizer's generator.
        backend: kernel backend of the ops (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"triton"``, ``"torch"``).

    Example::

        opt = frugal_kernels.FRUGAL(frugal_kernels.param_groups(model), lr=1e-3,
                                    density=0.25, update_gap=200)
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        lr: float | Tensor = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.25,
        update_gap: int = 200,
        projection: str = "blocks",
        state_free: str = "sign",
        state_free_lr_scale: float = 1.0,
        reset_state: bool = True,
        block_order: str = "random",
        seed: int = 0,
        backend: str = "auto",
    ):
        if not isinstance(update_gap, int) or update_gap < 1:
            raise ValueError(f"update_gap must be a positive int, got {update_gap!r}")
        if backend != "auto" and backend not in ops.BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {', '.join(ops.BACKENDS)}; "
                             f"got {backend!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, projected=True,
                        density=density, projection=projection, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale, reset_state=reset_state,
                        block_order=block_order)
        _check_group(defaults, "defaults")
        self.backend = backend
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._update_gap = update_gap
        self._steps_taken = 0
        self._last_change: Optional[int] = None
        # Per projected group (by index): the blocks state-full now and the
        # cursor of the block order.
        self._active_blocks: Dict[int, List[int]] = {}
        self._block_cursor: Dict[int, int] = {}
        self._chosen_groups: set = set()
        self.history: List[dict] = []
        self._plan: Optional[List[_Bucket]] = None
        self._plan_key: Optional[tuple] = None
        self._lr_tensors: Dict[int, Tensor] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ public

    @property
    def update_gap(self) -> int:
        """T: steps between subspace changes (current value)."""
        return self._update_gap

    @property
    def rho(self) -> float:
        """The density the projected groups use now."""
        return self._current_density()

    def state_bytes(self) -> int:
        """Bytes of optimizer state allocated right now (every tensor in ``self.state``)."""
        total = 0
        for st in self.state.values():
            for value in st.values():
                if isinstance(value, Tensor):
                    total += value.untyped_storage().nbytes()
        return total

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group}, f"param group {len(self.param_groups)}")
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
    def _prepare_step(self) -> Optional[Tuple[List[_Bucket], List[List[Tensor]]]]:
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
        self._steps_taken += 1
        if self._subspace_due():
            self._change_subspace(self._change_reason())
        self._choose_new_groups()
        key = tuple(p.grad is not None for g in self.param_groups for p in g["params"])
        if self._plan is None or key != self._plan_key:
            self._plan = self._build_plan()
            self._plan_key = key
        for gi, group in enumerate(self.param_groups):
            if not isinstance(group["lr"], Tensor):
                # A group whose tensors have no gradients yet has no bucket, so
                # its lr tensor may not exist yet.
                self._group_lr(gi, group).fill_(group["lr"])
        steps = [self.state[p]["step"] for b in self._plan if b.rule != "state_free"
                 for p in b.params]
        if steps:
            torch._foreach_add_(steps, 1.0)
        return self._plan, [[p.grad for p in b.params] for b in self._plan]

    def _apply(self, plan: List[_Bucket], grads: List[List[Tensor]]) -> None:
        for bucket, bucket_grads in zip(plan, grads):
            self._run_bucket(bucket, bucket_grads)

    # ----------------------------------------------------------- subspace policy

    def _current_density(self) -> float:
        return float(self.defaults["density"])

    def _group_density(self, group: dict) -> float:
        return float(group["density"])

    def _subspace_due(self) -> bool:
        return self._last_change is None or self._steps_taken - self._last_change >= self._update_gap

    def _change_reason(self) -> str:
        return "initial" if self._last_change is None else "update_gap"

    def _change_subspace(self, reason: str) -> None:
        """Choose every projected group's state-full subspace again."""
        self._last_change = self._steps_taken
        for gi, group in enumerate(self.param_groups):
            if group["projected"]:
                self._choose_group(gi, group)
        self._chosen_groups = {gi for gi, g in enumerate(self.param_groups) if g["projected"]}
        self._plan = None
        _release_freed_memory()
        self.history.append({"step": self._steps_taken, "rho": self._current_density(),
                             "update_gap": self._update_gap, "reason": reason})

    def _choose_new_groups(self) -> None:
        """Groups added after the last change get their subspace at their first step."""
        for gi, group in enumerate(self.param_groups):
            if group["projected"] and gi not in self._chosen_groups:
                self._choose_group(gi, group)
                self._chosen_groups.add(gi)
                self._plan = None

    def _choose_group(self, gi: int, group: dict) -> None:
        projection = group["projection"]
        density = self._group_density(group)
        if projection == "blocks":
            self._choose_blocks(gi, group, density)
        elif projection in COORDINATE_PROJECTIONS:
            for p in group["params"]:
                self._choose_subset(p, group, COORDINATE_PROJECTIONS[projection], density)
        else:
            for p in group["params"]:
                self._choose_lowrank(p, group, projection, density)

    def _choose_blocks(self, gi: int, group: dict, density: float) -> None:
        params = group["params"]
        order = group["block_order"]
        n_active = subspace.num_active_blocks(density, len(params), order)
        default_cursor = len(params) - 1 if order == "descending" else 0
        active, cursor = subspace.choose_blocks(len(params), n_active, order,
                                                self._block_cursor.get(gi, default_cursor),
                                                self._generator)
        self._block_cursor[gi] = cursor
        previous = set(self._active_blocks.get(gi, []))
        self._active_blocks[gi] = active
        for i, p in enumerate(params):
            st = self.state[p]
            if i not in active:
                st.clear()  # leaving (or staying out of) the state-full set frees its state
            elif group["reset_state"] or i not in previous or "exp_avg" not in st:
                _fresh_moments(st, p.shape, p.device)

    def _choose_subset(self, p: Tensor, group: dict, kind: str, density: float) -> None:
        if p.dim() == 0:
            kind = "flat"
        dim = subset_dim(p, kind)
        k = subspace.subset_size(density, dim)
        idx = subspace.choose_subset(dim, k, self._generator, p.device)
        st = self.state[p]
        shape = subset_state_shape(p, kind, k)
        if group["reset_state"] or "indices" not in st:
            st.clear()
            _fresh_moments(st, shape, p.device)
        else:
            _carry_moments(st, idx, kind, shape)
        st["indices"] = idx

    def _choose_lowrank(self, p: Tensor, group: dict, kind: str, density: float) -> None:
        st = self.state[p]
        if p.dim() < 2:
            if "exp_avg" not in st or group["reset_state"]:
                st.clear()
                _fresh_moments(st, p.shape, p.device)
            return
        if p.grad is None:
            # Chosen from the gradient: wait for one (see _build_plan).
            st.clear()
            return
        rank = subspace.subset_size(density, _layout.lowrank_dim(p.shape))
        proj = subspace.make_projection(kind, p.grad, rank, self._generator)
        shape = _layout.lowrank_state_shape(p.shape, rank)
        keep = (not group["reset_state"] and "exp_avg" in st
                and tuple(st["exp_avg"].shape) == shape)
        if not keep:
            st.clear()
            _fresh_moments(st, shape, p.device)
        st["projection"] = proj

    # ------------------------------------------------------------------ update

    def _build_plan(self) -> List[_Bucket]:
        """Group tensors into op calls: one per rule, group, dtype, device and step."""
        buckets: Dict[tuple, _Bucket] = {}
        for gi, group in enumerate(self.param_groups):
            projection = group["projection"] if group["projected"] else None
            active = set(self._active_blocks.get(gi, []))
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                st = self.state[p]
                if projection is None or (projection in LOWRANK_PROJECTIONS and p.dim() < 2):
                    if "exp_avg" not in st:
                        _fresh_moments(st, p.shape, p.device)
                    rule, kind, full = "adamw", "", False
                elif projection == "blocks":
                    rule, kind, full = ("adamw" if i in active else "state_free"), "", False
                elif projection in COORDINATE_PROJECTIONS:
                    kind = COORDINATE_PROJECTIONS[projection] if p.dim() > 0 else "flat"
                    rule, full = "subset", False
                    kind = (kind, st["indices"].dtype)
                else:
                    if "projection" not in st:
                        self._choose_lowrank(p, group, projection, self._group_density(group))
                    rank = _layout.projection_rank(st["projection"],
                                                   _layout.lowrank_side(p.shape))
                    rule, kind = "lowrank", projection
                    full = rank == _layout.lowrank_dim(p.shape)
                step = float(st["step"]) if "step" in st else 0.0
                bkey = (rule, gi, kind, full, p.dtype, p.device, step)
                bucket = buckets.get(bkey)
                if bucket is None:
                    bucket = buckets[bkey] = _Bucket(rule, group, self._group_lr(gi, group),
                                                     kind=kind, full_rank=full)
                bucket.params.append(p)
        return list(buckets.values())

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

    def _run_bucket(self, b: _Bucket, grads: List[Tensor]) -> None:
        group = b.group
        beta1, beta2 = group["betas"]
        params = b.params
        lr, wd, eps = b.lr, group["weight_decay"], group["eps"]
        if b.rule == "state_free":
            self._state_free(params, grads, group, lr)
            return
        states = [self.state[p] for p in params]
        m = [st["exp_avg"] for st in states]
        v = [st["exp_avg_sq"] for st in states]
        step = states[0]["step"]
        if b.rule == "adamw":
            ops.adamw_(params, grads, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=wd, step=step, backend=self.backend)
        elif b.rule == "subset":
            kind = b.kind[0]
            ops.frugal_step_(params, grads, m, v, [st["indices"] for st in states], kind=kind,
                             lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, step=step,
                             state_free=group["state_free"],
                             state_free_scale=group["state_free_lr_scale"],
                             backend=self.backend, check_indices=False)
        else:
            self._lowrank(params, grads, states, m, v, step, group, lr, b.full_rank)

    def _state_free(self, params, grads, group, lr) -> None:
        rule = group["state_free"]
        wd, scale = group["weight_decay"], group["state_free_lr_scale"]
        if rule == "sign":
            ops.sign_sgd_(params, grads, lr=lr, weight_decay=wd, scale=scale, backend=self.backend)
            return
        # sgd / none: the fused FRUGAL op with an empty state-full set.
        empty = [torch.empty(0, dtype=torch.int32, device=p.device) for p in params]
        zeros = [torch.empty(0, device=p.device) for p in params]
        ops.frugal_step_(params, grads, zeros, zeros, empty, kind="flat", lr=lr, beta1=0.0,
                         beta2=0.0, eps=0.0, weight_decay=wd, step=1, state_free=rule,
                         state_free_scale=scale, backend=self.backend, check_indices=False)

    def _lowrank(self, params, grads, states, m, v, step, group, lr, full_rank) -> None:
        beta1, beta2 = group["betas"]
        projs = [st["projection"] for st in states]
        sides = [_layout.lowrank_side(p.shape) for p in params]
        low_grads = [_layout.project(g, proj, side) for g, proj, side in zip(grads, projs, sides)]
        # AdamW on a zero "parameter" without decay leaves exactly the update in it.
        low_updates = [torch.zeros_like(lg) for lg in low_grads]
        ops.adamw_(low_updates, low_grads, m, v, lr=lr, beta1=beta1, beta2=beta2,
                   eps=group["eps"], weight_decay=0.0, step=step, backend=self.backend)
        # At full rank the residual is zero but for rounding, which a sign
        # would blow up to +-lr: there is no state-free part.
        rule = "none" if full_rank else group["state_free"]
        ops.lowrank_step_(params, grads, low_updates, low_grads, projs, sides, lr=lr,
                          weight_decay=group["weight_decay"], state_free=rule,
                          state_free_scale=group["state_free_lr_scale"], backend=self.backend)

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["frugal"] = {
            "version": 1,
            "steps_taken": self._steps_taken,
            "last_change": self._last_change,
            "update_gap": self._update_gap,
            "generator": self._generator.get_state(),
            "active_blocks": {gi: list(a) for gi, a in self._active_blocks.items()},
            "block_cursor": dict(self._block_cursor),
            "chosen_groups": sorted(self._chosen_groups),
            "history": [dict(h) for h in self.history],
            **self._extra_state(),
        }
        return sd

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume exactly from :meth:`state_dict`, or raise a ValueError that says
        why the checkpoint does not fit these parameters (nothing is changed then)."""
        if "frugal" not in state_dict:
            raise ValueError("this state dict was not saved by a FRUGAL optimizer (no 'frugal' "
                             "entry); it cannot resume the subspaces and schedules")
        extra = state_dict["frugal"]
        saved_state = state_dict["state"]
        params = [p for g in self.param_groups for p in g["params"]]
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups but the "
                             f"optimizer has {len(self.param_groups)}")
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {gi} has {len(group['params'])} params but the "
                                 f"state dict's has {len(saved['params'])}")
            for key in ("projected", "projection"):
                if saved.get(key, group[key]) != group[key]:
                    raise ValueError(f"param group {gi}: {key} is {group[key]!r} here but "
                                     f"{saved.get(key)!r} in the state dict")
        ids = [pid for g in saved_groups for pid in g["params"]]
        for pid, p in zip(ids, params):
            _check_saved_state(saved_state.get(pid, {}), p, pid)

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
        self._steps_taken = int(extra["steps_taken"])
        self._last_change = None if extra["last_change"] is None else int(extra["last_change"])
        self._update_gap = int(extra["update_gap"])
        self._generator.set_state(extra["generator"])
        self._active_blocks = {int(k): [int(i) for i in v] for k, v in
                               extra["active_blocks"].items()}
        self._block_cursor = {int(k): int(v) for k, v in extra["block_cursor"].items()}
        self._chosen_groups = {int(i) for i in extra["chosen_groups"]}
        self.history = [dict(h) for h in extra["history"]]
        self._load_extra_state(extra)
        self._plan = None


def _check_group(group: dict, where: str) -> None:
    if group.get("projection") not in PROJECTIONS:
        raise ValueError(f"{where}: projection must be one of {', '.join(PROJECTIONS)}; got "
                         f"{group.get('projection')!r}")
    if group.get("state_free") not in STATE_FREE_RULES:
        raise ValueError(f"{where}: state_free must be one of {', '.join(STATE_FREE_RULES)}; "
                         f"got {group.get('state_free')!r}")
    if group.get("block_order") not in BLOCK_ORDERS:
        raise ValueError(f"{where}: block_order must be one of {', '.join(BLOCK_ORDERS)}; got "
                         f"{group.get('block_order')!r}")
    density = group.get("density")
    if not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"{where}: density must be in [0, 1], got {density!r}")
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
    if not group.get("state_free_lr_scale") >= 0.0:
        raise ValueError(f"{where}: state_free_lr_scale must be >= 0")


def _fresh_moments(st: dict, shape, device: torch.device) -> None:
    st["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=device)
    st["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=device)
    st["step"] = torch.zeros((), dtype=torch.float32)


def _carry_moments(st: dict, new_idx: Tensor, kind: str, shape) -> None:
    """reset_state=False for coordinate subsets: coordinates in both the old and
    the new set keep their moments, new ones start at zero."""
    old_idx = st["indices"].long()
    new = new_idx.long()
    dim = 0 if kind in ("rows", "flat") else -1
    if old_idx.numel() == 0:
        src = dst = torch.empty(0, dtype=torch.long, device=new.device)
    else:
        pos = torch.searchsorted(old_idx, new).clamp(max=old_idx.numel() - 1)
        hit = old_idx[pos] == new
        src, dst = pos[hit], torch.nonzero(hit).squeeze(1)
    for key in ("exp_avg", "exp_avg_sq"):
        old = st[key]
        fresh = torch.zeros(shape, dtype=old.dtype, device=old.device)
        fresh.index_copy_(dim, dst, old.index_select(dim, src))
        st[key] = fresh


def _check_saved_state(saved: dict, p: Tensor, pid: Any) -> None:
    for key, value in saved.items():
        if key not in _STATE_KEYS:
            raise ValueError(f"state of param {pid}: unknown entry {key!r}")
        if key == "step":
            continue
        if not isinstance(value, Tensor):
            raise ValueError(f"state of param {pid}: {key} is a {type(value).__name__}, "
                             "not a tensor")
    m = saved.get("exp_avg")
    if m is None:
        return
    if m.dtype != torch.float32:
        raise ValueError(f"state of param {pid}: exp_avg has dtype {m.dtype}, not float32")
    if "exp_avg_sq" not in saved or tuple(saved["exp_avg_sq"].shape) != tuple(m.shape):
        raise ValueError(f"state of param {pid}: exp_avg_sq is missing or shaped unlike exp_avg")
    shape = tuple(p.shape)
    if "indices" in saved:
        k = saved["indices"].numel()
        fits = any(tuple(m.shape) == subset_state_shape(p, kind, k)
                   for kind in ("rows", "columns", "flat"))
    elif "projection" in saved:
        proj = saved["projection"]
        fits = p.dim() >= 2 and proj.dim() == 2 and tuple(m.shape) in (
            _layout.lowrank_state_shape(p.shape, proj.shape[0]),
            _layout.lowrank_state_shape(p.shape, proj.shape[1]))
    else:
        fits = tuple(m.shape) == shape
    if not fits:
        raise ValueError(f"state of param {pid}: exp_avg of shape {tuple(m.shape)} does not fit "
                         f"a parameter of shape {shape}")


def _release_freed_memory() -> None:
    """Hand freed state back to the OS. glibc keeps freed heap memory for reuse
    (its mmap threshold grows after large frees), so the process would keep the
    dropped state; malloc_trim returns it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
