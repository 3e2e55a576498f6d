"""The fine-tuning task (frugal_kernels/lab/finetune.py): its data split, its cached base, the
LoRA row's memory and a whole run from the command line."""

import dataclasses
import json
import logging

import pytest
import torch

from frugal_kernels.__main__ import main
from frugal_kernels.lab import finetune
from frugal_kernels.lab.corpus import TokenDataset
from frugal_kernels.lab.train import TrainConfig, step_memory
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM

MAX_BYTES = 200_000
TINY = dataclasses.replace(finetune.DEFAULTS, model="tiny", steps=12, batch_size=2, seq_len=16,
                           warmup_steps=2, eval_every=2, eval_batches=1, max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def base_data():
    return finetune.finetune_data(TINY)[0]


def test_the_base_and_the_finetuning_data_share_no_file():
    base, tests = finetune.stdlib_split(max_bytes=None)
    base_names = {doc.name for doc in base}
    test_names = {doc.name for doc in tests}
    assert base_names and test_names
    assert not base_names & test_names
    assert not any(finetune.is_test_module(name) for name in base_names)
    assert all(finetune.is_test_module(name) for name in test_names)
    # The test suites are there (CPython's Lib/test), and no file's text is in both parts.
    assert any(name.startswith("test/test_") for name in test_names)
    assert not {doc.data for doc in base} & {doc.data for doc in tests if len(doc.data) > 64}


def test_finetune_bytes_caps_the_domain_only_and_keeps_the_base():
    small = dataclasses.replace(TINY, finetune_bytes=20_000)
    base, domain = finetune.finetune_data(small)
    full_base, full_domain = finetune.finetune_data(TINY)
    assert base.digest == full_base.digest
    def size(data):
        return len(data.train) + len(data.validation)  # byte tokens: one per byte
    assert size(domain) == 20_000 < size(full_domain)
    # The base of a run with a capped domain is the same cached base.
    assert finetune.base_settings(small) == finetune.base_settings(TINY)
    with pytest.raises(ValueError, match="finetune_bytes must be an int >= 1"):
        dataclasses.replace(TINY, finetune_bytes=0)


def test_test_modules_are_told_by_folder_and_name():
    assert finetune.is_test_module("test/test_os.py")
    assert finetune.is_test_module("idlelib/idle_test/htest.py")
    assert finetune.is_test_module("email/test_x.py")
    assert not finetune.is_test_module("unittest/case.py")
    assert not finetune.is_test_module("contest.py")


def test_the_base_is_cached_by_its_settings_and_rebuilt_when_they_change(tmp_path, base_data,
                                                                          caplog):
    settings = finetune.base_settings(TINY, base_steps=2)
    model, record = finetune.pretrained_base(settings, base_data, tmp_path, progress=False)
    assert record["built"] and (tmp_path / record["hash"] / "model.pt").exists()
    again, second = finetune.pretrained_base(settings, base_data, tmp_path, progress=False)
    assert not second["built"] and second["hash"] == record["hash"]
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    # Any other setting is another base, built anew beside the first.
    other = dataclasses.replace(settings, lr=settings.lr * 2)
    _, third = finetune.pretrained_base(other, base_data, tmp_path, progress=False)
    assert third["built"] and third["hash"] != record["hash"]
    # A cached base whose recorded settings are not those asked for is rebuilt, not reused.
    recorded = tmp_path / record["hash"] / "settings.json"
    edited = json.loads(recorded.read_text())
    edited["config"]["steps"] = 99
    recorded.write_text(json.dumps(edited))
    with caplog.at_level(logging.WARNING):
        _, fourth = finetune.pretrained_base(settings, base_data, tmp_path, progress=False)
    assert fourth["built"] and "other settings" in caplog.text
    assert json.loads(recorded.read_text())["config"]["steps"] == 2
    _, fifth = finetune.pretrained_base(settings, base_data, tmp_path, rebuild=True,
                                        progress=False)
    assert fifth["built"]


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_lora_rank_matches_frugals_state_full_subspace():
    for preset, rank in (("tiny", 10), ("small", 20)):
        assert finetune.lora_rank(LlamaForCausalLM(LlamaConfig.from_preset(preset))) == rank


def test_the_lora_rows_held_bytes_are_those_of_its_tensors(base_data):
    pytest.importorskip("peft")
    model = LlamaForCausalLM(TINY.model_config(256))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = finetune.ROWS["lora"].make(model, TINY)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert adapters and all(p.requires_grad for p in adapters)
    assert not any(p.requires_grad for p in frozen)
    rank = 10  # finetune.lora_rank of the tiny preset, before the adapters
    # fp32 adapters of 2 layers: r x (in + out) for 4 attention and 3 MLP matrices each.
    assert _nbytes(adapters) == 4 * rank * 2 * (4 * (64 + 64) + 3 * (64 + 176))
    ids, labels = next(base_data.batches("train", 2, 16, seed=0))
    model(ids, labels=labels).loss.backward()
    opt.step()
    memory = step_memory(model, opt)
    steps = [st["step"] for st in opt.state.values()]
    assert memory["weight_bytes"] == _nbytes(frozen) + _nbytes(adapters)
    assert memory["grad_bytes"] == _nbytes(adapters)
    assert memory["state_bytes"] == 2 * _nbytes(adapters) + _nbytes(steps)
    assert memory["held_bytes"] == (_nbytes(frozen) + 4 * _nbytes(adapters) + _nbytes(steps))
    # The base's weights are frozen: the step moved the adapters only.
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name.replace(".base_layer", "")])


def test_the_finetune_demo_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["demo", "--task", "finetune", "--model", "tiny", "--steps", "12", "--batch-size", "2",
            "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1", "--max-bytes",
            str(MAX_BYTES), "--device", "cpu", "--quiet", "--base-steps", "2",
            "--base-cache", str(tmp_path / "base"), "--out", str(out),
            "--optimizers", "frugal", "adamw+governor"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["runs"]) == ["frugal", "adamw", "adamw+governor"]
    assert metrics["base"]["built"] and metrics["base"]["steps"] == 2
    assert metrics["data"]["source"] == "stdlib tests"
    for run in metrics["runs"].values():
        assert run["forgetting"] > 0
    governed = metrics["runs"]["adamw+governor"]
    assert governed["summary"]["flop_budget"] == metrics["runs"]["adamw"]["summary"]["flops"]
    assert any(d["action"] == "decay" for d in governed["decisions"])
    assert "Forgetting" in printed and "FLOPs vs its twin" in printed
    assert "Forgetting" in (out / "table.md").read_text()
    # The second run finds the base in the cache (--overwrite: the same --out); its rows
    # are labelled as the demo's, from what the run did.
    assert main(argv[:-2] + ["badam", "--badam-switch-every", "3", "--overwrite"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert not metrics["base"]["built"]
    assert metrics["runs"]["badam"]["label"] == "BAdam K=3"


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--optimizers", "lora"], "rows of --task finetune only"),
    (["demo", "--task", "finetune", "--optimizers", "dqt8"], "not a row of --task finetune"),
])
def test_a_row_of_the_other_task_is_refused_before_any_training(argv, fragment, capsys,
                                                                 tmp_path):
    assert main(argv + ["--out", str(tmp_path / "out"), "--base-cache",
                        str(tmp_path / "base")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "base").exists()


def test_data_replaces_the_finetuning_domain_not_the_base(tmp_path):
    (tmp_path / "notes.txt").write_text("fine-tune on this\n" * 2000)
    base, data = finetune.finetune_data(dataclasses.replace(TINY, data=str(tmp_path)))
    assert base.source == "stdlib without tests"
    assert data.source == str(tmp_path) and data.train[:4].tolist() == list(b"fine")


def test_the_train_command_fine_tunes_the_cached_base_and_resumes(tmp_path):
    from frugal_kernels.lab.finetune import base_settings, finetune_data, pretrained_base

    common = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
              "--max-bytes", str(MAX_BYTES), "--device", "cpu", "--quiet",
              "--base-cache", str(tmp_path / "base")]
    out = tmp_path / "out"
    argv = ["train", "--task", "finetune", "--optimizer", "lora", "--steps", "4",
            "--eval-every", "2", "--base-steps", "2", "--save-model", "--out", str(out), *common]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "finetune" and metrics["data"]["source"] == "stdlib tests"
    # It started from the cached base: the frozen weights are the base's.
    config = dataclasses.replace(finetune.DEFAULTS, model="tiny", batch_size=2, seq_len=16,
                                 eval_batches=1, max_bytes=MAX_BYTES)
    base, record = pretrained_base(base_settings(config, 2), finetune_data(config)[0],
                                   tmp_path / "base")
    assert not record["built"]
    trained = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(trained["lm_head.weight"], base.lm_head.weight)
    # A resume of the fine-tuning run takes its task from the checkpoint.
    assert main(["train", "--resume", str(out / "checkpoint.pt"), "--device", "cpu",
                 "--quiet", "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "metrics.json").read_text())["task"] == "finetune"
    assert main(["train", "--optimizer", "lora", "--out", str(tmp_path / "no"), *common]) == 2
