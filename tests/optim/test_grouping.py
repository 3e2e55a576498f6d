"""param_groups: the paper's split for several naming schemes."""

import warnings

import pytest
import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _split(model, **kw):
    groups = fk.param_groups(model, **kw)
    regular = next(g for g in groups if not g["projected"])
    projected = next(g for g in groups if g["projected"])
    return _names(model, regular), _names(model, projected), projected


def test_our_llama_follows_the_paper():
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    regular, projected, group = _split(model, density=0.3)
    assert group["density"] == 0.3
    assert len(projected) == 2 * 7
    assert all(any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj")) for n in projected)
    assert "model.embed_tokens.weight" in regular and "lm_head.weight" in regular
    assert all("norm" not in n for n in projected)
    assert regular | projected == {n for n, _ in model.named_parameters()}


class Conv1D(nn.Module):
    """GPT-2's transposed linear layer: a 2-D weight that is not an nn.Linear."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


def _gpt2_like():
    block = nn.Module()
    block.ln_1 = nn.LayerNorm(8)
    block.attn = nn.Module()
    block.attn.c_attn, block.attn.c_proj = Conv1D(8, 24), Conv1D(8, 8)
    block.mlp = nn.Module()
    block.mlp.c_fc, block.mlp.c_proj = Conv1D(8, 32), Conv1D(32, 8)
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.wte, model.transformer.wpe = nn.Embedding(50, 8), nn.Embedding(16, 8)
    model.transformer.h = nn.ModuleList([block])
    model.lm_head = nn.Linear(8, 50, bias=False)
    return model


def test_gpt2_naming():
    regular, projected, _ = _split(_gpt2_like())
    assert projected == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                         "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}
    assert "transformer.h.0.attn.c_attn.bias" in regular
    assert "transformer.wte.weight" in regular and "lm_head.weight" in regular


def _bert_like():
    layer = nn.Module()
    layer.attention = nn.Module()
    layer.attention.self = nn.Module()
    for n in ("query", "key", "value"):
        setattr(layer.attention.self, n, nn.Linear(8, 8))
    layer.attention.output = nn.Module()
    layer.attention.output.dense = nn.Linear(8, 8)
    layer.attention.output.LayerNorm = nn.LayerNorm(8)
    layer.intermediate = nn.Module()
    layer.intermediate.dense = nn.Linear(8, 32)
    layer.output = nn.Module()
    layer.output.dense = nn.Linear(32, 8)
    model = nn.Module()
    model.embeddings = nn.Module()
    model.embeddings.word_embeddings = nn.Embedding(30, 8)
    model.encoder = nn.Module()
    model.encoder.layer = nn.ModuleList([layer])
    model.classifier = nn.Linear(8, 2)
    return model


def test_bert_naming():
    regular, projected, _ = _split(_bert_like())
    prefix = "encoder.layer.0."
    assert projected == {prefix + n for n in (
        "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
        "attention.output.dense.weight", "intermediate.dense.weight", "output.dense.weight")}
    assert "classifier.weight" in regular
    assert prefix + "attention.output.LayerNorm.weight" in regular


def test_options_project_more_and_match_other_names():
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    _, projected, _ = _split(model, project_embeddings=True, project_head=True)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= projected
    custom = nn.Sequential()
    custom.add_module("mixer", nn.Linear(4, 4))
    custom.add_module("out", nn.Linear(4, 4))
    _, projected, _ = _split(custom, extra_patterns=["mixer"])
    assert projected == {"mixer.weight"}


def test_frozen_parameters_are_left_out():
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    model.model.embed_tokens.weight.requires_grad_(False)
    groups = fk.param_groups(model)
    ids = {id(p) for g in groups for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in ids


def test_unknown_names_warn_once_naming_the_matrices_and_the_fix():
    # A plain MLP: no module name is a known pattern, so nothing would be projected and
    # FRUGAL would silently hold AdamW's state.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(UserWarning) as caught:
        groups = fk.param_groups(mlp)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "projected nothing" in message and "0.weight, 2.weight" in message
    assert "extra_patterns" in message
    assert [g["projected"] for g in groups] == [False]
    # The fix it names works, and then it is silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = fk.param_groups(mlp, extra_patterns=["0", "2"])
    assert _names(mlp, next(g for g in groups if g["projected"])) == {"0.weight", "2.weight"}


def test_no_warning_where_nothing_could_be_projected():
    # Only an embedding, a norm and biases: nothing to project, nothing to warn about.
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "norm": nn.LayerNorm(4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fk.param_groups(model)
        fk.param_groups(LlamaForCausalLM(LlamaConfig.from_preset("tiny")))
