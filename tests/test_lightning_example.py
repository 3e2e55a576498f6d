"""examples/lightning_example.py: FRUGAL under lightning.Trainer, as the plain loop.

Needs Lightning (``pip install ".[lightning]"``, or pytorch_lightning): without it the
test is skipped and says so (an optional dependency, like the hf extra).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import frugal_kernels as fk

if importlib.util.find_spec("lightning") is None and \
        importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("Lightning is not installed (pip install '.[lightning]')",
                allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_example.py"


def load_example():
    spec = importlib.util.spec_from_file_location("lightning_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_example"] = module
    spec.loader.exec_module(module)
    return module


def plain_loop(example, steps):
    """What Lightning's automatic optimization should amount to: the ordinary loop."""
    module = example.TinyLM(max_steps=steps)
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    batches = iter(example.loader())
    for _ in range(steps):
        (ids,) = next(batches)
        opt.zero_grad()
        module.model(ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
    return module


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step_in_backward"])
def test_lightning_trains_frugal_as_the_plain_loop(in_backward):
    example = load_example()
    steps = 6
    trained = example.train(max_steps=steps, step_in_backward=in_backward)
    reference = plain_loop(example, steps)
    for (name, a), b in zip(trained.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name
    if in_backward:
        assert trained.handle.steps == steps
        assert all(p.grad is None for p in trained.model.parameters())
    ids = example.toy_batches()[:8]
    with torch.no_grad():
        assert trained.model(ids, labels=ids).loss < 5.4  # log(256) = 5.55 at the start


def test_lightnings_own_clip_after_a_step_in_backward_is_refused():
    """gradient_clip_val clips after backward (torch's clip_grad_norm_), where the
    gradients of a step in backward are gone: it raises instead of clipping nothing."""
    example = load_example()
    module = example.TinyLM(max_steps=2, step_in_backward=True)
    trainer = example.L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, gradient_clip_val=1.0)
    with pytest.raises(RuntimeError, match="step in backward"):
        trainer.fit(module, example.loader())
    assert fk.optim.in_backward.handle_of(trainer.optimizers[0]) is module.handle
