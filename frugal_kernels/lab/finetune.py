"""``frugal-kernels demo --task finetune``: one pretrained base, fine-tuned by every row.

A base model is pretrained once with AdamW on the standard library's sources without its test
modules (:func:`stdlib_split`) and cached under the runs folder, named by a hash of its
settings (:func:`pretrained_base`): a change of any setting, of the base data or of the model
builds another base, and a cached base whose recorded settings differ from those asked for is
rebuilt, never reused. Every row then fine-tunes a copy of that base on another domain: the
standard library's test modules, which the base never saw, or the user's ``--data``. Beside the
demo's columns, the task reports each row's forgetting: the fine-tuned model's loss on the
base's own validation data, against the base's before fine-tuning.

The rows are the demo's (:data:`frugal_kernels.lab.registry.OPTIMIZERS`; DQT quantizes the
base, then fine-tunes it), LoRA through ``peft`` where installed (:func:`lora_rank`), and governed
twins of AdamW and FRUGAL whose governor starts the warmup-stable-decay schedule's decay
(:mod:`frugal_kernels.lab.schedule`): their budget is their ungoverned twin's FLOPs, and the
twin decays at ``1 / (1 + DECAY_FRACTION)`` of its steps, where a governed run that never
plateaus decays too.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from frugal_kernels.lab import demo
from frugal_kernels.lab.corpus import Document, TokenDataset, load_corpus, stdlib_documents
from frugal_kernels.lab.corpus import _read_capped
from frugal_kernels.lab.demo import DemoOptimizer
from frugal_kernels.lab.peers import missing
from frugal_kernels.lab.schedule import twin_cooldown_fraction
from frugal_kernels.lab.train import RunResult, TrainConfig, _evaluate, lr_groups, train
from frugal_kernels.model import LlamaForCausalLM

__all__ = ["BASE_STEPS", "DECAY_FRACTION", "DEFAULTS", "DEFAULT_RUNS", "ROWS",
           "base_settings", "finetune_data", "finetune_setup", "is_test_module", "lora_rank", "pretrained_base",
           "run_finetune", "stdlib_split", "table"]

logger = logging.getLogger(__name__)

# The governed rows' decay, as a fraction of the FLOPs before it: every row's WSD schedule
# decays over the last 0.25 / 1.25 = 20% of its steps, as the demo's does.
DECAY_FRACTION = 0.25

# Steps of the base's pretraining (AdamW at the demo's tuned lrs for the preset): twice the
# demo's run, so that the base has learnt the language before it is fine-tuned.
BASE_STEPS = 400

# The fine-tuning runs: the demo's shape, evaluated every 10 steps on 8 batches so that the
# governor (a window of 5 evaluations, a patience of 3) can decide within the first half of
# the run; every row at one lr, below the pretraining peak, where no fine-tuning sweep
# recorded its own in tuned.json.
DEFAULTS = TrainConfig(lr=1e-3, matrix_lr_ratio=1.0, warmup_steps=10, eval_every=10,
                       eval_batches=8, cooldown_fraction=twin_cooldown_fraction(DECAY_FRACTION))

# Folder names and file names of the standard library's test modules.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_NEVER_READ = frozenset({"site-packages", "dist-packages", "__pycache__"})


def is_test_module(name: str) -> bool:
    """Whether the relative path ``name`` of a standard-library file is a test module: it lies
    under a ``test``, ``tests`` or ``idle_test`` folder, or is named ``test_*.py``."""
    *folders, file = name.split("/")
    return any(f in _TEST_DIRS for f in folders) or file.startswith("test_")


def stdlib_split(max_bytes: Optional[int], domain_bytes: Optional[int] = None
                 ) -> tuple[list[Document], list[Document]]:
    """The standard library's ``*.py`` files in two parts with no file in both: the base's
    (no test module) and the fine-tuning domain (the test modules), each sorted by path and
    read up to ``max_bytes`` (the domain up to ``domain_bytes`` where that is smaller)."""
    base = [doc for doc in stdlib_documents(max_bytes) if not is_test_module(doc.name)]
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NEVER_READ]
        for name in filenames:
            path = Path(dirpath, name)
            if name.endswith(".py") and is_test_module(path.relative_to(root).as_posix()):
                files.append(path)
    files.sort(key=lambda path: path.relative_to(root).as_posix())
    return base, _read_capped(root, files, _smaller(max_bytes, domain_bytes))


def _smaller(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """The smaller of two byte caps, None meaning no cap."""
    return b if a is None else a if b is None else min(a, b)


def finetune_data(config: TrainConfig) -> tuple[TokenDataset, TokenDataset]:
    """(the base's data, the fine-tuning data): the standard library without and with only its
    test modules, or, with ``config.data``, the user's files for the fine-tuning; the latter
    read up to ``config.finetune_bytes`` where that is below ``config.max_bytes`` (a small
    domain set, trained on for several epochs, where the validation loss plateaus)."""
    base_documents, test_documents = stdlib_split(config.max_bytes, config.finetune_bytes)
    base = TokenDataset(base_documents, seed=config.seed, source="stdlib without tests")
    if config.data is not None:
        return base, load_corpus(config.data, seed=config.seed,
                                 max_bytes=_smaller(config.max_bytes, config.finetune_bytes))
    return base, TokenDataset(test_documents, seed=config.seed, source="stdlib tests")


def base_settings(config: TrainConfig, base_steps: int = BASE_STEPS) -> TrainConfig:
    """The base's pretraining run: ``config``'s model, shape, evaluation batches and seed for
    ``base_steps`` steps at AdamW's tuned lrs for the preset (the demo's schedule
    otherwise)."""
    pretrain = dataclasses.replace(demo.DEFAULTS, model=config.model, batch_size=config.batch_size,
                                   seq_len=config.seq_len, eval_batches=config.eval_batches,
                                   seed=config.seed, device=config.device, data=None,
                                   max_bytes=config.max_bytes)
    return demo.run_config(pretrain, "adamw").with_steps(base_steps)


def _identity(settings: TrainConfig, base_data: TokenDataset) -> dict[str, Any]:
    """What the base depends on: every setting of its run but the device, and its data."""
    config = dataclasses.asdict(settings)
    del config["device"]
    return {"config": config, "optimizer": "adamw", "data_digest": base_data.digest,
            "torch": torch.__version__.split("+")[0]}


def pretrained_base(settings: TrainConfig, base_data: TokenDataset, cache: Path, *,
                    rebuild: bool = False, progress: bool | str = True
                    ) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """The base model pretrained with ``settings`` on ``base_data``: loaded from
    ``cache/<hash of the settings>/`` when it was built there with the same settings, else
    (or with ``rebuild``) pretrained and saved there. Returns it with a record of where it
    lies, its hash, whether it was built now and its validation loss."""
    identity = _identity(settings, base_data)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache) / digest
    weights, recorded = folder / "model.pt", folder / "settings.json"
    model = LlamaForCausalLM(settings.model_config(base_data.vocab_size), seed=settings.seed)
    built = rebuild or not (weights.exists() and recorded.exists())
    if not built and json.loads(recorded.read_text()) != identity:
        # The same hash for other settings: a collision or an edited file. Never reuse it.
        logger.warning("the base cached in %s was built with other settings; rebuilding it",
                       folder)
        built = True
    if built:
        result = train(settings, demo.OPTIMIZERS["adamw"].make, model=model, data=base_data,
                       name="base (AdamW)", progress=progress)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), weights)
        recorded.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
        base_loss = result.final_val_loss
    else:
        model.load_state_dict(torch.load(weights, weights_only=True))
        base_loss = None
    model.to("cpu")
    return model, {"path": str(folder), "hash": digest, "built": built,
                   "steps": settings.steps, "val_loss": base_loss}


# The Linear layers LoRA adapts: those FRUGAL projects (the attention and MLP matrices).
_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_rank(model: nn.Module, density: float = 0.25) -> int:
    """The LoRA rank whose adapters hold as many trainable values as FRUGAL's state-full
    subspace at ``density`` over the same matrices: ``r * (in + out)`` summed over them equals
    ``density * in * out`` summed (AdamW moments on both; 20 on the small preset, 10 on
    tiny). LoRA freezes the embeddings, norms and head, which FRUGAL trains with AdamW, so
    its state is the smaller."""
    numel = sides = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in _LORA_TARGETS:
            numel += module.in_features * module.out_features
            sides += module.in_features + module.out_features
    return max(1, round(density * numel / sides))


def _lora(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """LoRA adapters (``peft``) on the attention and MLP matrices of the base, everything else
    frozen, AdamW on the adapters. ``lora_alpha = 2 r`` (the scale 2 of common recipes)."""
    from peft import LoraConfig, inject_adapter_in_model

    rank = lora_rank(model)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                       target_modules=_LORA_TARGETS), model)
    fused = True if torch.device(config.device).type in ("cpu", "cuda") else None
    return torch.optim.AdamW(lr_groups(model, config), lr=config.lr,
                             weight_decay=config.weight_decay, fused=fused)


def _governed(source: str, label: str, color: str) -> DemoOptimizer:
    """The ``source`` row under the governor, which starts its WSD decay."""
    entry = demo.OPTIMIZERS[source]
    return DemoOptimizer(label, color, entry.make, budget_from=source,
                         governor={"decay_fraction": DECAY_FRACTION})


ROWS: dict[str, DemoOptimizer] = {
    **{name: demo.OPTIMIZERS[name] for name in (
        "adamw", "frugal", "adafrugal", "badam", "badam+frugal", "dqt4", "frugal+inbwd",
        "galore")},
    "lora": DemoOptimizer("LoRA (peft) rank for rho=0.25", "goldenrod", _lora,
                          requires=("peft", "peft")),
    "adamw+governor": _governed("adamw", "AdamW+governor (decay)", "dimgray"),
    "frugal+governor": _governed("frugal", "FRUGAL+governor (decay)", "navy"),
}

DEFAULT_RUNS = tuple(ROWS)


def _resolve(names: Sequence[str]) -> list[str]:
    """``names`` in order, each governed row after its twin, rows whose package is missing
    skipped with a notice (as the demo's)."""
    ordered: list[str] = []
    for name in names:
        if name not in ROWS:
            raise ValueError(f"unknown fine-tuning row {name!r}; choose from {', '.join(ROWS)}")
        source = ROWS[name].budget_from
        for needed in ([source] if source else []) + [name]:
            if needed not in ordered:
                ordered.append(needed)
    kept = []
    for name in ordered:
        reason = missing(ROWS[name].requires)
        if reason is None:
            kept.append(name)
        else:
            print(f"skipping {name}: {reason}", flush=True)
    return kept


def finetune_setup(config: TrainConfig, base_steps: int = BASE_STEPS,
                   cache: Optional[Path] = None, rebuild_base: bool = False,
                   progress: bool | str = True
                   ) -> tuple[LlamaForCausalLM, dict[str, Any], TokenDataset, TokenDataset]:
    """What every fine-tuning run starts from: ``(base, its record, the base's data, the
    fine-tuning data)``, the base pretrained or loaded from ``cache`` (default
    ``runs/finetune-base``)."""
    cache = Path(cache) if cache is not None else Path("runs") / "finetune-base"
    base_data, data = finetune_data(config)
    base, record = pretrained_base(base_settings(config, base_steps), base_data,
                                   cache, rebuild=rebuild_base, progress=progress)
    return base, record, base_data, data


def run_finetune(config: TrainConfig = DEFAULTS, names: Sequence[str] = DEFAULT_RUNS,
                 out: Optional[Path] = None, progress: bool | str = True, *,
                 base_steps: int = BASE_STEPS, cache: Optional[Path] = None,
                 rebuild_base: bool = False, tuned: bool = True) -> dict[str, Any]:
    """Fine-tune one copy of the cached base per row in ``names`` on the fine-tuning domain;
    write ``metrics.json``, ``table.md``, ``table.csv`` and ``finetune.png`` into ``out``
    (default ``runs/finetune-<time>``). The base lies under ``cache`` (default
    ``runs/finetune-base``). With ``tuned``, each row runs at the lr and matrix lr ratio a
    fine-tuning sweep recorded for it in ``tuned.json`` (:func:`~frugal_kernels.lab.registry.
    run_config`), else, and without ``tuned``, at ``config.lr`` and ``config.matrix_lr_ratio``.

    Returns the metrics with ``"out"`` and ``"files"`` added; ``metrics["base"]`` describes
    the base and every run carries ``"forgetting"``: its loss on the base's validation data.
    """
    names = _resolve(names)
    out = Path(out) if out is not None else Path("runs") / time.strftime("finetune-%Y%m%d-%H%M%S")
    base, record, base_data, data = finetune_setup(config, base_steps, cache, rebuild_base,
                                                   progress)
    device = torch.device(config.device)
    base_val = base_data.validation_batches(config.batch_size, config.seq_len,
                                            num_batches=config.eval_batches, device=device)
    val = data.validation_batches(config.batch_size, config.seq_len,
                                  num_batches=config.eval_batches, device=device)
    base.to(device)
    record["own_domain_loss"] = _evaluate(base, base_val)
    record["finetune_domain_loss"] = _evaluate(base, val)
    started = time.perf_counter()
    results: dict[str, RunResult] = {}
    forgetting: dict[str, float] = {}
    records = ({name: demo.tuned_for(config, name, ROWS, "finetune") for name in names}
               if tuned else {})
    for name in names:
        entry = ROWS[name]
        named_config = demo.run_config(config, name, tuned, ROWS, "finetune")
        if entry.budget_from is not None:
            named_config = dataclasses.replace(named_config,
                                               flop_budget=results[entry.budget_from].flops,
                                               governor=dict(entry.governor))
        model = copy.deepcopy(base)
        results[name] = train(named_config, entry.make, model=model, data=data,
                              name=entry.label, progress=progress)
        forgetting[name] = _evaluate(model, base_val)
    metrics = demo.collect_metrics(config, data, results, time.perf_counter() - started,
                                   tuned=records, rows=ROWS)
    metrics["task"] = "finetune"
    metrics["base"] = {**record, "data": {"source": base_data.source, "digest": base_data.digest,
                                          "train_tokens": len(base_data.train)}}
    for name, run in metrics["runs"].items():
        run["forgetting"] = forgetting[name]
    files = demo.write(metrics, out, "finetune")
    # table.md with the forgetting and the governors' savings (demo.write wrote the demo's).
    (out / "table.md").write_text(table(metrics) + "\n")
    return {**metrics, "out": str(out), "files": files}


def table(metrics: dict[str, Any]) -> str:
    """The demo's table of the runs, then each row's forgetting and each governed row's
    savings against its twin."""
    base = metrics["base"]
    lines = [demo.table(metrics), "",
             f"Forgetting: the loss on the base's own domain ({base['data']['source']}, "
             f"validation) after fine-tuning; the base before it: "
             f"{base['own_domain_loss']:.4f} (and {base['finetune_domain_loss']:.4f} on the "
             f"fine-tuning domain).", "",
             "| row | fine-tuning loss | own-domain loss | vs the base |",
             "|---|---|---|---|"]
    for run in metrics["runs"].values():
        lines.append(f"| {run['label']} | {run['summary']['final_val_loss']:.4f} | "
                     f"{run['forgetting']:.4f} | "
                     f"{run['forgetting'] / base['own_domain_loss'] - 1:+.2%} |")
    governed = [run for run in metrics["runs"].values() if run["budget_from"] is not None]
    if governed:
        lines += ["", "| governed row | FLOPs vs its twin | loss vs its twin | decay at step "
                      "| stopped at step |", "|---|---|---|---|---|"]
        for run in governed:
            twin = metrics["runs"][run["budget_from"]]["summary"]
            s = run["summary"]
            at = {d["action"]: d["step"] for d in run["decisions"]}
            lines.append(f"| {run['label']} | {s['flops'] / twin['flops']:.1%} | "
                         f"{s['final_val_loss'] / twin['final_val_loss'] - 1:+.2%} | "
                         f"{at.get('decay', '-')} | {at.get('stop', '-')} |")
    return "\n".join(lines)
