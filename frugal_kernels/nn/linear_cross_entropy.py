"""The output layer and its cross-entropy loss as one module, and a one-line patch that
gives a causal LM the fused loss without rewriting its forward.

:class:`LinearCrossEntropy` holds the head's weight (and bias) like ``nn.Linear`` and
computes ``F.cross_entropy(hidden @ weight.T + bias, targets)`` with
:func:`frugal_kernels.ops.linear_cross_entropy`, never holding the ``[tokens, vocab]``
logits, and per-token scores where asked.

:func:`patch_causal_lm` switches a causal LM's loss to the fused op: when ``labels`` are
given, the trunk's last hidden states go straight into the fused loss with the head's
weight (shared, so tied embeddings stay tied), and the output's ``logits`` is None; without
labels the model runs as before. It knows two kinds of model:

- frugal_kernels' ``LlamaForCausalLM`` (any model with a ``fused_loss`` attribute: its
  forward takes the options from there);
- Hugging Face ``*ForCausalLM`` models (a ``transformers.PreTrainedModel`` with a ``model``
  trunk and an ``nn.Linear`` output embedding): their loss as
  ``ForCausalLMLoss`` computes it (labels shifted inside, ``-100`` ignored, ``shift_labels``
  and ``num_items_in_batch`` honoured).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from frugal_kernels.ops import linear_cross_entropy

__all__ = ["LinearCrossEntropy", "LinearCrossEntropyOutput", "patch_causal_lm"]


class LinearCrossEntropyOutput(NamedTuple):
    loss: Tensor
    scores: Dict[str, Tensor]


class LinearCrossEntropy(nn.Module):
    """``F.cross_entropy(hidden @ weight.T + bias, targets)`` without the logits in memory.

    Args:
        in_features: the hidden size D.
        out_features: the vocabulary size V.
        bias: whether the layer has a bias (``nn.Linear``'s default initialisation).
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy``.
        scores: per-token scores to return, any of ``"loss"``, ``"el2n"``, ``"grad_norm"``
            (see :func:`frugal_kernels.ops.linear_cross_entropy`).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    ``forward(hidden [..., D], targets [...])`` returns ``(loss, scores)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 ignore_index: int = -100, label_smoothing: float = 0.0,
                 reduction: str = "mean", scores: Sequence[str] = (), backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.scores = tuple(scores)
        self.backend = backend
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As ``nn.Linear``: uniform in ``+-1/sqrt(in_features)``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "LinearCrossEntropy":
        """A fused loss over an existing head: its weight and bias Parameters are shared,
        not copied (a tied embedding stays tied)."""
        module = cls(linear.in_features, linear.out_features, bias=False,
                     device="meta", **options)
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, hidden: Tensor, targets: Tensor) -> LinearCrossEntropyOutput:
        loss, scores = linear_cross_entropy(
            hidden, self.weight, targets, bias=self.bias, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, reduction=self.reduction,
            scores=self.scores, backend=self.backend)
        return LinearCrossEntropyOutput(loss, scores)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, scores={self.scores}")


def patch_causal_lm(model: nn.Module, *, label_smoothing: float = 0.0,
                    backend: str = "auto") -> nn.Module:
    """Give ``model`` the fused head and loss whenever it is called with ``labels``
    (module docstring); returns the model. Undo: ``model.fused_loss = None`` for
    frugal_kernels' model, ``del model.forward`` for a Hugging Face one."""
    options = dict(label_smoothing=float(label_smoothing), backend=backend)
    if hasattr(model, "fused_loss"):
        model.fused_loss = options
        return model
    if _is_hf_causal_lm(model):
        model.forward = _hf_forward(model, options)
        return model
    raise TypeError(f"patch_causal_lm: {type(model).__name__} is neither frugal_kernels' "
                    "LlamaForCausalLM nor a Hugging Face PreTrainedModel with a `model` trunk "
                    "and an nn.Linear output embedding")


def _is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and isinstance(
        getattr(model, "model", None), nn.Module) and isinstance(
        model.get_output_embeddings(), nn.Linear)


def _hf_forward(model: nn.Module, options: dict):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}

    def forward(*args, labels: Optional[Tensor] = None, **kwargs):
        if labels is None and kwargs.get("shift_labels") is None:
            return original(*args, **kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)  # every position is scored
        outputs = model.model(*args, **kwargs)
        hidden = outputs[0]
        if shift_labels is None:
            # ForCausalLMLoss: position t is scored on labels[t + 1]; the last on nothing.
            hidden, shift_labels = hidden[:, :-1], labels[:, 1:]
        head = model.get_output_embeddings()
        reduction = "mean" if num_items is None else "sum"
        loss, _ = linear_cross_entropy(hidden, head.weight, shift_labels.to(hidden.device),
                                       bias=head.bias, ignore_index=-100,
                                       reduction=reduction, **options)
        if num_items is not None:
            loss = loss / num_items
        rest = {k: v for k, v in outputs.items() if k in fields and k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)

    return forward
