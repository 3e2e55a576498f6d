"""frugal-kernels sweep, the tuned.json it writes, and the demo that reads it."""

import csv
import dataclasses
import json
import math

import pytest

from frugal_kernels.lab import demo, finetune, report, sweep, tuned
from frugal_kernels.__main__ import main
from frugal_kernels.lab.train import TrainConfig

MAX_BYTES = 200_000
TINY_ARGS = ["--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
             "--eval-every", "2", "--eval-batches", "1", "--max-bytes", str(MAX_BYTES),
             "--device", "cpu", "--quiet"]


def _record(name, lr, seed, loss, ratio=0.5):
    return {"optimizer": name, "label": name.upper(), "lr": lr, "matrix_lr_ratio": ratio,
            "seed": seed, "final_val_loss": loss}


def test_best_setting_is_the_lowest_mean_over_seeds_and_skips_divergence():
    runs = [_record("a", 1e-3, 0, 2.0), _record("a", 1e-3, 1, 2.2),   # mean 2.1
            _record("a", 3e-3, 0, 1.9), _record("a", 3e-3, 1, 2.4),   # mean 2.15
            _record("a", 1e-2, 0, 1.0), _record("a", 1e-2, 1, float("nan")),
            _record("b", 1e-2, 0, float("inf")), _record("b", 1e-2, 1, 3.0)]
    best = sweep.best_settings(runs)
    assert list(best) == ["a"]
    assert best["a"]["lr"] == 1e-3 and best["a"]["matrix_lr_ratio"] == 0.5
    assert best["a"]["val_loss"] == pytest.approx(2.1)
    assert best["a"]["spread"] == pytest.approx(0.2) and best["a"]["seeds"] == 2


def test_sweep_command_writes_tables_and_tuned_lrs_the_demo_reads(tmp_path, monkeypatch,
                                                                   capsys):
    path = tmp_path / "tuned.json"
    assert main(["sweep", "--optimizers", "adamw", "frugal", "--lrs", "1e-3", "1e-2",
                 "--matrix-lr-ratio", "0.5", "--seeds", "0", "1", "--out", str(tmp_path / "s"),
                 "--write-tuned", str(path), *TINY_ARGS]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert len(saved["runs"]) == 2 * 2 * 2
    assert (tmp_path / "s" / "sweep.md").read_text() == sweep.table(saved) + "\n"
    assert sweep.table(saved) in printed
    with open(tmp_path / "s" / "sweep.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:5] == ["optimizer", "lr", "matrix_lr_ratio", "seed", "final_val_loss"]
    assert len(rows) == 1 + 8
    for name in ("adamw", "frugal"):
        losses = {(r["lr"], r["seed"]): r["final_val_loss"] for r in saved["runs"]
                  if r["optimizer"] == name}
        best = saved["best"][name]
        mean = {lr: (losses[lr, 0] + losses[lr, 1]) / 2 for lr in (1e-3, 1e-2)}
        assert best["lr"] == min(mean, key=mean.get)
        assert best["spread"] == pytest.approx(abs(losses[best["lr"], 0] - losses[best["lr"], 1]))

    recorded = tuned.load(path)["tasks"]["pretrain"]["tiny"]
    assert recorded["optimizers"] == saved["best"]
    assert recorded["settings"]["seeds"] == [0, 1]
    assert recorded["settings"]["config"]["steps"] == 4

    # The demo reads the recorded lrs per optimizer; --lr overrides them for every one.
    monkeypatch.setattr(tuned, "PATH", path)
    out = tmp_path / "d"
    assert main(["demo", "--optimizers", "adamw", "frugal", "badam", "--out", str(out),
                 *TINY_ARGS]) == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    for name in ("adamw", "frugal"):
        assert runs[name]["config"]["lr"] == saved["best"][name]["lr"]
        assert runs[name]["config"]["matrix_lr_ratio"] == 0.5
        assert runs[name]["tuned"]["spread"] == saved["best"][name]["spread"]
    assert runs["badam"]["tuned"] is None  # not swept: the config's lr
    assert runs["badam"]["config"]["lr"] == demo.DEFAULTS.lr
    printed = capsys.readouterr().out
    assert "the seed-to-seed spread" in printed and "FRUGAL rho=0.25 (" in printed
    assert "settings differ" not in printed

    assert main(["demo", "--optimizers", "adamw", "frugal", "--lr", "2e-3",
                 "--out", str(out), "--overwrite", *TINY_ARGS]) == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    assert {run["config"]["lr"] for run in runs.values()} == {2e-3}
    assert {run["config"]["matrix_lr_ratio"] for run in runs.values()} == {1.0}
    assert "beyond the seed-to-seed spread" not in capsys.readouterr().out


def test_sweep_refuses_a_governed_run(tmp_path):
    with pytest.raises(ValueError, match="governed run; sweep 'adafrugal'"):
        sweep.run_sweep(TrainConfig(model="tiny"), ["adafrugal+governor"], [1e-3], [1.0], [0],
                        out=tmp_path)


def test_tuned_update_merges_same_settings_and_replaces_others(tmp_path):
    path = tmp_path / "tuned.json"
    config = dataclasses.asdict(TrainConfig(model="tiny"))
    entry = {"lr": 1e-3, "matrix_lr_ratio": 1.0, "val_loss": 2.0, "spread": 0.1, "seeds": 2}
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1]}, {"a": entry})
    tuned.update(path, "tiny", {"config": {**config, "lr": 5.0}, "seeds": [0, 1]},
                 {"b": entry})
    assert set(tuned.load(path)["tasks"]["pretrain"]["tiny"]["optimizers"]) == {"a", "b"}
    assert tuned.lookup("tiny", "a", path)["settings"]["config"]["lr"] == 5.0
    assert tuned.lookup("small", "a", path) is None and tuned.lookup("tiny", "c", path) is None
    tuned.update(path, "tiny", {"config": {**config, "steps": 99}, "seeds": [0]}, {"b": entry})
    assert set(tuned.load(path)["tasks"]["pretrain"]["tiny"]["optimizers"]) == {"b"}
    assert tuned.load(tmp_path / "none.json") == {"tasks": {}}


def _run(label, loss, spread, budget_from=None):
    return {"label": label, "budget_from": budget_from, "summary": {"final_val_loss": loss},
            "tuned": None if spread is None else {"spread": spread, "settings": SETTINGS}}


SETTINGS = {"config": dataclasses.asdict(TrainConfig()), "seeds": [0, 1]}


def test_verdict_says_better_worse_or_the_same_within_the_seed_spread():
    metrics = {"config": dataclasses.asdict(TrainConfig()), "runs": {
        "adamw": _run("AdamW", 2.00, 0.02),
        "near": _run("Near", 2.03, 0.03),      # 0.03 <= max(0.03, 0.02): the same
        "far": _run("Far", 1.90, 0.01),        # 0.10 > 0.02: better
        "worse": _run("Worse", 2.50, 0.01),    # worse
        "governed": _run("Gov", 3.0, 0.01, budget_from="far"),
        "untuned": _run("Untuned", 1.0, None)}}
    text = report._verdict(metrics)
    assert "beyond the seed-to-seed spread (the range over 2 seeds" in text
    assert "better: Far (-5.00%, spread 1.00%); worse: Worse (+25.00%, spread 1.00%)." in text
    assert "The same within the seed-to-seed spread: Near (+1.50%, spread 1.50%)." in text
    assert "Gov" not in text and "settings differ" not in text
    # A run without a spread is put as lower or higher, with the caveat.
    assert "with no seed-to-seed spread" in text and "lower loss: Untuned (-50.00%)" in text
    metrics["config"] = {**metrics["config"], "steps": 7}
    assert "settings differ" in report._verdict(metrics)
    # A sweep of one seed has no spread: its range of 0 is not one.
    metrics["runs"]["adamw"]["tuned"] = {"spread": 0.0, "seeds": 1, "settings": SETTINGS}
    text = report._verdict(metrics)
    assert "beyond the seed-to-seed spread" not in text
    assert "higher: Near (+1.50%), Worse (+25.00%)" in text


def test_a_row_takes_the_tuning_it_names_or_its_budget_source(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    config = TrainConfig(model="tiny")
    entry = {"lr": 4e-3, "matrix_lr_ratio": 0.5, "val_loss": 2.0, "spread": 0.1, "seeds": 2}
    tuned.update(path, "tiny", {"config": dataclasses.asdict(config), "seeds": [0, 1]},
                 {"frugal": entry, "adafrugal": {**entry, "lr": 6e-3}})
    monkeypatch.setattr(tuned, "PATH", path)
    monkeypatch.setitem(demo.OPTIMIZERS, "frugal-again", dataclasses.replace(
        demo.OPTIMIZERS["frugal"], tuned_as="frugal"))
    again = demo.run_config(config, "frugal-again")
    assert (again.lr, again.matrix_lr_ratio) == (4e-3, 0.5)
    assert demo.run_config(config, "adafrugal+governor").lr == 6e-3
    assert demo.run_config(config, "adamw") == config  # not recorded: the config's lrs
    assert demo.run_config(config, "frugal", tuned=False) == config


def test_a_repeated_seed_runs_once_with_a_notice(tmp_path, capsys):
    assert main(["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "1e-3", "--seeds", "0",
                 "0", "--matrix-lr-ratios", "1", "--out", str(tmp_path / "s"), *TINY_ARGS]) == 0
    captured = capsys.readouterr()
    assert "--seeds: 0 given more than once; running 0" in captured.err
    assert "--lrs: 0.001 given more than once" in captured.err
    saved = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [(r["lr"], r["seed"]) for r in saved["runs"]] == [(1e-3, 0)]
    assert saved["best"]["adamw"]["seeds"] == 1
    assert "– (one seed)" in captured.out  # not a spread of 0


def test_sweep_writes_every_finished_run_and_ctrl_c_keeps_them(tmp_path, monkeypatch, capsys):
    real, calls = sweep.train, []

    def interrupted_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(sweep, "train", interrupted_third)
    path = tmp_path / "tuned.json"
    out = tmp_path / "s"
    assert main(["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "1e-2", "--seeds", "0",
                 "1", "--matrix-lr-ratios", "1", "--out", str(out), "--write-tuned", str(path),
                 *[a for a in TINY_ARGS if a != "--quiet"], "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"frugal-kernels sweep: interrupted: interrupted during run 3 of 4 (adamw lr 0.01 x1 "
        f"seed 0); wrote the 2 finished runs to {out}")
    assert "run 2 of 4: adamw lr 0.001 x1 seed 1 (" in err and " left)" in err
    saved = json.loads((out / "sweep.json").read_text())
    assert len(saved["runs"]) == 2 and saved["planned"] == 4
    assert "2 of 4 runs finished." in (out / "sweep.md").read_text()
    assert not path.exists()  # an unfinished sweep records no tuning


def test_write_tuned_is_checked_before_the_sweep_trains(tmp_path, capsys):
    for bad in (tmp_path, tmp_path / "missing" / "tuned.json"):
        try:
            status = main(["sweep", "--lrs", "1e-3", "--write-tuned", str(bad), "--out",
                           str(tmp_path / "o"), *TINY_ARGS])
        except SystemExit as exit_info:
            status = exit_info.code
        assert status == 2
        line = capsys.readouterr().err.strip()
        assert "error: --write-tuned" in line and "\n" not in line


class _Result:
    """What the sweep reads of a finished run, with a loss lowest at lr 1e-3, matrices x0.25
    (a stand-in for train(): the test is about the grid; test_sweep_command_writes_tables_and_
    tuned_lrs_the_demo_reads trains)."""

    def __init__(self, config):
        self.config = config

    def summary(self):
        c = self.config
        loss = 2.0 + abs(math.log(c.lr / 1e-3)) + abs(math.log(c.matrix_lr_ratio / 0.25))
        return {"steps": c.steps, "final_val_loss": loss + 0.01 * c.seed, "held_bytes": 1,
                "state_bytes": 1, "step_time": 0.01, "wall_time": 0.04}


def test_the_sweep_crosses_matrix_lr_ratios_with_lrs_and_seeds(tmp_path, monkeypatch, capsys):
    trained = []

    def recording(config, *args, **kwargs):
        trained.append((config.matrix_lr_ratio, config.lr, config.seed))
        return _Result(config)
    monkeypatch.setattr(sweep, "train", recording)
    out = tmp_path / "s"
    assert main(["sweep", "--optimizers", "adamw", "frugal", "--lrs", "1e-3", "1e-2", "--seeds",
                 "0", "1", "--out", str(out), *[a for a in TINY_ARGS if a != "--quiet"],
                 "--no-progress"]) == 0
    assert sweep.MATRIX_LR_RATIOS == (1.0, 0.25, 0.0625)  # the default, not given here
    grid = [(r, lr, seed) for r in sweep.MATRIX_LR_RATIOS for lr in (1e-3, 1e-2)
            for seed in (0, 1)]
    assert trained == grid * 2
    saved = json.loads((out / "sweep.json").read_text())
    assert [(r["optimizer"], r["matrix_lr_ratio"], r["lr"], r["seed"]) for r in saved["runs"]] \
        == [(name, *setting) for name in ("adamw", "frugal") for setting in grid]
    assert saved["settings"]["matrix_lr_ratios"] == [1.0, 0.25, 0.0625]
    assert saved["settings"]["task"] == "pretrain"
    for name in ("adamw", "frugal"):
        best = saved["best"][name]
        assert (best["lr"], best["matrix_lr_ratio"]) == (1e-3, 0.25)
        assert best["spread"] == pytest.approx(0.01) and best["seeds"] == 2
    captured = capsys.readouterr()
    assert "run 24 of 24: frugal lr 0.01 x0.0625 seed 1 (" in captured.err
    assert "2 lrs x 3 matrix lr ratios x 2 seeds" in captured.out
    text = sweep.table(saved)
    for ratio in ("x1", "x0.25", "x0.0625"):
        assert f"| {ratio} |" in text
    assert text.count("**") == 2 * 2  # one best cell per optimizer
    # The option's old spelling still names it.
    assert main(["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "--seeds", "0",
                 "--matrix-lr-ratio", "0.5", "--out", str(tmp_path / "t"), *TINY_ARGS]) == 0
    assert trained[-1] == (0.5, 1e-3, 0)


def _entry(lr, ratio, spread=0.01, loss=2.0):
    return {"lr": lr, "matrix_lr_ratio": ratio, "val_loss": loss, "spread": spread, "seeds": 2}


def test_tuned_json_records_the_ratio_per_task_and_round_trips(tmp_path):
    path = tmp_path / "tuned.json"
    config = dataclasses.asdict(TrainConfig(model="tiny"))
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1]},
                 {"adamw": _entry(3e-3, 0.0625)})
    base = {"steps": 2, "hash": "abc"}
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1], "base": base},
                 {"adamw": _entry(1e-3, 1.0)}, task="finetune")
    assert set(json.loads(path.read_text())) == {"tasks"}
    pretrain = tuned.lookup("tiny", "adamw", path)
    assert (pretrain["lr"], pretrain["matrix_lr_ratio"]) == (3e-3, 0.0625)
    finetuning = tuned.lookup("tiny", "adamw", path, task="finetune")
    assert (finetuning["lr"], finetuning["matrix_lr_ratio"]) == (1e-3, 1.0)
    assert finetuning["settings"]["base"] == base
    # Another base is another task's record: it replaces, never merges.
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1],
                                "base": {"steps": 2, "hash": "def"}},
                 {"frugal": _entry(1e-3, 0.25)}, task="finetune")
    assert tuned.lookup("tiny", "adamw", path, task="finetune") is None
    assert tuned.lookup("tiny", "adamw", path) == pretrain  # the other task untouched
    with pytest.raises(ValueError, match="unknown task"):
        tuned.lookup("tiny", "adamw", path, task="sft")


def test_an_old_tuned_json_without_ratios_or_tasks_loads_at_a_quarter(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    config = dataclasses.asdict(TrainConfig(model="tiny"))
    old_entry = {"lr": 3e-3, "val_loss": 2.0, "spread": 0.02, "seeds": 2}
    path.write_text(json.dumps({"presets": {"tiny": {
        "settings": {"config": config, "seeds": [0, 1]}, "optimizers": {"adamw": old_entry}}}}))
    found = tuned.lookup("tiny", "adamw", path)
    assert found["lr"] == 3e-3 and found["matrix_lr_ratio"] == tuned.LEGACY_MATRIX_LR_RATIO == 0.25
    assert tuned.lookup("tiny", "adamw", path, task="finetune") is None
    monkeypatch.setattr(tuned, "PATH", path)
    again = demo.run_config(TrainConfig(model="tiny"), "adamw")
    assert (again.lr, again.matrix_lr_ratio) == (3e-3, 0.25)
    # A sweep recorded into it rewrites it in the new layout, the old record kept.
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1]},
                 {"frugal": _entry(1e-2, 1.0)})
    recorded = json.loads(path.read_text())["tasks"]["pretrain"]["tiny"]["optimizers"]
    assert recorded["adamw"]["matrix_lr_ratio"] == 0.25 and recorded["frugal"]["lr"] == 1e-2


def test_train_takes_the_tuned_lr_and_ratio_of_its_row(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    config = dataclasses.asdict(TrainConfig(model="tiny"))
    tuned.update(path, "tiny", {"config": config, "seeds": [0, 1]},
                 {"frugal": _entry(4e-3, 0.0625)})
    monkeypatch.setattr(tuned, "PATH", path)
    out = tmp_path / "t"
    assert main(["train", "--optimizer", "frugal", "--out", str(out), *TINY_ARGS]) == 0
    used = json.loads((out / "metrics.json").read_text())["config"]
    assert (used["lr"], used["matrix_lr_ratio"]) == (4e-3, 0.0625)


def test_a_row_swept_itself_takes_its_own_best_before_the_row_it_names(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    config = TrainConfig(model="tiny")
    tuned.update(path, "tiny", {"config": dataclasses.asdict(config), "seeds": [0, 1]},
                 {"adamw": _entry(3e-3, 0.25, spread=0.02),
                  "dqt4": _entry(1e-2, 0.0625, spread=0.05)})
    monkeypatch.setattr(tuned, "PATH", path)
    own = demo.tuned_for(config, "dqt4")
    assert (own["row"], own["lr"], own["matrix_lr_ratio"], own["spread"]) == (
        "dqt4", 1e-2, 0.0625, 0.05)
    assert demo.tuned_for(config, "dqt4-frugal")["row"] == "adamw"  # not swept: adamw's
    assert demo.run_config(config, "dqt4").matrix_lr_ratio == 0.0625


def test_the_verdict_takes_each_rows_spread_at_its_own_best_setting():
    # Two rows whose best settings differ in ratio: each spread is the seeds' range there,
    # not at another row's setting nor at a shared ratio.
    runs = [_record("adamw", 1e-3, 0, 2.00, ratio=1.0), _record("adamw", 1e-3, 1, 2.40, ratio=1.0),
            _record("adamw", 1e-3, 0, 2.00, ratio=0.25), _record("adamw", 1e-3, 1, 2.02, ratio=0.25),
            _record("frugal", 1e-3, 0, 1.90, ratio=1.0), _record("frugal", 1e-3, 1, 1.91, ratio=1.0),
            _record("frugal", 1e-3, 0, 1.95, ratio=0.25), _record("frugal", 1e-3, 1, 2.25, ratio=0.25)]
    best = sweep.best_settings(runs)
    assert best["adamw"]["matrix_lr_ratio"] == 0.25
    assert best["adamw"]["spread"] == pytest.approx(0.02)
    assert best["frugal"]["matrix_lr_ratio"] == 1.0
    assert best["frugal"]["spread"] == pytest.approx(0.01)
    metrics = {"config": dataclasses.asdict(TrainConfig()), "runs": {
        "adamw": _run("AdamW", 2.01, best["adamw"]["spread"]),
        "frugal": _run("FRUGAL", 1.905, best["frugal"]["spread"]),
        "near": _run("Near", 2.025, 0.001)}}
    text = report._verdict(metrics)
    # FRUGAL: 0.105 below, beyond max(0.02, 0.01); Near: 0.015 above, within AdamW's 0.02.
    assert "better: FRUGAL (-5.22%, spread 1.00%)" in text
    assert "The same within the seed-to-seed spread: Near (+0.75%, spread 1.00%)" in text


@pytest.mark.slow
def test_a_finetuning_sweep_records_the_task_that_its_demo_and_train_read(tmp_path,
                                                                        monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setattr(tuned, "PATH", path)
    task = ["--task", "finetune", "--base-steps", "2", "--base-cache", str(tmp_path / "base")]
    out = tmp_path / "s"
    assert main(["sweep", *task, "--optimizers", "frugal", "--lrs", "1e-3", "3e-3",
                 "--matrix-lr-ratios", "1", "0.25", "--seeds", "0", "1", "--out", str(out),
                 "--write-tuned", *TINY_ARGS]) == 0
    saved = json.loads((out / "sweep.json").read_text())
    assert len(saved["runs"]) == 2 * 2 * 2 and saved["settings"]["task"] == "finetune"
    assert saved["settings"]["base"]["steps"] == 2
    assert "fine-tuning the base of 2 steps" in (out / "sweep.md").read_text()
    best = saved["best"]["frugal"]
    recorded = tuned.lookup("tiny", "frugal", path, task="finetune")
    assert {k: recorded[k] for k in best} == best
    assert tuned.lookup("tiny", "frugal", path) is None  # the pretraining task untouched
    # The fine-tuning demo runs the row and its governed twin at that best, with its spread.
    demo_out = tmp_path / "d"
    assert main(["demo", *task, "--optimizers", "adamw", "frugal+governor", "--out",
                 str(demo_out), *TINY_ARGS]) == 0
    runs = json.loads((demo_out / "metrics.json").read_text())["runs"]
    for name in ("frugal", "frugal+governor"):
        used = runs[name]["config"]
        assert (used["lr"], used["matrix_lr_ratio"]) == (best["lr"], best["matrix_lr_ratio"])
    assert runs["frugal"]["tuned"]["spread"] == best["spread"]
    assert runs["adamw"]["tuned"] is None  # not swept: the task's defaults
    assert runs["adamw"]["config"]["lr"] == finetune.DEFAULTS.lr
    train_out = tmp_path / "t"
    assert main(["train", *task, "--optimizer", "frugal", "--out", str(train_out),
                 *TINY_ARGS]) == 0
    used = json.loads((train_out / "metrics.json").read_text())["config"]
    assert (used["lr"], used["matrix_lr_ratio"]) == (best["lr"], best["matrix_lr_ratio"])


def test_the_default_rows_of_each_tasks_sweep_and_a_row_of_the_other_task(tmp_path, capsys):
    for task in ("pretrain", "finetune"):
        rows = sweep.default_rows(task)
        assert "adamw" in rows and "frugal+inbwd" not in rows
        assert all(sweep.rows_of(task)[n].budget_from is None for n in rows)
    assert "lora" in sweep.default_rows("finetune") and "dqt4" in sweep.default_rows("pretrain")
    assert main(["sweep", "--optimizers", "lora", "--lrs", "1e-3", "--out",
                 str(tmp_path / "o"), *TINY_ARGS]) == 2
    assert "lora: not a row of --task pretrain" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
