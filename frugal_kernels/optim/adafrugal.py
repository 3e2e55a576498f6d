"""AdaFRUGAL: FRUGAL with a decaying density and a loss-aware update gap (Bui & Ta, 2026)."""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional

import torch
from torch import Tensor

from frugal_kernels.optim.engine import check_int, check_number
from frugal_kernels.optim.frugal import FRUGAL
from frugal_kernels.optim.governed import suggested_factor

__all__ = ["AdaFRUGAL"]


class AdaFRUGAL(FRUGAL):
    r"""FRUGAL whose density rho and update gap T adapt during training.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                          \\
            &\textbf{input}: \rho_{start}, \rho_{end}, \: K \text{ (rho\_steps)},
                \: T_0 \text{ (update\_gap)}, \: T_{max} \text{ (update\_gap\_max)}      \\
            &\hspace{13mm} \tau \text{ (loss\_tolerance)}, \: \eta \text{ (gap\_growth)},
                \: w \text{ (loss\_window)}, \text{ and FRUGAL's inputs}               \\
            &\rule{110mm}{0.4pt}                                                          \\
            &T \leftarrow T_0                                                            \\
            &\textbf{at the subspace change after } k \textbf{ completed steps}:         \\
            &\hspace{5mm} \rho \leftarrow \max\big(\rho_{end}, \: \rho_{start}
                - (\rho_{start} - \rho_{end}) \, k / K\big)                              \\
            &\hspace{5mm} \text{choose FRUGAL's subspace with density } \rho            \\
            &\textbf{at each observed loss}: \: \mathcal{L} \leftarrow
                \mathcal{L} \cup \{L\}                                                   \\
            &\hspace{5mm} \textbf{if} \: |\mathcal{L}| \geq w \: \textbf{and} \:
                |L_{first} - L_{last}| / |L_{first}| < \tau \text{ over the last } w      \\
            &\hspace{10mm} T \leftarrow \min(T_{max}, \lceil \eta T \rceil), \quad
                \mathcal{L} \leftarrow \emptyset                                          \\
            &\textbf{each step}: \text{ FRUGAL's step with } \rho \text{ and } T          \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    - Dynamic rho: the decay above, for every projected group (their own
      ``density`` is ignored). When the state-full set shrinks, the state it
      drops is freed, and handed back to the OS
      (:func:`frugal_kernels.optim.memory.release_freed_memory`).
    - Dynamic T: :meth:`observe_loss` feeds a (validation or smoothed
      training) loss; ``loss_window`` counts observed losses, not steps.

    Either schedule can be switched off: ``dynamic_rho=False`` keeps
    ``rho = rho_start``; ``dynamic_update_gap=False`` keeps T. A
    :class:`frugal_kernels.Governor` steers both through
    :meth:`apply_governor`. ``opt.rho`` and ``opt.update_gap`` give the
    current values and ``opt.history`` lists the subspace changes and T
    changes (step, rho, T, reason).

    Args:
        params, lr: as :class:`FRUGAL`.
        rho_start, rho_end, rho_steps: the density's decay; ``rho_steps`` (K, usually the
            length of training) is needed when ``dynamic_rho``.
        update_gap, update_gap_max: T's start and ceiling.
        loss_tolerance, gap_growth, loss_window: the loss-aware rule of T.
        dynamic_rho, dynamic_update_gap: switch a schedule on or off.
        **frugal_options: the other arguments of :class:`FRUGAL` (``betas``, ``eps``,
            ``weight_decay``, ``projection``, ``state_free``, ``seed``, ``backend``,
            ``nonfinite``...);
            ``density`` is ``rho_start``'s.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | Tensor = 1e-3,
        *,
        rho_start: float = 0.25,
        rho_end: float = 0.05,
        rho_steps: Optional[int] = None,
        update_gap: int = 100,
        update_gap_max: int = 1000,
        loss_tolerance: float = 0.005,
        gap_growth: float = 1.5,
        loss_window: int = 3,
        dynamic_rho: bool = True,
        dynamic_update_gap: bool = True,
        **frugal_options: Any,
    ):
        if "density" in frugal_options:
            raise TypeError("AdaFRUGAL takes rho_start, rho_end and rho_steps, not density")
        check_number(rho_start, "rho_start", "AdaFRUGAL")
        check_number(rho_end, "rho_end", "AdaFRUGAL")
        if not 0.0 <= rho_end <= rho_start <= 1.0:
            raise ValueError(f"need 0 <= rho_end <= rho_start <= 1, got rho_start={rho_start}, "
                             f"rho_end={rho_end}")
        if rho_steps is not None:
            check_int(rho_steps, "rho_steps", 1, "AdaFRUGAL")
        if dynamic_rho and rho_steps is None:
            raise ValueError("rho_steps (the steps over which rho decays, usually the length of "
                             "training) must be a positive int when dynamic_rho=True; pass "
                             "dynamic_rho=False for a static rho")
        check_int(update_gap, "update_gap", 1, "AdaFRUGAL")
        check_int(update_gap_max, "update_gap_max", 1, "AdaFRUGAL")
        if update_gap_max < update_gap:
            raise ValueError(f"update_gap_max ({update_gap_max}) must be >= update_gap "
                             f"({update_gap})")
        check_number(gap_growth, "gap_growth", "AdaFRUGAL", low=1.0)
        check_number(loss_tolerance, "loss_tolerance", "AdaFRUGAL")
        check_int(loss_window, "loss_window", 2, "AdaFRUGAL")
        self.rho_start, self.rho_end, self.rho_steps = float(rho_start), float(rho_end), rho_steps
        self.update_gap_max = int(update_gap_max)
        self.loss_tolerance = float(loss_tolerance)
        self.gap_growth = float(gap_growth)
        self.loss_window = int(loss_window)
        self.dynamic_rho = bool(dynamic_rho)
        self.dynamic_update_gap = bool(dynamic_update_gap)
        self._rho_scale = 1.0        # in effect since the last subspace change
        self._next_rho_scale = 1.0   # from the next one (a governor's reallocation)
        self._losses: List[float] = []
        super().__init__(params, lr, density=rho_start, update_gap=update_gap, **frugal_options)

    def _current_density(self) -> float:
        rho = self.rho_start
        if self.dynamic_rho:
            # k counts the steps completed before the change: rho_start at the first step.
            k = self._last_change - 1 if self._last_change is not None else 0
            rho = max(self.rho_end,
                      self.rho_start - (self.rho_start - self.rho_end) * k / self.rho_steps)
        return min(1.0, rho * self._rho_scale)

    def _group_density(self, group: dict) -> float:
        return self._current_density()

    def _change_subspace(self, reason: str) -> None:
        self._rho_scale = self._next_rho_scale
        super()._change_subspace(reason)

    def _bookkeeping(self) -> dict:
        return {**super()._bookkeeping(), "rho_scale": self._rho_scale}

    def _restore_bookkeeping(self, saved: dict) -> None:
        super()._restore_bookkeeping(saved)
        self._rho_scale = saved["rho_scale"]

    def observe_loss(self, value: float | Tensor) -> None:
        """Feed one (validation or smoothed training) loss to the dynamic-T rule.

        Under ``torch.distributed`` (a process group of more than one rank) the rule
        sees the mean of the ranks' losses, so every rank keeps the same T: then every
        rank must call this at the same steps (it is a collective, one all-reduce)."""
        loss = _mean_over_ranks(float(value))
        if not math.isfinite(loss):
            raise ValueError(f"observe_loss got a non-finite loss {loss}")
        if not self.dynamic_update_gap:
            return
        self._losses.append(loss)
        if len(self._losses) < self.loss_window:
            return
        window = self._losses[-self.loss_window:]
        first, last = window[0], window[-1]
        change = abs(first - last) / max(abs(first), 1e-12)
        if change < self.loss_tolerance:
            self._grow_gap(self.gap_growth,
                           f"loss plateau: relative change {change:.3g} over {self.loss_window} "
                           f"losses < {self.loss_tolerance}")
            self._losses = []
        else:
            self._losses = self._losses[-(self.loss_window - 1):]

    governable = True

    def apply_governor(self, decision: Any) -> None:
        """Take a :class:`frugal_kernels.Governor` reallocation: grow T by its
        ``update_gap_factor`` now and scale rho by its ``rho_factor`` from the next
        subspace change (``opt.rho`` is the density in effect, so it changes then)."""
        gap_factor = suggested_factor(decision, "update_gap_factor")
        rho_factor = suggested_factor(decision, "rho_factor")
        if gap_factor > 1.0:
            self._grow_gap(gap_factor, "governor: grow T")
        if 0.0 < rho_factor < 1.0:
            self._next_rho_scale *= rho_factor
            self.history.append({"step": self._steps_taken, "rho": self._current_density(),
                                 "update_gap": self._update_gap,
                                 "reason": f"governor: rho scaled by {rho_factor:g} from the "
                                           "next subspace change"})

    def _grow_gap(self, factor: float, reason: str) -> None:
        new_gap = min(self.update_gap_max, math.ceil(self._update_gap * factor))
        if new_gap == self._update_gap:
            return
        self.history.append({"step": self._steps_taken, "rho": self._current_density(),
                             "update_gap": new_gap,
                             "reason": f"{reason}; T {self._update_gap} -> {new_gap}"})
        self._update_gap = new_gap

    def _schedule_state(self) -> dict:
        return {"rho_scale": self._rho_scale, "next_rho_scale": self._next_rho_scale,
                "losses": list(self._losses)}

    _schedule_keys = ("rho_scale", "next_rho_scale", "losses")

    def _check_extra(self, extra: dict) -> None:
        super()._check_extra(extra)
        try:
            for key in ("rho_scale", "next_rho_scale"):
                check_number(extra[key], key, "the state dict's 'frugal' entry")
            for loss in extra["losses"]:
                check_number(loss, "losses", "the state dict's 'frugal' entry", -math.inf)
        except TypeError as e:
            raise ValueError(str(e)) from None

    def _load_schedule_state(self, extra: dict) -> None:
        self._rho_scale = float(extra["rho_scale"])
        self._next_rho_scale = float(extra["next_rho_scale"])
        self._losses = [float(x) for x in extra["losses"]]


def _mean_over_ranks(value: float) -> float:
    """``value`` averaged over the ranks of the default process group (itself without one)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    world = torch.distributed.get_world_size()
    if world == 1:
        return value
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    total = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return float(total) / world
