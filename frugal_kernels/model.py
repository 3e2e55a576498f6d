"""A small LLaMA-style decoder-only language model, written with torch only.

The module tree and parameter names follow Hugging Face's ``LlamaForCausalLM``
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``model.layers.N.mlp.gate_proj``,
``model.layers.N.input_layernorm``, ``model.norm``, ``lm_head``...), so parameter grouping
written against HF Llama by name works unchanged on this model.

Example::

    config = LlamaConfig.from_preset("tiny", vocab_size=256, max_seq_len=128)
    model = LlamaForCausalLM(config, seed=0)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from frugal_kernels.ops import linear_cross_entropy

__all__ = [
    "PRESETS",
    "LlamaConfig",
    "CausalLMOutput",
    "RMSNorm",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "flops_per_token",
]


@dataclass
class LlamaConfig:
    """Shape of a :class:`LlamaForCausalLM`.

    ``intermediate_size`` is the width of the SwiGLU feed-forward block; ``max_seq_len`` bounds
    the positions the rotary embedding is precomputed for. The head is untied from the token
    embedding unless ``tie_embeddings`` is set.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_preset(
        cls, name: str, vocab_size: Optional[int] = None, max_seq_len: Optional[int] = None
    ) -> "LlamaConfig":
        """The preset ``name`` from :data:`PRESETS`, with its vocabulary and context overridden."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        overrides = {}
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        if max_seq_len is not None:
            overrides["max_seq_len"] = max_seq_len
        return dataclasses.replace(PRESETS[name], **overrides)

    def layer_params(self) -> int:
        """Parameters of one decoder layer: 4 attention and 3 MLP matrices and 2 RMSNorm weights."""
        h, ffn = self.hidden_size, self.intermediate_size
        return 4 * h * h + 3 * h * ffn + 2 * h

    def num_params(self, embeddings: bool = True) -> int:
        """Number of parameters of the model; ``embeddings=False`` leaves out the token embedding.

        The output head is counted as a non-embedding parameter when it is untied: it is a
        matmul every token pays for, while the embedding is only a lookup.
        """
        h, vocab = self.hidden_size, self.vocab_size
        body = self.num_layers * self.layer_params() + h
        head = 0 if self.tie_embeddings else vocab * h
        return body + head + (vocab * h if embeddings else 0)


# Byte-level presets default to the 256 byte values; the LLaMA shapes keep the paper's
# 32000-token vocabulary so that "130m" really has LLaMA-130M's 134,105,856 parameters.
# The 20m/60m/130m shapes are those used by GaLore and FRUGAL.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2,
                        num_heads=4, max_seq_len=256),
    "small": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=4,
                         num_heads=4, max_seq_len=256),
    "20m": LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_layers=4,
                       num_heads=4, max_seq_len=1024),
    "60m": LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_layers=8,
                       num_heads=8, max_seq_len=1024),
    "130m": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                        num_heads=12, max_seq_len=1024),
}


@dataclass
class CausalLMOutput:
    """What :meth:`LlamaForCausalLM.forward` returns.

    ``logits`` has shape ``[batch, seq_len, vocab_size]`` (None when the model's loss is
    fused, ``frugal_kernels.nn.patch_causal_lm``, and labels were given); ``loss`` is the
    mean next-token cross-entropy when labels were given, else ``None``.
    """

    logits: Optional[torch.Tensor]
    loss: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, as in LLaMA (no mean subtraction, no bias)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in at least float32: in bf16 it loses most of its mantissa.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[i], x[i + head_dim / 2])`` by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin of rotary position embeddings (the half-split layout of HF Llama)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta

    def forward(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        # Recomputed at every call, in at least float32, rather than cached in buffers that
        # model.to(torch.bfloat16) would round: the angles reach max_seq_len radians.
        compute_dtype = torch.promote_types(dtype, torch.float32)
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=compute_dtype)
        inv_freq = self.theta ** (-exponents / self.head_dim)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=compute_dtype), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, hidden = x.shape
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, hidden))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack without the output head: token ids to final hidden states."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """LLaMA decoder with a language-modelling head.

    Args:
        config: the model shape.
        seed: seed of :meth:`init_weights`; the same seed gives the same weights on any device.
    """

    #: Options of ``ops.linear_cross_entropy`` when the head and the loss are fused
    #: (``frugal_kernels.nn.patch_causal_lm`` sets them); None: logits, then F.cross_entropy.
    fused_loss: Optional[dict] = None

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) for every matrix (LLaMA's ``initializer_range``), ones for norms.

        Values are drawn on the CPU from a private generator, in parameter order, and then
        copied: the weights do not depend on the device, the dtype or the global RNG.
        """
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if param.is_meta:
                continue  # a meta tensor has no storage to fill
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                param.copy_(values.normal_(0.0, 0.02, generator=generator))

    def forward(
        self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> CausalLMOutput:
        """Logits for ``input_ids`` (``[batch, seq_len]``) and, given ``labels``, the loss.

        ``labels`` is aligned with ``input_ids`` (usually the same tensor), as in Hugging Face:
        the shift is done here, so position ``t`` is scored on ``labels[:, t + 1]``. Labels
        equal to -100 are ignored. The loss is the mean over the ``seq_len - 1`` scored
        positions of every sequence. With a fused loss (``fused_loss``) and labels, the
        logits are never formed and the output's ``logits`` is None.
        """
        if labels is not None and self.fused_loss is not None:
            hidden = self.model(input_ids)
            loss, _ = linear_cross_entropy(hidden[:, :-1], self.lm_head.weight, labels[:, 1:],
                                           bias=self.lm_head.bias, ignore_index=-100,
                                           **self.fused_loss)
            return CausalLMOutput(logits=None, loss=loss)
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            # log-softmax over the vocabulary in at least float32, as bf16 logits would round it
            scored = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(
                scored.flatten(0, 1),
                labels[:, 1:].flatten(),
                ignore_index=-100,
            )
        return CausalLMOutput(logits=logits, loss=loss)


def flops_per_token(config: LlamaConfig, seq_len: Optional[int] = None) -> int:
    """Training FLOPs per token (forward and backward), the estimate of PaLM (Chowdhery et al.).

    ``6 * N + 12 * num_layers * hidden_size * seq_len``, where

    * ``N`` is the number of parameters in matrices a token is multiplied by: the attention and
      MLP matrices and the output head (the embedding is a lookup and costs nothing). Each
      multiply-add is 2 FLOPs forward and 4 backward, hence ``6 * N``.
    * the second term is attention: ``Q K^T`` and ``attn @ V`` each cost ``2 * seq_len *
      hidden_size`` FLOPs per token and layer forward, and twice that backward. The full
      ``seq_len`` is counted, as PaLM does, although the causal mask hides half of the scores.

    ``seq_len`` defaults to ``config.max_seq_len``. Norms, activations and softmax are left out.
    """
    seq_len = config.max_seq_len if seq_len is None else seq_len
    h = config.hidden_size
    layer_matrices = 4 * h * h + 3 * h * config.intermediate_size
    # A tied head is the embedding table, but it is multiplied all the same.
    matmul_params = config.num_layers * layer_matrices + config.vocab_size * h
    return 6 * matmul_params + 12 * config.num_layers * h * seq_len
