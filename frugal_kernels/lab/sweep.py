"""``frugal-kernels sweep``: the demo's training over a grid of learning rates, matrix lr
ratios and seeds.

Every setting is one of the demo's runs (:func:`frugal_kernels.lab.train.train` with the row's
optimizer), from the seed's initialisation and batches: with ``task="pretrain"`` a fresh model
(the rows of :data:`frugal_kernels.lab.registry.OPTIMIZERS`), with ``task="finetune"`` a copy
of the fine-tuning task's one pretrained base (:func:`frugal_kernels.lab.finetune.finetune_setup`,
the rows of :data:`frugal_kernels.lab.finetune.ROWS`), the seed then drawing the fine-tuning
batches and the optimizer's own randomness. The sweep writes ``sweep.json`` (every run, the
best setting per optimizer), ``sweep.md`` and ``sweep.csv`` after every run; with ``tuned``
it records the best settings for the task in a ``tuned.json`` (:mod:`frugal_kernels.lab.tuned`),
the file the demo and ``train`` read their learning rates from.

The best setting of an optimizer is the (lr, ratio) with the lowest mean final validation loss
over the seeds; its ``spread`` is the seeds' range (max - min) there.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from frugal_kernels.lab import demo, finetune
from frugal_kernels.lab import tuned as tuned_lrs
from frugal_kernels.lab.corpus import TokenDataset
from frugal_kernels.lab.train import TrainConfig, train

__all__ = ["MATRIX_LR_RATIOS", "best_settings", "default_rows", "rows_of", "run_sweep", "table"]

# The matrices' lr over the lr: the shared lr, GaLore's recipe (0.25) and a quarter of that.
MATRIX_LR_RATIOS = (1.0, 0.25, 0.0625)

# Default rows left out of a default sweep: the frugal row's optimizer stepped in backward,
# which differs from that row only by rounding and takes its tuning.
_SAME_AS_ANOTHER = ("frugal+inbwd",)


def rows_of(task: str) -> dict[str, demo.DemoOptimizer]:
    """The rows of ``task``: the demo's for ``"pretrain"``, the fine-tuning task's for
    ``"finetune"``."""
    tuned_lrs._check_task(task)
    return finetune.ROWS if task == "finetune" else demo.OPTIMIZERS


def default_rows(task: str = "pretrain") -> list[str]:
    """What a sweep runs unless told: the task's default rows but the governed ones (they
    take their budget source's tuning) and those that run another row's optimizer another
    way."""
    defaults = finetune.DEFAULT_RUNS if task == "finetune" else demo.DEFAULT_RUNS
    rows = rows_of(task)
    return [name for name in defaults
            if rows[name].budget_from is None and name not in _SAME_AS_ANOTHER]


def _unique(values: Sequence, option: str) -> list:
    """``values`` in order without repeats; a repeat is dropped with a notice on stderr (a
    seed run twice would make a seed-to-seed spread of 0)."""
    kept = list(dict.fromkeys(values))
    if len(kept) < len(values):
        repeated = sorted({v for v in values if list(values).count(v) > 1})
        print(f"{option}: {', '.join(map(str, repeated))} given more than once; running "
              f"{' '.join(map(str, kept))}", file=sys.stderr)
    return kept


def run_sweep(config: TrainConfig, names: Optional[Sequence[str]], lrs: Sequence[float],
              ratios: Sequence[float] = MATRIX_LR_RATIOS, seeds: Sequence[int] = (0, 1),
              out: Optional[Path] = None, progress: bool | str = False,
              tuned: Optional[Path] = None, data: Optional[TokenDataset] = None,
              overwrite: bool = False, task: str = "pretrain",
              base_steps: int = finetune.BASE_STEPS, cache: Optional[Path] = None,
              rebuild_base: bool = False) -> dict[str, Any]:
    """Train ``config`` once per row of ``task`` in ``names`` (default :func:`default_rows`;
    those installed), lr in ``lrs``, matrix lr ratio in ``ratios`` and seed in ``seeds``
    (repeats dropped, with a notice); write the results into ``out`` (default
    ``runs/sweep-<time>``; see :func:`~frugal_kernels.lab.output.output_folder`) after every
    run and, with ``tuned``, record the best settings for ``task`` there at the end. A line
    before each run says which of how many it is, the time so far and an estimate of the
    rest.

    Pretraining runs on ``data`` (default ``load_corpus(config.data)``). Fine-tuning runs
    start from the base of ``finetune_setup(config, base_steps, cache, rebuild_base)``,
    pretrained once (or found in ``cache``) at ``config.seed`` for every seed of the sweep,
    and fine-tune on its data (``config.data`` replaces the domain); ``data`` is not taken.

    Returns what ``sweep.json`` holds, with ``"out"`` and ``"files"`` added. Ctrl-C writes
    the finished runs (not ``tuned``) and raises :class:`~frugal_kernels.lab.demo.Interrupted`.
    """
    rows = rows_of(task)
    names = default_rows(task) if names is None else names
    for name in names:
        if name not in rows:
            raise ValueError(f"unknown optimizer {name!r} for --task {task}; choose from "
                             f"{', '.join(rows)}")
        if rows[name].budget_from is not None:
            raise ValueError(f"{name!r} is a governed run; sweep "
                             f"{rows[name].budget_from!r}, whose tuning it takes")
    if task == "finetune" and data is not None:
        raise ValueError("a fine-tuning sweep takes its data from the task (config.data "
                         "replaces the domain), not from data")
    names = demo.available(_unique(names, "--optimizers"), rows)
    lrs, ratios = _unique(lrs, "--lrs"), _unique(ratios, "--matrix-lr-ratios")
    seeds = _unique(seeds, "--seeds")
    out = demo.run_folder(out, "sweep", overwrite, progress)
    settings: dict[str, Any] = {"task": task, "config": dataclasses.asdict(config),
                                "lrs": list(lrs), "matrix_lr_ratios": list(ratios),
                                "seeds": list(seeds), "command": " ".join(sys.argv)}
    base = None
    if task == "finetune":
        base, record, _, data = finetune.finetune_setup(config, base_steps, cache,
                                                        rebuild_base, progress)
        demo.checked_data(config, data)
        settings["base"] = {"steps": base_steps, "hash": record["hash"]}
    else:
        data = demo.checked_data(config, data)
    started = time.perf_counter()
    from frugal_kernels.bench.fingerprint import fingerprint

    grid = [(name, ratio, lr, seed) for name in names for ratio in ratios for lr in lrs
            for seed in seeds]
    runs: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    files: list[Path] = []
    for k, (name, ratio, lr, seed) in enumerate(grid, 1):
        entry = rows[name]
        label = f"{name} lr {lr:g} x{ratio:g} seed {seed}"
        if progress:
            print(demo.overall_progress(k, len(grid), label, time.perf_counter() - started,
                                        sum(r["wall_time"] for r in runs),
                                        sum(r["steps"] for r in runs),
                                        (len(grid) - k + 1) * config.steps),
                  file=sys.stderr, flush=True)
        run_config = dataclasses.replace(config, lr=lr, matrix_lr_ratio=ratio, seed=seed)
        if name in demo.OPTIMIZERS:
            run_config = demo.row_config(run_config, name)  # a +select row selects
        model = copy.deepcopy(base) if base is not None else None
        try:
            result = train(run_config, entry.make, model=model, data=data, name=label,
                           progress=progress)
        except KeyboardInterrupt:
            kept = (f"wrote the {len(runs)} finished runs to {out}" if runs
                    else "no run had finished, nothing written")
            raise demo.Interrupted(f"interrupted during run {k} of {len(grid)} ({label}); "
                                   f"{kept}") from None
        runs.append({"optimizer": name, "label": entry.label, "lr": lr,
                     "matrix_lr_ratio": ratio, "seed": seed, **result.summary()})
        metrics = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "wall_time": time.perf_counter() - started,
                   "fingerprint": fingerprint(torch.device(config.device)),
                   "settings": settings, "planned": len(grid), "runs": runs,
                   "best": best_settings(runs)}
        files = _write(metrics, out)
    if tuned is not None:
        tuned_lrs.update(tuned, config.model, settings, metrics["best"], task=task)
        files.append(Path(tuned))
    return {**metrics, "out": str(out), "files": [str(f) for f in files]}


def _write(metrics: dict[str, Any], out: Path) -> list[Path]:
    """``sweep.json``, ``sweep.md`` and ``sweep.csv`` of the runs so far."""
    files = [out / "sweep.json", out / "sweep.md", out / "sweep.csv"]
    files[0].write_text(json.dumps(metrics, indent=1))
    files[1].write_text(table(metrics) + "\n")
    columns = ["optimizer", "lr", "matrix_lr_ratio", "seed", "final_val_loss", "held_bytes",
               "state_bytes", "step_time", "wall_time"]
    with open(files[2], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([run[c] for c in columns] for run in metrics["runs"])
    return files


def _cells(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, float, float], list[float]]:
    """Final validation losses per (optimizer, lr, ratio), one per seed, in run order."""
    cells: dict[tuple[str, float, float], list[float]] = {}
    for run in runs:
        key = (run["optimizer"], run["lr"], run["matrix_lr_ratio"])
        cells.setdefault(key, []).append(run["final_val_loss"])
    return cells


def best_settings(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per optimizer, the (lr, ratio) of lowest mean loss over the seeds, with that mean, the
    seeds' range there (``spread``) and the number of seeds. Settings that diverged (a
    non-finite loss on any seed) are never best; an optimizer with no finite setting is left
    out."""
    best: dict[str, dict[str, Any]] = {}
    for (name, lr, ratio), losses in _cells(runs).items():
        if not all(math.isfinite(v) for v in losses):
            continue
        mean = statistics.fmean(losses)
        if name not in best or mean < best[name]["val_loss"]:
            best[name] = {"lr": lr, "matrix_lr_ratio": ratio, "val_loss": mean,
                          "spread": max(losses) - min(losses), "seeds": len(losses)}
    return best


def table(metrics: dict[str, Any]) -> str:
    """The sweep as markdown: per optimizer, one line per matrix lr ratio with the mean loss at
    every lr (the seeds' range in parentheses, with two seeds or more; the best setting in
    bold), and on its first line the best setting and the spread there."""
    settings = metrics["settings"]
    cells = _cells(metrics["runs"])
    header = ["optimizer", "matrices", *(f"lr {lr:g}" for lr in settings["lrs"]),
              "best lr (matrices)", "seed spread"]
    labels = {run["optimizer"]: run["label"] for run in metrics["runs"]}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, label in labels.items():
        chosen = metrics["best"].get(name)
        for i, ratio in enumerate(settings["matrix_lr_ratios"]):
            row = [label if i == 0 else "", f"x{ratio:g}"]
            for lr in settings["lrs"]:
                losses = cells.get((name, lr, ratio))
                if losses is None:
                    row.append("–")
                    continue
                text = f"{statistics.fmean(losses):.4f}"
                if len(losses) > 1:  # one seed has no range (not one of 0)
                    text += f" ({max(losses) - min(losses):.4f})"
                if chosen and (chosen["lr"], chosen["matrix_lr_ratio"]) == (lr, ratio):
                    text = f"**{text}**"
                row.append(text)
            if i > 0:
                row += ["", ""]
            elif chosen is None:
                row += ["diverged", "–"]
            else:
                spread = (f"{chosen['spread']:.4f} ({chosen['spread'] / chosen['val_loss']:.2%})"
                          if chosen["seeds"] > 1 else "– (one seed)")
                row += [f"{chosen['lr']:g} ({chosen['lr'] * chosen['matrix_lr_ratio']:.3g})",
                        spread]
            lines.append("| " + " | ".join(row) + " |")
    c = settings["config"]
    task = settings.get("task", "pretrain")
    what = (f"fine-tuning the base of {settings['base']['steps']} steps" if task == "finetune"
            else "pretraining")
    seeds = settings["seeds"]
    lines.append(f"\nMean final validation loss over seeds {', '.join(map(str, seeds))}"
                 + (" (their range in parentheses)" if len(seeds) > 1 else "")
                 + "; matrices: their lr as a multiple of the lr; "
                 f"{what}, {c['model']} model, {c['steps']} steps of "
                 f"{c['batch_size']}x{c['seq_len']} bytes, {c['schedule']} schedule; "
                 f"{metrics['wall_time']:.0f} s in all.")
    planned = metrics.get("planned", len(metrics["runs"]))
    if len(metrics["runs"]) < planned:
        lines.append(f"{len(metrics['runs'])} of {planned} runs finished.")
    return "\n".join(lines)
