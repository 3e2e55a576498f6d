"""Online data selection in the training loop (TrainConfig.select, frugal_kernels.data)."""

import copy
import dataclasses
import json

import pytest
import torch

from frugal_kernels.data import sequence_scores
from frugal_kernels.lab import train as train_module
from frugal_kernels.lab.corpus import load_corpus
from frugal_kernels.lab.train import TrainConfig, train
from frugal_kernels.model import LlamaForCausalLM

TINY = TrainConfig(model="tiny", steps=8, batch_size=2, seq_len=16, warmup_steps=1,
                   eval_every=4, eval_batches=1, max_bytes=200_000, select="loss",
                   keep=0.5, candidates=2)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=TINY.max_bytes)


def adamw(model, config):
    return torch.optim.AdamW(model.parameters(), lr=config.lr)


def test_a_selected_step_trains_on_the_best_scored_candidates(corpus):
    config = dataclasses.replace(TINY, steps=1)
    model = LlamaForCausalLM(config.model_config(corpus.vocab_size), seed=config.seed)
    pool = list(corpus.batches("train", 2, 16, seed=config.seed, num_batches=2))
    ids = torch.cat([b for b, _ in pool])
    best = sequence_scores(model, ids).topk(2).indices.sort().values
    expected = LlamaForCausalLM(config.model_config(corpus.vocab_size), seed=config.seed)
    opt = adamw(expected, config)
    opt.param_groups[0]["lr"] *= train_module.lr_factor(0, 1, 1, config.min_lr_ratio, "wsd")
    expected(ids[best], labels=ids[best]).loss.backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), config.grad_clip)
    opt.step()
    train(config, adamw, model=model, data=corpus, progress=False)
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scoring_is_counted_in_the_flops(corpus):
    plain = train(dataclasses.replace(TINY, select=None), adamw, data=corpus, progress=False)
    selected = train(TINY, adamw, data=corpus, progress=False)
    scoring = TINY.steps * 2 * TINY.tokens_per_step() * plain.flops_per_token / 3
    assert selected.flops == pytest.approx(plain.flops + scoring)
    assert all(s["selected"] for s in selected.steps)


def test_a_resumed_selected_run_equals_the_uninterrupted_one(corpus):
    states = []
    whole = train(TINY, adamw, data=corpus, progress=False, checkpoint=lambda state: states.append(copy.deepcopy(state)))
    model = LlamaForCausalLM(TINY.model_config(corpus.vocab_size), seed=1)
    resumed = train(TINY, adamw, model=model, data=corpus, progress=False, resume=states[0])
    assert [s["train_loss"] for s in resumed.steps] == [s["train_loss"] for s in whole.steps]
    assert resumed.final_val_loss == whole.final_val_loss


def test_rho_trains_a_reference_and_counts_its_flops(corpus):
    config = dataclasses.replace(TINY, steps=2, select="rho", select_reference_steps=3)
    plain = train(dataclasses.replace(config, select="loss"), adamw, data=corpus,
                  progress=False)
    rho = train(config, adamw, data=corpus, progress=False)
    # the reference's 3 training steps and its forward on every scored token
    assert rho.flops > plain.flops + 3 * config.tokens_per_step() * 0.9 * \
        train_module.flops_per_token(train_module.LlamaConfig.from_preset(
            "tiny", vocab_size=256, max_seq_len=16), 16)


def test_the_governor_turns_selection_on_and_off(corpus, monkeypatch):
    losses = iter([5.0 - 0.1 * i for i in range(100)])
    monkeypatch.setattr(train_module, "_evaluate", lambda model, batches: next(losses))
    config = dataclasses.replace(TINY, steps=14, eval_every=1, flop_budget=1e15,
                                 governor={"select_trial": 2, "window": 2})
    result = train(config, adamw, data=corpus, progress=False)
    selects = [d for d in result.decisions if d["action"] == "select"]
    assert selects, result.decisions
    mode = False
    for record in result.steps:
        assert record["selected"] == mode
        decision = next(d for d in result.decisions if d["step"] == record["step"])
        if decision["action"] == "select":
            mode = bool(decision["suggestion"]["select"])


@pytest.mark.parametrize("kwargs, match", [
    ({"select": "best"}, "select must be one of"), ({"keep": 0.0}, "keep"),
    ({"candidates": 0}, "candidates"), ({"data_noise": 1.0}, "data_noise"),
    ({"select": None, "governor": {"select_trial": 2}}, "give select"),
    ({"parallel": "ddp"}, "one-process")])
def test_bad_selection_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **kwargs)


def test_data_noise_reaches_the_corpus(monkeypatch, corpus):
    seen = {}

    def fake_load(source, **kwargs):
        seen.update(kwargs)
        return corpus

    monkeypatch.setattr(train_module, "load_corpus", fake_load)
    train(dataclasses.replace(TINY, steps=1, data_noise=0.3), adamw, progress=False)
    assert seen["noise"] == 0.3


CLI_ARGS = ["--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--eval-every", "1", "--eval-batches", "1", "--max-bytes", "200000",
            "--device", "cpu", "--quiet"]


def test_the_train_command_selects_on_a_noised_corpus(tmp_path, capsys):
    from frugal_kernels.__main__ import main

    out = tmp_path / "run"
    assert main(["train", "--optimizer", "adamw", "--select", "el2n", "--keep", "0.25",
                 "--candidates", "4", "--data-noise", "0.2", "--out", str(out),
                 *CLI_ARGS]) == 0
    saved = json.loads((out / "metrics.json").read_text())
    assert (saved["config"]["select"], saved["config"]["data_noise"]) == ("el2n", 0.2)
    assert all(s["selected"] for s in saved["runs"]["adamw"]["steps"])
    assert "selecting by el2n" in capsys.readouterr().out


def test_the_governed_selection_option_needs_select_and_a_budget(capsys):
    from frugal_kernels.__main__ import main

    assert main(["train", "--optimizer", "adamw", "--governor-select-trial", "3",
                 *CLI_ARGS]) == 2
    assert "needs --select and --flop-budget" in capsys.readouterr().err


def test_the_demo_selects_in_its_select_rows_only(tmp_path):
    from frugal_kernels.__main__ import main

    out = tmp_path / "demo"
    assert main(["demo", "--optimizers", "adamw", "adamw+select", "--select", "el2n",
                 "--out", str(out), *CLI_ARGS]) == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    assert not any("selected" in s for s in runs["adamw"]["steps"])
    assert all(s["selected"] for s in runs["adamw+select"]["steps"])
    assert runs["adamw+select"]["config"]["select"] == "el2n"
    assert "+select" in (out / "table.md").read_text()


def test_a_select_row_of_the_train_command_selects_by_loss(tmp_path):
    from frugal_kernels.__main__ import main

    out = tmp_path / "train"
    assert main(["train", "--optimizer", "frugal+select", "--out", str(out), *CLI_ARGS]) == 0
    run = json.loads((out / "metrics.json").read_text())["runs"]["frugal+select"]
    assert run["config"]["select"] == "loss" and all(s["selected"] for s in run["steps"])
