"""The learning rates the demo uses: the best of a sweep, per model preset and optimizer.

``frugal_kernels/lab/tuned.json`` ships with the package; ``frugal-kernels sweep --write-tuned``
records its best settings there (or in the file it is given). Its layout::

    {"presets": {"small": {"settings": {...the sweep's TrainConfig, seeds, command...},
                           "optimizers": {"adamw": {"lr": 0.01, "matrix_lr_ratio": 0.25,
                                                    "val_loss": 1.97, "spread": 0.004,
                                                    "seeds": 2}, ...}}}}

``val_loss`` is the mean over the seeds at the best setting and ``spread`` the seeds' range
(max - min) there: the demo's verdict compares differences with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["PATH", "comparable", "load", "lookup", "update"]

PATH = Path(__file__).with_name("tuned.json")


def load(path: Optional[Path] = None) -> dict[str, Any]:
    """The recorded sweeps in ``path`` (default :data:`PATH`); empty when the file does not
    exist."""
    path = Path(path if path is not None else PATH)
    if not path.exists():
        return {"presets": {}}
    return json.loads(path.read_text())


def lookup(preset: str, name: str, path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The best setting recorded for optimizer ``name`` on model ``preset``, with the sweep's
    settings under ``"settings"``; None when that pair was never swept."""
    recorded = load(path)["presets"].get(preset)
    if recorded is None or name not in recorded["optimizers"]:
        return None
    return {**recorded["optimizers"][name], "settings": recorded["settings"]}


def update(path: Path, preset: str, settings: dict[str, Any],
           best: dict[str, dict[str, Any]]) -> None:
    """Record ``best`` (per optimizer) for ``preset`` in ``path``.

    Optimizers swept before under the same settings keep their entries; a sweep under other
    settings replaces the preset's record, so that every entry of a preset shares one setting
    and one spread can be compared with another.
    """
    recorded = load(path)
    previous = recorded["presets"].get(preset)
    optimizers = {}
    if previous is not None and comparable(previous["settings"]["config"], settings["config"]):
        optimizers = previous["optimizers"]
    recorded["presets"][preset] = {"settings": settings, "optimizers": {**optimizers, **best}}
    Path(path).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


# The settings that change what a learning rate does; the lrs themselves, the seeds and the
# command line differ between sweeps that may share a record.
_SHAPE = ("model", "steps", "batch_size", "seq_len", "warmup_steps", "schedule", "min_lr_ratio",
          "cooldown_fraction", "grad_clip", "weight_decay", "data", "max_bytes")


def comparable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two TrainConfigs (as dicts) train the same shape of run, lrs and seed aside."""
    return all(a.get(k) == b.get(k) for k in _SHAPE)
