"""nn.LinearCrossEntropy and patch_causal_lm: the fused head and loss give the loss and the
gradients of every parameter of the unfused model (ours and a Hugging Face Llama)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from frugal_kernels.model import LlamaConfig, LlamaForCausalLM
from frugal_kernels.nn import LinearCrossEntropy, patch_causal_lm

from ..ops.helpers import rel_diff


def test_module_equals_linear_then_cross_entropy():
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 30, bias=True)
    fused = LinearCrossEntropy.from_linear(linear, label_smoothing=0.1, scores=("el2n",))
    assert fused.weight is linear.weight and fused.bias is linear.bias
    hidden = torch.randn(2, 7, 12)
    targets = torch.randint(0, 30, (2, 7))
    targets[0, :3] = -100
    loss, scores = fused(hidden, targets)
    assert scores["el2n"].shape == (2, 7)
    loss.backward()
    grads = [linear.weight.grad.clone(), linear.bias.grad.clone()]
    linear.zero_grad()
    ref = F.cross_entropy(linear(hidden).flatten(0, 1), targets.flatten(), label_smoothing=0.1)
    ref.backward()
    assert rel_diff(loss.detach(), ref.detach()) <= 1e-6
    for g, p in zip(grads, (linear.weight, linear.bias)):
        assert rel_diff(g, p.grad) <= 1e-5


def test_a_new_module_is_initialised_as_nn_linear():
    fused = LinearCrossEntropy(16, 40, bias=True)
    bound = 1 / 16 ** 0.5
    assert fused.weight.abs().max() <= bound and fused.bias.abs().max() <= bound
    assert fused.weight.std() > bound / 4
    assert "out_features=40" in repr(fused)


def _loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad()
    out = model(ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.grad is not None}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_patch_gives_our_llama_the_same_loss_and_gradients(tie):
    config = dataclasses.replace(LlamaConfig.from_preset("tiny", max_seq_len=16),
                                 tie_embeddings=tie)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 5:] = -100
    _, ref_loss, ref_grads = _loss_and_grads(model, ids, labels)
    assert patch_causal_lm(model) is model
    out, loss, grads = _loss_and_grads(model, ids, labels)
    assert out.logits is None
    assert rel_diff(loss, ref_loss) <= 1e-6
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_diff(g, ref_grads[name]) <= 1e-4, name
    assert model(ids).logits.shape == (3, 16, config.vocab_size)  # no labels: as before
    model.fused_loss = None
    assert model(ids, labels=labels).logits is not None


def test_patch_refuses_a_model_it_does_not_know():
    with pytest.raises(TypeError, match="neither frugal_kernels' LlamaForCausalLM"):
        patch_causal_lm(torch.nn.Linear(3, 4))


def test_patch_gives_a_hugging_face_llama_the_same_loss_and_gradients():
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra is not installed (pip install '.[hf]')")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    cases = [dict(attention_mask=mask), dict(attention_mask=mask, num_items_in_batch=15)]
    refs = [_loss_and_grads(model, ids, labels, **kw)[1:] for kw in cases]
    patch_causal_lm(model)
    for kw, (ref_loss, ref_grads) in zip(cases, refs):
        out, loss, grads = _loss_and_grads(model, ids, labels, **kw)
        assert out.logits is None
        assert rel_diff(loss, ref_loss) <= 1e-6, kw
        for name, g in grads.items():
            assert rel_diff(g, ref_grads[name]) <= 1e-4, name
    assert model(ids).logits.shape == (2, 12, 97)
    del model.forward
    assert model(ids, labels=labels).logits is not None
