"""FRUGAL inside Lightning: return it from ``configure_optimizers``.

A tiny LLaMA-style model (frugal_kernels.model, nothing downloaded) learns a toy byte
sequence with ``lightning.Trainer`` on the CPU. ``configure_optimizers`` returns FRUGAL
(over ``param_groups``: attention and MLP matrices projected, the rest on AdamW) and an
LR schedule stepped every step; Lightning's automatic optimization then calls
``optimizer.step(closure)`` as for any ``torch.optim`` optimizer. With
``step_in_backward=True`` each tensor is stepped inside backward as its gradient
completes (``frugal_kernels.step_in_backward``): Lightning's loop is unchanged (the
closure's backward does the stepping), and a clip is the step's own (``max_grad_norm``),
not Lightning's ``gradient_clip_val``, which would find no gradient.

Run it with ``python examples/lightning_example.py [--step-in-backward]`` after
``pip install ".[lightning]"`` (or with ``pytorch_lightning`` installed).
"""

from __future__ import annotations

import sys

import torch

import frugal_kernels as fk
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM

try:
    import lightning as L
except ImportError:  # the older package name
    import pytorch_lightning as L


def toy_batches(count: int = 64, length: int = 32, seed: int = 0) -> torch.Tensor:
    """Byte sequences of a repeating pattern with a random phase: learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 256, (count, 1), generator=gen)
    return (starts + 7 * torch.arange(length)) % 256


class TinyLM(L.LightningModule):
    def __init__(self, lr: float = 3e-3, max_steps: int = 20, step_in_backward: bool = False,
                 max_grad_norm: float | None = None, seed: int = 0):
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"), seed=seed)
        self.lr, self.max_steps = lr, max_steps
        self.step_in_backward, self.max_grad_norm = step_in_backward, max_grad_norm
        self.handle = None

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(ids, labels=ids).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = fk.FRUGAL(fk.param_groups(self.model), lr=self.lr, density=0.25,
                        projection="columns", update_gap=5)
        if self.step_in_backward:
            self.handle = fk.step_in_backward(opt, max_grad_norm=self.max_grad_norm)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batch_size: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(toy_batches()),
                                       batch_size=batch_size, shuffle=False)


def train(max_steps: int = 20, step_in_backward: bool = False, **options) -> TinyLM:
    module = TinyLM(max_steps=max_steps, step_in_backward=step_in_backward, **options)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader())
    return module


if __name__ == "__main__":
    in_backward = "--step-in-backward" in sys.argv[1:]
    module = train(step_in_backward=in_backward)
    ids = toy_batches()[:8]
    with torch.no_grad():
        loss = module.model(ids, labels=ids).loss.item()
    print(f"trained 20 steps with FRUGAL{' stepped inside backward' if in_backward else ''}"
          f" under Lightning; loss on the first batch {loss:.3f} (log(256) = 5.545 at start)")
