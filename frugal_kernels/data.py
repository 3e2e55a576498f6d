"""Online data selection: score candidate sequences, train on those the policy keeps.

:class:`OnlineSelector` takes a candidate batch (``candidates`` times the batch the step
trains on), scores every sequence (the model-scored policies with one no-grad forward pass
whose loss is ``ops.linear_cross_entropy``: the per-token scores come with the loss, no
logits, no second pass), and keeps the ``keep`` fraction with the highest scores (the
middle ranks under ``"middle"``):

- ``"loss"``: the sequence's mean token loss (SelectiveBackprop, Jiang et al. 2019);
- ``"el2n"``: its mean ``||softmax(z) - onehot(y)||`` (EL2N, Paul et al. 2021);
- ``"rho"``: its mean loss minus that of a small reference model trained on a holdout
  split (RHO-LOSS, Mindermann et al. 2022): high where the model can still learn, low on
  noise the reference cannot predict either;
- ``"middle"``: the mean loss, keeping the middle ranks: the highest losses (noise that
  cannot be learnt) and the lowest (what is learnt already) are dropped alike;
- ``"ngram"``: the mean log-probability of the sequence's bytes under a
  :class:`BigramReference` (byte-pair counts of a holdout split; no forward pass, a table
  lookup per token): the most plausible sequences are kept, which drops text with no
  structure, such as shuffled bytes, whose loss is the highest and which ``"loss"`` keeps;
- ``"random"``: no score, the kept fraction drawn at random (the control that tells what
  selection buys beyond training on fewer sequences per step).

``"ngram"`` and ``"random"`` need no pass of the model: their scoring costs
``BigramReference.FLOPS_PER_TOKEN`` per token and nothing.

Ties are broken by a seeded generator, so a selection is a function of the scores, the
seed and the number of calls so far; :meth:`state_dict` holds that state (put it in the
training checkpoint) and :meth:`load_state_dict` resumes it. ``scored_tokens`` counts the
tokens the scoring passes read, so that a run can count their FLOPs
(:meth:`scoring_flops`). Models: frugal_kernels' ``LlamaForCausalLM`` and Hugging Face
``*ForCausalLM`` (a ``model`` trunk and an ``lm_head``/output embedding).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from frugal_kernels.ops import linear_cross_entropy

__all__ = ["BigramReference", "OnlineSelector", "POLICIES", "scoring_flops_per_token",
           "sequence_scores"]

POLICIES = ("loss", "el2n", "rho", "middle", "ngram", "random")
# The policies whose scores come from a no-grad forward of the trained model.
MODEL_SCORED = ("loss", "el2n", "rho", "middle")


def _hidden_and_head(model: nn.Module, input_ids: Tensor):
    out = model.model(input_ids)
    hidden = out if isinstance(out, Tensor) else out[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else \
        model.lm_head
    return hidden, head


@torch.no_grad()
def sequence_scores(model: nn.Module, input_ids: Tensor, labels: Optional[Tensor] = None,
                    score: str = "loss", backend: str = "auto") -> Tensor:
    """Each sequence's mean per-token ``score`` (``"loss"`` or ``"el2n"``), fp32 ``[B]``,
    position ``t`` scored on ``labels[:, t + 1]`` (``labels`` default: ``input_ids``),
    ``-100`` ignored; a sequence with no scored token gets 0."""
    labels = input_ids if labels is None else labels
    hidden, head = _hidden_and_head(model, input_ids)
    _, scores = linear_cross_entropy(hidden[:, :-1], head.weight, labels[:, 1:],
                                     bias=head.bias, reduction="none", scores=(score,),
                                     backend=backend)
    counted = (labels[:, 1:] != -100).sum(1)
    return scores[score].sum(1) / counted.clamp_min(1)


def scoring_flops_per_token(policy: str, forward_flops_per_token: float,
                            reference_flops_per_token: float = 0.0) -> float:
    """FLOPs per token that ``policy`` scores: the model's forward (plus the reference
    model's under ``"rho"``), a bigram lookup under ``"ngram"``, none under ``"random"``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "random":
        return 0.0
    if policy == "ngram":
        return float(BigramReference.FLOPS_PER_TOKEN)
    extra = reference_flops_per_token if policy == "rho" else 0.0
    return forward_flops_per_token + extra


class BigramReference:
    """A byte-bigram model: ``log p(b | a)`` from pair counts with add-``smoothing``.

    :meth:`fit` counts the pairs of ``input_ids`` (``-100`` labels skipped);
    :meth:`sequence_scores` gives each sequence's mean log-probability of its labels given
    the byte before, ``[B]`` fp32, on the same positions as :func:`sequence_scores`.
    Counting and scoring each cost about ``FLOPS_PER_TOKEN`` per token (an index, an add).
    """

    FLOPS_PER_TOKEN = 2

    def __init__(self, vocab_size: int = 256, smoothing: float = 0.5) -> None:
        if not smoothing > 0:
            raise ValueError(f"BigramReference: smoothing must be > 0, got {smoothing!r}")
        self.vocab_size = vocab_size
        self.smoothing = float(smoothing)
        self.counts = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        self.fitted_tokens = 0

    def fit(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> "BigramReference":
        labels = input_ids if labels is None else labels
        prev, nxt = input_ids[:, :-1].reshape(-1).cpu(), labels[:, 1:].reshape(-1).cpu()
        counted = nxt != -100
        pairs = prev[counted] * self.vocab_size + nxt[counted]
        self.counts += torch.bincount(pairs, minlength=self.vocab_size ** 2).view(
            self.vocab_size, self.vocab_size).double()
        self.fitted_tokens += input_ids.numel()
        return self

    def log_probs(self) -> Tensor:
        """``[V, V]``: ``log p(column | row)``."""
        smoothed = self.counts + self.smoothing
        return (smoothed / smoothed.sum(1, keepdim=True)).log()

    def sequence_scores(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        labels = input_ids if labels is None else labels
        prev, nxt = input_ids[:, :-1].cpu(), labels[:, 1:].cpu()
        counted = nxt != -100
        lp = self.log_probs()[prev, nxt.clamp_min(0)] * counted
        return (lp.sum(1) / counted.sum(1).clamp_min(1)).float()

    def state_dict(self) -> dict:
        return {"counts": self.counts.clone(), "fitted_tokens": self.fitted_tokens,
                "smoothing": self.smoothing}

    def load_state_dict(self, state: dict) -> None:
        self.counts = state["counts"].clone().double()
        self.fitted_tokens = int(state["fitted_tokens"])
        self.smoothing = float(state["smoothing"])


class OnlineSelector:
    """Keep the best ``keep`` fraction of a candidate batch by ``policy`` (module docstring).

    Args:
        policy: one of :data:`POLICIES`.
        keep: the fraction of the candidates trained on, in (0, 1].
        candidates: how many times the trained batch the caller draws and passes in (the
            selector scores whatever it is given; the training loop sizes its batch with it).
        reference: the reference model of ``"rho"``, the :class:`BigramReference` of
            ``"ngram"`` (required there, unused otherwise).
        seed: of the generator that breaks ties (and draws ``"random"``'s choice).
        backend: of the fused loss.
    """

    def __init__(self, policy: str = "loss", keep: float = 0.5, candidates: int = 2, *,
                 reference: Optional[nn.Module] = None, seed: int = 0,
                 backend: str = "auto") -> None:
        if policy not in POLICIES:
            raise ValueError(f"OnlineSelector: policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or \
                not 0.0 < keep <= 1.0:
            raise ValueError(f"OnlineSelector: keep must be in (0, 1], got {keep!r}")
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"OnlineSelector: candidates must be an int >= 1, got "
                             f"{candidates!r}")
        if policy == "rho" and not isinstance(reference, nn.Module):
            raise ValueError("OnlineSelector: policy 'rho' needs a reference model")
        if policy == "ngram" and not isinstance(reference, BigramReference):
            raise ValueError("OnlineSelector: policy 'ngram' needs a BigramReference")
        self.policy = policy
        self.keep = float(keep)
        self.candidates = candidates
        self.reference = reference
        self.backend = backend
        self.generator = torch.Generator().manual_seed(seed)
        self.calls = 0
        self.scored_tokens = 0

    def scores(self, model: nn.Module, input_ids: Tensor,
               labels: Optional[Tensor] = None) -> Tensor:
        """Each candidate's score under the policy, fp32 ``[B]`` (no gradients; ``"random"``:
        all 0, the choice is the generator's)."""
        if self.policy == "random":
            return torch.zeros(input_ids.shape[0])
        self.scored_tokens += input_ids.numel()
        if self.policy == "ngram":
            return self.reference.sequence_scores(input_ids, labels)
        kind = "el2n" if self.policy == "el2n" else "loss"
        s = sequence_scores(model, input_ids, labels, kind, self.backend)
        if self.policy == "rho":
            s = s - sequence_scores(self.reference, input_ids, labels, "loss", self.backend)
        return s

    def select(self, model: nn.Module, input_ids: Tensor,
               labels: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor], Tensor]:
        """``(input_ids[kept], labels[kept], kept)``: the ``ceil(keep * B)`` candidates the
        policy keeps (:meth:`choose`), ``kept`` ascending."""
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise ValueError(f"OnlineSelector: input_ids must be [B, T] with B >= 1, got "
                             f"{tuple(input_ids.shape)}")
        if self.policy in MODEL_SCORED:
            was_training = model.training
            model.eval()
            try:
                s = self.scores(model, input_ids, labels).cpu()
            finally:
                model.train(was_training)
        else:
            s = self.scores(model, input_ids, labels)
        kept = self.choose(s)
        index = kept.to(input_ids.device)
        return (input_ids[index], None if labels is None else labels[index], kept)

    def choose(self, scores: Tensor) -> Tensor:
        """The indices kept from ``scores`` ``[B]``, sorted ascending: the highest scores
        (``"middle"``: the middle ranks, as many dropped from the top as from the bottom, one
        more from the top when the number dropped is odd), ties in a random order drawn from
        the generator."""
        b = scores.shape[0]
        count = max(1, math.ceil(self.keep * b - 1e-9))
        order = torch.randperm(b, generator=self.generator)
        ranked = order[torch.sort(scores[order], descending=True, stable=True).indices]
        self.calls += 1
        first = -(-(b - count) // 2) if self.policy == "middle" else 0
        return ranked[first:first + count].sort().values

    def scoring_flops_per_token(self, forward_flops_per_token: float,
                                reference_flops_per_token: float = 0.0) -> float:
        """:func:`scoring_flops_per_token` of this selector's policy."""
        return scoring_flops_per_token(self.policy, forward_flops_per_token,
                                       reference_flops_per_token)

    def scoring_flops(self, forward_flops_per_token: float,
                      reference_flops_per_token: float = 0.0) -> float:
        """FLOPs of the scoring so far: :meth:`scoring_flops_per_token` times the tokens
        scored."""
        return self.scored_tokens * self.scoring_flops_per_token(forward_flops_per_token,
                                                                 reference_flops_per_token)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "calls": self.calls,
                "scored_tokens": self.scored_tokens, "policy": self.policy, "keep": self.keep}

    def load_state_dict(self, state: dict) -> None:
        if state.get("policy") != self.policy or state.get("keep") != self.keep:
            raise ValueError(f"OnlineSelector: the state is of policy {state.get('policy')!r}, "
                             f"keep {state.get('keep')!r}, not {self.policy!r}, {self.keep!r}")
        self.generator.set_state(state["generator"])
        self.calls = int(state["calls"])
        self.scored_tokens = int(state["scored_tokens"])
