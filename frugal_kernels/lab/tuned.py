"""The learning rates the demo uses: the best of a sweep, per task, model preset and optimizer.

``frugal_kernels/lab/tuned.json`` ships with the package; ``frugal-kernels sweep --write-tuned``
records its best settings there (or in the file it is given). Its layout::

    {"tasks": {"pretrain": {"small": {"settings": {...the sweep's TrainConfig, lrs, ratios,
                                                   seeds, command...},
                                      "optimizers": {"adamw": {"lr": 0.003,
                                                               "matrix_lr_ratio": 0.25,
                                                               "val_loss": 1.87,
                                                               "spread": 0.02,
                                                               "seeds": 2}, ...}}},
               "finetune": {"small": {...the same, "settings" adding "base"...}}}}

Each optimizer's entry is its best (lr, matrix lr ratio) in the sweep: ``val_loss`` is the
mean over the seeds there and ``spread`` the seeds' range (max - min) there, which the demo's
verdict compares differences with. A fine-tuning sweep's settings add ``base`` (the steps and
hash of the pretrained base every run started from).

Files written before tasks and ratios were recorded still load: a top-level ``"presets"`` is
the pretraining task's, and an entry without ``matrix_lr_ratio`` had the matrices at
:data:`LEGACY_MATRIX_LR_RATIO` of the lr, the split every sweep of that time ran with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["LEGACY_MATRIX_LR_RATIO", "PATH", "TASKS", "comparable", "load", "lookup", "update"]

PATH = Path(__file__).with_name("tuned.json")

TASKS = ("pretrain", "finetune")

LEGACY_MATRIX_LR_RATIO = 0.25


def load(path: Optional[Path] = None) -> dict[str, Any]:
    """The recorded sweeps in ``path`` (default :data:`PATH`), as ``{"tasks": {task: {preset:
    record}}}`` whatever layout the file has; empty when the file does not exist."""
    path = Path(path if path is not None else PATH)
    if not path.exists():
        return {"tasks": {}}
    recorded = json.loads(path.read_text())
    if "tasks" not in recorded:  # the layout of one task, pretraining
        recorded = {"tasks": {"pretrain": recorded.get("presets", {})}}
    for presets in recorded["tasks"].values():
        for record in presets.values():
            for entry in record["optimizers"].values():
                entry.setdefault("matrix_lr_ratio", LEGACY_MATRIX_LR_RATIO)
    return recorded


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def lookup(preset: str, name: str, path: Optional[Path] = None,
           task: str = "pretrain") -> Optional[dict[str, Any]]:
    """The best setting recorded for optimizer ``name`` on model ``preset`` in ``task``, with
    the sweep's settings under ``"settings"``; None when that was never swept."""
    _check_task(task)
    recorded = load(path)["tasks"].get(task, {}).get(preset)
    if recorded is None or name not in recorded["optimizers"]:
        return None
    return {**recorded["optimizers"][name], "settings": recorded["settings"]}


def update(path: Path, preset: str, settings: dict[str, Any],
           best: dict[str, dict[str, Any]], task: str = "pretrain") -> None:
    """Record ``best`` (per optimizer) for ``preset`` in ``task`` in ``path``, in the layout
    above (a file of the older layout is rewritten in it, its records kept).

    Optimizers swept before under the same settings keep their entries; a sweep under other
    settings (or, fine-tuning, from another base) replaces the preset's record, so that every
    entry of a preset shares one setting and one spread can be compared with another.
    """
    _check_task(task)
    recorded = load(path)
    presets = recorded["tasks"].setdefault(task, {})
    previous = presets.get(preset)
    optimizers = {}
    if previous is not None and comparable(previous["settings"]["config"], settings["config"]) \
            and previous["settings"].get("base", {}).get("hash") \
            == settings.get("base", {}).get("hash"):
        optimizers = previous["optimizers"]
    presets[preset] = {"settings": settings, "optimizers": {**optimizers, **best}}
    Path(path).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


# The settings that change what a learning rate does; the lrs themselves, the seeds and the
# command line differ between sweeps that may share a record.
_SHAPE = ("model", "steps", "batch_size", "seq_len", "warmup_steps", "schedule", "min_lr_ratio",
          "cooldown_fraction", "grad_clip", "weight_decay", "data", "max_bytes")


def comparable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two TrainConfigs (as dicts) train the same shape of run, lrs and seed aside."""
    return all(a.get(k) == b.get(k) for k in _SHAPE)
