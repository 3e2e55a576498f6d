import math

import pytest
import torch
from torch.func import functional_call

from frugal_kernels.model import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    flops_per_token,
)


def micro_config(**overrides):
    fields = dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2,
                  max_seq_len=16)
    fields.update(overrides)
    return LlamaConfig(**fields)


def test_output_shapes():
    config = LlamaConfig.from_preset("tiny", vocab_size=259, max_seq_len=32)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 259, (3, 17))
    out = model(ids)
    assert out.logits.shape == (3, 17, 259)
    assert out.loss is None
    out = model(ids, labels=ids)
    assert out.loss.shape == ()


def test_loss_at_init_is_about_log_vocab():
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    model = LlamaForCausalLM(config, seed=1)
    ids = torch.randint(0, config.vocab_size, (4, 64))
    loss = model(ids, labels=ids).loss.item()
    assert abs(loss - math.log(config.vocab_size)) < 0.05


def test_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    model = LlamaForCausalLM(micro_config(), seed=0)
    ids = torch.randint(0, 11, (2, 6))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(ids, labels=labels)
    log_probs = out.logits.log_softmax(-1)
    terms = [-log_probs[b, t, labels[b, t + 1]]
             for b in range(2) for t in range(5) if labels[b, t + 1] != -100]
    torch.testing.assert_close(out.loss, torch.stack(terms).mean())


def test_gradcheck_float64():
    torch.manual_seed(0)
    model = LlamaForCausalLM(micro_config(), seed=0).double()
    names, params = zip(*model.named_parameters())
    ids = torch.randint(0, 11, (2, 4))

    def loss_fn(*values):
        return functional_call(model, dict(zip(names, values)), (ids,), {"labels": ids}).loss

    inputs = tuple(p.detach().clone().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(loss_fn, inputs)


def test_causality():
    torch.manual_seed(0)
    model = LlamaForCausalLM(PRESETS["tiny"], seed=0)
    ids = torch.randint(0, 256, (2, 24))
    changed = ids.clone()
    changed[:, 15:] = (changed[:, 15:] + 7) % 256
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(before[:, :15], after[:, :15], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 15:], after[:, 15:])


def reference_attention(attention, x, theta):
    """Causal softmax attention written out, with rotary embeddings as complex rotations."""
    batch, seq_len, hidden = x.shape
    heads, dim = attention.num_heads, attention.head_dim
    q, k, v = (proj(x).view(batch, seq_len, heads, dim)
               for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]

    def rotate(t):
        z = torch.complex(t[..., : dim // 2], t[..., dim // 2:]) * rotation
        return torch.cat((z.real, z.imag), dim=-1)

    scores = torch.einsum("bthd,bshd->bhts", rotate(q), rotate(k)) / math.sqrt(dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, -math.inf).softmax(-1)
    out = torch.einsum("bhts,bshd->bthd", weights, v)
    return attention.o_proj(out.reshape(batch, seq_len, hidden))


def test_attention_matches_reference():
    config = micro_config(hidden_size=16, num_heads=2, rope_theta=100.0)
    model = LlamaForCausalLM(config, seed=3).double()
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(9, x.device, torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attention(x, cos, sin), reference_attention(attention, x, 100.0))


def test_position_matters():
    # Without rotary embeddings attention is permutation-invariant over the prefix.
    model = LlamaForCausalLM(PRESETS["tiny"], seed=0)
    ids = torch.tensor([[1, 2, 3, 4]])
    swapped = torch.tensor([[2, 1, 3, 4]])
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[:, -1], model(swapped).logits[:, -1])


def test_init_is_deterministic_from_seed():
    torch.manual_seed(123)
    a = LlamaForCausalLM(PRESETS["tiny"], seed=7)
    torch.manual_seed(456)
    b = LlamaForCausalLM(PRESETS["tiny"], seed=7)
    c = LlamaForCausalLM(PRESETS["tiny"], seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    weight = a.model.layers[0].self_attn.q_proj.weight
    assert abs(weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.model.norm.weight, torch.ones(64))


def test_130m_parameter_count():
    config = LlamaConfig.from_preset("130m")
    h, ffn, layers, vocab = 768, 2048, 12, 32000
    assert (config.hidden_size, config.intermediate_size, config.num_layers,
            config.num_heads, config.vocab_size) == (h, ffn, layers, 12, vocab)
    expected = vocab * h + layers * (4 * h * h + 3 * h * ffn + 2 * h) + h + h * vocab
    assert expected == 134_105_856
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert config.num_params() == expected
    assert config.num_params(embeddings=False) == expected - vocab * h


def test_hf_llama_parameter_names():
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    expected = ["model.embed_tokens.weight"]
    for i in range(2):
        expected += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        expected += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        expected += [f"model.layers.{i}.input_layernorm.weight",
                     f"model.layers.{i}.post_attention_layernorm.weight"]
    expected += ["model.norm.weight", "lm_head.weight"]
    assert sorted(name for name, _ in model.named_parameters()) == sorted(expected)
    assert list(model.state_dict()) == [name for name, _ in model.named_parameters()]
    assert all(isinstance(model.get_submodule(n.rsplit(".", 1)[0]), torch.nn.Linear)
               for n in expected if "proj" in n or n.startswith("lm_head"))


def test_tied_embeddings_share_the_matrix():
    model = LlamaForCausalLM(micro_config(tie_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


def test_presets_grow_and_train_on_bytes():
    sizes = [PRESETS[name].num_params(embeddings=False)
             for name in ("tiny", "small", "20m", "60m", "130m")]
    assert sizes == sorted(sizes)
    assert PRESETS["tiny"].vocab_size == 256
    assert not PRESETS["130m"].tie_embeddings
    with pytest.raises(KeyError, match="unknown preset"):
        LlamaConfig.from_preset("7b")


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        micro_config(num_heads=3)
    with pytest.raises(ValueError, match="max_seq_len"):
        LlamaForCausalLM(micro_config(max_seq_len=4))(torch.zeros(1, 5, dtype=torch.long))


def test_flops_per_token():
    config = LlamaConfig.from_preset("130m")
    h, ffn, layers, vocab, seq = 768, 2048, 12, 32000, 256
    matmul_params = layers * (4 * h * h + 3 * h * ffn) + vocab * h
    assert flops_per_token(config, seq) == 6 * matmul_params + 12 * layers * h * seq
    assert flops_per_token(config) == flops_per_token(config, config.max_seq_len)
    tied = LlamaConfig.from_preset("130m", vocab_size=32000)
    tied.tie_embeddings = True
    assert flops_per_token(tied, seq) == flops_per_token(config, seq)
