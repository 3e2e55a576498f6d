"""BAdam: block coordinate descent, AdamW or FRUGAL on one block at a time (DESIGN.md section 1).

BAdam is a policy of the step engine (:class:`~frugal_kernels.optim.engine.FusedOptimizer`):
its param groups are the blocks, the active block is the one group that steps
(:meth:`BAdam._group_steps`), and its tensors take AdamW (``DENSE_MASTER``: bf16 /
fp16 ones on an fp32 master copy) or, with ``inner="frugal"``, FRUGAL's families
composed as a FRUGAL over the block would compose them: the chosen projection on
its matrices, AdamW on the rest, with subspaces drawn from a generator of the block's
own. Checks, atomic steps and loads, the non-finite policy, step counts, state
dicts (DCP's global form included) and ``state_bytes`` are the engine's.
"""

from __future__ import annotations

import inspect
import math
import re
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from frugal_kernels._layout import STATE_DTYPES
from frugal_kernels._shard import RowShard
from frugal_kernels.optim import plan
from frugal_kernels.optim.engine import FusedOptimizer, check_adamw_options, check_int
from frugal_kernels.optim.frugal import FRUGAL, _check_group as _check_frugal_group
from frugal_kernels.optim.frugal import _saved_extra as _saved_frugal_extra
from frugal_kernels.optim.frugal import _copy_record, _saved_subspaces
from frugal_kernels.optim.governed import suggested_factor
from frugal_kernels.optim.memory import release_freed_memory
from frugal_kernels.optim.plan import Assignment
from frugal_kernels.optim.projections import (DENSE, DENSE_MASTER, FAMILIES, Projection,
                                              Subspace)

__all__ = ["BAdam", "SWITCH_MODES", "INNER_OPTIMIZERS"]

SWITCH_MODES = ("random", "ascending", "descending", "fixed")
# What trains the active block: AdamW, or FRUGAL over the block.
INNER_OPTIMIZERS = ("adamw", "frugal")
# FRUGAL's options that inner="frugal" takes, with FRUGAL's defaults (its lr, betas,
# eps and weight decay are the block's; its seed is derived from BAdam's). All but
# update_gap are options of every block's param group, as they are of FRUGAL's groups.
_FRUGAL_DEFAULTS = {name: inspect.signature(FRUGAL.__init__).parameters[name].default
                    for name in ("density", "update_gap", "projection", "state_free",
                                 "state_free_lr_scale", "reset_state", "block_order")}

# A transformer layer is the prefix up to its index: "model.layers.3" (HF Llama and
# frugal_kernels.model), "transformer.h.3" (GPT-2). The index must be followed by a dot,
# so "layers.1." is never a prefix of "layers.10.".
_LAYER = re.compile(r"^((?:.*\.)?(?:layers|h)\.\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe|embeddings?)\.")
_HEAD = re.compile(r"(?:^|\.)lm_head\.")

# Format of the "badam" entry of the state dict, in the first param group (where
# torch.distributed.checkpoint's get_optimizer_state_dict carries it), its history
# written as lists of [key, value] pairs. 4: the engine's per-tensor state (each with
# its "step"); inner="frugal"'s schedule as the inner_* entries. Older formats load:
# 3 kept one count of the block's applied updates ("block_updates") and a nested
# FRUGAL's state dict ("inner_state", its per-tensor state in ours with keys prefixed
# "inner_"); 2 that state inside "inner_state"; 1 the entry beside "state".
_FORMAT = 4
_INNER = "inner_"

BlockSpec = Union[Dict[str, Sequence[str]], Sequence[Sequence[str]]]


class _Composed(Projection):
    """inner="frugal"'s family over a block: FRUGAL's family ``matrices`` on its tensors
    of 2 dims or more, AdamW (:data:`DENSE`) on the rest, as a FRUGAL over the block
    with its matrices in a projected group would hold them (for state-dict checks and
    the global form; choosing and assigning are BAdam's, which knows the matrices)."""

    def __init__(self, matrices: Projection):
        self.matrices = matrices
        self.state_keys = matrices.state_keys

    def _of(self, p: Tensor) -> Projection:
        return self.matrices if p.dim() >= 2 else DENSE

    def fits(self, saved: dict, p: Tensor) -> bool:
        return self._of(p).fits(saved, p)

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        return self._of(p).check_saved(saved, p)

    def global_state(self, st: dict, p: Tensor, layout: RowShard) -> dict:
        return self._of(p).global_state(st, p, layout)

    def local_state(self, saved: dict, p: Tensor, layout: RowShard,
                    device: torch.device) -> dict:
        return self._of(p).local_state(saved, p, layout, device)


_COMPOSED = {name: _Composed(family) for name, family in FAMILIES.items()}


class BAdam(FusedOptimizer):
    """Train one block of parameters at a time with AdamW (BAdam, NeurIPS 2024).

    The parameters are split into blocks; only the active block trains, for
    ``switch_every`` steps, then the next block takes over. Inactive blocks have
    ``requires_grad=False``, ``grad=None`` and no state, so backward computes no
    weight gradient for them; parameters outside every block stay frozen. The active
    block is stepped by the engine's plan (one fused ``adamw_`` call per dtype and
    device, prepared once per block), with moments created at its first step and
    dropped (and the freed memory handed back to the OS) at the switch, so
    ``state_bytes()`` counts the active block only. Each block starts its AdamW
    afresh: moments at zero and bias correction from step 1, as a new
    ``torch.optim.AdamW`` would.

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
        backend: the backend of the fused ops (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"triton"``, ``"torch"``).
        inner: what trains the active block: ``"adamw"`` or ``"frugal"``: FRUGAL over
            the block, started afresh at each switch (its state is dropped with the
            block's), its matrices (2-D and larger) projected and the rest on AdamW,
            with the block's lr, betas, eps and weight decay and the FRUGAL options
            given as keywords (``density``, ``projection``, ``update_gap``,
            ``state_free``, ``state_free_lr_scale``, ``reset_state``,
            ``block_order``; all but ``update_gap`` are options of every block's
            param group). Its parameters are updated in their own dtype (FRUGAL
            keeps no master copy).
        nonfinite: what a step does when a gradient of the active block holds a NaN
            or an infinity: ``"skip"`` (default; decided on the device, no host
            sync), ``"raise"`` (one host sync per step) or ``"propagate"``, as for
            :class:`frugal_kernels.FRUGAL` (see :meth:`FusedOptimizer.step`).
        state_dtype: how the active block's AdamW moments are stored: ``"fp32"``, or
            ``"int8"`` (:func:`frugal_kernels.ops.adamw_int8_`: 8-bit codes with an
            fp32 scale per block of 256 elements along each tensor's rows), as
            FRUGAL's ``state_dtype``: tensors of fewer than 4096 elements and 1-D
            tensors keep fp32 moments. With ``inner="frugal"`` it takes
            ``projection="blocks"``, ``"rows"`` or ``"columns"`` (the subsets' compact
            state through :func:`frugal_kernels.ops.frugal_step_int8_`); ``"randk"``
            and the low-rank projections take fp32 moments. A checkpoint loads only
            into a BAdam of its own ``state_dtype``.

    bf16 / fp16 parameters get an fp32 master copy for the active block only
    (``state["master"]``, 4 bytes per active parameter beside the 8 of the moments,
    plus an fp32 copy of the block's gradient during the step); the update runs on
    it and is rounded back into the parameter after every step.

    DTensor parameters (FSDP2's ``fully_shard``) are stepped through their local
    blocks, with state for the local rows only; ``state_dict()`` gives that state in
    its global form, as the engine does.

    ``opt.active_block`` is the active block's name (``opt.active_block_index`` its
    index in ``opt.block_names``); ``opt.history`` lists the switches (step, block,
    reason) and switch_every changes. :meth:`apply_governor` lengthens
    ``switch_every`` on a :class:`frugal_kernels.Governor` reallocation.

    Example::

        opt = frugal_kernels.BAdam(model, lr=1e-5, switch_every=100)
    """

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
        state_dtype: str = "fp32",
        **frugal_options: Any,
    ):
        # Everything is checked before any parameter is touched, as FRUGAL checks it.
        _check_switch_every(switch_every)
        _check_inner(inner, frugal_options)
        self.inner = inner
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        state_dtype=state_dtype)
        if inner == "frugal":
            options = {**_FRUGAL_DEFAULTS, **frugal_options}
            check_int(options["update_gap"], "update_gap")
            self._update_gap = options.pop("update_gap")
            defaults.update(options)
        self._check_group(defaults, "defaults", read_device=True)
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
        self._fixed_order = fixed
        self._switch_every = switch_every
        self._steps_taken = 0
        self._block_steps = 0  # step() calls since the switch: the schedule's count
        self._epoch: List[int] = []  # block order of the current pass over the blocks
        self._cursor = 0  # position of the active block in _epoch
        self.history: List[dict] = []
        # inner="frugal": the active block's matrices (FRUGAL's projected group, by
        # their index in it) and its schedule of subspaces, as a FRUGAL over the block
        # would keep it: its steps, the step of its last change, its generator and the
        # family's record.
        self._matrices: List[Tensor] = []
        self._matrix_index: Dict[Tensor, int] = {}
        self._inner_steps = 0
        self._inner_last_change: Optional[int] = None
        self._inner_generator: Optional[torch.Generator] = None
        self._inner_record: dict = {}
        # The parameters the user froze: never trained, whichever block is active. A
        # parameter that a BAdam froze (an earlier one over the same model) is not one.
        self._frozen = {(gi, i) for gi, ps in enumerate(block_params)
                        for i, p in enumerate(ps)
                        if not p.requires_grad and p not in _FROZEN_BY_BADAM}
        super().__init__([{"params": ps, "block": n} for n, ps in zip(names, block_params)],
                         defaults, backend, nonfinite, seed)

        in_blocks = {id(p) for ps in block_params for p in ps}
        for _, p in named:
            if id(p) not in in_blocks:
                _deactivate(p)
        for ps in block_params:
            for p in ps:
                _deactivate(p)
        # The active block's entries only (the engine gave every parameter one).
        self.state = defaultdict(dict)
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
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """The engine's step (:meth:`FusedOptimizer.step`) of the active block, then the
        switch to the next block when its ``switch_every`` steps are done (before the
        next forward, so that backward already skips the block that stopped). The
        schedule counts calls of ``step()``: a switch due at a skipped step happens
        (docs/optimizers.md, "Skipped steps and schedules"); a step that raises counts
        nothing."""
        loss = super().step(closure)
        self._switch_if_due()
        return loss

    # ------------------------------------------------------------- engine hooks

    def _group_steps(self, gi: int) -> bool:
        return gi == self._epoch[self._cursor]

    def _check_group(self, group: dict, where: str, read_device: bool = False) -> None:
        if self.inner == "frugal":
            _check_frugal_group(group, where, read_device)
        else:
            check_adamw_options(group, where, read_device)
        _check_state_dtype(group, where, self.inner)

    def _check_saved_group(self, gi: int, saved: dict, group: dict) -> None:
        saved_dtype, dtype = saved["state_dtype"], group.get("state_dtype", "fp32")
        if saved_dtype != dtype:
            raise ValueError(f"block {group['block']!r}: the state dict's moments are "
                             f"state_dtype={saved_dtype!r} but this optimizer's are {dtype!r}; "
                             f"build the BAdam with state_dtype={saved_dtype!r} to resume "
                             "from it")

    def _family(self, group: dict) -> Projection:
        return _COMPOSED[group["projection"]] if self.inner == "frugal" else DENSE_MASTER

    def _before_plan(self) -> None:
        self._steps_taken += 1
        self._block_steps += 1
        if self.inner != "frugal":
            return
        self._inner_steps += 1
        if self._inner_change_due(self._inner_steps):
            self._inner_last_change = self._inner_steps
            if self._matrices:
                self._family(self.param_groups[self.active_block_index]).matrices.choose(
                    self._inner_subspace())
            self._plan = None

    def _inner_change_due(self, step: int) -> bool:
        return self._inner_last_change is None or \
            step - self._inner_last_change >= self._update_gap

    def _state_may_change(self) -> bool:
        return self.inner == "frugal" and self._inner_change_due(self._inner_steps + 1)

    def _after_plan(self) -> None:
        if self.inner == "frugal" and self._inner_last_change == self._inner_steps:
            # The state the new subspaces dropped is free now: hand it back to the OS.
            release_freed_memory()

    def _bookkeeping(self) -> dict:
        return {"counts": (self._steps_taken, self._block_steps, self._inner_steps,
                           self._inner_last_change),
                "record": _copy_record(self._inner_record),
                "inner_generator": None if self._inner_generator is None
                else self._inner_generator.get_state()}

    def _restore_bookkeeping(self, saved: dict) -> None:
        (self._steps_taken, self._block_steps, self._inner_steps,
         self._inner_last_change) = saved["counts"]
        self._inner_record = saved["record"]
        if saved["inner_generator"] is not None:
            self._inner_generator.set_state(saved["inner_generator"])

    def _inner_subspace(self) -> Subspace:
        """What FRUGAL's family reads and writes about the active block's matrices."""
        group = self.param_groups[self.active_block_index]
        return Subspace({**group, "params": self._matrices}, self.state, self._inner_generator,
                        float(group["density"]), self._inner_record, self._layouts,
                        arriving=self._grads_arriving)

    def _assign(self, gi: int, group: dict, i: int, p: Tensor) -> Assignment:
        j = self._matrix_index.get(p)
        if j is not None:
            return self._family(group).matrices.assign(self._inner_subspace(), j, p)
        sub = Subspace(group, self.state, self._generator, 1.0, {}, self._layouts)
        return (DENSE if self.inner == "frugal" else DENSE_MASTER).assign(sub, i, p)

    def end_tensor_steps(self) -> None:
        super().end_tensor_steps()
        self._switch_if_due()

    # ---------------------------------------------------------------- schedule

    def _switch_if_due(self) -> None:
        if self._block_steps >= self._switch_every:
            self._switch("switch_every")

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
        self._drop_state()
        self._cursor += 1
        if self._cursor == len(self._epoch):
            self._epoch = self._new_epoch()
            self._cursor = 0
        self._block_steps = 0
        self._activate(self.active_block_index)
        self.history.append({"step": self._steps_taken, "block": self.active_block,
                             "reason": reason})

    def _drop_state(self) -> None:
        """Let go of the block's state and of the plans that hold it, and hand the freed
        memory back to the OS (at a switch)."""
        for stale in (self._plan, self._steps_plan):
            if stale is not None:
                plan.release(stale)
        self._plan = self._steps_plan = None
        self._steps = {}
        self._tensor_buckets = {}
        self.state = defaultdict(dict)  # _activate gives the new block its entries
        release_freed_memory()

    def _trained(self, index: int, frozen: Optional[set] = None) -> List[Tensor]:
        """The parameters of block ``index`` that train when it is active: all but those
        in ``frozen`` (by default those the user froze)."""
        frozen = self._frozen if frozen is None else frozen
        return [p for i, p in enumerate(self.param_groups[index]["params"])
                if (index, i) not in frozen]

    def _activate(self, index: int) -> None:
        trained = self._trained(index)
        for p in trained:
            _FROZEN_BY_BADAM.pop(p, None)
            p.requires_grad_(True)
            # An empty entry until the block's first step: torch.distributed.checkpoint's
            # get/set_optimizer_state_dict take a step with zero gradients on an
            # optimizer whose state is empty, which would count a step of the block.
            self.state[p]
        self._matrices = [p for p in trained if p.dim() >= 2] if self.inner == "frugal" else []
        self._matrix_index = {p: j for j, p in enumerate(self._matrices)}
        if self.inner == "frugal":
            # A FRUGAL of the block's own: a different stream for each block,
            # reproducible from BAdam's seed and the step the block starts at.
            self._inner_generator = torch.Generator().manual_seed(
                _inner_seed(self.seed, self._steps_taken))
            self._inner_steps, self._inner_last_change, self._inner_record = 0, None, {}

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """The engine's state dict (:meth:`FusedOptimizer.state_dict`: the active
        block's per-tensor state, in its global form under FSDP2) plus the ``"badam"``
        entry of the first param group: block names, the current epoch's order and
        position, step counts, switch_every, the generator state, the history, the
        parameters the user froze and, for ``inner="frugal"``, the block's schedule of
        subspaces. Everything loads with ``torch.load(weights_only=True)``."""
        sd = super().state_dict()
        extra = {
            "version": _FORMAT,
            "block_names": list(self.block_names),
            "switch_mode": self.switch_mode,
            "epoch": list(self._epoch),
            "cursor": self._cursor,
            "steps_taken": self._steps_taken,
            "block_steps": self._block_steps,
            "switch_every": self._switch_every,
            "generator": self._generator.get_state(),
            "history": [[[k, v] for k, v in h.items()] for h in self.history],
            "inner": self.inner,
            # The parameters the user froze, as [block index, index in the block] pairs.
            "frozen": [list(f) for f in sorted(self._frozen)],
        }
        if self.inner == "frugal":
            extra.update(inner_steps=self._inner_steps,
                         inner_last_change=self._inner_last_change,
                         inner_generator=self._inner_generator.get_state(),
                         inner_record=[[k, v] for k, v in
                                       _copy_record(self._inner_record).items()])
        sd["param_groups"][0]["badam"] = extra
        return sd

    def _expect_saved_state(self, params: List[Tensor]) -> None:
        """``params`` have state in a checkpoint about to be loaded with
        torch.distributed.checkpoint's ``set_optimizer_state_dict``, which passes on
        the state of parameters that require grad only: let them require it
        (:meth:`load_state_dict` sets every flag by the loaded schedule)."""
        for p in params:
            p.requires_grad_(True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume exactly from :meth:`state_dict`, of this format or an older one (the
        model's parameters are the caller's to restore), or raise a ValueError that says
        why the checkpoint does not fit this optimizer; nothing is changed then.

        With DTensor parameters the state is taken in its global form (DTensors of any
        split, or plain tensors holding the whole); this rank keeps its rows."""
        extra = self._checked_extra(state_dict)
        super().load_state_dict(self._upgraded(state_dict, extra))

    def _checked_extra(self, state_dict: dict) -> dict:
        """The "badam" entry of ``state_dict``, of any format, as format 4 holds it (the
        history as dicts, inner="frugal"'s schedule as ``inner_*`` entries, the record a
        dict), or a ValueError unless it can resume this optimizer's schedule."""
        extra = _saved_extra(state_dict)
        if extra.get("inner", "adamw") != self.inner:
            raise ValueError(f"the state dict was saved with inner={extra.get('inner', 'adamw')!r}"
                             f", this optimizer uses inner={self.inner!r}")
        n = len(self.block_names)
        if list(extra["block_names"]) != self.block_names:
            raise ValueError(f"the state dict's blocks {list(extra['block_names'])} are not "
                             f"this optimizer's {self.block_names}")
        if extra["switch_mode"] != self.switch_mode:
            raise ValueError(f"the state dict was saved with switch_mode "
                             f"{extra['switch_mode']!r}, this optimizer uses "
                             f"{self.switch_mode!r}")
        _check_extra(extra, n)
        epoch, cursor = [int(i) for i in extra["epoch"]], int(extra["cursor"])
        blocks_of_epoch = list(range(n)) if self._fixed_order is None else self._fixed_order
        if sorted(epoch) != sorted(blocks_of_epoch) or not 0 <= cursor < len(epoch):
            raise ValueError(f"the state dict's block order {epoch} (position {cursor}) is not "
                             f"an order of this optimizer's blocks {sorted(blocks_of_epoch)}")
        _check_switch_every(extra["switch_every"])
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != n:
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this "
                             f"optimizer {n} blocks")
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"block {group['block']!r} has {len(group['params'])} params "
                                 f"but the state dict's has {len(saved['params'])}")
        if extra.get("version", 1) < 4:
            # One count of the block's applied updates: saved before it existed, every
            # step of the block was applied.
            updates = extra.get("block_updates", extra["block_steps"])
            if isinstance(updates, bool) or not isinstance(updates, (int, float)) or \
                    not (math.isfinite(updates) and 0 <= updates <= extra["block_steps"]):
                raise ValueError(f"the state dict's block_updates {updates!r} is not a count "
                                 f"of at most block_steps ({extra['block_steps']!r})")
        if self.inner == "frugal":
            extra = {**extra, **self._saved_inner_schedule(extra)}
        return extra

    def _saved_inner_schedule(self, extra: dict) -> dict:
        """inner="frugal"'s schedule of a saved "badam" entry (format 4's inner_*
        entries, or the nested FRUGAL's state dict of older formats), checked."""
        active = int(extra["epoch"][int(extra["cursor"])])
        num_matrices = sum(p.dim() >= 2 for p in
                           self._trained(active, _saved_frozen(extra, self._frozen)))
        if extra.get("version", 1) < 4:
            inner = extra.get("inner_state")
            if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
                raise ValueError("the state dict's 'badam' entry lacks inner_state, the "
                                 "inner FRUGAL's state dict")
            saved = _saved_frugal_extra(inner)
            missing = [k for k in ("steps_taken", "last_change", "generator") if k not in saved]
            if missing:
                raise ValueError(f"the state dict's inner FRUGAL lacks {', '.join(missing)}")
            records = {int(gi): record for gi, record in _saved_subspaces(saved).items()}
            # Its first group holds the block's matrices, when it has some.
            schedule = {"inner_steps": saved["steps_taken"],
                        "inner_last_change": saved["last_change"],
                        "inner_generator": saved["generator"],
                        "inner_record": dict(records.get(0, {})) if num_matrices else {}}
        else:
            missing = [k for k in ("inner_steps", "inner_last_change", "inner_generator",
                                   "inner_record") if k not in extra]
            if missing:
                raise ValueError(f"the state dict's 'badam' entry lacks {', '.join(missing)}")
            record = extra["inner_record"]
            if not isinstance(record, (list, tuple)) or not all(
                    isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in record):
                raise ValueError("the state dict's inner_record is not a list of [key, value] "
                                 "pairs")
            schedule = {k: extra[k] for k in ("inner_steps", "inner_last_change",
                                              "inner_generator")}
            schedule["inner_record"] = {k: v for k, v in record}
        try:
            check_int(schedule["inner_steps"], "inner_steps", 0)
            if schedule["inner_last_change"] is not None:
                check_int(schedule["inner_last_change"], "inner_last_change", 1)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the state dict's inner FRUGAL schedule: {e}") from None
        try:
            torch.Generator().set_state(schedule["inner_generator"])
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"the state dict's inner generator state cannot be restored: "
                             f"{e}") from None
        chosen = schedule["inner_record"].get("active", [])
        if not isinstance(chosen, (list, tuple)) or list(chosen) != sorted(set(chosen)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_matrices
                for i in chosen):
            raise ValueError(f"the state dict's inner record: the active blocks {chosen!r} "
                             f"are not sorted unique ids of the block's {num_matrices} "
                             "matrices")
        return schedule

    def _upgraded(self, state_dict: dict, extra: dict) -> dict:
        """``state_dict`` as format 4 holds it (checked "badam" entry ``extra``), for the
        engine's load: every group with the options a group of this optimizer has (older
        formats lack inner="frugal"'s; a group saved before ``state_dtype`` existed held
        fp32 moments), the per-tensor state with its step counts."""
        saved_groups = state_dict["param_groups"]
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "state_dtype": "fp32",
                   **saved}
                  for group, saved in zip(self.param_groups, saved_groups)]
        groups[0] = {**groups[0], "badam": extra}
        state = state_dict["state"]
        if extra.get("version", 1) < 4:
            state = self._upgraded_state(state_dict, extra)
        return {"state": state, "param_groups": groups}

    def _upgraded_state(self, state_dict: dict, extra: dict) -> dict:
        """The per-tensor state of a state dict of format 3 or older as format 4 holds it."""
        if self.inner == "adamw":
            step = torch.tensor(float(extra.get("block_updates", extra["block_steps"])))
            return {pid: {**st, "step": step} if "exp_avg" in st else dict(st)
                    for pid, st in state_dict["state"].items()}
        # The nested FRUGAL's state: in ours with prefixed keys (format 3) or in its own
        # state dict (format 2), its parameters being the active block's trained ones,
        # matrices first.
        inner = extra["inner_state"]
        state = {pid: {k: v for k, v in st.items() if not k.startswith(_INNER)}
                 for pid, st in state_dict["state"].items()}
        active = int(extra["epoch"][int(extra["cursor"])])
        frozen = _saved_frozen(extra, self._frozen)
        ids = state_dict["param_groups"][active]["params"]
        trained = [(pid, p) for i, (pid, p) in
                   enumerate(zip(ids, self.param_groups[active]["params"]))
                   if (active, i) not in frozen]
        order = [pid for pid, p in trained if p.dim() >= 2] + \
                [pid for pid, p in trained if p.dim() < 2]
        inner_ids = [pid for g in inner["param_groups"] for pid in g["params"]]
        if len(inner_ids) != len(order):
            raise ValueError(f"the state dict's inner FRUGAL has {len(inner_ids)} params, the "
                             f"active block {len(order)} trained ones")
        stray = [pid for pid, st in state_dict["state"].items() if pid not in order
                 and any(k.startswith(_INNER) for k in st)]
        if stray:
            raise ValueError(f"the state dict holds state for param {stray[0]}, which is not "
                             "trained in the active block")
        for pid, inner_pid in zip(order, inner_ids):
            entries = {k[len(_INNER):]: v for k, v in state_dict["state"].get(pid, {}).items()
                       if k.startswith(_INNER)}
            entries = entries or dict(inner.get("state", {}).get(inner_pid, {}))
            if entries:
                state[pid] = {**state.get(pid, {}), **entries}
        return state

    def _saved_group(self, saved: dict) -> dict:
        return {k: v for k, v in saved.items() if k != "badam"}

    def _check_state_dict(self, state_dict: dict) -> None:
        super()._check_state_dict(state_dict)
        extra = state_dict["param_groups"][0]["badam"]
        active = int(extra["epoch"][int(extra["cursor"])])
        saved_groups = state_dict["param_groups"]
        for gi, saved in enumerate(saved_groups):
            for pid in saved["params"]:
                st = state_dict["state"].get(pid)
                if st and gi != active:  # an empty entry is no state
                    raise ValueError(f"the state dict holds state for param {pid}, which is "
                                     "not in the active block")
                if st and "step" in st and not float(st["step"]) <= extra["block_steps"]:
                    raise ValueError(f"state of param {pid}: its step count "
                                     f"{float(st['step'])} is more than the block's steps "
                                     f"({extra['block_steps']})")

    def _load_optimizer_state(self, state_dict: dict) -> None:
        extra = state_dict["param_groups"][0]["badam"]
        self._frozen = _saved_frozen(extra, self._frozen)
        self._epoch, self._cursor = [int(i) for i in extra["epoch"]], int(extra["cursor"])
        self._steps_taken = int(extra["steps_taken"])
        self._block_steps = int(extra["block_steps"])
        self._switch_every = int(extra["switch_every"])
        self._generator.set_state(extra["generator"])
        self.history = [dict(h) for h in extra["history"]]
        active = self.active_block_index
        trained = self._trained(active)
        # The engine loaded an entry for every parameter: the active block's are kept.
        self.state = defaultdict(dict, {p: self.state[p] for p in trained})
        self._tensor_buckets = {}
        self._activate(active)
        if self.inner == "frugal":
            self._inner_steps = int(extra["inner_steps"])
            last = extra["inner_last_change"]
            self._inner_last_change = None if last is None else int(last)
            self._inner_generator.set_state(extra["inner_generator"])
            self._inner_record = _copy_record(extra["inner_record"])
        for gi, group in enumerate(self.param_groups):
            if gi != active:
                for p in group["params"]:
                    _deactivate(p)
        for i, p in enumerate(self.param_groups[active]["params"]):
            if (active, i) in self._frozen:
                _deactivate(p)


# ------------------------------------------------------------------ helpers


def _saved_extra(state_dict: dict) -> dict:
    """The "badam" entry of a saved state dict, of any format, as format 1 holds it
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
    version = extra.get("version", 2)
    if isinstance(version, bool) or not isinstance(version, int) or version > _FORMAT:
        raise ValueError(f"the state dict's 'badam' entry is of format {version!r}; this "
                         f"BAdam reads formats 1 to {_FORMAT}")
    return {**extra, "history": [{k: v for k, v in h} for h in history]}


# The entries of the "badam" entry a load needs (inner, frozen and the formats' own
# came later; a state dict without them loads as one of its time).
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
    except (TypeError, ValueError) as e:
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


def _saved_frozen(extra: dict, default: set) -> set:
    """The parameters the user froze, of a checked "badam" entry (``default``, those of
    the optimizer it is loaded into, when it was saved before the list existed)."""
    if "frozen" not in extra:
        return default
    return {(int(gi), int(i)) for gi, i in extra["frozen"]}


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


def _check_inner(inner: str, frugal_options: dict) -> None:
    if inner not in INNER_OPTIMIZERS:
        raise ValueError(f"inner must be one of {', '.join(INNER_OPTIMIZERS)}; got {inner!r}")
    unknown = sorted(set(frugal_options) - set(_FRUGAL_DEFAULTS))
    if unknown:
        raise TypeError(f"BAdam got unexpected keyword arguments {unknown}; the FRUGAL options "
                        f"of inner='frugal' are {', '.join(_FRUGAL_DEFAULTS)}")
    if frugal_options and inner != "frugal":
        raise ValueError(f"{', '.join(sorted(frugal_options))} are options of inner='frugal', "
                         f"not of inner={inner!r}")


def _check_state_dtype(group: dict, where: str, inner: str) -> None:
    state_dtype = group.get("state_dtype", "fp32")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}: state_dtype must be one of {', '.join(STATE_DTYPES)}; got "
                         f"{state_dtype!r}")
    if inner == "frugal":
        plan.check_int8_projection(state_dtype, group["projection"], where,
                                   "inner='adamw', or inner='frugal' with projection='blocks'")


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
