"""What a training loop reads from an optimizer, as one public surface.

:class:`FrugalOptimizer` names the members a loop (``frugal_kernels.lab.train``, the bench,
a user's own loop) may call on any optimizer of the package, with defaults for those an
optimizer has no use for: the state it holds, its clip, the schedule values it is at, the
validation losses it listens to, the governor's reallocations and its history. The fused
optimizers (FRUGAL, AdaFRUGAL, DQT) and BAdam inherit it. :func:`protocol_of` gives the same
surface over any other ``torch.optim`` optimizer (torch's AdamW, a peer's), so that a loop
asks every optimizer the same questions instead of probing which attributes it has.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import torch
from torch import Tensor
from torch.optim import Optimizer

from frugal_kernels.optim.memory import storage_bytes

__all__ = ["FrugalOptimizer", "protocol_of", "state_tensors"]


def state_tensors(optimizer) -> Iterator[Tensor]:
    """The tensors of ``optimizer.state``, and those one attribute down in the helper objects
    some optimizers keep there (GaLore's and APOLLO's projectors hold their projection
    matrix)."""
    for st in optimizer.state.values():
        for value in st.values():
            if isinstance(value, Tensor):
                yield value
            elif hasattr(value, "__dict__"):
                yield from (v for v in vars(value).values() if isinstance(v, Tensor))


class FrugalOptimizer:
    """The surface a training loop reads from an optimizer (mixed into a
    ``torch.optim.Optimizer``: it reads ``self.state`` and ``self.param_groups``).

    - ``state_bytes()``: bytes of optimizer state allocated right now, every storage once.
    - ``clip_grad_norm_(max_norm, norm_type=2.0, error_if_nonfinite=False)``: clip the
      gradients of the optimizer's parameters by their global norm and return the norm, as
      ``torch.nn.utils.clip_grad_norm_`` (the fused optimizers apply it inside their next
      step instead).
    - ``training_info()``: the schedule values in force now that a loop records per step,
      by name: ``{"rho": ..., "update_gap": ...}`` for the FRUGAL family, empty otherwise.
    - ``observe_loss(value)``: a (validation) loss, for an optimizer whose schedule follows
      it (AdaFRUGAL's dynamic T); the default ignores it.
    - ``governable`` and ``apply_governor(decision)``: whether a
      :class:`~frugal_kernels.Governor`'s reallocations change this optimizer, and the call
      that takes one (AdaFRUGAL's rho and T, BAdam's switch interval).
    - ``history``: a list of dicts, one per change of what the optimizer trains (subspace
      changes, block switches, skipped steps); each optimizer sets its own in ``__init__``.
    """

    governable: bool = False
    history: List[dict]

    def state_bytes(self) -> int:
        """Bytes of optimizer state allocated right now: every storage of the tensors in
        ``self.state`` once."""
        return storage_bytes(state_tensors(self))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters."""
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def training_info(self) -> Dict[str, float]:
        """The schedule values in force now, by name (none by default)."""
        return {}

    def observe_loss(self, value: float | Tensor) -> None:
        """Take a (validation) loss; nothing in this optimizer's schedule follows it."""

    def apply_governor(self, decision: Any) -> None:
        """Take a governor's reallocation: refused where ``governable`` is False."""
        raise TypeError(f"{self._kind} has no schedule that a governor can reallocate "
                        "(its governable is False)")

    @property
    def _kind(self) -> str:
        """The optimizer's class name, for messages."""
        return type(self).__name__


class _TorchOptimizer(FrugalOptimizer):
    """The surface over a plain ``torch.optim`` optimizer: the defaults, its own clip where
    :func:`~frugal_kernels.swap` gave it one, and a history that stays empty."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.history: List[dict] = []

    @property
    def _kind(self) -> str:
        return type(self.optimizer).__name__

    @property
    def state(self):
        return self.optimizer.state

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """The swapped optimizer's fused clip (applied inside its next step), else torch's."""
        from frugal_kernels.optim.swap import is_swapped  # swap stands on base, which on this

        if is_swapped(self.optimizer):
            return self.optimizer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups


def protocol_of(optimizer: Optimizer) -> FrugalOptimizer:
    """``optimizer`` itself when it is one of the package's (a :class:`FrugalOptimizer`),
    else its surface with the defaults (the state it holds, torch's clip or a swapped
    optimizer's own, no schedule, an empty history)."""
    if isinstance(optimizer, FrugalOptimizer):
        return optimizer
    return _TorchOptimizer(optimizer)
