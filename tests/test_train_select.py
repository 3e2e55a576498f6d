"""Online data selection in the training loop (TrainConfig.select, frugal_kernels.data)."""

import copy
import dataclasses
import json

import pytest
import torch

from frugal_kernels.data import OnlineSelector, sequence_scores
from frugal_kernels.lab import train as train_module
from frugal_kernels.lab.corpus import load_corpus
from frugal_kernels.lab.train import TrainConfig, equal_flops_steps, train
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


def test_a_select_row_of_the_train_command_selects_by_its_own_policy(tmp_path, capsys):
    from frugal_kernels.__main__ import main
    from frugal_kernels.lab.registry import ROW_SELECTION

    out = tmp_path / "train"
    assert main(["train", "--optimizer", "frugal+select", "--out", str(out), *CLI_ARGS]) == 0
    run = json.loads((out / "metrics.json").read_text())["runs"]["frugal+select"]
    assert {k: run["config"][k] for k in ROW_SELECTION} == ROW_SELECTION
    assert all(s["selected"] for s in run["steps"])
    # a keep without a policy would be silently replaced by the row's: refused
    assert main(["train", "--optimizer", "frugal+select", "--keep", "0.5", "--out",
                 str(tmp_path / "t2"), *CLI_ARGS]) == 2
    assert "give --select too" in capsys.readouterr().err


@pytest.fixture(scope="module")
def noisy():
    return load_corpus(max_bytes=TINY.max_bytes, noise=0.4)


@pytest.mark.parametrize("policy", ["ngram", "random", "middle"])
def test_a_resumed_run_of_each_new_policy_equals_the_uninterrupted_one(noisy, policy):
    config = dataclasses.replace(TINY, select=policy, select_reference_steps=2)
    states = []
    whole = train(config, adamw, data=noisy, progress=False,
                  checkpoint=lambda state: states.append(copy.deepcopy(state)))
    model = LlamaForCausalLM(config.model_config(noisy.vocab_size), seed=1)
    resumed = train(config, adamw, model=model, data=noisy, progress=False, resume=states[0])
    assert resumed.steps == whole.steps[:4] + resumed.steps[4:]
    assert [s["train_loss"] for s in resumed.steps] == [s["train_loss"] for s in whole.steps]
    assert [s["kept_shuffled"] for s in resumed.steps] == \
        [s["kept_shuffled"] for s in whole.steps]
    assert resumed.final_val_loss == whole.final_val_loss


def test_the_noise_kept_and_offered_is_counted_per_step(noisy):
    """A random selection redrawn by hand from the same batches and generator: the counts of
    each step are those of the windows' labels."""
    config = dataclasses.replace(TINY, select="random", batch_size=4, keep=0.5, candidates=3)
    result = train(config, adamw, data=noisy, progress=False)
    batches = noisy.batches("train", 4, 16, seed=config.seed, with_noise=True)
    selector = OnlineSelector("random", keep=0.5, candidates=3, seed=config.seed)
    totals = {"offered": 0, "kept": 0, "offered_shuffled": 0, "kept_shuffled": 0}
    for record in result.steps:
        offered = torch.cat([next(batches)[2] for _ in range(3)])
        kept = offered[selector.choose(torch.zeros(12))]
        for kind, code in (("shuffled", 1), ("duplicate", 2)):
            assert record[f"offered_{kind}"] == int((offered == code).sum())
            assert record[f"kept_{kind}"] == int((kept == code).sum())
        assert (record["offered"], record["kept"]) == (12, 6)
        for key in totals:
            totals[key] += record[key]
    assert totals["offered_shuffled"] > 0
    noise = result.summary()["noise"]
    assert noise["kept_shuffled"] == totals["kept_shuffled"] / totals["kept"]
    assert noise["offered_shuffled"] == totals["offered_shuffled"] / totals["offered"]
    assert train(dataclasses.replace(config, steps=1), adamw, data=load_corpus(
        max_bytes=TINY.max_bytes), progress=False).summary()["noise"] is None


def test_ngram_keeps_less_shuffled_noise_than_offered(noisy):
    config = dataclasses.replace(TINY, select="ngram", steps=12, batch_size=8, keep=0.5,
                                 candidates=2, select_reference_steps=200)
    noise = train(config, adamw, data=noisy, progress=False).summary()["noise"]
    assert noise["kept_shuffled"] < noise["offered_shuffled"] / 2, noise


@pytest.mark.parametrize("select, keep, candidates, more_steps", [
    ("loss", 0.5, 2, False), ("ngram", 0.5, 1, True), ("random", 0.5, 3, False),
    ("rho", 0.5, 2, False), ("middle", 0.25, 4, False)])
def test_the_equal_flops_steps_spend_the_twins_flops(corpus, select, keep, candidates,
                                                     more_steps):
    """The selecting run of that many steps spends no more than its twin, and one step more
    would spend more."""
    twin_config = dataclasses.replace(TINY, select=None, steps=6)
    twin = train(twin_config, adamw, data=corpus, progress=False)
    config = dataclasses.replace(TINY, select=select, keep=keep, candidates=candidates,
                                 select_reference_steps=1)
    steps = equal_flops_steps(config, twin.flops, twin.steps_done, corpus.vocab_size)
    once, per_step = train_module.selection_flops(config, corpus.vocab_size)
    run = train(config.with_steps(steps), adamw, data=corpus, progress=False)
    assert run.steps_done == steps
    assert run.steps[0]["flops"] - (run.steps[1]["flops"] - run.steps[0]["flops"]) == \
        pytest.approx(once)
    step_cost = (run.flops - once) / steps
    assert run.flops <= twin.flops * (1 + 1e-12) < run.flops + step_cost
    # more steps where a step trains on fewer sequences and scores nearly free
    assert (steps > twin.steps_done) if more_steps else (steps < twin.steps_done)


@pytest.mark.parametrize("equal_steps", [False, True])
def test_the_demo_gives_a_select_row_its_twins_flops(tmp_path, equal_steps):
    from frugal_kernels.__main__ import main

    out = tmp_path / "demo"
    # adamw+select alone brings its twin
    assert main(["demo", "--optimizers", "adamw+select", "--select", "ngram", "--keep", "0.5",
                 "--candidates", "1", "--data-noise", "0.3", "--out", str(out), *CLI_ARGS,
                 "--steps", "4", *(["--select-at-equal-steps"] if equal_steps else [])]) == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    assert list(runs) == ["adamw", "adamw+select"]
    twin, selected = runs["adamw"]["summary"], runs["adamw+select"]["summary"]
    if equal_steps:
        assert selected["steps"] == twin["steps"] == 4
    else:
        config = TrainConfig(**{**runs["adamw+select"]["config"], "steps": 4})
        assert selected["steps"] == equal_flops_steps(config, twin["flops"], 4, 256) > 4
        assert selected["flops"] <= twin["flops"]
    text = (out / "table.md").read_text()
    assert f"{selected['steps']} steps for" in text and "of those kept" in text
