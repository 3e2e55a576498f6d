"""examples/hf_trainer.py: FRUGAL through transformers.Trainer, saved and resumed exactly.

Needs the ``hf`` extra (``pip install ".[hf]"``; CI installs it): without
transformers and accelerate the test is skipped and says so.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import frugal_kernels as fk

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install '.[hf]')")
pytest.importorskip("accelerate", reason="the hf extra is not installed (pip install '.[hf]')")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_trainer"] = module
    spec.loader.exec_module(module)
    return module


def test_trainer_trains_frugal_and_resumes_exactly(tmp_path):
    example = load_example()
    whole = example.make_trainer(str(tmp_path / "whole"))
    result = whole.train()
    assert result.global_step == 20
    losses = [h["loss"] for h in whole.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    assert (tmp_path / "whole" / "checkpoint-10").is_dir()

    resumed = example.make_trainer(str(tmp_path / "whole"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-10"))
    assert resumed.state.global_step == 20
    # The FRUGAL state (subspaces, moments, generator) and the schedule come back from
    # the checkpoint: the resumed run ends on the same parameters, bit for bit.
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def _final_params(trainer):
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_trainer_with_the_step_in_backward_equals_the_ordinary_trainer(tmp_path):
    """The --step-in-backward variant: the Trainer's loop unchanged, each tensor stepped
    inside backward and its gradient freed; without a clip it ends on the ordinary
    Trainer's parameters bit for bit, and with its per-tensor clip it trains."""
    example = load_example()
    ordinary = _final_params(example.make_trainer(str(tmp_path / "a"), max_steps=6,
                                                  save_steps=100, max_grad_norm=0.0))
    trainer = example.make_trainer(str(tmp_path / "b"), max_steps=6, save_steps=100,
                                   step_in_backward=True, max_grad_norm=0.0)
    in_backward = _final_params(trainer)
    assert trainer.state.global_step == 6
    assert all(p.grad is None for p in trainer.model.parameters())
    for i, (a, b) in enumerate(zip(in_backward, ordinary)):
        assert torch.equal(a, b), i
    clipped = example.make_trainer(str(tmp_path / "c"), max_steps=6, save_steps=100,
                                   step_in_backward=True)
    # The Trainer's clip (accelerate's, after backward) would find no gradient and clip
    # nothing without a word: it is off, and the step clips each tensor instead.
    handle = fk.optim.in_backward.handle_of(clipped.optimizer)
    assert clipped.args.max_grad_norm == 0 and handle.max_grad_norm == 1.0
    result = clipped.train()
    start = example.tiny_llama()
    assert result.global_step == 6 and result.training_loss < 4.1  # log(64) = 4.16 at start
    for a, b in zip(clipped.model.parameters(), start.parameters()):
        assert torch.isfinite(a).all() and not torch.equal(a, b)


@pytest.mark.slow  # about 17 s: two Trainers
def test_the_trainers_clip_runs_in_the_optimizer(tmp_path, monkeypatch):
    """max_grad_norm > 0: each step's clip is the optimizer's clip_grad_norm_ (one read of
    the gradients, the factor applied inside the step); the Trainer's own clip
    (accelerate's, torch's math) is not called, not even for the logged norm, which is the
    optimizer's. The first step's norm is the one the plain Trainer's clip measures on
    the same gradients."""
    from accelerate import Accelerator
    from transformers import Trainer

    example = load_example()
    torch_norms, ours = [], []
    real = Accelerator.clip_grad_norm_

    def recorded(self, *args, **kwargs):
        torch_norms.append(real(self, *args, **kwargs))
        return torch_norms[-1]
    monkeypatch.setattr(Accelerator, "clip_grad_norm_", recorded)
    trainer = example.make_trainer(str(tmp_path / "a"), max_steps=6, save_steps=100)
    assert isinstance(trainer, example.optimizer_clip_trainer())
    opt = trainer.optimizer
    clip = opt.clip_grad_norm_

    def counted(max_norm, *args, **kwargs):
        ours.append((max_norm, clip(max_norm, *args, **kwargs)))
        return ours[-1][1]
    opt.clip_grad_norm_ = counted
    result = trainer.train()
    assert result.global_step == 6 and result.training_loss < 4.1  # log(64) = 4.16 at start
    assert torch_norms == [] and [m for m, _ in ours] == [1.0] * 6
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged and logged[-1] == pytest.approx(ours[4][1].item())  # logged at step 5

    plain = example.make_trainer(str(tmp_path / "b"), max_steps=1, save_steps=100)
    plain.__class__ = Trainer  # torch's clip, through accelerate
    plain.train()
    assert len(torch_norms) == 1
    assert ours[0][1].item() == pytest.approx(torch_norms[0].item(), rel=1e-5)


def test_param_groups_reads_hf_llama_names():
    import frugal_kernels as fk

    model = load_example().tiny_llama()
    groups = fk.param_groups(model)
    projected = {id(p) for g in groups if g.get("projected", True) for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in projected}
    assert names and all(("self_attn" in n or "mlp" in n) and n.endswith("weight")
                         for n in names)
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in names)
