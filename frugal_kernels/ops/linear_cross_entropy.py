"""``frugal::linear_cross_entropy``: the output layer and the cross-entropy loss in one op,
without the ``[N, V]`` logits in memory, with per-token scores as a by-product.

``loss = F.cross_entropy(hidden @ weight.T + bias, targets)`` (``ignore_index``,
``label_smoothing`` and the three reductions as there), computed over chunks of the
logits: the peak is one chunk, not ``N x V`` (at ``N = 8192`` tokens and a 128k
vocabulary the fp32 logits alone are 4 GiB, and their gradient as much again).

Two registered ops carry it:

- ``frugal::linear_cross_entropy`` returns the loss, the scores, each token's
  log-sum-exp and, when ``compute_grads`` is set, the gradients of the (reduced) loss
  with respect to ``hidden``, ``weight`` and ``bias``. With a mean or sum reduction the
  gradient of a scalar loss is a multiple of these, so autograd's backward only scales
  them: the logits are computed once (three GEMMs in all, as the unfused loss).
- ``frugal::linear_cross_entropy_backward`` recomputes the logits chunk by chunk from the
  saved log-sum-exp (a fourth GEMM): for ``reduction="none"``, whose per-token weights
  arrive only in backward, and for a forward run without gradients.

Scores (``[N]``, fp32, never differentiable; 0 for ignored tokens): ``"loss"`` (the
token's loss), ``"el2n"`` (``||softmax(z) - q||_2``, ``q`` the smoothed one-hot target,
``onehot(y)`` without smoothing: the norm of the gradient of the token's loss with
respect to its logits) and ``"grad_norm"`` (``el2n * ||h||``: the Frobenius norm of the
token's own gradient of ``weight``, ``outer(softmax(z) - q, h)``).

Backends: ``torch`` (chunks of whole rows of the logits on torch's GEMM; the CPU path)
and ``triton`` (tiles of tokens and vocabulary with an online softmax; see
kernels/triton/linear_cross_entropy.py). Both accumulate in fp32 whatever the input
dtype; the loss and scores are fp32, the gradients have their inputs' dtypes.
Double backward is not supported.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from frugal_kernels._layout import PARAM_DTYPES
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._spec import Implementations

OP = "frugal::linear_cross_entropy"
BACKWARD_OP = "frugal::linear_cross_entropy_backward"
REDUCTIONS = ("mean", "sum", "none")
SCORES = ("loss", "el2n", "grad_norm")
TARGET_DTYPES = (torch.int64, torch.int32)

# The torch backend's chunk of logits: whole rows of the vocabulary, CHUNK_BYTES of fp32
# but never fewer than MIN_ROWS rows. Every chunk reads and writes the fp32 gradient of
# the whole weight once and runs GEMMs whose inner size is the chunk's rows, so chunks
# of few rows are slow: at N = 2048, D = 512, V = 32k on 2 loaded cores, forward +
# backward took 1.9x the unfused loss's time with 64-row chunks, 1.17x with 256 and
# 0.89x with 1024 (bench/results/ has the section's runs). The peak beyond the returned
# gradients is about one chunk: 4 * rows * V bytes.
CHUNK_BYTES = 32 << 20
MIN_ROWS = 256


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
           ignore_index: int, label_smoothing: float, reduction: str,
           scores: Sequence[str]) -> None:
    """The metadata checks (shared with the fake kernels): nothing is read or written."""
    if hidden.dtype not in PARAM_DTYPES:
        raise TypeError(f"{OP}: hidden must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {hidden.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"{OP}: hidden must be 2-D [N, D], got shape {tuple(hidden.shape)}")
    n, d = hidden.shape
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{OP}: weight has dtype {weight.dtype} but hidden has {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != d or weight.shape[0] == 0:
        raise ValueError(f"{OP}: weight must be [V, {d}] with V >= 1 for hidden of shape "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if targets.dtype not in TARGET_DTYPES:
        raise TypeError(f"{OP}: targets must be torch.int64 or torch.int32, got {targets.dtype}")
    if tuple(targets.shape) != (n,):
        raise ValueError(f"{OP}: targets must have shape ({n},), one per row of hidden, got "
                         f"{tuple(targets.shape)}")
    vocab = weight.shape[0]
    if bias is not None and (bias.dtype != hidden.dtype or tuple(bias.shape) != (vocab,)):
        raise ValueError(f"{OP}: bias must be {hidden.dtype} of shape ({vocab},), got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but hidden on {hidden.device}")
    if not (math.isfinite(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be one of {', '.join(REDUCTIONS)}, got "
                         f"{reduction!r}")
    for name in scores:
        if name not in SCORES:
            raise ValueError(f"{OP}: unknown score {name!r}; scores are {', '.join(SCORES)}")
    if len(set(scores)) != len(scores):
        raise ValueError(f"{OP}: scores {list(scores)} name one score twice")


def _check_targets(targets: Tensor, vocab: int, ignore_index: int) -> None:
    """Targets in [0, V) or ``ignore_index``. Reads the values: a device sync on a GPU
    (F.cross_entropy checks them too); a wrong target would otherwise score silently."""
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"{OP}: target {value} is out of range for a vocabulary of {vocab} "
                         f"(and is not ignore_index={ignore_index})")


def _outputs_meta(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], reduction: str,
                  num_scores: int, compute_grads: bool):
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    loss = torch.empty((n,) if reduction == "none" else (), **f32)
    grads = (hidden.new_empty(hidden.shape if compute_grads else (0,)),
             weight.new_empty(weight.shape if compute_grads else (0,)),
             weight.new_empty(bias.shape if compute_grads and bias is not None else (0,)))
    return (loss, torch.empty((num_scores, n), **f32), torch.empty((n,), **f32), *grads)


@torch.library.custom_op(OP, mutates_args=())
def _linear_cross_entropy_op(
        hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
        ignore_index: int, label_smoothing: float, reduction: str, scores: str,
        compute_grads: bool, backend: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # The schema has no list of strings: the names come joined by commas.
    scores = _score_names(scores)
    _check(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, scores)
    _check_targets(targets, weight.shape[0], ignore_index)
    impl = _IMPLS[_dispatch.resolve(backend, hidden.device, OP)]
    loss_tok, lse, stats, grads = impl.forward(
        hidden.contiguous(), weight.contiguous(), targets.contiguous(),
        None if bias is None else bias.contiguous(), ignore_index, label_smoothing, reduction,
        compute_grads, "el2n" in scores or "grad_norm" in scores)
    score_rows = []
    for name in scores:
        if name == "loss":
            score_rows.append(loss_tok)
        elif name == "el2n":
            score_rows.append(stats)
        else:
            score_rows.append(stats * torch.linalg.vector_norm(hidden.float(), dim=1))
    n = hidden.shape[0]
    score_tensor = (torch.stack(score_rows) if score_rows else
                    torch.empty((0, n), dtype=torch.float32, device=hidden.device))
    loss = _reduce(loss_tok, targets, ignore_index, reduction)
    if grads is None:
        grads = _outputs_meta(hidden, weight, bias, reduction, 0, False)[3:]
    return (loss, score_tensor, lse, *grads)


@_linear_cross_entropy_op.register_fake
def _fake(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, scores,
          compute_grads, backend):
    scores = _score_names(scores)
    _check(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, scores)
    return _outputs_meta(hidden, weight, bias, reduction, len(scores), compute_grads)


def _score_names(joined: str) -> Tuple[str, ...]:
    return tuple(joined.split(",")) if joined else ()


def _reduce(loss_tok: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return loss_tok
    total = loss_tok.sum()
    if reduction == "sum":
        return total
    # As F.cross_entropy: NaN when every token is ignored (0 / 0).
    return total / (targets != ignore_index).sum()


def row_scales(targets: Tensor, ignore_index: int, reduction: str,
               grad_loss: Optional[Tensor] = None) -> Tensor:
    """Each token's weight in the loss's gradient, fp32 ``[N]``: 0 for ignored tokens, else
    1 (sum), 1 / (kept tokens) (mean) or ``grad_loss`` per token (none); times
    ``grad_loss`` when it is a scalar."""
    kept = (targets != ignore_index).float()
    if reduction == "mean":
        kept = kept / kept.sum().clamp_min(1.0)
    if grad_loss is not None:
        kept = kept * grad_loss.float()
    return kept


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def _linear_cross_entropy_backward_op(
        grad_loss: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor,
        bias: Optional[Tensor], lse: Tensor, ignore_index: int, label_smoothing: float,
        reduction: str, backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    _check(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, ())
    impl = _IMPLS[_dispatch.resolve(backend, hidden.device, OP)]
    scale = row_scales(targets, ignore_index, reduction, grad_loss)
    return impl.backward(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                         None if bias is None else bias.contiguous(), lse.contiguous(), scale,
                         ignore_index, label_smoothing)


@_linear_cross_entropy_backward_op.register_fake
def _fake_backward(grad_loss, hidden, weight, targets, bias, lse, ignore_index,
                   label_smoothing, reduction, backend):
    _check(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, ())
    return _outputs_meta(hidden, weight, bias, reduction, 0, True)[3:]


def _setup_context(ctx, inputs, output):
    (hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, _, compute_grads,
     backend) = inputs
    _, scores, lse, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(scores, lse, grad_hidden, grad_weight, grad_bias)
    # Else autograd hands backward a tensor of zeros for each output without a gradient:
    # one of them the size of the weight, at the peak beside the weight's gradient.
    ctx.set_materialize_grads(False)
    ctx.has_bias = bias is not None
    ctx.options = (ignore_index, label_smoothing, reduction, backend)
    ctx.grads = None
    if compute_grads:
        # Held on ctx, not saved: backward hands these very tensors to autograd (scaled in
        # place), which can then keep them as .grad without a copy; a saved tensor would
        # still be referenced and copied, a second weight gradient at the peak.
        ctx.grads = [grad_hidden, grad_weight, grad_bias]
    else:
        ctx.save_for_backward(hidden, weight, targets, bias, lse)


def _backward(ctx, grad_loss, *unused):
    if ctx.saved_tensors == ():
        if ctx.grads is None:
            raise RuntimeError(f"{OP}: its gradients were computed in the forward pass and "
                               "handed out by the first backward; a second backward through "
                               "it (retain_graph=True) is not supported")
        grads, ctx.grads = ctx.grads, None
        # A scalar loss: its gradients are grad_loss times those of the loss itself. In
        # place on plain tensors; traced ones (torch.compile's functional and fake tensors,
        # which refuse the in-place product of an output) take a copy.
        if type(grad_loss) is Tensor:
            for g in grads:
                g.mul_(grad_loss)
        else:
            grads = [g * grad_loss for g in grads]
    else:
        hidden, weight, targets, bias, lse = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, backend = ctx.options
        grads = list(_linear_cross_entropy_backward_op(
            grad_loss, hidden, weight, targets, bias, lse, ignore_index, label_smoothing,
            reduction, backend))
    grad_hidden, grad_weight, grad_bias = grads
    return (grad_hidden, grad_weight, None, grad_bias if ctx.has_bias else None, None, None,
            None, None, None, None)


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ backends

def _minus_target(e: Tensor, s: Tensor, targets: Tensor, c: Tensor,
                  label_smoothing: float) -> Tensor:
    """``c * (p - q)`` in place of ``e``: ``p = e / s`` the softmax of a chunk's rows, ``q``
    their smoothed one-hot targets, ``c`` a weight per row (an ignored row's target is a
    stand-in 0, so ``c`` must be 0 there or the row's result unused)."""
    d = e.mul_((c / s)[:, None])
    d[torch.arange(d.shape[0], device=d.device), targets] -= (1.0 - label_smoothing) * c
    if label_smoothing:
        d.sub_((label_smoothing / d.shape[1]) * c[:, None])
    return d


class _Torch:
    """Chunks of whole rows of the logits on torch's GEMM (the CPU path): a chunk's softmax
    is exact, so its gradient and el2n come from the chunk itself. One ``[rows, V]`` fp32
    buffer per chunk turns into the softmax and then the gradient in place; the weight's
    gradient is accumulated in fp32 over the chunks."""

    @staticmethod
    def _rows(vocab: int) -> int:
        return max(MIN_ROWS, CHUNK_BYTES // (4 * vocab))

    @staticmethod
    def _buffer(n: int, vocab: int, device) -> Tensor:
        # One buffer for all the chunks: a fresh [rows, V] per chunk, freed among the
        # chunk's small tensors, left holes in the heap that the next one did not fit, and
        # the process's resident peak grew to two or three chunks.
        rows = min(n, _Torch._rows(vocab))
        return torch.empty((rows, vocab), dtype=torch.float32, device=device)

    @staticmethod
    def _chunk(hidden, targets, kept_all, w32, b32, rows: slice, buf: Tensor):
        h = hidden[rows]
        kept = kept_all[rows]
        t = torch.where(kept, targets[rows], 0).long()
        z = torch.mm(h.float(), w32.t(), out=buf[:h.shape[0]])
        if b32 is not None:
            z += b32
        return h, kept, t, z

    @staticmethod
    def _grads_init(hidden, weight, bias):
        gh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        gb = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32,
                                                   device=bias.device)
        return gh, gw, gb

    @staticmethod
    def _accumulate(d: Tensor, h: Tensor, w32: Tensor, rows: slice, grads) -> None:
        gh, gw, gb = grads
        torch.mm(d, w32, out=gh[rows])
        gw.addmm_(d.t(), h.float())
        if gb is not None:
            gb += d.sum(0)

    @staticmethod
    def _grads_out(grads, hidden, weight, bias):
        gh, gw, gb = grads
        return (gh.to(hidden.dtype), gw.to(weight.dtype),
                weight.new_empty((0,)) if gb is None else gb.to(bias.dtype))

    @classmethod
    def forward(cls, hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                compute_grads, with_el2n):
        n = hidden.shape[0]
        w32 = weight.float()
        b32 = None if bias is None else bias.float()
        f32 = dict(dtype=torch.float32, device=hidden.device)
        loss_tok, lse, el2n = (torch.zeros(n, **f32) for _ in range(3))
        kept = targets != ignore_index
        scale = row_scales(targets, ignore_index, reduction)
        grads = cls._grads_init(hidden, weight, bias) if compute_grads else None
        rows = cls._rows(weight.shape[0])
        buf = cls._buffer(n, weight.shape[0], hidden.device)
        for r0 in range(0, n, rows):
            # One chunk per call: its temporaries are freed before the next one's.
            cls._forward_chunk(slice(r0, min(n, r0 + rows)), buf, hidden, targets, kept, w32,
                               b32, label_smoothing, scale, grads, with_el2n, loss_tok, lse,
                               el2n)
        out = None if grads is None else cls._grads_out(grads, hidden, weight, bias)
        return loss_tok, lse, el2n, out

    @classmethod
    def _forward_chunk(cls, rows, buf, hidden, targets, kept, w32, b32, label_smoothing,
                       scale, grads, with_el2n, loss_tok, lse, el2n):
        h, kept, t, z = cls._chunk(hidden, targets, kept, w32, b32, rows, buf)
        picked = z.gather(1, t[:, None]).squeeze(1)
        mean_z = z.mean(1) if label_smoothing else None
        # In place (torch.logsumexp would allocate two more chunks): the chunk's one
        # [rows, V] buffer becomes exp(z - max), then the softmax times c, then d.
        m = z.amax(1, keepdim=True)
        e = z.sub_(m).exp_()
        s = e.sum(1, keepdim=True)
        lse[rows] = (m + s.log()).squeeze(1)
        tok = lse[rows] - picked
        if label_smoothing:
            tok = (1.0 - label_smoothing) * tok + label_smoothing * (lse[rows] - mean_z)
        loss_tok[rows] = torch.where(kept, tok, 0.0)
        if grads is None and not with_el2n:
            return
        # With gradients each row is weighted by its scale (> 0 where kept: a mean's
        # 1 / count, a sum's 1), and el2n is the row's norm divided by it.
        c = scale[rows] if grads is not None else kept.float()
        d = _minus_target(e, s.squeeze(1), t, c, label_smoothing)
        if with_el2n:
            norm = torch.linalg.vector_norm(d, dim=1)
            el2n[rows] = torch.where(kept, norm / c.clamp_min(1e-30), 0.0)
        if grads is not None:
            cls._accumulate(d, h, w32, rows, grads)

    @classmethod
    def backward(cls, hidden, weight, targets, bias, lse, scale, ignore_index,
                 label_smoothing):
        w32 = weight.float()
        b32 = None if bias is None else bias.float()
        kept = targets != ignore_index
        grads = cls._grads_init(hidden, weight, bias)
        n = hidden.shape[0]
        rows = cls._rows(weight.shape[0])
        buf = cls._buffer(n, weight.shape[0], hidden.device)
        for r0 in range(0, n, rows):
            cls._backward_chunk(slice(r0, min(n, r0 + rows)), buf, hidden, targets, kept, w32,
                                b32, lse, scale, label_smoothing, grads)
        return cls._grads_out(grads, hidden, weight, bias)

    @classmethod
    def _backward_chunk(cls, rows, buf, hidden, targets, kept, w32, b32, lse, scale,
                        label_smoothing, grads):
        h, _, t, z = cls._chunk(hidden, targets, kept, w32, b32, rows, buf)
        d = _minus_target(z.sub_(lse[rows, None]).exp_(), 1.0, t, scale[rows], label_smoothing)
        cls._accumulate(d, h, w32, rows, grads)


class _Triton:
    """Tiles of tokens and vocabulary with an online softmax (the logits never leave
    registers); the gradients from a second kernel that recomputes the tiles."""

    @staticmethod
    def forward(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                compute_grads, with_el2n):
        from frugal_kernels.kernels.triton.linear_cross_entropy import backward, forward
        loss_tok, lse, el2n = forward(hidden, weight, targets, bias, ignore_index,
                                      label_smoothing)
        grads = None
        if compute_grads:
            scale = row_scales(targets, ignore_index, reduction)
            grads = backward(hidden, weight, targets, bias, lse, scale, ignore_index,
                             label_smoothing)
        return loss_tok, lse, el2n, grads

    @staticmethod
    def backward(hidden, weight, targets, bias, lse, scale, ignore_index, label_smoothing):
        from frugal_kernels.kernels.triton.linear_cross_entropy import backward
        return backward(hidden, weight, targets, bias, lse, scale, ignore_index,
                        label_smoothing)


_IMPLS = Implementations(OP)
_IMPLS.backend("torch")(_Torch)
_IMPLS.backend("triton")(_Triton)
_IMPLS.complete()


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         scores: Sequence[str] = (),
                         backend: str = "auto") -> Tuple[Tensor, Dict[str, Tensor]]:
    """``F.cross_entropy(hidden @ weight.T + bias, targets)`` without the logits in memory,
    and per-token scores.

    Args:
        hidden: ``[..., D]`` float32, bfloat16 or float16 (the last hidden states).
        weight: ``[V, D]`` of hidden's dtype (the output layer's weight).
        targets: ``[...]`` (hidden's leading shape), int64 or int32, each in ``[0, V)`` or
            ``ignore_index``.
        bias: None or ``[V]`` of hidden's dtype.
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy`` (no class
            weights). ``"mean"`` is NaN when every token is ignored, as there.
        scores: any of ``"loss"``, ``"el2n"``, ``"grad_norm"`` (module docstring).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``(loss, scores)``: the loss (fp32; ``[...]`` for ``reduction="none"``, ignored
        tokens 0) and a dict of the asked scores, each fp32 of ``targets``' shape, ignored
        tokens 0, detached from autograd.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets),
                    ("bias", bias)):
        if not isinstance(t, Tensor) and not (name == "bias" and t is None):
            raise TypeError(f"{OP}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if isinstance(scores, str):
        raise TypeError(f"{OP}: scores must be a sequence of names, got the string {scores!r}")
    scores = tuple(scores)
    if hidden.dim() < 1 or tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{OP}: targets must have hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    lead = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, score_tensor, *_ = _linear_cross_entropy_op(
        h2, weight, targets.reshape(-1), bias, int(ignore_index), float(label_smoothing),
        reduction, ",".join(scores), needs_grad and reduction != "none", backend)
    if reduction == "none":
        loss = loss.reshape(lead)
    return loss, {name: score_tensor[i].reshape(lead) for i, name in enumerate(scores)}
