"""FRUGAL: AdamW on a state-full subspace, SignSGD on the rest (Zmushko et al., ICML 2025)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels._layout import STATE_DTYPES, STATE_FREE_RULES
from frugal_kernels._shard import local
from frugal_kernels.optim.engine import FusedOptimizer, check_adamw_options, check_int, check_number
from frugal_kernels.optim.memory import release_freed_memory
from frugal_kernels.optim.plan import Assignment, check_int8_projection
from frugal_kernels.optim.projections import DENSE, FAMILIES, Projection, Subspace
from frugal_kernels.optim.subspace_choice import BLOCK_ORDERS, PROJECTIONS

__all__ = ["FRUGAL"]

# Format of the "frugal" entry of the state dict. 3: in the first param group, its
# lists and maps written as lists of lists (see _encode_extra); 2: a top-level entry
# (which torch.distributed.checkpoint's get_optimizer_state_dict drops: it keeps
# "state" and "param_groups" only); 1: 2 with the blocks' memory in two maps.
_FORMAT = 3


class FRUGAL(FusedOptimizer):
    r"""FRUGAL: full-rank updates with a state-full subspace.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                          \\
            &\textbf{input}: \gamma \text{ (lr)}, \: \beta_1, \beta_2 \text{ (betas)},
                \: \epsilon \text{ (eps)}, \: \lambda \text{ (weight decay)},
                \: \theta_0 \text{ (params)}, \: f(\theta) \text{ (objective)}            \\
            &\hspace{13mm} \rho \text{ (density)}, \: T \text{ (update\_gap)},
                \: s \text{ (state\_free\_lr\_scale)},
                \: \phi \text{ (state\_free: sign, sgd or none)}                          \\
            &\rule{110mm}{0.4pt}                                                          \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do}                  \\
            &\hspace{5mm} g_t \leftarrow \nabla_{\theta} f_t (\theta_{t-1})               \\
            &\hspace{5mm} \textbf{if} \: (t - 1) \bmod T = 0                              \\
            &\hspace{10mm} P \leftarrow \text{a subspace keeping a fraction } \rho
                \text{ of } \theta \text{ (see projection)}                              \\
            &\hspace{10mm} m \leftarrow 0, \: v \leftarrow 0, \: k \leftarrow 0
                \quad \text{(if reset\_state)}                                            \\
            &\hspace{5mm} k \leftarrow k + 1, \quad \tilde{g} \leftarrow P^{\top} g_t       \\
            &\hspace{5mm} m \leftarrow \beta_1 m + (1 - \beta_1) \tilde{g}                \\
            &\hspace{5mm} v \leftarrow \beta_2 v + (1 - \beta_2) \tilde{g}^2              \\
            &\hspace{5mm} u \leftarrow P \, \Big(\frac{m / (1 - \beta_1^k)}
                {\sqrt{v / (1 - \beta_2^k)} + \epsilon}\Big)                              \\
            &\hspace{5mm} \theta_t \leftarrow \theta_{t-1} (1 - \gamma \lambda) - \gamma u
                - \gamma s \, \phi\big(g_t - P P^{\top} g_t\big)                        \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
            &\bf{return} \: \theta_t                                                      \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    where :math:`\phi(r) = \mathrm{sign}(r)`, :math:`r` or :math:`0`. The moments
    :math:`m, v` exist only in the subspace (``rho`` of the memory of AdamW's).
    Groups with ``"projected": False`` get plain AdamW (:math:`P = I`).

    Projections (``projection``; :mod:`frugal_kernels.optim.projections`):

    - ``"blocks"``: :math:`P` keeps whole tensors, ``round(density * n)`` of the
      group's n, chosen by ``block_order`` (``random``, ``ascending``,
      ``descending``, ``mirror``). Tensors that leave the set lose their state.
    - ``"columns"``, ``"rows"``, ``"randk"``: a random subset of
      ``round(density * dim)`` columns (last dim), rows (dim 0) or coordinates
      of each tensor, with compact moments; one fused pass per step
      (:func:`frugal_kernels.ops.frugal_step_`).
    - ``"random"``, ``"svd"``: a rank ``round(density * d)`` subspace of each
      matrix (d the smaller side, GaLore's rule), random semi-orthogonal or the
      top singular vectors of the gradient. Tensors of more than 2 dims are
      seen as ``[shape[0], rest]``; 1-D tensors get plain AdamW. At full rank
      the residual is dropped (it is rounding noise, which a sign would
      amplify).

    Random choices come from a generator owned by the optimizer, seeded by
    ``seed``: the same on every rank, saved in ``state_dict()``. Moments are
    allocated at a tensor's first state-full step with a gradient.

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
        state_free_lr_scale: s, the state-free step is ``lr * state_free_lr_scale``.
        reset_state: restart the moments at each subspace change.
        block_order: order of ``blocks``.
        seed: seed of the optimizer's generator (an int).
        nonfinite: what a step does when a gradient holds a NaN or an infinity:
            ``"skip"`` (params, moments and step counts unchanged, as a GradScaler's
            skip, decided on the device: no host sync; the schedules count the call),
            ``"raise"`` (a ValueError naming the parameter, nothing changes; one host
            sync per step) or ``"propagate"`` (the step applies them: NaN reaches the
            params and moments). See :meth:`FusedOptimizer.step`.
        backend: kernel backend of the ops (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"triton"``, ``"torch"``).
        state_dtype: how AdamW's moments are stored: ``"fp32"``, or ``"int8"``
            (:func:`frugal_kernels.ops.adamw_int8_`: 8-bit codes with an fp32 scale
            per block of 256 elements along each tensor's rows, about a quarter of the
            bytes), for the whole tensors of ``projection="blocks"`` and the groups
            that are not projected, and for the compact state of the ``"rows"`` and
            ``"columns"`` subsets (:func:`frugal_kernels.ops.frugal_step_int8_`, its
            blocks along the compact state's rows); tensors of fewer than 4096
            elements and 1-D tensors keep fp32 moments. ``projection="randk"`` and
            the low-rank projections refuse ``"int8"`` (randk's state is one row
            spread over the tensor's rows: its blocks would straddle them). A checkpoint loads only into an optimizer of
            its own ``state_dtype``.

    Example::

        opt = frugal_kernels.FRUGAL(frugal_kernels.param_groups(model), lr=1e-3,
                                    density=0.25, update_gap=200)
    """

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
        nonfinite: str = "skip",
        state_dtype: str = "fp32",
    ):
        check_int(update_gap, "update_gap")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, projected=True,
                        density=density, projection=projection, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale, reset_state=reset_state,
                        block_order=block_order, state_dtype=state_dtype)
        self._check_group(defaults, "defaults", read_device=True)
        self._update_gap = update_gap
        self._steps_taken = 0
        self._last_change: Optional[int] = None
        # Per projected group (by index) whose subspace is chosen: its family's record.
        self._subspaces: Dict[int, dict] = {}
        self.history: List[dict] = []
        # from_optimizer: the AdamW moments to carry into the first step's state.
        self._carried: Dict[Tensor, dict] = {}
        super().__init__(params, defaults, backend, nonfinite, seed)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **options):
        """This optimizer over an existing ``torch.optim.AdamW`` (or ``Adam`` with
        decoupled or no weight decay)'s parameters, keeping its param groups, their
        hyper-parameters (lr, betas, eps, weight_decay, and any key of your own, such
        as ``"projected"`` or a scheduler's ``"initial_lr"``) and its moments.

        ``options`` are this optimizer's own (``density``, ``projection``,
        ``update_gap``, ...; AdaFRUGAL's schedules) and defaults for keys the groups
        lack. The Adam moments and step count of each parameter are carried into
        its state-full part at its first step with a gradient: whole for AdamW
        coordinates (non-projected groups, state-full blocks), the subset's rows,
        columns or coordinates for ``rows`` / ``columns`` / ``randk``; the low-rank
        kinds (``random``, ``svd``) start their moments afresh (a projection of a
        second moment is not the second moment of the projection). The carried
        tensors are the old optimizer's: delete it to free its state. A scheduler
        holds its optimizer: make a new one for the new optimizer, with
        ``last_epoch=step - 1`` to resume its schedule. Each group keeps the
        ``"initial_lr"`` an earlier scheduler set, and one that had none gets its
        current lr as ``"initial_lr"`` (what a scheduler made at step 0 would have
        recorded), since torch's schedulers made with ``last_epoch`` read it.

        Raises TypeError for another optimizer type and ValueError for settings
        FRUGAL does not have (``amsgrad``, ``maximize``, Adam's coupled weight
        decay); the old optimizer is left as it was.
        """
        groups, carried = _groups_and_moments(optimizer)
        new = cls(groups, **options)
        new._carried = carried
        for group in new.param_groups:
            if "initial_lr" not in group:
                lr = group["lr"]
                group["initial_lr"] = lr.clone() if isinstance(lr, Tensor) else lr
        return new

    @property
    def update_gap(self) -> int:
        """T: steps between subspace changes (current value)."""
        return self._update_gap

    @property
    def rho(self) -> float:
        """The density the projected groups use now."""
        return self._current_density()

    def training_info(self) -> Dict[str, float]:
        """rho and T in force now (:attr:`rho`, :attr:`update_gap`)."""
        return {"rho": self.rho, "update_gap": self.update_gap}

    def _check_group(self, group: dict, where: str, read_device: bool = False) -> None:
        _check_group(group, where, read_device)

    # ----------------------------------------------------------- subspace policy

    def _current_density(self) -> float:
        return float(self.defaults["density"])

    def _group_density(self, group: dict) -> float:
        return float(group["density"])

    def _family(self, group: dict) -> Projection:
        return FAMILIES[group["projection"]] if group["projected"] else DENSE

    def _subspace(self, gi: int, group: dict) -> Subspace:
        record = self._subspaces.setdefault(gi, {}) if group["projected"] else {}
        return Subspace(group, self.state, self._generator, self._group_density(group), record,
                        self._layouts, arriving=self._grads_arriving)

    def _before_plan(self) -> None:
        self._steps_taken += 1
        if self._last_change is None or self._steps_taken - self._last_change >= self._update_gap:
            self._change_subspace("initial" if self._last_change is None else "update_gap")
        # Groups added after the last change get their subspace at their first step.
        for gi, group in enumerate(self.param_groups):
            if group["projected"] and gi not in self._subspaces:
                self._family(group).choose(self._subspace(gi, group))
                self._plan = None

    def _after_plan(self) -> None:
        # from_optimizer's moments went into the plan's tensors as they were assigned;
        # those of tensors without a gradient at the first step are let go with them.
        self._carried = {}
        if self._last_change == self._steps_taken:
            # The state the new subspaces dropped is free now: hand it back to the OS.
            release_freed_memory()

    def _state_may_change(self) -> bool:
        return (self._last_change is None
                or self._steps_taken + 1 - self._last_change >= self._update_gap
                or any(g["projected"] and gi not in self._subspaces
                       for gi, g in enumerate(self.param_groups)))

    def _bookkeeping(self) -> dict:
        return {"steps_taken": self._steps_taken, "last_change": self._last_change,
                "subspaces": {gi: _copy_record(r) for gi, r in self._subspaces.items()},
                "history": len(self.history)}

    def _restore_bookkeeping(self, saved: dict) -> None:
        self._steps_taken, self._last_change = saved["steps_taken"], saved["last_change"]
        self._subspaces = saved["subspaces"]
        del self.history[saved["history"]:]

    def _change_subspace(self, reason: str) -> None:
        """Choose every projected group's state-full subspace again."""
        self._last_change = self._steps_taken
        for gi, group in enumerate(self.param_groups):
            if group["projected"]:
                self._family(group).choose(self._subspace(gi, group))
        self._plan = None
        self.history.append({"step": self._steps_taken, "rho": self._current_density(),
                             "update_gap": self._update_gap, "reason": reason})

    def _assign(self, gi: int, group: dict, i: int, p: Tensor) -> Assignment:
        assignment = self._family(group).assign(self._subspace(gi, group), i, p)
        old = self._carried.pop(p, None)
        if old is not None and assignment.rule in ("adamw", "adamw_int8", "subset",
                                                    "subset_int8"):
            # from_optimizer: the state-full part of the AdamW moments, before the plan
            # buckets the tensor by its (carried) bias-correction step.
            st = self.state[p]
            kind = assignment.subset_kind if assignment.rule.startswith("subset") else None
            for key in ("exp_avg", "exp_avg_sq"):
                # A DTensor's moments (FSDP2): the local block holds this rank's rows,
                # which the local ids index.
                moment = _gather(local(old[key]), st.get("indices"), kind)
                if assignment.rule in ("adamw_int8", "subset_int8"):
                    codes, scales = reference.quantize_moment(moment, key == "exp_avg_sq")
                    st[key].copy_(codes)
                    st[key + "_scale"].copy_(scales)
                else:
                    st[key].copy_(moment)
            st["step"] = torch.tensor(old["step"], dtype=torch.float32)
        return assignment

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """torch's layout (see :meth:`FusedOptimizer.state_dict`); the schedules, the
        subspaces' records, the generator and the history are the ``"frugal"`` entry of
        the first param group, where ``torch.distributed.checkpoint``'s
        get/set_optimizer_state_dict carry them. Everything loads with
        ``torch.load(weights_only=True)``."""
        sd = super().state_dict()
        sd["param_groups"][0]["frugal"] = _encode_extra({
            "version": _FORMAT,
            "steps_taken": self._steps_taken,
            "last_change": self._last_change,
            "update_gap": self._update_gap,
            "generator": self._generator.get_state(),
            "subspaces": {gi: _copy_record(r) for gi, r in self._subspaces.items()},
            "history": [dict(h) for h in self.history],
            **self._schedule_state(),
        })
        return sd

    def _schedule_state(self) -> dict:
        """What a subclass's schedules add to the ``"frugal"`` entry of the state dict."""
        return {}

    def _load_schedule_state(self, extra: dict) -> None:
        pass

    # Keys of the "frugal" entry a subclass's schedules add (AdaFRUGAL's).
    _schedule_keys: Tuple[str, ...] = ()

    def _check_state_dict(self, state_dict: dict) -> None:
        extra = _saved_extra(state_dict)
        super()._check_state_dict(state_dict)
        self._check_extra(extra)

    def _saved_group(self, saved: dict) -> dict:
        # A state dict from before the option held fp32 moments.
        return {"state_dtype": "fp32", **{k: v for k, v in saved.items() if k != "frugal"}}

    def _check_extra(self, extra: dict) -> None:
        """Raise a ValueError unless the "frugal" entry can resume these groups."""
        if not isinstance(extra, dict):
            raise ValueError(f"the state dict's 'frugal' entry is a {type(extra).__name__}")
        version = extra.get("version", 1)
        records = ("subspaces",) if version >= 2 else ("chosen_groups", "active_blocks",
                                                       "block_cursor")
        needed = ("steps_taken", "last_change", "update_gap", "generator", "history") + records
        missing = [k for k in needed + self._schedule_keys if k not in extra]
        if missing and self._schedule_keys and all(k in missing for k in self._schedule_keys):
            raise ValueError("this state dict was saved by FRUGAL, not AdaFRUGAL: it has no "
                             "schedule state to resume")
        if missing:
            raise ValueError(f"the state dict's 'frugal' entry lacks {', '.join(missing)}")
        unknown = sorted(set(extra) - set(needed + self._schedule_keys + ("version",)))
        if unknown:
            raise ValueError(f"the state dict's 'frugal' entry has entries this "
                             f"{type(self).__name__} does not know: {', '.join(unknown)} (was it "
                             "saved by AdaFRUGAL? load it into an AdaFRUGAL)")
        try:
            check_int(extra["steps_taken"], "steps_taken", 0)
            if extra["last_change"] is not None:
                check_int(extra["last_change"], "last_change", 1)
            check_int(extra["update_gap"], "update_gap", 1)
        except TypeError as e:
            raise ValueError(f"the state dict's 'frugal' entry: {e}") from None
        generator = extra["generator"]
        try:
            torch.Generator().set_state(generator)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"the state dict's generator state cannot be restored: {e}") from None
        if not isinstance(extra["history"], list) or not all(
                isinstance(h, dict) for h in extra["history"]):
            raise ValueError("the state dict's history must be a list of dicts")
        for gi, record in _saved_subspaces(extra).items():
            gi = int(gi)
            if not 0 <= gi < len(self.param_groups) or not self.param_groups[gi]["projected"]:
                raise ValueError(f"the state dict has a subspace for param group {gi}, which is "
                                 "not a projected group here")
            n = len(self.param_groups[gi]["params"])
            active = record.get("active", [])
            if list(active) != sorted(set(active)) or any(
                    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                    for i in active):
                raise ValueError(f"param group {gi}: the saved active blocks {list(active)} are "
                                 f"not sorted unique ids of its {n} tensors")

    def _check_saved_group(self, gi: int, saved: dict, group: dict) -> None:
        for key in ("projected", "projection"):
            if saved.get(key, group[key]) != group[key]:
                raise ValueError(f"param group {gi}: {key} is {group[key]!r} here but "
                                 f"{saved.get(key)!r} in the state dict")
        saved_dtype = self._saved_group(saved)["state_dtype"]
        if saved_dtype != group.get("state_dtype", "fp32"):
            raise ValueError(f"param group {gi}: the state dict's moments are "
                             f"state_dtype={saved_dtype!r} but this optimizer's are "
                             f"{group.get('state_dtype', 'fp32')!r}; build the optimizer with "
                             f"state_dtype={saved_dtype!r} to resume from it")

    def _load_optimizer_state(self, state_dict: dict) -> None:
        extra = _saved_extra(state_dict)
        self._steps_taken = int(extra["steps_taken"])
        self._last_change = None if extra["last_change"] is None else int(extra["last_change"])
        self._update_gap = int(extra["update_gap"])
        self._generator.set_state(extra["generator"])
        self._subspaces = {int(gi): _copy_record(r) for gi, r in _saved_subspaces(extra).items()}
        self.history = [dict(h) for h in extra["history"]]
        self._load_schedule_state(extra)


# torch.optim.Adam / AdamW group keys FRUGAL has no use for (or refuses when set).
_TORCH_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay")


def _groups_and_moments(optimizer: torch.optim.Optimizer) -> Tuple[List[dict], Dict[Tensor, dict]]:
    """``optimizer``'s param groups without torch's implementation keys, and each
    parameter's Adam moments and step; TypeError / ValueError before anything is built."""
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(f"from_optimizer takes a torch.optim.AdamW or Adam, got "
                        f"{type(optimizer).__name__}")
    adamw = isinstance(optimizer, torch.optim.AdamW)
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ValueError(f"param group {gi}: amsgrad=True has no FRUGAL counterpart")
        if group.get("maximize"):
            raise ValueError(f"param group {gi}: maximize=True has no FRUGAL counterpart")
        if not adamw and group.get("weight_decay", 0.0) and \
                not group.get("decoupled_weight_decay"):
            raise ValueError(f"param group {gi}: Adam's weight_decay is an L2 term in the "
                             "gradient, FRUGAL's is decoupled (AdamW's); use AdamW, "
                             "decoupled_weight_decay=True or weight_decay=0")
        groups.append({k: (list(v) if k == "params" else v) for k, v in group.items()
                       if k not in _TORCH_ONLY_KEYS})
    carried = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            if "exp_avg" in st and "exp_avg_sq" in st:
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if "exp_avg_scale" in st:
                    # A torch AdamW swapped with state_dtype="int8": the moments its codes
                    # stand for (swap(undo=True)'s), not the codes.
                    m = reference.dequantize_moment(m, st["exp_avg_scale"], False)
                    v = reference.dequantize_moment(v, st["exp_avg_sq_scale"], True)
                carried[p] = {"exp_avg": m, "exp_avg_sq": v, "step": float(st["step"])}
    return groups, carried


def _gather(moment: Tensor, indices: Optional[Tensor], subset_kind: Optional[str]) -> Tensor:
    """The part of a full moment a state-full subset keeps (all of it without one)."""
    if subset_kind is None:
        return moment
    idx = indices.long()
    if subset_kind == "rows":
        return moment[idx]
    if subset_kind == "columns":
        return moment[..., idx]
    return moment.reshape(-1)[idx]


def _copy_record(record: dict) -> dict:
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in record.items()}


def _pairs(record: dict) -> list:
    return [[key, value] for key, value in record.items()]


def _encode_extra(extra: dict) -> dict:
    """The "frugal" entry as torch.distributed.checkpoint keeps it whole: DCP flattens
    nested dicts and lists of dicts into one entry per leaf and loads only the leaves
    its template has (a fresh optimizer's, with a shorter history and other
    subspaces), while a list of lists of numbers and strings is one leaf. So the
    history (dicts) and the subspaces (a map of group index to record) are written as
    lists of [key, value] pairs."""
    return {**extra,
            "subspaces": [[gi, _pairs(record)]
                          for gi, record in sorted(extra["subspaces"].items())],
            "history": [_pairs(h) for h in extra["history"]]}


def _unpairs(pairs: Any, what: str) -> dict:
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
            for p in pairs):
        raise ValueError(f"the state dict's 'frugal' entry: {what} is not a list of "
                         "[key, value] pairs")
    return {key: value for key, value in pairs}


def _saved_extra(state_dict: dict) -> dict:
    """The "frugal" entry of a saved state dict, of any format, as format 2 holds it."""
    groups = state_dict.get("param_groups") or [{}]
    extra = groups[0].get("frugal") if isinstance(groups[0], dict) else None
    if extra is None:
        extra = state_dict.get("frugal")  # formats 1 and 2
        if extra is None:
            raise ValueError("this state dict was not saved by a FRUGAL optimizer (no 'frugal' "
                             "entry); it cannot resume the subspaces and schedules")
        return extra
    if not isinstance(extra, dict):
        raise ValueError(f"the state dict's 'frugal' entry is a {type(extra).__name__}")
    subspaces, history = extra.get("subspaces"), extra.get("history")
    if not isinstance(subspaces, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 for s in subspaces):
        raise ValueError("the state dict's 'frugal' entry: subspaces is not a list of "
                         "[group index, record] pairs")
    if not isinstance(history, (list, tuple)):
        raise ValueError("the state dict's history must be a list")
    return {**extra,
            "subspaces": {gi: _unpairs(record, f"the subspace of group {gi}")
                          for gi, record in subspaces},
            "history": [_unpairs(h, "a history entry") for h in history]}


def _saved_subspaces(extra: dict) -> dict:
    """The families' records of a saved ``"frugal"`` entry, of either format."""
    if extra.get("version", 1) >= 2:
        return extra["subspaces"]
    records = {int(gi): {} for gi in extra["chosen_groups"]}
    for gi, active in extra["active_blocks"].items():
        records[int(gi)] = {"active": [int(i) for i in active],
                            "cursor": int(extra["block_cursor"][gi])}
    return records


def _check_group(group: dict, where: str, read_device: bool = False) -> None:
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
    check_number(density, "density", where)
    if not density <= 1.0:
        raise ValueError(f"{where}: density must be in [0, 1], got {density!r}")
    check_adamw_options(group, where, read_device)
    check_number(group.get("state_free_lr_scale"), "state_free_lr_scale", where)
    state_dtype = group.get("state_dtype", "fp32")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}: state_dtype must be one of {', '.join(STATE_DTYPES)}; got "
                         f"{state_dtype!r}")
    if group.get("projected"):
        check_int8_projection(state_dtype, group["projection"], where,
                              "projection='blocks' and the groups that are not projected")
