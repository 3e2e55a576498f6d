"""examples/hf_trainer.py: FRUGAL through transformers.Trainer, saved and resumed exactly.

Needs the ``hf`` extra (``pip install ".[hf]"``; CI installs it): without
transformers and accelerate the test is skipped and says so.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

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


def test_param_groups_reads_hf_llama_names():
    import frugal_kernels as fk

    model = load_example().tiny_llama()
    groups = fk.param_groups(model)
    projected = {id(p) for g in groups if g.get("projected", True) for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in projected}
    assert names and all(("self_attn" in n or "mlp" in n) and n.endswith("weight")
                         for n in names)
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in names)
