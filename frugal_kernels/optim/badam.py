"""BAdam: block coordinate descent, AdamW or FRUGAL on one block at a time (DESIGN.md section 1)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from frugal_kernels import ops
from frugal_kernels._layout import on_device
from frugal_kernels.optim import plan, sharding
from frugal_kernels.optim.base import (_check_new_params, _check_sharded_gradient,
                                       _refuse_gradient, check_adamw_options, check_int,
                                       check_nonfinite, first_nonfinite, skip_flag)
from frugal_kernels.optim.frugal import FRUGAL
from frugal_kernels.optim.governed import suggested_factor
from frugal_kernels.optim.memory import release_freed_memory
from frugal_kernels.optim.protocol import FrugalOptimizer

__all__ = ["BAdam", "SWITCH_MODES", "INNER_OPTIMIZERS"]

SWITCH_MODES = ("random", "ascending", "descending", "fixed")
# What trains the active block: the fused AdamW, or a FRUGAL optimizer over the block.
INNER_OPTIMIZERS = ("adamw", "frugal")
# FRUGAL's options that inner="frugal" forwards (its lr, betas, eps and weight decay are
# the block's; its seed is derived from BAdam's).
_FRUGAL_OPTIONS = ("density", "update_gap", "projection", "state_free", "state_free_lr_scale",
                   "reset_state", "block_order")

# A transformer layer is the prefix up to its index: "model.layers.3" (HF Llama and
# frugal_kernels.model), "transformer.h.3" (GPT-2). The index must be followed by a dot,
# so "layers.1." is never a prefix of "layers.10.".
_LAYER = re.compile(r"^((?:.*\.)?(?:layers|h)\.\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe|embeddings?)\.")
_HEAD = re.compile(r"(?:^|\.)lm_head\.")

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")

# Format of the "badam" entry of the state dict. 2: in the first param group, its
# history written as lists of [key, value] pairs (torch.distributed.checkpoint's
# get_optimizer_state_dict keeps "state" and "param_groups" only, and keeps a list of
# dicts only as far as the template it loads into has entries); 1: a top-level entry.
# 3: as 2, with inner="frugal"'s per-tensor state in "state" (see _INNER).
_FORMAT = 3
# inner="frugal": the inner FRUGAL's state of a parameter is saved in this optimizer's
# entry of that parameter, its keys prefixed (no dots: DCP's keys are "<fqn>.<entry>").
# torch.distributed.checkpoint keys "state" by the model's parameter names and loads a
# nested state only as far as a fresh optimizer's has entries, and a fresh inner
# FRUGAL's are empty.
_INNER = "inner_"

BlockSpec = Union[Dict[str, Sequence[str]], Sequence[Sequence[str]]]


class BAdam(FrugalOptimizer, torch.optim.Optimizer):
    """Train one block of parameters at a time with AdamW (BAdam, NeurIPS 2024).

    The parameters are split into blocks; only the active block trains, for
    ``switch_every`` steps, then the next block takes over. Inactive blocks have
    ``requires_grad=False``, ``grad=None`` and no state, so backward computes no
    weight gradient for them; parameters outside every block stay frozen. The active
    block is stepped by the fused :func:`frugal_kernels.ops.adamw_` through the
    engine's plan (:mod:`frugal_kernels.optim.plan`: one bucket per (dtype, device),
    prepared once per block), with moments created at its first step and dropped (and
    the freed memory handed back to the OS) at the switch, so ``state_bytes()``
    counts the active block only. Each block starts its AdamW afresh: moments at
    zero and bias correction from step 1, as a new ``torch.optim.AdamW`` would.

    Args:
        model_or_named_parameters: an ``nn.Module`` or an iterable of
            ``(name, parameter)`` pairs (``model.named_parameters()``).
        lr, betas, eps, weight_decay: AdamW's (decoupled weight decay). ``lr``
            lives in ``param_groups`` (one group per block, with its ``"block"``
            name), so LR schedulers work as with any torch optimizer.
        switch_every: steps each block trains before the switch (settable:
            ``opt.switch_every = n`` takes effect from the current block).
        switch_mode: ``"random"`` (every block once per epoch of blocks, a new
            permutation each epoch from the optimizer's own generator seeded by
            ``seed``), ``"ascending"``, ``"descending"`` (block order, cycling) or
            ``"fixed"`` (cycling through ``order``).
        blocks: None for one block per transformer layer, found by name
            (``model.layers.N.`` of HF Llama and ``frugal_kernels.model``,
            ``h.N.`` of GPT-2), in model order; or the blocks, as a dict of block
            name to entries or a list of entry lists (named ``"block0"``, ...).
            An entry is a parameter's name or else a regular expression that must
            match whole names (``re.fullmatch``).
        include_embedding, include_head: with ``blocks=None``, add a block
            ``"embedding"`` (first) of the embedding tables and a block ``"head"``
            (last) of ``lm_head``. Otherwise they are frozen, as are the final norm
            and anything else outside every block.
        order: the block order of ``"fixed"``, as block names or indices (default:
            the order of the blocks); not allowed with the other modes.
        seed: seeds the generator of ``"random"`` (saved in the state dict).
        backend: the backend of the fused op (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"triton"``, ``"torch"``).
        inner: what trains the active block: ``"adamw"`` (the fused AdamW) or
            ``"frugal"``: a :class:`~frugal_kernels.FRUGAL` over the block, built at
            each switch (its state is dropped with the block's), with the block's lr,
            betas, eps and weight decay read at every step (LR schedulers work), its
            matrices (2-D and larger) in a projected group and the rest in an AdamW
            group, and the FRUGAL options given as keywords (``density``,
            ``projection``, ``update_gap``, ``state_free``, ``state_free_lr_scale``,
            ``reset_state``, ``block_order``). Its parameters are updated in their own
            dtype (FRUGAL keeps no master copy); it takes BAdam's ``nonfinite``.
        nonfinite: what a step does when a gradient of the active block holds a NaN
            or an infinity: ``"skip"`` (default; decided on the device, no host
            sync), ``"raise"`` (one host sync per step) or ``"propagate"``, as for
            :class:`frugal_kernels.FRUGAL` (see :meth:`step`).

    bf16 / fp16 parameters get an fp32 master copy for the active block only
    (``state["master"]``, 4 bytes per active parameter beside the 8 of the moments,
    plus an fp32 copy of the block's gradient during the step); the update runs on
    it and is rounded back into the parameter after every step.

    DTensor parameters (FSDP2's ``fully_shard``) are stepped through their local
    blocks, with state for the local rows only; ``state_dict()`` gives that state as
    DTensors of the parameters' shape (see :meth:`state_dict`).

    ``opt.active_block`` is the active block's name (``opt.active_block_index`` its
    index in ``opt.block_names``); ``opt.history`` lists the switches (step, block,
    reason) and switch_every changes. :meth:`apply_governor` lengthens
    ``switch_every`` on a :class:`frugal_kernels.Governor` reallocation.

    Example::

        opt = frugal_kernels.BAdam(model, lr=1e-5, switch_every=100)
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        model_or_named_parameters: Union[nn.Module, Iterable[Tuple[str, Tensor]]],
        lr: float | Tensor = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        switch_every: int = 50,
        switch_mode: str = "random",
        blocks: Optional[BlockSpec] = None,
        include_embedding: bool = False,
        include_head: bool = False,
        order: Optional[Sequence[Union[str, int]]] = None,
        seed: int = 0,
        backend: str = "auto",
        inner: str = "adamw",
        nonfinite: str = "skip",
        **frugal_options: Any,
    ):
        # Everything is checked before any parameter is touched, as FRUGAL checks it.
        _check_switch_every(switch_every)
        check_nonfinite(nonfinite)
        if backend != "auto" and backend not in ops.BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {', '.join(ops.BACKENDS)}; "
                             f"got {backend!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_adamw_options(defaults, "defaults", read_device=True)
        _check_inner(inner, frugal_options, lr, betas, eps, weight_decay, backend)
        if switch_mode not in SWITCH_MODES:
            raise ValueError(f"switch_mode must be one of {', '.join(SWITCH_MODES)}; "
                             f"got {switch_mode!r}")
        if isinstance(model_or_named_parameters, nn.Module):
            named = list(model_or_named_parameters.named_parameters())
        else:
            named = list(model_or_named_parameters)
        names, block_params = _resolve_blocks(named, blocks, include_embedding, include_head)
        if order is not None and switch_mode != "fixed":
            raise ValueError(f"order is for switch_mode='fixed', not {switch_mode!r}")
        fixed = _resolve_order(order, names) if switch_mode == "fixed" else None

        self.block_names: List[str] = names
        self.switch_mode = switch_mode
        self.backend = backend
        self.nonfinite = nonfinite
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._fixed_order = fixed
        self._switch_every = switch_every
        self._steps_taken = 0
        self._block_steps = 0  # step() calls since the switch: the schedule's count
        # Updates applied to the active block (inner="adamw"): its bias-correction step,
        # a float32 tensor on the block's device, where a skipped step's flag is
        # subtracted from it without a host sync (None until the block's first update).
        self._block_updates: Optional[Tensor] = None
        self._epoch: List[int] = []  # block order of the current pass over the blocks
        self._cursor = 0  # position of the active block in _epoch
        self.history: List[dict] = []
        self.inner = inner
        self._frugal_options = dict(frugal_options)
        self._inner: Optional[FRUGAL] = None  # inner="frugal": the active block's optimizer
        # inner="adamw": the plan of the active block, for its tensors with gradients
        # (those tensors, the buckets), and a bucket per tensor for steps in backward.
        self._block_buckets: Tuple[List[Tensor], List[plan.Bucket]] = ([], [])
        self._tensor_buckets: Dict[Tensor, plan.Bucket] = {}
        # A float lr (what LR schedulers set) is copied into this tensor at each step.
        self._lr = torch.tensor(0.0, dtype=torch.float64)
        # The DTensor parameters' layouts (FSDP2): where each rank's rows lie.
        self._layouts = {p: layout for n, ps in zip(names, block_params) for i, p in
                         enumerate(ps)
                         if (layout := sharding.layout_of(p, f"block {n!r} params[{i}]"))}
        # The parameters the user froze: never trained, whichever block is active. A
        # parameter that a BAdam froze (an earlier one over the same model) is not one.
        self._frozen = {(gi, i) for gi, ps in enumerate(block_params)
                        for i, p in enumerate(ps)
                        if not p.requires_grad and p not in _FROZEN_BY_BADAM}
        super().__init__([{"params": ps, "block": n} for n, ps in zip(names, block_params)],
                         defaults)

        in_blocks = {id(p) for ps in block_params for p in ps}
        for _, p in named:
            if id(p) not in in_blocks:
                _deactivate(p)
        for ps in block_params:
            for p in ps:
                _deactivate(p)
        self._epoch = self._new_epoch()
        self._activate(self._epoch[0])
        self.history.append({"step": 0, "block": self.active_block, "reason": "initial"})

    # ------------------------------------------------------------------ public

    @property
    def active_block(self) -> str:
        """The name of the block that trains now."""
        return self.block_names[self.active_block_index]

    @property
    def active_block_index(self) -> int:
        """The index in ``block_names`` (and ``param_groups``) of the active block."""
        return self._epoch[self._cursor]

    @property
    def switch_every(self) -> int:
        """Steps each block trains; setting it applies to the active block too."""
        return self._switch_every

    @switch_every.setter
    def switch_every(self, value: int) -> None:
        _check_switch_every(value)
        self._switch_every = value

    def state_bytes(self) -> int:
        """Bytes of optimizer state allocated right now (the active block's only)."""
        own = sum(v.untyped_storage().nbytes() for st in self.state.values()
                  for v in st.values() if isinstance(v, Tensor))
        return own + (self._inner.state_bytes() if self._inner is not None else 0)

    governable = True

    def apply_governor(self, decision: Any) -> None:
        """Take a :class:`frugal_kernels.Governor` reallocation: multiply
        ``switch_every`` by ``decision.suggestion["switch_every_factor"]``, or, when
        that key is absent, by the Governor's default ``"update_gap_factor"`` (BAdam's
        switch interval plays the part of FRUGAL's T). Factors <= 1 change nothing."""
        factor = suggested_factor(decision, "switch_every_factor", "update_gap_factor")
        if factor <= 1.0:
            return
        new = math.ceil(self._switch_every * factor)
        self.history.append({"step": self._steps_taken, "block": self.active_block,
                             "reason": f"governor: switch_every {self._switch_every} -> {new}"})
        self._switch_every = new

    def add_param_group(self, param_group: dict) -> None:
        if len(self.param_groups) == len(self.block_names):
            raise ValueError("BAdam's param groups are its blocks, fixed at construction")
        gi = len(self.param_groups)
        _check_new_params(param_group["params"], gi,
                          [(gj, i, p) for gj, g in enumerate(self.param_groups)
                           for i, p in enumerate(g["params"])])
        check_adamw_options({**self.defaults, **param_group}, f"block {param_group['block']!r}",
                            read_device=True)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Update the active block, then switch blocks when its ``switch_every``
        steps are done (before the next forward, so that backward already skips the
        block that stopped). ``closure`` re-evaluates the model and returns the loss.

        A non-finite gradient in the active block follows ``nonfinite``: under
        ``"skip"`` one fused read of the block's gradients sets a flag on the
        device that the fused op takes as ``found_inf``, so the block's params,
        moments and bias-correction count stay bit-identical without a host sync.
        Driven by a GradScaler, its ``found_inf`` is that flag and its
        ``grad_scale`` is divided out of the gradients by the fused op as it reads
        them (they stay scaled). The host never learns whether a step was skipped:
        the schedule (``switch_every``, the block order) counts calls of ``step()``,
        and a switch due at a skipped step happens (docs/optimizers.md, "Skipped
        steps and schedules").
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[self.active_block_index]
        grad_scale = getattr(self, "grad_scale", None)
        # Checks first, counts and writes after: a step that raises changes nothing.
        self._check_options()
        for i, p in enumerate(group["params"]):
            if p.grad is not None:
                self._check_gradient(self.active_block_index, i, p)
        if self._inner is not None:
            # Counted once the inner step is through: one that raises changes nothing.
            self._step_inner(group, grad_scale, getattr(self, "found_inf", None))
            self._count_step()
        else:
            params = [p for p in group["params"] if p.grad is not None]
            gi = self.active_block_index
            # Before anything is counted: under nonfinite="raise" this may raise.
            found_inf = skip_flag(
                getattr(self, "found_inf", None), self.nonfinite,
                [(gi, i, p) for i, p in enumerate(group["params"]) if p.grad is not None],
                sharding.process_groups(self._layouts.values()) if self._layouts else [])
            self._count_step()
            if params:
                self._count_update(params[0].device)
                self._update(group, params, grad_scale, found_inf)
                if found_inf is not None:
                    # Queued after the update: a skipped step takes its count back.
                    counts = self._block_updates
                    counts.sub_(found_inf.to(counts.device).reshape(()))
        self._switch_if_due()
        return loss

    def _check_options(self) -> None:
        """Every block's options, at every step (a user or an LR scheduler may have
        changed them), as FRUGAL checks its groups'."""
        for group in self.param_groups:
            check_adamw_options(group, f"block {group['block']!r}")

    def _check_gradient(self, gi: int, i: int, p: Tensor) -> None:
        """Raise unless ``p`` can take a step with its gradient (the engine's check)."""
        g = p.grad
        if g.layout is not torch.strided or g.dtype is not p.dtype or not p.is_contiguous():
            _refuse_gradient(gi, i, p)
        if p in self._layouts:
            _check_sharded_gradient(gi, i, p)

    def _count_step(self) -> None:
        self._steps_taken += 1
        self._block_steps += 1

    def _count_update(self, device: torch.device) -> None:
        """Count an update of the active block (the count after it, as the fused op's
        ``step`` takes it), on ``device`` when the count is new."""
        if self._block_updates is None:
            self._block_updates = torch.zeros((), dtype=torch.float32, device=device)
        self._block_updates.add_(1.0)

    def _switch_if_due(self) -> None:
        if self._block_steps >= self._switch_every:
            self._switch("switch_every")

    # ------------------------------------------------------- steps in backward
    # What frugal_kernels.step_in_backward drives (see FusedOptimizer's): the active
    # block's tensors are updated one at a time, each as its gradient completes, with
    # the pieces of step(); the switch comes once backward is done.

    def _tensor_steps_refused(self) -> Optional[str]:
        # Under nonfinite="skip" the step in backward skips each tensor with a
        # non-finite gradient (frugal_kernels.optim.in_backward).
        return None

    def _begin_tensor_steps(self) -> None:
        self._check_options()
        self._count_step()
        if self._inner is None:
            params = self.param_groups[self.active_block_index]["params"]
            self._count_update(params[0].device)
        else:
            self._sync_inner(self.param_groups[self.active_block_index])
            self._inner._begin_tensor_steps()

    def _step_tensor(self, p: Tensor) -> None:
        group = self.param_groups[self.active_block_index]
        i = next((i for i, q in enumerate(group["params"]) if q is p), None)
        if i is None:
            return  # outside the active block: step() leaves it alone too
        self._check_gradient(self.active_block_index, i, p)
        if self._inner is not None:
            self._inner._step_tensor(p)
            return
        if self.nonfinite == "raise":
            if first_nonfinite([(self.active_block_index, i, p)]) is not None:
                raise ValueError(
                    f"params[{i}] of block {group['block']!r} (shape {tuple(p.shape)}) has a "
                    "non-finite gradient (NaN or inf); its update was not applied "
                    "(nonfinite='raise'); the tensors stepped before it in this backward "
                    "keep theirs")
        self._update(group, [p], None, None)

    def _end_tensor_steps(self) -> None:
        if self._inner is not None:
            self._inner._end_tensor_steps()
        self._switch_if_due()

    # ------------------------------------------------------------------ update

    def _update(self, group: dict, params: List[Tensor], grad_scale: Optional[Tensor],
                found_inf: Optional[Tensor]) -> None:
        """The active block's ``params`` take AdamW through the engine's plan: one bucket
        per (dtype, device), fp32 params on the ``adamw`` rule, bf16 / fp16 ones on
        ``adamw_master``, all with the block's count of applied updates."""
        if len(params) == 1:
            bucket = self._tensor_buckets.get(params[0])
            if bucket is None:
                bucket = self._tensor_buckets[params[0]] = self._buckets(group, params)[0]
            buckets = [bucket]
        else:
            kept, buckets = self._block_buckets
            if len(kept) != len(params) or any(a is not b for a, b in zip(kept, params)):
                buckets = self._buckets(group, params)
                self._block_buckets = (params, buckets)
        if isinstance(group["lr"], Tensor):
            lr = group["lr"]
        else:
            lr = self._lr.fill_(group["lr"])
        for bucket in buckets:
            device = bucket.params[0].device
            bucket.lr = lr
            bucket.step = on_device(self._block_updates, device)
            # A DTensor is stepped through its local block (a view of its storage).
            plan.run(bucket, [sharding.local(p.grad) for p in bucket.params], self.backend,
                     grad_scale, on_device(found_inf, device))

    def _buckets(self, group: dict, params: List[Tensor]) -> List[plan.Bucket]:
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[Tensor]] = defaultdict(list)
        for p in params:
            by_kind[(p.dtype, p.device)].append(p)
        return [plan.Bucket(plan.ADAMW if dtype == torch.float32 else plan.ADAMW_MASTER,
                            group, self._lr, ps, [self._layouts.get(p) for p in ps],
                            states=[self._state_of(p) for p in ps])
                for (dtype, _), ps in by_kind.items()]

    def _drop_buckets(self) -> None:
        """Let go of the buckets (and the prepared calls, which hold the moments) of a
        block whose state is replaced: at a switch and a load."""
        plan.release(self._block_buckets[1])
        plan.release(list(self._tensor_buckets.values()))
        self._block_buckets = ([], [])
        self._tensor_buckets = {}

    def _sync_inner(self, group: dict) -> None:
        """The block's lr, betas, eps and weight decay, as they are now, into its FRUGAL."""
        for inner_group in self._inner.param_groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner_group[key] = group[key]

    def _step_inner(self, group: dict, grad_scale: Optional[Tensor],
                    found_inf: Optional[Tensor]) -> None:
        self._sync_inner(group)
        # GradScaler's tensors reach the inner FRUGAL's ops as a GradScaler's would;
        # without them it checks the gradients itself (it has BAdam's nonfinite).
        self._inner.grad_scale, self._inner.found_inf = grad_scale, found_inf
        try:
            self._inner.step()
        finally:
            del self._inner.grad_scale, self._inner.found_inf

    def _make_inner(self, index: int, frozen: Optional[set] = None) -> FRUGAL:
        """The FRUGAL of block ``index`` (without the parameters in ``frozen``, by default
        those the user froze), seeded by BAdam's seed and the step it starts at."""
        trained = self._trained(index, frozen)
        group = self.param_groups[index]
        matrices = [p for p in trained if p.dim() >= 2]
        others = [p for p in trained if p.dim() < 2]
        groups = ([{"params": matrices}] if matrices else []) + \
                 ([{"params": others, "projected": False}] if others else [])
        return FRUGAL(groups, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], backend=self.backend,
                      nonfinite=self.nonfinite, seed=_inner_seed(self.seed, self._steps_taken),
                      **self._frugal_options)

    def _state_of(self, p: Tensor) -> dict:
        st = self.state[p]
        if not st:
            block = sharding.local(p.detach())  # a DTensor's state is its local rows'
            st["exp_avg"] = torch.zeros_like(block, dtype=torch.float32,
                                             memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
            if p.dtype != torch.float32:
                st["master"] = block.float().contiguous()
        return st

    # ---------------------------------------------------------------- schedule

    def _new_epoch(self) -> List[int]:
        n = len(self.block_names)
        if self.switch_mode == "random":
            return torch.randperm(n, generator=self._generator).tolist()
        if self.switch_mode == "ascending":
            return list(range(n))
        if self.switch_mode == "descending":
            return list(reversed(range(n)))
        return list(self._fixed_order)

    def _switch(self, reason: str) -> None:
        for p in self.param_groups[self.active_block_index]["params"]:
            _deactivate(p)
        self._drop_buckets()
        self.state = defaultdict(dict)  # _activate gives the new block its entries
        self._inner = None
        release_freed_memory()
        self._cursor += 1
        if self._cursor == len(self._epoch):
            self._epoch = self._new_epoch()
            self._cursor = 0
        self._block_steps = 0
        self._block_updates = None
        self._activate(self.active_block_index)
        self.history.append({"step": self._steps_taken, "block": self.active_block,
                             "reason": reason})

    def _trained(self, index: int, frozen: Optional[set] = None) -> List[Tensor]:
        """The parameters of block ``index`` that train when it is active: all but those
        in ``frozen`` (by default those the user froze)."""
        frozen = self._frozen if frozen is None else frozen
        return [p for i, p in enumerate(self.param_groups[index]["params"])
                if (index, i) not in frozen]

    def _activate(self, index: int) -> None:
        for p in self._trained(index):
            _FROZEN_BY_BADAM.pop(p, None)
            p.requires_grad_(True)
            # An empty entry until the block's first step: torch.distributed.checkpoint's
            # get/set_optimizer_state_dict take a step with zero gradients on an
            # optimizer whose state is empty, which would count a step of the block.
            self.state[p]
        if self.inner == "frugal":
            self._inner = self._make_inner(index)

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """torch's layout (``state`` holds tensors only: exp_avg, exp_avg_sq and, for
        low-precision params, master) plus the ``"badam"`` entry of the first param
        group: block names, the current epoch's order and position, step counts,
        switch_every, the generator state and the history. Everything loads with
        ``torch.load(weights_only=True)``.

        With DTensor parameters the state tensors are DTensors of the parameter's
        shape, split as it is (what ``torch.distributed.checkpoint`` reshards)."""
        sd = super().state_dict()
        if self._layouts:
            params = [p for g in self.param_groups for p in g["params"]]
            for pid, p in enumerate(params):
                layout = self._layouts.get(p)
                if layout is not None and sd["state"].get(pid):
                    sd["state"][pid] = {k: layout.to_dtensor(v, p.shape)
                                        for k, v in sd["state"][pid].items()}
        inner_state = None
        if self._inner is not None:
            # In its global form on DTensors already (a collective).
            inner_state = self._inner.state_dict()
            ids = {id(p): pid for g, saved in zip(self.param_groups, sd["param_groups"])
                   for p, pid in zip(g["params"], saved["params"])}
            for p, inner_pid in _inner_pairs(self._inner, inner_state):
                entries = {_INNER + k: v
                           for k, v in inner_state["state"].get(inner_pid, {}).items()}
                if entries:
                    # A new dict: torch's state_dict hands out this optimizer's own.
                    pid = ids[id(p)]
                    sd["state"][pid] = {**sd["state"].get(pid, {}), **entries}
            inner_state = {**inner_state, "state": {}}
        sd["param_groups"][0]["badam"] = {
            "version": _FORMAT,
            "block_names": list(self.block_names),
            "switch_mode": self.switch_mode,
            "epoch": list(self._epoch),
            "cursor": self._cursor,
            "steps_taken": self._steps_taken,
            "block_steps": self._block_steps,
            # A host read of the count (a sync, at a checkpoint only).
            "block_updates": 0.0 if self._block_updates is None else float(self._block_updates),
            "switch_every": self._switch_every,
            "generator": self._generator.get_state(),
            "history": [[[k, v] for k, v in h.items()] for h in self.history],
            "inner": self.inner,
            "inner_state": inner_state,
            # The parameters the user froze, as [block index, index in the block] pairs.
            "frozen": [list(f) for f in sorted(self._frozen)],
        }
        return sd

    def _expect_saved_state(self, params: List[Tensor]) -> None:
        """``params`` have state in a checkpoint about to be loaded with
        torch.distributed.checkpoint's ``set_optimizer_state_dict``, which passes on
        the state of parameters that require grad only: let them require it
        (:meth:`load_state_dict` sets every flag by the loaded schedule)."""
        for p in params:
            p.requires_grad_(True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume exactly from :meth:`state_dict` (the model's parameters are the
        caller's to restore), or raise a ValueError that says why the checkpoint does
        not fit this optimizer; nothing is changed then.

        With DTensor parameters the state is taken as DTensors of any split (or plain
        tensors holding the whole); this rank keeps its rows."""
        extra = _saved_extra(state_dict)
        # The inner FRUGAL's entries (format 3) apart from this optimizer's own.
        own_state, inner_entries = {}, {}
        for pid, st in state_dict["state"].items():
            own_state[pid] = {k: v for k, v in st.items() if not k.startswith(_INNER)}
            inner = {k[len(_INNER):]: v for k, v in st.items() if k.startswith(_INNER)}
            if inner:
                inner_entries[pid] = inner
        state_dict = {**state_dict, "state": own_state}
        n = len(self.block_names)
        if list(extra["block_names"]) != self.block_names:
            raise ValueError(f"the state dict's blocks {list(extra['block_names'])} are not "
                             f"this optimizer's {self.block_names}")
        if extra["switch_mode"] != self.switch_mode:
            raise ValueError(f"the state dict was saved with switch_mode "
                             f"{extra['switch_mode']!r}, this optimizer uses "
                             f"{self.switch_mode!r}")
        _check_extra(extra, n)
        frozen = ({(int(gi), int(i)) for gi, i in extra["frozen"]} if "frozen" in extra
                  else self._frozen)
        epoch = [int(i) for i in extra["epoch"]]
        cursor = int(extra["cursor"])
        blocks_of_epoch = list(range(n)) if self._fixed_order is None else self._fixed_order
        if sorted(epoch) != sorted(blocks_of_epoch) or not 0 <= cursor < len(epoch):
            raise ValueError(f"the state dict's block order {epoch} (position {cursor}) is not "
                             f"an order of this optimizer's blocks {sorted(blocks_of_epoch)}")
        _check_switch_every(extra["switch_every"])
        # Saved before block_updates existed: every step of the block was applied.
        updates = extra.get("block_updates", extra["block_steps"])
        if isinstance(updates, bool) or not isinstance(updates, (int, float)) or \
                not (math.isfinite(updates) and 0 <= updates <= extra["block_steps"]):
            raise ValueError(f"the state dict's block_updates {updates!r} is not a count of "
                             f"at most block_steps ({extra['block_steps']!r})")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != n:
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this "
                             f"optimizer {n} blocks")
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"block {group['block']!r} has {len(group['params'])} params "
                                 f"but the state dict's has {len(saved['params'])}")
        active = epoch[cursor]
        saved_state = state_dict["state"]
        pairs = [(pid, p) for saved, group in zip(saved_groups, self.param_groups)
                 for pid, p in zip(saved["params"], group["params"])]
        active_ids = set(saved_groups[active]["params"])
        for pid, p in pairs:
            if (saved_state.get(pid) or pid in inner_entries) and pid not in active_ids:
                raise ValueError(f"the state dict holds state for param {pid}, which is "
                                 "not in the active block")
            if saved_state.get(pid):  # an empty entry is no state
                _check_saved_state(saved_state[pid], p, pid)
        generator = torch.Generator()
        generator.set_state(extra["generator"])
        if extra.get("inner", "adamw") != self.inner:
            saved_inner = extra.get("inner", "adamw")
            raise ValueError(f"the state dict was saved with inner={saved_inner!r}, this "
                             f"optimizer uses inner={self.inner!r}")
        inner = None
        if self.inner == "frugal":
            # Built and loaded before anything of this optimizer changes: its
            # load_state_dict raises on a state that does not fit the block.
            inner = self._make_inner(active, frozen)
            saved_inner = extra["inner_state"]
            # Format 2 kept the inner state in saved_inner["state"]; format 3 in ours.
            merged = dict(saved_inner.get("state", {}))
            block_ids = {id(p): pid for p, pid in zip(self.param_groups[active]["params"],
                                                     saved_groups[active]["params"])}
            for p, inner_pid in _inner_pairs(inner, saved_inner):
                if block_ids[id(p)] in inner_entries:
                    merged[inner_pid] = inner_entries[block_ids[id(p)]]
            inner.load_state_dict({**saved_inner, "state": merged})
        elif inner_entries:
            raise ValueError("the state dict holds an inner FRUGAL's state, but this "
                             "optimizer uses inner='adamw'")

        loaded = {}
        for pid, p in pairs:
            if saved_state.get(pid):  # an empty entry is no state
                layout = self._layouts.get(p)
                loaded[p] = {k: v.to(p.device, copy=True) if layout is None
                             else layout.block_of(v, p.device)
                             for k, v in saved_state[pid].items()}

        # torch's loader would cast the fp32 moments and master copies to the
        # parameters' dtype: load the groups through it and the state here.
        super().load_state_dict({"state": {}, "param_groups": [
            {k: v for k, v in g.items() if k != "badam"} for g in saved_groups]})
        self._drop_buckets()
        self.state = defaultdict(dict, loaded)
        self._frozen = frozen
        for p in self._trained(active):
            self.state[p]  # the active block's entries (see _activate)
        self._epoch, self._cursor = epoch, cursor
        self._steps_taken = int(extra["steps_taken"])
        self._block_steps = int(extra["block_steps"])
        self._block_updates = None if not updates else torch.tensor(
            float(updates), dtype=torch.float32,
            device=self.param_groups[active]["params"][0].device)
        self._switch_every = int(extra["switch_every"])
        self._generator = generator
        self.history = [dict(h) for h in extra["history"]]
        self._inner = inner
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if gi == active and (gi, i) not in frozen:
                    _FROZEN_BY_BADAM.pop(p, None)
                    p.requires_grad_(True)
                else:
                    _deactivate(p)


# ------------------------------------------------------------------ helpers


def _inner_pairs(inner: FRUGAL, inner_state: dict) -> List[Tuple[Tensor, Any]]:
    """(parameter, id in ``inner_state``) of an inner FRUGAL's parameters, by position."""
    params = [p for g in inner.param_groups for p in g["params"]]
    ids = [pid for g in inner_state["param_groups"] for pid in g["params"]]
    return list(zip(params, ids))


def _saved_extra(state_dict: dict) -> dict:
    """The "badam" entry of a saved state dict, of either format, as format 1 holds it
    (the history as dicts)."""
    groups = state_dict.get("param_groups") or [{}]
    extra = groups[0].get("badam") if isinstance(groups[0], dict) else None
    if extra is None:
        extra = state_dict.get("badam")  # format 1
        if extra is None:
            raise ValueError("this state dict was not saved by BAdam (no 'badam' entry); it "
                             "cannot resume the block schedule")
        _check_extra_keys(extra)
        if not isinstance(extra["history"], list) or not all(
                isinstance(h, dict) for h in extra["history"]):
            raise ValueError("the state dict's 'badam' history is not a list of dicts")
        return extra
    _check_extra_keys(extra)
    history = extra["history"]
    if not isinstance(history, (list, tuple)) or not all(
            isinstance(h, (list, tuple)) and all(
                isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in h) for h in history):
        raise ValueError("the state dict's 'badam' history is not a list of lists of "
                         "[key, value] pairs")
    return {**extra, "history": [{k: v for k, v in h} for h in history]}


# The entries of the "badam" entry a load needs (block_updates, inner, inner_state and
# frozen came later; a state dict without them loads as one of its time).
_EXTRA_KEYS = ("block_names", "switch_mode", "epoch", "cursor", "steps_taken", "block_steps",
               "switch_every", "generator", "history")


def _check_extra_keys(extra: Any) -> None:
    if not isinstance(extra, dict):
        raise ValueError(f"the state dict's 'badam' entry is a {type(extra).__name__}, not a dict")
    missing = [key for key in _EXTRA_KEYS if key not in extra]
    if missing:
        raise ValueError(f"the state dict's 'badam' entry lacks {', '.join(missing)}")


def _check_extra(extra: dict, num_blocks: int) -> None:
    """Raise a ValueError unless the counts, generator and frozen list of a saved "badam"
    entry (its keys checked already) can resume a schedule."""
    try:
        check_int(extra["steps_taken"], "steps_taken", 0)
        check_int(extra["block_steps"], "block_steps", 0)
        check_int(extra["cursor"], "cursor", 0)
    except TypeError as e:
        raise ValueError(f"the state dict's 'badam' entry: {e}") from None
    except ValueError as e:
        raise ValueError(f"the state dict's 'badam' entry: {e}") from None
    if extra["block_steps"] > extra["steps_taken"]:
        raise ValueError(f"the state dict's block_steps {extra['block_steps']} is more than "
                         f"steps_taken {extra['steps_taken']}")
    epoch = extra["epoch"]
    if not isinstance(epoch, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in epoch):
        raise ValueError(f"the state dict's block order {epoch!r} is not a list of block ids")
    try:
        torch.Generator().set_state(extra["generator"])
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"the state dict's generator state cannot be restored: {e}") from None
    frozen = extra.get("frozen", [])
    if not isinstance(frozen, (list, tuple)) or not all(
            isinstance(f, (list, tuple)) and len(f) == 2 and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in f)
            and f[0] < num_blocks for f in frozen):
        raise ValueError(f"the state dict's frozen parameters {frozen!r} are not "
                         "[block, index] pairs of this optimizer's blocks")


# The tensors a BAdam froze (inactive blocks, parameters outside every block), so that a
# later BAdam over the same model does not take them for parameters the user froze.
# Keyed by identity: a deepcopy of the model has new tensors, which carry no mark.
_FROZEN_BY_BADAM = WeakIdKeyDictionary()


def _deactivate(p: Tensor) -> None:
    if p.requires_grad:
        _FROZEN_BY_BADAM[p] = True
    p.grad = None
    p.requires_grad_(False)


def _inner_seed(seed: int, step: int) -> int:
    # A different stream for each block's FRUGAL, reproducible from BAdam's seed.
    return (seed * 1_000_003 + step) % 2**63


def _check_inner(inner: str, frugal_options: dict, lr, betas, eps, weight_decay,
                 backend: str) -> None:
    if inner not in INNER_OPTIMIZERS:
        raise ValueError(f"inner must be one of {', '.join(INNER_OPTIMIZERS)}; got {inner!r}")
    unknown = sorted(set(frugal_options) - set(_FRUGAL_OPTIONS))
    if unknown:
        raise TypeError(f"BAdam got unexpected keyword arguments {unknown}; the FRUGAL options "
                        f"of inner='frugal' are {', '.join(_FRUGAL_OPTIONS)}")
    if frugal_options and inner != "frugal":
        raise ValueError(f"{', '.join(sorted(frugal_options))} are options of inner='frugal', "
                         f"not of inner={inner!r}")
    if inner == "frugal":
        # FRUGAL's own checks, on a stand-in tensor, before any parameter is touched.
        probe = torch.zeros(2, 2, requires_grad=True)
        FRUGAL([probe], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
               backend=backend, **frugal_options)


def _check_switch_every(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"switch_every must be a positive int, got {value!r}")


def _resolve_blocks(named: List[Tuple[str, Tensor]], blocks: Optional[BlockSpec],
                    include_embedding: bool, include_head: bool
                    ) -> Tuple[List[str], List[List[Tensor]]]:
    """Block names and their parameters, in block order; ValueError on a bad spec."""
    if not named:
        raise ValueError("BAdam got no parameters")
    if blocks is None:
        spec = _default_blocks([n for n, _ in named], include_embedding, include_head)
    else:
        if include_embedding or include_head:
            raise ValueError("include_embedding / include_head apply to the default blocks; "
                             "with blocks=... list those parameters in a block")
        if isinstance(blocks, dict):
            spec = {str(k): list(v) for k, v in blocks.items()}
        else:
            spec = {f"block{i}": list(v) for i, v in enumerate(blocks)}
        for name, entries in spec.items():
            if not entries or any(not isinstance(e, str) for e in entries):
                raise ValueError(f"block {name!r} must be a non-empty list of parameter names "
                                 f"or patterns, got {entries!r}")
    if not spec:
        raise ValueError("BAdam got no blocks")
    by_name = dict(named)
    owner: Dict[str, str] = {}
    out_names, out_params = [], []
    for block, entries in spec.items():
        members: List[str] = []
        for entry in entries:
            if entry in by_name:
                matched = [entry]
            else:
                try:
                    pattern = re.compile(entry)
                except re.error as err:
                    raise ValueError(f"block {block!r}: {entry!r} is neither a parameter name "
                                     f"nor a regular expression ({err})") from None
                matched = [n for n in by_name if pattern.fullmatch(n)]
            if not matched:
                raise ValueError(f"block {block!r}: {entry!r} matches no parameter name")
            for n in matched:
                if owner.get(n, block) != block:
                    raise ValueError(f"parameter {n!r} is in two blocks: {owner[n]!r} and "
                                     f"{block!r}")
                if n not in owner:
                    owner[n] = block
                    members.append(n)
        out_names.append(block)
        out_params.append([by_name[n] for n in members])
    for block, ps in zip(out_names, out_params):
        if not ps:
            raise ValueError(f"block {block!r} is empty")
        if any(not p.is_floating_point() for p in ps):
            raise ValueError(f"block {block!r} holds a non-floating-point tensor")
    return out_names, out_params


def _default_blocks(names: List[str], include_embedding: bool, include_head: bool
                    ) -> Dict[str, List[str]]:
    layers: Dict[str, List[str]] = {}
    embedding, head = [], []
    for n in names:
        match = _LAYER.match(n)
        if match:
            layers.setdefault(match.group(1), []).append(n)
        elif _EMBEDDING.search(n):
            embedding.append(n)
        elif _HEAD.search(n):
            head.append(n)
    if not layers:
        raise ValueError("found no transformer layers by name (model.layers.N. or h.N.); give "
                         "the blocks with blocks=...")
    spec: Dict[str, List[str]] = {}
    if include_embedding:
        if not embedding:
            raise ValueError("include_embedding=True but no embedding parameter was found")
        spec["embedding"] = embedding
    spec.update(layers)
    if include_head:
        if not head:
            raise ValueError("include_head=True but no lm_head parameter was found (a head "
                             "tied to the embedding is trained with the embedding block)")
        spec["head"] = head
    return spec


def _resolve_order(order: Optional[Sequence[Union[str, int]]], names: List[str]) -> List[int]:
    if order is None:
        return list(range(len(names)))
    indices = []
    for entry in order:
        if isinstance(entry, str):
            if entry not in names:
                raise ValueError(f"order names an unknown block {entry!r}")
            indices.append(names.index(entry))
        elif isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < len(names):
            indices.append(entry)
        else:
            raise ValueError(f"order entry {entry!r} is neither a block name nor an index in "
                             f"[0, {len(names)})")
    if not indices:
        raise ValueError("order is empty")
    if len(set(indices)) != len(indices):
        raise ValueError(f"order repeats a block: {list(order)!r}")
    return indices


def _check_saved_state(saved: dict, p: Tensor, pid: Any) -> None:
    if not saved:
        return
    for key, value in saved.items():
        if key not in _STATE_KEYS:
            raise ValueError(f"state of param {pid}: unknown entry {key!r}")
        if not isinstance(value, Tensor) or value.dtype != torch.float32:
            raise ValueError(f"state of param {pid}: {key} must be a float32 tensor")
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"state of param {pid}: {key} has shape {tuple(value.shape)}, the "
                             f"param {tuple(p.shape)}")
    if "exp_avg" not in saved or "exp_avg_sq" not in saved:
        raise ValueError(f"state of param {pid}: exp_avg and exp_avg_sq must come together")
    if ("master" in saved) != (p.dtype != torch.float32):
        raise ValueError(f"state of param {pid}: a master copy belongs to bf16/fp16 params only")
