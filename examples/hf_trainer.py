"""FRUGAL inside Hugging Face's ``transformers.Trainer``: pass it through ``optimizers``.

A tiny ``LlamaForCausalLM`` built from a config (nothing is downloaded) learns a toy
token sequence; the Trainer saves a checkpoint halfway and a second run resumes from
it. Run it with ``python examples/hf_trainer.py [output_dir]`` after
``pip install ".[hf]"``.
"""

from __future__ import annotations

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


def make_trainer(output_dir: str, max_steps: int = 20, save_steps: int = 10, seed: int = 0):
    from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup

    model = tiny_llama(seed)
    # param_groups reads HF Llama's names: attention and MLP matrices are projected;
    # embeddings, norms and the head get AdamW.
    optimizer = fk.FRUGAL(fk.param_groups(model), lr=3e-3, weight_decay=0.0, density=0.25,
                          projection="columns", update_gap=5)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=max_steps)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps,
                             per_device_train_batch_size=8, save_steps=save_steps,
                             logging_steps=5, report_to=[], use_cpu=True, seed=seed,
                             dataloader_num_workers=0,
                             disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Tokens(),
                   optimizers=(optimizer, scheduler))


def main(output_dir: str) -> None:
    trainer = make_trainer(output_dir)
    result = trainer.train()
    print(f"trained {result.global_step} steps, final loss {result.training_loss:.3f}")
    resumed = make_trainer(output_dir)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-10")
    print("resumed from checkpoint-10 and trained to step", resumed.state.global_step)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
