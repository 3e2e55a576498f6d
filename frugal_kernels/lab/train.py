"""A training loop for the LLaMA model on a byte corpus, with the metrics the demo reports.

:func:`train` runs one optimizer for one :class:`TrainConfig` and returns a :class:`RunResult`
holding, per step, the training loss, the step and optimizer times, the optimizer-state bytes,
the FLOPs spent so far and the peak memory; per evaluation, the validation loss; and every
decision of the compute governor when the run has a FLOP budget.

Example::

    config = TrainConfig(model="tiny", steps=100, batch_size=8, seq_len=64)
    result = train(config, lambda model, cfg: torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    print(result.final_val_loss, result.state_bytes)
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from frugal_kernels._layout import STATE_FREE_RULES
from frugal_kernels._shard import local
from frugal_kernels.lab.corpus import DEFAULT_MAX_BYTES, NOISE_KINDS, TokenDataset, load_corpus
from frugal_kernels.lab.schedule import evaluation_due, governed_schedule
from frugal_kernels.governor import Governor, optimizer_flops
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM, flops_per_token
from frugal_kernels.optim.in_backward import handle_of
from frugal_kernels.optim.memory import PeakMemory, release_freed_memory, storage_bytes
from frugal_kernels.optim.protocol import protocol_of, state_tensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "OptimizerFactory",
    "RunResult",
    "TrainConfig",
    "TrainingInterrupted",
    "check_data",
    "load_checkpoint",
    "metric_logger",
    "lr_factor",
    "lr_groups",
    "optimizer_state_bytes",
    "optimizer_step_flops",
    "step_memory",
    "steps_for_budget",
    "train",
]


@dataclass
class TrainConfig:
    """Settings of one training run; plain values, so that it is saved with the metrics.

    Every optimizer gets the same two parameter groups (:func:`lr_groups`): the embeddings,
    norms and head at ``lr``, the projected matrices at ``matrix_lr_ratio * lr``.
    The learning rate warms up linearly over ``warmup_steps``, then ``schedule`` takes it
    down to ``min_lr_ratio * lr`` at ``steps``: ``"wsd"`` (warmup-stable-decay) holds it
    and decays linearly over the last ``cooldown_fraction`` of the steps; ``"cosine"``
    follows a cosine from the end of the warmup. Validation runs every ``eval_every`` steps and at
    the end, on the same ``eval_batches`` batches of ``batch_size`` each time.
    ``flop_budget`` puts the run under a :class:`~frugal_kernels.Governor` built with
    ``governor`` (its keyword arguments); with ``decay_fraction`` among them the governor
    starts the WSD decay (:mod:`frugal_kernels.lab.schedule`) and ends the run after it.

    ``select`` trains on online-selected batches (:class:`~frugal_kernels.data.OnlineSelector`
    with policy ``select``): each step draws ``candidates`` batches, scores them (a no-grad
    forward pass, or a bigram lookup under ``"ngram"``, nothing under ``"random"``) and
    trains on the ``keep`` fraction (``keep = 1 / candidates`` trains on ``batch_size``
    sequences, as a plain step does); the scoring counts in the run's FLOPs (a forward is a
    third of :func:`~frugal_kernels.model.flops_per_token`). ``"rho"`` first trains a
    ``select_reference_model`` reference model on ``select_reference_steps`` batches of the
    training split (another seed), ``"ngram"`` counts the byte pairs of as many batches
    (:class:`~frugal_kernels.data.BigramReference`), their FLOPs counted too
    (:func:`selection_flops`). With ``select_trial`` in
    ``governor`` the governor turns selection on and off (docs/governor.md). ``data_noise``
    replaces that fraction of the training documents with low-value text
    (:func:`~frugal_kernels.lab.corpus.add_noise`) when the data is loaded from ``data``.

    ``badam_switch_every`` is BAdam's K, the steps each block trains before the next (the
    demo's BAdam rows; other optimizers ignore it).

    ``parallel`` spreads the run over the processes of an initialized default process
    group (``torchrun``): ``"ddp"`` (DistributedDataParallel) or ``"fsdp"`` (FSDP2's
    ``fully_shard`` on every decoder layer and the whole model). ``batch_size`` is then
    the global batch, each rank taking its share of every batch, so that the run is
    the one-process run but for rounding.

    The defaults are those of ``frugal-kernels demo`` (docs/demo.md): batches of 16
    sequences, and a run short enough for the whole demo, nine optimizers, to take about
    five minutes on a 2-core CPU.
    """

    model: str = "small"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 1e-3
    matrix_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    schedule: str = "wsd"
    cooldown_fraction: float = 0.2
    grad_clip: Optional[float] = 1.0
    eval_every: int = 25
    eval_batches: int = 16
    seed: int = 0
    device: str = "cpu"
    data: Optional[str] = None
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES
    finetune_bytes: Optional[int] = None
    flop_budget: Optional[float] = None
    governor: dict[str, Any] = field(default_factory=dict)
    parallel: Optional[str] = None
    select: Optional[str] = None
    keep: float = 0.5
    candidates: int = 2
    select_reference_steps: int = 50
    select_reference_model: str = "tiny"
    data_noise: float = 0.0
    badam_switch_every: int = 20

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "badam_switch_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must lie in [0, steps={self.steps}], "
                             f"got {self.warmup_steps}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {', '.join(map(str, PARALLEL))}, got "
                             f"{self.parallel!r}")
        if self.finetune_bytes is not None and (isinstance(self.finetune_bytes, bool) or not
                                                isinstance(self.finetune_bytes, int)
                                                or self.finetune_bytes < 1):
            raise ValueError(f"finetune_bytes must be an int >= 1 or None, got "
                             f"{self.finetune_bytes!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.schedule!r}")
        if not 0.0 < self.cooldown_fraction <= 1.0:
            raise ValueError(f"cooldown_fraction must lie in (0, 1], got {self.cooldown_fraction}")
        for name in ("lr", "matrix_lr_ratio"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive finite number, got "
                                 f"{getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        # The weights, the batches and the optimizers' own generators (DQT's rounding, BAdam's
        # block order) are all seeded with it; the narrowest of them takes 32 bits.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        self._check_selection()
        if self.governor.get("decay_fraction") is not None and self.schedule != "wsd":
            raise ValueError("a governor with decay_fraction starts the decay of a "
                             f"warmup-stable-decay schedule; schedule={self.schedule!r} has "
                             "none: use schedule='wsd'")

    def _check_selection(self) -> None:
        from frugal_kernels.data import POLICIES

        if self.select is not None and self.select not in POLICIES:
            raise ValueError(f"select must be one of {', '.join(POLICIES)} or None, got "
                             f"{self.select!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or \
                not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must lie in (0, 1], got {self.keep!r}")
        for name in ("candidates", "select_reference_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.data_noise, bool) or not isinstance(self.data_noise, (int, float)) \
                or not 0.0 <= self.data_noise < 1.0:
            raise ValueError(f"data_noise must lie in [0, 1), got {self.data_noise!r}")
        from frugal_kernels.model import PRESETS

        if self.select_reference_model not in PRESETS:
            raise ValueError(f"select_reference_model must be one of {', '.join(PRESETS)}, "
                             f"got {self.select_reference_model!r}")
        if self.governor.get("select_trial") is not None and self.select is None:
            raise ValueError("a governor with select_trial turns selection on and off: give "
                             "select (the policy) too")
        if self.select is not None and self.parallel is not None:
            raise ValueError("online selection runs in one-process runs only")

    def selected_batch(self) -> int:
        """The sequences a selected step trains on: ``keep`` of ``candidates`` batches."""
        return max(1, math.ceil(self.keep * self.candidates * self.batch_size - 1e-9))

    def model_config(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig.from_preset(self.model, vocab_size=vocab_size,
                                       max_seq_len=self.seq_len)

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def with_steps(self, steps: int, *, warmup_steps: Optional[int] = None,
                   eval_every: Optional[int] = None) -> "TrainConfig":
        """This config for a run of ``steps`` steps: the warmup and the evaluation interval
        keep their proportion to the steps unless given, so that a short run still warms up
        and gets evaluations (for the governor)."""
        if warmup_steps is None:
            warmup_steps = steps * self.warmup_steps // self.steps
        if eval_every is None:
            eval_every = max(1, steps * self.eval_every // self.steps)
        return dataclasses.replace(self, steps=steps, warmup_steps=warmup_steps,
                                   eval_every=eval_every)


def lr_groups(model: nn.Module, config: TrainConfig, **projected_options) -> list[dict]:
    """:func:`~frugal_kernels.param_groups` with the config's two learning rates: ``lr`` for
    the embeddings, norms and head, ``matrix_lr_ratio * lr`` for the projected matrices.

    Every demo optimizer, AdamW and the peers included, is built from these groups, so that
    a comparison measures the optimizers rather than their parametrisations.
    """
    from frugal_kernels.optim import param_groups

    groups = param_groups(model, **projected_options)
    for group in groups:
        group["lr"] = config.lr * (config.matrix_lr_ratio if group["projected"] else 1.0)
    return groups


# An optimizer factory gets the model and the run's config (steps, lr, weight decay).
OptimizerFactory = Callable[[nn.Module, TrainConfig], Optimizer]


SCHEDULES = ("wsd", "cosine")
PARALLEL = (None, "ddp", "fsdp")


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float,
              schedule: str = "cosine", cooldown_fraction: float = 0.2) -> float:
    """Multiplier of the base lr for update ``step`` (0-based): linear warmup, then the
    cosine, or the stable phase and a linear cooldown over the last ``cooldown_fraction``
    of the steps (``"wsd"``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "wsd":
        cooldown = max(1, round(cooldown_fraction * steps))
        progress = min(1.0, max(0.0, (step - (steps - cooldown)) / cooldown))
        return 1.0 - (1.0 - min_lr_ratio) * progress
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_state_bytes(opt: Optimizer) -> int:
    """Bytes of the optimizer's state tensors now (its ``state_bytes()``, any optimizer's
    through :func:`~frugal_kernels.optim.protocol_of`)."""
    return int(protocol_of(opt).state_bytes())


def step_memory(model: nn.Module, opt: Optimizer) -> dict[str, int]:
    """Bytes of the training state held during a step, from the tensors themselves (call it
    between ``opt.step()`` and ``zero_grad``): the weights, their gradients, the optimizer's
    state, and ``held``, the three together with every storage counted once.

    An optimizer that steps in backward (:func:`~frugal_kernels.step_in_backward`) has
    freed its gradients by then: its gradient bytes are the most that were alive at once
    during backward (``handle.peak_grad_bytes``)."""
    # A QuantLinear's weight counts its codes and scales (storage_bytes reads them).
    params = list(model.parameters())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = list(state_tensors(opt))
    memory = {"weight_bytes": storage_bytes(params), "grad_bytes": storage_bytes(grads),
              "state_bytes": optimizer_state_bytes(opt),
              "held_bytes": storage_bytes(params + grads + state)}
    handle = handle_of(opt)
    if handle is not None:
        memory["grad_bytes"] += handle.peak_grad_bytes
        memory["held_bytes"] += handle.peak_grad_bytes
    return memory


def optimizer_step_flops(opt: Optimizer) -> int:
    """FLOPs of one step of ``opt`` as its state stands now (call it after ``opt.step()``).

    Coordinates with AdamW moments (``exp_avg``; compact for FRUGAL's subsets) are counted at
    the AdamW rate, the others at the rate of their group's ``state_free`` rule (SGD for groups
    that have none, e.g. a torch optimizer's parameters without moments). For low-rank FRUGAL
    the projections' matmuls are left out, as the governor's table has no entry for them.
    Under FSDP2 (DTensor parameters) it counts this rank's rows.
    """
    flops = 0
    for group in opt.param_groups:
        rest_rule = group.get("state_free")
        if rest_rule not in STATE_FREE_RULES:
            rest_rule = "sgd"
        for p in group["params"]:
            exp_avg = opt.state[p].get("exp_avg") if p in opt.state else None
            # This rank's: a DTensor's (FSDP2) block and the state of its rows.
            numel = local(p).numel()
            state_full = 0 if exp_avg is None else min(local(exp_avg).numel(), numel)
            flops += optimizer_flops(state_full, "adamw")
            flops += optimizer_flops(numel - state_full, rest_rule)
    return flops


def steps_for_budget(budget: float, config: TrainConfig, vocab_size: int) -> int:
    """The most steps of ``config``'s shape that ``budget`` FLOPs pay for, counting each step's
    optimizer as AdamW over every parameter (the dearest case, so the schedule fits)."""
    model_config = config.model_config(vocab_size)
    per_step = (config.tokens_per_step() * flops_per_token(model_config, config.seq_len)
                + optimizer_flops(model_config.num_params(), "adamw"))
    steps = int(budget // per_step)
    if steps < 1:
        raise ValueError(f"a budget of {budget:.3g} FLOPs does not pay for one step "
                         f"({per_step:.3g} FLOPs)")
    return steps


def check_data(data: TokenDataset, config: TrainConfig) -> None:
    """Refuse, before any training, data too small for ``config``'s batches: a training
    window of ``seq_len`` bytes and a validation batch of ``batch_size`` such windows."""
    train_tokens, val_tokens = len(data.train), len(data.validation)
    need = config.batch_size * config.seq_len
    if train_tokens < config.seq_len or val_tokens < need:
        raise ValueError(
            f"the data {data.source!r} is too small for batches of {config.batch_size} x "
            f"{config.seq_len} bytes: it splits into {train_tokens:,} training and "
            f"{val_tokens:,} validation bytes, and validation needs at least {need:,}; give "
            "more text, or a smaller batch size or sequence length")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`train`: ``result`` holds the steps finished before it (its
    ``stop_reason`` says where the run stopped). A KeyboardInterrupt, so that code that
    does not know it stops as on any Ctrl-C."""

    def __init__(self, result: "RunResult") -> None:
        super().__init__(result.stop_reason)
        self.result = result


CHECKPOINT_FORMAT = "frugal-kernels train checkpoint 1"


def load_checkpoint(path) -> dict[str, Any]:
    """A checkpoint :func:`train` wrote (``checkpoint=``), read with ``weights_only=True``;
    ``ValueError`` for a file that is not one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(path)!r} does not exist") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{str(path)!r} is not a training checkpoint ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a training checkpoint of frugal-kernels train")
    return state


class _Logger:
    """Scalars of a run sent to TensorBoard or Weights & Biases: ``logger(step, values)``."""

    def __init__(self, kind: str, folder, config: "TrainConfig", name: str) -> None:
        self.kind = kind
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--log tensorboard needs the tensorboard package, which is not "
                                 "installed (pip install tensorboard)") from None
            self._writer = SummaryWriter(log_dir=str(folder))
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise ValueError("--log wandb needs the wandb package, which is not installed "
                                 "(pip install wandb)") from None
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(project="frugal-kernels", name=name, dir=str(folder),
                                   config=dataclasses.asdict(config))
        else:
            raise ValueError(f"log must be 'tensorboard' or 'wandb', got {kind!r}")

    def __call__(self, step: int, values: dict[str, float]) -> None:
        if self.kind == "tensorboard":
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
        else:
            self._run.log(values, step=step)

    def close(self) -> None:
        if self.kind == "tensorboard":
            self._writer.close()
        else:
            self._run.finish()


def metric_logger(kind: str, folder, config: TrainConfig, name: str = "") -> _Logger:
    """A logger for :func:`train`'s ``log``: ``"tensorboard"`` (event files under ``folder``)
    or ``"wandb"`` (a run of the project frugal-kernels). ``ValueError`` when the package is
    not installed."""
    return _Logger(kind, folder, config, name)


@dataclass
class RunResult:
    """What :func:`train` measured. Times are seconds, memory and state are bytes.

    ``steps`` has one record per optimizer step, ``evaluations`` one per validation pass,
    ``decisions`` the governor's history (empty without a budget) and ``optimizer_history``
    the optimizer's own record of subspace and T changes (FRUGAL, AdaFRUGAL).
    """

    name: str
    optimizer: str
    config: dict[str, Any]
    num_params: int
    flops_per_token: int
    stop_reason: str
    wall_time: float
    peak_memory: int
    peak_memory_kind: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    optimizer_history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steps_done(self) -> int:
        return len(self.steps)

    @property
    def final_val_loss(self) -> float:
        return self.evaluations[-1]["val_loss"]

    @property
    def flops(self) -> float:
        return self.steps[-1]["flops"]

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes after the last step."""
        return self.steps[-1]["state_bytes"]

    @property
    def held_bytes(self) -> int:
        """Most bytes of weights, gradients and optimizer state held during one step."""
        return max(s["held_bytes"] for s in self.steps)

    @property
    def max_state_bytes(self) -> int:
        return max(s["state_bytes"] for s in self.steps)

    @property
    def step_time(self) -> float:
        # Medians: other work on a shared machine shows up as outliers, not as a shift.
        return statistics.median(s["step_time"] for s in self.steps)

    @property
    def optimizer_time(self) -> float:
        return statistics.median(s["optimizer_time"] for s in self.steps)

    def noise(self) -> Optional[dict[str, float]]:
        """On a noised corpus, the fraction of the sequences offered and of those trained on
        that were noise of each kind (``offered_shuffled``, ``kept_shuffled``, ...); None on
        a clean one."""
        if not self.steps or "offered" not in self.steps[0]:
            return None
        offered = sum(s["offered"] for s in self.steps)
        kept = sum(s["kept"] for s in self.steps)
        out = {}
        for kind in NOISE_KINDS[1:]:
            out[f"offered_{kind}"] = sum(s[f"offered_{kind}"] for s in self.steps) / offered
            out[f"kept_{kind}"] = sum(s[f"kept_{kind}"] for s in self.steps) / kept
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "noise": self.noise(),
            "steps": self.steps_done,
            "final_val_loss": self.final_val_loss,
            "state_bytes": self.state_bytes,
            "max_state_bytes": self.max_state_bytes,
            "held_bytes": self.held_bytes,
            "peak_memory": self.peak_memory,
            "peak_memory_kind": self.peak_memory_kind,
            "step_time": self.step_time,
            "optimizer_time": self.optimizer_time,
            "optimizer_share": self.optimizer_time / self.step_time,
            "flops": self.flops,
            "flop_budget": self.config["flop_budget"],
            "stop_reason": self.stop_reason,
            "wall_time": self.wall_time,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), **dataclasses.asdict(self)}


def _check_clip(config: TrainConfig, in_backward) -> None:
    """A step in backward has updated every tensor before a clip after backward could run:
    ``config.grad_clip`` must be the handle's own clip (``max_grad_norm``)."""
    if in_backward is None or config.grad_clip is None:
        return
    if in_backward.max_grad_norm != config.grad_clip:
        raise ValueError(
            f"grad_clip={config.grad_clip} clips the gradients after backward, but this "
            "optimizer steps in backward, before that: build it with "
            f"step_in_backward(opt, max_grad_norm={config.grad_clip}, clip='global') (the "
            "global norm, in two backward passes) or clip='tensor', or set grad_clip=None")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    total = sum(model(ids, labels=labels).loss.item() for ids, labels in batches)
    model.train()
    return total / len(batches)


def _reference_model(data: TokenDataset, config: TrainConfig, device: torch.device):
    """The reference of ``config.select``: RHO-LOSS's, a ``select_reference_model`` model
    trained with AdamW on ``select_reference_steps`` batches of the training split drawn
    with another seed; ``"ngram"``'s, a :class:`~frugal_kernels.data.BigramReference`
    counted on the same batches; None for the other policies. The references see what the
    trained model sees, noise included: RHO's cannot predict the noise either, so
    subtracting its loss leaves what is learnable and not yet learnt; the bigram's counts
    are mostly of clean text, under which shuffled bytes are improbable."""
    from frugal_kernels.data import BigramReference

    if config.select not in ("rho", "ngram"):
        return None
    batches = data.batches("train", config.batch_size, config.seq_len,
                           seed=config.seed + 1, device=device,
                           num_batches=config.select_reference_steps)
    if config.select == "ngram":
        reference = BigramReference(data.vocab_size)
        for input_ids, labels in batches:
            reference.fit(input_ids, labels)
        return reference
    model = LlamaForCausalLM(_reference_config(config, data.vocab_size),
                             seed=config.seed + 1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for input_ids, labels in batches:
        model(input_ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return model


def _reference_config(config: TrainConfig, vocab_size: int) -> LlamaConfig:
    return LlamaConfig.from_preset(config.select_reference_model, vocab_size=vocab_size,
                                   max_seq_len=config.seq_len)


def selection_flops(config: TrainConfig, vocab_size: int) -> tuple[float, float]:
    """``(once, per_step)`` of a run selecting by ``config.select``: the FLOPs of building
    its reference (``"rho"``: the reference model's training steps, forward, backward and
    AdamW; ``"ngram"``: the bigram counts) and those of one selected step's model passes,
    training and scoring (the optimizer's step not included)."""
    from frugal_kernels.data import BigramReference, scoring_flops_per_token

    if config.select is None:
        raise ValueError("selection_flops: config.select is None")
    fpt = flops_per_token(config.model_config(vocab_size), config.seq_len)
    reference_fpt, once = 0.0, 0.0
    reference_tokens = config.select_reference_steps * config.tokens_per_step()
    if config.select == "rho":
        reference_config = _reference_config(config, vocab_size)
        reference_fpt = flops_per_token(reference_config, config.seq_len)
        once = (reference_tokens * reference_fpt + config.select_reference_steps
                * optimizer_flops(reference_config.num_params(), "adamw"))
    elif config.select == "ngram":
        once = reference_tokens * BigramReference.FLOPS_PER_TOKEN
    # A forward pass is a third of a training step's 6N FLOPs per token (2N of them).
    scoring = scoring_flops_per_token(config.select, fpt / 3, reference_fpt / 3)
    per_step = (config.selected_batch() * config.seq_len * fpt
                + config.candidates * config.tokens_per_step() * scoring)
    return float(once), float(per_step)


def equal_flops_steps(config: TrainConfig, twin_flops: float, twin_steps: int,
                      vocab_size: int) -> int:
    """The steps a run selecting by ``config.select`` takes to spend the FLOPs of its twin,
    the same run without selection that took ``twin_steps`` steps for ``twin_flops``: its
    reference's FLOPs, then as many selected steps as the rest pays for, each costing its
    model passes (:func:`selection_flops`) and the twin's mean optimizer step (the same
    optimizer): the most steps those FLOPs pay for (at least 1)."""
    once, per_step = selection_flops(config, vocab_size)
    fpt = flops_per_token(config.model_config(vocab_size), config.seq_len)
    optimizer_step = (twin_flops - twin_steps * config.tokens_per_step() * fpt) / twin_steps
    return max(1, math.floor((twin_flops - once) / (per_step + optimizer_step)))


def _ranks(config: TrainConfig) -> tuple[int, int]:
    """(rank, world size) of a parallel run (checked), (0, 1) otherwise."""
    if config.parallel is None:
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"parallel={config.parallel!r} runs on an initialized default process "
                         "group: start the run with torchrun")
    rank, world = dist.get_rank(), dist.get_world_size()
    if config.batch_size % world:
        raise ValueError(f"the global batch of {config.batch_size} sequences does not split "
                         f"over {world} ranks")
    return rank, world


def _parallelize(model: nn.Module, parallel: Optional[str]) -> nn.Module:
    """The module to run forward: DDP's wrapper of ``model``, or ``model`` itself, sharded
    in place by FSDP2 (every decoder layer a unit, the rest, embeddings and head, the
    root's), or as it is. The optimizer takes ``model``'s parameters in every case."""
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _sum_over_ranks(*values: float, device: torch.device) -> tuple:
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64,
                         device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(total)
    return tuple(total.tolist())


def train(
    config: TrainConfig,
    make_optimizer: OptimizerFactory,
    *,
    model: Optional[nn.Module] = None,
    data: Optional[TokenDataset] = None,
    name: str = "",
    progress: Union[bool, str] = True,
    checkpoint: Optional[Callable[[dict[str, Any]], None]] = None,
    resume: Optional[dict[str, Any]] = None,
    log: Optional[Callable[[int, dict[str, float]], None]] = None,
) -> RunResult:
    """Train ``model`` (default: a fresh ``config.model`` preset seeded with ``config.seed``)
    on ``data`` (default: ``load_corpus(config.data)``) with ``make_optimizer(model, config)``.

    The run ends after ``config.steps`` steps, or at the governor's "stop" when
    ``config.flop_budget`` is set; the governor counts the model's FLOPs
    (:func:`~frugal_kernels.model.flops_per_token` per token) plus the optimizer's
    (:func:`optimizer_step_flops`), sees every validation loss, and its reallocations reach
    the optimizer's ``apply_governor`` where it is ``governable``. The optimizer's
    ``observe_loss`` (AdaFRUGAL's dynamic T; a no-op for the others) is fed every validation
    loss too; the loop reads every optimizer through :func:`~frugal_kernels.optim.protocol_of`. The model is trained in place.

    ``progress``: ``"bar"`` draws a progress bar on stderr, ``"lines"`` writes one line per
    evaluation there (for log files and CI, where a bar's carriage returns pile up), True
    picks the bar on a terminal and the lines elsewhere, False writes nothing.

    With ``config.parallel`` (see :class:`TrainConfig`) every rank runs this with the same
    config: each takes its share of every batch, the validation losses are those of the
    whole model on the same batches on every rank, the training loss and the optimizer's
    FLOPs are summed over the ranks, so that the governor and AdaFRUGAL see the same
    numbers everywhere and decide alike; memory and state bytes are this rank's, and
    only the first rank writes progress.

    ``checkpoint``, when given, is called after every evaluation with the whole state of the
    run (model, optimizer, lr schedule, governor, RNG, step, the metrics so far: what
    ``resume`` takes); ``resume``, such a state, continues that run from its step on the
    batches it would have seen, exactly as if it had not stopped. ``log(step, values)`` gets
    the scalars of every step and evaluation (``metric_logger``). Ctrl-C raises
    :class:`TrainingInterrupted` with the steps finished so far.
    """
    from tqdm.auto import tqdm

    device = torch.device(config.device)
    if data is None:
        data = load_corpus(config.data, max_bytes=config.max_bytes, noise=config.data_noise)
    check_data(data, config)
    if (checkpoint is not None or resume is not None) and config.parallel is not None:
        raise ValueError("checkpoints are written and resumed in one-process runs only")
    if model is None:
        model = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    model.to(device).train()
    rank, world = _ranks(config)
    forward = _parallelize(model, config.parallel)
    fpt = flops_per_token(model.config, config.seq_len)
    tokens = config.tokens_per_step()
    share = config.batch_size // world
    val_batches = data.validation_batches(config.batch_size, config.seq_len,
                                          num_batches=config.eval_batches, device=device)
    start = 0 if resume is None else int(resume["step"])
    # A resumed run skips the batches the first part drew (selected steps draw several).
    drawn = start if resume is None else int(resume.get("batches_drawn", start))
    batches = data.batches("train", config.batch_size, config.seq_len, seed=config.seed,
                           device=device, skip=drawn, with_noise=True)
    # Noise accounting (a noised corpus): per step, the sequences offered and kept of each kind.
    noise_kinds = NOISE_KINDS[1:] if data.noise else ()

    peak = PeakMemory(device)
    opt = make_optimizer(model, config)
    surface = protocol_of(opt)  # what the loop reads: schedule values, history, the hooks
    in_backward = handle_of(opt)
    _check_clip(config, in_backward)
    governor = None
    if config.flop_budget is not None:
        governor = Governor(config.flop_budget, flops_per_token=fpt, **config.governor)
        # Optimizers without a schedule to reallocate (AdamW) still get every decision
        # recorded; attaching them would only log that reallocations cannot change them.
        if surface.governable:
            governor.attach(opt)
    # A governor with decay_fraction starts the decay of the WSD schedule (lab/schedule.py).
    governed = governed_schedule(governor, config.warmup_steps, config.min_lr_ratio)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, governed or (lambda step: lr_factor(step, config.steps, config.warmup_steps,
                                                 config.min_lr_ratio, config.schedule,
                                                 config.cooldown_fraction)))
    flops, elapsed_before = 0.0, 0.0
    selector = reference = None
    if config.select is not None:
        from frugal_kernels.data import OnlineSelector

        reference = _reference_model(data, config, device)
        flops = selection_flops(config, data.vocab_size)[0]
        if reference is not None and resume is not None:
            reference.load_state_dict(resume["selector"]["reference"])
        selector = OnlineSelector(config.select, config.keep, config.candidates,
                                  reference=reference, seed=config.seed)
    if governor is not None and flops:
        governor.add_flops(flops)  # the reference model's training
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        schedule.load_state_dict(resume["schedule"])
        if governor is not None:
            governor.load_state_dict(resume["governor"])
        torch.set_rng_state(resume["rng"])
        flops, elapsed_before = float(resume["flops"]), float(resume["elapsed"])
        if selector is not None:
            selector.load_state_dict(resume["selector"]["state"])

    name = name or type(opt).__name__
    result = RunResult(name=name, optimizer=type(opt).__name__, config=dataclasses.asdict(config),
                       num_params=sum(p.numel() for p in model.parameters()),
                       flops_per_token=fpt, stop_reason="", wall_time=0.0, peak_memory=0,
                       peak_memory_kind=peak.kind)
    if resume is not None:
        result.steps = [dict(r) for r in resume["result"]["steps"]]
        result.evaluations = [dict(e) for e in resume["result"]["evaluations"]]
    started = time.perf_counter() - elapsed_before

    def finish(reason: str) -> RunResult:
        result.stop_reason = result.stop_reason or reason
        result.wall_time = time.perf_counter() - started
        result.peak_memory = peak.read()
        if governor is not None:
            result.decisions = governor.history
        result.optimizer_history = [dict(h) for h in surface.history]
        return result

    if progress is True:
        progress = "bar" if sys.stderr.isatty() else "lines"
    if rank != 0:
        progress = False

    # A forward pass is a third of a training step's 6N FLOPs per token (2N of them).
    scoring_fpt = 0.0 if selector is None else selector.scoring_flops_per_token(
        fpt / 3, 0.0 if not isinstance(reference, nn.Module)
        else flops_per_token(reference.config, config.seq_len) / 3)

    def _loop() -> None:
        nonlocal flops, drawn
        for step in range(start + 1, config.steps + 1):
            _synchronize(device)
            t0 = time.perf_counter()
            selecting = selector is not None and (
                governor is None or governor.select_trial is None or governor.selecting)
            scored = 0
            if selecting:
                pool = [next(batches) for _ in range(config.candidates)]
                drawn += config.candidates
                offered = torch.cat([noise for _, _, noise in pool])
                input_ids, labels, kept = selector.select(
                    forward, torch.cat([ids for ids, _, _ in pool]),
                    torch.cat([lab for _, lab, _ in pool]))
                kept_noise = offered[kept.to(offered.device)]
                scored = config.candidates * tokens
            else:
                input_ids, labels, offered = next(batches)
                kept_noise = offered
                drawn += 1
            if world > 1:  # this rank's share of the global batch
                input_ids = input_ids[rank * share:(rank + 1) * share]
                labels = labels[rank * share:(rank + 1) * share]
            loss = forward(input_ids, labels=labels).loss
            if in_backward is not None and in_backward.clip == "global" \
                    and in_backward.max_grad_norm is not None:
                # The global-norm clip of a step in backward: the norm in a first pass.
                with in_backward.norm_pass():
                    loss.backward(retain_graph=True)
            loss.backward()
            if config.grad_clip is not None and in_backward is None:
                # Ours read the gradients once and apply the factor inside the step;
                # torch's optimizers get torch's clip.
                surface.clip_grad_norm_(config.grad_clip)
            _synchronize(device)
            t_opt = time.perf_counter()
            opt.step()
            _synchronize(device)
            opt_time = time.perf_counter() - t_opt
            if in_backward is not None:
                opt_time += in_backward.step_seconds  # the updates ran inside backward
            memory = step_memory(model, opt)
            opt.zero_grad(set_to_none=True)
            lr = opt.param_groups[0]["lr"]
            schedule.step()
            opt_flops = optimizer_step_flops(opt)
            train_loss = loss.item()
            if world > 1:
                train_loss, opt_flops = _sum_over_ranks(train_loss / world, opt_flops, device=device)
            step_time = time.perf_counter() - t0

            trained = input_ids.numel() * world
            flops += trained * fpt + scored * scoring_fpt + opt_flops
            record = {"step": step, "train_loss": train_loss, "lr": float(lr),
                      "step_time": step_time, "optimizer_time": opt_time,
                      **memory, "flops": flops, "peak_memory": peak.read()}
            schedule_values = surface.training_info()
            record.update(schedule_values)
            result.steps.append(record)
            if log is not None:
                log(step, {"train/loss": train_loss, "train/lr": float(lr),
                           "time/step_seconds": step_time,
                           "memory/held_MB": memory["held_bytes"] / 2**20,
                           "memory/state_MB": memory["state_bytes"] / 2**20,
                           **{f"optimizer/{k}": v for k, v in schedule_values.items()}})
            if selector is not None:
                record["selected"] = selecting
            if noise_kinds:
                record.update({"offered": len(offered), "kept": len(kept_noise)})
                for code, kind in enumerate(noise_kinds, 1):
                    record[f"offered_{kind}"] = int((offered == code).sum())
                    record[f"kept_{kind}"] = int((kept_noise == code).sum())
            if governor is not None:
                governor.step(trained, optimizer_flops=opt_flops + scored * scoring_fpt)

            # A budget spent mid-interval ends the run at this step, evaluated, rather than
            # overshooting by up to eval_every steps.
            due = (step % config.eval_every == 0 or step == config.steps
                   or evaluation_due(governor))
            decision = None
            if due:
                val_loss = _evaluate(forward, val_batches)
                result.evaluations.append({"step": step, "val_loss": val_loss, "flops": flops,
                                           "time": time.perf_counter() - started})
                if progress == "lines":
                    print(f"{name}: step {step}/{config.steps}, train loss {train_loss:.4f}, "
                          f"val loss {val_loss:.4f}, {time.perf_counter() - started:.0f} s",
                          file=sys.stderr, flush=True)
                if log is not None:
                    log(step, {"val/loss": val_loss})
                surface.observe_loss(val_loss)
                if governor is not None:
                    decision = governor.observe(val_loss, step=step)
                    if decision.action == "decay":
                        governed.apply_now(schedule)
                    if decision.action != "continue":
                        bar.write(f"{name}: governor {decision.action} at step {step}: "
                                  f"{decision.reason}")
            postfix = {"loss": f"{train_loss:.3f}"}
            if result.evaluations:
                postfix["val"] = f"{result.evaluations[-1]['val_loss']:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if due and checkpoint is not None:
                checkpoint({"format": CHECKPOINT_FORMAT, "config": dataclasses.asdict(config),
                            "step": step, "model": model.state_dict(),
                            "optimizer": opt.state_dict(), "schedule": schedule.state_dict(),
                            "governor": None if governor is None else governor.state_dict(),
                            "rng": torch.get_rng_state(), "flops": flops,
                            "batches_drawn": drawn,
                            "selector": None if selector is None else {
                                "state": selector.state_dict(),
                                "reference": None if reference is None
                                else reference.state_dict()},
                            "elapsed": time.perf_counter() - started,
                            "result": {"steps": result.steps,
                                       "evaluations": result.evaluations}})
            if decision is not None and decision.action == "stop":
                result.stop_reason = f"governor stop at step {step}: {decision.reason}"
                return
    bar = tqdm(total=config.steps, initial=start, desc=name, unit="step",
               disable=progress != "bar", leave=True)
    try:
        with bar:
            _loop()
    except KeyboardInterrupt:
        raise TrainingInterrupted(finish(f"interrupted after step {result.steps_done} of "
                                         f"{config.steps}")) from None
    return finish(f"completed {config.steps} steps")
