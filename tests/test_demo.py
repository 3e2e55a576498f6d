import dataclasses
import json
import math

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels.lab import demo, plots, registry, report
from frugal_kernels.__main__ import main
from frugal_kernels.lab.corpus import load_corpus
from frugal_kernels.governor import optimizer_flops
from frugal_kernels.model import LlamaForCausalLM, flops_per_token
from frugal_kernels.lab.train import (TrainConfig, lr_factor, lr_groups, optimizer_state_bytes,
                                  optimizer_step_flops, step_memory, steps_for_budget, train)

MAX_BYTES = 200_000
TINY = TrainConfig(model="tiny", steps=8, batch_size=2, seq_len=16, warmup_steps=2,
                   eval_every=4, eval_batches=1, max_bytes=MAX_BYTES)
TINY_ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
             "--max-bytes", str(MAX_BYTES), "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=MAX_BYTES)


def adamw(model, config):
    return torch.optim.AdamW(model.parameters(), lr=config.lr)


def frozen_adamw(model, config):
    """lr 0: the validation loss is the same at every evaluation, a perfect plateau."""
    return torch.optim.AdamW(model.parameters(), lr=0.0)


def test_demo_writes_metrics_and_plot(tmp_path, monkeypatch):
    # A short T, so that AdaFRUGAL changes its subspace, with a smaller rho, in a short run.
    monkeypatch.setattr(registry, "UPDATE_GAP", 4)
    config = dataclasses.replace(TINY, steps=10, eval_every=3)
    metrics = demo.run_demo(config, list(demo.OPTIMIZERS), out=tmp_path / "run", progress=False)
    installed = demo.available(list(demo.OPTIMIZERS))  # the peers' rows need their packages

    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (tmp_path / "run" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(metrics["files"]) == sorted(str(tmp_path / "run" / f)
                                              for f in ("metrics.json", "table.md",
                                                        "table.csv", "demo.png"))
    assert (tmp_path / "run" / "table.md").read_text() == demo.table(saved) + "\n"
    import csv
    with open(tmp_path / "run" / "table.csv", newline="") as f:
        table_rows = list(csv.reader(f))
    assert table_rows[0][:3] == ["optimizer", "steps", "val loss"] and len(table_rows) == 1 + len(installed)
    runs = saved["runs"]
    assert list(runs) == installed
    # Every run starts from the same weights on the same batch; a DQT run from their
    # quantization at its width (the same for its FRUGAL row); a +select row on the batch
    # the same initial model selects (the same for both).
    def start(name):
        if registry.OPTIMIZERS[name].selects:
            return "selected"
        return name.split("-")[0] if name.startswith("dqt") else "float"
    first_losses = {}
    for name, run in runs.items():
        first_losses.setdefault(start(name), set()).add(run["steps"][0]["train_loss"])
    assert all(len(losses) == 1 for losses in first_losses.values()), first_losses
    for name in ("adamw", "frugal", "adafrugal"):
        s = runs[name]["summary"]
        assert s["steps"] == config.steps and len(runs[name]["steps"]) == config.steps
        assert [e["step"] for e in runs[name]["evaluations"]] == [3, 6, 9, 10]
        assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] < math.log(256)
        assert s["peak_memory"] > 0 and 0 < s["optimizer_share"] < 1
    state = {name: runs[name]["summary"]["state_bytes"] for name in runs}
    assert state["frugal"] < state["adamw"] / 2
    assert state["adafrugal"] < state["frugal"]
    assert runs["adafrugal"]["steps"][-1]["rho"] < runs["frugal"]["steps"][-1]["rho"] == 0.25
    # The label says the rho the run reached: it changes only with the subspace (steps 4 and
    # 8 here), so 0.09, above the schedule's 0.05.
    reached = min(s["rho"] for s in runs["adafrugal"]["steps"])
    assert reached == pytest.approx(0.09)
    assert runs["adafrugal"]["label"] == "AdaFRUGAL rho 0.25->0.09"

    # The frugal row stepped in backward: the same training, one gradient alive at a time.
    frugal, inbwd = runs["frugal"]["summary"], runs["frugal+inbwd"]["summary"]
    assert inbwd["held_bytes"] < frugal["held_bytes"]
    assert inbwd["state_bytes"] == frugal["state_bytes"]
    assert abs(inbwd["final_val_loss"] - frugal["final_val_loss"]) < 1e-3 * frugal["final_val_loss"]

    governed = runs["adafrugal+governor"]
    assert governed["summary"]["flop_budget"] == runs["adafrugal"]["summary"]["flops"]
    assert len(governed["decisions"]) == len(governed["evaluations"])
    assert governed["decisions"][-1]["action"] == "stop"

    text = demo.table(saved)
    for run in runs.values():
        assert run["label"] in text
    assert "of its budget" in text


def test_every_row_has_a_colour_of_its_own():
    """The plot names the runs by colour alone (one legend for the four panels)."""
    colours = [entry.color for entry in demo.OPTIMIZERS.values()]
    assert len(set(colours)) == len(colours), colours


def test_rho_and_t_panels_show_the_runs_with_a_subspace():
    def run(*rhos):
        return {"steps": [{"step": i + 1, "rho": r} for i, r in enumerate(rhos)]}
    assert plots._has_subspace(run(0.25, 0.25))
    assert plots._has_subspace(run(1.0, 0.15))  # a density that shrinks below one
    assert not plots._has_subspace(run(1.0, 1.0))  # DQT with every code state-full
    assert not plots._has_subspace(run(0.0, 0.0))  # DQT with SignSGD alone
    assert not plots._has_subspace({"steps": [{"step": 1}]})  # AdamW: no rho at all


@pytest.mark.parametrize("update, rho", [("adamw", 1.0), ("sign", 0.0), ("frugal", 0.3)])
def test_dqt_rho_is_the_state_full_fraction_of_its_codes(update, rho):
    layer = fk.nn.QuantLinear(8, 8, bits=4)
    assert fk.DQT(layer.parameters(), update=update, density=0.3).rho == rho


def test_demo_command_adds_the_budget_run(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["demo", "--steps", "4", "--eval-every", "2", "--optimizers",
                 "adafrugal+governor", "--out", str(out), *TINY_ARGS]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "metrics.json").read_text())
    assert list(saved["runs"]) == ["adafrugal", "adafrugal+governor"]
    assert saved["config"]["steps"] == 4 and saved["config"]["eval_every"] == 2
    assert saved["config"]["warmup_steps"] == 4 * demo.DEFAULTS.warmup_steps // demo.DEFAULTS.steps
    assert f"results in {out}" in printed
    assert "AdaFRUGAL+governor" in printed


def test_resolve_rejects_unknown_names():
    assert demo.resolve(["frugal", "adafrugal+governor", "adafrugal"]) == [
        "frugal", "adafrugal", "adafrugal+governor"]
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        demo.resolve(["lion"])


def test_train_stops_when_the_budget_is_spent(corpus):
    model = LlamaForCausalLM(TINY.model_config(corpus.vocab_size))
    per_step = (TINY.tokens_per_step() * flops_per_token(model.config, TINY.seq_len)
                + optimizer_flops(sum(p.numel() for p in model.parameters()), "adamw"))
    config = dataclasses.replace(TINY, steps=20, eval_every=10, flop_budget=2.5 * per_step)
    result = train(config, adamw, model=model, data=corpus, progress=False)
    # The budget runs out during step 3: that step is evaluated and the governor stops the run.
    assert result.steps_done == 3
    assert result.stop_reason.startswith("governor stop at step 3: budget exhausted")
    assert result.flops == pytest.approx(3 * per_step)
    assert [d["action"] for d in result.decisions] == ["stop"]
    assert [e["step"] for e in result.evaluations] == [3]


def test_train_stops_on_a_plateau_under_the_governor(corpus):
    config = dataclasses.replace(TINY, steps=40, eval_every=2, flop_budget=1e15,
                                 governor={"window": 2, "patience": 2})
    result = train(config, frozen_adamw, data=corpus, progress=False)
    # The window fills at the 2nd evaluation; a zero slope stays under the threshold at the
    # 2nd and 3rd, and patience 2 stops the run there.
    assert result.steps_done == 6
    assert [d["action"] for d in result.decisions] == ["continue", "continue", "stop"]
    assert "the rest of the budget would improve the loss" in result.stop_reason
    assert result.decisions[-1]["projected_improvement"] == 0.0
    assert result.flops < config.flop_budget


def test_governor_reallocations_reach_adafrugal(corpus):
    config = dataclasses.replace(TINY, steps=30, eval_every=2, lr=3e-3, flop_budget=1e15,
                                 governor={"window": 2, "cooldown": 1, "patience": 10**6,
                                           "reallocate_fraction": 0.9})

    def make(model, cfg):
        return fk.AdaFRUGAL(fk.param_groups(model), lr=cfg.lr, rho_steps=cfg.steps,
                            update_gap=5)

    result = train(config, make, data=corpus, progress=False)
    reallocations = [d for d in result.decisions if d["action"] == "reallocate"]
    assert reallocations
    from_governor = [h for h in result.optimizer_history if h["reason"].startswith("governor")]
    assert len(from_governor) == 2 * len(reallocations)  # T grown, rho scaled
    assert result.steps[-1]["update_gap"] > 5


def test_train_command_derives_steps_from_the_budget(tmp_path, capsys):
    model_config = TINY.model_config(256)
    budget = 5 * (TINY.tokens_per_step() * flops_per_token(model_config, TINY.seq_len)
                  + optimizer_flops(model_config.num_params(), "adamw"))
    assert steps_for_budget(budget, TINY, 256) == 5
    out = tmp_path / "train"
    assert main(["train", "--optimizer", "frugal", "--flop-budget", str(budget),
                 "--eval-every", "2", "--out", str(out), "--save-model", *TINY_ARGS]) == 0
    saved = json.loads((out / "metrics.json").read_text())
    run = saved["runs"]["frugal"]
    assert saved["config"]["steps"] == 5 and run["summary"]["steps"] <= 5
    assert run["summary"]["flops"] <= budget
    assert (out / "train.png").exists()
    state = torch.load(out / "model.pt", weights_only=True)
    assert "lm_head.weight" in state
    assert "governor:" in capsys.readouterr().out


def test_wsd_schedule_holds_then_cools_down_to_the_floor():
    factors = [lr_factor(s, 100, 10, 0.1, "wsd", 0.2) for s in range(101)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10:80] == pytest.approx([1.0] * 70)
    assert all(a > b for a, b in zip(factors[80:100], factors[81:101]))
    assert factors[90] == pytest.approx(0.55)
    assert factors[100] == pytest.approx(0.1)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(0, 10, 0, 0.0) == pytest.approx(1.0)


def test_optimizer_accounting_follows_the_state():
    model = LlamaForCausalLM(TINY.model_config(256))
    n = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    assert optimizer_step_flops(opt) == optimizer_flops(n, "adamw")
    assert optimizer_state_bytes(opt) == 2 * 4 * n + 4 * len(list(model.parameters()))

    groups = fk.param_groups(model)
    regular = sum(p.numel() for p in groups[0]["params"])
    opt = fk.FRUGAL(groups, density=0.0)
    opt.step()
    assert optimizer_step_flops(opt) == (optimizer_flops(regular, "adamw")
                                         + optimizer_flops(n - regular, "sign"))
    assert optimizer_state_bytes(opt) == opt.state_bytes()


@pytest.mark.parametrize("command", [[], ["demo"], ["train"], ["sweep"], ["bench"]])
def test_help_of_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: frugal-kernels" in capsys.readouterr().out


BAD_ARGUMENTS = [
    (["train", "--steps", "-5"], "--steps"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--data", "/nonexistent/corpus"], "does not exist"),
    (["train", "--lr", "-1"], "--lr"),
    (["demo", "--lr", "nan"], "--lr"),
    (["demo", "--matrix-lr-ratio", "0"], "--matrix-lr-ratio"),
    (["demo", "--batch-size", "0"], "--batch-size"),
    (["demo", "--seq-len", "1"], "--seq-len"),
    (["train", "--flop-budget", "-1"], "--flop-budget"),
    (["train", "--governor-window", "1"], "--governor-window"),
    (["demo", "--weight-decay", "-0.1"], "--weight-decay"),
    (["demo", "--badam-switch-every", "0"], "--badam-switch-every"),
    (["demo", "--device", "tpu"], "not a device"),
    (["bench", "--ops", "nosuch"], "--ops"),
    (["bench", "--rounds", "-1"], "--rounds"),
    (["bench", "--dtypes", "int8"], "--dtypes"),
    (["bench", "--preset", "7b"], "--preset"),
    (["train", "--warmup-steps", "50", "--steps", "10"], "warmup_steps"),
    (["train", "--fsdp"], "--fsdp runs under torchrun"),
    (["nosuch"], "invalid choice"),
    (["sweep"], "--lrs"),
    (["sweep", "--lrs", "0"], "--lrs"),
    (["sweep", "--lrs", "1e-3", "--optimizers", "adafrugal+governor"], "--optimizers"),
    (["sweep", "--lrs", "1e-3", "--matrix-lr-ratio", "-1"], "--matrix-lr-ratio"),
]
if not torch.cuda.is_available():
    BAD_ARGUMENTS.append((["demo", "--device", "cuda"], "CUDA is not available"))


@pytest.mark.parametrize("argv,fragment", BAD_ARGUMENTS, ids=lambda a: " ".join(a)
                         if isinstance(a, list) else None)
def test_bad_arguments_get_one_line_and_status_2(argv, fragment, capsys):
    try:
        status = main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and fragment in lines[0], captured.err


def test_run_train_writes_one_run_and_refuses_a_governed_entry(tmp_path, corpus):
    metrics = demo.run_train(TINY, "frugal", data=corpus, out=tmp_path / "t", progress=False,
                             save_model=True)
    assert list(metrics["runs"]) == ["frugal"]
    assert metrics["runs"]["frugal"]["summary"]["steps"] == TINY.steps
    assert sorted(metrics["files"]) == sorted(str(tmp_path / "t" / f)
                                              for f in ("metrics.json", "table.md", "table.csv",
                                                        "train.png", "checkpoint.pt", "model.pt"))
    with pytest.raises(ValueError, match="takes its budget from the 'adafrugal' run"):
        demo.run_train(TINY, "adafrugal+governor", data=corpus, out=tmp_path / "g")


def test_with_steps_keeps_the_schedule_in_proportion_unless_given():
    long = TrainConfig(steps=1200, warmup_steps=120, eval_every=80)
    short = long.with_steps(60)
    assert (short.steps, short.warmup_steps, short.eval_every) == (60, 6, 4)
    given = long.with_steps(60, warmup_steps=1, eval_every=7)
    assert (given.warmup_steps, given.eval_every) == (1, 7)
    assert long.with_steps(5).eval_every == 1


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["adamw", "frugal"])
def test_memory_columns_are_the_bytes_of_the_tensors(name, corpus):
    model = LlamaForCausalLM(TINY.model_config(corpus.vocab_size))
    opt = demo.OPTIMIZERS[name].make(model, TINY)
    loss = model(*next(corpus.batches("train", 2, 16, seed=0))).loss
    loss.backward()
    opt.step()
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    memory = step_memory(model, opt)
    assert memory["weight_bytes"] == _nbytes(params)
    assert memory["grad_bytes"] == _nbytes(p.grad for p in params)
    assert memory["state_bytes"] == _nbytes(state)
    assert memory["held_bytes"] == _nbytes(params) * 2 + _nbytes(state)

    result = train(TINY, demo.OPTIMIZERS[name].make, data=corpus, progress=False)
    assert result.held_bytes == max(s["held_bytes"] for s in result.steps)
    assert result.steps[-1]["held_bytes"] == (result.steps[-1]["weight_bytes"]
                                              + result.steps[-1]["grad_bytes"]
                                              + result.steps[-1]["state_bytes"])


def test_memory_columns_of_a_step_in_backward(corpus):
    """Its gradients are gone by the time step() is called: held counts the most that were
    alive at once in backward, here the largest tensor's alone."""
    model = LlamaForCausalLM(TINY.model_config(corpus.vocab_size))
    opt = demo.OPTIMIZERS["frugal+inbwd"].make(model, TINY)
    ids, labels = next(corpus.batches("train", 2, 16, seed=0))
    loss = model(ids, labels=labels).loss
    with fk.optim.in_backward.handle_of(opt).norm_pass():
        loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    memory = step_memory(model, opt)
    largest = max(_nbytes([p]) for p in params)
    assert memory["grad_bytes"] == largest
    assert memory["held_bytes"] == _nbytes(params) + largest + _nbytes(state)


def test_a_clip_after_backward_with_a_step_in_backward_is_refused(corpus):
    def in_backward_without_its_clip(model, config):
        opt = fk.FRUGAL(lr_groups(model, config), lr=config.lr, nonfinite="raise")
        fk.step_in_backward(opt)
        return opt

    with pytest.raises(ValueError, match="steps in backward, before that"):
        train(TINY, in_backward_without_its_clip, data=corpus, progress=False)
    # Without a clip it trains.
    result = train(dataclasses.replace(TINY, grad_clip=None), in_backward_without_its_clip,
                   data=corpus, progress=False)
    assert result.steps_done == TINY.steps and result.steps[-1]["optimizer_time"] > 0


def test_lr_groups_give_the_matrices_their_own_lr():
    model = LlamaForCausalLM(TINY.model_config(256))
    groups = lr_groups(model, dataclasses.replace(TINY, lr=1e-2, matrix_lr_ratio=0.25))
    assert [(g["projected"], g["lr"]) for g in groups] == [(False, 1e-2), (True, 2.5e-3)]
    opt = demo.OPTIMIZERS["adamw"].make(model, dataclasses.replace(TINY, lr=1e-2,
                                                                   matrix_lr_ratio=0.25))
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 2.5e-3]


@pytest.mark.parametrize("name", ["badam", "badam+frugal"])
def test_badam_rows_give_the_layers_blocks_the_matrix_lr_and_take_their_k(name):
    model = LlamaForCausalLM(TINY.model_config(256))
    opt = demo.OPTIMIZERS[name].make(model, dataclasses.replace(TINY, lr=1e-2,
                                                                matrix_lr_ratio=0.25,
                                                                badam_switch_every=7))
    lrs = {g["block"]: g["lr"] for g in opt.param_groups}
    assert lrs.pop("embedding") == lrs.pop("head") == 1e-2
    assert lrs and set(lrs.values()) == {2.5e-3}
    assert opt.switch_every == 7


def test_progress_lines_off_a_terminal_and_nothing_when_quiet(corpus, capsys):
    train(TINY, adamw, data=corpus, name="run", progress=True)  # capsys: not a terminal
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("run: step 4/8, train loss ")
    assert len(err.splitlines()) == 2 and "\r" not in err
    train(TINY, adamw, data=corpus, name="run", progress=False)
    assert capsys.readouterr().err == ""


def test_quiet_demo_prints_only_the_table(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--optimizers", "adamw", "--quiet", "--lr", "2e-3",
                 "--matrix-lr-ratio", "0.5", "--out", str(tmp_path / "q"),
                 *[a for a in TINY_ARGS if a != "--no-progress"]]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "held MB" in captured.out
    saved = json.loads((tmp_path / "q" / "metrics.json").read_text())
    assert saved["config"]["lr"] == 2e-3 and saved["config"]["matrix_lr_ratio"] == 0.5


# --- A new user's first hour (issue 24) and the CLI's bad input (issue 27 items 4, 9) ---

def _status(argv):
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def _interrupt_call(monkeypatch, module, name, at):
    """Replace ``module.name`` by the real one that raises KeyboardInterrupt (a Ctrl-C) on
    its call number ``at``."""
    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)


def test_demo_writes_every_finished_run_and_ctrl_c_keeps_them(tmp_path, monkeypatch, capsys):
    out = tmp_path / "d"
    _interrupt_call(monkeypatch, demo, "train", at=3)
    status = main(["demo", "--optimizers", "adamw", "frugal", "badam", "--steps", "2",
                   "--out", str(out), *TINY_ARGS])
    captured = capsys.readouterr()
    assert status == 130
    last = captured.err.strip().splitlines()[-1]
    assert last == (f"frugal-kernels demo: interrupted: interrupted during run 3 of 3 "
                    f"(BAdam K=20); wrote the 2 finished runs to {out}")
    assert "Traceback" not in captured.err
    saved = json.loads((out / "metrics.json").read_text())
    assert list(saved["runs"]) == ["adamw", "frugal"]
    assert saved["planned"] == ["adamw", "frugal", "badam"]
    text = (out / "table.md").read_text()
    assert "2 of 3 runs finished; not run: BAdam K=20." in text
    assert (out / "demo.png").exists() and (out / "table.csv").exists()


def test_demo_prints_run_k_of_n_with_the_time_so_far_and_left(tmp_path, capsys):
    assert main(["demo", "--optimizers", "adamw", "frugal", "--steps", "2", "--out",
                 str(tmp_path / "p"), *TINY_ARGS]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("run ")]
    assert lines[0].startswith("run 1 of 2: AdamW (") and "elapsed)" in lines[0]
    assert lines[1].startswith("run 2 of 2: FRUGAL rho=0.25 (") and " left)" in lines[1]


@pytest.mark.parametrize("command, results", [
    (["demo", "--optimizers", "adamw"], "metrics.json"),
    (["train", "--optimizer", "adamw"], "metrics.json"),
    (["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "--matrix-lr-ratios", "1",
      "--seeds", "0"], "sweep.json")], ids=lambda c: c[0] if isinstance(c, list) else None)
def test_a_folder_with_results_is_never_overwritten_without_overwrite(command, results,
                                                                      tmp_path, capsys):
    out = tmp_path / "same"
    argv = [*command, "--steps", "2", "--out", str(out), *TINY_ARGS]
    assert main(argv) == 0
    first = (out / results).read_text()
    capsys.readouterr()
    assert main(argv) == 0
    assert (out / results).read_text() == first
    assert (tmp_path / "same-2" / results).exists()
    assert f"writing to {tmp_path / 'same-2'} instead" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert (out / results).read_text() != first
    assert not (tmp_path / "same-3").exists()


@pytest.mark.parametrize("command", [
    ["demo", "--optimizers", "adamw"], ["train", "--optimizer", "adamw"],
    ["sweep", "--optimizers", "adamw", "--lrs", "1e-3"]], ids=lambda c: c[0])
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_bad_out_is_refused_before_anything_trains(command, where, tmp_path, monkeypatch,
                                                     capsys):
    from frugal_kernels.lab import sweep, train as train_module

    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking --out")
    for module in (demo, sweep, train_module):
        monkeypatch.setattr(module, "train", no_training)
    existing = tmp_path / "file"
    existing.write_text("not a folder")
    out = existing if where == "a file" else existing / "sub"
    assert _status([*command, "--out", str(out), "--steps", "2", *TINY_ARGS]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error: --out" in lines[0], captured.err
    assert existing.read_text() == "not a folder"


def _data_cases(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    no_text = tmp_path / "pictures"
    no_text.mkdir()
    (no_text / "a.png").write_bytes(b"\x89PNG")
    little = tmp_path / "little.txt"
    little.write_text("print('hello')\n" * 8)
    return [(["--data", str(empty)], "holds no text"),
            (["--data", str(no_text)], "no .txt/.md/.py files found"),
            (["--data", "/dev/null"], "neither a file nor a folder"),
            (["--data", str(little)], "too small for batches of 2 x 16 bytes")]


@pytest.mark.parametrize("command", ["demo", "train", "sweep"])
def test_bad_data_is_one_line_and_status_2(command, tmp_path, capsys):
    extra = ["--lrs", "1e-3"] if command == "sweep" else []
    for argv, fragment in _data_cases(tmp_path):
        assert _status([command, *extra, *argv, "--out", str(tmp_path / "o"), "--steps", "2",
                        *TINY_ARGS]) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "error: --data" in lines[0] and fragment in lines[0], lines


@pytest.mark.parametrize("command", [["demo"], ["train"], ["sweep", "--lrs", "1e-3"]],
                         ids=lambda c: c[0])
def test_a_hugging_face_source_without_datasets_is_refused(command, monkeypatch, capsys):
    import sys as _sys
    monkeypatch.setitem(_sys.modules, "datasets", None)  # as if not installed
    assert _status([*command, "--data", "hf:wikitext", *TINY_ARGS]) == 2
    line = capsys.readouterr().err.strip()
    assert "needs the optional package datasets" in line and "\n" not in line


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--flop-budget", "1"], "does not pay for one step"),
    (["train", "--flop-budget", "1", "--steps", "3"], "does not pay for one step"),
    (["demo", "--seed", "99999999999999999999"], "--seed"),
    (["train", "--seed", "-1"], "--seed"),
    (["sweep", "--lrs", "1e-3", "--seeds", "0", "4294967296"], "--seeds"),
    (["train", "--resume", "/nonexistent/checkpoint.pt"], "--resume"),
    (["train", "--log", "mlflow"], "--log"),
])
def test_more_bad_arguments_get_one_line_and_status_2(argv, fragment, tmp_path, capsys):
    assert _status([*argv, "--out", str(tmp_path / "o"), *TINY_ARGS]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and fragment in lines[0], lines


def test_train_resumes_exactly_where_it_stopped(tmp_path, monkeypatch, capsys):
    import frugal_kernels.lab.train as train_module

    run = ["train", "--optimizer", "adafrugal", "--steps", "12", "--eval-every", "3",
           "--save-model", *TINY_ARGS]
    assert main([*run, "--out", str(tmp_path / "whole")]) == 0
    # Ctrl-C in the third evaluation (step 9): the checkpoint of step 6 stands.
    with monkeypatch.context() as patch:
        _interrupt_call(patch, train_module, "_evaluate", at=3)
        assert main([*run, "--out", str(tmp_path / "parts")]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = tmp_path / "parts" / "checkpoint.pt"
    assert err.endswith(f"interrupted after step 9 of 12; wrote the metrics so far to "
                        f"{tmp_path / 'parts'}; resume from step 6 with --resume {checkpoint}")
    assert json.loads((tmp_path / "parts" / "metrics.json").read_text())[
        "runs"]["adafrugal"]["summary"]["steps"] == 9
    assert main(["train", "--resume", str(checkpoint), "--save-model", "--device", "cpu",
                 "--no-progress"]) == 0
    whole, parts = (json.loads((tmp_path / f / "metrics.json").read_text())["runs"]["adafrugal"]
                    for f in ("whole", "parts"))
    assert [s["train_loss"] for s in parts["steps"]] == [s["train_loss"] for s in whole["steps"]]
    assert [s["rho"] for s in parts["steps"]] == [s["rho"] for s in whole["steps"]]
    assert parts["evaluations"] == [{**e, "time": p["time"]} for e, p in
                                    zip(whole["evaluations"], parts["evaluations"])]
    a, b = (torch.load(tmp_path / f / "model.pt", weights_only=True) for f in ("whole", "parts"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A resumed run takes its settings from the checkpoint; another file is not one.
    assert _status(["train", "--resume", str(checkpoint), "--lr", "1e-2"]) == 2
    assert "drop --lr" in capsys.readouterr().err
    (tmp_path / "other.pt").write_bytes(b"not a checkpoint")
    assert _status(["train", "--resume", str(tmp_path / "other.pt")]) == 2
    assert "is not a training checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("kind, module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_log_sends_metrics_where_installed_and_says_so_where_not(kind, module, tmp_path,
                                                                 monkeypatch, capsys):
    import importlib.util
    argv = ["train", "--optimizer", "adamw", "--steps", "2", "--log", kind, "--out",
            str(tmp_path / "l"), *TINY_ARGS]
    if importlib.util.find_spec(module) is None:
        assert _status(argv) == 2
        line = capsys.readouterr().err.strip()
        assert f"--log {kind} needs the {module} package" in line and "\n" not in line
        assert not (tmp_path / "l" / "metrics.json").exists()
    else:
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert main(argv) == 0
        assert any((tmp_path / "l" / kind).rglob("*"))


def _summary_run(label, loss, held_mb, spread=0.01, budget_from=None, note=""):
    return {"label": label, "budget_from": budget_from, "note": note,
            "summary": {"final_val_loss": loss, "held_bytes": held_mb * 2**20,
                        "step_time": 0.05},
            "tuned": None if spread is None else {"spread": spread, "seeds": 2,
                                                  "settings": {"seeds": [0, 1]}}}


def test_recommendation_per_memory_budget_with_its_reason():
    metrics = {"runs": {
        "adamw": _summary_run("AdamW", 2.00, 12.0),
        "galore": _summary_run("GaLore", 1.90, 10.0),     # best at AdamW's memory
        "frugal": _summary_run("FRUGAL", 1.985, 8.0),      # fits 2/3
        "quick": _summary_run("Quick", 1.99, 7.0),        # within the spread of FRUGAL, faster
        "small": _summary_run("Small", 2.10, 5.0),        # beyond it: the pick at half
        "badam": _summary_run("BAdam", 3.00, 3.5),        # the only one under 1/3
        "gov": _summary_run("Gov", 1.0, 1.0, budget_from="frugal")}}
    metrics["runs"]["quick"]["summary"]["step_time"] = 0.03
    lines = report._recommendations(metrics).splitlines()
    assert lines[0] == "Recommendation per memory budget (held MB):"
    assert lines[1] == ("- at most 12.0 MB held (AdamW's 12.0 MB): GaLore: the lowest loss of "
                        "the 6 runs that fit (1.9000, -5.00% against AdamW), holding 10.0 MB, "
                        "50 ms/step.")
    assert lines[2] == ("- at most 8.0 MB held (67% of AdamW's): Quick: within the seed-to-seed "
                        "spread of the lowest loss (FRUGAL, 1.9850) and faster, 30 ms/step "
                        "against 50, holding 7.0 MB.")
    assert lines[3].startswith("- at most 6.0 MB held (50% of AdamW's): Small: the lowest loss "
                               "of the 2 runs that fit (2.1000, +5.00% against AdamW)")
    assert lines[4].startswith("- at most 4.0 MB held (33% of AdamW's): BAdam: the lowest loss "
                               "of the 1 runs that fit")
    assert len(lines) == 5


def test_rows_far_from_the_first_are_explained():
    metrics = {"runs": {
        "adamw": _summary_run("AdamW", 2.00, 12.0),
        "badam": _summary_run("BAdam K=20", 2.98, 5.0, spread=0.15, note="a fine-tuning method"),
        "near": _summary_run("Near", 2.005, 8.0, note="never shown: within the spread"),
        "untuned": _summary_run("Untuned", 2.2, 8.0, spread=None, note="beyond 5%"),
        "ahead": _summary_run("Ahead", 1.5, 8.0, note="never shown: better")}}
    assert report._explanations(metrics).splitlines() == [
        "Why the rows far behind AdamW are there:",
        "- BAdam K=20 (+49.00%): a fine-tuning method.",
        "- Untuned (+10.00%): beyond 5%."]


def test_badam_row_says_it_is_a_fine_tuning_method_and_holds_its_peak_state(tmp_path):
    config = dataclasses.replace(TINY, steps=6, eval_every=3, badam_switch_every=2)
    metrics = demo.run_demo(config, ["adamw", "badam"], out=tmp_path / "b", progress=False,
                            tuned=False)
    run = metrics["runs"]["badam"]
    # The tiny preset's 2 layers, the embedding and the head: 4 blocks, 2 steps each.
    assert run["label"] == "BAdam K=2"
    assert run["note"].startswith("BAdam is a fine-tuning method: it trains one block of 4 at "
                                  "a time (the embedding, each of the 2 layers, the head; "
                                  "K = 2 steps each)")
    s = run["summary"]
    assert s["max_state_bytes"] == max(st["state_bytes"] for st in run["steps"]) > 0
    header, rows = report._rows(metrics)
    state = rows[1][header.index("state MB")]
    assert state == f"{s['max_state_bytes'] / 2**20:.2f}"
    assert "state MB: the most optimizer state held at once over the run" in demo.table(metrics)


def test_plot_names_the_runs_lrs_has_a_time_panel_and_tells_lines_apart(tmp_path):
    config = dataclasses.replace(TINY, steps=6, eval_every=2)
    metrics = demo.run_demo(config, ["adamw", "adafrugal", "adafrugal+governor"],
                            out=tmp_path / "p", progress=False, tuned=False)
    # The lrs the runs used, not the config's (tuned lrs differ from it).
    for run in metrics["runs"].values():
        run["config"].update(lr=0.003, matrix_lr_ratio=0.25)
    assert "lr 0.003 (matrices x0.25)" in plots._title(metrics)
    fig = plots.figure(metrics)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    time_ax = axes["validation loss against wall time"]
    lines = {line.get_label(): line for line in time_ax.get_lines()}
    for run in metrics["runs"].values():
        assert list(lines[run["label"]].get_xdata()) == [e["time"] for e in run["evaluations"]]
    ada, gov = (lines[metrics["runs"][n]["label"]] for n in ("adafrugal", "adafrugal+governor"))
    assert (ada.get_linestyle(), ada.get_marker()) != (gov.get_linestyle(), gov.get_marker())
    assert ada.get_linestyle() != gov.get_linestyle() and ada.get_marker() != gov.get_marker()
    # Neither rho nor T changed in 6 steps: no flat panels, the title gives them.
    assert not any(t.startswith(("T:", "rho:")) for t in axes)
    assert fig._suptitle.get_text().endswith(
        f"rho = 0.25 and T = {registry.UPDATE_GAP} throughout, in every run with a subspace")
    steps = metrics["runs"]["adafrugal"]["steps"]
    steps[-1]["update_gap"] = 2 * registry.UPDATE_GAP
    steps[-1]["rho"] = 0.15
    titles = [ax.get_title() for ax in plots.figure(metrics).axes]
    assert any(t.startswith("T:") for t in titles) and any(t.startswith("rho:") for t in titles)


def test_the_int8_state_rows_hold_about_a_quarter_of_their_twins_state(tmp_path):
    out = tmp_path / "demo8"
    assert main(["demo", "--optimizers", "adamw", "adamw-8bit", "frugal", "frugal-8bit",
                 "--steps", "2", "--eval-every", "2", "--out", str(out), *TINY_ARGS]) == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    for twin in ("adamw", "frugal"):
        ours, fp32 = runs[f"{twin}-8bit"]["summary"], runs[twin]["summary"]
        assert ours["state_bytes"] < 0.3 * fp32["state_bytes"], twin
        assert ours["final_val_loss"] == pytest.approx(fp32["final_val_loss"], rel=1e-3), twin
