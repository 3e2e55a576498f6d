"""FRUGAL inside Hugging Face's ``transformers.Trainer``: pass it through ``optimizers``.

A tiny ``LlamaForCausalLM`` built from a config (nothing is downloaded) learns a toy
token sequence; the Trainer saves a checkpoint halfway and a second run resumes from
it. Run it with ``python examples/hf_trainer.py [--step-in-backward] [output_dir]``
after ``pip install ".[hf]"``.

The Trainer's clip by ``max_grad_norm`` goes through the optimizer: ``OptimizerClipTrainer``
(a ``Trainer`` with its clip hook overridden; mix it into a Trainer subclass of your own
the same way) calls ``optimizer.clip_grad_norm_(max_grad_norm)`` where the Trainer would
call ``torch.nn.utils.clip_grad_norm_`` through accelerate: one read of the gradients
gives the norm the Trainer logs, and the next step applies the clip factor as it reads
them and skips a step whose gradients hold a NaN or inf, where torch's clip reads them,
then reads and writes them again.

With ``--step-in-backward`` each tensor is stepped inside backward
(``frugal_kernels.step_in_backward``) as its gradient completes, and the gradient freed:
the Trainer's loop is unchanged (its ``optimizer.step()`` is then bookkeeping for the LR
scheduler). The Trainer's own clip runs after backward, when the gradients are gone, so
it is switched off (``max_grad_norm=0``; a clip there raises) and the step clips each
tensor's gradient instead (``max_grad_norm=1.0, clip="tensor"``).
"""

from __future__ import annotations

import functools
import sys
import tempfile

import torch

import frugal_kernels as fk


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Sequences of a repeating pattern with a random phase: learnable in a few steps."""

    def __init__(self, count: int = 64, length: int = 16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, 64, (count, 1), generator=gen)
        self.ids = (starts + 3 * torch.arange(length)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@functools.lru_cache(maxsize=None)
def optimizer_clip_trainer():
    """``transformers.Trainer`` with its clip by ``args.max_grad_norm`` routed through the
    optimizer's ``clip_grad_norm_`` (FRUGAL, AdaFRUGAL, DQT, a swapped torch optimizer).

    The Trainer clips in ``_clip_grad_norm(model)``, which returns the norm it logs; it
    calls ``accelerator.clip_grad_norm_``, i.e. ``torch.nn.utils.clip_grad_norm_``, and
    with ``max_grad_norm=0`` it still takes the norm that way for its log, so switching
    its clip off and clipping in a callback would read the gradients twice. Overriding
    the hook is the one place where the optimizer's clip replaces the Trainer's read. The
    hook is private to transformers: a version without it is refused here rather than
    left clipping nothing. DeepSpeed clips inside its own engine: the Trainer's clip
    stands there, as it does for an optimizer without ``clip_grad_norm_``."""
    from accelerate.utils import DistributedType
    from transformers import Trainer

    if not callable(getattr(Trainer, "_clip_grad_norm", None)):
        raise RuntimeError("this transformers version's Trainer has no _clip_grad_norm hook "
                           "to route its clip through the optimizer: use Trainer with "
                           "max_grad_norm as usual (torch's clip)")

    class OptimizerClipTrainer(Trainer):
        def _clip_grad_norm(self, model):
            # accelerate wraps the optimizer; the wrapper's step calls the inner one's.
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            if not callable(getattr(optimizer, "clip_grad_norm_", None)) or \
                    self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                return super()._clip_grad_norm(model)
            # fp16 under a GradScaler: the norm of the unscaled gradients, as torch's clip.
            self.accelerator.unscale_gradients()
            return optimizer.clip_grad_norm_(self.args.max_grad_norm)

    return OptimizerClipTrainer


def make_trainer(output_dir: str, max_steps: int = 20, save_steps: int = 10, seed: int = 0,
                 step_in_backward: bool = False, max_grad_norm: float = 1.0):
    """The Trainer; its clip by ``max_grad_norm`` runs in the optimizer
    (:func:`optimizer_clip_trainer`). ``step_in_backward``: step each tensor inside
    backward, clipped by its own norm to ``max_grad_norm`` (the Trainer's clip after
    backward is switched off)."""
    from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup

    model = tiny_llama(seed)
    # param_groups reads HF Llama's names: attention and MLP matrices are projected;
    # embeddings, norms and the head get AdamW.
    optimizer = fk.FRUGAL(fk.param_groups(model), lr=3e-3, weight_decay=0.0, density=0.25,
                          projection="columns", update_gap=5)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=max_steps)
    trainer_clip = max_grad_norm
    if step_in_backward:
        fk.step_in_backward(optimizer, max_grad_norm=max_grad_norm or None, clip="tensor")
        trainer_clip = 0.0
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps,
                             max_grad_norm=trainer_clip,
                             per_device_train_batch_size=8, save_steps=save_steps,
                             logging_steps=5, report_to=[], use_cpu=True, seed=seed,
                             dataloader_num_workers=0,
                             disable_tqdm=True)
    # No clip, or the step in backward's own: the plain Trainer.
    cls = optimizer_clip_trainer() if trainer_clip > 0 else Trainer
    return cls(model=model, args=args, train_dataset=Tokens(), optimizers=(optimizer, scheduler))


def main(output_dir: str, step_in_backward: bool = False) -> None:
    trainer = make_trainer(output_dir, step_in_backward=step_in_backward)
    result = trainer.train()
    print(f"trained {result.global_step} steps"
          f"{' (each tensor stepped inside backward)' if step_in_backward else ''}, "
          f"final loss {result.training_loss:.3f}")
    resumed = make_trainer(output_dir, step_in_backward=step_in_backward)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-10")
    print("resumed from checkpoint-10 and trained to step", resumed.state.global_step)


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    if set(flags) - {"--step-in-backward"}:
        sys.exit(f"usage: {sys.argv[0]} [--step-in-backward] [output_dir]")
    main(paths[0] if paths else tempfile.mkdtemp(), step_in_backward=bool(flags))
